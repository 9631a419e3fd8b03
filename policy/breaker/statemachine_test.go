package breaker

import (
	"errors"
	"testing"
	"time"
)

// TestStateMachine ports the scenarios of Resilience4j's CircuitBreakerStateMachineTest, run on
// fixed instants with r4jConfig unless a scenario says otherwise.
func TestStateMachine(t *testing.T) {
	tests := []struct {
		name string
		cfg  func() Config
		run  func(h *harness)
	}{
		{
			name: "open refuses and counts the refusal",
			run: func(h *harness) {
				h.transition(Open)
				h.refused(ErrOpen)
				h.wantMetrics(-1, 0, 0, 0, 1)
			},
		},
		{
			name: "forced open refuses with its own error that is also ErrOpen",
			run: func(h *harness) {
				h.transition(ForcedOpen)
				h.refused(ErrForcedOpen)
				if _, err := h.b.Acquire(h.now); !errors.Is(err, ErrOpen) {
					h.t.Fatalf("errors.Is(%v, ErrOpen) = false", err)
				}
				h.wantMetrics(-1, 0, 0, 0, 2)
			},
		},
		{
			name: "released probe permit can be taken again",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				var p Permit
				for range 4 {
					p = h.acquire()
				}
				h.refused(ErrOpen)
				h.refused(ErrOpen)
				h.b.Release(p)
				h.acquire()
				h.refused(ErrOpen)
			},
		},
		{
			name: "half open permits exactly the configured probes and counts the next as not permitted",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				for range 4 {
					h.acquire()
				}
				h.refused(ErrOpen)
				h.wantMetrics(-1, 0, 0, 0, 1)
				if s := h.b.Snapshot(h.now); s.ProbesRemaining != 0 {
					h.t.Fatalf("ProbesRemaining = %d, want 0", s.ProbesRemaining)
				}
			},
		},
		{
			name: "every stay in half open gets fresh probe permits",
			run: func(h *harness) {
				h.wantReset()
				for range 2 {
					h.transition(Open)
					h.transition(HalfOpen)
					h.wantState(HalfOpen)
					for range 4 {
						h.acquire()
					}
					h.refused(ErrOpen)
					h.refused(ErrOpen)
				}
			},
		},
		{
			name: "time based window opens once failures reach half of calls spread over seconds",
			run: func(h *harness) {
				for _, o := range []Outcome{Success, Success, Success, Failure, Failure} {
					h.call(o, 0)
					h.advance(time.Second)
				}
				h.wantState(Closed) // 2 of 5 failed: 40 %
				h.fail()            // 3 of 6: 50 %, at the threshold
				h.wantState(Open)
			},
		},
		{
			name: "opens on failure rate once minimum calls are buffered, not before",
			run: func(h *harness) {
				h.wantReset()
				h.fail()
				h.wantMetrics(-1, 0, 1, 1, 0)
				h.fail()
				h.wantMetrics(-1, 0, 2, 2, 0)
				h.fail()
				h.wantMetrics(-1, 0, 3, 3, 0)
				h.succeed()
				h.wantState(Closed) // 3 of 4 failed, but 4 < minimum calls 5
				h.wantMetrics(-1, 1, 4, 3, 0)
				h.takeEvents()
				h.succeed()
				h.wantState(Open)
				h.wantMetrics(60, 2, 5, 3, 0)
				ev := h.takeEvents()
				if len(ev) != 1 || ev[0].Reason != ReasonFailureRate || ev[0].FailureRate != 60 || ev[0].SlowRate != 0 ||
					ev[0].From != Closed || ev[0].To != Open || ev[0].Name != "testName" || !ev[0].At.Equal(h.now) {
					h.t.Fatalf("events = %+v, want one CLOSED->OPEN failure_rate at 60 %%", ev)
				}
				h.refused(ErrOpen)
				h.wantMetrics(60, 2, 5, 3, 1)
			},
		},
		{
			name: "opens on slow call rate even when calls succeed",
			run: func(h *harness) {
				h.call(Failure, 5*time.Second)
				h.call(Success, 5*time.Second)
				h.call(Failure, 100*time.Millisecond)
				h.call(Success, 100*time.Millisecond)
				h.wantState(Closed)
				h.takeEvents()
				h.call(Success, 5*time.Second)
				h.wantState(Open)
				s := h.b.Snapshot(h.now)
				if s.BufferedCalls != 5 || s.SlowCalls != 3 || s.SlowRate != 60 || s.SlowFailedCalls != 1 || s.FailureRate != 40 {
					h.t.Fatalf("snapshot = %+v, want 5 buffered, 3 slow (1 failed), slow rate 60, failure rate 40", s)
				}
				if ev := h.takeEvents(); len(ev) != 1 || ev[0].Reason != ReasonSlowCallRate {
					h.t.Fatalf("events = %+v, want one slow_call_rate opening", ev)
				}
			},
		},
		{
			name: "a call exactly as long as the slow call duration is not slow",
			run: func(h *harness) {
				h.call(Success, 4*time.Second)
				h.call(Success, 4*time.Second+1)
				if s := h.b.Snapshot(h.now); s.SlowCalls != 1 {
					h.t.Fatalf("SlowCalls = %d, want 1", s.SlowCalls)
				}
			},
		},
		{
			name: "open moves to half open on the first acquire strictly after the wait",
			run: func(h *harness) {
				h.transition(Open)
				h.wantReset()
				h.refused(ErrOpen)
				h.advance(3 * time.Second)
				h.wantState(Open)
				h.refused(ErrOpen)
				h.wantMetrics(-1, 0, 0, 0, 2)
				h.advance(2 * time.Second) // exactly the 5s wait: Resilience4j still refuses
				h.refused(ErrOpen)
				h.advance(time.Nanosecond)
				h.acquire()
				h.wantState(HalfOpen)
				h.wantMetrics(-1, 0, 0, 0, 0)
			},
		},
		{
			name: "wait in open grows on consecutive openings",
			cfg: func() Config {
				c := r4jConfig()
				c.WaitInOpenMultiplier = 1.5 // Resilience4j's ofExponentialBackoff(5000)
				return c
			},
			run: func(h *harness) {
				h.transition(Open)
				h.refused(ErrOpen)
				h.advance(3 * time.Second)
				h.refused(ErrOpen)
				h.wantMetrics(-1, 0, 0, 0, 2)
				h.advance(3 * time.Second)
				h.acquire()
				h.wantState(HalfOpen)
				h.wantMetrics(-1, 0, 0, 0, 0)

				h.transition(Open) // second opening: 7.5s
				h.advance(6 * time.Second)
				h.wantState(Open)
				h.refused(ErrOpen)
				h.advance(5 * time.Second)
				h.acquire()
				h.wantState(HalfOpen)
			},
		},
		{
			name: "half open goes back to open when probes fail",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				h.wantMetrics(-1, 0, 0, 0, 0)
				h.takeEvents()
				h.fail()
				h.fail()
				h.succeed()
				h.wantState(HalfOpen)
				h.fail()
				h.wantState(Open)
				h.wantMetrics(75, 1, 4, 3, 0)
				if got, want := h.transitions(), []string{"transition HALF_OPEN->OPEN probe_failed"}; !equalStrings(got, want) {
					h.t.Fatalf("events = %q, want %q", got, want)
				}
			},
		},
		{
			name: "half open goes back to open when probes are slow",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				h.call(Success, 5*time.Second)
				h.call(Success, 5*time.Second)
				h.call(Success, 5*time.Second)
				h.call(Success, time.Second)
				h.wantState(Open)
				s := h.b.Snapshot(h.now)
				if s.SlowCalls != 3 || s.SlowRate != 75 || s.FailureRate != 0 {
					h.t.Fatalf("snapshot = %+v, want 3 slow, slow rate 75, failure rate 0", s)
				}
			},
		},
		{
			name: "half open closes when probes stay under thresholds and starts an empty window",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				h.takeEvents()
				h.fail()
				h.succeed()
				h.succeed()
				h.wantState(HalfOpen)
				h.succeed()
				h.acquire()
				h.wantState(Closed)
				h.wantReset()
				h.succeed()
				h.wantMetrics(-1, 1, 1, 0, 0)
				if got, want := h.transitions(), []string{"transition HALF_OPEN->CLOSED probes_succeeded"}; !equalStrings(got, want) {
					h.t.Fatalf("events = %q, want %q", got, want)
				}
			},
		},
		{
			name: "half open decides after minimum calls when fewer than the probes",
			cfg: func() Config {
				c := r4jConfig()
				c.MinimumCalls = 2 // probes decide after min(2, 4) results
				return c
			},
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				late := h.acquire()
				h.succeed()
				h.wantState(HalfOpen)
				h.succeed()
				h.wantState(Closed)
				h.b.Record(late, Failure, 0, h.now) // a probe of the finished stay: stale
				h.wantReset()
				if c := h.b.Counts(); c.Stale != 1 {
					h.t.Fatalf("Stale = %d, want 1", c.Stale)
				}
			},
		},
		{
			name: "closing to closed resets the window",
			run: func(h *harness) {
				h.wantReset()
				h.succeed()
				h.fail()
				h.wantMetrics(-1, 1, 2, 1, 0)
				h.transition(Closed)
				h.wantReset()
			},
		},
		{
			name: "disabled permits everything and records nothing",
			run: func(h *harness) {
				h.transition(Disabled)
				h.wantState(Disabled)
				h.wantReset()
				h.succeed()
				for range 4 {
					h.fail()
				}
				h.wantState(Disabled)
				h.wantReset()
				if c := h.b.Counts(); c != (Counts{}) {
					h.t.Fatalf("Counts = %+v, want none while disabled", c)
				}
			},
		},
		{
			name: "forced open stays open after the wait",
			run: func(h *harness) {
				h.transition(ForcedOpen)
				h.wantState(ForcedOpen)
				h.refused(ErrForcedOpen)
				h.advance(6 * time.Second)
				h.refused(ErrForcedOpen)
				h.wantState(ForcedOpen)
				h.wantMetrics(-1, 0, 0, 0, 2)
				if r := h.b.RemainingOpen(h.now); r != 0 {
					h.t.Fatalf("RemainingOpen in FORCED_OPEN = %v, want 0", r)
				}
			},
		},
		{
			name: "ignored probe gives its permit back and records nothing",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				h.succeed()
				h.wantMetrics(-1, 1, 1, 0, 0)
				h.succeed()
				h.succeed()
				h.wantMetrics(-1, 3, 3, 0, 0)
				h.call(Ignored, 0)
				h.wantState(HalfOpen)
				h.wantMetrics(-1, 3, 3, 0, 0)
				h.fail() // fourth recorded probe: 1 of 4 failed, 25 %
				h.wantState(Closed)
				h.wantReset()
			},
		},
		{
			name: "ignoring every probe keeps half open until real results arrive",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				for range 4 {
					h.call(Ignored, 0)
					h.wantState(HalfOpen)
				}
				h.wantReset()
				for range 3 {
					h.succeed()
					h.wantState(HalfOpen)
				}
				h.wantMetrics(-1, 3, 3, 0, 0)
				h.succeed()
				h.wantState(Closed)
				if c := h.b.Counts(); c.Ignored != 4 || c.Success != 4 {
					h.t.Fatalf("Counts = %+v, want 4 ignored and 4 successes", c)
				}
			},
		},
		{
			name: "zero outcome is treated as ignored",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				for range 10 {
					h.call(Outcome(0), 0)
				}
				h.wantState(HalfOpen)
				h.wantReset()
			},
		},
		{
			name: "closed cannot go straight to half open",
			run: func(h *harness) {
				err := h.b.Transition(HalfOpen, h.now)
				if !errors.Is(err, ErrIllegalTransition) {
					h.t.Fatalf("Transition(HALF_OPEN) from CLOSED = %v, want ErrIllegalTransition", err)
				}
				h.wantState(Closed)
				if ev := h.takeEvents(); len(ev) != 0 {
					h.t.Fatalf("events = %+v, want none", ev)
				}
			},
		},
		{
			name: "metrics only cannot go straight to open or half open",
			run: func(h *harness) {
				h.transition(MetricsOnly)
				for _, to := range []State{Open, HalfOpen} {
					if err := h.b.Transition(to, h.now); !errors.Is(err, ErrIllegalTransition) {
						h.t.Fatalf("Transition(%s) from METRICS_ONLY = %v, want ErrIllegalTransition", to, err)
					}
				}
				h.wantState(MetricsOnly)
			},
		},
		{
			name: "unknown state is refused",
			run: func(h *harness) {
				if err := h.b.Transition(State(42), h.now); err == nil {
					h.t.Fatal("Transition(State(42)) = nil, want an error")
				}
			},
		},
		{
			name: "entering metrics only starts an empty window",
			run: func(h *harness) {
				h.succeed()
				h.succeed()
				h.transition(MetricsOnly)
				h.wantState(MetricsOnly)
				h.wantReset()
			},
		},
		{
			name: "metrics only records and reports a breach once but never opens",
			run: func(h *harness) {
				h.transition(MetricsOnly)
				h.wantReset()
				h.takeEvents()
				h.fail()
				h.fail()
				h.fail()
				h.succeed()
				h.wantMetrics(-1, 1, 4, 3, 0)
				h.succeed()
				h.wantState(MetricsOnly)
				h.wantMetrics(60, 2, 5, 3, 0)
				h.fail()
				h.wantState(MetricsOnly)
				ev := h.takeEvents()
				if len(ev) != 1 || ev[0].Kind != EventThresholdExceeded || ev[0].Reason != ReasonFailureRate ||
					ev[0].From != MetricsOnly || ev[0].To != MetricsOnly || ev[0].FailureRate != 60 {
					h.t.Fatalf("events = %+v, want one failure_rate threshold_exceeded at 60 %%", ev)
				}
			},
		},
		{
			name: "metrics only reports each rate once",
			run: func(h *harness) {
				h.transition(MetricsOnly)
				h.takeEvents()
				for range 5 {
					h.call(Failure, 5*time.Second)
				}
				for range 5 {
					h.call(Failure, 5*time.Second)
				}
				got := h.transitions()
				want := []string{"threshold_exceeded METRICS_ONLY->METRICS_ONLY failure_rate", "threshold_exceeded METRICS_ONLY->METRICS_ONLY slow_call_rate"}
				if !equalStrings(got, want) {
					h.t.Fatalf("events = %q, want %q", got, want)
				}
				h.transition(MetricsOnly) // a fresh stay reports again
				h.takeEvents()
				for range 5 {
					h.fail()
				}
				if got := h.transitions(); len(got) != 1 {
					h.t.Fatalf("events after re-entering = %q, want one", got)
				}
			},
		},
		{
			name: "re-entering a state is published with equal from and to and starts a generation",
			run: func(h *harness) {
				steps := []State{Open, Open, HalfOpen, HalfOpen, Disabled, Disabled, MetricsOnly, MetricsOnly, Closed, Closed}
				gen := h.b.Snapshot(h.now).Generation
				for _, s := range steps {
					h.transition(s)
					ev := h.takeEvents()
					if len(ev) != 1 || ev[0].To != s || ev[0].Reason != ReasonForced || ev[0].Generation != gen+1 {
						h.t.Fatalf("Transition(%s): events %+v, want one forced transition to generation %d", s, ev, gen+1)
					}
					gen++
				}
			},
		},
		{
			name: "half open times out back to open after max wait in half open",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				p := h.acquire()
				h.takeEvents()
				h.advance(999 * time.Millisecond)
				h.wantState(HalfOpen)
				h.advance(time.Millisecond)
				h.wantState(Open)
				if got, want := h.transitions(), []string{"transition HALF_OPEN->OPEN half_open_timeout"}; !equalStrings(got, want) {
					h.t.Fatalf("events = %q, want %q", got, want)
				}
				h.b.Record(p, Success, 0, h.now) // the late probe is stale
				h.wantState(Open)
				if s := h.b.Snapshot(h.now); s.WaitRemaining != 10*time.Second || s.ConsecutiveOpenings != 2 {
					h.t.Fatalf("snapshot = %+v, want the second opening's wait: 5s × 2", s)
				}
			},
			cfg: func() Config {
				c := r4jConfig()
				c.WaitInOpenMultiplier = 2
				return c
			},
		},
		{
			name: "half open timeout is noticed by acquire",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				h.advance(2 * time.Second)
				h.refused(ErrOpen)
				if s := h.b.Snapshot(h.now); s.State != Open || s.WaitRemaining != 5*time.Second {
					h.t.Fatalf("snapshot = %+v, want OPEN with a 5s wait starting when the timeout was noticed", s)
				}
			},
		},
		{
			name: "results of an older generation are ignored",
			run: func(h *harness) {
				old := h.acquire()
				oldProbe := Permit{}
				h.transition(Open)
				h.b.Record(old, Failure, 0, h.now)
				h.b.Record(oldProbe, Failure, 0, h.now)
				h.transition(Closed)
				h.b.Record(old, Failure, 0, h.now)
				h.wantReset()
				if c := h.b.Counts(); c.Stale != 3 || c.Failure != 0 {
					h.t.Fatalf("Counts = %+v, want 3 stale, no failure", c)
				}
				h.b.Record(old, Ignored, 0, h.now)
				if c := h.b.Counts(); c.Stale != 4 || c.Ignored != 0 {
					h.t.Fatalf("Counts = %+v, want the stale ignore counted as stale", c)
				}
			},
		},
		{
			name: "a stale probe release does not add a permit to the new half open",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				old := h.acquire()
				h.transition(HalfOpen)
				h.acquire()
				h.b.Release(old)
				h.b.Record(old, Ignored, 0, h.now)
				for range 3 {
					h.acquire()
				}
				h.refused(ErrOpen)
			},
		},
		{
			name: "double release never exceeds the probe count",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				p := h.acquire()
				h.b.Release(p)
				h.b.Release(p)
				for range 4 {
					h.acquire()
				}
				h.refused(ErrOpen)
			},
		},
		{
			name: "release outside half open changes nothing",
			run: func(h *harness) {
				p := h.acquire()
				h.b.Release(p)
				h.wantReset()
				h.b.Record(p, Success, 0, h.now) // the caller's mistake still records once
				h.wantMetrics(-1, 1, 1, 0, 0)
			},
		},
		{
			name: "automatic transition shows half open in a snapshot after the wait",
			cfg: func() Config {
				c := r4jConfig()
				c.AutomaticTransition = true
				return c
			},
			run: func(h *harness) {
				h.transition(Open)
				h.takeEvents()
				h.advance(5 * time.Second) // exactly the end of the wait: still OPEN
				h.wantState(Open)
				h.advance(1)
				h.wantState(HalfOpen)
				if got, want := h.transitions(), []string{"transition OPEN->HALF_OPEN wait_elapsed"}; !equalStrings(got, want) {
					h.t.Fatalf("events = %q, want %q", got, want)
				}
			},
		},
		{
			name: "without automatic transition a snapshot keeps open with no wait left",
			run: func(h *harness) {
				h.transition(Open)
				h.advance(time.Minute)
				s := h.b.Snapshot(h.now)
				if s.State != Open || s.WaitRemaining != 0 {
					h.t.Fatalf("snapshot = %+v, want OPEN with no wait remaining", s)
				}
				h.acquire()
				h.wantState(HalfOpen)
			},
		},
		{
			name: "open keeps the window that opened it for reporting",
			cfg: func() Config {
				c := r4jConfig()
				c.WindowType = CountBased
				c.WindowSize = 5
				return c
			},
			run: func(h *harness) {
				for range 5 {
					h.fail()
				}
				h.wantState(Open)
				h.advance(time.Hour)
				h.wantMetrics(100, 0, 5, 5, 0)
			},
		},
		{
			name: "state, name and config accessors",
			run: func(h *harness) {
				if h.b.Name() != "testName" || h.b.State() != Closed || h.b.Config() != r4jConfig() {
					h.t.Fatalf("Name %q State %s Config %+v", h.b.Name(), h.b.State(), h.b.Config())
				}
				h.transition(Open)
				if h.b.State() != Open {
					h.t.Fatalf("State() = %s, want OPEN", h.b.State())
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := r4jConfig()
			if tc.cfg != nil {
				cfg = tc.cfg()
			}
			tc.run(newHarness(t, cfg))
		})
	}
}
