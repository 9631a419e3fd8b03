package policy_test

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/internal/stall"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

const adaptivePolicy = `
classification:
  provider:
    default: openai
  feature:
    rules: [{header: x-llm-feature}]
providers:
  openai:
    max_concurrent: adaptive
    adaptive: {min: 1, max: 8, initial: 4, interval: 1s, remeasure_interval: 1h}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`

// adaptiveView returns the single compartment's view, failing unless it is adaptive.
func adaptiveView(t *testing.T, e *policy.Engine) policy.CompartmentView {
	t.Helper()
	views := e.Compartments()
	if len(views) != 1 || views[0].Adaptive == nil {
		t.Fatalf("want one adaptive compartment, got %+v", views)
	}
	return views[0]
}

// saturate admits requests until the compartment refuses one, and returns the admitted.
func saturate(t *testing.T, e *policy.Engine) []*policy.Ticket {
	t.Helper()
	var out []*policy.Ticket
	for range 100 {
		d, tk := admit(t, e, input{}, 1000)
		if d.Verdict != policy.Admit {
			return out
		}
		out = append(out, tk)
	}
	t.Fatal("the adaptive compartment never refused")
	return nil
}

// rounds runs n rounds of: fill the compartment, let a second pass, finish everything with o.
func rounds(t *testing.T, e *policy.Engine, clk *clock, n int, o policy.Outcome) {
	t.Helper()
	for range n {
		tickets := saturate(t, e)
		clk.Advance(500 * time.Millisecond)
		for _, tk := range tickets {
			tk.Done(o)
		}
	}
}

// TestAdaptiveLimitMovesAndIsEnforced: the compartment admits as many requests as its learned
// limit, no more; a saturated limit with a fast first token grows, upstream 429s cut it.
func TestAdaptiveLimitMovesAndIsEnforced(t *testing.T) {
	e, clk := engine(t, adaptivePolicy)
	first := saturate(t, e)
	if len(first) != 4 {
		t.Fatalf("admitted %d at the initial limit, want 4", len(first))
	}
	for _, tk := range first {
		tk.Done(policy.Outcome{Cancelled: true}) // no response: nothing to learn
	}
	healthy := policy.Outcome{Status: 200, TTFB: 120 * time.Millisecond, Duration: 2 * time.Second}
	rounds(t, e, clk, 12, healthy)
	v := adaptiveView(t, e)
	if v.MaxConcurrent != 8 || v.Adaptive.Limit != 8 || v.Adaptive.Increases == 0 {
		t.Fatalf("after saturated healthy rounds: %+v / %+v, want the limit grown to max 8", v, *v.Adaptive)
	}
	if got := len(saturate(t, e)); got != 8 {
		t.Errorf("admitted %d at the learned limit 8", got)
	}
	e, clk = engine(t, adaptivePolicy)
	rounds(t, e, clk, 6, policy.Outcome{Status: 429})
	v = adaptiveView(t, e)
	if v.Adaptive.Limit != 1 || v.Adaptive.BackoffsUpstream == 0 || v.MaxConcurrent != 1 {
		t.Fatalf("after 429 rounds: %+v / %+v, want the limit at min 1", v, *v.Adaptive)
	}
	if got := len(saturate(t, e)); got != 1 {
		t.Errorf("admitted %d at the learned limit 1", got)
	}
}

// TestAdaptiveShrinkRevokesNothing: a limit cut below the requests in flight leaves them
// running; new requests wait for the count to drop below the new limit.
func TestAdaptiveShrinkRevokesNothing(t *testing.T) {
	e, clk := engine(t, adaptivePolicy)
	// Four long requests keep their slots while others bring 503s.
	long := saturate(t, e)
	for range 3 {
		clk.Advance(600 * time.Millisecond)
		// One slot at a time: finish one long request with 503, admit another.
		tk := long[0]
		long = long[1:]
		tk.Done(policy.Outcome{Status: 503})
		for range 2 {
			if d, t2 := admit(t, e, input{}, 1000); d.Verdict == policy.Admit {
				long = append(long, t2)
			}
		}
	}
	// Enough 503s for a window.
	for range 6 {
		clk.Advance(300 * time.Millisecond)
		if d, tk := admit(t, e, input{}, 1000); d.Verdict == policy.Admit {
			tk.Done(policy.Outcome{Status: 503})
		} else {
			long[0].Done(policy.Outcome{Status: 503})
			long = long[1:]
		}
	}
	v := adaptiveView(t, e)
	if v.Adaptive.Limit >= 4 {
		t.Fatalf("503s did not cut the limit: %+v", *v.Adaptive)
	}
	if v.InFlight != int64(len(long)) {
		t.Fatalf("in flight %d, want the %d requests still running", v.InFlight, len(long))
	}
	if v.InFlight >= v.Adaptive.Limit {
		if d, _ := admit(t, e, input{}, 1000); d.Verdict == policy.Admit {
			t.Errorf("admitted with %d in flight above the limit %d", v.InFlight, v.Adaptive.Limit)
		}
	}
	for _, tk := range long {
		tk.Done(policy.Outcome{Status: 200})
	}
	if got := len(saturate(t, e)); int64(got) != v.Adaptive.Limit {
		t.Errorf("after the drain admitted %d, want the limit %d", got, v.Adaptive.Limit)
	}
}

// TestAdaptiveReload: a reload that keeps the adaptive settings keeps the learned limit; one
// that changes them starts again at initial; one that sets a number puts the number in force.
func TestAdaptiveReload(t *testing.T) {
	e, clk := engine(t, adaptivePolicy)
	rounds(t, e, clk, 12, policy.Outcome{Status: 200, TTFB: 100 * time.Millisecond})
	if got := adaptiveView(t, e).MaxConcurrent; got != 8 {
		t.Fatalf("learned %d, want 8", got)
	}
	apply := func(yaml string) {
		t.Helper()
		p, err := config.Load("v2.yaml", []byte(yaml), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Apply(p); err != nil {
			t.Fatal(err)
		}
	}
	// Same adaptive settings, another feature rule: the learned limit stays.
	apply(strings.Replace(adaptivePolicy, "x-llm-feature", "x-feature", 1))
	if got := adaptiveView(t, e).MaxConcurrent; got != 8 {
		t.Errorf("after a reload that kept the settings the limit is %d, want the learned 8", got)
	}
	apply(strings.Replace(adaptivePolicy, "initial: 4", "initial: 3", 1))
	if v := adaptiveView(t, e); v.MaxConcurrent != 3 || v.Adaptive.Limit != 3 {
		t.Errorf("after a reload with a new initial: %d / %+v, want 3", v.MaxConcurrent, *v.Adaptive)
	}
	apply(strings.Replace(strings.Replace(adaptivePolicy, "max_concurrent: adaptive", "max_concurrent: 6", 1),
		"    adaptive: {min: 1, max: 8, initial: 4, interval: 1s, remeasure_interval: 1h}\n", "", 1))
	views := e.Compartments()
	if len(views) != 1 || views[0].Adaptive != nil || views[0].MaxConcurrent != 6 {
		t.Fatalf("after a reload to a fixed 6: %+v", views)
	}
	if got := len(saturate(t, e)); got != 6 {
		t.Errorf("admitted %d under the fixed limit 6", got)
	}
}

// TestAdaptiveShadow: in shadow mode nothing is refused, and the limit the algorithm would set
// is reported, with what it would have refused.
func TestAdaptiveShadow(t *testing.T) {
	e, clk := engine(t, strings.Replace(adaptivePolicy, "max_concurrent: adaptive", "max_concurrent: adaptive\n    mode: shadow", 1))
	var held []*policy.Ticket
	for range 10 {
		d, tk := admit(t, e, input{}, 1000)
		if d.Verdict != policy.Admit {
			t.Fatalf("shadow mode refused: %+v", d)
		}
		held = append(held, tk)
	}
	v := adaptiveView(t, e)
	if v.Mode != "shadow" || v.MaxConcurrent != 4 || v.ShadowRefusals != 6 {
		t.Errorf("shadow view %+v, want limit 4 reported with 6 would-be refusals", v)
	}
	for range 8 {
		clk.Advance(300 * time.Millisecond)
		held[0].Done(policy.Outcome{Status: 429})
		held = held[1:]
		if len(held) < 3 {
			_, tk := admit(t, e, input{}, 1000)
			held = append(held, tk)
		}
	}
	if v := adaptiveView(t, e); v.Adaptive.Limit >= 4 {
		t.Errorf("429s in shadow mode left the reported limit at %d", v.Adaptive.Limit)
	}
	for _, tk := range held {
		tk.Done(policy.Outcome{Status: 200})
	}
}

// TestAdaptiveMetrics: the learned limit, baselines and signals are exported per compartment.
func TestAdaptiveMetrics(t *testing.T) {
	p, err := config.Load("test.yaml", []byte(adaptivePolicy), nil)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	clk := newClock()
	e, err := observe.NewEngine(p, policy.Options{Clock: clk, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, reg)
	if err != nil {
		t.Fatal(err)
	}
	rounds(t, e, clk, 12, policy.Outcome{Status: 200, TTFB: 100 * time.Millisecond, InterToken: 20 * time.Millisecond})
	got := gathered(t, reg)
	for key, want := range map[string]float64{
		"llm_bulkhead_adaptive_limit":                        8,
		"llm_bulkhead_adaptive_baseline_seconds/ttfb":        0.1 / 1.5, // 500 prompt tokens
		"llm_bulkhead_adaptive_baseline_seconds/inter_token": 0.02,
		"llm_bulkhead_adaptive_signal_seconds/inter_token":   0.02,
		"llm_bulkhead_adaptive_latency_ratio":                1,
		"llm_bulkhead_adaptive_backoffs_total/upstream":      0,
		"llm_bulkhead_adaptive_remeasuring":                  0,
		"llm_bulkhead_compartment_max_concurrent":            8,
	} {
		if v, ok := got[key]; !ok || v < want*0.99 || v > want*1.01 {
			t.Errorf("%s = %v (present %v), want %v", key, v, ok, want)
		}
	}
	if got["llm_bulkhead_adaptive_increases_total"] == 0 {
		t.Error("no increase counted")
	}
}

// gathered returns reg's metrics by name, with their signal or cause label appended.
func gathered(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			key := mf.GetName()
			for _, l := range m.GetLabel() {
				if l.GetName() == "signal" || l.GetName() == "cause" {
					key += "/" + l.GetValue()
				}
			}
			got[key] = m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
	}
	return got
}

// TestAdaptivePoolMemberRefused: a pool member's concurrency is its share of the pool; an
// adaptive limit on it is refused when the policy is built.
func TestAdaptivePoolMemberRefused(t *testing.T) {
	yaml := strings.Replace(adaptivePolicy, "compartments:", "  anthropic: {max_concurrent: 5}\ncompartments:", 1) + `
pools:
  - name: shared
    max_concurrent: 10
    members: [{compartment: provider/openai, guaranteed: 2}, {compartment: provider/anthropic, guaranteed: 2}]
`
	p, err := config.Load("test.yaml", []byte(yaml), nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = policy.NewEngine(p, policy.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err == nil || !strings.Contains(err.Error(), "adaptive") {
		t.Errorf("NewEngine error = %v, want the adaptive pool member refused", err)
	}
}

// BenchmarkAdmitDoneAdaptive is BenchmarkAdmitDone with a provider compartment whose limit is
// adaptive: the same fast path, plus the first token and the end of each request fed to the
// controller. BenchmarkAdmitDoneProviderFixed is the same with a fixed provider limit, for
// comparison.
func BenchmarkAdmitDoneAdaptive(b *testing.B) {
	benchProvider(b, "{max_concurrent: adaptive, adaptive: {min: 1, max: 1000, initial: 100}}", nil)
}

// BenchmarkAdmitDoneAdaptiveMetered is BenchmarkAdmitDoneAdaptive with the meter of the
// process's stalls running, as with the system clock: the stalled time is read at admission,
// first token and end.
func BenchmarkAdmitDoneAdaptiveMetered(b *testing.B) {
	m := stall.New()
	defer m.Stop()
	benchProvider(b, "{max_concurrent: adaptive, adaptive: {min: 1, max: 1000, initial: 100}}", m)
}

func BenchmarkAdmitDoneProviderFixed(b *testing.B) {
	benchProvider(b, "{max_concurrent: 100}", nil)
}

func benchProvider(b *testing.B, limits string, stalls policy.StallMeter) {
	yaml := strings.Replace(seedPolicy, "classification:\n", "classification:\n  provider: {default: openai}\n", 1)
	p, err := config.Load("test.yaml", []byte(strings.Replace(yaml, "compartments:", "providers:\n  openai: "+limits+`
compartments:
  - {name: provider, key: [provider], limits_from: provider}`, 1)), nil)
	if err != nil {
		b.Fatal(err)
	}
	clk := newClock()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	e, err := policy.NewEngine(p, policy.Options{Clock: clk, Logger: log, Recorder: observe.NewMetrics(log), Stalls: stalls})
	if err != nil {
		b.Fatal(err)
	}
	s := e.Snapshot()
	in := &input{headers: map[string]string{"x-llm-feature": "chat", "x-tenant-id": "acme"}}
	size := policy.RequestSize{Scanned: true, PromptBytes: 4000, MaxTokens: 500, HasMaxTokens: true, N: 1}
	tk := &policy.Ticket{}
	ctx := context.Background()
	o := policy.Outcome{Status: 200, TTFB: 200 * time.Millisecond, InterToken: 20 * time.Millisecond,
		Usage: policy.Usage{Known: true, PromptKnown: true}}
	b.ReportAllocs()
	for b.Loop() {
		d := s.Classify(in)
		r := policy.Request{Dims: d, Estimate: s.Estimate(d.Model, size), PromptBytes: 4000}
		if dec := e.Admit(ctx, s, &r, tk, nil); dec.Verdict != policy.Admit {
			b.Fatal(dec.Err())
		}
		clk.Advance(time.Millisecond)
		tk.FirstToken(200 * time.Millisecond)
		tk.Done(o)
	}
}

// stallMeter is a StallMeter the test sets: the process has been stalled for stalled.
type stallMeter struct {
	mu      sync.Mutex
	stalled time.Duration
	running bool
}

func (m *stallMeter) Start() { m.mu.Lock(); m.running = true; m.mu.Unlock() }
func (m *stallMeter) Stop()  { m.mu.Lock(); m.running = false; m.mu.Unlock() }
func (m *stallMeter) Stalled(time.Time) time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.stalled
}
func (m *stallMeter) Total() time.Duration { return m.Stalled(time.Time{}) }

func (m *stallMeter) stall(d time.Duration) { m.mu.Lock(); m.stalled += d; m.mu.Unlock() }

// TestAdaptiveDiscountsProcessStalls: the compartment is full of streamed requests when the
// process stalls for two seconds; the first token that came meanwhile is handled at the end.
// Every request waited far beyond its baseline, but for the stall: the limit stays where it was,
// and the stall is exported. An engine that cannot measure its stalls cuts the limit for it.
func TestAdaptiveDiscountsProcessStalls(t *testing.T) {
	p, err := config.Load("test.yaml", []byte(adaptivePolicy), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, measured := range []bool{true, false} {
		reg := prometheus.NewRegistry()
		clk := newClock()
		o := policy.Options{Clock: clk, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
		m := &stallMeter{}
		if measured {
			o.Stalls = m
		}
		e, err := observe.NewEngine(p, o, reg)
		if err != nil {
			t.Fatal(err)
		}
		rounds(t, e, clk, 12, policy.Outcome{Status: 200, TTFB: 100 * time.Millisecond, InterToken: 20 * time.Millisecond})
		if got := adaptiveView(t, e).Adaptive.Limit; got != 8 {
			t.Fatalf("limit %d after healthy rounds, want max 8", got)
		}
		if measured && !m.running {
			t.Error("the stall meter was not started by admissions into an adaptive compartment")
		}
		var streams []*policy.Ticket
		for range 8 {
			s := e.Snapshot()
			tk := &policy.Ticket{}
			r := policy.Request{Dims: s.Classify(input{}), Estimate: policy.Estimate{Prompt: 500, Output: 500, Total: 1000}, Stream: true}
			if d := e.Admit(context.Background(), s, &r, tk, nil); d.Verdict != policy.Admit {
				t.Fatalf("stream not admitted: %+v", d)
			}
			streams = append(streams, tk)
		}
		clk.Advance(2 * time.Second)
		m.stall(2 * time.Second)
		streams[0].FirstToken(2*time.Second + 100*time.Millisecond)
		v := adaptiveView(t, e).Adaptive
		if measured && (v.Limit != 8 || v.BackoffsLatency != 0) {
			t.Errorf("a stall of the process cut the limit to %d (%d cuts for latency), want it at 8", v.Limit, v.BackoffsLatency)
		}
		if !measured && v.Limit >= 8 {
			t.Errorf("without a stall meter the requests held by the stall left the limit at %d; the test shows nothing", v.Limit)
		}
		for _, tk := range streams {
			tk.Done(policy.Outcome{Status: 200})
		}
		if measured {
			if err := e.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			if m.running {
				t.Error("Close left the stall meter running")
			}
			if got := gathered(t, reg)["llm_bulkhead_process_stall_seconds_total"]; got != 2 {
				t.Errorf("llm_bulkhead_process_stall_seconds_total = %v, want 2", got)
			}
		}
	}
}
