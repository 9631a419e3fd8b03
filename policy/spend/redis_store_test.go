package spend

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
)

// replica opens a cluster store on addr and returns a ledger keeping its sums there.
func replica(t *testing.T, addr, id string) (*Ledger, *cluster.Store) {
	t.Helper()
	st, err := cluster.Open(cluster.Options{
		Addresses: []string{addr}, Mode: cluster.Standalone, KeyPrefix: "spend", ReplicaID: id,
		Timeout: 300 * time.Millisecond, DialTimeout: 2 * time.Second, WriteTimeout: 2 * time.Second,
		LeaseTTL: time.Minute, Heartbeat: 100 * time.Millisecond, SettleInterval: time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = st.Close(ctx)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !st.WaitAvailable(ctx) {
		t.Fatalf("replica %s never reached Redis", id)
	}
	l := NewLedger(NewRedisStore(st))
	l.Configure(Settings{Currency: "USD", Calendar: NewCalendar(time.UTC)})
	return l, st
}

func reserveIn(t *testing.T, l *Ledger, b Budget, amount Micros) (*Reservation, Refusal, bool) {
	t.Helper()
	r := &Reservation{}
	r.Reset(time.Now())
	r.Add(b)
	rf, ok := l.Reserve(context.Background(), r, amount, time.Now())
	return r, rf, ok
}

// eventually polls cond for up to 10 s: settlements reach Redis in the background.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRedisStoreSharesBudgetsAcrossReplicas: a daily budget of $1.00 is one budget across two
// replicas, settled to real cost, and both see the same window.
func TestRedisStoreSharesBudgetsAcrossReplicas(t *testing.T) {
	rd := redistest.Standalone(t)
	a, _ := replica(t, rd.Addr(), "a")
	b, _ := replica(t, rd.Addr(), "b")
	budget := Budget{Name: "tenant/acme", Period: Day, Limit: 1_000_000}

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
	eventually(t, "the settlement on the other replica", func() bool {
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

// TestRedisStoreFallsBackWhileRedisIsGone: with Redis not answering, the ledger enforces the budget
// in this process; what it reserved there is settled there, and Redis's window is untouched.
func TestRedisStoreFallsBackWhileRedisIsGone(t *testing.T) {
	rd := redistest.Standalone(t)
	l, st := replica(t, rd.Addr(), "a")
	budget := Budget{Name: "tenant/acme", Period: Day, Limit: 1_000_000}
	shared, _, ok := reserveIn(t, l, budget, 300_000)
	if !ok {
		t.Fatal("refused in an empty budget")
	}
	rd.Pause(time.Hour)
	eventually(t, "the store to notice Redis is gone", func() bool {
		_, _, _ = reserveIn(t, l, Budget{Name: "probe", Period: Hour, Limit: 1}, 0)
		return !st.Available()
	})
	before := l.FellBack()
	local, _, ok := reserveIn(t, l, budget, 600_000)
	if !ok || l.FellBack() == before {
		t.Fatalf("reservation while Redis is gone: ok %v, fell back %d times", ok, l.FellBack()-before)
	}
	if _, _, ok := reserveIn(t, l, budget, 600_000); ok {
		t.Fatal("the local fallback let $1.20 into a $1.00 budget")
	}
	local.Settle(500_000, time.Now())
	shared.Settle(100_000, time.Now())
	rd.Resume()
	eventually(t, "Redis to be back", st.Available)
	id := l.Window(budget, time.Now()).ID
	eventually(t, "the queued settlement", func() bool {
		u, ok := l.Store().Get(id, time.Now())
		return ok && u.Spent == 100_000 && u.Reserved == 0
	})
}
