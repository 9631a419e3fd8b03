package breaker

import (
	"errors"
	"sync"
	"testing"
	"time"
)

// t0 is the fixed instant scenarios start from (the instant Resilience4j's tests use).
var t0 = time.Date(2019, 1, 1, 12, 0, 0, 0, time.UTC)

// r4jConfig is the configuration of Resilience4j's CircuitBreakerStateMachineTest: a 20-second
// TIME_BASED window judged from 5 calls, 50 % thresholds, 4s slow calls, 5s in OPEN, 4 probes
// with 1s to decide.
func r4jConfig() Config {
	c := Defaults()
	c.WindowType = TimeBased
	c.WindowSize = 20
	c.MinimumCalls = 5
	c.FailureRateThreshold = 50
	c.SlowCallRateThreshold = 50
	c.SlowCallDuration = 4 * time.Second
	c.WaitInOpen = 5 * time.Second
	c.PermittedCallsInHalfOpen = 4
	c.MaxWaitInHalfOpen = time.Second
	return c
}

// harness drives one breaker on a fake clock and records its events.
type harness struct {
	t   *testing.T
	b   *Breaker
	now time.Time

	mu     sync.Mutex
	events []Event
}

func newHarness(t *testing.T, cfg Config, opts ...Option) *harness {
	t.Helper()
	h := &harness{t: t, now: t0}
	b, err := New("testName", cfg, t0, append([]Option{WithListener(h.listen)}, opts...)...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	h.b = b
	return h
}

func (h *harness) listen(e Event) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.events = append(h.events, e)
}

// takeEvents returns the events since the last call.
func (h *harness) takeEvents() []Event {
	h.mu.Lock()
	defer h.mu.Unlock()
	ev := h.events
	h.events = nil
	return ev
}

func (h *harness) advance(d time.Duration) { h.now = h.now.Add(d) }

func (h *harness) acquire() Permit {
	h.t.Helper()
	p, err := h.b.Acquire(h.now)
	if err != nil {
		h.t.Fatalf("Acquire at %v: %v, want a permit (state %s)", h.now.Sub(t0), err, h.b.State())
	}
	return p
}

func (h *harness) refused(want error) {
	h.t.Helper()
	_, err := h.b.Acquire(h.now)
	if !errors.Is(err, want) || (want == ErrOpen && errors.Is(err, ErrForcedOpen)) {
		h.t.Fatalf("Acquire at %v: %v, want %v", h.now.Sub(t0), err, want)
	}
}

// call acquires and records one call with outcome o lasting d.
func (h *harness) call(o Outcome, d time.Duration) {
	h.t.Helper()
	h.b.Record(h.acquire(), o, d, h.now)
}

func (h *harness) fail()    { h.t.Helper(); h.call(Failure, 0) }
func (h *harness) succeed() { h.t.Helper(); h.call(Success, 0) }

func (h *harness) wantState(want State) {
	h.t.Helper()
	if got := h.b.Snapshot(h.now).State; got != want {
		h.t.Fatalf("state at %v = %s, want %s", h.now.Sub(t0), got, want)
	}
}

// wantMetrics mirrors Resilience4j's assertCircuitBreakerMetricsEqualTo.
func (h *harness) wantMetrics(failureRate float64, successful, buffered, failed int, notPermitted int64) {
	h.t.Helper()
	s := h.b.Snapshot(h.now)
	if s.FailureRate != failureRate || s.SuccessfulCalls != successful || s.BufferedCalls != buffered ||
		s.FailedCalls != failed || s.NotPermittedCalls != notPermitted {
		h.t.Fatalf("metrics = rate %v, successful %d, buffered %d, failed %d, not permitted %d; want %v, %d, %d, %d, %d",
			s.FailureRate, s.SuccessfulCalls, s.BufferedCalls, s.FailedCalls, s.NotPermittedCalls,
			failureRate, successful, buffered, failed, notPermitted)
	}
}

func (h *harness) wantReset() {
	h.t.Helper()
	h.wantMetrics(-1, 0, 0, 0, 0)
}

func (h *harness) transition(to State) {
	h.t.Helper()
	if err := h.b.Transition(to, h.now); err != nil {
		h.t.Fatalf("Transition(%s): %v", to, err)
	}
}

// transitions returns the From→To pairs and reasons of the transition events since the last
// call, formatted for comparison.
func (h *harness) transitions() []string {
	var out []string
	for _, e := range h.takeEvents() {
		out = append(out, e.Kind.String()+" "+e.From.String()+"->"+e.To.String()+" "+string(e.Reason))
	}
	return out
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
