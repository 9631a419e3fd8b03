package policy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

const leasedPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 4, max_wait: 5s}
  batch: {max_concurrent: 50, requests_per_minute: 30}
  default: {max_concurrent: 10}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
cluster:
  backend: redis
  addresses: [%q]
  replica_id: %s
  key_prefix: %s
  admission: leased
  lease_interval: 20ms
  timeout: 200ms
  lease_ttl: 2s
  heartbeat: 250ms
`

// leasedEngine starts a replica with leased admission on the Redis at addr, and waits until
// its leases can grow (a new deployment's compartments recover first, a few lease intervals).
func leasedEngine(t *testing.T, addr, id, prefix string) *policy.Engine {
	t.Helper()
	p, err := config.Load("leased.yaml", []byte(fmt.Sprintf(leasedPolicy, addr, id, prefix)), nil)
	if err != nil {
		t.Fatalf("policy:\n%v", err)
	}
	e, err := policy.NewEngine(p, policy.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Cluster: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	waitFor(t, "the shared state to be available to "+id, func() bool { return e.Cluster().Available() })
	waitFor(t, "leases to grow on "+id, func() bool {
		d := admitWaiting(e, feature("default"), 1, time.Second)
		return d.Verdict == policy.Admit
	})
	return e
}

func TestLeasedConcurrencyNeverAboveTheFleetLimit(t *testing.T) {
	rd := redistest.Standalone(t)
	engines := []*policy.Engine{leasedEngine(t, rd.Addr(), "a", "lc"), leasedEngine(t, rd.Addr(), "b", "lc"), leasedEngine(t, rd.Addr(), "c", "lc")}
	var running, peak atomic.Int64
	var admitted [3]atomic.Int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(1500 * time.Millisecond)
	for i, e := range engines {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(deadline) {
					d, tk := admit(t, e, feature("chat"), 10)
					if d.Verdict != policy.Admit {
						continue
					}
					// Sampled at every admission: the fleet's chat requests in flight.
					n := running.Add(1)
					for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
					}
					admitted[i].Add(1)
					time.Sleep(2 * time.Millisecond)
					running.Add(-1)
					chatDone(tk, 10)
				}
			}()
		}
	}
	wg.Wait()
	if p := peak.Load(); p > 4 {
		t.Fatalf("%d chat requests ran at once across the fleet, limit 4", p)
	}
	for i := range engines {
		if admitted[i].Load() == 0 {
			t.Errorf("replica %d admitted no chat request while it asked all along", i)
		}
	}
	t.Logf("peak %d; admitted %d, %d, %d", peak.Load(), admitted[0].Load(), admitted[1].Load(), admitted[2].Load())
}

func TestLeasedRateNeverAboveTheFleetWindow(t *testing.T) {
	rd := redistest.Standalone(t)
	engines := []*policy.Engine{leasedEngine(t, rd.Addr(), "a", "lr"), leasedEngine(t, rd.Addr(), "b", "lr")}
	var admitted, refused atomic.Int64
	var wg sync.WaitGroup
	for _, e := range engines {
		for range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 40 {
					d, tk := admit(t, e, feature("batch"), 10)
					if d.Verdict == policy.Admit {
						admitted.Add(1)
						chatDone(tk, 10)
						continue
					}
					if d.Reason != policy.ReasonRateLimit {
						t.Errorf("refused for %s, want rate_limit", d.Reason)
						return
					}
					refused.Add(1)
				}
			}()
		}
	}
	wg.Wait()
	// 240 requests within well under a minute against 30 a minute for the fleet.
	if n := admitted.Load(); n > 30 || n < 25 {
		t.Fatalf("%d batch requests admitted against a fleet window of 30 a minute (want at most 30, and nearly all of it)", n)
	}
}

const leaseGivebackPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  tenant:
    default: anyone
    rules: [{header: x-tenant-id, trusted: true}]
  tier:
    rules: [{tenant_directory: true}]
tenants:
  default_tier: wide
  directory:
    - {id: narrow, tier: narrow}
tiers:
  narrow: {max_concurrent: 3, max_wait: 1s}
  wide: {max_concurrent: 20, max_wait: 1s}
features:
  narrow: {max_concurrent: 2, max_wait: 1s}
  wide: {max_concurrent: 20, max_wait: 1s}
  default: {max_concurrent: 10}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
cluster:
  backend: redis
  addresses: [%q]
  replica_id: %s
  key_prefix: giveback
  admission: leased
  lease_interval: 50ms
  timeout: 200ms
  lease_ttl: 2s
  heartbeat: 250ms
`

// A request needs a slot in each of its compartments. Whichever of them is short on a replica
// while another replica holds slots there that it does not use, those come back within a
// report or two of each replica: the request is admitted within its max_wait, after a report of
// its own replica at once and its next regular one, and one or two of the other's.
func TestLeasedHolderGivesBackWhicheverCompartmentIsShort(t *testing.T) {
	for _, c := range []struct{ name, feature, tenant string }{
		{"the first short", "narrow", "wide"},
		{"the second short", "wide", "narrow"},
		{"both short", "narrow", "narrow"},
	} {
		t.Run(c.name, func(t *testing.T) {
			rd := redistest.Standalone(t)
			start := func(id string) *policy.Engine {
				e := clusterEngine(t, fmt.Sprintf(leaseGivebackPolicy, rd.Addr(), id))
				waitFor(t, "the shared state to be available to "+id, func() bool { return e.Cluster().Available() })
				waitFor(t, "leases to grow on "+id, func() bool {
					return admitWaiting(e, feature("default"), 1, time.Second).Verdict == policy.Admit
				})
				return e
			}
			a, b := start("a"), start("b")
			in := input{headers: map[string]string{"x-llm-feature": c.feature, "x-tenant-id": c.tenant}}
			// Given b holds one request, and leases of both compartments that leave a no room
			// in the narrow ones (2 of feature/narrow's 2 slots, 3 of tenant/narrow's 3)
			d, held := admit(t, b, in, 10)
			if d.Verdict != policy.Admit {
				t.Fatalf("b: %+v", d)
			}
			defer chatDone(held, 10)
			narrow := map[string]int64{}
			if c.feature == "narrow" {
				narrow["feature/narrow"] = 2
			}
			if c.tenant == "narrow" {
				narrow["tenant/narrow"] = 3
			}
			waitFor(t, "b's leases of the narrow compartments to hold their limits", func() bool {
				for _, l := range b.ClusterLeases() {
					if lim, ok := narrow[l.Compartment]; ok && l.Granted < lim {
						return false
					}
				}
				return true
			})
			// When a is asked for one
			roundsA, roundsB := countLeaseRounds(a), countLeaseRounds(b)
			d, tk := admit(t, a, in, 10)
			na, nb := roundsA(), roundsB()
			// Then it is admitted within its max_wait
			if d.Verdict != policy.Admit {
				t.Fatalf("a refused the request after %d of its lease rounds and %d of b's (%s %s)\n  a: %s\n  b: %s", na, nb, d.Reason, d.Compartment, leaseView(a), leaseView(b))
			}
			chatDone(tk, 10)
			// And b gave back what it did not use at once (a report, or two when a's news came
			// during one), and a took it at its next report: a asked Redis once at once, then
			// at its regular rounds (counted: the rounds that ended before the admission, with
			// room for late ones on a loaded machine).
			if nb > 3 || na > 4 {
				t.Errorf("admitted after %d of a's lease rounds and %d of b's: want at most 4 and 3", na, nb)
			}
			t.Logf("admitted after %d of a's lease rounds and %d of b's", na, nb)
		})
	}
}

// countLeaseRounds counts e's rounds of lease reports until the returned function is called,
// which returns the count.
func countLeaseRounds(e *policy.Engine) func() int {
	stop := make(chan struct{})
	var n atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-policy.NextLeaseRound(e):
				n.Add(1)
			case <-stop:
				return
			}
		}
	}()
	return func() int {
		close(stop)
		<-done
		return int(n.Load())
	}
}

// leaseView describes e's leases of the feature and tenant compartments.
func leaseView(e *policy.Engine) string {
	var b strings.Builder
	for _, l := range e.ClusterLeases() {
		if strings.HasPrefix(l.Compartment, "feature/") || strings.HasPrefix(l.Compartment, "tenant/") {
			fmt.Fprintf(&b, "%s %d of %d granted, contended %v; ", l.Compartment, l.Slots, l.Granted, l.Contended)
		}
	}
	return b.String()
}

// TestLeasedWindowSlowRoundIsUnavailableNotRefused: a request short of a window's chunk asks for
// a round; when Redis answers none within cluster.timeout, Redis is slow, which says nothing of
// the window's room: the request is admitted against this replica's share of the window, as
// on_unavailable (local) says, instead of refused rate_limit because an earlier round answered.
func TestLeasedWindowSlowRoundIsUnavailableNotRefused(t *testing.T) {
	rd := redistest.Standalone(t)
	e := leasedEngine(t, rd.Addr(), "a", "slowwin")
	// batch's 30 a minute is leased one request at a time: each request needs a round.
	d, tk := admit(t, e, feature("batch"), 10)
	if d.Verdict != policy.Admit {
		t.Fatalf("the first batch request: %+v", d)
	}
	chatDone(tk, 10)
	// Redis busy for half a second (a slow command, a loaded host): it answers the round, but
	// after cluster.timeout (200 ms), while the last round before got its answer.
	slept := make(chan error, 1)
	go func() {
		_, err := rd.Do("EVAL", `local t0 = redis.call('TIME')
while true do
  local t = redis.call('TIME')
  if (t[1] - t0[1]) * 1000000 + t[2] - t0[2] > 500000 then return 0 end
end`, "0")
		slept <- err
	}()
	time.Sleep(50 * time.Millisecond)
	d, tk = admit(t, e, feature("batch"), 10)
	if err := <-slept; err != nil {
		t.Fatal(err)
	}
	if d.Verdict != policy.Admit {
		t.Fatalf("a batch request while Redis answers no round in time: %v (%s); want admitted against this replica's share", d.Verdict, d.Reason)
	}
	chatDone(tk, 10)
}
