package cluster

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// replica opens a store on addr and returns a ledger keeping its sums there.
func replica(t *testing.T, addr, id string) (*spend.Ledger, *Store) {
	t.Helper()
	o := options(addr, "spend", id)
	// A reservation gives up on a paused Redis soon: the outage test waits for that.
	o.Timeout = 300 * time.Millisecond
	st := open(t, o)
	l := spend.NewLedger(NewSpendStore(st))
	_, _ = l.Configure(spend.Settings{Currency: "USD", Calendar: spend.NewCalendar(time.UTC)}, time.Now())
	return l, st
}

func reserveIn(t *testing.T, l *spend.Ledger, b spend.Budget, amount spend.Micros) (*spend.Reservation, spend.Refusal, bool) {
	t.Helper()
	r := &spend.Reservation{}
	r.Reset(time.Now())
	r.Add(b)
	rf, ok := l.Reserve(context.Background(), r, amount, time.Now())
	return r, rf, ok
}

// reserveSoon reserves amount in b, trying until a reservation is admitted (a leased replica's
// first ones wait for its chunks), and returns it.
func reserveSoon(t *testing.T, l *spend.Ledger, b spend.Budget, amount spend.Micros, what string) *spend.Reservation {
	t.Helper()
	var r *spend.Reservation
	waitFor(t, what, func() bool {
		res, _, ok := reserveIn(t, l, b, amount)
		r = res
		return ok
	})
	return r
}

// TestSpendStoreSharesBudgetsAcrossReplicas: a daily budget of $1.00 is one budget across two
// replicas, settled to real cost, and both see the same window.
func TestSpendStoreSharesBudgetsAcrossReplicas(t *testing.T) {
	rd := redistest.Standalone(t)
	a, _ := replica(t, rd.Addr(), "a")
	b, _ := replica(t, rd.Addr(), "b")
	budget := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: 1_000_000}

	ra, _, ok := reserveIn(t, a, budget, 400_000)
	if !ok {
		t.Fatal("first reservation refused")
	}
	if _, _, ok := reserveIn(t, b, budget, 400_000); !ok {
		t.Fatal("second reservation refused")
	}
	_, rf, ok := reserveIn(t, a, budget, 400_000)
	if ok {
		t.Fatal("a third $0.40 fitted in $1.00 with $0.80 reserved")
	}
	if rf.Budget != budget || rf.Reserved != 800_000 || !rf.Window.End.After(time.Now()) {
		t.Fatalf("refusal %+v", rf)
	}
	ra.Settle(150_000, time.Now())
	id := b.Window(budget, time.Now()).ID
	waitFor(t, "the settlement on the other replica", func() bool {
		u, ok := b.Store().Get(id, time.Now())
		return ok && u.Spent == 150_000 && u.Reserved == 400_000
	})
	us := b.Usage(time.Now())
	if len(us) != 1 || us[0].ID != id || us[0].Limit != budget.Limit {
		t.Fatalf("usage on b: %+v", us)
	}
	if _, _, ok := reserveIn(t, b, budget, 400_000); !ok {
		t.Fatal("refused although the settlement freed room")
	}
}

// TestSpendStoreAddsLocalSpendBack: with Redis not answering, the ledger decides reservations in
// this process against its share of what Redis last showed left (two replicas, $0.30 of $1.00
// reserved: $0.35 each), lists what it counted, and once Redis is back adds it there, settled
// at real cost, so that the budget counts every dollar spent during the outage.
func TestSpendStoreAddsLocalSpendBack(t *testing.T) {
	rd := redistest.Standalone(t)
	l, st := replica(t, rd.Addr(), "a")
	_, other := replica(t, rd.Addr(), "b")
	waitFor(t, "both replicas to see each other", func() bool { return st.Live() == 2 && other.Live() == 2 })
	budget := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: 1_000_000}
	shared, _, ok := reserveIn(t, l, budget, 300_000)
	if !ok {
		t.Fatal("refused in an empty budget")
	}
	rd.Pause(time.Hour)
	waitFor(t, "the store to find Redis gone", func() bool {
		_, _, _ = reserveIn(t, l, spend.Budget{Name: "probe", Period: spend.Hour, Limit: 1}, 0)
		return st.Gone()
	})
	before := l.FellBack()
	if _, _, ok := reserveIn(t, l, budget, 400_000); ok {
		t.Fatal("$0.40 admitted locally: this replica's share is half of the $0.70 left, $0.35")
	}
	local, _, ok := reserveIn(t, l, budget, 300_000)
	if !ok || l.FellBack() == before {
		t.Fatalf("reservation while Redis is gone: ok %v, fell back %d times", ok, l.FellBack()-before)
	}
	if _, _, ok := reserveIn(t, l, budget, 100_000); ok {
		t.Fatal("$0.40 counted locally against a share of $0.35")
	}
	small, _, ok := reserveIn(t, l, budget, 50_000)
	if !ok {
		t.Fatal("$0.05 refused with $0.05 of the share left")
	}
	now := time.Now()
	if got, ok := l.LocalLimit(budget, now); !ok || got != 350_000 {
		t.Fatalf("local limit %s, %v; want 0.35", got, ok)
	}
	u := ledgerUsage(t, l, budget, now)
	if u.Spent != 0 || u.Reserved != 650_000 || u.Local.Reserved != 350_000 || u.Local.Pending.Reserved != 350_000 {
		t.Fatalf("during the outage: %+v, want $0.30 seen in Redis and $0.35 reserved here, all pending", u)
	}
	local.Settle(250_000, now)
	small.Release(now)
	shared.Settle(100_000, now)
	if got := l.PendingTotal(); got != 250_000 {
		t.Fatalf("pending %s, want the 0.25 settled here", got)
	}
	rd.Resume()
	waitFor(t, "Redis to be back", st.Available)
	id := l.Window(budget, time.Now()).ID
	waitFor(t, "the spend counted here to reach Redis", func() bool {
		u, ok := l.Store().Get(id, time.Now())
		return ok && u.Spent == 350_000 && u.Reserved == 0 && l.PendingTotal() == 0
	})
	if u := ledgerUsage(t, l, budget, time.Now()); u.Spent != 350_000 || u.Reserved != 0 || u.Local.Spent != 250_000 || u.Local.Pending != (spend.Pending{}) {
		t.Fatalf("after Redis is back: %+v", u)
	}
}

func ledgerUsage(t *testing.T, l *spend.Ledger, b spend.Budget, now time.Time) spend.Usage {
	t.Helper()
	id := l.Window(b, now).ID
	for _, u := range l.Usage(now) {
		if u.ID == id {
			return u
		}
	}
	t.Fatalf("no window %v in %+v", id, l.Usage(now))
	return spend.Usage{}
}

// zoneCalendars returns the calendars of UTC and Asia/Kathmandu, skipping the test when either
// day ends within two minutes (a budget would reset during it).
func zoneCalendars(t *testing.T) (utc, ktm spend.Calendar) {
	t.Helper()
	now := time.Now()
	loc, err := time.LoadLocation("Asia/Kathmandu")
	if err != nil {
		t.Fatal(err)
	}
	utc, ktm = spend.NewCalendar(time.UTC), spend.NewCalendar(loc)
	for _, c := range []spend.Calendar{utc, ktm} {
		if c.End(spend.Day, c.Start(spend.Day, now)).Sub(now) < 2*time.Minute {
			t.Skip("too close to the end of a day: the budget would reset during the test")
		}
	}
	return utc, ktm
}

// TestSpendStoreCarriesAcrossZoneChange: two replicas share a $10 day; $8 is spent under UTC.
// They change to Asia/Kathmandu one after the other, each spending $1 meanwhile in the zone it
// uses: once both changed, the Kathmandu window counts all $10 and refuses. Changing back to UTC
// counts $10 there too, not the $19 adding both windows would give, and a replica started under
// Kathmandu later finds the spend carried when it first reaches Redis.
func TestSpendStoreCarriesAcrossZoneChange(t *testing.T) {
	now := time.Now()
	utcCal, ktmCal := zoneCalendars(t)
	if utcCal.Start(spend.Day, now).Equal(ktmCal.Start(spend.Day, now)) {
		t.Fatal("the two zones' days start together")
	}
	rd := redistest.Standalone(t)
	a, _ := replica(t, rd.Addr(), "a")
	b, _ := replica(t, rd.Addr(), "b")
	day := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: 10_000_000}
	spendOn := func(l *spend.Ledger, n int) int {
		t.Helper()
		admitted := 0
		for range n {
			r, _, ok := reserveIn(t, l, day, 1_000_000)
			if ok {
				r.Settle(1_000_000, time.Now())
				admitted++
			}
		}
		return admitted
	}
	// spentIn waits until l's current window counts want (settlements are sent in the
	// background) and fails when it does not.
	spentIn := func(l *spend.Ledger, want spend.Micros) {
		t.Helper()
		waitFor(t, fmt.Sprintf("$%s spent in the current window", want), func() bool {
			u, ok := l.Store().Get(l.Window(day, time.Now()).ID, time.Now())
			return ok && u.Spent+u.Reserved == want
		})
	}
	if spendOn(a, 4)+spendOn(b, 4) != 8 {
		t.Fatal("refused below the budget")
	}
	spentIn(a, 8_000_000)
	kathmandu := spend.Settings{Currency: "USD", Calendar: ktmCal}
	if n, err := a.Configure(kathmandu, time.Now()); err != nil || n != 1 {
		t.Fatalf("a: carried %d windows (%v), want 1", n, err)
	}
	spentIn(a, 8_000_000)
	if spendOn(a, 1) != 1 || spendOn(b, 1) != 1 {
		t.Fatal("refused with $2 left")
	}
	spentIn(a, 9_000_000)
	spentIn(b, 9_000_000)
	if _, err := b.Configure(kathmandu, time.Now()); err != nil {
		t.Fatal(err)
	}
	spentIn(b, 10_000_000)
	spentIn(a, 10_000_000)
	if n := spendOn(a, 2) + spendOn(b, 2); n != 0 {
		t.Fatalf("%d admitted past the $10 spent across both zones", n)
	}
	// A replica started under Kathmandu now: carrying again changes nothing.
	c, _ := replica(t, rd.Addr(), "c")
	_, _ = c.Configure(kathmandu, time.Now())
	if _, err := c.CarryForeign(time.Now()); err != nil {
		t.Fatal(err)
	}
	spentIn(c, 10_000_000)
	// Back to UTC: $10, once.
	utc := spend.Settings{Currency: "USD", Calendar: utcCal}
	for _, l := range []*spend.Ledger{a, b, c} {
		if _, err := l.Configure(utc, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	spentIn(a, 10_000_000)
	if n := spendOn(b, 1); n != 0 {
		t.Fatal("admitted after changing back")
	}
}
