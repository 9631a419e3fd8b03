package cluster

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// scriptsLoaded reports whether Redis holds every script a store in that admission mode runs.
func scriptsLoaded(t *testing.T, rc *redis.Client, leased bool) bool {
	t.Helper()
	var shas []string
	for _, src := range scriptSources(leased) {
		shas = append(shas, redis.NewScript(src).Hash())
	}
	ok, err := rc.ScriptExists(context.Background(), shas...).Result()
	if err != nil {
		return false
	}
	for _, b := range ok {
		if !b {
			return false
		}
	}
	return true
}

// evals returns how many scripts Redis was sent whole (EVAL) since its statistics were reset.
func evals(t *testing.T, rc *redis.Client) string {
	t.Helper()
	info, err := rc.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(info, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_eval:"); ok {
			return strings.Split(rest, ",")[0]
		}
	}
	return "calls=0"
}

// burst runs 64 admissions at once and settles them.
func burst(t *testing.T, s *Store) {
	t.Helper()
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			a := &Admission{Lease: s.NextLease(), Slots: []Slot{{Name: "chat", Max: 1000}},
				Windows: []Window{{Name: "chat", Kind: "tpm", Length: time.Minute, Capacity: 1e9, Amount: 10}}}
			var r Result
			if err := s.Admit(context.Background(), a, &r); err != nil {
				t.Error(err)
				return
			}
			s.Settle(a.Lease, 10, a.Windows)
		})
	}
	wg.Wait()
}

// TestStorePreparesBeforeAvailable: a store is available only once Redis holds every script it
// runs and its connection pool is open, so that a burst of admissions right after start sends no
// script whole (NOSCRIPT, then the script) and opens no connection on the requests' path; and so
// again after Redis restarted empty.
func TestStorePreparesBeforeAvailable(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	s := open(t, options(rd.Addr(), "prep", "a"))
	check := func(when string) {
		t.Helper()
		if !scriptsLoaded(t, rc, false) {
			t.Errorf("%s: the store is available before Redis holds its scripts", when)
		}
		// Warming is best effort (a ping that ends before the last starts lets it reuse a
		// connection), so a loaded machine may leave a few connections to the burst: most of
		// the pool is open, and the burst opens few.
		size := uint32(s.client.(*redis.Client).Options().PoolSize)
		if n := s.client.PoolStats().TotalConns; n < size/2 {
			t.Errorf("%s: %d connections open, want most of the pool's %d", when, n, size)
		}
		if err := rc.ConfigResetStat(context.Background()).Err(); err != nil {
			t.Fatal(err)
		}
		misses := s.client.PoolStats().Misses
		burst(t, s)
		if got := evals(t, rc); got != "calls=0" {
			t.Errorf("%s: a burst of admissions sent scripts whole: EVAL %s", when, got)
		}
		if n := s.client.PoolStats().Misses - misses; n > size/4 {
			t.Errorf("%s: a burst of admissions opened %d connections", when, n)
		}
	}
	check("after start")

	rd.Restart()
	// The store finds Redis empty at its next heartbeat (or admission), and registers again.
	waitFor(t, "the store to register in the restarted Redis", func() bool {
		n, err := rc.Exists(context.Background(), s.keys.epoch).Result()
		return err == nil && n == 1 && s.Available()
	})
	check("after Redis restarted empty")
}

// TestStoreReloadsFlushedScripts: Redis losing its scripts but not its state (SCRIPT FLUSH, a
// failover to a replica that never loaded them) costs one call sent whole, after which the
// store loads every script again.
func TestStoreReloadsFlushedScripts(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	s := open(t, options(rd.Addr(), "flush", "a"))
	if err := rc.ScriptFlush(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	admit(t, s, &Admission{Slots: []Slot{{Name: "chat", Max: 10}}})
	waitFor(t, "the scripts to be loaded again", func() bool { return scriptsLoaded(t, rc, false) })
}

// TestLeasedStoreLoadsLeaseScripts: with leased admission the scripts loaded ahead are the lease
// rounds'.
func TestLeasedStoreLoadsLeaseScripts(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	o := options(rd.Addr(), "leased", "a")
	o.Leased = true
	open(t, o)
	if !scriptsLoaded(t, rc, true) {
		t.Fatal("the store is available before Redis holds the lease scripts")
	}
}

// TestStoreRegistersWhenRedisRefusesToPrepare: an ACL that allows the scripts but not PING or
// SCRIPT LOAD leaves a store to send each script whole on its first call: it registers all the
// same, and admits through Redis.
func TestStoreRegistersWhenRedisRefusesToPrepare(t *testing.T) {
	rd := redistest.Standalone(t)
	if _, err := rd.Do("ACL", "SETUSER", "scripts-only", "on", ">pw", "~*", "&*", "+@all", "-ping", "-script"); err != nil {
		t.Fatal(err)
	}
	o := options(rd.Addr(), "acl", "a")
	o.Username, o.Password = "scripts-only", "pw"
	s := open(t, o)
	var r Result
	a := &Admission{Lease: s.NextLease(), Slots: []Slot{{Name: "f", Max: 2}}}
	if err := s.Admit(context.Background(), a, &r); err != nil || r.Status != Admitted {
		t.Fatalf("admission with scripts sent whole: %+v, %v", r, err)
	}
}

// TestLeasedStoreKeepsFewConnections: a leased replica calls Redis only from its loops, so it
// opens a pool of 8 connections per node, not the exact store's 32 or more: a fleet of 30
// replicas keeps 240 connections on each node instead of about 1 000.
func TestLeasedStoreKeepsFewConnections(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	o := options(rd.Addr(), "fewconns", "a")
	o.Leased = true
	s := open(t, o)
	waitFor(t, "the leased store to register", s.Available)
	if n := s.client.PoolStats().TotalConns; n == 0 || n > leasedPool {
		t.Errorf("a leased replica opened %d connections, want at most %d", n, leasedPool)
	}
	list, err := rc.ClientList(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	// This test's own connection and the store's subscription besides.
	if n := strings.Count(list, "\n"); n > leasedPool+3 {
		t.Errorf("Redis lists %d clients with one leased replica connected, want at most %d", n, leasedPool+3)
	}
}
