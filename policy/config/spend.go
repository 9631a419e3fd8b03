package config

import (
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/glob"
)

// currencyPattern is an ISO 4217 style currency code.
var currencyPattern = regexp.MustCompile(`^[A-Z]{3}$`)

func (l Limits) anySpend() bool {
	return l.SpendPerHour != nil || l.SpendPerDay != nil || l.SpendPerMonth != nil
}

// AnySpendLimits reports whether any limit set a compartment reads has a spend budget.
func (p *Policy) AnySpendLimits() bool {
	found := false
	p.eachLimitSet(func(_ string, l Limits) {
		if p.Resolve(l).AnySpend() {
			found = true
		}
	})
	return found
}

// Location returns the time zone of spend windows (UTC when time_zone is unset or unknown,
// which validation refuses).
func (p *Policy) Location() *time.Location {
	if p.TimeZone == "" {
		return time.UTC
	}
	loc, err := time.LoadLocation(p.TimeZone)
	if err != nil {
		return time.UTC
	}
	return loc
}

// perUnit reports whether r prices something other than tokens.
func (r PriceRule) perUnit() bool {
	return r.PerSecond != nil || r.PerRequest != nil || r.PerImage != nil
}

// spend checks currency, time zone and prices, and that every model the policy names has a
// price when a spend budget applies.
func (v *validator) spend() {
	p := v.p
	if !currencyPattern.MatchString(p.Currency) {
		v.own("currency", "%q is not a currency code (three capital letters, like USD or EUR)", p.Currency)
	}
	if _, err := time.LoadLocation(p.TimeZone); err != nil || p.TimeZone == "Local" {
		v.own("time_zone", "%q is not an IANA time zone (like UTC, Europe/Berlin or America/New_York)", p.TimeZone)
	}
	defaults := 0
	for i, pr := range p.Prices {
		path := fmt.Sprintf("prices[%d]", i)
		switch {
		case pr.Match == "":
			v.add(path+".match", "needs a model name, a glob such as deepseek-*, or default")
		case pr.Match == DefaultPrice:
			if defaults++; defaults > 1 {
				v.add(path+".match", "a second default entry: only one may price the models no other entry matches")
			}
		}
		if pr.InputPerMtok == nil && !pr.perUnit() {
			v.add(path+".input_per_mtok", "is required (the price of a million prompt tokens; write 0 if they are free), unless the entry sets per_second, per_request or per_image")
		}
		if pr.OutputPerMtok == nil && !pr.perUnit() {
			v.add(path+".output_per_mtok", "is required (the price of a million completion tokens; write 0 if they are free), unless the entry sets per_second, per_request or per_image")
		}
	}
	if !p.AnySpendLimits() || defaults > 0 {
		return
	}
	if len(p.Prices) == 0 {
		v.add("prices", "spend budgets (spend_per_hour, spend_per_day, spend_per_month) need prices: list what the models cost, or a default entry")
		return
	}
	priced := func(model string) bool {
		for _, pr := range p.Prices {
			if pr.Match == DefaultPrice {
				continue
			}
			m, g := pr.Match, model
			if !p.Classification.Model.CaseSensitive {
				m, g = strings.ToLower(m), strings.ToLower(g)
			}
			// A models glob is priced by an entry whose glob matches it read as a name:
			// deepseek-* by deepseek-* or by *, not by deepseek-chat.
			if glob.Match(m, g) {
				return true
			}
		}
		return false
	}
	for i, m := range p.Models {
		if m.Match != "" && !priced(m.Match) {
			v.add(fmt.Sprintf("models[%d].match", i), "model %q has no price, but spend budgets apply: add a prices entry that matches it, or a default entry", m.Match)
		}
	}
	for _, name := range sortedKeys(p.Providers) {
		for j, mm := range p.Providers[name].Models {
			if mm.Model != "" && mm.Model != "*" && !priced(mm.Model) {
				v.add(fmt.Sprintf("providers.%s.models[%d].model", name, j), "model %q has no price, but spend budgets apply: add a prices entry that matches it, or a default entry", mm.Model)
			}
		}
	}
}
