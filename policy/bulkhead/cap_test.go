package bulkhead_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
)

// takeN takes n slots of one token each in c, failing the test if one is refused.
func takeN(t *testing.T, s *bulkhead.Scheduler, c *bulkhead.Compartment, n int64) [][]int64 {
	t.Helper()
	var out [][]int64
	for range n {
		held := make([]int64, 1)
		if !s.TryAcquire([]*bulkhead.Compartment{c}, held, want(1, "t", 0)) {
			t.Fatalf("%s refused a slot with %d of its limit held", c.Name(), len(out))
		}
		out = append(out, held)
	}
	return out
}

// queueOne queues a request for a slot in c and returns, once it waits, what it ends with.
func queueOne(t *testing.T, s *bulkhead.Scheduler, c *bulkhead.Compartment) <-chan error {
	got := make(chan error, 1)
	go func() {
		_, err := acquire(t, s, context.Background(), want(1, "t", 10*time.Second), c)
		got <- err
	}()
	for s.Stats(c).Queued == 0 {
		time.Sleep(time.Millisecond)
	}
	return got
}

// TestCapKeepsToThePart: a compartment capped to this replica's part admits only up to it (its
// own slots, as the others count them, plus an equal part of the room free), reports the part
// as its limit, and admits its waiters as soon as the cap is lifted.
func TestCapKeepsToThePart(t *testing.T) {
	s := &bulkhead.Scheduler{}
	c := bulkhead.NewCompartment("feature/chat", bulkhead.Limits{MaxConcurrent: 10, MaxInflightTokens: 100, QueueDepth: 10})
	held := takeN(t, s, c, 2)
	// The three replicas held 6 in all (2 here): 4 are free, one third of them is this one's.
	slots, tokens := s.Cap(c, bulkhead.Share{Gen: 7, Replicas: 3, Slots: true, Totals: 6, TotalTokens: 60, ForgetRemote: true})
	if slots != 3 || tokens != 2+(100-60)/3 {
		t.Fatalf("cap %d slots, %d tokens; want 3 and %d", slots, tokens, 2+(100-60)/3)
	}
	// Released slots the others still count (their releases not sent) stay this replica's.
	other := bulkhead.NewCompartment("feature/other", bulkhead.Limits{MaxConcurrent: 10})
	if slots, _ := s.Cap(other, bulkhead.Share{Gen: 7, Replicas: 3, Slots: true, Totals: 10, Lag: 6}); slots != 6 {
		t.Errorf("a replica the others count as holding 6, holding none, may hold %d, want 6", slots)
	}
	st := s.Stats(c)
	if !st.Capped || st.Limits.MaxConcurrent != 3 || st.Limits.MaxInflightTokens != 15 {
		t.Errorf("stats %+v, want the part as the limits in force", st)
	}
	// A second cap for the same episode changes nothing, whatever it says.
	if slots, _ := s.Cap(c, bulkhead.Share{Gen: 7, Replicas: 1, Slots: true}); slots != 3 {
		t.Errorf("capped again for the same episode: %d slots", slots)
	}
	if g := s.CapGen(c); g != 7 {
		t.Errorf("CapGen = %d, want 7", g)
	}
	held = append(held, takeN(t, s, c, 1)...)
	if s.TryAcquire([]*bulkhead.Compartment{c}, make([]int64, 1), want(1, "t", 0)) {
		t.Fatal("a fourth slot was taken beyond the part of 3")
	}
	// A waiter gets in once the cap is lifted.
	got := queueOne(t, s, c)
	s.Uncap(c)
	if err := <-got; err != nil {
		t.Fatalf("the waiter after the cap was lifted: %v", err)
	}
	if st := s.Stats(c); st.Capped || st.Limits.MaxConcurrent != 10 || s.CapGen(c) != 0 {
		t.Errorf("after Uncap: %+v", st)
	}
	for _, h := range held {
		release(s, h, c)
	}
}

// TestCapPartsNeverAddUpToMoreThanTheLimit: whatever the replicas held when they stopped
// counting each other's slots (their sum within the limit), and however many of their slots
// ended before each noticed (the others still count them), the parts add up to the limit at
// most, and each part is at least what the replica was counted as holding.
func TestCapPartsNeverAddUpToMoreThanTheLimit(t *testing.T) {
	rng := rand.New(rand.NewPCG(36, 5))
	for range 2000 {
		n := 1 + rng.IntN(5)
		limit := int64(1 + rng.IntN(40))
		// seen[i]: what the shared state counted for replica i; now[i] ≤ seen[i]: what it
		// holds when it notices (the rest ended, their releases not sent).
		seen := make([]int64, n)
		var total int64
		for i := range seen {
			seen[i] = rng.Int64N(limit - total + 1)
			total += seen[i]
		}
		var bound int64
		for i := range n {
			now := rng.Int64N(seen[i] + 1)
			s := &bulkhead.Scheduler{}
			c := bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: limit})
			takeN(t, s, c, now)
			part, _ := s.Cap(c, bulkhead.Share{Gen: 1, Replicas: int64(n), Slots: true, Totals: total, Lag: seen[i] - now, ForgetRemote: true})
			if part < seen[i] {
				t.Fatalf("a replica counted as holding %d got a part of %d", seen[i], part)
			}
			bound += part
		}
		if bound > limit {
			t.Fatalf("%d replicas, limit %d, counted %v: the parts let them hold %d", n, limit, seen, bound)
		}
	}
}

// TestNarrowCapKeepsToItsOwnSlotsUntilWidened: a replica that may be cut off alone (the others
// still count on the shared state, and take the room it finds free) keeps to the slots the others
// count for it; once the shared state is known gone for every replica, Widen gives it its share
// of the free room, computed when it was cut off, and its waiters go at once.
func TestNarrowCapKeepsToItsOwnSlotsUntilWidened(t *testing.T) {
	s := &bulkhead.Scheduler{}
	c := bulkhead.NewCompartment("feature/chat", bulkhead.Limits{MaxConcurrent: 10, MaxInflightTokens: 100, QueueDepth: 10})
	held := takeN(t, s, c, 2)
	// The three replicas held 4 in all (2 here, 1 release not sent): 6 are free.
	slots, tokens := s.Cap(c, bulkhead.Share{Gen: 3, Replicas: 3, Slots: true, Totals: 4, TotalTokens: 40, Lag: 1, LagTokens: 1, ForgetRemote: true, Narrow: true})
	if slots != 3 || tokens != 3 {
		t.Fatalf("narrow cap %d slots, %d tokens; want the 3 and 3 the others count", slots, tokens)
	}
	held = append(held, takeN(t, s, c, 1)...)
	if s.TryAcquire([]*bulkhead.Compartment{c}, make([]int64, 1), want(1, "t", 0)) {
		t.Fatal("a slot was taken beyond the 3 the others count for this replica")
	}
	got := queueOne(t, s, c)
	// Widening for another episode changes nothing; for this one, the part is 3 + 6/3.
	s.Widen(c, 4)
	if st := s.Stats(c); st.Limits.MaxConcurrent != 3 {
		t.Fatalf("widened for another episode: limit in force %d", st.Limits.MaxConcurrent)
	}
	s.Widen(c, 3)
	if err := <-got; err != nil {
		t.Fatalf("the waiter once widened: %v", err)
	}
	if st := s.Stats(c); st.Limits.MaxConcurrent != 5 || st.Limits.MaxInflightTokens != 3+(100-40)/3 {
		t.Errorf("widened: limits in force %+v, want 5 slots and %d tokens", st.Limits, 3+(100-40)/3)
	}
	s.Uncap(c)
	for _, h := range held {
		release(s, h, c)
	}
}

// TestTightenNeverRaisesThePart: cut off again before the episode ended, a replica keeps to the
// lower of its part and the part computed from what the shared state counts now (the others may
// have taken what its first part left them); it never gets more than its first part.
func TestTightenNeverRaisesThePart(t *testing.T) {
	s := &bulkhead.Scheduler{}
	c := bulkhead.NewCompartment("feature/chat", bulkhead.Limits{MaxConcurrent: 10})
	held := takeN(t, s, c, 1)
	if slots, _ := s.Cap(c, bulkhead.Share{Gen: 5, Replicas: 2, Slots: true, Totals: 5}); slots != 1+5/2 {
		t.Fatalf("first part %d, want %d", slots, 1+5/2)
	}
	// Now the others hold 8 of the 10: the part is 1 + 1/2.
	if slots, _ := s.Cap(c, bulkhead.Share{Gen: 5, Replicas: 2, Slots: true, Totals: 9, Tighten: true}); slots != 1 {
		t.Errorf("tightened with the others holding 8: %d slots, want 1", slots)
	}
	// With everything free again it stays at most the first part.
	if slots, _ := s.Cap(c, bulkhead.Share{Gen: 5, Replicas: 1, Slots: true, Totals: 1, Tighten: true}); slots != 1 {
		t.Errorf("tightened with the room free: %d slots, want 1 (never more than before)", slots)
	}
	s.Widen(c, 5)
	if slots := s.Stats(c).Limits.MaxConcurrent; slots != 1 {
		t.Errorf("widened after tightening: %d slots, want 1", slots)
	}
	s.Uncap(c)
	for _, h := range held {
		release(s, h, c)
	}
}
