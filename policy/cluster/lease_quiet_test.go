package cluster

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// use is a compartment's use on one replica as a test sets it, round by round.
type use struct{ u LeaseUsage }

func (h *use) LeaseUsage(bool) LeaseUsage { return h.u }
func (h *use) LeaseChanged(LeaseState)    {}

// reportsOf counts the lease reports replica l sent, by reason (all of them without).
func reportsOf(l *Leaser, ws ...why) float64 {
	if len(ws) == 0 {
		for w := whyRenew; w < whyCount; w++ {
			ws = append(ws, w)
		}
	}
	var n float64
	for _, w := range ws {
		var m dto.Metric
		if err := l.st.met.leaseReports[w].Write(&m); err != nil {
			panic(err)
		}
		n += m.GetCounter().GetValue()
	}
	return n
}

// dueNow reports why the lease would be reported at a round now.
func dueNow(f *fleet, ls *Lease) why {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	w, _ := ls.due(f.clock.Now())
	return w
}

// leaseInUse returns a replica's lease of a compartment limited to 100 at once, past its first
// recovery, with inFlight requests in flight.
func leaseInUse(t *testing.T, prefix string, inFlight int64) (*fleet, *use, *Lease) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), prefix, 1, time.Minute)
	h := &use{u: LeaseUsage{InFlight: inFlight}}
	ls := f.leasers[0].Lease("feature/chat", LeaseLimits{MaxConcurrent: 100}, h)
	f.pastRecovery(t, ls)
	return f, h, ls
}

// A compartment whose requests come and go within its lease (in flight 4, then 1, then 4 …) is
// steady: it is renewed every renewSteps intervals, not reported every interval.
func TestFluctuatingUseWithinTheLeaseIsSteady(t *testing.T) {
	f, h, _ := leaseInUse(t, "fluct", 4)
	for range 2 * renewSteps {
		f.round()
	}
	before := reportsOf(f.leasers[0])
	const rounds = 8 * renewSteps
	for i := range rounds {
		h.u.InFlight = []int64{4, 1}[i%2]
		f.round()
	}
	if got := reportsOf(f.leasers[0]) - before; got > rounds/renewSteps+1 {
		t.Fatalf("%v reports in %d rounds of use moving within the lease (renewals: %d)", got, rounds, rounds/renewSteps)
	}
}

// Use that comes up to the lease is reported at the next round, not at the renewal.
func TestUseReachingTheLeaseIsReportedAtOnce(t *testing.T) {
	f, h, ls := leaseInUse(t, "reach", 2)
	f.round()
	if w := dueNow(f, ls); w != whyNone {
		t.Fatalf("a lease whose use did not change is due (%v) one round after its report", w)
	}
	target := ls.State(f.clock.Now()).Slots
	h.u.InFlight = target
	if w := dueNow(f, ls); w != whyChanged {
		t.Fatalf("a lease whose requests hold all %d of its slots is due for %q, want changed", target, w)
	}
	before := reportsOf(f.leasers[0], whyChanged)
	f.round()
	if got := reportsOf(f.leasers[0], whyChanged) - before; got != 1 {
		t.Fatalf("%v reports at the round after the use reached the lease, want 1", got)
	}
	if grown := ls.State(f.clock.Now()).Slots; grown <= target {
		t.Fatalf("the lease stayed at %d slots (was %d) with all of them in use", grown, target)
	}
}

// A replica whose lease is steady, and so not reported for rounds, hears at once that another
// is short: it reports at the next round, giving back what its requests do not use, and the
// short replica gets its fair share within three rounds.
func TestSteadyReplicaHearsAnotherShortAtOnce(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "hear", 2, time.Minute)
	lim := LeaseLimits{MaxConcurrent: 10}
	holder, short := &demand{want: 5}, &demand{}
	ls0 := f.leasers[0].Lease("feature/chat", lim, holder)
	ls1 := f.leasers[1].Lease("feature/chat", lim, short)
	f.pastRecovery(t, ls0)
	waitFor(t, "r0 to hold more than its requests use", func() bool {
		holder.settle()
		f.round()
		return holder.running() == 5 && ls0.State(f.clock.Now()).Slots > 5
	})
	// r0 is steady: after a report, none for the rounds before its renewal.
	ls0.Urgent()
	f.round()
	before := reportsOf(f.leasers[0])
	for range renewSteps - 1 {
		f.clock.add(fleetInterval)
		f.leasers[0].Round()
	}
	if got := reportsOf(f.leasers[0]) - before; got != 0 {
		t.Fatalf("a steady lease was reported %v times within %d rounds", got, renewSteps-1)
	}
	// r1's requests want 5 of the 10 slots: its report asks, finds too few, and names the
	// compartment; r0 hears it.
	short.set(5)
	ls1.Need(0)
	f.leasers[1].Round()
	waitFor(t, "r0 to hear that r1 is short", func() bool { return dueNow(f, ls0) == whyHeard })
	for range 3 {
		holder.settle()
		short.settle()
		f.round()
	}
	if got := short.running(); got != 5 {
		t.Fatalf("r1 runs %d of its 5 requests three rounds after it was short (r0's lease: %d)", got, ls0.State(f.clock.Now()).Slots)
	}
}

// A replica using a window at a steady pace is given chunks that last from one renewal to the
// next: it reports for its chunks every few intervals, not every interval or two, and no
// request finds them short.
func TestSteadyWindowUseIsNotReportedEveryInterval(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "steadywin", 1, time.Minute)
	lim := LeaseLimits{Windows: []Window{{Name: "tenant/acme", Kind: "tpm", Length: time.Minute, Capacity: 100_000_000}}}
	ls := f.leasers[0].Lease("tenant/acme", lim, nil)
	short := 0
	step := func() {
		if _, ok := ls.Reserve(0, 100, f.clock.Now()); !ok {
			short++
			ls.NeedWindow(0, 100)
			f.leasers[0].Round()
			if _, ok := ls.Reserve(0, 100, f.clock.Now()); !ok {
				t.Fatal("no chunk after a report asked for it")
			}
			ls.UnneedWindow(0, 100)
		}
		f.round()
	}
	for range 6 * renewSteps {
		step()
	}
	before, short := reportsOf(f.leasers[0]), 0
	const rounds = 8 * renewSteps
	for range rounds {
		step()
	}
	if got := reportsOf(f.leasers[0]) - before; got > rounds/(renewSteps-1)+1 {
		t.Fatalf("%v reports in %d rounds of steady use of a window (one every %d rounds at most: %d)", got, rounds, renewSteps-1, rounds/(renewSteps-1))
	}
	if short > 0 {
		t.Fatalf("%d requests found the chunks short at a steady pace", short)
	}
}

// What an expired chunk leaves goes back with the renewal while the window has room, and at the
// next round when it is tight (another replica may wait for it).
func TestChunkLeftoversWaitOnlyWhileTheWindowHasRoom(t *testing.T) {
	for _, tc := range []struct {
		name     string
		capacity int64
		want     why
	}{{"roomy", 1_000_000, whyNone}, {"tight", 1_000, whyWindow}} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.Standalone(t)
			f := newFleet(t, srv.Addr(), "left"+tc.name, 1, time.Minute)
			lim := LeaseLimits{Windows: []Window{{Name: "tenant/acme", Kind: "tpm", Length: time.Minute, Capacity: tc.capacity}}}
			ls := f.leasers[0].Lease("tenant/acme", lim, nil)
			// A request takes most of the window (all of a tight one but a tenth), its chunk
			// granted whole; it settles for less once the chunk has expired.
			n := min(tc.capacity*9/10, 900)
			ls.NeedWindow(0, n)
			f.leasers[0].Round()
			c, ok := ls.Reserve(0, n, f.clock.Now())
			ls.UnneedWindow(0, n)
			if !ok {
				t.Fatal("no chunk after a report asked for it")
			}
			// Rounds go by until the chunk has expired and the lease's use has died down; then
			// a report.
			settled := func() bool {
				ls.mu.Lock()
				defer ls.mu.Unlock()
				a := &ls.wins[0]
				return a.rate <= 0.01 && len(a.chunks) == 0 && len(a.returns) == 0
			}
			for i := 0; !settled(); i++ {
				if i > 1000 {
					t.Fatal("the lease's use did not die down")
				}
				f.round()
			}
			ls.Urgent()
			f.round()
			ls.Settle(0, c, n/2, f.clock.Now())
			if w := dueNow(f, ls); w != tc.want {
				t.Fatalf("a lease with %d to give back to a window of %d is due for %q, want %q", n/2, tc.capacity, w, tc.want)
			}
		})
	}
}

// A window no longer used is let go: its last chunk expires and goes back, and the lease is not
// reported again (it used to keep asking for a chunk of one, renewed forever).
func TestIdleWindowIsNoLongerReported(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "idlewin", 1, time.Minute)
	lim := LeaseLimits{Windows: []Window{{Name: "tenant/acme", Kind: "tpm", Length: time.Minute, Capacity: 1_000_000}}}
	ls := f.leasers[0].Lease("tenant/acme", lim, nil)
	for range 2 * renewSteps {
		if _, ok := ls.Reserve(0, 100, f.clock.Now()); !ok {
			ls.NeedWindow(0, 100)
			f.leasers[0].Round()
			ls.UnneedWindow(0, 100)
		}
		f.round()
	}
	// The use stops. Its rate halves at every report, so it dies down within a few dozen
	// renewals; after that, nothing is reported.
	for range 60 * renewSteps {
		f.round()
	}
	before := reportsOf(f.leasers[0])
	for range 10 * renewSteps {
		f.round()
	}
	if got := reportsOf(f.leasers[0]) - before; got != 0 {
		ls.mu.Lock()
		defer ls.mu.Unlock()
		t.Fatalf("a window unused for %d rounds was reported %v times in %d more (its chunks: %v)", 60*renewSteps, got, 10*renewSteps, ls.wins[0].chunks)
	}
}

// leaseCalls counts the round trips replica l's lease rounds made to Redis.
func leaseCalls(l *Leaser) uint64 {
	var m dto.Metric
	if err := l.st.met.latency.WithLabelValues("lease").(prometheus.Histogram).Write(&m); err != nil {
		panic(err)
	}
	return m.GetHistogram().GetSampleCount()
}

// Two steady compartments of one replica, reported out of step at first, come to be renewed in
// one round trip: a round that reports one takes the other along once it is past half its
// renewal.
func TestSteadyLeasesAreRenewedTogether(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "together", 1, time.Minute)
	l := f.leasers[0]
	a := l.Lease("feature/chat", LeaseLimits{MaxConcurrent: 100}, &use{u: LeaseUsage{InFlight: 2}})
	b := l.Lease("tenant/acme", LeaseLimits{MaxConcurrent: 100}, &use{u: LeaseUsage{InFlight: 2}})
	f.pastRecovery(t, a)
	f.pastRecovery(t, b)
	// Out of step: a is reported now, b a third of a renewal later.
	a.Urgent()
	f.round()
	for range renewSteps / 3 {
		f.round()
	}
	b.Urgent()
	f.round()
	reports, calls := reportsOf(l), leaseCalls(l)
	const renewals = 8
	for range renewals * renewSteps {
		f.round()
	}
	gotReports, gotCalls := reportsOf(l)-reports, leaseCalls(l)-calls
	if gotReports < 2*renewals-2 || gotReports > 2*renewals+2 {
		t.Fatalf("%v reports of two steady compartments over %d renewals", gotReports, renewals)
	}
	if gotCalls > renewals+1 {
		t.Fatalf("%d round trips for %v reports of two steady compartments over %d renewals: they were not renewed together", gotCalls, gotReports, renewals)
	}
}
