package app

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// explainSpend prints prices and spend budgets: the currency and zone they are counted in,
// what each model costs per million tokens, and every spend budget with its window.
func explainSpend(w io.Writer, p *config.Policy, s *Summary) {
	if !p.AnySpendLimits() && len(p.Prices) == 0 {
		return
	}
	fmt.Fprintf(w, "\nSpend (%s, calendar windows in %s; a request reserves its worst case — estimated prompt × input + max_tokens × n × output — and settles at the usage the response reports, priced by the model that answered):\n", p.Currency, p.TimeZone)
	if len(p.Prices) > 0 {
		fmt.Fprintln(w, "  prices per million tokens (first match wins; cached input and reasoning default to input and output):")
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "    MATCH\tINPUT\tCACHED_INPUT\tOUTPUT\tREASONING")
		for _, pr := range p.Prices {
			in, out := amountOr(pr.InputPerMtok, "0"), amountOr(pr.OutputPerMtok, "0")
			fmt.Fprintf(tw, "    %s\t%s\t%s\t%s\t%s\n", pr.Match, in, amountOr(pr.CachedInputPerMtok, in), out, amountOr(pr.ReasoningPerMtok, out))
		}
		tw.Flush()
		hasDefault := false
		for _, pr := range p.Prices {
			hasDefault = hasDefault || pr.Match == config.DefaultPrice
		}
		if !hasDefault {
			fmt.Fprintln(w, "  a model no entry matches is charged the highest price of each kind above")
		}
	}
	if !p.AnySpendLimits() {
		fmt.Fprintln(w, "  no spend budget: prices are not used")
		return
	}
	fmt.Fprintln(w, "  budgets (a request needs room in every one of its compartments' budgets):")
	for _, b := range s.spend.Budgets {
		if b.Tenant {
			continue
		}
		fmt.Fprintf(w, "    %-40s spend_per_%s %s\n", b.Budget, b.Period, b.Limit)
	}
	for _, f := range p.Compartments {
		tenantKeyed := false
		for _, k := range f.Key {
			tenantKeyed = tenantKeyed || k == config.DimTenant
		}
		if !tenantKeyed || (f.LimitsFrom != config.DimTenant && f.LimitsFrom != config.DimTier && f.Limits == nil) {
			continue
		}
		var lines []string
		if f.Limits != nil {
			if d := describeSpend(p.Resolve(*f.Limits)); d != "" {
				lines = append(lines, fmt.Sprintf("every tenant: %s", d))
			}
		} else {
			for _, t := range p.TierNames() {
				if d := describeSpend(p.Resolve(p.Tiers[t])); d != "" {
					lines = append(lines, fmt.Sprintf("tier %s: %s", t, d))
				}
			}
			if f.LimitsFrom == config.DimTenant {
				for _, t := range p.Tenants.Directory {
					if t.Limits == nil {
						continue
					}
					if d := describeSpend(p.Resolve(config.Overlay(p.Tiers[t.Tier], *t.Limits))); d != "" {
						lines = append(lines, fmt.Sprintf("tenant %s: %s", t.ID, d))
					}
				}
			}
		}
		for _, l := range lines {
			fmt.Fprintf(w, "    %-40s %s\n", f.Name+"/<tenant>", l)
		}
	}
}

func describeSpend(r config.Resolved) string {
	var parts []string
	for i, name := range []string{"hour", "day", "month"} {
		if r.Spend[i] > 0 {
			parts = append(parts, fmt.Sprintf("spend_per_%s %s", name, r.Spend[i]))
		}
	}
	return strings.Join(parts, ", ")
}

func amountOr(a *config.Amount, def string) string {
	if a == nil {
		return def
	}
	return a.String()
}
