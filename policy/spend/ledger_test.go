package spend_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

var (
	ctx = context.Background()
	// t0 is a Tuesday afternoon in the middle of a month.
	t0 = time.Date(2026, 3, 17, 15, 4, 5, 0, time.UTC)
)

func dollars(s string) spend.Micros {
	m, err := money.ParseAmount(s)
	if err != nil {
		panic(err)
	}
	return m
}

func reserve(l *spend.Ledger, amount spend.Micros, now time.Time, bs ...spend.Budget) (*spend.Reservation, spend.Refusal, bool) {
	r := &spend.Reservation{}
	r.Reset(now)
	for _, b := range bs {
		r.Add(b)
	}
	rf, ok := l.Reserve(ctx, r, amount, now)
	return r, rf, ok
}

func usage(t *testing.T, l *spend.Ledger, name string, p spend.Period, now time.Time) spend.Usage {
	t.Helper()
	w := l.Window(spend.Budget{Name: name, Period: p}, now)
	u, _ := l.Store().Get(w.ID, now)
	return u
}

func TestLedgerReservesAllOrNothing(t *testing.T) {
	l := spend.NewLedger(nil)
	tenant := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: dollars("1.00")}
	tier := spend.Budget{Name: "tier/free", Period: spend.Month, Limit: dollars("0.50")}

	r1, _, ok := reserve(l, dollars("0.40"), t0, tenant, tier)
	if !ok {
		t.Fatal("first reservation refused")
	}
	// 0.40 + 0.40 fits the tenant's 1.00 but not the tier's 0.50: nothing is reserved anywhere.
	_, rf, ok := reserve(l, dollars("0.40"), t0, tenant, tier)
	if ok {
		t.Fatal("reservation over the tier budget admitted")
	}
	if rf.Budget != tier || rf.Spent != 0 || rf.Reserved != dollars("0.40") {
		t.Fatalf("refusal = %+v, want the tier budget with 0.40 reserved", rf)
	}
	if want := time.Date(2026, 4, 1, 0, 0, 0, 0, time.UTC); !rf.Window.End.Equal(want) {
		t.Fatalf("refusal resets at %s, want %s", rf.Window.End, want)
	}
	if u := usage(t, l, "tenant/acme", spend.Day, t0); u.Reserved != dollars("0.40") {
		t.Fatalf("tenant reserved %s after a refusal, want 0.4 (all or nothing)", u.Reserved)
	}

	// Settlement replaces the reservation with the real cost.
	r1.Settle(dollars("0.123456"), t0)
	r1.Settle(dollars("0.9"), t0) // exactly once
	r1.Release(t0)
	for _, b := range []spend.Budget{tenant, tier} {
		u := usage(t, l, b.Name, b.Period, t0)
		if u.Spent != dollars("0.123456") || u.Reserved != 0 {
			t.Fatalf("%s after settle: %+v, want spent 0.123456 and nothing reserved", b.Name, u)
		}
		if u.Remaining() != b.Limit-dollars("0.123456") {
			t.Fatalf("%s remaining %s", b.Name, u.Remaining())
		}
	}
}

func TestLedgerReleaseAndOversizedRequests(t *testing.T) {
	l := spend.NewLedger(nil)
	b := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: dollars("1")}
	// A request costing more than the whole budget is refused, even by an untouched window.
	if _, rf, ok := reserve(l, dollars("3"), t0, b); ok || rf.Budget != b {
		t.Fatalf("an oversized request: %+v, %v; want refused by %s", rf, ok, b.Name)
	}
	// Unless the policy allows a single overrun: then it runs in an untouched window only.
	_, _ = l.Configure(spend.Settings{Currency: "USD", AllowSingleOverrun: true}, t0)
	big, _, ok := reserve(l, dollars("3"), t0, b)
	if !ok {
		t.Fatal("allowed a single overrun, an oversized request was refused by an untouched window")
	}
	if _, _, ok := reserve(l, 1, t0, b); ok {
		t.Fatal("admitted with the window over its limit")
	}
	big.Release(t0)
	big.Release(t0)
	big.Settle(dollars("3"), t0) // released already: no effect
	if u := usage(t, l, b.Name, b.Period, t0); u.Spent != 0 || u.Reserved != 0 {
		t.Fatalf("after release: %+v, want nothing", u)
	}
	// Up to the limit exactly, then nothing more.
	r, _, ok := reserve(l, dollars("1"), t0, b)
	if !ok {
		t.Fatal("a request of exactly the limit was refused")
	}
	r.Settle(dollars("1"), t0)
	if _, _, ok := reserve(l, 1, t0, b); ok {
		t.Fatal("admitted one micro-unit over the limit")
	}
}

func TestLedgerWindowsReset(t *testing.T) {
	l := spend.NewLedger(nil)
	berlin, err := time.LoadLocation("Europe/Berlin")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = l.Configure(spend.Settings{Currency: "EUR", Calendar: spend.NewCalendar(berlin)}, t0)
	month := spend.Budget{Name: "tenant/acme", Period: spend.Month, Limit: dollars("10")}
	day := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: dollars("5")}
	// 31 March 23:30 in Berlin is 21:30 UTC.
	late := time.Date(2026, 3, 31, 21, 30, 0, 0, time.UTC)
	r, _, ok := reserve(l, dollars("5"), late, month, day)
	if !ok {
		t.Fatal("refused")
	}
	r.Settle(dollars("5"), late)
	_, rf, ok := reserve(l, dollars("0.01"), late, month, day)
	if ok || rf.Budget != day {
		t.Fatalf("refusal = %+v, %v; want the day budget", rf, ok)
	}
	if want := time.Date(2026, 3, 31, 22, 0, 0, 0, time.UTC); !rf.Window.End.Equal(want) {
		t.Fatalf("day resets at %s, want midnight in Berlin (%s)", rf.Window.End, want)
	}
	// Half an hour later it is April in Berlin: both windows are new.
	april := late.Add(30 * time.Minute)
	if _, _, ok := reserve(l, dollars("5"), april, month, day); !ok {
		t.Fatal("refused in a new month")
	}
	if got := len(l.Usage(april)); got != 2 {
		t.Fatalf("%d windows listed in April, want the 2 current ones (March's have ended)", got)
	}
	// A settlement arriving after its window ended changes no current window.
	r2, _, _ := reserve(l, dollars("1"), late.Add(29*time.Minute), spend.Budget{Name: "x", Period: spend.Day, Limit: dollars("2")})
	r2.Settle(dollars("2"), april)
	if u := usage(t, l, "x", spend.Day, april); u.Spent != 0 {
		t.Fatalf("a late settlement landed in the new window: %+v", u)
	}
}

func TestLedgerShadowBudgets(t *testing.T) {
	l := spend.NewLedger(nil)
	enforced := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: dollars("10")}
	shadow := spend.Budget{Name: "tier/free", Period: spend.Day, Limit: dollars("1"), Shadow: true}
	r, _, _ := reserve(l, dollars("1"), t0, enforced, shadow)
	r.Settle(dollars("1"), t0)
	r, _, ok := reserve(l, dollars("1"), t0, enforced, shadow)
	if !ok {
		t.Fatal("a shadow budget refused")
	}
	if r.Over() != 1<<1 {
		t.Fatalf("Over() = %b, want the shadow budget's bit", r.Over())
	}
	if u := usage(t, l, shadow.Name, spend.Day, t0); u.Reserved != dollars("1") {
		t.Fatalf("shadow budget reserved %s, want the request counted", u.Reserved)
	}
}

type failingStore struct{ spend.Store }

func (failingStore) Reserve(context.Context, []spend.Window, spend.Micros, time.Time) (uint64, error) {
	return 0, errors.New("unreachable")
}

func TestLedgerFallsBackWhileTheStoreIsUnreachable(t *testing.T) {
	l := spend.NewLedger(failingStore{spend.NewMemoryStore()})
	b := spend.Budget{Name: "tenant/acme", Period: spend.Hour, Limit: dollars("1")}
	r, _, ok := reserve(l, dollars("1"), t0, b)
	if !ok {
		t.Fatal("refused")
	}
	if _, _, ok := reserve(l, 1, t0, b); ok {
		t.Fatal("the fallback did not enforce the budget")
	}
	r.Settle(dollars("0.5"), t0)
	if l.FellBack() != 2 {
		t.Fatalf("FellBack = %d, want 2", l.FellBack())
	}
	var found bool
	for _, u := range l.Usage(t0) {
		if u.ID.Budget == b.Name {
			found = u.Spent == dollars("0.5")
		}
	}
	if !found {
		t.Fatalf("the settlement did not reach the fallback store: %+v", l.Usage(t0))
	}
}

func TestSaveAndRestoreNeverDoubleCount(t *testing.T) {
	l := spend.NewLedger(nil)
	_, _ = l.Configure(spend.Settings{Currency: "USD"}, t0)
	day := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: dollars("1")}
	hour := spend.Budget{Name: "tenant/acme", Period: spend.Hour, Limit: dollars("1")}
	r, _, _ := reserve(l, dollars("0.30"), t0, day, hour)
	r.Settle(dollars("0.25"), t0)
	inFlight, _, _ := reserve(l, dollars("0.10"), t0, day)
	_ = inFlight
	st := l.SaveState(t0)
	if st.Currency != "USD" || len(st.Windows) != 2 {
		t.Fatalf("state = %+v", st)
	}

	// A new process restores it: settled and in-flight spend count as spent.
	l2 := spend.NewLedger(nil)
	_, _ = l2.Configure(spend.Settings{Currency: "USD"}, t0)
	n, err := l2.RestoreState(st, t0)
	if err != nil || n != 2 {
		t.Fatalf("RestoreState = %d, %v", n, err)
	}
	if u := usage(t, l2, day.Name, spend.Day, t0); u.Spent != dollars("0.35") {
		t.Fatalf("restored day spend %s, want 0.35", u.Spent)
	}
	// Spend in the new process adds to it; restoring the same state again adds nothing.
	r2, _, _ := reserve(l2, dollars("0.05"), t0, day)
	r2.Settle(dollars("0.05"), t0)
	if _, err := l2.RestoreState(st, t0); err != nil {
		t.Fatal(err)
	}
	if u := usage(t, l2, day.Name, spend.Day, t0); u.Spent != dollars("0.40") {
		t.Fatalf("day spend after a second restore %s, want 0.40", u.Spent)
	}
	// What the new process saves holds both, once.
	st2 := l2.SaveState(t0)
	for _, w := range st2.Windows {
		if w.Period == "day" && w.Settled != int64(dollars("0.40")) {
			t.Fatalf("saved day window %+v, want 0.40 settled", w)
		}
	}
	// Next day the day window has ended and is not restored; the hour one neither.
	l3 := spend.NewLedger(nil)
	if n, err := l3.RestoreState(st2, t0.Add(24*time.Hour)); err != nil || n != 0 {
		t.Fatalf("restoring ended windows: %d, %v", n, err)
	}
	// Another currency is refused whole.
	l4 := spend.NewLedger(nil)
	_, _ = l4.Configure(spend.Settings{Currency: "EUR"}, t0)
	if _, err := l4.RestoreState(st, t0); !errors.Is(err, spend.ErrOtherCurrency) {
		t.Fatalf("restoring USD into EUR: %v", err)
	}
	if got := l4.Usage(t0); len(got) != 0 {
		t.Fatalf("a refused state left %d windows", len(got))
	}
	// A window that makes no sense refuses the whole state.
	bad := st
	bad.Windows = append([]spend.SavedWindow{{Budget: "b", Period: "week", Start: t0, End: t0.Add(time.Hour)}}, st.Windows...)
	if _, err := l2.RestoreState(bad, t0); err == nil || errors.Is(err, spend.ErrOtherCurrency) {
		t.Fatalf("restoring a bad window: %v", err)
	}
}

func TestReservationAllocatesNothingOnTheWay(t *testing.T) {
	l := spend.NewLedger(nil)
	b := spend.Budget{Name: "tenant/acme", Period: spend.Month, Limit: money.MaxAmount}
	r := &spend.Reservation{}
	reserveOnce := func() {
		r.Reset(t0)
		r.Add(b)
		if _, ok := l.Reserve(ctx, r, 1, t0); !ok {
			t.Fatal("refused")
		}
		r.Settle(1, t0)
	}
	reserveOnce() // creates the window
	if n := testing.AllocsPerRun(100, reserveOnce); n != 0 {
		t.Fatalf("reserve and settle allocated %v times", n)
	}
}

// Under concurrent reservations a budget admits exactly what fits, all or nothing across the
// windows of each request, and every settlement lands once.
func TestLedgerConcurrentReservations(t *testing.T) {
	l := spend.NewLedger(nil)
	tenant := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: dollars("1.00")}
	month := spend.Budget{Name: "tier/free", Period: spend.Month, Limit: dollars("100")}
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 50 {
				r, _, ok := reserve(l, dollars("0.01"), t0, tenant, month)
				if ok {
					admitted.Add(1)
					r.Settle(dollars("0.01"), t0)
					r.Settle(dollars("0.01"), t0)
				}
			}
		})
	}
	wg.Wait()
	if n := admitted.Load(); n != 100 {
		t.Fatalf("%d admitted, want exactly the 100 that fit", n)
	}
	for _, b := range []spend.Budget{tenant, month} {
		if u := usage(t, l, b.Name, b.Period, t0); u.Spent != dollars("1.00") || u.Reserved != 0 {
			t.Fatalf("%s: %+v", b.Name, u)
		}
	}
}

// TestLedgerCarriesSpendAcrossZoneChange: $8 spent of a $10 UTC day (and of a $100 month), the
// zone changes to Asia/Kathmandu (+05:45: other day and month windows). The new zone's current
// windows start with the $8, so only $2 more fit; changing back gives the UTC windows the $10
// spent in all, not $18; a state file written under UTC and restored by a process that uses
// Kathmandu carries its spend too.
func TestLedgerCarriesSpendAcrossZoneChange(t *testing.T) {
	ktm, err := time.LoadLocation("Asia/Kathmandu")
	if err != nil {
		t.Fatal(err)
	}
	utc := spend.Settings{Currency: "USD", Calendar: spend.NewCalendar(time.UTC)}
	kathmandu := spend.Settings{Currency: "USD", Calendar: spend.NewCalendar(ktm)}
	day := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: dollars("10")}
	month := spend.Budget{Name: "tenant/acme", Period: spend.Month, Limit: dollars("100")}
	spendAll := func(l *spend.Ledger, n int) int {
		admitted := 0
		for range n {
			r, _, ok := reserve(l, dollars("1"), t0, day, month)
			if ok {
				r.Settle(dollars("1"), t0)
				admitted++
			}
		}
		return admitted
	}
	l := spend.NewLedger(nil)
	_, _ = l.Configure(utc, t0)
	if n := spendAll(l, 8); n != 8 {
		t.Fatalf("%d of 8 admitted", n)
	}
	utcState := l.SaveState(t0)

	carried, err := l.Configure(kathmandu, t0)
	if err != nil || carried != 2 {
		t.Fatalf("Configure to Kathmandu carried %d windows (%v), want the day's and the month's", carried, err)
	}
	for _, b := range []spend.Budget{day, month} {
		if u := usage(t, l, b.Name, b.Period, t0); u.Spent != dollars("8") || u.ID.Start == utcStart(b.Period) {
			t.Fatalf("%s after the zone change: %+v, want the $8 in the Kathmandu window", b.Period, u)
		}
	}
	if n := spendAll(l, 10); n != 2 {
		t.Fatalf("%d of 10 admitted after the zone change, want the $2 left of $10", n)
	}
	// Changing back: the UTC window counts the $10, once.
	if _, err := l.Configure(utc, t0); err != nil {
		t.Fatal(err)
	}
	if u := usage(t, l, day.Name, spend.Day, t0); u.Spent != dollars("10") {
		t.Fatalf("UTC day after changing back: spent %s, want 10", u.Spent)
	}
	if n := spendAll(l, 3); n != 0 {
		t.Fatalf("%d admitted after changing back", n)
	}
	// Configuring the same zone again carries nothing more.
	if n, err := l.Configure(utc, t0); n != 0 || err != nil {
		t.Fatalf("a second Configure carried %d (%v)", n, err)
	}

	// A restart under the new zone with the file written under the old one.
	l2 := spend.NewLedger(nil)
	_, _ = l2.Configure(kathmandu, t0)
	if _, err := l2.RestoreState(utcState, t0); err != nil {
		t.Fatal(err)
	}
	if u := usage(t, l2, day.Name, spend.Day, t0); u.Spent != dollars("8") {
		t.Fatalf("restored under Kathmandu: day spent %s, want the $8 of the UTC file", u.Spent)
	}
	// Saved again and restored again, still $8.
	l3 := spend.NewLedger(nil)
	_, _ = l3.Configure(kathmandu, t0)
	if _, err := l3.RestoreState(l2.SaveState(t0), t0); err != nil {
		t.Fatal(err)
	}
	if u := usage(t, l3, day.Name, spend.Day, t0); u.Spent != dollars("8") {
		t.Fatalf("restored twice: day spent %s, want 8", u.Spent)
	}
}

// utcStart is the start of t0's UTC window of period p.
func utcStart(p spend.Period) int64 { return spend.NewCalendar(time.UTC).Start(p, t0).Unix() }
