package app

import (
	"fmt"
	"io"
	"slices"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// Summary describes an effective policy: what `validate` prints.
type Summary struct {
	p            *config.Policy
	compartments []policy.CompartmentView
	breakers     []policy.BreakerView
	spend        policy.SpendView
}

// Summarize builds the policy aside (as a reload would, without serving it) and describes it.
// An error means the policy validated but cannot be built.
func Summarize(p *config.Policy) (*Summary, error) {
	eng, err := policy.NewEngine(p, policy.Options{Logger: discardLogger()})
	if err != nil {
		return nil, err
	}
	return &Summary{p: p, compartments: eng.Compartments(), breakers: eng.Breakers(), spend: eng.Snapshot().Spend(eng.Now())}, nil
}

// Line is a one-line summary.
func (s *Summary) Line() string {
	p := s.p
	return fmt.Sprintf("%d features, %d tiers, %d tenants in the directory, %d providers, %d compartment families (%d compartments at start), %d pools, %d breakers",
		len(p.FeatureNames()), len(p.Tiers), len(p.Tenants.Directory), len(p.ProviderNames()), len(p.Compartments), len(s.compartments), len(p.Pools), len(s.breakers))
}

// Explain prints the effective policy with inheritance resolved: classification, every
// compartment's limits, tenant-keyed families' templates, pools, breakers and Envoy settings.
func (s *Summary) Explain(w io.Writer) {
	p := s.p
	fmt.Fprintln(w, "\nClassification (first rule that gives a value wins, then the default):")
	c := p.Classification
	for _, d := range []struct {
		name string
		dim  config.Dimension
	}{{"feature", c.Feature}, {"tenant", c.Tenant}, {"tier", c.Tier}, {"provider", c.Provider}, {"model", c.Model}} {
		var rules []string
		for _, r := range d.dim.Rules {
			rules = append(rules, describeRule(p, r))
		}
		rules = append(rules, fmt.Sprintf("default %q", d.dim.Default))
		fmt.Fprintf(w, "  %-9s %s\n", d.name+":", strings.Join(rules, " → "))
	}

	fmt.Fprintln(w, "\nCompartments (limits resolved; 0 = no limit):")
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  NAME\tMODE\tMAX_CONCURRENT\tMAX_WAIT\tQUEUE\tPRIORITY\tINFLIGHT_TOKENS\tTPM\tTPD\tRPM\tPOOL")
	for _, cv := range s.compartments {
		var tpm, tpd, rpm int64
		for _, b := range cv.Budgets {
			switch b.Kind {
			case "tokens_per_minute":
				tpm = b.Capacity
			case "tokens_per_day":
				tpd = b.Capacity
			case "requests_per_minute":
				rpm = b.Capacity
			}
		}
		wait := cv.MaxWait
		if wait == "" {
			wait = "-"
		}
		pool := cv.Pool
		if pool != "" {
			pool = fmt.Sprintf("%s (guaranteed %d)", pool, cv.Guaranteed)
		}
		conc := strconv.FormatInt(cv.MaxConcurrent, 10)
		if a := cv.Adaptive; a != nil {
			conc = fmt.Sprintf("adaptive %d-%d", a.Min, a.Max)
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n", cv.Name, cv.Mode, conc, wait, cv.QueueDepth,
			cv.Priority, cv.MaxInflightTokens, tpm, tpd, rpm, pool)
	}
	tw.Flush()
	for _, f := range p.Compartments {
		for _, k := range f.Key {
			if k == config.DimTenant {
				fmt.Fprintf(w, "  %s/<tenant>: created per tenant from the tenant's tier (limits_from %s), at most %d, idle ones evicted after %s\n",
					f.Name, f.LimitsFrom, f.MaxInstances, f.IdleTTL)
				for _, t := range p.TierNames() {
					r := p.Resolve(p.Tiers[t])
					fmt.Fprintf(w, "      tier %-12s max_concurrent %d, max_wait %s, tokens_per_minute %d\n", t, r.MaxConcurrent, waitString(r), r.TokensPerMinute)
				}
			}
		}
	}
	if len(p.Tenants.Directory) > 0 {
		fmt.Fprintln(w, "\nTenant directory:")
		for _, t := range p.Tenants.Directory {
			extra := ""
			if t.Limits != nil {
				extra = " (with its own limit overrides)"
			}
			fmt.Fprintf(w, "  %s → %s%s\n", t.ID, t.Tier, extra)
		}
		fmt.Fprintf(w, "  anyone else → %s\n", p.Tenants.DefaultTier)
	}
	if len(p.Models) > 0 {
		fmt.Fprintln(w, "\nModel map:")
		for _, m := range p.Models {
			fmt.Fprintf(w, "  %s → %s\n", m.Match, orDash(m.Provider))
		}
	}
	if len(s.breakers) > 0 {
		fmt.Fprintln(w, "\nBreakers:")
		names := make([]string, 0, len(p.Providers))
		for n := range p.Providers {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			pr := p.Providers[n]
			if pr.Breaker == "" {
				continue
			}
			b := p.ResolveBreaker(pr.Breaker)
			fmt.Fprintf(w, "  %s (%s): %s window %d, minimum %d calls, open at %g%% failures or %g%% slow calls (> %s %s), open %s, %d probes",
				n, pr.Breaker, b.SlidingWindowType, b.SlidingWindowSize, b.MinimumCalls, b.FailureRateThreshold, b.SlowCallRateThreshold,
				b.SlowCallDuration, b.SlowCallMeasure, b.WaitInOpen, b.PermittedCallsInHalfOpen)
			if pr.Fallback != "" {
				fmt.Fprintf(w, ", falls back to %s", pr.Fallback)
			}
			fmt.Fprintf(w, "; fail: %s; ignore: %s\n", strings.Join(verdictList(b.FailureStatuses, b, "failure"), ", "),
				orDash(strings.Join(verdictList(b.IgnoreStatuses, b, "ignore"), ", ")))
		}
	}
	explainSpend(w, p, s)
	explainAdaptive(w, s.compartments)
	explainPools(w, p)
	explainReroutes(w, p)
	e := p.Envoy
	fmt.Fprintf(w, "\nEnvoy filter: request_body_mode %s, response_body_mode %s, message_timeout %s, max_message_timeout %s, allow_mode_override %v, failure_mode_allow %v\n",
		e.RequestBodyMode, e.ResponseBodyMode, e.MessageTimeout, e.MaxMessageTimeout, e.AllowModeOverride, e.FailureModeAllow)
	explainCluster(w, p.Cluster)
	explainTracing(w, p.Tracing)
}

// NoLimitsWarning says, when p limits nothing at all (it can load only with allow_empty: true),
// that every request would be admitted; otherwise it returns "". validate prints it and the
// server logs it at start, since such a policy only counts and labels traffic.
func NoLimitsWarning(p *config.Policy) string {
	if p.AnyLimits() {
		return ""
	}
	return "the policy sets no limit at all (no max_concurrent, max_inflight_tokens, token budget, request rate or breaker): " +
		"every request would be admitted; it only classifies and counts traffic"
}

// Warnings are things about a valid policy that an operator should know before serving it.
func (s *Summary) Warnings() []string {
	if w := NoLimitsWarning(s.p); w != "" {
		return []string{w}
	}
	return nil
}

// explainPools prints each pool: its capacity and every member's guaranteed share and the most it
// may hold by borrowing.
func explainPools(w io.Writer, p *config.Policy) {
	if len(p.Pools) == 0 {
		return
	}
	fmt.Fprintln(w, "\nPools (a member always has its guaranteed share and borrows idle capacity up to its max):")
	for _, pl := range p.Pools {
		fmt.Fprintf(w, "  %s: capacity %d\n", pl.Name, pl.MaxConcurrent)
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		for _, m := range pl.Members {
			maxv := m.Max
			if maxv == 0 {
				maxv = pl.MaxConcurrent
			}
			fmt.Fprintf(tw, "    %s\tguaranteed %d\tmax %d\n", m.Compartment, m.Guaranteed, maxv)
		}
		tw.Flush()
	}
}

// explainReroutes prints where refused or failing requests go instead: each feature's degrade
// rule and each provider's fallback chain, with the model each target is sent.
func explainReroutes(w io.Writer, p *config.Policy) {
	var degrade []string
	for _, n := range p.FeatureNames() {
		if d := p.Features[n].Degrade; d != nil {
			degrade = append(degrade, fmt.Sprintf("  %s: refused for %s → %s", n, strings.Join(d.On, ", "), hop(p, d.Provider)))
		}
	}
	var fallbacks []string
	for _, n := range p.ProviderNames() {
		pr := p.Providers[n]
		if pr.Fallback == "" {
			continue
		}
		chain := []string{n}
		hops := []string{fmt.Sprintf("%s (breaker %s)", n, pr.Breaker)}
		for cur := pr.Fallback; cur != "" && !slices.Contains(chain, cur); cur = p.Providers[cur].Fallback {
			chain = append(chain, cur)
			hops = append(hops, hop(p, cur))
		}
		fallbacks = append(fallbacks, "  "+strings.Join(hops, " → "))
	}
	if len(degrade) > 0 {
		fmt.Fprintln(w, "\nDegrade rules (a request refused for one of these reasons is re-routed instead, when the target can take it):")
		for _, l := range degrade {
			fmt.Fprintln(w, l)
		}
	}
	if len(fallbacks) > 0 {
		fmt.Fprintln(w, "\nFallbacks (while a provider's breaker is open, its requests try the next provider of the chain):")
		for _, l := range fallbacks {
			fmt.Fprintln(w, l)
		}
	}
	if len(degrade)+len(fallbacks) > 0 {
		fmt.Fprintln(w, "  (models: the model a re-routed request is sent, first match wins; a model no entry matches is not re-routed there)")
	}
}

// hop names a re-route target and the model a request re-routed there is sent.
func hop(p *config.Policy, target string) string {
	models := p.Providers[target].Models
	if len(models) == 0 {
		return target + " (model unchanged)"
	}
	var maps []string
	for _, m := range models {
		maps = append(maps, m.Match+" → "+m.Model)
	}
	return target + " (models: " + strings.Join(maps, ", ") + ")"
}

// verdictList is a breaker's resolved record or ignore list: its statuses, then timeout and
// stream_error when they count as what.
func verdictList(statuses []string, b config.BreakerSettings, what string) []string {
	out := append([]string(nil), statuses...)
	if b.NoResponseAs == what {
		out = append(out, "timeout")
	}
	if b.StreamErrorAs == what {
		out = append(out, "stream_error")
	}
	return out
}

func waitString(r config.Resolved) string {
	if !r.HasMaxWait {
		return "-"
	}
	return r.MaxWait.String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func describeRule(p *config.Policy, r config.Rule) string {
	var s string
	switch {
	case r.APIKey:
		s = "API key in authorization (Bearer) or x-api-key"
		if r.Header != "" {
			s = "API key in " + r.Header
		}
		if r.Trusted {
			s += " (trusted)"
		}
		dir := 0
		for _, t := range p.Tenants.Directory {
			dir += len(t.KeySHA256)
		}
		s += fmt.Sprintf(" [keys: %d in the directory", dir)
		if f := p.Tenants.KeysFile; f != "" {
			s += fmt.Sprintf(", %d in %s", p.Tenants.KeysFromFile().Len(), f)
		}
		s += "; unknown or missing key: " + p.Tenants.UnknownKey
		if r.StripClientKey {
			s += "; the client's key is removed before the upstream"
		}
		s += "]"
	case r.Header != "":
		s = "header " + r.Header
		if r.Trusted {
			s += " (trusted)"
		}
	case r.PathPrefix != "":
		s = fmt.Sprintf("path prefix %s = %s", r.PathPrefix, r.Value)
	case r.PathRegex != "":
		s = fmt.Sprintf("path ~ %s = %s", r.PathRegex, r.Value)
	case r.Body != "":
		s = "body " + r.Body
	case r.Metadata != nil:
		s = "metadata " + r.Metadata.Namespace + ":" + r.Metadata.Key
	case r.Attribute != "":
		s = "attribute " + r.Attribute
	case r.TenantDirectory:
		s = "tenant directory"
	case r.ModelMap:
		s = "model map"
	}
	if len(r.Map) > 0 {
		s += " (mapped)"
	}
	return s
}
