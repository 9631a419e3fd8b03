package spend_test

import (
	"math"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

func TestCost(t *testing.T) {
	deepseek := spend.Price{Input: 270_000, Output: 1_100_000, CachedInput: 70_000, HasCachedInput: true}
	gpt := spend.Price{Input: 2_500_000, Output: 10_000_000}
	reasoner := spend.Price{Input: 550_000, Output: 2_190_000, Reasoning: 5_000_000, HasReasoning: true}
	whisper := spend.Price{PerSecond: 100}
	images := spend.Price{Input: 5_000_000, PerImage: 40_000, PerRequest: 1_000}
	tests := []struct {
		name  string
		price spend.Price
		tok   spend.Tokens
		want  spend.Micros
	}{
		{"prompt and completion", gpt, spend.Tokens{Prompt: 1000, Completion: 500}, 2_500 + 5_000},
		// 600 × 0.27 + 400 × 0.07 + 500 × 1.10 = 162 + 28 + 550 micro-units.
		{"cached prompt tokens at the cached price", deepseek, spend.Tokens{Prompt: 1000, Cached: 400, Completion: 500}, 740},
		{"cached tokens without a cached price cost input", gpt, spend.Tokens{Prompt: 1000, Cached: 400}, 2_500},
		// 100 × 2.19 + 300 × 5 = 219 + 1500.
		{"reasoning at its own price", reasoner, spend.Tokens{Completion: 400, Reasoning: 300}, 1_719},
		{"reasoning billed as output without a price", gpt, spend.Tokens{Completion: 400, Reasoning: 300}, 4_000},
		// 1 × 0.27 micro-units rounds up to 1: never charged less than it cost.
		{"one token rounds up to a micro-unit", deepseek, spend.Tokens{Prompt: 1}, 1},
		// 3 × 0.27 + 1 × 0.07 = 0.88 → 1: parts are summed before the one rounding.
		{"rounded once after summing", deepseek, spend.Tokens{Prompt: 4, Cached: 1}, 1},
		{"exact micro-units stay exact", deepseek, spend.Tokens{Prompt: 100}, 27},
		{"nothing costs nothing", gpt, spend.Tokens{}, 0},
		{"negative counts are zero", gpt, spend.Tokens{Prompt: -5, Completion: -1}, 0},
		{"cached above prompt is all of it", deepseek, spend.Tokens{Prompt: 100, Cached: 1000}, 7},
		{"saturates instead of overflowing", spend.Price{Input: money.MaxAmount}, spend.Tokens{Prompt: math.MaxInt64}, math.MaxInt64},
		{"large but exact", spend.Price{Input: money.MaxAmount}, spend.Tokens{Prompt: 1_000_000}, money.MaxAmount},
		// $0.006 a minute is 100 micro-units a second: 9.215 s cost 921.5 → 922.
		{"audio by the second, rounded up once", whisper, spend.Tokens{AudioMillis: 9_215}, 922},
		{"audio seconds without a price per second cost nothing", gpt, spend.Tokens{AudioMillis: 60_000}, 0},
		// 2 images at $0.04 and the request's own $0.001, plus 10 prompt tokens at $5 per million.
		{"per image and per request", images, spend.Tokens{Prompt: 10, Requests: 1, Images: 2}, 80_000 + 1_000 + 50},
		{"tokens and seconds add up", spend.Price{Input: 2_500_000, PerSecond: 100}, spend.Tokens{Prompt: 1000, AudioMillis: 1_500}, 2_500 + 150},
		{"negative seconds, requests and images are zero", images, spend.Tokens{AudioMillis: -5, Requests: -1, Images: -3}, 0},
		{"images saturate instead of overflowing", spend.Price{PerImage: money.MaxAmount}, spend.Tokens{Images: math.MaxInt64}, math.MaxInt64},
		{"seconds saturate instead of overflowing", spend.Price{PerSecond: money.MaxAmount, Input: 1}, spend.Tokens{AudioMillis: math.MaxInt64, Prompt: math.MaxInt64}, math.MaxInt64},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.price.Cost(tt.tok); got != tt.want {
				t.Fatalf("Cost(%+v) = %d, want %d", tt.tok, got, tt.want)
			}
		})
	}
}

func TestPricesLookup(t *testing.T) {
	chat := spend.Price{Input: 270_000, Output: 1_100_000}
	reasoner := spend.Price{Input: 550_000, Output: 2_190_000}
	def := spend.Price{Input: 10_000_000, Output: 30_000_000}
	rules := []spend.PriceRule{
		{Match: "deepseek-reasoner", Price: reasoner},
		{Match: "deepseek-*", Price: chat},
		{Match: "gpt-4o?", Price: def},
	}
	withDefault := spend.NewPrices(rules, &def, true)
	without := spend.NewPrices(rules, nil, true)
	tests := []struct {
		p      *spend.Prices
		model  string
		want   spend.Price
		wantOK bool
	}{
		{withDefault, "deepseek-reasoner", reasoner, true},
		{withDefault, "deepseek-chat", chat, true},
		{withDefault, "DeepSeek-Chat", chat, true},
		{withDefault, "gpt-4oé", def, true},
		{withDefault, "claude-sonnet-4", def, true},
		{without, "claude-sonnet-4", spend.Price{}, false},
		{without, "deepseek-", chat, true},
		{without, "gpt-4o", spend.Price{}, false},
		{nil, "deepseek-chat", spend.Price{}, false},
	}
	for _, tt := range tests {
		got, ok := tt.p.Lookup(tt.model)
		if ok != tt.wantOK || got != tt.want {
			t.Errorf("Lookup(%q) = %+v, %v; want %+v, %v", tt.model, got, ok, tt.want, tt.wantOK)
		}
	}
	caseSensitive := spend.NewPrices(rules, nil, false)
	if _, ok := caseSensitive.Lookup("DeepSeek-Chat"); ok {
		t.Error("a case-sensitive table matched a model of other case")
	}
}

func TestPricesLookupDoesNotAllocate(t *testing.T) {
	p := spend.NewPrices([]spend.PriceRule{{Match: "deepseek-*", Price: spend.Price{Input: 1}}}, nil, true)
	if n := testing.AllocsPerRun(100, func() { p.Lookup("deepseek-chat") }); n != 0 {
		t.Fatalf("Lookup allocated %v times", n)
	}
}
