package quota

import (
	"fmt"
	"sync"
	"testing"
)

// TestAccountsKeepEachAccountsQuota: two accounts at one provider: the one whose response said
// nothing is left refuses, the other still admits; the same account always finds its tracker.
func TestAccountsKeepEachAccountsQuota(t *testing.T) {
	a := NewAccounts(64)
	teamA, _, _ := a.Tracker("team-a")
	teamB, _, _ := a.Tracker("team-b")
	if teamA == teamB {
		t.Fatal("two accounts share one tracker")
	}
	resA, _, ok := teamA.Reserve(Need{}, 0, false, t0)
	if !ok {
		t.Fatal("team-a before any reading")
	}
	r := read(t, t0, "x-ratelimit-limit-requests", "10", "x-ratelimit-remaining-requests", "0", "x-ratelimit-reset-requests", "30s")
	teamA.Observe(&resA, &r, t0)

	again, _, _ := a.Tracker("team-a")
	if _, v, ok := again.Reserve(Need{}, 0, false, t0); ok || v.Kind != Requests {
		t.Errorf("team-a with 0 requests left: admitted %v (%+v)", ok, v)
	}
	if _, _, ok := teamB.Reserve(Need{}, 0, false, t0); !ok {
		t.Error("team-b, whose responses said nothing, refused")
	}
	if names := accountNames(a); fmt.Sprint(names) != "[team-a team-b]" {
		t.Errorf("accounts %v", names)
	}
}

// TestAccountsBeyondMaxShareOther: accounts beyond max share OtherAccount's tracker, reported
// once; a known account keeps its own.
func TestAccountsBeyondMaxShareOther(t *testing.T) {
	a := NewAccounts(2)
	a.Tracker("a")
	a.Tracker("b")
	c, other, first := a.Tracker("c")
	if !other || !first {
		t.Fatalf("third account of two: other %v, first %v", other, first)
	}
	d, other, first := a.Tracker("d")
	if !other || first || d != c {
		t.Fatalf("fourth account: other %v, first %v, same tracker as the third %v", other, first, d == c)
	}
	if _, other, _ := a.Tracker("a"); other {
		t.Error("a known account lost its tracker")
	}
	if names := accountNames(a); fmt.Sprint(names) != "[_other a b]" {
		t.Errorf("accounts %v", names)
	}
}

// accountNames names the accounts a tracks, in Each's order.
func accountNames(a *Accounts) []string {
	var names []string
	for _, acc := range a.Each() {
		names = append(names, acc.Name)
	}
	return names
}

// TestAccountsConcurrent: accounts found and created from many goroutines at once stay within
// max (run with -race).
func TestAccountsConcurrent(t *testing.T) {
	a := NewAccounts(8)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 100 {
				tr, _, _ := a.Tracker(fmt.Sprint((g + i) % 16))
				tr.Reserve(Need{Prompt: 1}, 0, false, t0)
			}
		})
	}
	wg.Wait()
	if n := len(a.Each()); n != 9 {
		t.Errorf("%d trackers, want 8 accounts and %s", n, OtherAccount)
	}
}
