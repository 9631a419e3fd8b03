package cluster

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// str is a reply's string, "" for none.
func str(v any) string {
	s, _ := v.(string)
	return s
}

// states records the States a store reports.
type states struct {
	mu  sync.Mutex
	all []State
}

func (s *states) on(st State) {
	s.mu.Lock()
	s.all = append(s.all, st)
	s.mu.Unlock()
}

func (s *states) since(i int) []State {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]State(nil), s.all[i:]...)
}

func (s *states) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.all)
}

// A heartbeat sent before the replica was cut off, and answered after, says nothing of what the
// replica admitted alone meanwhile: the replica counts on Redis alone again only after it has
// rewritten its slots (and confirmed them), never on that answer.
func TestAnAnswerSentBeforeTheCutDoesNotEndIt(t *testing.T) {
	rd := redistest.Standalone(t)
	seen := &states{}
	o := options(rd.Addr(), "late", "a")
	o.Timeout, o.Heartbeat, o.OnState = 50*time.Millisecond, 100*time.Millisecond, seen.on
	a := open(t, o)
	wantStatus(t, admit(t, a, &Admission{Slots: []Slot{{Name: "c", Max: 5}}}), Admitted, 0) // scripts loaded
	waitFor(t, "a to share its limits", a.Synced)

	// Given Redis hangs while a heartbeat is on its way (sent every 100 ms, it waits up to the
	// 2 s write timeout)
	rd.Pause(0)
	defer rd.Resume()
	time.Sleep(300 * time.Millisecond)
	// When three admissions in a row time out, cutting the replica off
	for range 3 {
		var r Result
		if err := a.Admit(context.Background(), &Admission{Lease: a.NextLease(), Slots: []Slot{{Name: "c", Max: 5}}}, &r); !errors.Is(err, ErrUnavailable) {
			t.Fatalf("admission against a hung Redis: %v, want ErrUnavailable", err)
		}
	}
	if a.Available() {
		t.Fatal("a is available after three admissions in a row timed out")
	}
	cut := seen.len()
	// And Redis answers the heartbeat sent before
	rd.Resume()
	waitFor(t, "a to share its limits again", a.Synced)

	// Then a was first available again after rewriting its slots, waiting for its own
	// confirmation, not synced at once on the heartbeat's answer
	for _, st := range seen.since(cut) {
		if st.Available {
			if st.Synced {
				t.Fatalf("after the cut, a's first state with Redis answering was %+v: synced on an answer to a call made before the cut, without rewriting its slots", st)
			}
			break
		}
	}
}

// Once a replica is cut off, the releases it sends settle their windows but leave their slots
// counted in Redis until it rewrites them: its part of each limit counts those slots as the
// other replicas do, and it may take them again on its own. Once rewritten, Redis counts what it
// holds, and releases free slots again.
func TestReleasesAfterTheCutLeaveTheirSlotsCounted(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	o := options(rd.Addr(), "hold", "a")
	o.Heartbeat = time.Hour
	a := open(t, o)
	sl := Slot{Name: "c", Max: 5, MaxTokens: 1000, Tokens: 100}
	w := withAmount(tokens, 100)
	first, second := a.NextLease(), a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: first, Slots: []Slot{sl}, Windows: []Window{w}}), Admitted, 0)
	wantStatus(t, admit(t, a, &Admission{Lease: second, Slots: []Slot{sl}, Windows: []Window{w}}), Admitted, 0)

	// Given a was cut off (its rewrite not run yet)
	a.stateMu.Lock()
	a.downs.Add(1)
	a.stateMu.Unlock()
	// When a request it holds ends, using 40 of its 100 tokens
	a.Settle(first, 40, []Window{w})
	waitFor(t, "the release to be sent", func() bool { return pending(a) == 0 })

	// Then its window is settled and its lease's record gone, but Redis still counts both slots
	if got := used(t, rc, a, w); got != 140 {
		t.Errorf("the window holds %d tokens after the release, want 140 (settled)", got)
	}
	if n, _ := rc.HExists(context.Background(), a.keys.leases, strconv.FormatUint(first, 10)).Result(); n {
		t.Error("the released lease's record is still in Redis")
	}
	if got := held(t, rc, a, "c"); got["n:a"] != "2" || got["t:a"] != "200" {
		t.Errorf("Redis counts %v for a after a release sent while cut off, want its 2 slots and 200 tokens", got)
	}

	// When a rewrites its slots, Redis counts the one it holds, and a release frees it again
	if _, err := a.doResync(); err != nil {
		t.Fatal(err)
	}
	if got := held(t, rc, a, "c"); got["n:a"] != "1" || got["t:a"] != "100" {
		t.Errorf("Redis counts %v for a after its rewrite, want its 1 slot and 100 tokens", got)
	}
	a.Settle(second, 100, []Window{w})
	waitFor(t, "the slot to be freed", func() bool { return len(held(t, rc, a, "c")) == 0 })
}

// A release sent in a call whose answer was lost may be applied by Redis at any moment: the part
// a replica cut off computes does not count its slot as one the others still count.
func TestAReleaseWhoseAnswerWasLostIsNotCountedAsUnsent(t *testing.T) {
	rd := redistest.Standalone(t)
	o := options(rd.Addr(), "lostrel", "a")
	o.Heartbeat, o.WriteTimeout = time.Hour, 100*time.Millisecond
	a := open(t, o)
	sl := Slot{Name: "c", Max: 5}
	id := a.NextLease()
	wantStatus(t, admit(t, a, &Admission{Lease: id, Slots: []Slot{sl}}), Admitted, 0)

	// Given Redis hangs while the release is sent
	rd.Pause(0)
	defer rd.Resume()
	a.Settle(id, 0, nil)
	// Then, its answer lost, the release stays queued, not counted as one Redis has not seen
	waitFor(t, "the release's answer to be lost", func() bool {
		e := a.LastError()
		return e != nil && e.Op == "settle"
	})
	if pending(a) != 1 {
		t.Fatalf("%d settlements queued after the release's answer was lost, want 1", pending(a))
	}
	if got := a.Unsent()["c"]; got != [2]int64{} {
		t.Errorf("a counts %v unsent for a release whose answer was lost, want none", got)
	}
	rd.Resume()
	waitFor(t, "the release to be sent", func() bool { return pending(a) == 0 })
}

// A heartbeat confirms only the waits its replica had heard of when it took its view: one sent
// before another replica's rewrite started a wait (and run late, after it) says nothing of what
// its replica admitted alone since it was sent.
func TestAHeartbeatConfirmsOnlyTheWaitsItHeardOf(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	ctx := context.Background()
	o := options(rd.Addr(), "heard", "b")
	o.Heartbeat = time.Hour
	b := open(t, o)
	// Given replica z, registered (its heartbeats are sent by hand below)
	now, err := rc.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.ZAdd(ctx, b.keys.replicas, redis.Z{Score: float64(now.Add(time.Minute).UnixMilli()), Member: "z"}).Err(); err != nil {
		t.Fatal(err)
	}
	epoch, err := rc.HGet(ctx, b.keys.epoch, "id").Result()
	if err != nil {
		t.Fatal(err)
	}
	wait := func() (p, g int64, x string) {
		v, err := rc.HMGet(ctx, b.keys.epoch, "p", "g", "x:z").Result()
		if err != nil {
			t.Fatal(err)
		}
		p, _ = strconv.ParseInt(str(v[0]), 10, 64)
		g, _ = strconv.ParseInt(str(v[1]), 10, 64)
		return p, g, str(v[2])
	}
	_, before, _ := wait()
	// When b rewrites its slots as a replica cut off, the epoch waits for z
	b.lost("test", causeExpired)
	waitFor(t, "b to wait for z", func() bool { _, _, x := wait(); return x != "" })
	_, g, _ := wait()
	beat := func(heard int64) {
		t.Helper()
		keys := []string{b.keys.replicas, b.tag + ":l:z", b.tag + ":rc:z", b.keys.seq, b.keys.epoch}
		if err := b.heartbeat.Run(ctx, rc, keys, "z", time.Minute.Milliseconds(), b.keys.channel, b.tag, epoch, "1", 0, 0, heard).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// Then z's heartbeat taken before it heard of the wait does not confirm it
	beat(before)
	if _, _, x := wait(); x == "" {
		t.Fatalf("a heartbeat that had heard of wait %d confirmed wait %d", before, g)
	}
	// And one taken after does
	beat(g)
	if _, _, x := wait(); x != "" {
		t.Fatalf("a heartbeat that had heard of wait %d did not confirm it", g)
	}
}
