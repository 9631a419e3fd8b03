package cluster

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// options are a replica's settings for tests: generous timeouts (no test depends on speed), a
// quick heartbeat, and a lease TTL no test outlives unless it sets a shorter one.
func options(addr, prefix, id string) Options {
	return Options{
		Addresses: []string{addr}, Mode: Standalone, KeyPrefix: prefix, ReplicaID: id,
		Timeout: 2 * time.Second, DialTimeout: 2 * time.Second, WriteTimeout: 2 * time.Second,
		LeaseTTL: time.Minute, Heartbeat: 100 * time.Millisecond, SettleInterval: time.Millisecond,
		Logger: quiet,
	}
}

// open opens a store, closes it when the test ends and waits until it is available.
func open(t testing.TB, o Options) *Store {
	t.Helper()
	s, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Close(ctx)
	})
	waitFor(t, o.ReplicaID+" to be available", s.Available)
	return s
}

// waitFor polls cond until it holds, failing the test after 10 s (a bound for a broken build,
// not a timing assertion).
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// inspect returns a client to look at the keys directly.
func inspect(t *testing.T, addr string) *redis.Client {
	t.Helper()
	rc := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = rc.Close() })
	return rc
}

func admit(t *testing.T, s *Store, a *Admission) Result {
	t.Helper()
	if a.Lease == 0 {
		a.Lease = s.NextLease()
	}
	var r Result
	if err := s.Admit(context.Background(), a, &r); err != nil {
		t.Fatalf("admission on %s: %v", s.ReplicaID(), err)
	}
	return r
}

func wantStatus(t *testing.T, r Result, st Status, index int) {
	t.Helper()
	if r.Status != st || (st != Admitted && r.Index != index) {
		t.Fatalf("got %+v, want status %d index %d", r, st, index)
	}
}

// held returns the slots each replica holds in compartment name, as Redis has them.
func held(t *testing.T, rc redis.UniversalClient, s *Store, name string) map[string]string {
	t.Helper()
	m, err := rc.HGetAll(context.Background(), s.slotKey(name)).Result()
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// used returns what counts against window w now, as Redis has it.
func used(t *testing.T, rc redis.UniversalClient, s *Store, w Window) int64 {
	t.Helper()
	v, err := windowState.Run(context.Background(), rc, []string{s.windowKey(&w)}, w.Capacity, slotMillis(w.Length), "").Int64Slice()
	if err != nil {
		t.Fatal(err)
	}
	return w.Capacity - v[0]
}

// expire ends s's registration now, as if its lease had run out: in Redis time its expiry
// is a second ago.
func expire(t *testing.T, rc redis.UniversalClient, s *Store) {
	t.Helper()
	ctx := context.Background()
	now, err := rc.Time(ctx).Result()
	if err == nil {
		err = rc.ZAddXX(ctx, s.keys.replicas, redis.Z{Score: float64(now.Add(-time.Second).UnixMilli()), Member: s.ReplicaID()}).Err()
	}
	if err != nil {
		t.Fatal(err)
	}
}

func pending(s *Store) int {
	s.pendMu.Lock()
	defer s.pendMu.Unlock()
	return len(s.pending)
}

// counts records the totals a store reports, as the engine applies them: a report older than
// the last applied is ignored.
type counts struct {
	mu  sync.Mutex
	seq map[string]int64
	n   map[string][2]int64
}

func newCounts() *counts { return &counts{seq: map[string]int64{}, n: map[string][2]int64{}} }

func (c *counts) on(name string, seq, slots, tokens int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if seq >= c.seq[name] {
		c.seq[name], c.n[name] = seq, [2]int64{slots, tokens}
	}
}

// reset forgets the sequence numbers: Redis lost its state and numbers them again.
func (c *counts) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	clear(c.seq)
}

func (c *counts) is(name string, slots, tokens int64) func() bool {
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.n[name] == [2]int64{slots, tokens}
	}
}

var (
	perMinute = Window{Name: "f", Kind: "rpm", Length: time.Minute, Capacity: 10, Amount: 1}
	tokens    = Window{Name: "f", Kind: "tpm", Length: time.Minute, Capacity: 1000}
)

func withAmount(w Window, n int64) Window { w.Amount = n; return w }

func TestAdmissionIsAllOrNothing(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	a := open(t, options(rd.Addr(), "aon", "a"))
	b := open(t, options(rd.Addr(), "aon", "b"))
	// Given b holds 900 of the 1000 tokens per minute and compartment one's only slot
	wantStatus(t, admit(t, b, &Admission{Slots: []Slot{{Name: "one", Max: 1}}, Windows: []Window{withAmount(tokens, 900)}}), Admitted, 0)

	// When a's admission fits its first window but not its second
	r := admit(t, a, &Admission{Slots: []Slot{{Name: "many", Max: 10}}, Windows: []Window{perMinute, withAmount(tokens, 200)}})
	// Then it is refused by the second, with the wait until room, and nothing is taken
	wantStatus(t, r, RefusedWindow, 1)
	if r.RetryAfter <= 0 || r.RetryAfter > time.Minute {
		t.Errorf("retry after %v, want within the minute", r.RetryAfter)
	}
	if got := used(t, rc, a, perMinute); got != 0 {
		t.Errorf("the first window was charged %d by a refused admission", got)
	}
	if got := used(t, rc, a, tokens); got != 900 {
		t.Errorf("the second window holds %d, want 900", got)
	}
	if got := held(t, rc, a, "many"); len(got) != 0 {
		t.Errorf("a refused admission holds slots: %v", got)
	}

	// When a's admission fits its windows and its first compartment but not its second
	r = admit(t, a, &Admission{Slots: []Slot{{Name: "many", Max: 10}, {Name: "one", Max: 1}}, Windows: []Window{perMinute}})
	// Then it is refused by the second compartment, seeing what the others hold, and nothing
	// is taken
	wantStatus(t, r, RefusedSlot, 1)
	if want := [][2]int64{{0, 0}, {1, 0}}; !slices.Equal(r.Others, want) {
		t.Errorf("others hold %v, want %v", r.Others, want)
	}
	if got := used(t, rc, a, perMinute); got != 0 {
		t.Errorf("a window was charged %d by an admission refused for a slot", got)
	}
	if got := held(t, rc, a, "many"); len(got) != 0 {
		t.Errorf("an admission refused for its second slot holds its first: %v", got)
	}
	if got := held(t, rc, a, "one"); len(got) != 1 || got["n:b"] != "1" {
		t.Errorf("compartment one holds %v, want b's slot only", got)
	}
	if n, _ := rc.HLen(context.Background(), a.keys.leases).Result(); n != 0 || a.Info(context.Background()).Leases != 0 {
		t.Errorf("refused admissions left leases: %d in Redis, %d here", n, a.Info(context.Background()).Leases)
	}

	// When everything fits, everything is taken at once
	r = admit(t, a, &Admission{Slots: []Slot{{Name: "many", Max: 10, MaxTokens: 500, Tokens: 100}}, Windows: []Window{perMinute, withAmount(tokens, 100)}})
	wantStatus(t, r, Admitted, 0)
	if !slices.Equal(r.Remaining, []int64{9, 0}) || len(r.Reset) != 2 || r.Reset[0] <= 0 || r.Reset[0] > time.Minute {
		t.Errorf("remaining %v, reset %v; want [9 0] and a reset within the minute", r.Remaining, r.Reset)
	}
	if got := held(t, rc, a, "many"); got["n:a"] != "1" || got["t:a"] != "100" {
		t.Errorf("compartment many holds %v, want a's slot and 100 tokens", got)
	}

	// A window in shadow mode that has no room admits, and says it would have refused
	r = admit(t, a, &Admission{Windows: []Window{perMinute, {Name: "f", Kind: "tpm", Length: time.Minute, Capacity: 1000, Amount: 10, Shadow: true}}})
	wantStatus(t, r, Admitted, 0)
	if r.Shadowed != 1<<1 {
		t.Errorf("shadowed %b, want the second window's bit", r.Shadowed)
	}
}

func TestSettlementIsIdempotent(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	a := open(t, options(rd.Addr(), "idem", "a"))
	w := withAmount(tokens, 300)
	sl := Slot{Name: "c", Max: 2, MaxTokens: 1000, Tokens: 300}
	// Given a request admitted with 300 tokens reserved and a slot
	id := a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: id, Slots: []Slot{sl}, Windows: []Window{w}}), Admitted, 0)

	// When the batch settling it to 100 tokens runs twice (the first reply was lost and the
	// batch sent again)
	keys := []string{a.keys.replicas, a.keys.leases, a.keys.comps, a.keys.seq, a.slotKey("c"), a.windowKey(&w)}
	args := []any{"a", a.keys.channel, 1, strconv.FormatUint(id, 10), 100, 1, 1, 5, 300, 6, 1, w.Capacity, w.Debt, slotMillis(w.Length)}
	for i, want := range []int64{1, 0} {
		n, err := a.settle.Run(context.Background(), rc, keys, args...).Int64()
		if err != nil || n != want {
			t.Fatalf("run %d settled %d (%v), want %d", i+1, n, err, want)
		}
	}
	// Then it was settled once: 200 refunded, the slot and its tokens released once
	if got := used(t, rc, a, w); got != 100 {
		t.Errorf("used %d, want 100", got)
	}
	if got := held(t, rc, a, "c"); len(got) != 0 {
		t.Errorf("compartment c holds %v after its only lease was released", got)
	}

	// And the store's own settlement of it (it still counts the lease as held) changes nothing
	a.Settle(id, 100, []Window{w})
	waitFor(t, "the settlement to be sent", func() bool { return pending(a) == 0 })
	if got := used(t, rc, a, w); got != 100 {
		t.Errorf("used %d after a repeated settlement, want 100", got)
	}

	// Given another request admitted, holding the slot
	id = a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: id, Slots: []Slot{sl}, Windows: []Window{w}}), Admitted, 0)
	other := a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: other, Slots: []Slot{sl}}), Admitted, 0)
	// When the store settles it twice
	a.Settle(id, 50, []Window{w})
	a.Settle(id, 50, []Window{w})
	waitFor(t, "the settlements to be sent", func() bool { return pending(a) == 0 })
	// Then it counts once: 100 + 50, and the other lease keeps its slot
	if got := used(t, rc, a, w); got != 150 {
		t.Errorf("used %d, want 150", got)
	}
	if got := held(t, rc, a, "c"); got["n:a"] != "1" || got["t:a"] != "300" {
		t.Errorf("compartment c holds %v, want the other lease's slot and 300 tokens", got)
	}
}

// TestSettlementLeavesRequestRatesAlone: a request-rate window counts the request charged at
// admission; settling the request's tokens once charged them to it as well, so one request
// with 600 tokens filled a 10-requests-per-minute window.
func TestSettlementLeavesRequestRatesAlone(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	a := open(t, options(rd.Addr(), "rates", "a"))
	// Given a request admitted with its request counted and 100 tokens reserved
	id := a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: id, Windows: []Window{perMinute, withAmount(tokens, 100)}}), Admitted, 0)
	// When it settles at 600 tokens
	a.Settle(id, 600, []Window{perMinute, tokens})
	waitFor(t, "the settlement to be sent", func() bool { return pending(a) == 0 })
	// Then the token window holds 600 and the request window still one request
	if got := used(t, rc, a, tokens); got != 600 {
		t.Errorf("tokens used %d, want 600", got)
	}
	if got := used(t, rc, a, perMinute); got != 1 {
		t.Errorf("requests counted %d, want 1", got)
	}
	// And a request settled below its estimate gives tokens back, not requests
	id = a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: id, Windows: []Window{perMinute, withAmount(tokens, 300)}}), Admitted, 0)
	a.Settle(id, 0, []Window{perMinute, tokens})
	waitFor(t, "the settlement to be sent", func() bool { return pending(a) == 0 })
	if got, want := [2]int64{used(t, rc, a, perMinute), used(t, rc, a, tokens)}, [2]int64{2, 600}; got != want {
		t.Errorf("requests and tokens used %v, want %v", got, want)
	}
}

func TestExpiredReplicaIsCountedByNobody(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	// a's next heartbeat is an hour away: it stops beating, as a replica that hangs or loses
	// its network does, without saying goodbye.
	oa := options(rd.Addr(), "exp", "a")
	oa.Heartbeat = time.Hour
	a := open(t, oa)
	seen := newCounts()
	ob := options(rd.Addr(), "exp", "b")
	ob.OnCounts = seen.on
	ob.Watched = func() []string { return []string{"c"} }
	b := open(t, ob)

	// Given a holds compartment c's only slot
	wantStatus(t, admit(t, a, &Admission{Slots: []Slot{{Name: "c", Max: 1}}}), Admitted, 0)
	waitFor(t, "b to see a's slot", seen.is("c", 1, 0))
	r := admit(t, b, &Admission{Slots: []Slot{{Name: "c", Max: 1}}})
	wantStatus(t, r, RefusedSlot, 0)

	// When a's lease expires, nobody counts its slot, and b's heartbeat drops a's state
	expire(t, rc, a)
	waitFor(t, "b's heartbeat to report c empty", seen.is("c", 0, 0))
	waitFor(t, "a's keys to be dropped", func() bool {
		ctx := context.Background()
		n, _ := rc.Exists(ctx, a.keys.leases, a.keys.comps, a.slotKey("c")).Result()
		_, err := rc.ZScore(ctx, a.keys.replicas, "a").Result()
		return n == 0 && err == redis.Nil
	})
	// Then b takes the slot
	wantStatus(t, admit(t, b, &Admission{Slots: []Slot{{Name: "c", Max: 1}}}), Admitted, 0)

	// And when a (still alive) next admits, it learns that it lost its registration, and
	// rewrites its leases by itself: its slot counts again
	var res Result
	if err := a.Admit(context.Background(), &Admission{Lease: a.NextLease(), Slots: []Slot{{Name: "d", Max: 1}}}, &res); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("admission of an expired replica: %v, want ErrUnavailable", err)
	}
	waitFor(t, "a to rewrite its leases", func() bool {
		return a.Available() && held(t, rc, a, "c")["n:a"] == "1"
	})
	waitFor(t, "b to see both slots", seen.is("c", 2, 0))
}

func TestRedisRestartIsRecovered(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	var (
		mu     sync.Mutex
		resets int
		states []bool
	)
	oa := options(rd.Addr(), "restart", "a")
	oa.OnReset = func() { mu.Lock(); resets++; mu.Unlock() }
	oa.OnState = func(st State) { mu.Lock(); states = append(states, st.Available); mu.Unlock() }
	a := open(t, oa)
	seen := newCounts()
	ob := options(rd.Addr(), "restart", "b")
	ob.OnCounts, ob.OnReset = seen.on, seen.reset
	b := open(t, ob)
	// Given a holds compartment c's only slot
	lease := a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: lease, Slots: []Slot{{Name: "c", Max: 1}}}), Admitted, 0)

	// When Redis restarts empty
	rd.Restart()

	// Then a notices (an admission fails, or its heartbeat finds it unregistered), rewrites its
	// lease and is available again by itself
	var r Result
	err := a.Admit(context.Background(), &Admission{Lease: a.NextLease(), Slots: []Slot{{Name: "d", Max: 1}}}, &r)
	t.Logf("first admission after the restart: %v", err)
	waitFor(t, "a to rewrite its lease", func() bool {
		v, _ := rc.HGet(context.Background(), a.slotKey("c"), "n:a").Result()
		return v == "1" && a.Available()
	})
	mu.Lock()
	if resets < 2 || !slices.Contains(states, false) || !states[len(states)-1] {
		t.Errorf("resets %d, states %v: want a reset after the restart and unavailable then available", resets, states)
	}
	mu.Unlock()
	// And the lease counts on b: b is refused c's slot
	waitFor(t, "b to admit against the new Redis", func() bool {
		return b.Admit(context.Background(), &Admission{Lease: b.NextLease(), Slots: []Slot{{Name: "c", Max: 1}}}, &r) == nil
	})
	wantStatus(t, r, RefusedSlot, 0)
	if want := [][2]int64{{1, 0}}; !slices.Equal(r.Others, want) {
		t.Errorf("b sees others hold %v, want %v", r.Others, want)
	}
	// Until a releases it: b hears of it (its subscription survived the restart) and takes it
	// (a publication while nobody is subscribed is lost: the heartbeat reports compartments
	// with requests waiting, which b has none of)
	waitFor(t, "both stores to subscribe again", func() bool {
		v, _ := rd.Do("PUBSUB", "NUMSUB", a.keys.channel)
		return v == a.keys.channel+"\n2"
	})
	a.Settle(lease, 0, nil)
	waitFor(t, "b to hear the slot was released", seen.is("c", 0, 0))
	waitFor(t, "b to take the released slot", func() bool {
		return b.Admit(context.Background(), &Admission{Lease: b.NextLease(), Slots: []Slot{{Name: "c", Max: 1}}}, &r) == nil && r.Status == Admitted
	})
}

func TestTimedOutAdmissionIsUndone(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	o := options(rd.Addr(), "pause", "a")
	o.Timeout, o.Heartbeat = 50*time.Millisecond, 30*time.Second
	a := open(t, o)
	sl := Slot{Name: "c", Max: 5, MaxTokens: 1000, Tokens: 100}
	w := withAmount(tokens, 100)
	// The scripts are loaded (the admission below is one round trip)
	id := a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: id, Slots: []Slot{sl}, Windows: []Window{w}}), Admitted, 0)
	a.Settle(id, 0, []Window{w})
	waitFor(t, "the settlement to be sent", func() bool { return pending(a) == 0 })

	// When Redis hangs during an admission
	rd.Pause(0)
	defer rd.Resume()
	start := time.Now()
	var r Result
	err := a.Admit(context.Background(), &Admission{Lease: a.NextLease(), Slots: []Slot{sl}, Windows: []Window{w}}, &r)
	took := time.Since(start)
	// Then the admission gives up about its timeout, unavailable
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("admission against a hung Redis: %v, want ErrUnavailable", err)
	}
	if took > 2*time.Second {
		t.Errorf("the admission took %v with a 50ms timeout", took)
	}
	time.Sleep(100 * time.Millisecond) // the undo is sent meanwhile, and waits too
	rd.Resume()

	// And once Redis answers, whatever the admission took is given back (the window too, which
	// only the undo gives back: rewriting the leases would not)
	waitFor(t, "the admission to be undone", func() bool {
		n, _ := rc.HLen(context.Background(), a.keys.leases).Result()
		return pending(a) == 0 && n == 0 && len(held(t, rc, a, "c")) == 0 && used(t, rc, a, w) == 0
	})
	waitFor(t, "a to be available", a.Available)
	wantStatus(t, admit(t, a, &Admission{Slots: []Slot{sl}, Windows: []Window{w}}), Admitted, 0)
}

func TestOneSlowAdmissionKeepsTheStoreAvailable(t *testing.T) {
	rd := redistest.Standalone(t)
	o := options(rd.Addr(), "slow", "a")
	o.Timeout, o.Heartbeat = 50*time.Millisecond, 30*time.Second
	a := open(t, o)
	wantStatus(t, admit(t, a, &Admission{Slots: []Slot{{Name: "c", Max: 5}}}), Admitted, 0) // scripts loaded
	rd.Pause(0)
	defer rd.Resume()
	// When admissions time out, the store stays available for the first two: one slow answer
	// does not send every admission to on_unavailable
	for i := 1; i <= 3; i++ {
		var r Result
		err := a.Admit(context.Background(), &Admission{Lease: a.NextLease(), Slots: []Slot{{Name: "c", Max: 5}}}, &r)
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("admission %d against a hung Redis: %v, want ErrUnavailable", i, err)
		}
		if want := i < 3; a.Available() != want {
			t.Fatalf("after %d timed-out admissions in a row, available is %v, want %v (%v)", i, a.Available(), want, err)
		}
	}
	// Then it recovers by itself once Redis answers
	rd.Resume()
	waitFor(t, "a to be available", a.Available)
}

// The scripts read Redis's clock, never the callers': replicas whose clocks disagree count one
// window. Three replicas' callers, with clocks 500 ms apart, retry refused admissions when their
// own clock says the window has room (one too early, one too late) for a few windows; every
// admission happened, in Redis time, between the instants its call started and returned, so
// admissions whose calls all fall within a window (less two slots, for the window's steps and
// Redis's milliseconds) were all counted at once and cannot exceed its capacity.
func TestReplicasWithSkewedClocksShareOneWindow(t *testing.T) {
	rd := redistest.Standalone(t)
	const capacity = 4
	w := Window{Name: "f", Kind: "rpm", Length: 1500 * time.Millisecond, Capacity: capacity, Amount: 1}
	slot := time.Duration(slotMillis(w.Length)) * time.Millisecond
	type call struct{ start, end time.Time }
	var (
		mu       sync.Mutex
		admitted []call
		refused  = map[string]int{}
		wg       sync.WaitGroup
	)
	stop := time.Now().Add(3 * time.Second)
	for i, skew := range []time.Duration{-500 * time.Millisecond, 0, 500 * time.Millisecond} {
		s := open(t, options(rd.Addr(), "skew", strconv.Itoa(i)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 0))
			for time.Now().Before(stop) {
				id := s.NextLease()
				var r Result
				start := time.Now()
				err := s.Admit(context.Background(), &Admission{Lease: id, Windows: []Window{w}}, &r)
				end := time.Now()
				switch {
				case err != nil:
					t.Errorf("admission on %s: %v", s.ReplicaID(), err)
					return
				case r.Status == Admitted:
					s.Settle(id, 1, []Window{w})
					mu.Lock()
					admitted = append(admitted, call{start, end})
					mu.Unlock()
					time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
				default:
					mu.Lock()
					refused[s.ReplicaID()]++
					mu.Unlock()
					// This caller's clock says the window has room after RetryAfter, give or
					// take its skew.
					time.Sleep(max(r.RetryAfter+skew, time.Millisecond) + time.Duration(rng.IntN(5))*time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	slices.SortFunc(admitted, func(x, y call) int { return x.start.Compare(y.start) })
	span := w.Length - 2*slot
	for i, first := range admitted {
		n := 0
		for _, c := range admitted[i:] {
			if c.end.Sub(first.start) < span {
				n++
			}
		}
		if n > capacity {
			t.Fatalf("%d admissions within %v of %v, capacity %d", n, span, first.start, capacity)
		}
	}
	if len(admitted) < capacity || len(refused) != 3 {
		t.Errorf("%d admitted, refused per replica %v: want the window filled and every replica refused", len(admitted), refused)
	}
	t.Logf("%d admitted, refused per replica %v", len(admitted), refused)
}

func TestCloseReleasesSlotsAtOnce(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	seen := newCounts()
	ob := options(rd.Addr(), "close", "b")
	ob.OnCounts = seen.on
	ob.Watched = func() []string { return []string{"c"} }
	open(t, ob)                                    // b only watches
	a := open(t, options(rd.Addr(), "close", "a")) // a minute's lease TTL
	// Given a holds two slots and 30 tokens in c
	for range 2 {
		wantStatus(t, admit(t, a, &Admission{Slots: []Slot{{Name: "c", Max: 10, MaxTokens: 100, Tokens: 15}}}), Admitted, 0)
	}
	waitFor(t, "b to see a's slots", seen.is("c", 2, 30))
	// When a closes (its leases held)
	if err := a.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	// Then b sees them free at once, not a lease TTL later
	waitFor(t, "b to see c empty", seen.is("c", 0, 0))
	if _, err := rc.ZScore(context.Background(), a.keys.replicas, "a").Result(); err != redis.Nil {
		t.Errorf("a is still registered after Close: %v", err)
	}
}

func TestRedisCluster(t *testing.T) {
	rcs := redistest.Cluster(t, 3)
	rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: rcs.Addrs()})
	t.Cleanup(func() { _ = rc.Close() })
	clustered := func(id string) Options {
		o := options("", "cl", id)
		o.Addresses, o.Mode = rcs.Addrs(), Cluster
		return o
	}
	seen := newCounts()
	ob := clustered("b")
	ob.OnCounts = seen.on
	ob.Watched = func() []string { return []string{"c", "d"} }
	b := open(t, ob)
	oa := clustered("a")
	a := open(t, oa)
	// x stops beating, and holds a slot of d
	ox := clustered("x")
	ox.Heartbeat = time.Hour
	x := open(t, ox)
	wantStatus(t, admit(t, x, &Admission{Slots: []Slot{{Name: "d", Max: 1}}}), Admitted, 0)

	// Admission and settlement
	w := withAmount(tokens, 400)
	lease := a.NextLease()
	r := admit(t, a, &Admission{Lease: lease, Slots: []Slot{{Name: "c", Max: 1}}, Windows: []Window{w}})
	wantStatus(t, r, Admitted, 0)
	waitFor(t, "b to see a's slot", seen.is("c", 1, 0))
	r = admit(t, b, &Admission{Slots: []Slot{{Name: "c", Max: 1}}, Windows: []Window{w}})
	wantStatus(t, r, RefusedSlot, 0)
	a.Settle(lease, 100, []Window{w})
	waitFor(t, "b to see the slot released", seen.is("c", 0, 0))
	if got := used(t, rc, a, w); got != 100 {
		t.Errorf("used %d after settling 400 reserved to 100, want 100", got)
	}
	wantStatus(t, admit(t, b, &Admission{Slots: []Slot{{Name: "c", Max: 1}}, Windows: []Window{w}}), Admitted, 0)

	// Heartbeats: x's lease expires, b's heartbeat drops its state (keys the script builds
	// from the prefix, in the same slot)
	expire(t, rc, x)
	waitFor(t, "x's state to be dropped", func() bool {
		ctx := context.Background()
		n, _ := rc.Exists(ctx, x.keys.leases, x.keys.comps).Result()
		_, err := rc.HGet(ctx, x.slotKey("d"), "n:x").Result()
		return n == 0 && err == redis.Nil
	})
	waitFor(t, "b's heartbeat to report d empty", seen.is("d", 0, 0))
	waitFor(t, "b to count two live replicas", func() bool { return b.Live() == 2 })
	if in := b.Info(context.Background()); in.InfoError != "" || len(in.Replicas) != 2 || in.Live != 2 {
		t.Errorf("membership %+v, want a and b live", in)
	}

	// Resync: x learns it lost its registration and rewrites its lease
	var res Result
	if err := x.Admit(context.Background(), &Admission{Lease: x.NextLease()}, &res); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("admission of an expired replica: %v, want ErrUnavailable", err)
	}
	waitFor(t, "x to rewrite its lease", func() bool {
		v, _ := rc.HGet(context.Background(), x.slotKey("d"), "n:x").Result()
		return x.Available() && v == "1"
	})
	waitFor(t, "b to see x's slot again", seen.is("d", 1, 0))
}

func TestSentinel(t *testing.T) {
	ss := redistest.Sentinel(t)
	rc := inspect(t, ss.Master().Addr())
	o := options("", "sent", "a")
	o.Addresses, o.Mode, o.MasterName = []string{ss.Addr()}, Sentinel, ss.MasterName()
	a := open(t, o)
	w := withAmount(tokens, 300)
	lease := a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: lease, Slots: []Slot{{Name: "c", Max: 1}}, Windows: []Window{w}}), Admitted, 0)
	if got := held(t, rc, a, "c"); got["n:a"] != "1" {
		t.Errorf("the master holds %v, want a's slot", got)
	}
	wantStatus(t, admit(t, a, &Admission{Slots: []Slot{{Name: "c", Max: 1}}}), RefusedSlot, 0)
	a.Settle(lease, 120, []Window{w})
	waitFor(t, "the settlement to be sent", func() bool { return pending(a) == 0 })
	if got := used(t, rc, a, w); got != 120 {
		t.Errorf("used %d, want 120", got)
	}
	if got := held(t, rc, a, "c"); len(got) != 0 {
		t.Errorf("the master holds %v after the release", got)
	}
}
