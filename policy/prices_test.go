package policy_test

import (
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	spendpkg "github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

func loadPrices(t *testing.T, yaml string) *spendpkg.Prices {
	t.Helper()
	p, err := config.Load("p.yaml", []byte(yaml), nil)
	if err != nil {
		t.Fatal(err)
	}
	return policy.PriceTable(p)
}

// TestPriceTable: amounts are read from the digits written, a cached (reasoning) token costs
// an input (output) token unless the entry prices it, and without a default entry a model
// nobody priced costs the highest price of each kind.
func TestPriceTable(t *testing.T) {
	prices := loadPrices(t, `allow_empty: true
prices:
  - {match: "deepseek-*", input_per_mtok: 0.27, output_per_mtok: 1.10, cached_input_per_mtok: 0.07}
  - {match: "qwen-*", input_per_mtok: 0.40, output_per_mtok: 1.20, reasoning_per_mtok: 4}
`)
	ds, ok := prices.Lookup("deepseek-chat")
	if !ok || ds != (spendpkg.Price{Input: 270_000, Output: 1_100_000, CachedInput: 70_000, HasCachedInput: true, Reasoning: 1_100_000}) {
		t.Fatalf("deepseek price = %+v, %v", ds, ok)
	}
	// Globs ignore case unless classification.model.case_sensitive.
	if upper, ok := prices.Lookup("DeepSeek-Chat"); !ok || upper != ds {
		t.Fatalf("DeepSeek-Chat price = %+v, %v", upper, ok)
	}
	other, ok := prices.Lookup("gpt-4o")
	if !ok || other != (spendpkg.Price{Input: 400_000, Output: 1_200_000, CachedInput: 400_000, Reasoning: 4_000_000, HasCachedInput: true, HasReasoning: true}) {
		t.Fatalf("unpriced model = %+v, %v", other, ok)
	}
}

// TestPriceTableEmpty: an empty prices list prices no model.
func TestPriceTableEmpty(t *testing.T) {
	if _, ok := loadPrices(t, "allow_empty: true\n").Lookup("anything"); ok {
		t.Fatal("an empty prices list priced a model")
	}
}

// TestPriceTablePerUnit: an entry may price audio seconds, requests and images instead of (or
// on top of) tokens; its token prices then default to 0.
func TestPriceTablePerUnit(t *testing.T) {
	prices := loadPrices(t, `allow_empty: true
prices:
  - {match: whisper-1, per_second: 0.0001}
  - {match: dall-e-3, per_image: 0.04, per_request: 0.001}
  - {match: gpt-4o-transcribe, input_per_mtok: 2.50, output_per_mtok: 10, per_request: 0.0005}
`)
	for model, want := range map[string]spendpkg.Price{
		"whisper-1":         {PerSecond: 100},
		"dall-e-3":          {PerImage: 40_000, PerRequest: 1_000},
		"gpt-4o-transcribe": {Input: 2_500_000, CachedInput: 2_500_000, Output: 10_000_000, Reasoning: 10_000_000, PerRequest: 500},
	} {
		if got, ok := prices.Lookup(model); !ok || got != want {
			t.Errorf("%s: %+v, want %+v", model, got, want)
		}
	}
	// A model no entry prices is charged the highest of each kind.
	if got, _ := prices.Lookup("tts-1"); got.PerSecond != 100 || got.PerImage != 40_000 || got.PerRequest != 1_000 {
		t.Errorf("unpriced model: %+v", got)
	}
}
