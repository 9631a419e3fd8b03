package breaker

import (
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestConcurrentUse hammers one breaker from thousands of goroutines on a shared fake clock that
// moves fast enough to cycle it through CLOSED, OPEN and HALF_OPEN many times, with an operator
// and a config reload interfering. Run it with -race. It checks that HALF_OPEN never has more
// probes out than permitted, that every call lands in exactly one counter, and that every
// generation was announced by exactly one event.
func TestConcurrentUse(t *testing.T) {
	tests := []struct {
		name   string
		window WindowType
		size   int
	}{
		{name: "count based", window: CountBased, size: 20},
		{name: "time based", window: TimeBased, size: 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Defaults()
			cfg.WindowType = tc.window
			cfg.WindowSize = tc.size
			cfg.MinimumCalls = 10
			cfg.FailureRateThreshold = 50
			cfg.SlowCallRateThreshold = 80
			cfg.SlowCallDuration = 50 * time.Millisecond
			cfg.WaitInOpen = 20 * time.Millisecond
			cfg.WaitInOpenMultiplier = 1.5
			cfg.PermittedCallsInHalfOpen = 5
			cfg.MaxWaitInHalfOpen = 200 * time.Millisecond
			cfg.AutomaticTransition = true
			const permitted = 5

			var (
				ticks       atomic.Int64 // the fake clock: every operation moves it 20µs
				refused     atomic.Uint64
				recorded    atomic.Uint64
				probesOut   sync.Map // generation → *atomic.Int64: probe permits taken and not given back
				violations  atomic.Int64
				eventsMu    sync.Mutex
				generations = map[uint64]int{}
			)
			now := func() time.Time { return t0.Add(time.Duration(ticks.Add(1)) * 20 * time.Microsecond) }
			outstanding := func(gen uint64) *atomic.Int64 {
				v, _ := probesOut.LoadOrStore(gen, new(atomic.Int64))
				return v.(*atomic.Int64)
			}

			b, err := New("p", cfg, t0, WithListener(func(e Event) {
				if e.Kind != EventTransition {
					return
				}
				eventsMu.Lock()
				generations[e.Generation]++
				eventsMu.Unlock()
			}))
			if err != nil {
				t.Fatal(err)
			}

			const workers, iterations = 2000, 60
			var wg sync.WaitGroup
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(w), 7))
					for range iterations {
						p, err := b.Acquire(now())
						if err != nil {
							if !errors.Is(err, ErrOpen) {
								t.Errorf("Acquire: %v", err)
							}
							refused.Add(1)
							continue
						}
						probe := p.State() == HalfOpen
						if probe && outstanding(p.Generation()).Add(1) > permitted {
							violations.Add(1)
						}
						switch r := rng.IntN(10); {
						case r == 0: // refused later in admission
							if probe {
								outstanding(p.Generation()).Add(-1)
							}
							b.Release(p)
						case r == 1: // a client error
							if probe {
								outstanding(p.Generation()).Add(-1)
							}
							b.Record(p, Ignored, 0, now())
							recorded.Add(1)
						default:
							o := Success
							if rng.IntN(100) < 35 {
								o = Failure
							}
							d := time.Duration(rng.IntN(70)) * time.Millisecond
							b.Record(p, o, d, now())
							recorded.Add(1)
						}
					}
				}()
			}
			// An operator and a reload interfere while the traffic runs.
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 200 {
					switch i % 4 {
					case 0:
						b.OpenFor(30*time.Millisecond, now())
					case 1:
						c := cfg
						c.FailureRateThreshold = 40 + float64(i%20)
						if err := b.Reconfigure(c, now()); err != nil {
							t.Errorf("Reconfigure: %v", err)
						}
					case 2:
						b.Snapshot(now())
						b.RemainingOpen(now())
						b.Counts()
					case 3:
						if err := b.Transition(Closed, now()); err != nil {
							t.Errorf("Transition: %v", err)
						}
					}
				}
			}()
			wg.Wait()

			if v := violations.Load(); v != 0 {
				t.Fatalf("%d acquisitions exceeded the %d probe permits of their HALF_OPEN", v, permitted)
			}
			c := b.Counts()
			if c.NotPermitted != refused.Load() {
				t.Fatalf("NotPermitted = %d, want the %d refusals callers saw", c.NotPermitted, refused.Load())
			}
			if sum := c.Success + c.Failure + c.SlowSuccess + c.SlowFailure + c.Ignored + c.Stale; sum != recorded.Load() {
				t.Fatalf("counts %+v add up to %d, want the %d recorded calls", c, sum, recorded.Load())
			}
			s := b.Snapshot(now())
			if s.SuccessfulCalls+s.FailedCalls != s.BufferedCalls || s.SlowFailedCalls > s.SlowCalls || s.SlowFailedCalls > s.FailedCalls {
				t.Fatalf("inconsistent snapshot %+v", s)
			}
			if tc.window == CountBased && s.BufferedCalls > tc.size {
				t.Fatalf("BufferedCalls = %d exceeds the window of %d", s.BufferedCalls, tc.size)
			}
			eventsMu.Lock()
			defer eventsMu.Unlock()
			if uint64(len(generations)) != s.Generation-1 {
				t.Fatalf("%d transition events for %d generations", len(generations), s.Generation-1)
			}
			for g, n := range generations {
				if n != 1 || g < 2 || g > s.Generation {
					t.Fatalf("generation %d announced %d times (last generation %d)", g, n, s.Generation)
				}
			}
			if s.Generation < 50 {
				t.Fatalf("only %d generations: the run did not exercise the state machine", s.Generation)
			}
			t.Logf("%d generations, counts %+v", s.Generation, c)
		})
	}
}
