package storm

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

func TestBrownoutScenario(t *testing.T) {
	sc := BrownoutScenario()
	if err := sc.Validate(); err != nil {
		t.Fatalf("the brownout scenario does not validate: %v", err)
	}
	want := []Phase{{0, 10, 10, true}, {10, 25, 4, false}, {25, 40, 10, true}}
	got := sc.Phases()
	if len(got) != len(want) {
		t.Fatalf("phases %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("phase %d = %+v, want %+v", i, got[i], want[i])
		}
	}
	if sc.BatchDocuments() != 0 {
		t.Errorf("a steady load has %d documents, want 0 (no fixed number)", sc.BatchDocuments())
	}

	bad := sc
	bad.Brownout = mock.CapacitySchedule{{At: 0, Capacity: 10}, {At: time.Minute, Capacity: 4}}
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "changes nothing within the run") {
		t.Errorf("a brownout after the run: %v", err)
	}
	bad.Brownout = mock.CapacitySchedule{{At: time.Second, Capacity: 10}, {At: 2 * time.Second, Capacity: 4}}
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "first step must be at 0s") {
		t.Errorf("a brownout without a first capacity: %v", err)
	}
	bad = sc
	bad.BatchWorkers = 0
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "0 batch workers") {
		t.Errorf("a steady load without workers: %v", err)
	}
}

func TestParseAdaptive(t *testing.T) {
	got, err := ParseAdaptive(" min=2, max=20 ,interval=500ms")
	if err != nil {
		t.Fatal(err)
	}
	if FormatAdaptive(got) != "interval=500ms,max=20,min=2" {
		t.Errorf("ParseAdaptive → %v", got)
	}
	if got, err := ParseAdaptive(""); err != nil || len(got) != 0 {
		t.Errorf("empty settings: %v, %v", got, err)
	}
	for in, want := range map[string]string{"min": "want key=value", "min=1,min=2": "given twice", "=3": "want key=value", "max=": "want key=value"} {
		if _, err := ParseAdaptive(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseAdaptive(%q) = %v, want an error containing %q", in, err, want)
		}
	}
}

// derivedProvider is deepseek's entry of a derived policy, which must load.
type derivedProvider struct {
	MaxConcurrent string            `yaml:"max_concurrent"`
	MaxWait       string            `yaml:"max_wait"`
	Adaptive      map[string]string `yaml:"adaptive"`
}

func providerOf(t *testing.T, b []byte) derivedProvider {
	t.Helper()
	if _, err := config.Load("derived", b, []string{}); err != nil {
		t.Fatalf("derived policy does not load: %v\n%s", err, b)
	}
	var doc struct {
		Providers map[string]derivedProvider `yaml:"providers"`
	}
	if err := yaml.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	p, ok := doc.Providers["deepseek"]
	if !ok {
		t.Fatalf("no provider deepseek in\n%s", b)
	}
	return p
}

func TestDeriveProviderLimit(t *testing.T) {
	b, err := DerivePolicy("brownout", BrownoutPolicy, Variant{ProviderLimit: "4", TimeScale: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	if p := providerOf(t, b); p.MaxConcurrent != "4" || p.MaxWait != "800ms" || p.Adaptive != nil {
		t.Errorf("static 4 at scale 0.1: %+v; want max_concurrent 4 and max_wait 800ms", p)
	}

	b, err = DerivePolicy("brownout", BrownoutPolicy, Variant{ProviderLimit: "adaptive", Adaptive: DefaultAdaptive, TimeScale: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	p := providerOf(t, b)
	want := map[string]string{"min": "2", "max": "20", "initial": "10", "interval": "50ms"}
	if p.MaxConcurrent != "adaptive" || len(p.Adaptive) != len(want) {
		t.Fatalf("adaptive provider = %+v, want max_concurrent adaptive with %v", p, want)
	}
	for k, v := range want {
		if p.Adaptive[k] != v {
			t.Errorf("adaptive.%s = %q, want %q (interval scaled by 0.1)", k, p.Adaptive[k], v)
		}
	}

	// Back to a number: the adaptive settings go.
	b2, err := DerivePolicy("adaptive", b, Variant{ProviderLimit: "10"})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b2), "interval") {
		t.Errorf("a static limit kept the adaptive settings:\n%s", b2)
	}
	if p := providerOf(t, b2); p.MaxConcurrent != "10" {
		t.Errorf("max_concurrent %s, want 10", p.MaxConcurrent)
	}

	if _, err := DerivePolicy("brownout", BrownoutPolicy, Variant{ProviderLimit: "adaptive", Adaptive: map[string]string{"colour": "red"}}); err == nil {
		t.Error("an unknown adaptive setting was accepted")
	}
	if _, err := DerivePolicy("no providers", []byte("features:\n  chat: {max_concurrent: 1}\n"), Variant{ProviderLimit: "4"}); err == nil ||
		!strings.Contains(err.Error(), "providers section") {
		t.Errorf("a provider limit without providers: %v", err)
	}
}

// TestBrownoutSmoke runs a short brownout ten times faster than real time through every
// brownout configuration and checks its plumbing: the upstream's capacity followed the schedule
// in the brownout runs and stayed put in the baseline, the proxy held the limit each
// configuration asks for, batch documents were answered in every phase, waits were measured on
// both sides, and the report, table and charts are complete. Latencies and the targets are the
// report's business, not this test's.
func TestBrownoutSmoke(t *testing.T) {
	sc := BrownoutScenario()
	// The brownout phase is the longest (6 s, 0.6 s of wall time): long enough for chat and
	// batch to reach the provider in it on a loaded machine.
	sc.Duration = 14 * time.Second
	sc.Chat = []TenantShare{{Tenant: "acme", Users: 4}, {Tenant: "globex", Users: 2}}
	sc.ThinkMin, sc.ThinkMax = time.Second, 2*time.Second
	sc.Brownout = mock.CapacitySchedule{{At: 0, Capacity: 10}, {At: 4 * time.Second, Capacity: 4}, {At: 10 * time.Second, Capacity: 10}}
	cfgs := BrownoutConfigurations("", nil, DefaultAdaptive, DefaultFollowDelay)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, Options{Scenario: sc, Configurations: cfgs, TimeScale: 0.1, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != len(cfgs) {
		t.Fatalf("%d runs for %d configurations", len(rep.Runs), len(cfgs))
	}
	for _, r := range rep.Runs {
		t.Run(r.Configuration, func(t *testing.T) {
			cfg := rep.Config(r.Configuration).Configuration
			s := r.Summary
			if len(r.Trace) < 10 {
				t.Fatalf("%d trace points", len(r.Trace))
			}
			// The mock LLM's capacity followed the schedule: 10, then 4, then 10 again, in
			// that order, under the brownout; 10 throughout without it. (When exactly each
			// change was sampled depends on the machine's load, so only the order is checked.)
			var steps, limits []int
			for _, tp := range r.Trace {
				if len(steps) == 0 || steps[len(steps)-1] != tp.Capacity {
					steps = append(steps, tp.Capacity)
				}
				if len(limits) == 0 || limits[len(limits)-1] != int(tp.Limit) {
					limits = append(limits, int(tp.Limit))
				}
				switch {
				case cfg.FollowCapacity:
				case cfg.ProviderLimit == "adaptive":
					if tp.Limit < 2 || tp.Limit > 20 {
						t.Errorf("at %.2f s the adaptive limit was %d, outside [2, 20]", tp.At, tp.Limit)
					}
					if tp.Adaptive == nil {
						t.Errorf("at %.2f s no adaptive state in the trace", tp.At)
					}
				default:
					if want := cfg.ProviderLimit; tp.Limit != int64(atoi(t, want)) {
						t.Errorf("at %.2f s the limit was %d, want %s", tp.At, tp.Limit, want)
					}
				}
			}
			want := []int{10}
			if cfg.Brownout {
				want = []int{10, 4, 10}
			}
			if !slices.Equal(steps, want) {
				t.Errorf("the upstream's capacity went %v, want %v", steps, want)
			}
			// Following the capacity, the limit went the same way, by policy reloads.
			if cfg.FollowCapacity && !slices.Equal(limits, want) {
				t.Errorf("the limit went %v, want %v", limits, want)
			}
			if s.ChatRequests == 0 || s.ChatOK+s.ChatRefused+s.ChatErrors != s.ChatRequests {
				t.Errorf("chat: %+v", s)
			}
			if s.BatchHealthyRate == nil || *s.BatchHealthyRate <= 0 || s.BatchBrownoutRate == nil || *s.BatchBrownoutRate <= 0 {
				t.Errorf("batch rates %v / %v, want documents answered in both kinds of phase", optF(s.BatchHealthyRate), optF(s.BatchBrownoutRate))
			}
			if s.ChatBrownoutP99 == nil {
				t.Error("no chat request started during the brownout phase")
			}
			// Twelve workers queue for ten slots: somebody waits in llm-bulkhead in every run.
			if s.ProxyWait[FeatureBatch] <= 0 {
				t.Errorf("batch waited %v s on its way to the provider", s.ProxyWait[FeatureBatch])
			}
			// Ten admitted against a capacity of four: the static limit of 10 queues at the
			// provider during the brownout, and every wait is in the samples.
			if cfg.Name == ConfigStatic10 {
				if r.UpstreamPeakQueued == 0 || s.ProviderWait[FeatureBatch] <= 0 {
					t.Errorf("static 10 under the brownout: upstream queue peak %d, provider wait %v", r.UpstreamPeakQueued, s.ProviderWait)
				}
				if _, ok := s.ProviderShare(""); !ok {
					t.Error("no provider share")
				}
			}
			var answered int
			for _, b := range r.Batch {
				if b.Outcome == OutcomeOK {
					answered++
				}
			}
			if answered == 0 || answered != r.Answered[FeatureBatch] {
				t.Errorf("%d documents answered, counters say %d", answered, r.Answered[FeatureBatch])
			}
		})
	}

	md := rep.Markdown()
	if rows := strings.Count(md, "\n| "); rows != len(cfgs) {
		t.Errorf("%d table rows, want %d:\n%s", rows, len(cfgs), md)
	}
	for _, want := range []string{"Chat P99 under the brownout ÷ chat P99 without it", "static-10 ", "static-4 ", "adaptive ",
		"Batch throughput in the healthy phases ÷ static limit 10's"} {
		if !strings.Contains(md, want) {
			t.Errorf("table lacks %q:\n%s", want, md)
		}
	}
	dir := t.TempDir()
	if err := rep.WriteFiles(dir); err != nil {
		t.Fatal(err)
	}
	for file, lines := range map[string]int{FileChart: len(cfgs), FileTrace: 6} {
		svg, err := os.ReadFile(filepath.Join(dir, file))
		if err != nil {
			t.Fatal(err)
		}
		if n := wellFormed(t, svg); n["polyline"] != lines {
			t.Errorf("%s: %d lines, want %d", file, n["polyline"], lines)
		}
	}
}

func atoi(t *testing.T, s string) int {
	t.Helper()
	var n int
	for _, c := range s {
		if c < '0' || c > '9' {
			t.Fatalf("limit %q is not a number", s)
		}
		n = n*10 + int(c-'0')
	}
	return n
}

func optF(v *float64) any {
	if v == nil {
		return "none"
	}
	return *v
}

func TestSampleWaits(t *testing.T) {
	r := &run{scale: 0.5}
	t0 := time.Unix(1000, 0)
	r.t0 = t0
	res := &envoysim.Result{Status: 200, Started: t0.Add(time.Second), Completed: t0.Add(3 * time.Second),
		Headers: envoysim.Headers{{Key: mock.HeaderQueueWait, Value: "1.250"}}}
	s := r.sampleOf(res, t0.Add(1500*time.Millisecond), nil, "acme")
	if s.Outcome != OutcomeOK || s.Start != 2 || s.Latency != 4 || s.ProxyWait != 1 || s.ProviderWait != 1.25 {
		t.Fatalf("sample %+v, want start 2, latency 4, 1 s on the way and 1.25 s at the provider (simulated)", s)
	}
	// A refusal never reached the provider: all its time was spent on the way.
	res = &envoysim.Result{Status: 503, Local: envoysim.LocalImmediate, Started: t0, Completed: t0.Add(time.Second),
		Headers: envoysim.Headers{{Key: "x-bulkhead-reason", Value: "bulkhead_full"}}}
	if s := r.sampleOf(res, time.Time{}, nil, "acme"); s.ProxyWait != 2 || s.ProviderWait != 0 {
		t.Fatalf("refusal sample %+v, want 2 s on the way and none at the provider", s)
	}
}

// TestBrownoutSummary checks the brownout's numbers on a hand-made run: phases by the time of
// the answer, chat P99 of the requests started in the brownout, waits per feature and the share
// of waiting at the provider.
func TestBrownoutSummary(t *testing.T) {
	sc := BrownoutScenario() // healthy 0–10 s and 25–40 s (25 s), brownout 10–25 s (15 s)
	res := &RunResult{
		Chat: []Sample{
			{Start: 5, Latency: 0.5, Outcome: OutcomeOK, ProxyWait: 0.1},
			{Start: 12, Latency: 2, Outcome: OutcomeOK, ProxyWait: 0.2, ProviderWait: 1.2},
			{Start: 20, Latency: 1, Outcome: OutcomeRefused, ProxyWait: 1},
		},
		Batch: []Sample{
			{Start: 1, Latency: 1, Outcome: OutcomeOK, ProxyWait: 0.5},         // answered at 2 s: healthy
			{Start: 9.5, Latency: 1, Outcome: OutcomeOK, ProviderWait: 0.3},    // at 10.5 s: brownout
			{Start: 24.5, Latency: 0.4, Outcome: OutcomeOK, ProviderWait: 0.2}, // at 24.9 s: brownout
			{Start: 24.5, Latency: 0.5, Outcome: OutcomeOK},                    // at 25 s: healthy
			{Start: 30, Latency: 1, Outcome: OutcomeRefused, ProxyWait: 2},     // refused: not counted
			{Start: 39.5, Latency: 1, Outcome: OutcomeOK},                      // after the run: not counted
		},
	}
	s := summarizeRun(res, sc)
	if s.BatchHealthyRate == nil || *s.BatchHealthyRate != 2.0/25 || s.BatchBrownoutRate == nil || *s.BatchBrownoutRate != 2.0/15 {
		t.Errorf("batch rates %v healthy, %v brownout; want 2/25 and 2/15", optF(s.BatchHealthyRate), optF(s.BatchBrownoutRate))
	}
	// The brownout's chat requests: 2 s and a refusal counted at the 30-s timeout.
	if s.ChatBrownoutP99 == nil || *s.ChatBrownoutP99 < 29 {
		t.Errorf("chat P99 in the brownout = %v, want the refusal's 30 s to dominate", optF(s.ChatBrownoutP99))
	}
	if s.ProviderWait[FeatureChat] != 1.2 || s.ProxyWait[FeatureChat] != 1.3 || s.ProviderWait[FeatureBatch] != 0.5 || s.ProxyWait[FeatureBatch] != 2.5 {
		t.Errorf("waits at the provider %v, on the way %v", s.ProviderWait, s.ProxyWait)
	}
	if share, ok := s.ProviderShare(FeatureChat); !ok || share != 1.2/2.5 {
		t.Errorf("chat's share at the provider = %v (%v), want 0.48", share, ok)
	}
	if share, ok := s.ProviderShare(""); !ok || share != 1.7/5.5 {
		t.Errorf("the share at the provider = %v (%v), want 1.7/5.5", share, ok)
	}
	if _, ok := (RunSummary{}).ProviderShare(""); ok {
		t.Error("a share without any waiting")
	}
	// Without a brownout none of this is computed.
	if s := summarizeRun(res, DefaultScenario()); s.BatchHealthyRate != nil || s.ChatBrownoutP99 != nil || s.ProviderWait != nil {
		t.Errorf("brownout numbers without a brownout: %+v", s)
	}
}

func TestTimeChart(t *testing.T) {
	svg := TimeChart("t <&>", "requests", 40, []TimeSeries{
		{Label: "capacity", Points: []TimePoint{{0, 10}, {10, 10}, {10, 4}, {25, 4}, {25, 10}, {40, 10}}},
		{Label: "queue", Points: []TimePoint{{0, 0}, {12, 6}}, Dashed: true},
		{Label: "empty"},
	})
	n := wellFormed(t, svg)
	if n["polyline"] != 2 {
		t.Errorf("%d lines, want 2 (an empty series draws only its legend)", n["polyline"])
	}
	if !strings.Contains(string(svg), "t &lt;&amp;&gt;") || !strings.Contains(string(svg), `stroke-dasharray="6 4"`) {
		t.Errorf("title not escaped or dashes missing:\n%s", svg)
	}
	for v, want := range map[float64]float64{0.3: 0.5, 1: 1, 1.2: 2, 3: 5, 7: 10, 40.0 / 8: 5, 0: 1} {
		if got := niceStep(v); got != want {
			t.Errorf("niceStep(%v) = %v, want %v", v, got, want)
		}
	}
}
