package spend

import (
	"math"
	"math/bits"
	"strings"

	"github.com/llm-bulkhead/llm-bulkhead/policy/glob"
)

// Price is what a model costs, per million tokens of each kind.
type Price struct {
	// Input is the price of a million prompt tokens not served from a cache.
	Input Micros
	// Output is the price of a million completion tokens.
	Output Micros
	// CachedInput is the price of a million prompt tokens served from a prompt cache; without
	// HasCachedInput they cost Input.
	CachedInput Micros
	// Reasoning is the price of a million reasoning tokens (part of the completion); without
	// HasReasoning they cost Output.
	Reasoning                    Micros
	HasCachedInput, HasReasoning bool
	// PerSecond is the price of one second of audio (transcription and translation billed by
	// duration), PerRequest the price of each request, PerImage the price of each image
	// generated; zero when the model is not priced so.
	PerSecond, PerRequest, PerImage Micros
}

// Tokens is a request's use by kind. Cached is the part of Prompt served from a prompt cache,
// Reasoning the part of Completion spent reasoning (as OpenAI reports them; Anthropic's
// separate cache counts are added to the prompt by the response parser). AudioMillis is the
// audio billed by duration, in milliseconds; Requests the requests served; Images the images
// generated.
type Tokens struct {
	Prompt, Cached, Completion, Reasoning int64
	AudioMillis, Requests, Images         int64
}

// Cost is what use t costs at price p: every token part at its price per million, the audio at
// its price per second, the requests and images at theirs, summed exactly, then rounded up once
// to the next millionth of the currency unit, so that a request is never charged less than it
// cost. Negative counts count as zero; a cached (reasoning) count above the prompt (completion)
// is taken as all of it. The result saturates at the largest Micros.
func (p Price) Cost(t Tokens) Micros {
	prompt, completion := max(t.Prompt, 0), max(t.Completion, 0)
	cached, reasoning := min(max(t.Cached, 0), prompt), min(max(t.Reasoning, 0), completion)
	cachedPrice, reasoningPrice := p.Input, p.Output
	if p.HasCachedInput {
		cachedPrice = p.CachedInput
	}
	if p.HasReasoning {
		reasoningPrice = p.Reasoning
	}
	var sum acc
	sum.add(prompt-cached, p.Input)
	sum.add(cached, cachedPrice)
	sum.add(completion-reasoning, p.Output)
	sum.add(reasoning, reasoningPrice)
	// A millisecond at a price per second is a thousand tokens at that price per million; a
	// request or an image a million.
	sum.addScaled(t.AudioMillis, p.PerSecond, 1_000)
	sum.addScaled(t.Requests, p.PerRequest, 1_000_000)
	sum.addScaled(t.Images, p.PerImage, 1_000_000)
	return sum.micros()
}

// addScaled adds n × scale units at price per million; a sum past 2^128 cannot be written
// anyway and saturates with the rest (micros).
func (a *acc) addScaled(n int64, price Micros, scale uint64) {
	if n <= 0 || price <= 0 || a.hi == math.MaxUint64 {
		return
	}
	hi, lo := bits.Mul64(uint64(n), uint64(price))
	hi2, lo2 := bits.Mul64(lo, scale)
	hiHi, hiLo := bits.Mul64(hi, scale)
	top, carry := bits.Add64(hi2, hiLo, 0)
	if hiHi != 0 || carry != 0 {
		a.hi, a.lo = math.MaxUint64, math.MaxUint64
		return
	}
	var c uint64
	a.lo, c = bits.Add64(a.lo, lo2, 0)
	var over uint64
	a.hi, over = bits.Add64(a.hi, top, c)
	if over != 0 {
		a.hi, a.lo = math.MaxUint64, math.MaxUint64
	}
}

// acc is a 128-bit sum of tokens × price-per-million products (in units of 10⁻¹² currency).
type acc struct{ hi, lo uint64 }

func (a *acc) add(n int64, price Micros) {
	if n <= 0 || price <= 0 {
		return
	}
	hi, lo := bits.Mul64(uint64(n), uint64(price))
	var carry uint64
	a.lo, carry = bits.Add64(a.lo, lo, 0)
	a.hi, _ = bits.Add64(a.hi, hi, carry)
}

// micros divides by a million, rounding up, saturating at MaxInt64.
func (a acc) micros() Micros {
	const million = 1_000_000
	if a.hi >= million {
		return math.MaxInt64
	}
	q, r := bits.Div64(a.hi, a.lo, million)
	if r > 0 {
		q++
	}
	if q > math.MaxInt64 || q == 0 && r > 0 {
		return math.MaxInt64
	}
	return Micros(q)
}

// PriceRule prices the models matching a glob.
type PriceRule struct {
	// Match is a glob over the model name (package glob): `*` matches any run of characters,
	// `?` one.
	Match string
	Price Price
}

// Prices is a compiled price table: rules tried in order, first match wins, then the default.
// Immutable; safe for concurrent use.
type Prices struct {
	rules    []PriceRule
	def      Price
	hasDef   bool
	foldCase bool
}

// NewPrices compiles a price table. def (may be nil) prices models no rule matches. With
// foldCase, globs and model names are compared in lower case.
func NewPrices(rules []PriceRule, def *Price, foldCase bool) *Prices {
	p := &Prices{foldCase: foldCase}
	for _, r := range rules {
		if foldCase {
			r.Match = strings.ToLower(r.Match)
		}
		p.rules = append(p.rules, r)
	}
	if def != nil {
		p.def, p.hasDef = *def, true
	}
	return p
}

// Lookup returns the price of model: the first rule whose glob matches it, else the default.
// ok is false when neither prices it. Lookup does not allocate for a lower-case model name.
func (p *Prices) Lookup(model string) (Price, bool) {
	if pr, ok := p.LookupRule(model); ok {
		return pr, true
	}
	if p == nil {
		return Price{}, false
	}
	return p.def, p.hasDef
}

// LookupRule returns the price of the first rule whose glob matches model, ignoring the
// default: ok is false when no rule names the model.
func (p *Prices) LookupRule(model string) (Price, bool) {
	if p == nil {
		return Price{}, false
	}
	if p.foldCase && hasUpper(model) {
		model = strings.ToLower(model)
	}
	for i := range p.rules {
		if glob.Match(p.rules[i].Match, model) {
			return p.rules[i].Price, true
		}
	}
	return Price{}, false
}

func hasUpper(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c >= 'A' && c <= 'Z' || c >= 0x80 {
			return true
		}
	}
	return false
}
