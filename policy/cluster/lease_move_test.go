package cluster

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// A chunk outlives the slot it was charged in. A request taking from it in a later slot moves
// what the chunk still holds to that slot (what was used before stays where it was charged),
// once per slot, and the next report carries the moves.
func TestChunkTakenInALaterSlotMovesWhatItHolds(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	a := allowance{slotLen: time.Second, chunks: []chunk{{slot: 50, left: 100, until: t0.Add(3 * time.Second), slotEnd: t0.Add(400 * time.Millisecond)}}}
	if slot := a.consume(30, t0); slot != 50 || len(a.moves) != 0 {
		t.Fatalf("taken within its slot: charged to %d with moves %v; want slot 50, no move", slot, a.moves)
	}
	// 1.5 s after the slot ended: two slots later. The 70 left move there, then 20 is taken.
	if slot := a.consume(20, t0.Add(1900*time.Millisecond)); slot != 52 {
		t.Fatalf("taken two slots later: charged to slot %d; want 52", slot)
	}
	if want := []move{{from: 50, to: 52, n: 70}}; !slices.Equal(a.moves, want) {
		t.Fatalf("moves %v; want %v", a.moves, want)
	}
	// Within slot 52 again: nothing more moves.
	a.consume(10, t0.Add(2300*time.Millisecond))
	if len(a.moves) != 1 || a.chunks[0].left != 40 || a.chunks[0].slot != 52 {
		t.Fatalf("after a take in the same slot: moves %v, chunk %+v; want one move, 40 left in slot 52", a.moves, a.chunks[0])
	}
	// Expired, what is left goes back to the slot it was last moved to.
	a.expire(t0.Add(3 * time.Second))
	if want := []chunk{{slot: 52, left: 40}}; !slices.Equal(a.returns, want) {
		t.Fatalf("returns %v; want %v", a.returns, want)
	}
}

// Redis applies a move once (a report sent again after a lost answer carries it again), never
// moves more than the slot holds, never to a slot ahead of the window's clock, and leaves the
// window's sum as it was.
func TestLeaseReportMovesChunkRemainders(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "move", 1, time.Minute)
	lim := LeaseLimits{Windows: []Window{{Name: "tenant/acme", Kind: "tpm", Length: time.Minute, Capacity: 1000}}}
	ls := f.leasers[0].Lease("tenant/acme", lim, nil)
	ls.NeedWindow(0, 400)
	f.leasers[0].Round()
	ls.UnneedWindow(0, 400)
	rc := inspect(t, srv.Addr())
	key := "{move|tenant/acme}:w:tpm:60000"
	window := func() map[string]int64 {
		h, err := rc.HGetAll(context.Background(), key).Result()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]int64{}
		for k, v := range h {
			n, _ := strconv.ParseInt(v, 10, 64)
			out[k] = n
		}
		return out
	}
	ls.mu.Lock()
	from := ls.wins[0].chunks[0].slot
	ls.mu.Unlock()
	before := window()
	if before[strconv.FormatInt(from, 10)] != 400 || before["-1"] != 400 {
		t.Fatalf("the window after a grant of 400 in slot %d: %v", from, before)
	}
	// The chunk's 400 are moved one slot on (the slot that follows is within the window's
	// clock once Redis's time has passed it; a move ahead of the clock goes to the clock's
	// slot), and 1000 more than the slot holds are asked to move from it too.
	time.Sleep(time.Until(time.UnixMilli((from + 1) * 1000)))
	ls.mu.Lock()
	ls.wins[0].moves = []move{{from: from, to: from + 1, n: 400}, {from: from + 1, to: from + 5, n: 1000}}
	r := ls.build(time.Now(), false)
	ls.mu.Unlock()
	for range 2 {
		if _, err := leaseReply(f.leasers[0].script.Run(context.Background(), f.stores[0].client, r.keys, r.args...)); err != nil {
			t.Fatal(err)
		}
	}
	after := window()
	cur := after["L"]
	if after["-1"] != 400 {
		t.Fatalf("the window's sum went from 400 to %d on moves", after["-1"])
	}
	if after[strconv.FormatInt(from, 10)] != 0 || after[strconv.FormatInt(cur, 10)] != 400 || cur < from+1 || cur > from+2 {
		t.Fatalf("after moving 400 from slot %d (clock now at %d) then on to a slot ahead of the clock, in a report sent twice: %v; want all 400 in slot %d", from, cur, after, cur)
	}
}

// A chunk used over many of the window's slots keeps the window exact: replica 0 is granted
// 100 of a window of 200 per 2 s and uses them one by one over 450 ms (14 of the window's
// slots). When the chunk's first slot ages out, only what was used in it is free: replica 1,
// asking for 200 then, is granted what the window really has, so that in no stretch of the
// window's length (less a slot: its resolution) are more than 200 admitted. Without the moves,
// the whole chunk would age out with its first slot, and replica 1 would be granted nearly
// all of 200 again.
func TestChunkUsedAcrossSlotsAgesOutAsUsed(t *testing.T) {
	srv := redistest.Standalone(t)
	const length, capacity = 2 * time.Second, 200
	lim := LeaseLimits{Windows: []Window{{Name: "tenant/acme", Kind: "rpm", Length: length, Capacity: capacity}}}
	var leasers []*Leaser
	var leases []*Lease
	for i := range 2 {
		o := options(srv.Addr(), "slots", "r"+strconv.Itoa(i))
		o.LeaseTTL, o.Timeout = time.Minute, time.Second
		l := newLeaser(open(t, o), LeaseOptions{Interval: fleetInterval}, true)
		t.Cleanup(func() { l.Close(context.Background()) })
		if err := l.refreshEpoch(context.Background()); err != nil {
			t.Fatal(err)
		}
		leasers, leases = append(leasers, l), append(leases, l.Lease("tenant/acme", lim, nil))
	}
	var admitted []time.Time
	// Replica 0: a chunk of 100, used one at a time every 4.5 ms.
	leases[0].NeedWindow(0, 100)
	leasers[0].Round()
	leases[0].UnneedWindow(0, 100)
	start := time.Now()
	for k := range 100 {
		time.Sleep(time.Until(start.Add(time.Duration(k) * 4500 * time.Microsecond)))
		if _, ok := leases[0].Reserve(0, 1, time.Now()); !ok {
			// A machine too slow to use the chunk within its validity: what was used still
			// counts.
			t.Logf("request %d found the chunk of 100 gone", k+1)
			break
		}
		admitted = append(admitted, time.Now())
	}
	// Both replicas' loops run a round every interval.
	for time.Now().Before(start.Add(length + 2*windowSlot(&lim.Windows[0]))) {
		leasers[0].Round()
		leasers[1].Round()
		time.Sleep(fleetInterval)
	}
	// Replica 1, once the chunk's first slot has aged out: as much as it can get of 200.
	for range 3 {
		if _, ok := leases[1].Reserve(0, 1, time.Now()); ok {
			admitted = append(admitted, time.Now())
			continue
		}
		leases[1].NeedWindow(0, 200)
		leasers[1].Round()
		leases[1].UnneedWindow(0, 200)
		for {
			if _, ok := leases[1].Reserve(0, 1, time.Now()); !ok {
				break
			}
			admitted = append(admitted, time.Now())
		}
	}
	span := length - windowSlot(&lim.Windows[0])
	most, j := 0, 0
	for i := range admitted {
		for admitted[i].Sub(admitted[j]) >= span {
			j++
		}
		most = max(most, i-j+1)
	}
	if most > capacity {
		t.Fatalf("%d requests admitted within %v by a window of %d per %v", most, span, capacity, length)
	}
}

// A replica whose leases are reported learns the epoch from their answers (outside Redis
// Cluster the lease script keeps the epoch too) and refreshes it on its own only when no report
// brought it for a renewal: an idle replica refreshes it every renewal.
func TestReportsBringTheEpochBack(t *testing.T) {
	srv := redistest.Standalone(t)
	o := options(srv.Addr(), "epoch", "r0")
	o.LeaseTTL = time.Minute
	l := NewLeaser(open(t, o), LeaseOptions{Interval: 20 * time.Millisecond})
	t.Cleanup(func() { l.Close(context.Background()) })
	waitFor(t, "the first refresh", func() bool { return l.refreshes.Load() > 0 })
	// Idle: a refresh every renewal.
	start, before := time.Now(), l.refreshes.Load()
	waitFor(t, "refreshes while idle", func() bool { return l.refreshes.Load() >= before+3 })
	if idle := time.Since(start); idle < 2*l.renew {
		t.Fatalf("3 refreshes in %v with a renewal of %v", idle, l.renew)
	}
	// In use, its lease reported every interval (a request waits for it): no refresh.
	ls := l.Lease("feature/chat", LeaseLimits{MaxConcurrent: 10}, nil)
	stop := time.Now().Add(4 * l.renew)
	waitFor(t, "a report answered", func() bool { ls.Urgent(); return ls.Valid(time.Now()) })
	before = l.refreshes.Load()
	for time.Now().Before(stop) {
		ls.Urgent()
		time.Sleep(l.o.Interval)
	}
	if n := l.refreshes.Load() - before; n > 1 {
		t.Fatalf("%d refreshes of the epoch over %v of reports every interval (renewal %v)", n, 4*l.renew, l.renew)
	}
}

// TestReturnAheadOfRedisClockIsRefunded: a replica tells a slot's end from the answer that
// granted its chunk, a round trip early, so a request just before the slot's end in Redis may
// take from the chunk in what the replica counts as the next slot: it moves the chunk there,
// and gives back what it did not use to that slot. Redis, still in the chunk's slot, moves
// nothing; the return must still come back, from the slot the chunk is in.
func TestReturnAheadOfRedisClockIsRefunded(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "ahead", 1, time.Minute)
	lim := LeaseLimits{Windows: []Window{{Name: "tenant/acme", Kind: "tpm", Length: time.Minute, Capacity: 1000}}}
	ls := f.leasers[0].Lease("tenant/acme", lim, nil)
	// At the start of a slot, so that Redis's clock stays in it throughout.
	time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second + 20*time.Millisecond)))
	ls.NeedWindow(0, 400)
	f.leasers[0].Round()
	ls.UnneedWindow(0, 400)
	ls.mu.Lock()
	from := ls.wins[0].chunks[0].slot
	ls.wins[0].chunks = nil
	ls.wins[0].moves = []move{{from: from, to: from + 1, n: 400}}
	ls.wins[0].returns = []chunk{{slot: from + 1, left: 300}}
	r := ls.build(time.Now(), false)
	ls.mu.Unlock()
	if _, err := leaseReply(f.leasers[0].script.Run(context.Background(), f.stores[0].client, r.keys, r.args...)); err != nil {
		t.Fatal(err)
	}
	rc := inspect(t, srv.Addr())
	h, err := rc.HGetAll(context.Background(), "{ahead|tenant/acme}:w:tpm:60000").Result()
	if err != nil {
		t.Fatal(err)
	}
	if h["L"] != strconv.FormatInt(from, 10) {
		t.Skipf("Redis's clock left slot %d before the report (%v): the case needs it not to", from, h)
	}
	if h["-1"] != "100" || h[strconv.FormatInt(from, 10)] != "100" {
		t.Errorf("after 300 of a 400 chunk in slot %d came back to the slot after it: %v; want 100 left in slot %d", from, h, from)
	}
}
