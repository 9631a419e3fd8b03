package storm

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// TargetRatio is the design's target: chat P99 under the storm within this multiple of chat
// P99 without the storm.
const TargetRatio = 1.3

// RunSummary is the headline numbers of one run. Latencies are simulated seconds; a nil
// percentile means there was nothing to measure.
type RunSummary struct {
	// ChatRequests counts chat requests; ChatOK, ChatRefused and ChatErrors split them.
	ChatRequests int `json:"chat_requests"`
	ChatOK       int `json:"chat_ok"`
	ChatRefused  int `json:"chat_refused"`
	ChatErrors   int `json:"chat_errors"`
	// ChatP50, ChatP90 and ChatP99 count every failed chat request at the scenario's
	// ChatTimeout: a user who got no answer waited at least that long.
	ChatP50 *float64 `json:"chat_p50"`
	ChatP90 *float64 `json:"chat_p90"`
	ChatP99 *float64 `json:"chat_p99"`
	// ChatServedP99 is the P99 of answered chat requests only.
	ChatServedP99 *float64 `json:"chat_served_p99"`
	// ChatStormP99 is the P99 (failures counted as above) of chat requests started while the
	// batch job ran.
	ChatStormP99 *float64 `json:"chat_storm_p99"`
	// BatchDocuments is how many documents the job had; BatchDone how many it got summarised;
	// BatchAttempts how many requests it sent for them.
	BatchDocuments int `json:"batch_documents"`
	BatchDone      int `json:"batch_done"`
	BatchAttempts  int `json:"batch_attempts"`
	// BatchP99 is the P99 of a finished document's time from its first attempt to its answer.
	BatchP99 *float64 `json:"batch_p99"`
	// Refused counts refused requests per feature and reason.
	Refused map[string]map[string]int `json:"refused"`
	// Errors counts failed requests that were not refusals, per feature and kind.
	Errors map[string]map[string]int `json:"errors"`
	// Shadow counts what shadow-mode compartments would have refused, per reason, summed over
	// compartments.
	Shadow map[string]int `json:"shadow,omitempty"`

	// The brownout's numbers (absent without Scenario.Brownout). ChatBrownoutP99 is the chat
	// P99 (failures counted as above) of requests started during the brownout phases.
	ChatBrownoutP99 *float64 `json:"chat_brownout_p99,omitempty"`
	// BatchHealthyRate and BatchBrownoutRate are the batch documents answered per simulated
	// second during the healthy phases and during the brownout phases, counted when answered.
	BatchHealthyRate  *float64 `json:"batch_healthy_rate,omitempty"`
	BatchBrownoutRate *float64 `json:"batch_brownout_rate,omitempty"`
	// ProviderWait and ProxyWait sum, per feature, the simulated seconds requests waited in the
	// upstream's queue and on their way to the upstream (Sample.ProviderWait, ProxyWait).
	ProviderWait map[string]float64 `json:"provider_wait,omitempty"`
	ProxyWait    map[string]float64 `json:"proxy_wait,omitempty"`

	// The provider quota's numbers (absent without Scenario.QuotaProvider). BatchRate is the
	// batch documents answered per simulated second of the run. ProviderQuotaRefused counts
	// the provider's 429s for its used-up quota (what llm-bulkhead saw), Provider429sToClients
	// the upstream 429s that reached the clients as they were. QuotaRerouted counts requests
	// re-routed for provider_quota; QuotaShort those the quota, as the headers told it, could
	// not cover (in shadow mode: counted, nothing else).
	BatchRate             *float64 `json:"batch_rate,omitempty"`
	ProviderQuotaRefused  int      `json:"provider_quota_refused,omitempty"`
	Provider429sToClients int      `json:"provider_429s_to_clients,omitempty"`
	QuotaRerouted         int      `json:"quota_rerouted,omitempty"`
	QuotaShort            int      `json:"quota_short,omitempty"`
}

// quotaSummary fills the provider quota's numbers of s.
func quotaSummary(s *RunSummary, res *RunResult, sc Scenario) {
	if sc.QuotaProvider == "" {
		return
	}
	v := float64(s.BatchDone) / sc.Duration.Seconds()
	s.BatchRate = &v
	s.ProviderQuotaRefused = int(res.ProviderQuotaRefused)
	for _, byKind := range res.Errors {
		s.Provider429sToClients += byKind["status_429"]
	}
	if res.Engine != nil {
		for _, rr := range res.Engine.Reroutes {
			if rr.Reason == "provider_quota" {
				s.QuotaRerouted += rr.Count
			}
		}
		for _, n := range res.Engine.QuotaShort {
			s.QuotaShort += n
		}
	}
}

// ProviderShare is the share of the waiting of feature's requests ("" for all) that happened
// in the upstream's queue rather than on the way to it; ok is false when nothing waited.
func (s RunSummary) ProviderShare(feature string) (share float64, ok bool) {
	var prov, proxy float64
	for f, w := range s.ProviderWait {
		if feature == "" || f == feature {
			prov += w
		}
	}
	for f, w := range s.ProxyWait {
		if feature == "" || f == feature {
			proxy += w
		}
	}
	if prov+proxy <= 0 {
		return 0, false
	}
	return prov / (prov + proxy), true
}

// brownoutSummary fills the brownout's numbers of s.
func brownoutSummary(s *RunSummary, res *RunResult, sc Scenario) {
	phases := sc.Phases()
	if len(phases) == 0 {
		return
	}
	brownout := func(t float64) bool {
		for _, p := range phases {
			if t >= p.From && t < p.To {
				return !p.Healthy
			}
		}
		return false
	}
	penalty := sc.ChatTimeout.Seconds()
	var lats []float64
	for _, c := range res.Chat {
		if !brownout(c.Start) {
			continue
		}
		if c.Outcome == OutcomeOK {
			lats = append(lats, c.Latency)
		} else {
			lats = append(lats, penalty)
		}
	}
	s.ChatBrownoutP99 = percentileOpt(lats, 99)
	var healthyLen, brownoutLen float64
	for _, p := range phases {
		if p.Healthy {
			healthyLen += p.To - p.From
		} else {
			brownoutLen += p.To - p.From
		}
	}
	var healthyDone, brownoutDone float64
	for _, b := range res.Batch {
		end := b.Start + b.Latency
		if b.Outcome != OutcomeOK || end >= sc.Duration.Seconds() {
			continue
		}
		if brownout(end) {
			brownoutDone++
		} else {
			healthyDone++
		}
	}
	if healthyLen > 0 {
		v := healthyDone / healthyLen
		s.BatchHealthyRate = &v
	}
	if brownoutLen > 0 {
		v := brownoutDone / brownoutLen
		s.BatchBrownoutRate = &v
	}
	s.ProviderWait, s.ProxyWait = map[string]float64{}, map[string]float64{}
	for _, c := range res.Chat {
		s.ProviderWait[FeatureChat] += c.ProviderWait
		s.ProxyWait[FeatureChat] += c.ProxyWait
	}
	for _, b := range res.Batch {
		s.ProviderWait[FeatureBatch] += b.ProviderWait
		s.ProxyWait[FeatureBatch] += b.ProxyWait
	}
}

// summarizeRun computes a run's headline numbers.
func summarizeRun(res *RunResult, sc Scenario) RunSummary {
	penalty := sc.ChatTimeout.Seconds()
	s := RunSummary{ChatRequests: len(res.Chat), BatchDocuments: sc.BatchDocuments(), Refused: res.Refusals, Errors: res.Errors}
	var all, served, storm []float64
	for _, c := range res.Chat {
		lat := c.Latency
		switch c.Outcome {
		case OutcomeOK:
			s.ChatOK++
			served = append(served, c.Latency)
		case OutcomeRefused:
			s.ChatRefused++
			lat = penalty
		default:
			s.ChatErrors++
			lat = penalty
		}
		all = append(all, lat)
		if res.StormStart != nil && c.Start >= *res.StormStart && c.Start <= *res.StormEnd {
			storm = append(storm, lat)
		}
	}
	s.ChatP50, s.ChatP90, s.ChatP99 = percentileOpt(all, 50), percentileOpt(all, 90), percentileOpt(all, 99)
	s.ChatServedP99 = percentileOpt(served, 99)
	s.ChatStormP99 = percentileOpt(storm, 99)
	var done []float64
	for _, b := range res.Batch {
		s.BatchAttempts += b.Attempts
		if b.Outcome == OutcomeOK {
			s.BatchDone++
			done = append(done, b.Latency)
		}
	}
	s.BatchP99 = percentileOpt(done, 99)
	brownoutSummary(&s, res, sc)
	quotaSummary(&s, res, sc)
	if res.Engine != nil && len(res.Engine.ShadowRejections) > 0 {
		s.Shadow = map[string]int{}
		for reason, byComp := range res.Engine.ShadowRejections {
			for _, n := range byComp {
				s.Shadow[reason] += n
			}
		}
	}
	return s
}

// ConfigSummary is one configuration over all its repetitions: the median of each run's
// number, with the spread.
type ConfigSummary struct {
	Configuration
	Runs           int  `json:"runs"`
	ChatRequests   Stat `json:"chat_requests"`
	ChatRefused    Stat `json:"chat_refused"`
	ChatErrors     Stat `json:"chat_errors"`
	ChatP50        Stat `json:"chat_p50"`
	ChatP90        Stat `json:"chat_p90"`
	ChatP99        Stat `json:"chat_p99"`
	ChatServedP99  Stat `json:"chat_served_p99"`
	ChatStormP99   Stat `json:"chat_storm_p99"`
	BatchDocuments int  `json:"batch_documents"`
	BatchDone      Stat `json:"batch_done"`
	BatchAttempts  Stat `json:"batch_attempts"`
	BatchP99       Stat `json:"batch_p99"`
	// Refused is per feature and reason; a run without such refusals counts 0.
	Refused map[string]map[string]Stat `json:"refused"`
	// Errors is per feature and kind: failures that were not refusals (timeouts, resets).
	Errors map[string]map[string]Stat `json:"errors"`
	// Shadow is per reason, summed over compartments.
	Shadow             map[string]Stat `json:"shadow,omitempty"`
	BreakerOpenings    Stat            `json:"breaker_openings"`
	UpstreamPeakQueued Stat            `json:"upstream_peak_queued"`
	StallMillis        Stat            `json:"stall_ms"`
	// The brownout's numbers (RunSummary's), and the share of the waiting that happened in the
	// upstream's queue, of all requests and of chat's.
	ChatBrownoutP99       Stat `json:"chat_brownout_p99"`
	BatchHealthyRate      Stat `json:"batch_healthy_rate"`
	BatchBrownoutRate     Stat `json:"batch_brownout_rate"`
	ProviderWaitShare     Stat `json:"provider_wait_share"`
	ChatProviderWaitShare Stat `json:"chat_provider_wait_share"`
	// The provider quota's numbers (RunSummary's).
	BatchRate             Stat `json:"batch_rate"`
	ProviderQuotaRefused  Stat `json:"provider_quota_refused"`
	Provider429sToClients Stat `json:"provider_429s_to_clients"`
	QuotaRerouted         Stat `json:"quota_rerouted"`
	QuotaShort            Stat `json:"quota_short"`
}

// Report is the outcome of Run: the setting, every run, and a summary per configuration.
type Report struct {
	Machine          machine          `json:"machine"`
	LoadAverageStart string           `json:"load_average_start,omitempty"`
	LoadAverageEnd   string           `json:"load_average_end,omitempty"`
	StartedAt        time.Time        `json:"started_at"`
	WallSeconds      float64          `json:"wall_seconds"`
	TimeScale        float64          `json:"time_scale"`
	Seed             uint64           `json:"seed"`
	Capacity         int              `json:"capacity"`
	Repeat           int              `json:"repeat"`
	Scenario         Scenario         `json:"scenario"`
	Configurations   []*ConfigSummary `json:"configurations"`
	Runs             []*RunResult     `json:"runs"`
}

func newReport(o Options) *Report {
	r := &Report{Machine: thisMachine(), LoadAverageStart: harness.LoadAverage(), StartedAt: time.Now().UTC().Round(time.Second),
		TimeScale: o.scale(), Seed: o.Seed, Capacity: o.Capacity, Repeat: o.repeat(), Scenario: o.scenario()}
	for _, c := range o.Configurations {
		r.Configurations = append(r.Configurations, &ConfigSummary{Configuration: c})
	}
	return r
}

// summarize fills the per-configuration summaries from the runs.
func (r *Report) summarize() {
	for _, cs := range r.Configurations {
		var runs []*RunResult
		for _, run := range r.Runs {
			if run.Configuration == cs.Name {
				runs = append(runs, run)
			}
		}
		cs.Runs = len(runs)
		num := func(f func(RunSummary) float64) Stat {
			xs := make([]float64, len(runs))
			for i, run := range runs {
				xs[i] = f(run.Summary)
			}
			return Summarize(xs)
		}
		opt := func(f func(RunSummary) *float64) Stat {
			xs := make([]*float64, len(runs))
			for i, run := range runs {
				xs[i] = f(run.Summary)
			}
			return summarizeOpt(xs)
		}
		cs.ChatRequests = num(func(s RunSummary) float64 { return float64(s.ChatRequests) })
		cs.ChatRefused = num(func(s RunSummary) float64 { return float64(s.ChatRefused) })
		cs.ChatErrors = num(func(s RunSummary) float64 { return float64(s.ChatErrors) })
		cs.ChatP50 = opt(func(s RunSummary) *float64 { return s.ChatP50 })
		cs.ChatP90 = opt(func(s RunSummary) *float64 { return s.ChatP90 })
		cs.ChatP99 = opt(func(s RunSummary) *float64 { return s.ChatP99 })
		cs.ChatServedP99 = opt(func(s RunSummary) *float64 { return s.ChatServedP99 })
		cs.ChatStormP99 = opt(func(s RunSummary) *float64 { return s.ChatStormP99 })
		if cs.Storm {
			cs.BatchDocuments = r.Scenario.BatchWorkers * r.Scenario.BatchPerWorker
			cs.BatchDone = num(func(s RunSummary) float64 { return float64(s.BatchDone) })
			cs.BatchAttempts = num(func(s RunSummary) float64 { return float64(s.BatchAttempts) })
			cs.BatchP99 = opt(func(s RunSummary) *float64 { return s.BatchP99 })
		}
		perFeature := func(get func(RunSummary) map[string]map[string]int) map[string]map[string]Stat {
			out := map[string]map[string]Stat{}
			for _, f := range keys2(runs, get) {
				out[f] = map[string]Stat{}
				for _, reason := range keys(runs, func(s RunSummary) map[string]int { return get(s)[f] }) {
					out[f][reason] = num(func(s RunSummary) float64 { return float64(get(s)[f][reason]) })
				}
			}
			return out
		}
		cs.Refused = perFeature(func(s RunSummary) map[string]map[string]int { return s.Refused })
		cs.Errors = perFeature(func(s RunSummary) map[string]map[string]int { return s.Errors })
		if shadow := keys(runs, func(s RunSummary) map[string]int { return s.Shadow }); len(shadow) > 0 {
			cs.Shadow = map[string]Stat{}
			for _, reason := range shadow {
				cs.Shadow[reason] = num(func(s RunSummary) float64 { return float64(s.Shadow[reason]) })
			}
		}
		xs := make([]float64, len(runs))
		for i, run := range runs {
			if run.Engine != nil {
				xs[i] = float64(run.Engine.BreakerOpenings)
			}
		}
		cs.BreakerOpenings = Summarize(xs)
		for i, run := range runs {
			xs[i] = float64(run.UpstreamPeakQueued)
		}
		cs.UpstreamPeakQueued = Summarize(xs)
		for i, run := range runs {
			xs[i] = run.StallMillis
		}
		cs.StallMillis = Summarize(xs)
		cs.ChatBrownoutP99 = opt(func(s RunSummary) *float64 { return s.ChatBrownoutP99 })
		cs.BatchHealthyRate = opt(func(s RunSummary) *float64 { return s.BatchHealthyRate })
		cs.BatchBrownoutRate = opt(func(s RunSummary) *float64 { return s.BatchBrownoutRate })
		share := func(feature string) func(RunSummary) *float64 {
			return func(s RunSummary) *float64 {
				if v, ok := s.ProviderShare(feature); ok {
					return &v
				}
				return nil
			}
		}
		if len(r.Scenario.Brownout) > 0 {
			cs.ProviderWaitShare = opt(share(""))
			cs.ChatProviderWaitShare = opt(share(FeatureChat))
		}
		if r.Scenario.QuotaProvider != "" {
			cs.BatchRate = opt(func(s RunSummary) *float64 { return s.BatchRate })
			cs.ProviderQuotaRefused = num(func(s RunSummary) float64 { return float64(s.ProviderQuotaRefused) })
			cs.Provider429sToClients = num(func(s RunSummary) float64 { return float64(s.Provider429sToClients) })
			cs.QuotaRerouted = num(func(s RunSummary) float64 { return float64(s.QuotaRerouted) })
			cs.QuotaShort = num(func(s RunSummary) float64 { return float64(s.QuotaShort) })
		}
	}
}

// keys returns the sorted union of the keys of f's map over the runs' summaries.
func keys(runs []*RunResult, f func(RunSummary) map[string]int) []string {
	set := map[string]bool{}
	for _, run := range runs {
		for k := range f(run.Summary) {
			set[k] = true
		}
	}
	return sortedSet(set)
}

func keys2(runs []*RunResult, f func(RunSummary) map[string]map[string]int) []string {
	set := map[string]bool{}
	for _, run := range runs {
		for k := range f(run.Summary) {
			set[k] = true
		}
	}
	return sortedSet(set)
}

func sortedSet(set map[string]bool) []string {
	out := make([]string, 0, len(set))
	for k := range set {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Config returns the summary of the named configuration, or nil.
func (r *Report) Config(name string) *ConfigSummary {
	for _, c := range r.Configurations {
		if c.Name == name {
			return c
		}
	}
	return nil
}

// BaselineName is the configuration the others are compared with: the chat-only run without a
// policy, or, in the brownout experiment, the run without a brownout.
func (r *Report) BaselineName() string {
	switch {
	case len(r.Scenario.Brownout) > 0:
		return ConfigNoBrownout
	case r.Scenario.QuotaProvider != "":
		return ConfigNoQuota
	}
	return ConfigBaseline
}

// Ratio returns the median chat P99 of configuration name divided by that of the baseline
// (BaselineName); ok is false when either is missing.
func (r *Report) Ratio(name string) (ratio float64, ok bool) {
	b, c := r.Config(r.BaselineName()), r.Config(name)
	if b == nil || c == nil || b.ChatP99.N == 0 || c.ChatP99.N == 0 || b.ChatP99.Median <= 0 {
		return 0, false
	}
	return c.ChatP99.Median / b.ChatP99.Median, true
}

// seconds formats a latency statistic: the median and, over several runs, the range.
func seconds(s Stat) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 || s.Min == s.Max {
		return fmt.Sprintf("%.2f", s.Median)
	}
	return fmt.Sprintf("%.2f (%.2f–%.2f)", s.Median, s.Min, s.Max)
}

// count formats a count statistic like seconds.
func count(s Stat) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 || s.Min == s.Max {
		return trimFloat(s.Median)
	}
	return fmt.Sprintf("%s (%s–%s)", trimFloat(s.Median), trimFloat(s.Min), trimFloat(s.Max))
}

func trimFloat(f float64) string {
	return strings.TrimSuffix(strings.TrimRight(fmt.Sprintf("%.1f", f), "0"), ".")
}

// shortFeature names features compactly in the table.
func shortFeature(f string) string {
	if f == FeatureBatch {
		return "batch"
	}
	return f
}

// refusedCell describes the refusals of a configuration, other failures, and for shadow mode
// what would have been refused.
func refusedCell(cs *ConfigSummary) string {
	byFeature := func(m map[string]map[string]Stat) string {
		var parts []string
		for _, f := range sortedKeys(m) {
			var rs []string
			for _, reason := range sortedKeys(m[f]) {
				rs = append(rs, reason+" "+count(m[f][reason]))
			}
			parts = append(parts, shortFeature(f)+": "+strings.Join(rs, ", "))
		}
		return strings.Join(parts, "; ")
	}
	out := byFeature(cs.Refused)
	if out == "" {
		out = "none"
	}
	if len(cs.Shadow) > 0 {
		var rs []string
		for _, reason := range sortedKeys(cs.Shadow) {
			rs = append(rs, reason+" "+count(cs.Shadow[reason]))
		}
		out += "; would refuse: " + strings.Join(rs, ", ")
	}
	if errs := byFeature(cs.Errors); errs != "" {
		out += "; failed without refusal: " + errs
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Markdown renders the results table (the layout of docs/benchmarks.md), with a line on the design
// target below it. Latencies are simulated seconds; each cell is the median over the
// repetitions with the range in brackets.
func (r *Report) Markdown() string {
	switch {
	case len(r.Scenario.Brownout) > 0:
		return r.brownoutMarkdown()
	case r.Scenario.QuotaProvider != "":
		return r.quotaMarkdown()
	}
	var b strings.Builder
	docs := r.Scenario.BatchWorkers * r.Scenario.BatchPerWorker
	fmt.Fprintf(&b, "| configuration | chat P50 (s) | chat P90 (s) | chat P99 (s) | chat failed | batch P99 (s) | batch done (of %d) | refused (x-bulkhead-reason) |\n", docs)
	b.WriteString("|---|---|---|---|---|---|---|---|\n")
	for _, cs := range r.Configurations {
		failed := r.chatFailed(cs.Name)
		batchDone := "—"
		if cs.Storm {
			batchDone = count(cs.BatchDone)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s of %s | %s | %s | %s |\n", cs.Label,
			seconds(cs.ChatP50), seconds(cs.ChatP90), seconds(cs.ChatP99), count(failed), count(cs.ChatRequests),
			seconds(cs.BatchP99), batchDone, refusedCell(cs))
	}
	var lines []string
	for _, cs := range r.Configurations {
		if !cs.Storm {
			continue
		}
		if ratio, ok := r.Ratio(cs.Name); ok {
			verdict := "met"
			if ratio > TargetRatio {
				verdict = "missed"
			}
			lines = append(lines, fmt.Sprintf("%s %.2f× (%s)", cs.Name, ratio, verdict))
		}
	}
	if len(lines) > 0 {
		fmt.Fprintf(&b, "\nChat P99 under the storm ÷ chat P99 of the baseline (target ≤ %.1f×): %s.\n", TargetRatio, strings.Join(lines, ", "))
	}
	b.WriteString(r.stallLine())
	return b.String()
}

// stallLine is the line on the longest process stalls of each configuration's runs.
func (r *Report) stallLine() string {
	var stalls []string
	for _, cs := range r.Configurations {
		if cs.StallMillis.N > 0 {
			stalls = append(stalls, cs.Name+" "+count(Stat{Median: math.Round(cs.StallMillis.Median), Min: math.Round(cs.StallMillis.Min),
				Max: math.Round(cs.StallMillis.Max), N: cs.StallMillis.N}))
		}
	}
	if len(stalls) == 0 {
		return ""
	}
	return fmt.Sprintf("\nLongest stall of the process per run (a 10 ms tick coming late; wall-clock ms, ×%v in simulated time): %s.\n",
		trimFloat(1/r.TimeScale), strings.Join(stalls, ", "))
}

// HealthyThroughputTarget is the brownout experiment's target for the adaptive limit's batch
// throughput in the healthy phases: at least this share of the static limit 10's.
const HealthyThroughputTarget = 0.9

// ThroughputRatio returns the median batch throughput in the healthy phases of configuration
// name divided by that of the static limit of 10 under the brownout; ok is false when either is
// missing.
func (r *Report) ThroughputRatio(name string) (ratio float64, ok bool) {
	b, c := r.Config(ConfigStatic10), r.Config(name)
	if b == nil || c == nil || b.BatchHealthyRate.N == 0 || c.BatchHealthyRate.N == 0 || b.BatchHealthyRate.Median <= 0 {
		return 0, false
	}
	return c.BatchHealthyRate.Median / b.BatchHealthyRate.Median, true
}

// percent formats a share statistic in per cent, like seconds.
func percent(s Stat) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 || s.Min == s.Max {
		return fmt.Sprintf("%.0f %%", 100*s.Median)
	}
	return fmt.Sprintf("%.0f %% (%.0f–%.0f)", 100*s.Median, 100*s.Min, 100*s.Max)
}

// rate formats a throughput statistic like seconds, with one decimal.
func rate(s Stat) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 || s.Min == s.Max {
		return fmt.Sprintf("%.1f", s.Median)
	}
	return fmt.Sprintf("%.1f (%.1f–%.1f)", s.Median, s.Min, s.Max)
}

// brownoutMarkdown renders the brownout experiment's table and its two targets.
func (r *Report) brownoutMarkdown() string {
	var b strings.Builder
	b.WriteString("| configuration | chat P50 (s) | chat P99 (s) | chat P99 ÷ baseline | chat P99, brownout (s) | batch/s, healthy | batch/s, brownout | waiting at the provider: all | waiting at the provider: chat | chat failed | refused (x-bulkhead-reason) |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, cs := range r.Configurations {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s of %s | %s |\n", cs.Label,
			seconds(cs.ChatP50), seconds(cs.ChatP99), r.ratioCell(cs.Name), seconds(cs.ChatBrownoutP99),
			rate(cs.BatchHealthyRate), rate(cs.BatchBrownoutRate), percent(cs.ProviderWaitShare), percent(cs.ChatProviderWaitShare),
			count(r.chatFailed(cs.Name)), count(cs.ChatRequests), refusedCell(cs))
	}
	var p99, thr []string
	for _, cs := range r.Configurations {
		if !cs.Brownout {
			continue
		}
		if v, ok := r.Ratio(cs.Name); ok {
			p99 = append(p99, fmt.Sprintf("%s %.2f× (%s)", cs.Name, v, verdict(v <= TargetRatio)))
		}
		if cs.Name == ConfigStatic10 {
			continue
		}
		if v, ok := r.ThroughputRatio(cs.Name); ok {
			thr = append(thr, fmt.Sprintf("%s %.2f (%s)", cs.Name, v, verdict(v >= HealthyThroughputTarget)))
		}
	}
	if len(p99) > 0 {
		fmt.Fprintf(&b, "\nChat P99 under the brownout ÷ chat P99 without it (target ≤ %.1f×): %s.\n", TargetRatio, strings.Join(p99, ", "))
	}
	if len(thr) > 0 {
		fmt.Fprintf(&b, "\nBatch throughput in the healthy phases ÷ static limit 10's (target ≥ %.2f): %s.\n", HealthyThroughputTarget, strings.Join(thr, ", "))
	}
	b.WriteString(r.stallLine())
	return b.String()
}

// quotaMarkdown renders the provider quota experiment's table and its targets for enforce.
func (r *Report) quotaMarkdown() string {
	var b strings.Builder
	b.WriteString("| configuration | chat P50 (s) | chat P99 (s) | chat P99 ÷ baseline | batch done/s | provider 429s (llm-bulkhead saw) | provider 429s to clients | re-routed for provider_quota | quota short (counted) | chat failed | refused, and failed otherwise (reason) |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, cs := range r.Configurations {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s of %s | %s |\n", cs.Label,
			seconds(cs.ChatP50), seconds(cs.ChatP99), r.ratioCell(cs.Name), rate(cs.BatchRate), count(cs.ProviderQuotaRefused),
			count(cs.Provider429sToClients), count(cs.QuotaRerouted), count(cs.QuotaShort),
			count(r.chatFailed(cs.Name)), count(cs.ChatRequests), refusedCell(cs))
	}
	if cs := r.Config(ConfigQuotaEnforce); cs != nil && cs.Runs > 0 {
		line := fmt.Sprintf("\nEnforce: provider 429s to clients %s (target 0)", count(cs.Provider429sToClients))
		if v, ok := r.Ratio(cs.Name); ok {
			line += fmt.Sprintf(", chat P99 ÷ baseline %.2f× (target ≤ %.1f×, %s)", v, TargetRatio, verdict(v <= TargetRatio))
		}
		b.WriteString(line + ".\n")
	}
	b.WriteString(r.stallLine())
	return b.String()
}

// ratioCell is the table's cell for Ratio: "1.23×", or "—".
func (r *Report) ratioCell(name string) string {
	if v, ok := r.Ratio(name); ok {
		return fmt.Sprintf("%.2f×", v)
	}
	return "—"
}

// chatFailed is the statistic of failed chat requests (refused or failed otherwise) of the
// configuration's runs.
func (r *Report) chatFailed(name string) Stat {
	var xs []float64
	for _, run := range r.Runs {
		if run.Configuration == name {
			xs = append(xs, float64(run.Summary.ChatRefused+run.Summary.ChatErrors))
		}
	}
	return Summarize(xs)
}

func verdict(met bool) string {
	if met {
		return "met"
	}
	return "missed"
}

// Files written by WriteFiles; FileTrace only with a brownout.
const (
	FileTable = "table.md"
	FileChart = "chat-latency.svg"
	FileTrace = "limit-trace.svg"
	FileJSON  = "results.json"
)

// WriteFiles writes the table (with a header naming the setting), the chart and the raw numbers
// into dir, creating it.
func (r *Report) WriteFiles(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var md strings.Builder
	title := "Storm experiment results"
	switch {
	case len(r.Scenario.Brownout) > 0:
		title = "Provider brownout results"
	case r.Scenario.QuotaProvider != "":
		title = "Provider quota results"
	}
	fmt.Fprintf(&md, "# %s\n\n%s\n\n", title, r.Setting())
	md.WriteString(r.Markdown())
	fmt.Fprintf(&md, "\n![chat latency distribution](%s)\n", FileChart)
	js, err := json.MarshalIndent(r, "", " ")
	if err != nil {
		return err
	}
	files := map[string][]byte{FileChart: r.SVG(), FileJSON: append(js, '\n')}
	if len(r.Scenario.Brownout) > 0 {
		files[FileTrace] = r.TraceSVG()
		fmt.Fprintf(&md, "\n![limit and queues over time](%s)\n", FileTrace)
	}
	files[FileTable] = []byte(md.String())
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// Setting describes the run in one paragraph: machine, scale, capacity, repetitions, seed.
func (r *Report) Setting() string {
	load := ""
	if r.LoadAverageStart != "" {
		load = fmt.Sprintf(", load average %s at the start and %s at the end", r.LoadAverageStart, r.LoadAverageEnd)
	}
	runs := fmt.Sprintf("%d runs", r.Repeat)
	if r.Repeat == 1 {
		runs = "1 run"
	}
	capacity := fmt.Sprintf("upstream capacity %d", r.Capacity)
	switch {
	case len(r.Scenario.Brownout) > 0:
		capacity = fmt.Sprintf("upstream capacity %s under the brownout and %d without it", r.Scenario.Brownout, r.Scenario.Brownout[0].Capacity)
	case r.Scenario.QuotaProvider != "":
		capacity += fmt.Sprintf(", %s's account quota %s (simulated)", r.Scenario.QuotaProvider, r.Scenario.QuotaString())
	}
	return fmt.Sprintf("%s per configuration (median, range in brackets), time scale %v, %s, random seed %d; "+
		"%s/%s, %d CPUs, %s%s; %.0f s of wall time. Latencies in simulated seconds; failed chat requests count as %v.",
		runs, r.TimeScale, capacity, r.Seed, r.Machine.OS, r.Machine.Arch, r.Machine.CPUs, r.Machine.GoVersion, load,
		r.WallSeconds, r.Scenario.ChatTimeout)
}

// chatLatencies returns every chat latency of a configuration over all its runs, failures
// counted at the chat timeout, sorted.
func (r *Report) chatLatencies(name string) []float64 {
	var out []float64
	penalty := r.Scenario.ChatTimeout.Seconds()
	for _, run := range r.Runs {
		if run.Configuration != name {
			continue
		}
		for _, s := range run.Chat {
			if s.Outcome == OutcomeOK {
				out = append(out, s.Latency)
			} else {
				out = append(out, penalty)
			}
		}
	}
	slices.Sort(out)
	return out
}
