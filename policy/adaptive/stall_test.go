package adaptive

import (
	"testing"
	"time"
)

// stallBeforeEnd stalls the process for d, starting a moment before the next request ends, so
// that an end (which judges the requests still waiting) is handled at the stall's end before
// the first tokens that came during it.
func (x *sim) stallBeforeEnd(d time.Duration) {
	next := time.Time{}
	for _, e := range x.queue {
		if e.kind == evDone && (next.IsZero() || e.at.Before(next)) {
			next = e.at
		}
	}
	if lead := next.Sub(x.now) - 50*time.Millisecond; lead > 0 {
		x.run(lead)
	}
	x.stall(d)
}

// TestProcessStallDoesNotCutAHealthyLimit: with a provider that has room, the limit sits at
// its max, saturated. Every few seconds our process stalls for 300ms (a CPU-throttled
// container): first tokens that came meanwhile are handled at its end, after an end that
// judges the requests still waiting. Those requests waited 300ms longer than the provider
// took, most beyond tolerance; but the process, not the provider, held them, and the limit
// stays where it was. (Without the stalled time discounted, the first stall cuts it.)
func TestProcessStallDoesNotCutAHealthyLimit(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
		s := settings(10)
		s.Max = 20
		x := newSimSeed(s, llmProvider(100), 60, seed)
		x.run(60 * time.Second)
		if got := x.ctl.Limit(); got != 20 {
			t.Fatalf("seed %d: limit %d after a minute with a provider that has room, want max 20", seed, got)
		}
		for range 20 {
			x.stallBeforeEnd(300 * time.Millisecond)
			x.run(3 * time.Second)
		}
		if x.lateFirst == 0 {
			t.Fatalf("seed %d: no first token came during a stall", seed)
		}
		st := x.ctl.State()
		if lo, _, _ := x.limits(at(60), x.now); lo != 20 || st.Decreases != [2]uint64{} {
			t.Errorf("seed %d: 20 stalls of the process took the limit down to %d (%d cuts for latency); want it at 20",
				seed, lo, st.Decreases[CauseLatency])
		}
	}
}

// TestBrownoutCutThroughProcessStalls: a brownout (capacity 10, then 4) in a process that
// stalls for 300ms every 2s is cut as fast as in one that never stalls, but for the time the
// process could not run: the limit is at most 7 no later than without stalls plus the stalled
// time before (a first token that came during a stall is known only to lie within it), and the
// provider's queue holds at most one request more. Over eight seeded runs.
func TestBrownoutCutThroughProcessStalls(t *testing.T) {
	for seed := uint64(1); seed <= 8; seed++ {
		var cut [2]time.Duration
		var peak [2]int
		var stalled time.Duration
		for run, stalls := range []bool{false, true} {
			p := llmProvider(10)
			x := newSimSeed(settings(10), p, 40, seed)
			x.run(120 * time.Second)
			onset := x.now
			p.capacity = 4
			for i := range 120 { // 6s
				if stalls && i%40 == 0 {
					x.stall(300 * time.Millisecond)
				} else {
					x.run(50 * time.Millisecond)
				}
				peak[run] = max(peak[run], len(p.queue))
				if cut[run] == 0 && x.ctl.Limit() <= 7 {
					cut[run] = x.now.Sub(onset)
					if stalls {
						stalled = time.Duration(len(x.stalls)) * 300 * time.Millisecond
					}
				}
			}
			if cut[run] == 0 {
				t.Fatalf("seed %d (stalls %v): the limit was still above 7 6s into the brownout", seed, stalls)
			}
		}
		if cut[1] > cut[0]+stalled {
			t.Errorf("seed %d: with stalls the limit was at most 7 after %v; without, after %v, and the process stalled for %v",
				seed, cut[1], cut[0], stalled)
		}
		if peak[1] > peak[0]+1 {
			t.Errorf("seed %d: with stalls the provider's queue reached %d; without, %d", seed, peak[1], peak[0])
		}
	}
}

// TestFirstBaselineThroughFrequentStalls: a process that stalls briefly and often from its
// start (a loaded machine: 40ms in every 100ms) meets a busy provider (capacity 4) with a limit
// of 16. Almost every first token comes during a stall, so only upper bounds of the first,
// unqueued requests' times are known; taking the first baseline from the few exact ones, all of
// queued requests, would learn the queue as the provider's speed and never bring the limit
// down. The first baseline stays near the provider's own time to first token, and the limit
// comes down to 8 or below within 20 s. Over four seeded runs.
func TestFirstBaselineThroughFrequentStalls(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
		s := settings(16)
		s.Max, s.Interval = 16, 200*time.Millisecond
		x := newSimSeed(s, llmProvider(4), 24, seed)
		for range 200 { // 20s
			x.run(60 * time.Millisecond)
			x.stall(40 * time.Millisecond)
		}
		st := x.ctl.State()
		// The provider's own time to first token, normalised: 200ms + 0.1ms per prompt token,
		// over 1 + prompt / PromptUnit, ±10%.
		if st.BaselineTTFB > 400*time.Millisecond {
			t.Errorf("seed %d: first baseline %v, the provider answering in about 300ms unqueued", seed, st.BaselineTTFB)
		}
		if lo, _, _ := x.limits(at(10), x.now); lo > 8 {
			t.Errorf("seed %d: limit still at least %d after 10s on a provider of capacity 4 (baseline %v)", seed, lo, st.BaselineTTFB)
		}
	}
}
