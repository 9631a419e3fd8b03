package mock

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

func TestParseCapacitySchedule(t *testing.T) {
	tests := []struct {
		in      string
		want    CapacitySchedule
		wantErr string
	}{
		{in: "10@0s,4@10s,10@25s", want: CapacitySchedule{{0, 10}, {10 * time.Second, 4}, {25 * time.Second, 10}}},
		{in: "3@0s", want: CapacitySchedule{{0, 3}}},
		{in: " 8@0 , 2@1m30s ,8@100ms", wantErr: "later than the previous"},
		{in: " 8@0 , 2@1m30s ", want: CapacitySchedule{{0, 8}, {90 * time.Second, 2}}},
		{in: "", wantErr: "empty"},
		{in: "   ", wantErr: "empty"},
		{in: "10", wantErr: `step 1 "10": want capacity@offset`},
		{in: "10@0s,", wantErr: `step 2 "": want capacity@offset`},
		{in: "ten@0s", wantErr: `capacity "ten" is not a whole number`},
		{in: "10@soon", wantErr: `offset "soon" is not a duration`},
		{in: "10@5", wantErr: `offset "5" is not a duration`},
		{in: "10@5s", wantErr: "first step must be at 0s"},
		{in: "0@0s", wantErr: "capacity 0 must lie in [1,"},
		{in: "-2@0s", wantErr: "capacity -2 must lie in [1,"},
		{in: "10@0s,4@10s,5@10s", wantErr: "step 3: offset 10s must be later than the previous step's 10s"},
		{in: "10@0s,4@-1s", wantErr: "step 2: offset -1s must lie in"},
		{in: "10@0s,4@200h", wantErr: "must lie in [0s, 168h0m0s]"},
		{in: "10 @0s", wantErr: "not a whole number"},
		{in: "10@0s@1s", wantErr: "not a duration"},
		{in: strings.Repeat("1@0s,", maxScheduleSteps) + "1@0s", wantErr: "at most 1024"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseCapacitySchedule(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("ParseCapacitySchedule(%q) = %v, %v; want an error containing %q", tt.in, got, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseCapacitySchedule(%q): %v", tt.in, err)
			}
			if !slices.Equal(got, tt.want) {
				t.Fatalf("ParseCapacitySchedule(%q) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}

func FuzzParseCapacitySchedule(f *testing.F) {
	for _, s := range []string{"10@0s,4@10s,10@25s", "1@0s", "2@0,3@1ns", "10@0s,", "x@y", "5@0s,5@1h,5@2h", "1@0s,1@-1s", "@", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		cs, err := ParseCapacitySchedule(s)
		if err != nil {
			if cs != nil {
				t.Fatalf("error %v with a schedule %v", err, cs)
			}
			return
		}
		if err := cs.validate(); err != nil {
			t.Fatalf("parsed %q into an invalid schedule %v: %v", s, cs, err)
		}
		again, err := ParseCapacitySchedule(cs.String())
		if err != nil || !slices.Equal(again, cs) {
			t.Fatalf("%q → %v → %q → %v, %v", s, cs, cs.String(), again, err)
		}
	})
}

func TestCapacityScheduleAt(t *testing.T) {
	cs := CapacitySchedule{{0, 10}, {10 * time.Second, 4}, {25 * time.Second, 10}}
	for _, tt := range []struct {
		at   time.Duration
		want int
	}{{-time.Second, 10}, {0, 10}, {10*time.Second - 1, 10}, {10 * time.Second, 4}, {24 * time.Second, 4}, {25 * time.Second, 10}, {time.Hour, 10}} {
		if got := cs.At(tt.at); got != tt.want {
			t.Errorf("At(%v) = %d, want %d", tt.at, got, tt.want)
		}
	}
	if got := (CapacitySchedule{}).At(time.Second); got != 0 {
		t.Errorf("empty schedule At = %d, want 0", got)
	}
}

func TestCapacityScheduleOptions(t *testing.T) {
	_, err := New(Options{Capacity: 3, CapacitySchedule: CapacitySchedule{{0, 2}}})
	if err == nil || !strings.Contains(err.Error(), "exclude each other") {
		t.Fatalf("New with both = %v, want an error", err)
	}
	_, err = New(Options{CapacitySchedule: CapacitySchedule{{time.Second, 2}}})
	if err == nil || !strings.Contains(err.Error(), "first step must be at 0s") {
		t.Fatalf("New with a late first step = %v, want an error", err)
	}
}

func TestPoolSetLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := newPool(3)
		for range 3 {
			if _, err := p.acquire(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		var order []int
		var mu sync.Mutex
		var wg sync.WaitGroup
		for i := range 3 {
			wg.Go(func() {
				if _, err := p.acquire(context.Background()); err == nil {
					mu.Lock()
					order = append(order, i)
					mu.Unlock()
				}
			})
			synctest.Wait()
		}
		p.setLimit(1)
		if st := p.stats(1); st.Capacity != 1 || st.InFlight != 3 || st.Queued != 3 {
			t.Fatalf("after lowering: %+v, want the 3 in service kept and 3 queued", st)
		}
		p.release()
		p.release()
		synctest.Wait()
		if st := p.stats(1); st.InFlight != 1 || st.Queued != 3 {
			t.Fatalf("after two releases: %+v, want 1 in flight and nobody let in", st)
		}
		p.release()
		synctest.Wait()
		if st := p.stats(1); st.InFlight != 1 || st.Queued != 2 || !slices.Equal(order, []int{0}) {
			t.Fatalf("after the third release: %+v, order %v; want the oldest waiter in", st, order)
		}
		p.release() // the holder leaves: waiter 1 gets its slot
		synctest.Wait()
		p.setLimit(2) // one more slot: waiter 2 at once
		synctest.Wait()
		if st := p.stats(1); st.InFlight != 2 || st.Queued != 0 || !slices.Equal(order, []int{0, 1, 2}) {
			t.Fatalf("after raising to 2: %+v, order %v; want the two waiters left in, oldest first", st, order)
		}
		wg.Wait()
	})
}

// TestCapacityScheduleTimeline runs requests of 1.001 simulated seconds
// against the schedule 2@0s,1@500ms,3@1500ms: a lowered capacity keeps the
// requests in service, a raised one lets the queue in at once, and every
// response reports its simulated queue wait, whatever the time scale.
func TestCapacityScheduleTimeline(t *testing.T) {
	for _, scale := range []float64{1, 0.1} {
		t.Run(strings.ReplaceAll(time.Duration(scale*float64(time.Second)).String(), ".", "_"), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				sched, err := ParseCapacitySchedule("2@0s,1@500ms,3@1500ms")
				if err != nil {
					t.Fatal(err)
				}
				s, err := New(Options{TimeScale: scale, CapacitySchedule: sched,
					Latency: LatencyModel{Base: time.Second, TokensPerSecond: 1000, JitterMin: 1, JitterMax: 1}})
				if err != nil {
					t.Fatal(err)
				}
				defer s.StopSchedule()
				sim := func(d time.Duration) time.Duration { return time.Duration(float64(d) * scale) }
				start := time.Now()
				const each = 1001 * time.Millisecond // 1 s + 1 token
				type result struct {
					done time.Duration
					wait string
				}
				results := make([]result, 5)
				var wg sync.WaitGroup
				send := func(i int) {
					req := httptest.NewRequest(http.MethodPost, "/v1/embeddings", strings.NewReader(`{"model":"e","input":"abcd"}`))
					w := newTimedWriter()
					wg.Go(func() {
						s.ServeHTTP(w, req)
						results[i] = result{done: time.Since(start), wait: w.Header().Get(HeaderQueueWait)}
					})
					synctest.Wait()
				}
				capacity := func() int { return s.Stats().Global.Capacity }
				for i := range 3 {
					send(i)
				}
				if g := s.Stats().Global; g.Capacity != 2 || g.InFlight != 2 || g.Queued != 1 {
					t.Fatalf("at 0s: %+v, want capacity 2, 2 in flight, 1 queued", g)
				}
				time.Sleep(sim(600 * time.Millisecond))
				if g := s.Stats().Global; g.Capacity != 1 || g.InFlight != 2 {
					t.Fatalf("at 0.6s: %+v, want capacity 1 with both requests still in service", g)
				}
				time.Sleep(sim(600 * time.Millisecond)) // 1.2 s: request 2 got the one slot at 1.001 s
				send(3)
				send(4)
				if g := s.Stats().Global; g.InFlight != 1 || g.Queued != 2 {
					t.Fatalf("at 1.2s: %+v, want 1 in flight and 2 queued", g)
				}
				time.Sleep(sim(400 * time.Millisecond)) // 1.6 s: capacity 3 since 1.5 s
				if c := capacity(); c != 3 {
					t.Fatalf("capacity at 1.6s = %d, want 3", c)
				}
				wg.Wait()
				want := []result{
					{sim(each), "0.000"}, {sim(each), "0.000"},
					{sim(2 * each), "1.001"},
					{sim(1500*time.Millisecond + each), "0.300"}, {sim(1500*time.Millisecond + each), "0.300"},
				}
				for i := range want {
					if results[i] != want[i] {
						t.Errorf("request %d: done at %v with queue wait %q, want %v and %q", i, results[i].done, results[i].wait, want[i].done, want[i].wait)
					}
				}
				g := s.Stats().Global
				if g.Waited != 3 || g.WaitSeconds < 1.6009 || g.WaitSeconds > 1.6011 {
					t.Errorf("stats: %d waited for %v s, want 3 for 1.601 s", g.Waited, g.WaitSeconds)
				}
			})
		})
	}
}

func TestResetRestartsTheSchedule(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := New(Options{CapacitySchedule: CapacitySchedule{{0, 1}, {time.Second, 5}}})
		if err != nil {
			t.Fatal(err)
		}
		defer s.StopSchedule()
		capacity := func() int { return s.Stats().Global.Capacity }
		time.Sleep(1500 * time.Millisecond)
		if c := capacity(); c != 5 {
			t.Fatalf("capacity after 1.5 s = %d, want 5", c)
		}
		s.Reset()
		if c := capacity(); c != 1 {
			t.Fatalf("capacity right after Reset = %d, want the first step's 1", c)
		}
		time.Sleep(900 * time.Millisecond)
		if c := capacity(); c != 1 {
			t.Fatalf("capacity 0.9 s after Reset = %d, want 1 (the old timers must not count)", c)
		}
		time.Sleep(200 * time.Millisecond)
		if c := capacity(); c != 5 {
			t.Fatalf("capacity 1.1 s after Reset = %d, want 5", c)
		}
		s.Reset()
		s.StopSchedule()
		time.Sleep(2 * time.Second)
		if c := capacity(); c != 1 {
			t.Fatalf("capacity after StopSchedule = %d, want the capacity in force (1) kept", c)
		}
		s.Reset()
		if err := s.SetCapacity(3); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Second)
		if c := capacity(); c != 3 {
			t.Fatalf("capacity after SetCapacity(3) = %d, want 3 (the schedule stopped)", c)
		}
		if err := s.SetCapacity(-1); err == nil {
			t.Fatal("SetCapacity(-1) accepted")
		}
	})
}
