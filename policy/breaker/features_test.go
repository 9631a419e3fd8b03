package breaker

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestOpenFor(t *testing.T) {
	tests := []struct {
		name string
		// given prepares the breaker; it returns nothing, the harness holds the state.
		given func(h *harness)
		d     time.Duration
		// wantState and wantRemaining are checked right after OpenFor.
		wantState     State
		wantRemaining time.Duration
		wantEvents    []string
	}{
		{
			name:          "closed opens for the retry-after",
			given:         func(h *harness) {},
			d:             30 * time.Second,
			wantState:     Open,
			wantRemaining: 30 * time.Second,
			wantEvents:    []string{"transition CLOSED->OPEN retry_after"},
		},
		{
			name:          "half open opens for the retry-after",
			given:         func(h *harness) { h.transition(Open); h.transition(HalfOpen); h.takeEvents() },
			d:             2 * time.Second,
			wantState:     Open,
			wantRemaining: 2 * time.Second,
			wantEvents:    []string{"transition HALF_OPEN->OPEN retry_after"},
		},
		{
			name:          "open extends a shorter wait",
			given:         func(h *harness) { h.transition(Open); h.takeEvents() },
			d:             time.Minute,
			wantState:     Open,
			wantRemaining: time.Minute,
			wantEvents:    []string{"transition OPEN->OPEN retry_after"},
		},
		{
			name:          "open keeps a longer wait",
			given:         func(h *harness) { h.transition(Open); h.takeEvents() },
			d:             time.Second,
			wantState:     Open,
			wantRemaining: 5 * time.Second,
		},
		{
			name:      "disabled is left alone",
			given:     func(h *harness) { h.transition(Disabled); h.takeEvents() },
			d:         time.Minute,
			wantState: Disabled,
		},
		{
			name:      "forced open is left alone",
			given:     func(h *harness) { h.transition(ForcedOpen); h.takeEvents() },
			d:         time.Minute,
			wantState: ForcedOpen,
		},
		{
			name:      "metrics only is left alone",
			given:     func(h *harness) { h.transition(MetricsOnly); h.takeEvents() },
			d:         time.Minute,
			wantState: MetricsOnly,
		},
		{
			name:      "a non-positive retry-after does nothing",
			given:     func(h *harness) {},
			d:         0,
			wantState: Closed,
		},
		{
			name:          "an enormous retry-after saturates instead of overflowing",
			given:         func(h *harness) { h.advance(time.Second); h.b.Snapshot(h.now) },
			d:             time.Duration(1<<63 - 1),
			wantState:     Open,
			wantRemaining: time.Duration(1<<63-1) - time.Second,
			wantEvents:    []string{"transition CLOSED->OPEN retry_after"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// Given
			h := newHarness(t, r4jConfig())
			tc.given(h)
			// When
			h.b.OpenFor(tc.d, h.now)
			// Then
			h.wantState(tc.wantState)
			if got := h.b.RemainingOpen(h.now); got != tc.wantRemaining {
				t.Fatalf("RemainingOpen = %v, want %v", got, tc.wantRemaining)
			}
			if got := h.transitions(); !equalStrings(got, tc.wantEvents) {
				t.Fatalf("events = %q, want %q", got, tc.wantEvents)
			}
		})
	}

	t.Run("does not count as a further opening", func(t *testing.T) {
		cfg := r4jConfig()
		cfg.WaitInOpenMultiplier = 2
		h := newHarness(t, cfg)
		h.b.OpenFor(time.Second, h.now)
		h.advance(time.Second + 1)
		for range 4 {
			h.fail() // the first Acquire moves to HALF_OPEN; 4 probes, 4 failed
		}
		h.wantState(Open)
		if s := h.b.Snapshot(h.now); s.ConsecutiveOpenings != 1 || s.WaitRemaining != 5*time.Second {
			t.Fatalf("snapshot = %+v, want the first opening's 5s wait", s)
		}
	})

	t.Run("remaining open counts down and is zero once the wait is over", func(t *testing.T) {
		h := newHarness(t, r4jConfig())
		h.b.OpenFor(10*time.Second, h.now)
		for _, step := range []struct {
			after time.Duration
			want  time.Duration
		}{{0, 10 * time.Second}, {4 * time.Second, 6 * time.Second}, {6 * time.Second, 0}, {time.Hour, 0}} {
			h.advance(step.after)
			if got := h.b.RemainingOpen(h.now); got != step.want {
				t.Fatalf("RemainingOpen after %v = %v, want %v", h.now.Sub(t0), got, step.want)
			}
		}
	})
}

func TestWaitInOpenBackoff(t *testing.T) {
	tests := []struct {
		name       string
		multiplier float64
		max        time.Duration
		// want is the wait after the 1st, 2nd, … consecutive opening.
		want []time.Duration
	}{
		{name: "constant without multiplier", multiplier: 1, want: []time.Duration{5 * time.Second, 5 * time.Second, 5 * time.Second}},
		{name: "doubles up to the cap", multiplier: 2, max: 30 * time.Second,
			want: []time.Duration{5 * time.Second, 10 * time.Second, 20 * time.Second, 30 * time.Second, 30 * time.Second}},
		{name: "zero max caps at ten times the wait", multiplier: 3,
			want: []time.Duration{5 * time.Second, 15 * time.Second, 45 * time.Second, 50 * time.Second, 50 * time.Second}},
		{name: "fractional multiplier", multiplier: 1.5, max: time.Hour,
			want: []time.Duration{5 * time.Second, 7500 * time.Millisecond, 11250 * time.Millisecond}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := r4jConfig()
			cfg.WaitInOpenMultiplier = tc.multiplier
			cfg.MaxWaitInOpen = tc.max
			cfg.MaxWaitInHalfOpen = 0
			h := newHarness(t, cfg)
			for i, want := range tc.want {
				if i == 0 {
					// Given a first opening on failures
					for range 5 {
						h.fail()
					}
				} else {
					// When the wait elapses and the probes fail again
					h.advance(h.b.RemainingOpen(h.now) + 1)
					for range 4 {
						h.fail()
					}
				}
				// Then the wait has grown
				s := h.b.Snapshot(h.now)
				if s.State != Open || s.WaitRemaining != want || s.ConsecutiveOpenings != i+1 {
					t.Fatalf("opening %d: state %s wait %v openings %d, want OPEN %v %d", i+1, s.State, s.WaitRemaining, s.ConsecutiveOpenings, want, i+1)
				}
			}
		})
	}

	t.Run("closing resets the growth", func(t *testing.T) {
		cfg := r4jConfig()
		cfg.WaitInOpenMultiplier = 2
		cfg.MaxWaitInHalfOpen = 0
		h := newHarness(t, cfg)
		for range 5 {
			h.fail()
		}
		h.advance(5*time.Second + 1)
		for range 4 {
			h.fail()
		}
		if w := h.b.RemainingOpen(h.now); w != 10*time.Second {
			t.Fatalf("second wait = %v, want 10s", w)
		}
		h.advance(10*time.Second + 1)
		for range 4 {
			h.succeed()
		}
		h.wantState(Closed)
		for range 5 {
			h.fail()
		}
		if s := h.b.Snapshot(h.now); s.WaitRemaining != 5*time.Second || s.ConsecutiveOpenings != 1 {
			t.Fatalf("after closing: %+v, want a fresh 5s wait", s)
		}
	})

	t.Run("a long run of openings saturates at the cap", func(t *testing.T) {
		cfg := r4jConfig()
		cfg.WaitInOpenMultiplier = 10
		cfg.MaxWaitInOpen = 24 * time.Hour
		for _, attempt := range []int{1, 2, 10, 100, 1 << 20} {
			if got := cfg.waitInOpen(attempt); got <= 0 || got > 24*time.Hour {
				t.Fatalf("waitInOpen(%d) = %v, want within (0, 24h]", attempt, got)
			}
		}
		if got := cfg.waitInOpen(1 << 20); got != 24*time.Hour {
			t.Fatalf("waitInOpen(2^20) = %v, want the cap", got)
		}
		cfg.WaitInOpen = time.Duration(1<<63-1) / 2 // ten times that does not fit
		cfg.MaxWaitInOpen = 0
		if got := cfg.waitInOpen(3); got != time.Duration(1<<63-1) {
			t.Fatalf("waitInOpen with an overflowing default cap = %v, want the largest duration", got)
		}
	})
}

func TestReconfigure(t *testing.T) {
	tests := []struct {
		name   string
		given  func(h *harness)
		change func(c *Config)
		then   func(h *harness)
	}{
		{
			name:   "same window keeps state and buffered calls",
			given:  func(h *harness) { h.fail(); h.fail(); h.succeed() },
			change: func(c *Config) { c.FailureRateThreshold = 60; c.SlowCallDuration = time.Second },
			then: func(h *harness) {
				h.wantState(Closed)
				h.wantMetrics(-1, 1, 3, 2, 0)
				h.fail()
				h.succeed() // 3 of 5 failed = 60 %: opens under the new threshold
				h.wantState(Open)
			},
		},
		{
			name:   "a new threshold applies from the next call",
			given:  func(h *harness) { h.fail(); h.fail(); h.succeed(); h.succeed(); h.succeed() },
			change: func(c *Config) { c.FailureRateThreshold = 40 },
			then: func(h *harness) {
				h.wantState(Closed) // 40 %, but nothing recorded since the reload
				h.succeed()         // 2 of 6: 33 %
				h.wantState(Closed)
				h.fail() // 3 of 7: 43 %
				h.wantState(Open)
			},
		},
		{
			name:   "a new window size starts an empty window in the same state",
			given:  func(h *harness) { h.fail(); h.fail() },
			change: func(c *Config) { c.WindowSize = 30 },
			then:   func(h *harness) { h.wantState(Closed); h.wantReset() },
		},
		{
			name:   "a new window type starts an empty window in the same state",
			given:  func(h *harness) { h.fail(); h.fail() },
			change: func(c *Config) { c.WindowType = CountBased; c.WindowSize = 10 },
			then: func(h *harness) {
				h.wantReset()
				for range 5 {
					h.fail()
				}
				h.wantState(Open)
			},
		},
		{
			name:   "open keeps its wait",
			given:  func(h *harness) { h.transition(Open) },
			change: func(c *Config) { c.WaitInOpen = time.Hour },
			then: func(h *harness) {
				h.wantState(Open)
				if r := h.b.RemainingOpen(h.now); r != 5*time.Second {
					h.t.Fatalf("RemainingOpen = %v, want the 5s set when it opened", r)
				}
			},
		},
		{
			name:   "half open with a new probe count restarts the probing",
			given:  func(h *harness) { h.transition(Open); h.transition(HalfOpen); h.acquire(); h.acquire(); h.takeEvents() },
			change: func(c *Config) { c.PermittedCallsInHalfOpen = 2 },
			then: func(h *harness) {
				if got, want := h.transitions(), []string{"transition HALF_OPEN->HALF_OPEN reconfigured"}; !equalStrings(got, want) {
					h.t.Fatalf("events = %q, want %q", got, want)
				}
				h.succeed()
				h.succeed()
				h.wantState(Closed)
			},
		},
		{
			name:   "half open with the same probe count keeps its permits",
			given:  func(h *harness) { h.transition(Open); h.transition(HalfOpen); h.acquire(); h.acquire(); h.takeEvents() },
			change: func(c *Config) { c.FailureRateThreshold = 90 },
			then: func(h *harness) {
				if got := h.transitions(); len(got) != 0 {
					h.t.Fatalf("events = %q, want none", got)
				}
				if s := h.b.Snapshot(h.now); s.ProbesRemaining != 2 {
					h.t.Fatalf("ProbesRemaining = %d, want 2", s.ProbesRemaining)
				}
			},
		},
		{
			name:   "a shorter half open limit applies at once",
			given:  func(h *harness) { h.transition(Open); h.transition(HalfOpen); h.advance(500 * time.Millisecond) },
			change: func(c *Config) { c.MaxWaitInHalfOpen = 100 * time.Millisecond },
			then:   func(h *harness) { h.wantState(Open) },
		},
		{
			name:   "disabled stays disabled",
			given:  func(h *harness) { h.transition(Disabled) },
			change: func(c *Config) { c.WindowSize = 7 },
			then:   func(h *harness) { h.wantState(Disabled); h.succeed(); h.wantReset() },
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, r4jConfig())
			tc.given(h)
			gen := h.b.Snapshot(h.now).Generation
			cfg := r4jConfig()
			tc.change(&cfg)
			if err := h.b.Reconfigure(cfg, h.now); err != nil {
				t.Fatalf("Reconfigure: %v", err)
			}
			if h.b.Config() != cfg {
				t.Fatalf("Config() = %+v, want %+v", h.b.Config(), cfg)
			}
			if s := h.b.Snapshot(h.now); s.Generation < gen {
				t.Fatalf("generation went back from %d to %d", gen, s.Generation)
			}
			tc.then(h)
		})
	}

	t.Run("invalid settings are refused and change nothing", func(t *testing.T) {
		h := newHarness(t, r4jConfig())
		h.fail()
		bad := r4jConfig()
		bad.MinimumCalls = 0
		err := h.b.Reconfigure(bad, h.now)
		var ce ConfigErrors
		if !errors.As(err, &ce) || len(ce) != 1 || ce[0].Key != "minimum_calls" || !strings.Contains(err.Error(), `breaker "testName"`) {
			t.Fatalf("Reconfigure = %v, want one minimum_calls problem naming the breaker", err)
		}
		if h.b.Config() != r4jConfig() {
			t.Fatal("config changed after a refused reload")
		}
		h.wantMetrics(-1, 0, 1, 1, 0)
	})
}

// TestClockBackwards pins the rule that a clock going backwards is "no time passed".
func TestClockBackwards(t *testing.T) {
	tests := []struct {
		name string
		cfg  func() Config
		run  func(h *harness)
	}{
		{
			name: "time window keeps younger calls when the clock jumps back",
			run: func(h *harness) {
				h.advance(10 * time.Second)
				h.fail()
				h.fail()
				h.advance(-9 * time.Second) // back to t0+1s
				h.succeed()
				h.succeed()
				h.advance(9 * time.Second) // t0+10s: the calls of t0+1s were counted at t0+10s
				h.wantMetrics(-1, 2, 4, 2, 0)
				h.advance(19 * time.Second) // t0+29s: bucket of t0+10s is still inside the 20s window
				h.wantMetrics(-1, 2, 4, 2, 0)
				h.advance(time.Second) // t0+30s: it expires
				h.wantReset()
			},
		},
		{
			name: "open neither shortens nor lengthens its wait when the clock jumps back",
			run: func(h *harness) {
				h.transition(Open)
				h.advance(-time.Hour)
				h.refused(ErrOpen)
				if r := h.b.RemainingOpen(h.now); r != 5*time.Second {
					h.t.Fatalf("RemainingOpen = %v, want 5s (no time passed)", r)
				}
				h.advance(time.Hour + 5*time.Second + 1)
				h.acquire()
				h.wantState(HalfOpen)
			},
		},
		{
			name: "a wait seen over stays over when the clock then jumps back",
			run: func(h *harness) {
				h.transition(Open)
				h.advance(5*time.Second + 1)
				h.wantState(Open) // no automatic transition: still OPEN, but the wait is over
				h.advance(-4 * time.Second)
				h.acquire()
				h.wantState(HalfOpen)
			},
		},
		{
			name: "a wait is measured from the latest instant seen",
			run: func(h *harness) {
				h.advance(time.Minute)
				h.b.Snapshot(h.now)
				h.advance(-time.Minute) // back to t0, behind the breaker's clock
				h.transition(Open)      // opens at t0+1m, not t0
				h.advance(time.Minute + 5*time.Second)
				h.refused(ErrOpen)
				h.advance(1)
				h.acquire()
			},
		},
		{
			name: "half open does not time out when the clock jumps back",
			run: func(h *harness) {
				h.transition(Open)
				h.transition(HalfOpen)
				h.advance(-10 * time.Second)
				h.wantState(HalfOpen)
				h.advance(10*time.Second + 999*time.Millisecond)
				h.wantState(HalfOpen)
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

func TestNew(t *testing.T) {
	tests := []struct {
		name      string
		cfg       Config
		opts      []Option
		wantState State
		wantErr   string
	}{
		{name: "defaults start closed", cfg: Defaults(), wantState: Closed},
		{name: "initial disabled", cfg: Defaults(), opts: []Option{WithInitialState(Disabled)}, wantState: Disabled},
		{name: "initial metrics only", cfg: Defaults(), opts: []Option{WithInitialState(MetricsOnly)}, wantState: MetricsOnly},
		{name: "initial forced open", cfg: Defaults(), opts: []Option{WithInitialState(ForcedOpen)}, wantState: ForcedOpen},
		{name: "initial open is refused", cfg: Defaults(), opts: []Option{WithInitialState(Open)}, wantErr: "cannot start in OPEN"},
		{name: "initial half open is refused", cfg: Defaults(), opts: []Option{WithInitialState(HalfOpen)}, wantErr: "cannot start in HALF_OPEN"},
		{name: "invalid config is refused", cfg: Config{}, wantErr: `breaker "p": sliding_window_size`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := New("p", tc.cfg, t0, tc.opts...)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || b != nil {
					t.Fatalf("New = %v, %v; want nil and an error containing %q", b, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			s := b.Snapshot(t0)
			if s.State != tc.wantState || s.Generation != 1 || s.Name != "p" || !s.EnteredAt.Equal(t0) {
				t.Fatalf("snapshot = %+v, want %s at generation 1", s, tc.wantState)
			}
		})
	}
}

func TestListener(t *testing.T) {
	t.Run("set, replace and remove", func(t *testing.T) {
		b, err := New("p", r4jConfig(), t0)
		if err != nil {
			t.Fatal(err)
		}
		var first, second int
		b.SetListener(func(Event) { first++ })
		if err := b.Transition(Open, t0); err != nil {
			t.Fatal(err)
		}
		b.SetListener(func(Event) { second++ })
		if err := b.Transition(Closed, t0); err != nil {
			t.Fatal(err)
		}
		b.SetListener(nil)
		if err := b.Transition(Open, t0); err != nil {
			t.Fatal(err)
		}
		if first != 1 || second != 1 {
			t.Fatalf("listener calls = %d, %d; want 1, 1", first, second)
		}
	})

	t.Run("a listener may call back into the breaker", func(t *testing.T) {
		var b *Breaker
		var seen []State
		b, err := New("p", r4jConfig(), t0, WithListener(func(e Event) {
			seen = append(seen, b.Snapshot(e.At).State)
			if e.To == Open && e.Reason == ReasonFailureRate {
				b.OpenFor(time.Minute, e.At) // as an adaptive wait would
			}
		}))
		if err != nil {
			t.Fatal(err)
		}
		for range 5 {
			p, err := b.Acquire(t0)
			if err != nil {
				t.Fatal(err)
			}
			b.Record(p, Failure, 0, t0)
		}
		if got := b.RemainingOpen(t0); got != time.Minute {
			t.Fatalf("RemainingOpen = %v, want the listener's minute", got)
		}
		if len(seen) != 2 || seen[0] != Open || seen[1] != Open {
			t.Fatalf("listener saw %v, want [OPEN OPEN]", seen)
		}
	})
}

func TestCountsByKind(t *testing.T) {
	h := newHarness(t, r4jConfig())
	h.call(Success, 0)
	h.call(Success, 5*time.Second)
	h.call(Failure, 0)
	h.call(Failure, 5*time.Second)
	h.call(Ignored, 0) // 4 recorded, 50 % failed: below minimum calls, still CLOSED
	h.transition(ForcedOpen)
	h.refused(ErrForcedOpen)
	want := Counts{Success: 1, SlowSuccess: 1, Failure: 1, SlowFailure: 1, Ignored: 1, NotPermitted: 1}
	if got := h.b.Counts(); got != want {
		t.Fatalf("Counts = %+v, want %+v", got, want)
	}
}
