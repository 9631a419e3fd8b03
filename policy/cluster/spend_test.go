package cluster

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// dollars converts to micro-units.
func dollars(d float64) int64 { return int64(d * 1e6) }

func spendWindow(key string, limit int64, end time.Time) SpendWindow {
	return SpendWindow{Key: key, Limit: limit, End: end}
}

func reserveSpend(t *testing.T, s *Store, ws []SpendWindow, amount int64) (uint64, bool) {
	t.Helper()
	_, over, refused := reserveToken(t, s, ws, amount)
	return over, refused
}

func reserveToken(t *testing.T, s *Store, ws []SpendWindow, amount int64) (uint64, uint64, bool) {
	t.Helper()
	token, over, refused, err := s.ReserveSpend(context.Background(), ws, amount, nil)
	if err != nil {
		t.Fatalf("reservation on %s: %v", s.ReplicaID(), err)
	}
	return token, over, refused
}

func spendGet(t *testing.T, s *Store, key string) SpendUsage {
	t.Helper()
	u, ok, err := s.SpendGet(context.Background(), key)
	if err != nil || !ok {
		t.Fatalf("window %s: ok %v, %v", key, ok, err)
	}
	return u
}

// TestSpendSharedAcrossReplicas: two replicas reserve in one budget; the third reservation that
// would pass the limit is refused whichever replica asks, and a settlement below the
// reservation gives the difference back to both.
func TestSpendSharedAcrossReplicas(t *testing.T) {
	rd := redistest.Standalone(t)
	a := open(t, options(rd.Addr(), "sp", "a"))
	b := open(t, options(rd.Addr(), "sp", "b"))
	end := time.Now().Add(time.Hour)
	day := []SpendWindow{spendWindow("tenant/acme|day|1", dollars(1), end)}

	ta, _, refused := reserveToken(t, a, day, dollars(0.40))
	if refused {
		t.Fatal("first reservation refused")
	}
	if _, refused := reserveSpend(t, b, day, dollars(0.40)); refused {
		t.Fatal("second reservation refused")
	}
	over, refused := reserveSpend(t, a, day, dollars(0.40))
	if !refused || over != 1 {
		t.Fatalf("third reservation: over %b refused %v, want refused by window 0", over, refused)
	}
	if u := spendGet(t, b, "tenant/acme|day|1"); u.Reserved != dollars(0.80) || u.Spent != 0 || u.Limit != dollars(1) {
		t.Fatalf("after two reservations: %+v", u)
	}
	// a's request cost $0.10 of the $0.40 reserved.
	a.SettleSpend(ta, []string{"tenant/acme|day|1"}, dollars(0.40), dollars(0.10))
	waitFor(t, "the settlement to reach Redis", func() bool {
		return spendGet(t, b, "tenant/acme|day|1").Spent == dollars(0.10)
	})
	if u := spendGet(t, b, "tenant/acme|day|1"); u.Reserved != dollars(0.40) {
		t.Fatalf("after settlement: %+v", u)
	}
	tb, _, refused := reserveToken(t, b, day, dollars(0.40))
	if refused {
		t.Fatal("reservation refused although the settlement freed room")
	}
	// A release gives the whole reservation back and charges nothing.
	b.SettleSpend(tb, []string{"tenant/acme|day|1"}, dollars(0.40), 0)
	waitFor(t, "the release to reach Redis", func() bool {
		return spendGet(t, a, "tenant/acme|day|1").Reserved == dollars(0.40)
	})
}

// TestSpendAllOrNothing: a reservation in several windows charges none of them when one is
// full; a shadow window without room is reported and charged, refusing nothing.
func TestSpendAllOrNothing(t *testing.T) {
	rd := redistest.Standalone(t)
	s := open(t, options(rd.Addr(), "sp", "a"))
	end := time.Now().Add(time.Hour)
	day := spendWindow("tenant/acme|day|1", dollars(10), end)
	month := spendWindow("feature/chat|month|1", dollars(1), end)
	if _, refused := reserveSpend(t, s, []SpendWindow{month}, dollars(0.9)); refused {
		t.Fatal("refused in an empty window")
	}
	over, refused := reserveSpend(t, s, []SpendWindow{day, month}, dollars(0.2))
	if !refused || over != 2 {
		t.Fatalf("over %b refused %v, want refused by window 1", over, refused)
	}
	if _, ok, _ := s.SpendGet(context.Background(), day.Key); ok {
		t.Fatal("the day window was charged by a refused reservation")
	}
	month.Shadow = true
	over, refused = reserveSpend(t, s, []SpendWindow{day, month}, dollars(0.2))
	if refused || over != 2 {
		t.Fatalf("shadow: over %b refused %v, want reported, not refused", over, refused)
	}
	if u := spendGet(t, s, month.Key); u.Reserved != dollars(1.1) || !u.Shadow {
		t.Fatalf("shadow window: %+v", u)
	}
	// A request larger than a whole budget is refused, even by an untouched window; a window
	// that allows a single overrun lets it run while it holds nothing.
	big := spendWindow("tenant/big|day|1", dollars(1), end)
	if _, refused := reserveSpend(t, s, []SpendWindow{big}, dollars(5)); !refused {
		t.Fatal("a request larger than the whole budget was admitted")
	}
	big.AllowSingleOverrun = true
	if _, refused := reserveSpend(t, s, []SpendWindow{big}, dollars(5)); refused {
		t.Fatal("allowed a single overrun, refused in an untouched window")
	}
	if _, refused := reserveSpend(t, s, []SpendWindow{big}, 1); !refused {
		t.Fatal("admitted past a spent budget")
	}
}

// TestSpendKeysExpireAfterTheirWindow: a window's key expires a grace period after its end, by
// Redis's clock, and ended windows are no longer listed.
func TestSpendKeysExpireAfterTheirWindow(t *testing.T) {
	rd := redistest.Standalone(t)
	s := open(t, options(rd.Addr(), "sp", "a"))
	rc := inspect(t, rd.Addr())
	end := time.Now().Add(time.Hour)
	w := spendWindow("tenant/acme|hour|1", dollars(1), end)
	token, _, _ := reserveToken(t, s, []SpendWindow{w}, dollars(0.1))
	ms, err := rc.PExpireTime(context.Background(), "{sp}:sp:tenant/acme|hour|1").Result()
	if err != nil {
		t.Fatal(err)
	}
	if want := end.Add(spendGrace).UnixMilli(); ms.Milliseconds() != want {
		t.Fatalf("key expires at %d, want %d (window end + grace)", ms.Milliseconds(), want)
	}
	// A window that ended a second ago (and its key still there, within the grace) is not
	// listed, and settlements leave it alone.
	past := spendWindow("tenant/acme|hour|0", dollars(1), time.Now().Add(-time.Second))
	reserveToken(t, s, []SpendWindow{past}, dollars(0.1))
	us, err := s.SpendUsage(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(us) != 1 || us[0].Key != w.Key || us[0].Reserved != dollars(0.1) || !us[0].End.Equal(end.Truncate(time.Millisecond)) {
		t.Fatalf("usage %+v, want only the current window", us)
	}
	// (A reservation in both, as a request in two budgets holds.)
	both, _, _ := reserveToken(t, s, []SpendWindow{past, w}, dollars(0.1))
	s.SettleSpend(token, []string{w.Key}, dollars(0.1), 0)
	s.SettleSpend(both, []string{past.Key, w.Key}, dollars(0.1), dollars(0.05))
	waitFor(t, "the settlement", func() bool { return spendGet(t, s, w.Key).Spent == dollars(0.05) })
	if got, _ := rc.HGet(context.Background(), "{sp}:sp:"+past.Key, "s").Result(); got != "" {
		t.Fatalf("an ended window was charged: spent %q", got)
	}
}

// unflushedStore opens a store on a Redis of its own that sends nothing unless the test
// flushes.
func unflushedStore(t *testing.T) (*redistest.Server, *Store) {
	t.Helper()
	rd := redistest.Standalone(t)
	o := options(rd.Addr(), "sp", "a")
	o.SettleInterval = time.Hour
	return rd, open(t, o)
}

// TestSpendSettlementAppliedOnce: a batch sent again (its answer lost) changes nothing the
// second time.
func TestSpendSettlementAppliedOnce(t *testing.T) {
	_, s := unflushedStore(t)
	w := spendWindow("tenant/acme|day|1", dollars(1), time.Now().Add(time.Hour))
	t1, _, _ := reserveToken(t, s, []SpendWindow{w}, dollars(0.5))
	t2, _, _ := reserveToken(t, s, []SpendWindow{w}, dollars(0.3))
	s.SettleSpend(t1, []string{w.Key}, dollars(0.5), dollars(0.2))
	s.SettleSpend(t2, []string{w.Key}, dollars(0.3), dollars(0.3))
	flushTwice(t, s, func() {})
	if u := spendGet(t, s, w.Key); u.Spent != dollars(0.5) || u.Reserved != 0 {
		t.Fatalf("after a batch sent twice: %+v, want spent 0.5, reserved 0", u)
	}
}

// flushTwice sends s's queued spend settlements and additions, runs between, then sends the same
// batches again (as after a timeout whose script did run) with what was queued since.
func flushTwice(t *testing.T, s *Store, between func()) {
	t.Helper()
	s.pendMu.Lock()
	ops, adds := append([]spendOp(nil), s.spendPending...), append([]spendAdd(nil), s.spend.adds...)
	s.pendMu.Unlock()
	if err := s.flushSpend(); err != nil {
		t.Fatal(err)
	}
	between()
	s.pendMu.Lock()
	s.spendPending = append(ops, s.spendPending...)
	s.spend.adds = append(adds, s.spend.adds...)
	s.pendMu.Unlock()
	if err := s.flushSpend(); err != nil {
		t.Fatal(err)
	}
}

// TestSpendAddAppliedOnce: spend counted in a process's memory is added to Redis without any
// reservation token, creating the window it lands in; a batch sent again (its answer lost)
// changes nothing the second time, and an addition to a window that has ended is dropped.
func TestSpendAddAppliedOnce(t *testing.T) {
	rd, s := unflushedStore(t)
	w := spendWindow("tenant/acme|day|1", dollars(1), time.Now().Add(time.Hour))
	past := spendWindow("tenant/acme|hour|1", dollars(1), time.Now().Add(-time.Second))
	s.AddSpend([]SpendWindow{w, past}, dollars(0.5), 0)
	s.AddSpend([]SpendWindow{w, past}, -dollars(0.5), dollars(0.2))
	s.AddSpend([]SpendWindow{w}, dollars(0.3), 0)
	if p := s.SpendPending()[w.Key]; p != (SpendAdded{Reserved: dollars(0.3), Settled: dollars(0.2)}) {
		t.Fatalf("pending %+v", p)
	}
	if got := s.SpendPendingTotal(); got != dollars(0.5) {
		t.Fatalf("pending total %d, want 0.5 (each addition once)", got)
	}
	flushTwice(t, s, func() {
		if p := s.SpendPending(); len(p) != 0 {
			t.Fatalf("still pending after a flush: %+v", p)
		}
		s.AddSpend([]SpendWindow{w}, 0, dollars(0.1))
	})
	u := spendGet(t, s, w.Key)
	if u.Spent != dollars(0.3) || u.Reserved != dollars(0.3) || u.Limit != dollars(1) || !u.End.Equal(w.End.Truncate(time.Millisecond)) {
		t.Fatalf("after a batch sent twice: %+v, want spent 0.3, reserved 0.3", u)
	}
	us, err := s.SpendUsage(context.Background())
	if err != nil || len(us) != 1 || us[0].Key != w.Key {
		t.Fatalf("listing %+v (%v), want the added window alone", us, err)
	}
	rc := inspect(t, rd.Addr())
	if n, _ := rc.Exists(context.Background(), "{sp}:sp:"+past.Key).Result(); n != 0 {
		t.Fatal("an addition to an ended window created it")
	}
}

// TestSpendUnavailable: with Redis gone a reservation fails (the caller enforces locally) and
// one whose answer was lost is undone once Redis is back; settlements stay queued and are
// applied when Redis is back.
func TestSpendUnavailable(t *testing.T) {
	rd := redistest.Standalone(t)
	o := options(rd.Addr(), "sp", "a")
	o.Timeout = 200 * time.Millisecond
	s := open(t, o)
	w := spendWindow("tenant/acme|day|1", dollars(1), time.Now().Add(time.Hour))
	token, _, _ := reserveToken(t, s, []SpendWindow{w}, dollars(0.5))
	rd.Pause(time.Hour)
	_, _, _, err := s.ReserveSpend(context.Background(), []SpendWindow{w}, dollars(0.1), nil)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("reservation with Redis paused: %v", err)
	}
	waitFor(t, "the store to be unavailable", func() bool { return !s.Available() })
	if _, _, _, err := s.ReserveSpend(context.Background(), []SpendWindow{w}, dollars(0.1), nil); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("reservation while unavailable: %v", err)
	}
	s.SettleSpend(token, []string{w.Key}, dollars(0.5), dollars(0.25))
	rd.Resume()
	waitFor(t, "the store to be available", s.Available)
	waitFor(t, "the queued settlement", func() bool { return spendGet(t, s, w.Key).Spent == dollars(0.25) })
	// The reservation sent while Redis was paused ran when it resumed; its answer was lost,
	// and it was undone.
	waitFor(t, "the lost reservation to be undone", func() bool { return spendGet(t, s, w.Key).Reserved == 0 })
}

// TestSpendWindowKeysAreDistinctPerStart: the next window of a budget is a key of its own,
// starting empty.
func TestSpendWindowKeysAreDistinctPerStart(t *testing.T) {
	rd := redistest.Standalone(t)
	s := open(t, options(rd.Addr(), "sp", "a"))
	end := time.Now().Add(time.Hour)
	for i := range 2 {
		w := spendWindow("tenant/acme|day|"+strconv.Itoa(i), dollars(1), end)
		if _, refused := reserveSpend(t, s, []SpendWindow{w}, dollars(0.9)); refused {
			t.Fatalf("window %d refused", i)
		}
	}
}

// TestSpendRedisCluster: in a Redis Cluster every spend key of a deployment carries its hash
// tag, so a reservation across several budgets is one script on one node.
func TestSpendRedisCluster(t *testing.T) {
	rcs := redistest.Cluster(t, 3)
	clustered := func(id string) Options {
		o := options("", "cl", id)
		o.Addresses, o.Mode = rcs.Addrs(), Cluster
		return o
	}
	a := open(t, clustered("a"))
	b := open(t, clustered("b"))
	end := time.Now().Add(time.Hour)
	ws := []SpendWindow{spendWindow("tenant/acme|day|1", dollars(1), end), spendWindow("feature/chat|month|1", dollars(100), end)}
	token, _, refused := reserveToken(t, a, ws, dollars(0.6))
	if refused {
		t.Fatal("refused in empty budgets")
	}
	if _, refused := reserveSpend(t, b, ws, dollars(0.6)); !refused {
		t.Fatal("the other replica fitted $1.20 into $1.00")
	}
	a.SettleSpend(token, []string{ws[0].Key, ws[1].Key}, dollars(0.6), dollars(0.3))
	waitFor(t, "the settlement", func() bool { return spendGet(t, b, ws[1].Key).Spent == dollars(0.3) })
	if _, refused := reserveSpend(t, b, ws, dollars(0.6)); refused {
		t.Fatal("refused although the settlement freed room")
	}
}

// TestSpendReplicaGoneKeepsReservations: a replica that stops without settling (killed) leaves
// its reservations counted in the window: the most its requests can have cost.
func TestSpendReplicaGoneKeepsReservations(t *testing.T) {
	rd := redistest.Standalone(t)
	a := open(t, options(rd.Addr(), "sp", "a"))
	b := open(t, options(rd.Addr(), "sp", "b"))
	w := spendWindow("tenant/acme|day|1", dollars(1), time.Now().Add(time.Hour))
	reserveSpend(t, a, []SpendWindow{w}, dollars(0.7))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if u := spendGet(t, b, w.Key); u.Reserved != dollars(0.7) {
		t.Fatalf("after the replica left: %+v, want its $0.70 still reserved", u)
	}
	if _, refused := reserveSpend(t, b, []SpendWindow{w}, dollars(0.4)); !refused {
		t.Fatal("the gone replica's reservation no longer counts")
	}
}
