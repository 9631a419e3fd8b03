package budget_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func at(d time.Duration) time.Time { return t0.Add(d) }

func TestWindow(t *testing.T) {
	type step struct {
		at       time.Duration
		op       string // reserve, settle, refund, take
		n        int64  // tokens to reserve/take, or actual for settle
		ref      int    // which earlier reservation to settle/refund
		wantOK   bool
		wantWait time.Duration
		wantUsed int64
	}
	tests := []struct {
		name  string
		cap   int64
		debt  float64
		steps []step
	}{
		{
			name: "admits up to capacity, then says exactly when",
			cap:  50_000,
			steps: []step{
				{at: 0, op: "reserve", n: 20_000, wantOK: true, wantUsed: 20_000},
				{at: 10 * time.Second, op: "reserve", n: 20_000, wantOK: true, wantUsed: 40_000},
				{at: 20 * time.Second, op: "reserve", n: 20_000, wantOK: false, wantWait: 40 * time.Second, wantUsed: 40_000},
				// The first charge ages out at 60s: 20 000 free again.
				{at: 59 * time.Second, op: "reserve", n: 20_000, wantOK: false, wantWait: time.Second, wantUsed: 40_000},
				{at: 60 * time.Second, op: "reserve", n: 20_000, wantOK: true, wantUsed: 40_000},
			},
		},
		{
			name: "refill is continuous, not a minute boundary",
			cap:  60,
			steps: []step{
				{at: 0, op: "reserve", n: 30, wantOK: true, wantUsed: 30},
				{at: 30 * time.Second, op: "reserve", n: 30, wantOK: true, wantUsed: 60},
				{at: 61 * time.Second, op: "reserve", n: 30, wantOK: true, wantUsed: 60},
				{at: 62 * time.Second, op: "reserve", n: 1, wantOK: false, wantWait: 28 * time.Second, wantUsed: 60},
			},
		},
		{
			name: "over-estimate refunded to its own slot",
			cap:  10_000,
			steps: []step{
				{at: 0, op: "reserve", n: 8000, wantOK: true, wantUsed: 8000},
				{at: 5 * time.Second, op: "settle", ref: 0, n: 3000, wantUsed: 3000},
				{at: 6 * time.Second, op: "reserve", n: 7000, wantOK: true, wantUsed: 10_000},
				// The refunded reservation still ages out at 60s, taking its 3000 with it.
				{at: 60 * time.Second, op: "reserve", n: 3000, wantOK: true, wantUsed: 10_000},
			},
		},
		{
			name: "under-estimate charged as debt that delays later requests",
			cap:  10_000,
			debt: 1,
			steps: []step{
				{at: 0, op: "reserve", n: 2000, wantOK: true, wantUsed: 2000},
				{at: 30 * time.Second, op: "settle", ref: 0, n: 15_000, wantUsed: 15_000},
				{at: 31 * time.Second, op: "reserve", n: 1, wantOK: false, wantWait: 59 * time.Second, wantUsed: 15_000},
				{at: 90 * time.Second, op: "reserve", n: 1, wantOK: true, wantUsed: 1},
			},
		},
		{
			name: "debt is bounded",
			cap:  10_000,
			debt: 0.5,
			steps: []step{
				{at: 0, op: "reserve", n: 1000, wantOK: true, wantUsed: 1000},
				{at: time.Second, op: "settle", ref: 0, n: 100_000, wantUsed: 15_000},
			},
		},
		{
			name: "a request larger than capacity needs an empty window",
			cap:  10_000,
			debt: 1,
			steps: []step{
				{at: 0, op: "reserve", n: 1, wantOK: true, wantUsed: 1},
				{at: time.Second, op: "reserve", n: 50_000, wantOK: false, wantWait: 59 * time.Second, wantUsed: 1},
				{at: 60 * time.Second, op: "reserve", n: 50_000, wantOK: true, wantUsed: 20_000},
			},
		},
		{
			name: "refund of a refused later step gives everything back",
			cap:  100,
			steps: []step{
				{at: 0, op: "reserve", n: 100, wantOK: true, wantUsed: 100},
				{at: time.Second, op: "refund", ref: 0, wantUsed: 0},
				{at: 2 * time.Second, op: "reserve", n: 100, wantOK: true, wantUsed: 100},
			},
		},
		{
			name: "a clock jumping backwards never mints tokens",
			cap:  100,
			steps: []step{
				{at: 30 * time.Second, op: "reserve", n: 100, wantOK: true, wantUsed: 100},
				{at: -10 * time.Minute, op: "reserve", n: 1, wantOK: false, wantWait: 60 * time.Second, wantUsed: 100},
				{at: 31 * time.Second, op: "reserve", n: 1, wantOK: false, wantWait: 59 * time.Second, wantUsed: 100},
				{at: 90 * time.Second, op: "reserve", n: 1, wantOK: true, wantUsed: 1},
			},
		},
		{
			name: "refund after the charge aged out does nothing",
			cap:  100,
			steps: []step{
				{at: 0, op: "reserve", n: 100, wantOK: true, wantUsed: 100},
				{at: 2 * time.Minute, op: "reserve", n: 50, wantOK: true, wantUsed: 50},
				{at: 2*time.Minute + time.Second, op: "settle", ref: 0, n: 0, wantUsed: 50},
			},
		},
		{
			name: "take ignores the limit (shadow mode) but not the debt bound",
			cap:  100,
			debt: 1,
			steps: []step{
				{at: 0, op: "take", n: 150, wantUsed: 150},
				{at: 0, op: "take", n: 150, wantUsed: 200},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := budget.New(tt.cap, time.Minute, tt.debt, t0)
			var charges []budget.Charge
			for i, s := range tt.steps {
				now := at(s.at)
				switch s.op {
				case "reserve":
					ch, ok, wait := w.Reserve(s.n, now)
					if ok != s.wantOK || (!ok && wait != s.wantWait) {
						t.Fatalf("step %d: Reserve(%d) = %v, wait %s; want %v, wait %s", i, s.n, ok, wait, s.wantOK, s.wantWait)
					}
					charges = append(charges, ch)
				case "take":
					charges = append(charges, w.Take(s.n, now))
				case "settle":
					w.Settle(charges[s.ref], s.n, now)
				case "refund":
					w.Refund(charges[s.ref], now)
				}
				if used := w.State(now).Used; used != s.wantUsed {
					t.Fatalf("step %d (%s): used = %d, want %d", i, s.op, used, s.wantUsed)
				}
			}
		})
	}
}

func TestReconfigureKeepsSpend(t *testing.T) {
	w := budget.New(1000, time.Minute, 1, t0)
	w.Reserve(800, t0)
	// Lowered below what was spent: nothing more until the spend ages out.
	w.Reconfigure(500, time.Minute, 1, at(time.Second))
	if _, ok, _ := w.Reserve(1, at(2*time.Second)); ok {
		t.Fatal("admitted while 800 of 500 are spent")
	}
	if _, ok, _ := w.Reserve(500, at(61*time.Second)); !ok {
		t.Fatal("refused after the spend aged out")
	}
	// A new window length keeps the spend for one whole new window.
	w2 := budget.New(1000, time.Minute, 1, t0)
	w2.Reserve(1000, t0)
	w2.Reconfigure(1000, 2*time.Minute, 1, at(30*time.Second))
	if _, ok, wait := w2.Reserve(1, at(31*time.Second)); ok || wait != 2*time.Minute-time.Second {
		t.Fatalf("after a window change: ok %v wait %s", ok, wait)
	}
}

func TestStateResetIn(t *testing.T) {
	w := budget.New(1000, time.Minute, 1, t0)
	w.Reserve(100, at(10*time.Second))
	w.Reserve(100, at(20*time.Second))
	st := w.State(at(30 * time.Second))
	if st.Remaining != 800 || st.ResetIn != 50*time.Second {
		t.Fatalf("state = %+v, want remaining 800, reset in 50s", st)
	}
}

// TestRandomisedHourStaysWithinBudget simulates an hour of random requests whose real use
// differs from the estimate, settling each when it ends. Over every minute, the tokens of
// requests admitted in that minute stay within the budget plus one largest request, and over
// the hour the real spend stays within the budget (plus one window of debt).
func TestRandomisedHourStaysWithinBudget(t *testing.T) {
	const capacity = 50_000
	rng := rand.New(rand.NewPCG(7, 11))
	w := budget.New(capacity, time.Minute, 1, t0)
	type pending struct {
		ch     budget.Charge
		actual int64
		ends   time.Time
	}
	var inflight []pending
	perMinute := map[int]int64{}
	var total, largest int64
	for ms := 0; ms < 3600_000; ms += 250 {
		now := at(time.Duration(ms) * time.Millisecond)
		// Settle what finished.
		kept := inflight[:0]
		for _, p := range inflight {
			if !now.Before(p.ends) {
				w.Settle(p.ch, p.actual, now)
				continue
			}
			kept = append(kept, p)
		}
		inflight = kept
		if rng.IntN(4) != 0 {
			continue
		}
		est := int64(rng.IntN(6000) + 500)
		actual := est * int64(rng.IntN(80)+40) / 100 // 40 %–120 % of the estimate
		ch, ok, _ := w.Reserve(est, now)
		if !ok {
			continue
		}
		largest = max(largest, actual)
		perMinute[ms/60_000] += actual
		total += actual
		inflight = append(inflight, pending{ch, actual, now.Add(time.Duration(rng.IntN(20)+1) * time.Second)})
	}
	for m, used := range perMinute {
		if used > capacity+largest {
			t.Errorf("minute %d: %d tokens admitted, budget %d + largest request %d", m, used, capacity, largest)
		}
	}
	if total > 60*capacity+capacity {
		t.Errorf("hour total %d exceeds 60 × %d + one window of debt", total, capacity)
	}
	if total < 30*capacity {
		t.Errorf("hour total %d: the budget was barely used, the test is not exercising it", total)
	}
}

func BenchmarkReserveSettle(b *testing.B) {
	w := budget.New(1<<40, time.Minute, 1, t0)
	b.ReportAllocs()
	now := t0
	for b.Loop() {
		ch, _, _ := w.Reserve(1000, now)
		w.Settle(ch, 900, now)
	}
}

// TestReservationClippedAtTheDebtBoundIsForgivenOnce is the regression test for a reservation
// clipped at the debt bound being counted as forgiven, and then the same tokens again when
// settlement could not charge them.
func TestReservationClippedAtTheDebtBoundIsForgivenOnce(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	w := budget.New(100, time.Minute, 0.5, now) // may hold 150 while in debt
	c, ok, _ := w.Reserve(400, now)             // an empty window admits it; the charge stops at 150
	if !ok || c.Amount() != 150 {
		t.Fatalf("reserve: ok %v, charged %d", ok, c.Amount())
	}
	if st := w.State(now); st.Forgiven != 0 {
		t.Fatalf("forgiven %d after the reservation alone", st.Forgiven)
	}
	w.Settle(c, 400, now)
	if st := w.State(now); st.Used != 150 || st.Forgiven != 250 {
		t.Fatalf("after settling 400: used %d, forgiven %d; want 150 and 250", st.Used, st.Forgiven)
	}
}

// TestSaveRestoreResumesExactly: a window restored from what Save gave counts, at every later
// instant, exactly what the window it was saved from counts: charges age out at the same
// instants, and what aged out while the process was down is gone.
func TestSaveRestoreResumesExactly(t *testing.T) {
	for _, tc := range []struct {
		name   string
		length time.Duration
		down   time.Duration
	}{
		{"minute window, down 5s", time.Minute, 5 * time.Second},
		{"minute window, down 45s", time.Minute, 45 * time.Second},
		{"day window, down 3h", 24 * time.Hour, 3 * time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			step := tc.length / 60
			orig := budget.New(1_000_000, tc.length, 1, t0)
			for i, n := range []int64{5000, 700, 12_000, 40, 9000} {
				orig.Take(n, t0.Add(time.Duration(i*7)*step+step/3))
			}
			saved := t0.Add(40 * step)
			slot, charges := orig.Save(saved)
			if slot != step || len(charges) != 5 {
				t.Fatalf("Save gave slot %v and %d charges, want %v and 5: %v", slot, len(charges), step, charges)
			}
			start := saved.Add(tc.down)
			restored := budget.New(1_000_000, tc.length, 1, start)
			if got, want := restored.Restore(slot, charges, start), orig.State(start).Used; got != want {
				t.Fatalf("Restore kept %d, the saved window counts %d at the restart", got, want)
			}
			for at := start; at.Before(start.Add(tc.length + 2*step)); at = at.Add(step / 2) {
				if got, want := restored.State(at), orig.State(at); got.Used != want.Used || got.ResetIn != want.ResetIn {
					t.Fatalf("at +%v the restored window counts %d (reset in %v), the saved one %d (reset in %v)",
						at.Sub(t0), got.Used, got.ResetIn, want.Used, want.ResetIn)
				}
			}
		})
	}
}

// TestRestoreAfterTheWindowIsEmpty: a process down for longer than the window restores nothing.
func TestRestoreAfterTheWindowIsEmpty(t *testing.T) {
	orig := budget.New(100, time.Minute, 1, t0)
	orig.Take(80, t0)
	slot, charges := orig.Save(at(30 * time.Second))
	w := budget.New(100, time.Minute, 1, at(2*time.Minute))
	if kept := w.Restore(slot, charges, at(2*time.Minute)); kept != 0 || !w.Empty(at(2*time.Minute)) {
		t.Fatalf("restored %d two minutes later, want nothing", kept)
	}
}

// TestRestoreReplaces: restoring the same charges again counts them once.
func TestRestoreReplaces(t *testing.T) {
	orig := budget.New(100, time.Minute, 1, t0)
	orig.Take(30, t0)
	slot, charges := orig.Save(at(time.Second))
	w := budget.New(100, time.Minute, 1, at(time.Second))
	w.Take(5, at(time.Second))
	w.Restore(slot, charges, at(time.Second))
	w.Restore(slot, charges, at(2*time.Second))
	if got := w.State(at(2 * time.Second)).Used; got != 30 {
		t.Fatalf("used %d after restoring 30 twice, want 30", got)
	}
}

// TestRestoreUnderANewCapacity: a lowered capacity keeps everything charged, which is debt
// until it ages out at the instant it would have; a raised one admits at once what now fits.
func TestRestoreUnderANewCapacity(t *testing.T) {
	orig := budget.New(1000, time.Minute, 1, t0)
	orig.Take(600, at(10*time.Second))
	orig.Take(300, at(20*time.Second))
	slot, charges := orig.Save(at(30 * time.Second))

	lower := budget.New(500, time.Minute, 1, at(35*time.Second))
	lower.Restore(slot, charges, at(35*time.Second))
	if st := lower.State(at(35 * time.Second)); st.Used != 900 || st.Remaining != -400 {
		t.Fatalf("under capacity 500: used %d remaining %d, want 900 and -400", st.Used, st.Remaining)
	}
	// 600 ages out at 70s, leaving 300: 200 fits then, and not a moment before.
	if _, ok, wait := lower.Reserve(200, at(35*time.Second)); ok || wait != 35*time.Second {
		t.Fatalf("reserve 200 at 35s: ok %v wait %v, want refused for 35s", ok, wait)
	}
	if _, ok, _ := lower.Reserve(200, at(70*time.Second)); !ok {
		t.Fatal("reserve 200 at 70s refused, want admitted once the 600 aged out")
	}

	higher := budget.New(2000, time.Minute, 1, at(35*time.Second))
	higher.Restore(slot, charges, at(35*time.Second))
	if _, ok, _ := higher.Reserve(1100, at(35*time.Second)); !ok {
		t.Fatal("reserve 1100 under capacity 2000 with 900 restored: refused")
	}
	if _, ok, _ := higher.Reserve(1, at(35*time.Second)); ok {
		t.Fatal("reserve 1 beyond capacity 2000: admitted")
	}
}

// TestRestoreUnderANewLength: charges saved by a window of another length count for the new
// length from the end of the slot they were made in — a shorter window drops those already
// older than it, a longer one keeps them until they are that old — and never longer.
func TestRestoreUnderANewLength(t *testing.T) {
	orig := budget.New(1000, time.Hour, 1, t0)
	orig.Take(100, at(time.Minute))                // slot [0, 1m): its end is 1m
	orig.Take(10, at(30*time.Minute))              // slot [30m, 31m)
	orig.Take(1, at(58*time.Minute+5*time.Second)) // slot [58m, 59m)
	slot, charges := orig.Save(at(58*time.Minute + 30*time.Second))

	// Into a minute window at 59m30s: only the charge whose slot ended at 59m is less than a
	// minute old. Its last possible instant, just before 59m, is in the new slot [58m59s, 59m):
	// it ages out with that slot, at 59m59s, as a charge made then would.
	short := budget.New(1000, time.Minute, 1, at(59*time.Minute+30*time.Second))
	if kept := short.Restore(slot, charges, at(59*time.Minute+30*time.Second)); kept != 1 {
		t.Fatalf("into a minute window kept %d, want 1 (the older charges are more than a minute old)", kept)
	}
	if st := short.State(at(59*time.Minute + 30*time.Second)); st.ResetIn != 29*time.Second {
		t.Fatalf("the restored charge resets in %v, want 29s (at 59m59s)", st.ResetIn)
	}

	// Into a day window, whose slots are 24 minutes long: everything counts, each charge until
	// the slot it lands in leaves the window, as a charge made then would — the one made in
	// [0, 1m) sits in [0, 24m) and ages out at 24h, those of 30m and 58m sit in [24m, 48m) and
	// [48m, 72m) and age out at 24h24m and 24h48m.
	day := budget.New(1000, 24*time.Hour, 1, at(time.Hour))
	if kept := day.Restore(slot, charges, at(time.Hour)); kept != 111 {
		t.Fatalf("into a day window kept %d, want 111", kept)
	}
	for _, c := range []struct {
		at   time.Duration
		used int64
	}{{24*time.Hour - time.Second, 111}, {24 * time.Hour, 11}, {24*time.Hour + 24*time.Minute, 1}, {24*time.Hour + 48*time.Minute, 0}} {
		if got := day.State(at(c.at)).Used; got != c.used {
			t.Fatalf("a day window counts %d at %v, want %d", got, c.at, c.used)
		}
	}
}

// TestRestoreFromAClockAhead: a charge saved at an instant later than now (the clock was ahead
// when it was saved) counts in the current slot, for one window from now, and no longer.
func TestRestoreFromAClockAhead(t *testing.T) {
	orig := budget.New(1000, time.Minute, 1, at(time.Hour))
	orig.Take(70, at(time.Hour))
	slot, charges := orig.Save(at(time.Hour))
	w := budget.New(1000, time.Minute, 1, t0)
	if kept := w.Restore(slot, charges, t0); kept != 70 {
		t.Fatalf("kept %d, want 70", kept)
	}
	if got := w.State(at(59 * time.Second)).Used; got != 70 {
		t.Fatalf("used %d at 59s, want 70", got)
	}
	if !w.Empty(at(time.Minute)) {
		t.Fatal("a charge from the future still counts a minute later")
	}
}
