package policy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
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
