package cluster

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// demand is a compartment's load on one replica, as the engine would count it: requests in
// flight (at most the lease's target) and requests waiting for more.
type demand struct {
	mu       sync.Mutex
	want     int64 // requests that would run now if the lease let them
	inFlight int64
	state    LeaseState
}

func (d *demand) LeaseUsage(freeze bool) LeaseUsage {
	d.mu.Lock()
	defer d.mu.Unlock()
	if freeze {
		d.state.Slots = min(d.state.Slots, d.inFlight)
	}
	return LeaseUsage{InFlight: d.inFlight, Waiting: max(d.want-d.inFlight, 0)}
}

// LeaseChanged applies a new lease the way the scheduler does: requests run up to the lease's
// slots, and requests above a shrunk lease keep running until they end (settle drains them).
func (d *demand) LeaseChanged(st LeaseState) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.state = st
	d.inFlight = max(d.inFlight, min(d.want, st.Slots))
}

// settle lets requests above the lease (or above the demand) end.
func (d *demand) settle() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.inFlight = min(d.inFlight, d.want, max(d.state.Slots, 0))
	d.inFlight = max(d.inFlight, min(d.want, d.state.Slots))
}

func (d *demand) set(want int64) {
	d.mu.Lock()
	d.want = want
	d.mu.Unlock()
}

func (d *demand) running() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.inFlight
}

// fleet is n replicas, each with a manual Leaser (the test runs the rounds) on one Redis, with
// one clock the test moves.
type fleet struct {
	stores  []*Store
	leasers []*Leaser
	clock   *testClock
}

// testClock is a clock a test moves.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// fleetInterval is the lease interval of a test fleet.
const fleetInterval = 50 * time.Millisecond

// round runs one round on every replica, in order, one interval later.
func (f *fleet) round() {
	f.clock.add(fleetInterval)
	for _, l := range f.leasers {
		l.Round()
	}
}

func newFleet(t *testing.T, addr, prefix string, n int, ttl time.Duration) *fleet {
	t.Helper()
	f := &fleet{clock: &testClock{now: time.Now()}}
	for i := 0; i < n; i++ {
		o := options(addr, prefix, "r"+strconv.Itoa(i))
		// A report's timeout is part of a recovery's length (a new deployment's compartments
		// recover first), but one short enough to keep that brief fails reports on a loaded
		// machine under the race detector, and a test's round would then change nothing.
		o.LeaseTTL, o.Timeout = ttl, time.Second
		s := open(t, o)
		l := newLeaser(s, LeaseOptions{Interval: fleetInterval, Now: f.clock.Now}, true)
		t.Cleanup(func() { l.Close(context.Background()) })
		// A replica learns the epoch as it starts (its loop does, which manual leasers lack).
		if err := l.refreshEpoch(context.Background()); err != nil {
			t.Fatal(err)
		}
		f.stores, f.leasers = append(f.stores, s), append(f.leasers, l)
	}
	return f
}

// pastRecovery runs rounds until replica 0's lease of name no longer recovers (a new
// deployment's compartments start so).
func (f *fleet) pastRecovery(t *testing.T, ls *Lease) {
	t.Helper()
	waitFor(t, "the first recovery to end", func() bool {
		ls.Urgent()
		f.round()
		ls.mu.Lock()
		defer ls.mu.Unlock()
		return !ls.sent.IsZero() && !ls.recovers
	})
}

// leaseHash returns the slots leased per replica, as Redis has them.
func leaseHash(t *testing.T, addr, prefix, name string) map[string]int64 {
	t.Helper()
	rc := inspect(t, addr)
	h, err := rc.HGetAll(context.Background(), "{"+prefix+"|"+name+"}:ls").Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for k, v := range h {
		if len(k) > 2 && k[:2] == "r:" {
			slots, _, _ := strings.Cut(v, "|")
			n, _ := strconv.ParseInt(slots, 10, 64)
			out[k[2:]] = n
		}
	}
	return out
}

func TestLeasesNeverAddUpAboveTheLimit(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "sum", 3, time.Second)
	lim := LeaseLimits{MaxConcurrent: 10}
	ds := make([]*demand, 3)
	leases := make([]*Lease, 3)
	for i := range ds {
		ds[i] = &demand{}
		leases[i] = f.leasers[i].Lease("feature/chat", lim, ds[i])
	}
	f.pastRecovery(t, leases[0])
	rng := rand.New(rand.NewPCG(1, 2))
	check := func(round int) {
		t.Helper()
		var sum, running int64
		for _, v := range leaseHash(t, srv.Addr(), "sum", "feature/chat") {
			sum += v
		}
		for i, d := range ds {
			running += d.running()
			if st := leases[i].State(time.Now()); st.Slots > leases[i].grant {
				t.Fatalf("round %d: replica %d enforces %d slots, more than its grant %d", round, i, st.Slots, leases[i].grant)
			}
		}
		if sum > 10 || running > 10 {
			t.Fatalf("round %d: leases add up to %d and %d requests run, limit 10", round, sum, running)
		}
	}
	for round := 0; round < 60; round++ {
		// Demand moves at random; replicas report in a random order.
		for _, d := range ds {
			d.set(rng.Int64N(12))
			d.settle()
		}
		for _, i := range rng.Perm(3) {
			f.leasers[i].Round()
			check(round)
		}
	}
	// Under full demand everywhere, the limit is shared out fairly and wholly.
	for _, d := range ds {
		d.set(20)
	}
	for round := 0; round < 6; round++ {
		for i := range ds {
			ds[i].settle()
			f.leasers[i].Round()
			check(round)
		}
	}
	var total int64
	for i, d := range ds {
		n := d.running()
		total += n
		if n < 3 || n > 4 {
			t.Errorf("replica %d runs %d requests under equal demand; want its fair share, 3 or 4", i, n)
		}
	}
	if total != 10 {
		t.Errorf("%d requests run under full demand, want the whole limit, 10", total)
	}
}

func TestLeaseFollowsSkewWithinThreeRounds(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "skew", 3, time.Second)
	lim := LeaseLimits{MaxConcurrent: 30}
	ds := make([]*demand, 3)
	leases := make([]*Lease, 3)
	for i := range ds {
		ds[i] = &demand{want: 10}
		leases[i] = f.leasers[i].Lease("feature/chat", lim, ds[i])
	}
	f.pastRecovery(t, leases[0])
	round := func() {
		for i := range ds {
			ds[i].settle()
		}
		f.round()
	}
	waitFor(t, "every replica to run its 10 before the skew", func() bool {
		round()
		return ds[0].running() == 10 && ds[1].running() == 10 && ds[2].running() == 10
	})
	// One replica now gets 80 % of the traffic: 24 of 30 concurrent requests. The others' leases
	// are steady (reported once a renewal): they hear of it from the short replica's report.
	ds[0].set(24)
	ds[1].set(3)
	ds[2].set(3)
	for k := 1; k <= 3; k++ {
		round()
		if ds[0].running() == 24 {
			t.Logf("the lease followed the skew in %d rounds", k)
			return
		}
		if k == 1 {
			waitFor(t, "the others to hear that replica 0 is short", func() bool {
				for _, ls := range leases[1:] {
					ls.mu.Lock()
					heard := ls.pressure
					ls.mu.Unlock()
					if !heard {
						return false
					}
				}
				return true
			})
		}
	}
	t.Fatalf("after 3 rounds replica 0 runs %d of the 24 it wants (others %d, %d)", ds[0].running(), ds[1].running(), ds[2].running())
}

// A replica whose requests wait for more than its lease names the compartment on the lease
// channel, and hears its own publication too: that is no news of another replica's shortage (it
// would stop the replica asking, and have it give back what its own requests wait for). A report
// that could not cover what its requests need stops them asking for more rounds (another replica
// must give some back first); the holder, which holds more than its requests use, gives it back
// at its next report (at once: it asks for the round), and the short replica takes it at its
// next.
func TestShortReplicaHearsItsOwnNewsAsNone(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "own", 2, time.Second)
	lim := LeaseLimits{MaxConcurrent: 2}
	short, holder := &demand{}, &demand{want: 1}
	ls0 := f.leasers[0].Lease("feature/chat", lim, short)
	ls1 := f.leasers[1].Lease("feature/chat", lim, holder)
	f.pastRecovery(t, ls1)
	contended := func(ls *Lease) bool {
		ls.mu.Lock()
		defer ls.mu.Unlock()
		return ls.pressure
	}
	// Given r1 runs one request on a lease of both slots (the second for what may come)
	waitFor(t, "r1 to lease both slots", func() bool {
		holder.settle()
		ls1.Urgent()
		f.round()
		return holder.running() == 1 && ls1.State(f.clock.Now()).Slots == 2
	})
	ctx := context.Background()
	ps := inspect(t, srv.Addr()).Subscribe(ctx, "{own}:lease")
	defer ps.Close()
	if _, err := ps.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	news := ps.Channel()
	// caughtUp publishes news of another compartment, and returns once r0 has heard it (and,
	// the channel keeping its order, everything published before it).
	other := f.leasers[0].Lease("feature/other", lim, nil)
	caughtUp := func() {
		t.Helper()
		if err := inspect(t, srv.Addr()).Publish(ctx, "{own}:lease", "feature/other").Err(); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "r0 to hear the news of feature/other", func() bool { return contended(other) })
		other.mu.Lock()
		other.pressure = false
		other.mu.Unlock()
		<-news
	}
	caughtUp()
	// No round is asked for on r1 yet (a manual leaser's requests for one stay pending).
	select {
	case <-f.leasers[1].kick:
	default:
	}
	// When a request waits on r0, which reports at once
	short.set(1)
	f.leasers[0].Round()
	// Then r0 holds nothing yet, names the compartment, and asks for no more rounds
	if got := short.running(); got != 0 {
		t.Fatalf("r0 runs %d requests while r1 holds both slots", got)
	}
	if msg := <-news; !strings.HasPrefix(msg.Payload, "feature/chat") {
		t.Fatalf("published %q, want feature/chat named", msg.Payload)
	}
	if ls0.CanGrow() {
		t.Error("r0's lease says a round can grow it, though Redis just found its limit leased to r1")
	}
	// And once r0 has heard its own news, its lease is not contended
	caughtUp()
	if contended(ls0) {
		t.Fatal("r0 took its own news for another replica's shortage")
	}
	// When r1 hears it, it asks for a round at once, and reports: it gives back the slot it
	// does not use
	waitFor(t, "r1 to hear that r0 is short", func() bool { return contended(ls1) })
	select {
	case <-f.leasers[1].kick:
	default:
		t.Error("r1 holds a slot it does not use, heard that r0 is short, and asked for no round")
	}
	f.clock.add(fleetInterval)
	f.leasers[1].Round()
	if got := ls1.State(f.clock.Now()).Slots; got != 1 {
		t.Fatalf("r1 holds %d slots after its report, want the 1 it uses", got)
	}
	// And r0's next report takes it
	f.leasers[0].Round()
	if got := short.running(); got != 1 {
		t.Fatalf("r0 runs %d requests after r1 gave a slot back, want 1", got)
	}
}

// A lease that shrank below what its compartment holds (another replica's fair share) hands on
// each slot its requests free above it at once: the release asks for a round, and the lease is
// due in it, however steady.
func TestDrainedLeaseIsReportedAtOnce(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "drain", 1, time.Second)
	d := &demand{want: 2}
	ls := f.leasers[0].Lease("feature/chat", LeaseLimits{MaxConcurrent: 10}, d)
	f.pastRecovery(t, ls)
	waitFor(t, "the lease to settle", func() bool {
		d.settle()
		f.round()
		ls.mu.Lock()
		due, _ := ls.due(f.clock.Now())
		ls.mu.Unlock()
		return d.running() == 2 && due == whyNone
	})
	select {
	case <-f.leasers[0].kick:
	default:
	}
	ls.Drained()
	select {
	case <-f.leasers[0].kick:
	default:
		t.Error("a drained lease asked for no round")
	}
	ls.mu.Lock()
	due, _ := ls.due(f.clock.Now())
	ls.mu.Unlock()
	if due != whyDrained {
		t.Error("a drained lease is not due at the next round, as drained")
	}
}

func TestIdleReplicaHoldsNothing(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "idle", 2, time.Second)
	lim := LeaseLimits{MaxConcurrent: 10}
	busy, idle := &demand{want: 4}, &demand{want: 4}
	f.pastRecovery(t, f.leasers[0].Lease("tenant/acme", lim, busy))
	f.leasers[1].Lease("tenant/acme", lim, idle)
	for range 3 {
		busy.settle()
		idle.settle()
		f.round()
	}
	if got := leaseHash(t, srv.Addr(), "idle", "tenant/acme"); got["r1"] == 0 {
		t.Fatalf("replica r1 holds nothing while it runs requests: %v", got)
	}
	// r1's requests end. It keeps its lease a little (a request may come back at once), then
	// gives it back: within a few renewals of its lease.
	idle.set(0)
	for range 6 * renewSteps {
		idle.settle()
		f.round()
	}
	got := leaseHash(t, srv.Addr(), "idle", "tenant/acme")
	if _, ok := got["r1"]; ok {
		t.Fatalf("an idle replica still holds a lease: %v", got)
	}
	if got["r0"] == 0 {
		t.Fatalf("the busy replica lost its lease: %v", got)
	}
}

// TestLostLeasesRecoverWithoutGoingOver pins what happens when Redis loses every lease while
// replicas hold them (FLUSHALL, a restart without persistence): replicas re-assert what they
// hold, and no lease grows until every holder can have done so.
func TestLostLeasesRecoverWithoutGoingOver(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "lost", 3, 600*time.Millisecond)
	lim := LeaseLimits{MaxConcurrent: 10}
	ds := []*demand{{want: 6}, {want: 4}, {}}
	leases := make([]*Lease, 3)
	for i := range ds {
		leases[i] = f.leasers[i].Lease("feature/chat", lim, ds[i])
	}
	waitFor(t, "the compartment to be past its first recovery", func() bool {
		for i := range ds {
			ds[i].settle()
			f.leasers[i].Round()
		}
		return ds[0].running() == 6 && ds[1].running() == 4
	})
	if _, err := srv.Do("FLUSHALL"); err != nil {
		t.Fatal(err)
	}
	// The replica that held nothing reports first and wants everything.
	ds[2].set(10)
	total := func() int64 { return ds[0].running() + ds[1].running() + ds[2].running() }
	f.leasers[2].Round()
	if got := ds[2].running(); got != 0 {
		t.Fatalf("right after Redis lost the leases, a replica that held none got %d slots while the others hold 10", got)
	}
	if !leases[2].recovers {
		t.Fatal("the compartment does not say it recovers")
	}
	for i := range 20 {
		for k := range ds {
			ds[k].settle()
			f.leasers[k].Round()
			if n := total(); n > 10 {
				t.Fatalf("round %d: %d requests run, limit 10", i, n)
			}
		}
	}
	// Once the holders' requests end, the newcomer gets its share.
	ds[0].set(2)
	ds[1].set(2)
	waitFor(t, "the leases to move after recovery", func() bool {
		for k := range ds {
			ds[k].settle()
			f.leasers[k].Round()
			if n := total(); n > 10 {
				t.Fatalf("%d requests run, limit 10", n)
			}
		}
		return ds[2].running() >= 6
	})
}

func TestHostileLeaseContentIsBounded(t *testing.T) {
	srv := redistest.Standalone(t)
	rc := inspect(t, srv.Addr())
	ctx := context.Background()
	key := "{hostile|feature/chat}:ls"
	f := newFleet(t, srv.Addr(), "hostile", 1, 2*time.Second)
	lim := LeaseLimits{MaxConcurrent: 10}
	d := &demand{want: 5}
	ls := f.leasers[0].Lease("feature/chat", lim, d)
	waitFor(t, "a first lease", func() bool { d.settle(); ls.Urgent(); f.round(); return d.running() == 5 })

	cases := []struct {
		name  string
		setup func()
	}{
		{"a replica that cannot exist holds a million slots", func() {
			now, _ := rc.Time(ctx).Result()
			rc.HSet(ctx, key, "r:ghost", fmt.Sprintf("1000000|0|1000000|0|%d|1:1|", now.Add(time.Hour).UnixMilli()))
		}},
		{"this replica's own entry claims a million slots", func() {
			now, _ := rc.Time(ctx).Result()
			rc.HSet(ctx, key, "r:r0", fmt.Sprintf("1000000|0|1000000|0|%d|1:1|", now.Add(time.Second).UnixMilli()))
		}},
		{"negative and broken counts", func() {
			now, _ := rc.Time(ctx).Result()
			rc.HSet(ctx, key, "r:neg", fmt.Sprintf("-50|0|0|0|%d|1:1|", now.Add(time.Second).UnixMilli()), "r:junk", "abc", "born", "-3", "al", "x")
		}},
		{"two hundred thousand fake replicas", func() {
			pipe := rc.Pipeline()
			for i := 0; i < 200000; i += 1000 {
				args := make([]any, 0, 2000)
				for k := i; k < i+1000; k++ {
					args = append(args, fmt.Sprintf("r:fake%d", k), "1|0|1|0|99999999999999|1:1|")
				}
				pipe.HSet(ctx, key, args...)
			}
			_, _ = pipe.Exec(ctx)
		}},
		{"a string over the hash", func() { rc.Set(ctx, key, "x", 0) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.setup()
			start := time.Now()
			d.settle()
			ls.Urgent()
			f.round()
			took := time.Since(start)
			if ls.resend != nil {
				t.Fatalf("the report failed")
			}
			t.Logf("report took %v", took)
			// This replica keeps what it holds, and the compartment is usable: within the
			// recovery, the lease does not grow; after it, the replica gets its share again.
			if d.running() != 5 {
				t.Fatalf("the replica runs %d of its 5 requests", d.running())
			}
			d.set(8)
			waitFor(t, "the lease to grow again", func() bool { d.settle(); ls.Urgent(); f.round(); return d.running() == 8 })
			d.set(5)
			d.settle()
			ls.Urgent()
			f.round()
			if n, _ := rc.HLen(ctx, key).Result(); n > 50 {
				t.Fatalf("the lease hash still holds %d fields", n)
			}
		})
	}
}

func TestWindowChunksNeverAdmitMoreThanTheWindow(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "win", 3, time.Minute)
	lim := LeaseLimits{Windows: []Window{{Name: "tenant/acme", Kind: "rpm", Length: time.Minute, Capacity: 100}}}
	leases := make([]*Lease, 3)
	for i := range leases {
		leases[i] = f.leasers[i].Lease("tenant/acme", lim, nil)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	admitted := 0
	// Each replica asks for requests at its own pace for many rounds, well within a minute.
	// A request that finds the chunks short says so (NeedWindow) until the round after.
	for round := 0; round < 40; round++ {
		for i, ls := range leases {
			var waiting int64
			for range rng.IntN(8) {
				if _, ok := ls.Reserve(0, 1, time.Now()); ok {
					admitted++
				} else {
					ls.NeedWindow(0, 1)
					waiting++
				}
			}
			f.leasers[i].Round()
			ls.UnneedWindow(0, waiting)
		}
	}
	if admitted > 100 {
		t.Fatalf("%d requests admitted by a window of 100 a minute", admitted)
	}
	if admitted < 90 {
		t.Errorf("only %d of 100 requests admitted although the replicas asked for far more", admitted)
	}
}

func TestResentReportAppliesOnce(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "once", 1, time.Minute)
	lim := LeaseLimits{Windows: []Window{{Name: "tenant/acme", Kind: "tpm", Length: time.Minute, Capacity: 1000}}}
	ls := f.leasers[0].Lease("tenant/acme", lim, nil)
	// A need of 400 is granted as one chunk.
	if _, ok := ls.Reserve(0, 400, time.Now()); ok {
		t.Fatal("a reservation succeeded before any chunk")
	}
	ls.NeedWindow(0, 400)
	f.leasers[0].Round()
	c, ok := ls.Reserve(0, 400, time.Now())
	if !ok {
		t.Fatal("no chunk after a report")
	}
	ls.UnneedWindow(0, 400)
	rc := inspect(t, srv.Addr())
	sum := func() int64 {
		v, err := rc.HGet(context.Background(), "{once|tenant/acme}:w:tpm:60000", "-1").Int64()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	before := sum()
	// The request cost 100, and its chunk has expired: 300 go back to the window. The report
	// carrying them is sent twice (its first answer was lost).
	ls.Settle(0, c, 100, time.Now().Add(time.Hour))
	ls.mu.Lock()
	r := ls.build(time.Now().Add(time.Hour), false)
	ls.mu.Unlock()
	var granted int64
	for range 2 {
		res, err := leaseReply(f.leasers[0].script.Run(context.Background(), f.stores[0].client, r.keys, r.args...))
		if err != nil {
			t.Fatal(err)
		}
		granted += res[13]
	}
	if got, want := sum(), before-300+granted; got != want {
		t.Fatalf("the window holds %d after 300 came back in a report sent twice (and %d granted): want %d; report %v", got, granted, want, r.args)
	}
}

// A window of a few requests a minute is leased one request at a time, and a refused request's
// reservation goes back to Redis at once, to the slot it was charged in: also when an earlier
// chunk, used up and charged in an earlier slot (its request refunded too), is still held.
func TestOneAtATimeRefundsGoBackToTheirOwnSlot(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "refund", 1, time.Minute)
	lim := LeaseLimits{Windows: []Window{{Name: "feature/chat", Kind: "rpm", Length: time.Minute, Capacity: 2}}}
	ls := f.leasers[0].Lease("feature/chat", lim, nil)
	rc := inspect(t, srv.Addr())
	sum := func() int64 {
		v, err := rc.HGet(context.Background(), "{refund|feature/chat}:w:rpm:60000", "-1").Int64()
		if err != nil && err != redis.Nil {
			t.Fatal(err)
		}
		return v
	}
	now := f.clock.Now()
	// reserveAndRefund takes one request (asking for it: the chunks hold none), then gives it
	// back (the request was refused further on), which the next report sends.
	reserveAndRefund := func(which string) {
		t.Helper()
		if _, ok := ls.Reserve(0, 1, now); ok {
			t.Fatalf("%s: reserved without a chunk", which)
		}
		ls.NeedWindow(0, 1)
		f.leasers[0].Round()
		c, ok := ls.Reserve(0, 1, now)
		ls.UnneedWindow(0, 1)
		if !ok {
			t.Fatalf("%s: no chunk after a report", which)
		}
		ls.Refund(0, c, now)
		f.leasers[0].Round()
		if got := sum(); got != 0 {
			t.Fatalf("%s: the window counts %d requests after its only one was refunded", which, got)
		}
	}
	reserveAndRefund("the first request")
	// The second is charged in a later second of Redis's clock, while the first's chunk (used
	// up) is still held.
	next := time.Now().Truncate(time.Second).Add(time.Second)
	time.Sleep(time.Until(next) + 10*time.Millisecond)
	reserveAndRefund("the second request")
}

func TestDeadReplicaShareReturnsAfterTTL(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "dead", 2, 700*time.Millisecond)
	lim := LeaseLimits{MaxConcurrent: 10}
	a, b := &demand{want: 5}, &demand{want: 5}
	f.leasers[0].Lease("feature/chat", lim, a)
	f.leasers[1].Lease("feature/chat", lim, b)
	waitFor(t, "both leases", func() bool {
		for i, d := range []*demand{a, b} {
			d.settle()
			f.leasers[i].Round()
		}
		return a.running() == 5 && b.running() == 5
	})
	// Replica 0 dies (no more reports). Replica 1 wants everything.
	b.set(10)
	b.settle()
	f.leasers[1].Round()
	if b.running() > 5 {
		t.Fatalf("replica 1 runs %d while replica 0's lease of 5 is live", b.running())
	}
	waitFor(t, "the dead replica's share to return", func() bool { b.settle(); f.leasers[1].Round(); return b.running() == 10 })
}

// TestLearnedLimitIsTheFleets: a compartment whose concurrency limit is learned has one limit
// for the fleet; a replica's cut applies to every replica at once, and raises by several
// replicas within one step count once.
func TestLearnedLimitIsTheFleets(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "learn", 2, time.Second)
	lim := LeaseLimits{Learned: LearnedLimit{Min: 1, Max: 40, Initial: 10, Step: time.Hour}}
	a, b := &demand{want: 20}, &demand{want: 20}
	la := f.leasers[0].Lease("provider/openai", lim, a)
	lb := f.leasers[1].Lease("provider/openai", lim, b)
	f.pastRecovery(t, la)
	round := func() {
		for i, d := range []*demand{a, b} {
			d.settle()
			f.leasers[i].Round()
		}
	}
	round()
	round()
	if got := a.running() + b.running(); got != 10 {
		t.Fatalf("%d requests run under a learned limit starting at 10", got)
	}
	// Replica a's controller halves the limit (the provider slows down).
	la.Propose(10, 5)
	round()
	if st := lb.State(time.Now()); st.Learned != 5 {
		t.Fatalf("replica b sees a learned limit of %d after a's cut to 5", st.Learned)
	}
	for range 4 {
		a.set(min(a.want, 2)) // requests end; the fleet drains to the new limit
		round()
	}
	if got := a.running() + b.running(); got > 5 {
		t.Fatalf("%d requests run after the fleet's limit fell to 5", got)
	}
	// Both controllers raise it by one within the same step: the fleet's rises once.
	la.Propose(5, 6)
	lb.Propose(5, 6)
	round()
	if st := la.State(time.Now()); st.Learned != 6 {
		t.Fatalf("learned limit %d after two raises within one step, want 6", st.Learned)
	}
}

// TestNewDeploymentDoesNotRecover: a fleet starting on an empty Redis gets leases at its first
// report (Redis did not lose anything: no replica knew an earlier epoch), while the same fleet
// after Redis lost its state holds every lease where it is until the recovery is over.
func TestNewDeploymentDoesNotRecover(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "fresh", 2, time.Second)
	lim := LeaseLimits{MaxConcurrent: 10}
	a := &demand{want: 4}
	ls := f.leasers[0].Lease("feature/chat", lim, a)
	ls.Urgent()
	f.round()
	if ls.Recovering() || a.running() != 4 {
		t.Fatalf("a new deployment's first report: recovering %v, %d of 4 requests run", ls.Recovering(), a.running())
	}
	if e := f.leasers[0].Epoch(); !strings.HasSuffix(e, ":f") {
		t.Fatalf("epoch %q, want a fresh one", e)
	}
	if _, err := srv.Do("FLUSHALL"); err != nil {
		t.Fatal(err)
	}
	b := &demand{want: 4}
	lb := f.leasers[1].Lease("feature/chat", lim, b)
	lb.Urgent()
	f.round()
	if !lb.Recovering() || b.running() != 0 {
		t.Fatalf("after Redis lost its state: recovering %v, %d requests run on the replica that held nothing", lb.Recovering(), b.running())
	}
	if e := f.leasers[1].Epoch(); !strings.HasSuffix(e, ":l") {
		t.Fatalf("epoch %q, want a lost one", e)
	}
}

// TestLeaseShareIsMaxMinFair: whatever the replicas want, a replica's share of a compartment's
// slots is its max-min fair share, replicas of equal wants ordered by id: in that order each
// gets the least of its want and an even part of what those before it left. The script
// computes it without sorting the replicas; the reference here is that definition, over random
// wants with many ties, against the script run on entries written as replicas write them.
func TestLeaseShareIsMaxMinFair(t *testing.T) {
	srv := redistest.Standalone(t)
	rc := inspect(t, srv.Addr())
	ctx := context.Background()
	sc := redis.NewScript(luaLease)
	rng := rand.New(rand.NewPCG(7, 31))
	key := "{fair|c}:ls"
	for i := range 400 {
		now, err := rc.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		// Other replicas hold nothing and want a few slots each; the reporting replica holds
		// nothing either, so that its target is its share.
		wants := map[string]int64{}
		fields := []any{"born", now.Add(-time.Hour).UnixMilli()}
		for r := range rng.IntN(14) {
			id := fmt.Sprintf("r%02d", r)
			wants[id] = int64(rng.IntN(7))
			fields = append(fields, "r:"+id, fmt.Sprintf("0|0|%d|0|%d|1:1|", wants[id], now.Add(time.Minute).UnixMilli()))
		}
		me := fmt.Sprintf("r%02d", rng.IntN(16))
		wants[me] = 1 + int64(rng.IntN(8))
		limit := 1 + int64(rng.IntN(40))
		rc.Del(ctx, key)
		rc.HSet(ctx, key, fields...)
		res, err := sc.Run(ctx, rc, []string{key}, me, 10000, "0", 2000, "1:"+strconv.Itoa(i+1),
			limit, 0, 0, wants[me], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", "c", "0:0", "").Slice()
		if err != nil {
			t.Fatal(err)
		}
		want := maxMinShare(wants, me, limit)
		if got := res[2].(int64); got != want {
			t.Fatalf("limit %d, wants %v: %s's share is %d, want %d", limit, wants, me, got, want)
		}
	}
}

// maxMinShare is replica me's max-min fair share of limit among wants, by definition.
func maxMinShare(wants map[string]int64, me string, limit int64) int64 {
	ids := make([]string, 0, len(wants))
	for id, w := range wants {
		if w > 0 {
			ids = append(ids, id)
		}
	}
	slices.SortFunc(ids, func(a, b string) int {
		if c := cmp.Compare(wants[a], wants[b]); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	left := limit
	for k, id := range ids {
		n := int64(len(ids) - k)
		give := min(wants[id], (left+n-1)/n)
		if id == me {
			return give
		}
		left -= give
	}
	return 0
}

// TestWindowChunksAreSharedByDemand: near a window's end, its last room is shared by what the
// replicas want of it per chunk, max-min fair, not taken whole by whichever reports first. Each
// report records what its replica wants, and the others' reports read it.
func TestWindowChunksAreSharedByDemand(t *testing.T) {
	srv := redistest.Standalone(t)
	rc := inspect(t, srv.Addr())
	ctx := context.Background()
	sc := redis.NewScript(luaLease)
	keys := []string{"{share|c}:ls", "{share|c}:w:tpm:60000"}
	// report runs replica me's report wanting want tokens of a window of 1000 (slots of 1 s),
	// and returns the chunk granted.
	seq := 0
	report := func(me string, want int64) int64 {
		seq++
		res, err := sc.Run(ctx, rc, keys, me, 10000, "0", 2000, "1:"+strconv.Itoa(seq),
			0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, "", "c", "0:0", "",
			"tpm", 1000, 0, 1000, want, 0, 0, 0, 0).Slice()
		if err != nil {
			t.Fatal(err)
		}
		return res[13].(int64)
	}
	if g := report("a", 600); g != 600 {
		t.Fatalf("a alone got %d of an empty window, want the 600 it asked for", g)
	}
	// 400 left; a still wants 600 a chunk, b asks for 800: b's fair share is half.
	if g := report("b", 800); g != 200 {
		t.Fatalf("b got %d of the 400 left while a wants 600 and b 800, want 200", g)
	}
	if v, _ := rc.HGet(ctx, keys[0], "r:b").Result(); !strings.HasSuffix(v, "|tpm=800") {
		t.Fatalf("b's entry %q does not say what it wants of the window", v)
	}
	// a wants no more: b gets all that is left.
	if g := report("a", 0); g != 0 {
		t.Fatalf("a got %d, having asked for nothing", g)
	}
	if g := report("b", 800); g != 200 {
		t.Fatalf("b got %d of the 200 left, want all of it", g)
	}
}

// TestGrowthIsHeardByEveryReplica: when a lease grows, every replica hears what the leases
// now hold, so that what it counts as free while Redis is unavailable is no more than is.
// Newer news wins; of the same growth, the larger sums (the earlier) do.
func TestGrowthIsHeardByEveryReplica(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "grow", 2, time.Second)
	lim := LeaseLimits{MaxConcurrent: 10}
	quiet, busy := &demand{want: 1}, &demand{}
	lq := f.leasers[0].Lease("feature/chat", lim, quiet)
	f.leasers[1].Lease("feature/chat", lim, busy)
	f.pastRecovery(t, lq)
	free := func() int64 {
		lq.mu.Lock()
		defer lq.mu.Unlock()
		st := lq.stateAt(f.clock.Now(), false)
		return st.Free
	}
	waitFor(t, "replica 0 to hold its slot", func() bool {
		quiet.settle()
		f.round()
		return quiet.running() == 1
	})
	lq.mu.Lock()
	grant := lq.grant
	lq.mu.Unlock()
	if got := free(); got != 10-grant {
		t.Fatalf("replica 0 alone counts %d free, want %d", got, 10-grant)
	}
	// Replica 1's lease grows without replica 0 reporting.
	busy.set(6)
	waitFor(t, "replica 1 to run 6", func() bool {
		busy.settle()
		f.leasers[1].Round()
		return busy.running() == 6
	})
	waitFor(t, "replica 0 to hear of the growth", func() bool { return free() <= 10-grant-6 })
	// Old news changes nothing.
	lq.mu.Lock()
	now := lq.sums
	lq.sums.take(sums{seq: now.seq - 1, slots: 0})
	lq.sums.take(sums{seq: now.seq, slots: now.slots - 1})
	after := lq.sums
	lq.mu.Unlock()
	if after != now {
		t.Errorf("older or smaller news of the same growth moved the sums from %+v to %+v", now, after)
	}
}

// TestLeaseBoundRisesAloudAndLowersQuietly pins the bound on what a compartment's leases hold
// (what every replica counts as taken while Redis is lost): it rises, under a new number
// published to every replica, whenever the leases come to hold more; it is lowered, without a
// new number or a publication, to what they hold at most once per recovery time; a hash Redis
// made anew numbers its bounds after every earlier one.
func TestLeaseBoundRisesAloudAndLowersQuietly(t *testing.T) {
	srv := redistest.Standalone(t)
	rc := inspect(t, srv.Addr())
	ctx := context.Background()
	const recov = 400 // ms
	sub := rc.Subscribe(ctx, "{b}:lease")
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	sc := redis.NewScript(luaLease)
	seq := 0
	// report has replica me report holding held of 10 slots and wanting want, and returns the
	// bound and its number.
	report := func(me string, held, want int64) (bound, number int64) {
		t.Helper()
		seq++
		res, err := leaseReply(sc.Run(ctx, rc, []string{"{b|c}:ls"}, me, 10000, "0", recov, "1:"+strconv.Itoa(seq),
			10, held, held, want, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "{b}:lease", "feature/chat", "0:0", "1:f"))
		if err != nil {
			t.Fatal(err)
		}
		return res[10], res[12]
	}
	heard := func() []sums {
		var out []sums
		for {
			m, err := sub.ReceiveTimeout(ctx, 100*time.Millisecond)
			if err != nil {
				return out
			}
			if msg, ok := m.(*redis.Message); ok {
				if name, s, ok := grownOf(msg.Payload); ok && name == "feature/chat" {
					out = append(out, s)
				}
			}
		}
	}
	b1, n1 := report("a", 0, 6)
	b2, n2 := report("b", 0, 3)
	if b1 != 6 || b2 != 9 || n2 <= n1 {
		t.Fatalf("growths: bounds %d (number %d) then %d (number %d), want 6 then 9 under a larger number", b1, n1, b2, n2)
	}
	if got := heard(); len(got) != 2 || got[0] != (sums{seq: n1, slots: 6}) || got[1] != (sums{seq: n2, slots: 9}) {
		t.Fatalf("published %+v, want both growths", got)
	}
	// a's lease shrinks to 2: the bound is lowered to 5 quietly.
	if b, n := report("a", 2, 2); b != 5 || n != n2 {
		t.Fatalf("after a shrank: bound %d number %d, want 5 under the same number %d", b, n, n2)
	}
	// a grows to 4 again: above the lowered bound, so aloud.
	b3, n3 := report("a", 2, 4)
	if b3 != 7 || n3 <= n2 {
		t.Fatalf("after a grew again: bound %d number %d, want 7 under a larger number", b3, n3)
	}
	// a shrinks to 1 within the recovery time of the last lowering: the bound stays.
	if b, n := report("a", 1, 1); b != 7 || n != n3 {
		t.Fatalf("a second shrink soon after: bound %d number %d, want 7 and %d still", b, n, n3)
	}
	time.Sleep(recov * time.Millisecond)
	if b, n := report("a", 1, 1); b != 4 || n != n3 {
		t.Fatalf("a recovery time later: bound %d number %d, want 4 and %d", b, n, n3)
	}
	if got := heard(); len(got) != 1 || got[0] != (sums{seq: n3, slots: 7}) {
		t.Fatalf("published %+v after the first two, want only the growth to 7", got)
	}
	// Redis loses the hash: the new one numbers its bounds after every earlier one.
	if err := rc.Del(ctx, "{b|c}:ls").Err(); err != nil {
		t.Fatal(err)
	}
	if _, n := report("b", 3, 3); n <= n3 {
		t.Fatalf("a new hash's bound is numbered %d, not after the lost hash's %d", n, n3)
	}
}

// A leased replica hears its store's channel and its leases' on one subscription: one connection,
// and one health check, per replica. Once its leaser stops, the store's channel stays heard.
func TestALeasedReplicaSubscribesOnce(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	ctx := context.Background()
	o := options(rd.Addr(), "subonce", "a")
	o.Leased = true
	s := open(t, o)
	l := NewLeaser(s, LeaseOptions{Interval: fleetInterval})
	subscribed := func(want map[string]int64) func() bool {
		return func() bool {
			got, err := rc.PubSubNumSub(ctx, "{subonce}:free", "{subonce}:lease").Result()
			if err != nil {
				t.Fatal(err)
			}
			for ch, n := range want {
				if got[ch] != n {
					return false
				}
			}
			return true
		}
	}
	waitFor(t, "the replica to subscribe to both channels", subscribed(map[string]int64{"{subonce}:free": 1, "{subonce}:lease": 1}))
	list, err := rc.ClientList(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(list, "flags=P"); n != 1 {
		t.Fatalf("%d subscribed connections for one leased replica, want 1:\n%s", n, list)
	}
	l.Close(ctx)
	waitFor(t, "the stopped leaser's channel to be left", subscribed(map[string]int64{"{subonce}:free": 1, "{subonce}:lease": 0}))
}
