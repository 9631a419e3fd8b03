package cluster

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// TestShareQuota: replicas share a provider account's latest reading and what their requests in
// flight hold; an earlier reading never replaces a later one, a replica's holdings stop counting
// lease_ttl after its last call, and a hash that is not one, or that was flooded, is rebuilt
// instead of failing every call.
func TestShareQuota(t *testing.T) {
	rd := redistest.Standalone(t)
	a := open(t, options(rd.Addr(), "pq", "a"))
	b := open(t, options(rd.Addr(), "pq", "b"))
	now := time.Now()
	ms := now.UnixMilli()
	reset := now.Add(time.Minute).UnixMilli()

	// a read 5 of 10 requests left and holds 2 in flight; b knows nothing and holds 1.
	if _, err := a.ShareQuota("openai", "", []QuotaShare{{At: ms, Limit: 10, Remaining: 5, Reset: reset, Pending: 2}, {}}, now); err != nil {
		t.Fatal(err)
	}
	got, err := b.ShareQuota("openai", "", []QuotaShare{{Pending: 1}, {}}, now)
	if err != nil {
		t.Fatal(err)
	}
	if want := (QuotaShare{At: ms, Limit: 10, Remaining: 5, Reset: reset, Pending: 2}); got[0] != want || got[1] != (QuotaShare{}) {
		t.Fatalf("b got %+v, want %+v and nothing of the second quota", got, want)
	}
	// b's earlier reading does not replace a's; a sees b's holding.
	got, err = b.ShareQuota("openai", "", []QuotaShare{{At: ms - 1000, Limit: 10, Remaining: 9, Reset: reset, Pending: 1}, {}}, now)
	if err != nil || got[0].Remaining != 5 {
		t.Fatalf("after an earlier reading: %+v %v", got, err)
	}
	if got, err = a.ShareQuota("openai", "", []QuotaShare{{At: ms, Limit: 10, Remaining: 5, Reset: reset, Pending: 2}, {}}, now); err != nil || got[0].Pending != 1 {
		t.Fatalf("a: %+v %v, want b's 1 request in flight", got, err)
	}
	// Past lease_ttl without a call from a, its holdings no longer count for b.
	later := now.Add(time.Minute + time.Second)
	if got, err = b.ShareQuota("openai", "", []QuotaShare{{Pending: 1}, {}}, later); err != nil || got[0].Pending != 0 {
		t.Fatalf("b after a went silent: %+v %v, want nothing held elsewhere", got, err)
	}

	// Hostile contents: a string over the hash, then a flood of fake replicas.
	key := "{pq|pq:openai}:pq"
	if _, err := rd.Do("SET", key, "x"); err != nil {
		t.Fatal(err)
	}
	if got, err = a.ShareQuota("openai", "", []QuotaShare{{At: ms, Limit: 10, Remaining: 4, Reset: reset, Pending: 1}, {}}, now); err != nil || got[0].Remaining != 4 {
		t.Fatalf("over a string: %+v %v", got, err)
	}
	ctx := context.Background()
	rc := inspect(t, rd.Addr())
	for i := range 5000 {
		rc.HSet(ctx, key, fmt.Sprintf("p:fake%d", i), fmt.Sprintf("%d,1000000", now.Add(time.Hour).UnixMilli()))
	}
	if got, err = b.ShareQuota("openai", "", []QuotaShare{{Pending: 0}, {}}, now); err != nil || got[0].Pending != 0 {
		t.Fatalf("after a flood of fake replicas: %+v %v, want the flood dropped", got, err)
	}
	// One fake replica that never expires holds nothing either.
	rc.HSet(ctx, key, "p:forever", fmt.Sprintf("%d,1000000", now.Add(24*time.Hour).UnixMilli()))
	if got, err = b.ShareQuota("openai", "", []QuotaShare{{Pending: 0}, {}}, now); err != nil || got[0].Pending != 0 {
		t.Fatalf("with an entry set to expire in a day: %+v %v, want it dropped", got, err)
	}
	if n, _ := rc.HLen(ctx, key).Result(); n > 10 {
		t.Fatalf("the flooded hash still has %d fields", n)
	}
}

// TestShareQuotaPerAccount: each account of a provider is shared apart from the others and from
// the provider's one-account quota, in the provider's hash slot whatever the account holds
// (braces included: they never reach the hash tag).
func TestShareQuotaPerAccount(t *testing.T) {
	rd := redistest.Standalone(t)
	a := open(t, options(rd.Addr(), "pqa", "a"))
	b := open(t, options(rd.Addr(), "pqa", "b"))
	now := time.Now()
	ms := now.UnixMilli()
	reset := now.Add(time.Minute).UnixMilli()
	for i, account := range []string{"team-a", "}{x}", ""} {
		mine := []QuotaShare{{At: ms, Limit: 10, Remaining: int64(i), Reset: reset, Pending: 1}}
		if _, err := a.ShareQuota("openai", account, mine, now); err != nil {
			t.Fatal(err)
		}
	}
	for i, account := range []string{"team-a", "}{x}", ""} {
		got, err := b.ShareQuota("openai", account, []QuotaShare{{}}, now)
		if err != nil || got[0].Remaining != int64(i) || got[0].Pending != 1 {
			t.Errorf("account %q at b: %+v %v, want %d left and 1 held at a", account, got, err, i)
		}
	}
	ctx := context.Background()
	keys, err := inspect(t, rd.Addr()).Keys(ctx, "*pq:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	want := []string{"{pqa|pq:openai}:pq", "{pqa|pq:openai}:pq:a:team-a", "{pqa|pq:openai}:pq:a:}{x}"}
	if !slices.Equal(keys, want) {
		t.Errorf("keys %q, want %q", keys, want)
	}
}
