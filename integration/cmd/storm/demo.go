package main

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/llm-bulkhead/llm-bulkhead/integration/storm"
)

// demoIntro explains what --demo runs and how to read its progress lines, before the first one.
// Every number comes from the scenario and the options, so the text stays true when they change.
func demoIntro(sc storm.Scenario, capacity int, scale float64) string {
	var tenants []string
	for _, t := range sc.Chat {
		tenants = append(tenants, t.Tenant)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d chat users of %s send %s-token chat requests; %v in, %s's export sends %d %s-token\n",
		sc.ChatUsers(), joinAnd(tenants), kilo(sc.ChatTokens.Total()), sc.StormAt, sc.BatchTenant,
		sc.BatchWorkers*sc.BatchPerWorker, kilo(sc.BatchTokens.Total()))
	fmt.Fprintf(&b, "summaries at once. The mock LLM answers in (0.2 s + tokens/10000 s) × uniform(0.9, 1.3) and serves\n"+
		"%s, first come first served. ", serves(capacity))
	if sc.BatchRetry {
		fmt.Fprintf(&b, "A refused request is told when to try again (retry-after):\n"+
			"the export waits that long and sends the summary again, until the run ends at %v. A document is\n"+
			"done when its summary comes back, and given up when its retry-after would end after the run.\n", sc.Duration)
	} else {
		fmt.Fprintf(&b, "The export drops a refused summary\n"+
			"(--batch-retry=false): a document is done when its summary comes back, and given up when its\n"+
			"request is refused. The run ends at %v.\n", sc.Duration)
	}
	fmt.Fprintf(&b, "Every wall-clock second, a line: the requests each feature got admitted (sent upstream) and refused\n"+
		"since the last line, first tries and retries alike, the summaries that came back, the slowest chat\n"+
		"answer, and the mock LLM's pool. t is simulated time (%.1f× real time).\n", 1/scale)
	return b.String()
}

// explainRun says, after a run, what became of the batch documents and why: how many requests
// they took, which compartments refused them (and chat) with what limits, what was re-routed,
// and why the documents that did not finish gave up. It returns nothing for a run with nothing to explain.
func explainRun(r *storm.RunResult, sc storm.Scenario) []string {
	var lines []string
	if n := len(r.Batch); n > 0 {
		attempts, done := 0, 0
		for _, d := range r.Batch {
			attempts += d.Attempts
			if d.Outcome == storm.OutcomeOK {
				done++
			}
		}
		l := fmt.Sprintf("batch: %s in %s", plural(n, "document"), plural(attempts, "request"))
		if retries := attempts - n; retries > 0 {
			l += fmt.Sprintf(" (%s after a refusal)", plural(retries, "retry"))
		}
		lines = append(lines, l+fmt.Sprintf(": %d summarised", done))
	}
	for _, feature := range []string{storm.FeatureChat, storm.FeatureBatch} {
		byComp := r.RefusedBy[feature]
		comps := make([]string, 0, len(byComp))
		for c := range byComp {
			comps = append(comps, c)
		}
		sort.Slice(comps, func(i, j int) bool {
			if a, b := sum(byComp[comps[i]]), sum(byComp[comps[j]]); a != b {
				return a > b
			}
			return comps[i] < comps[j]
		})
		for _, c := range comps {
			name := c
			if name == "" {
				name = "(no compartment named)"
			}
			l := fmt.Sprintf("%s refused by %s", short(feature), name)
			if r.Engine != nil {
				if lim, ok := r.Engine.Limits[c]; ok {
					if d := describeLimits(lim, feature, sc); d != "" {
						l += " (" + d + ")"
					}
				}
			}
			lines = append(lines, l+": "+counts(byComp[c]))
		}
	}
	if r.Engine != nil {
		for _, rr := range r.Engine.Reroutes {
			lines = append(lines, fmt.Sprintf("%s re-routed instead of refused (%s): %d from %s to %s",
				short(rr.Feature), rr.Reason, rr.Count, rr.From, rr.To))
		}
	}
	return append(lines, endings(r.Batch, sc)...)
}

// endings explains the documents that were not summarised, grouped by how their last attempt
// ended.
func endings(docs []storm.Sample, sc storm.Scenario) []string {
	type key struct{ outcome, reason, compartment string }
	type group struct {
		n        int
		min, max float64
	}
	groups := map[key]*group{}
	var keys []key
	for _, d := range docs {
		if d.Outcome == storm.OutcomeOK {
			continue
		}
		k := key{d.Outcome, d.Reason, d.Compartment}
		g := groups[k]
		if g == nil {
			g = &group{min: d.RetryAfter, max: d.RetryAfter}
			groups[k] = g
			keys = append(keys, k)
		}
		g.n++
		g.min, g.max = min(g.min, d.RetryAfter), max(g.max, d.RetryAfter)
	}
	sort.Slice(keys, func(i, j int) bool {
		if a, b := groups[keys[i]].n, groups[keys[j]].n; a != b {
			return a > b
		}
		return fmt.Sprint(keys[i]) < fmt.Sprint(keys[j])
	})
	var out []string
	for _, k := range keys {
		g := groups[k]
		switch {
		case k.outcome != storm.OutcomeRefused:
			out = append(out, fmt.Sprintf("%s failed (%s)", plural(g.n, "document"), k.reason))
		case !sc.BatchRetry:
			out = append(out, fmt.Sprintf("%s dropped after a refusal (%s by %s)", plural(g.n, "document"), k.reason, k.compartment))
		default:
			wait := "without a retry-after"
			if g.max > 0 {
				wait = "retry-after " + secondsRange(g.min, g.max)
			}
			out = append(out, fmt.Sprintf("%s given up: refused %s by %s with %s, after the run's end (%v)",
				plural(g.n, "document"), k.reason, k.compartment, wait, sc.Duration))
		}
	}
	return out
}

// describeLimits renders a compartment's limits; a token budget also in requests of the
// feature's size, which is what bounds how many of them can finish within a run.
func describeLimits(l storm.CompartmentLimits, feature string, sc storm.Scenario) string {
	size, what := sc.ChatTokens.Total(), "chat requests"
	if feature == storm.FeatureBatch {
		size, what = sc.BatchTokens.Total(), "documents"
	}
	// Not its max_wait: a request queues for the shortest of its compartments' waits, which may
	// be another compartment's.
	var parts []string
	if l.MaxConcurrent > 0 {
		parts = append(parts, fmt.Sprintf("%d at once", l.MaxConcurrent))
	}
	budget := func(capacity int64, per string) {
		if capacity <= 0 {
			return
		}
		p := fmt.Sprintf("%s tokens a %s", thousands(capacity), per)
		if size > 0 {
			p += fmt.Sprintf(" = %d %s of %s tokens", capacity/int64(size), what, thousands(int64(size)))
		}
		parts = append(parts, p)
	}
	budget(l.TokensPerMinute, "minute")
	budget(l.TokensPerDay, "day")
	if l.RequestsPerMinute > 0 {
		parts = append(parts, fmt.Sprintf("%d requests a minute", l.RequestsPerMinute))
	}
	return strings.Join(parts, "; ")
}

// counts renders reason counts, largest first.
func counts(m map[string]int) string {
	keys := sortedKeys(m)
	sort.SliceStable(keys, func(i, j int) bool { return m[keys[i]] > m[keys[j]] })
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}

// secondsRange renders a range of seconds, or one value when both ends agree.
func secondsRange(lo, hi float64) string {
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
	if lo == hi {
		return f(lo) + " s"
	}
	return f(lo) + "–" + f(hi) + " s"
}

// plural renders n and its noun, with an s (or ies) when n is not 1.
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	if strings.HasSuffix(noun, "y") {
		return fmt.Sprintf("%d %sies", n, strings.TrimSuffix(noun, "y"))
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// joinAnd joins names as prose: "a", "a and b", "a, b and c".
func joinAnd(names []string) string {
	if len(names) <= 1 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
}

// kilo renders a token count as 2K when it is whole thousands.
func kilo(n int) string {
	if n > 0 && n%1000 == 0 {
		return strconv.Itoa(n/1000) + "K"
	}
	return strconv.Itoa(n)
}

// thousands renders n with a space between groups of three digits: 75 000.
func thousands(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(' ')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// serves says how many requests the mock LLM serves at once.
func serves(capacity int) string {
	if capacity <= 0 {
		return "any number at a time"
	}
	return fmt.Sprintf("%d at a time", capacity)
}
