package config_test

import (
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
)

const spendPolicy = `currency: EUR
time_zone: Europe/Berlin
models:
  - {match: "deepseek-*", provider: deepseek}
providers:
  deepseek: {max_concurrent: 5}
  qwen:
    max_concurrent: 5
    models:
      - {match: "deepseek-*", model: qwen-plus}
prices:
  - {match: "deepseek-*", input_per_mtok: 0.27, output_per_mtok: 1.10, cached_input_per_mtok: 0.07}
  - {match: "qwen-*", input_per_mtok: 0.40, output_per_mtok: 1.20, reasoning_per_mtok: 4}
features:
  chat: {max_concurrent: 4, ratio: 0.3}
tiers:
  free: {spend_per_day: 1.10, spend_per_hour: 0.000001}
  pro: {template: paid}
templates:
  paid: {spend_per_month: 500}
tenants:
  directory:
    - {id: initech, tier: free, limits: {spend_per_day: 20}}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tier_feature, key: [tier, feature], limits_from: tier, scale_by: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
  - {name: provider, key: [provider], limits_from: provider}
classification:
  feature: {default: chat}
  provider: {default: deepseek}
`

// Amounts are read from the digits written: 1.10 is exactly 1 100 000 millionths, never the
// float nearest to it, and the tier × feature rule scales them like every limit.
func TestSpendConfigIsExact(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(spendPolicy), []string{"LLM_BULKHEAD_TIERS__PRO__SPEND_PER_DAY=0.30"})
	if err != nil {
		t.Fatal(err)
	}
	free := p.Resolve(p.Tiers["free"])
	if free.Spend != [3]config.Amount{1, 1_100_000, 0} {
		t.Fatalf("free tier spend = %v, want [1 1100000 0]", free.Spend)
	}
	if pro := p.Resolve(p.Tiers["pro"]); pro.Spend != [3]config.Amount{0, 300_000, 500_000_000} {
		t.Fatalf("pro tier spend = %v (template and environment override)", pro.Spend)
	}
	// 1.10 × 0.3 = 0.33 exactly; the hourly 0.000001 stays at the smallest amount.
	if scaled := free.Scale(0.3); scaled.Spend != [3]config.Amount{1, 330_000, 0} {
		t.Fatalf("scaled = %v, want [1 330000 0]", scaled.Spend)
	}
	if tenant := p.Resolve(config.Overlay(p.Tiers["free"], *p.Tenants.Directory[0].Limits)); tenant.Spend[1] != 20_000_000 {
		t.Fatalf("tenant override = %v", tenant.Spend)
	}
	if p.Currency != "EUR" || p.Location().String() != "Europe/Berlin" {
		t.Fatalf("currency %q, zone %s", p.Currency, p.Location())
	}
	if !p.AnySpendLimits() {
		t.Fatal("AnySpendLimits = false")
	}
}

func TestSpendDefaults(t *testing.T) {
	p, err := config.Load("p.yaml", []byte("allow_empty: true\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if p.Currency != "USD" || p.TimeZone != "UTC" || p.AnySpendLimits() {
		t.Fatalf("currency %q, zone %q, spend %v", p.Currency, p.TimeZone, p.AnySpendLimits())
	}
}

func TestSpendConfigProblems(t *testing.T) {
	data := `currency: usd
time_zone: Mars/Olympus_Mons
models:
  - {match: "deepseek-*"}
  - {match: "claude-*"}
providers:
  local:
    max_concurrent: 2
    models:
      - {match: "*", model: llama-3}
prices:
  - {match: "deepseek-*", input_per_mtok: 0.27}
  - {match: "", input_per_mtok: 1e-3, output_per_mtok: 0.0000001}
tiers:
  free: {spend_per_day: -1, spend_per_month: 1.5}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant}
  - {name: provider, key: [provider], limits_from: provider}
classification:
  provider: {default: local}
`
	got := loadProblems(t, data, nil)
	wantProblems(t, got, []string{
		`p.yaml:1: currency: "usd" is not a currency code`,
		`p.yaml:2: time_zone: "Mars/Olympus_Mons" is not an IANA time zone`,
		`p.yaml:5: models[1].match: model "claude-*" has no price, but spend budgets apply`,
		`p.yaml:10: providers.local.models[0].model: model "llama-3" has no price`,
		`p.yaml:12: prices[0].output_per_mtok: is required`,
		// (the entry's match is not judged: one of its values could not be taken)
		`p.yaml:13: prices[1].input_per_mtok: "1e-3" is not an amount`,
		`p.yaml:13: prices[1].output_per_mtok: "0.0000001" is more precise than a millionth`,
		`p.yaml:15: tiers.free.spend_per_day: "-1" is negative`,
	})
}

func TestSpendNeedsPrices(t *testing.T) {
	got := loadProblems(t, `features:
  default: {spend_per_hour: 2}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`, nil)
	wantProblems(t, got, []string{`p.yaml: prices: spend budgets (spend_per_hour, spend_per_day, spend_per_month) need prices`})

	got = loadProblems(t, `prices:
  - {match: default, input_per_mtok: 1, output_per_mtok: 2}
  - {match: default, input_per_mtok: 1, output_per_mtok: 2}
features:
  default: {spend_per_hour: 2}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`, nil)
	wantProblems(t, got, []string{`p.yaml:3: prices[1].match: a second default entry`})

	// A spend budget no family reads does nothing: refused like any such limit.
	got = loadProblems(t, `prices:
  - {match: default, input_per_mtok: 1, output_per_mtok: 2}
features:
  default: {max_concurrent: 2}
providers:
  p: {spend_per_day: 5}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
classification:
  provider: {default: p}
`, nil)
	wantProblems(t, got, []string{`p.yaml:6: providers.p: sets limits, but no compartment family takes limits_from: provider`})
}

// TestPricesMatchModelGlobs: a models glob is priced by a prices glob that matches it read as a
// name, a `*` of the prices glob matching the models glob's own `*`: a prices entry * prices
// *-mini.
func TestPricesMatchModelGlobs(t *testing.T) {
	pricedBy := func(glob string) string {
		return `models:
  - {match: "*-mini", provider: p}
prices:
  - {match: "` + glob + `", input_per_mtok: 1, output_per_mtok: 2}
features:
  default: {spend_per_hour: 2}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
classification:
  provider: {default: p}
providers:
  p: {}
`
	}
	if _, err := config.Load("p.yaml", []byte(pricedBy("*")), nil); err != nil {
		t.Fatalf("a prices entry * did not price the model glob *-mini: %v", err)
	}
	got := loadProblems(t, pricedBy("gpt-*"), nil)
	wantProblems(t, got, []string{`p.yaml:2: models[0].match: model "*-mini" has no price`})
}

// FuzzAmountScalar: an amount written as a plain YAML scalar is read from its text, exactly as
// money.ParseAmount reads it, whatever float YAML would make of it; one that ParseAmount
// refuses is refused by Load with the key's line.
func FuzzAmountScalar(f *testing.F) {
	for _, s := range []string{"1.10", "0.000001", "20", "1e3", "-1", "0.1234567", ".5", "1000000000000", "0x10", "1_000", "+3.25", "007"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		if text == "" || strings.TrimSpace(text) != text || strings.Trim(text, "0123456789.+-_eExXabcdfnlurtoNIAF ") != "" {
			return // not a plain number-like scalar
		}
		doc := "allow_empty: true\nprices:\n  - {match: default, input_per_mtok: 1, output_per_mtok: 1}\nfeatures:\n  default:\n    spend_per_day: " + text + "\ncompartments:\n  - {name: feature, key: [feature], limits_from: feature}\n"
		p, err := config.Load("p.yaml", []byte(doc), nil)
		if err != nil && strings.Contains(err.Error(), "invalid YAML") {
			return // not a scalar after all ("-" starts a list)
		}
		want, perr := money.ParseAmount(text)
		switch {
		case perr == nil && err != nil:
			if !strings.Contains(err.Error(), "spend_per_day") || p != nil {
				t.Fatalf("%q: ParseAmount = %d but Load failed: %v", text, want, err)
			}
			// The scalar may be something YAML reads as another type (null, a bool, a date).
		case perr == nil:
			if got := p.Resolve(p.Features["default"].Limits).Spend[1]; got != want {
				t.Fatalf("%q: loaded %d, ParseAmount %d", text, got, want)
			}
		case err == nil:
			if got := p.Resolve(p.Features["default"].Limits).Spend[1]; got != 0 {
				t.Fatalf("%q: ParseAmount refused it (%v) but Load took %d", text, perr, got)
			}
		default:
			if !strings.Contains(err.Error(), "p.yaml:6: features.default.spend_per_day") {
				t.Fatalf("%q: error without the key's line: %v", text, err)
			}
		}
	})
}

// TestPricesPerUnit: an entry may price audio seconds, requests and images instead of (or on
// top of) tokens (what they cost is TestPriceTablePerUnit in package policy), and each amount is
// checked like the others.
func TestPricesPerUnit(t *testing.T) {
	_, err := config.Load("p.yaml", []byte(`allow_empty: true
prices:
  - {match: whisper-1, per_second: 0.0001}
  - {match: dall-e-3, per_image: 0.04, per_request: 0.001}
  - {match: gpt-4o-transcribe, input_per_mtok: 2.50, output_per_mtok: 10, per_request: 0.0005}
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	got := loadProblems(t, `allow_empty: true
prices:
  - {match: a, per_second: -0.1}
  - {match: b, per_image: 0.0000001}
  - {match: c, per_request: x}
`, nil)
	wantProblems(t, got, []string{
		`p.yaml:3: prices[0].per_second: "-0.1" is negative`,
		`p.yaml:4: prices[1].per_image: "0.0000001" is more precise than a millionth`,
		`p.yaml:5: prices[2].per_request: "x" is not an amount`,
	})
}
