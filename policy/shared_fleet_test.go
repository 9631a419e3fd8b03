package policy_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// A fleet of engines sharing one Redis, against the events that cost Redis its state or cut the
// replicas off it: the fleet must never hold more than a limit. Every admission samples the
// fleet's requests in flight (counted up once a request is admitted and down before it is
// released, so a sample never exceeds what the replicas really hold).

// clusterModes are the cluster admission modes the fleet tests run in: one script in Redis per
// admission ("exact"), and leases of every compartment's limits ("leased").
var clusterModes = []string{"exact", "leased"}

// modeSection returns the cluster keys that select mode.
func modeSection(t *testing.T, mode string) string {
	t.Helper()
	switch mode {
	case "exact":
		return "  admission: exact\n"
	case "leased":
		return "  admission: leased\n  lease_interval: 20ms\n"
	}
	t.Fatalf("unknown cluster admission mode %q", mode)
	return ""
}

// fleetLimit is chat's concurrency limit in fleetPolicy.
const fleetLimit = 10

const fleetPolicy = `
envoy: {max_message_timeout: 30s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 10, max_wait: 10s}
  default: {max_concurrent: 10}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
cluster:
  backend: redis
  addresses: [%q]
  replica_id: %s
  key_prefix: %s
  timeout: %s
  write_timeout: 500ms
  lease_ttl: %s
  heartbeat: %s
  on_unavailable: %s
`

// fleetOptions shape a fleet.
type fleetOptions struct {
	mode          string
	onUnavailable string
	// timeout is cluster.timeout.
	timeout time.Duration
	// leaseTTL and heartbeat are every replica's; slow names replicas whose heartbeat is 30 s
	// (lease_ttl 60 s).
	leaseTTL, heartbeat time.Duration
	slow                map[string]bool
}

// fleet is replicas a, b and c sharing chat's 10 slots.
type fleet struct {
	t       *testing.T
	rd      *redistest.Server
	engines []*policy.Engine
	names   []string

	prefix string

	// held counts the fleet's chat requests in flight; peak and overs are what admissions
	// found: the most held, and how many found more than the limit; firstOver describes the
	// fleet when the first did.
	held, peak, overs, admitted atomic.Int64
	firstOver                   atomic.Value
}

func startFleet(t *testing.T, rd *redistest.Server, prefix string, o fleetOptions) *fleet {
	t.Helper()
	f := &fleet{t: t, rd: rd, names: []string{"a", "b", "c"}, prefix: prefix}
	f.engines = make([]*policy.Engine, len(f.names))
	// Replicas with a slow heartbeat start last, once the others are registered: their first
	// registration is then when they learn the membership.
	order := []int{}
	for _, slow := range []bool{false, true} {
		for i, id := range f.names {
			if o.slow[id] == slow {
				order = append(order, i)
			}
		}
	}
	for _, i := range order {
		id := f.names[i]
		lease, beat := o.leaseTTL, o.heartbeat
		if o.slow[id] {
			lease, beat = time.Minute, 30*time.Second
		}
		e := clusterEngine(t, fmt.Sprintf(fleetPolicy, rd.Addr(), id, prefix, o.timeout, lease, beat, o.onUnavailable)+modeSection(t, o.mode))
		f.engines[i] = e
		waitFor(t, id+" to register", func() bool { return e.Cluster().Synced() })
	}
	for i, e := range f.engines {
		waitFor(t, f.names[i]+" to share its limits with every replica", func() bool {
			return e.Cluster().Synced() && e.Cluster().Live() == len(f.engines)
		})
	}
	return f
}

// try asks replica i for a chat slot, waiting at most wait, and returns the ticket if admitted.
func (f *fleet) try(i int, wait time.Duration) *policy.Ticket {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	e := f.engines[i]
	s := e.Snapshot()
	r := policy.Request{Dims: s.Classify(feature("chat")), Estimate: policy.Estimate{Total: 10, Prompt: 5, Output: 5}}
	tk := &policy.Ticket{}
	if d := e.Admit(ctx, s, &r, tk, nil); d.Verdict != policy.Admit {
		return nil
	}
	f.admitted.Add(1)
	n := f.held.Add(1)
	for p := f.peak.Load(); n > p && !f.peak.CompareAndSwap(p, n); p = f.peak.Load() {
	}
	if n > fleetLimit && f.overs.Add(1) == 1 {
		f.firstOver.Store(f.describe(fmt.Sprintf("%d held after an admission on %s", n, f.names[i])))
	}
	return tk
}

// describe says what every replica holds and knows, for a failure's message.
func (f *fleet) describe(what string) string {
	var b strings.Builder
	b.WriteString(what)
	for i, e := range f.engines {
		st := e.Cluster()
		in := st.Info(context.Background())
		fmt.Fprintf(&b, "\n  %s: available %v, synced %v, live %d, leases %d, queued %d, last error %+v", f.names[i], st.Available(), st.Synced(), st.Live(), in.Leases, in.Pending, in.LastError)
		for _, c := range e.Compartments() {
			if c.Name == "feature/chat" {
				fmt.Fprintf(&b, "; chat in flight %d of %d, others %d", c.InFlight, c.MaxConcurrent, c.RemoteInFlight)
			}
		}
	}
	if f.rd != nil {
		if out, err := f.rd.Do("HGETALL", "{"+f.prefix+"}:c:feature/chat"); err == nil {
			fmt.Fprintf(&b, "\n  in Redis: %q", out)
		}
	}
	return b.String()
}

// hold has replica i take n slots at once, failing the test if it cannot.
func (f *fleet) hold(i, n int) []*policy.Ticket {
	f.t.Helper()
	var out []*policy.Ticket
	for range n {
		tk := f.try(i, 5*time.Second)
		if tk == nil {
			f.t.Fatalf("%s could not take a slot (%d held in the fleet)", f.names[i], f.held.Load())
		}
		out = append(out, tk)
	}
	return out
}

// release ends requests: counted out before their slots are given back.
func (f *fleet) release(tks ...*policy.Ticket) {
	for _, tk := range tks {
		f.held.Add(-1)
		chatDone(tk, 10)
	}
}

// synced waits until every replica shares its limits again, counting every replica's slots.
func (f *fleet) synced() {
	f.t.Helper()
	for i, e := range f.engines {
		waitFor(f.t, f.names[i]+" to share its limits again", func() bool { return e.Cluster().Synced() })
	}
}

// assertNeverOver fails the test if an admission found the fleet over the limit.
func (f *fleet) assertNeverOver(what string) {
	f.t.Helper()
	if n := f.overs.Load(); n > 0 {
		first, _ := f.firstOver.Load().(string)
		f.t.Errorf("%s: %d admissions left the fleet holding more than %d chat slots (at most %d at once); the first: %s", what, n, fleetLimit, f.peak.Load(), first)
	}
}

// fleetEvent is something that happens to Redis: cut, then (when not nil) restore.
type fleetEvent struct {
	name          string
	cut, restore  func(rd *redistest.Server)
	slowA         bool // replica a's heartbeat is 30 s: only what the others do can make it rewrite its slots soon
	timeout       time.Duration
	leaseTTL, hbt time.Duration
}

var fleetEvents = []fleetEvent{
	{name: "flushall", slowA: true, timeout: time.Second, leaseTTL: 2 * time.Second, hbt: 250 * time.Millisecond,
		cut: func(rd *redistest.Server) { mustDo(rd, "FLUSHALL") }},
	{name: "restarted empty", timeout: time.Second, leaseTTL: 2 * time.Second, hbt: 250 * time.Millisecond,
		cut: func(rd *redistest.Server) { rd.Restart() }},
	{name: "paused", timeout: 20 * time.Millisecond, leaseTTL: 4 * time.Second, hbt: 500 * time.Millisecond,
		cut: func(rd *redistest.Server) { rd.Pause(0) }, restore: func(rd *redistest.Server) { rd.Resume() }},
	{name: "killed", timeout: time.Second, leaseTTL: 2 * time.Second, hbt: 250 * time.Millisecond,
		cut: func(rd *redistest.Server) { rd.Kill() }, restore: func(rd *redistest.Server) { rd.Restart() }},
}

func mustDo(rd *redistest.Server, args ...string) {
	if _, err := rd.Do(args...); err != nil {
		panic(fmt.Sprintf("redis %v: %v", args, err))
	}
}

// forFleetCases runs f for every admission mode, event and on_unavailable.
func forFleetCases(t *testing.T, f func(t *testing.T, mode string, ev fleetEvent, onUnavailable string)) {
	for _, mode := range clusterModes {
		for _, ev := range fleetEvents {
			for _, onUnavailable := range []string{config.OnUnavailableLocal, config.OnUnavailableClosed} {
				t.Run(mode+"/"+ev.name+"/"+onUnavailable, func(t *testing.T) { f(t, mode, ev, onUnavailable) })
			}
		}
	}
}

// TestFleetNeverExceedsALimitWhenRedisLosesItsState: a holds 8 of chat's 10 slots and b 2 when
// Redis loses its state, restarts, hangs or dies. Whatever order the replicas notice it in,
// rewrite their slots and come back in, no admission finds the fleet over 10: a replica cut off
// keeps to its part (its own slots plus an equal part of the room free when it was cut off,
// here none), and keeps to it after rewriting its slots until every replica has. Then the
// fleet admits its whole limit again: c gets a's 8 slots once a releases them, and no more.
func TestFleetNeverExceedsALimitWhenRedisLosesItsState(t *testing.T) {
	forFleetCases(t, func(t *testing.T, mode string, ev fleetEvent, onUnavailable string) {
		// Sixteen cases of a few seconds each, mostly waiting for replicas to notice an event,
		// each with a Redis of its own, run side by side; but not the paused ones, whose replicas
		// wait only 20 ms for Redis: alone, a busy machine's scheduling delays are least likely
		// to pass for a hung Redis before anything happened.
		if ev.name != "paused" {
			t.Parallel()
		}
		rd := redistest.Standalone(t)
		o := fleetOptions{mode: mode, onUnavailable: onUnavailable, timeout: ev.timeout, leaseTTL: ev.leaseTTL, heartbeat: ev.hbt}
		if ev.slowA {
			o.slow = map[string]bool{"a": true}
		}
		f := startFleet(t, rd, "lost", o)
		a := f.hold(0, 8)
		b := f.hold(1, 2)
		if tk := f.try(2, 100*time.Millisecond); tk != nil {
			t.Fatalf("c took an 11th slot before anything happened")
		}

		ev.cut(rd)
		t.Cleanup(rd.Resume) // a paused server must not outlive a failed test
		// b and c keep asking: noticing the event, rewriting their slots (or
		// enforcing their part alone), and coming back, each in its own time.
		var extra []*policy.Ticket
		for range 12 {
			for _, i := range []int{1, 2} {
				if tk := f.try(i, 50*time.Millisecond); tk != nil {
					extra = append(extra, tk)
				}
			}
			time.Sleep(50 * time.Millisecond)
		}
		if ev.restore != nil {
			ev.restore(rd)
		}
		f.synced()
		for range 3 {
			for i := range f.engines {
				if tk := f.try(i, 50*time.Millisecond); tk != nil {
					extra = append(extra, tk)
				}
			}
		}
		f.assertNeverOver(ev.name)

		// Every replica's slots are counted again: a's 8 go to c, and no more.
		f.release(a...)
		f.release(extra...)
		var got []*policy.Ticket
		for range 8 {
			if tk := f.try(2, 5*time.Second); tk != nil {
				got = append(got, tk)
			}
		}
		if tk := f.try(2, 100*time.Millisecond); tk != nil {
			got = append(got, tk)
		}
		f.assertNeverOver(ev.name + ", then a's slots released")
		if len(got) != 10-len(b) {
			t.Errorf("after a released its slots c got %d, want %d (b holds %d of 10)", len(got), 10-len(b), len(b))
		}
		f.release(got...)
		f.release(b...)
	})
}

// TestFleetNeverExceedsALimitUnderLoad: three replicas keep chat's 10 slots busy (6 workers
// each, holding a slot 20–80 ms) while Redis is flushed, restarted empty, paused or killed (and,
// the last two, brought back once every replica noticed), twice; every admission samples the
// fleet's requests in flight, and none finds more than 10. Requests are admitted again after
// each event.
func TestFleetNeverExceedsALimitUnderLoad(t *testing.T) {
	forFleetCases(t, func(t *testing.T, mode string, ev fleetEvent, onUnavailable string) {
		rd := redistest.Standalone(t)
		f := startFleet(t, rd, "load", fleetOptions{mode: mode, onUnavailable: onUnavailable, timeout: ev.timeout,
			leaseTTL: ev.leaseTTL, heartbeat: ev.hbt})
		var stop atomic.Bool
		var wg sync.WaitGroup
		for i := range f.engines {
			for w := range 6 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
					for !stop.Load() {
						if tk := f.try(i, 200*time.Millisecond); tk != nil {
							time.Sleep(time.Duration(20+rng.IntN(60)) * time.Millisecond)
							f.release(tk)
						}
					}
				})
			}
		}
		t.Cleanup(rd.Resume)
		for range 2 {
			waitFor(t, "admissions under load", func() bool { return f.admitted.Load() > 30 })
			ev.cut(rd)
			if ev.restore != nil {
				for i, e := range f.engines {
					waitFor(t, f.names[i]+" to notice", func() bool { return !e.Cluster().Available() })
				}
				time.Sleep(300 * time.Millisecond) // the replicas work on their own meanwhile
				ev.restore(rd)
			}
			f.synced()
			f.admitted.Store(0)
		}
		waitFor(t, "admissions under load after the last event", func() bool { return f.admitted.Load() > 30 })
		stop.Store(true)
		wg.Wait()
		f.assertNeverOver(ev.name + " under load")
		t.Logf("%s: at most %d of %d slots held at once", ev.name, f.peak.Load(), fleetLimit)
	})
}

// TestFleetShareFromTheStart: a replica that cannot reach Redis when it starts knows no other
// replica; with expected_replicas it enforces its part of each limit (10 / 3 → 3 slots) from
// its first request, not the whole limit.
func TestFleetShareFromTheStart(t *testing.T) {
	for _, mode := range clusterModes {
		t.Run(mode, func(t *testing.T) {
			addr := redistest.ClosedAddr(t)
			for _, c := range []struct {
				expected string
				want     int
			}{{"  expected_replicas: 3\n", 3}, {"", 10}} {
				e := clusterEngine(t, fmt.Sprintf(fleetPolicy, addr, "a", "start", "100ms", "2s", "250ms", "local")+c.expected+modeSection(t, mode))
				f := &fleet{t: t, engines: []*policy.Engine{e}, names: []string{"a"}}
				var got []*policy.Ticket
				for range 11 {
					if tk := f.try(0, 20*time.Millisecond); tk != nil {
						got = append(got, tk)
					}
				}
				if len(got) != c.want {
					t.Errorf("with %q a replica that never reached Redis admitted %d of chat's 10 slots, want %d", strings.TrimSpace(c.expected), len(got), c.want)
				}
				f.release(got...)
				_ = e.Close(context.Background())
			}
		})
	}
}

// TestLeasedPartsAfterRedisIsGoneAddUpToTheLimit: once Redis is gone and their leases have run
// out, leased replicas keep to their parts of chat's 10 slots: what Redis last granted each.
// a last reported holding 3 slots while 7 were free; b and c then took 3 each. Had a's part
// counted its share of the room it last heard was free, the parts would add up to more than 10.
func TestLeasedPartsAfterRedisIsGoneAddUpToTheLimit(t *testing.T) {
	rd := redistest.Standalone(t)
	f := startFleet(t, rd, "parts", fleetOptions{mode: "leased", onUnavailable: config.OnUnavailableLocal,
		timeout: time.Second, leaseTTL: 2 * time.Second, heartbeat: 250 * time.Millisecond})
	// a's lease grows to 3 slots, then a holds 1 of them: its lease is steady (it reports once a
	// renewal), and it last heard 7 slots free.
	a := f.hold(0, 3)
	f.release(a[1:]...)
	a = a[:1]
	time.Sleep(40 * time.Millisecond)
	b := f.hold(1, 3)
	c := f.hold(2, 3)
	// What the leases hold reaches every replica within a moment of the growth (cluster.md:
	// the last publications before Redis dies may not).
	time.Sleep(50 * time.Millisecond)
	rd.Kill()
	for i, e := range f.engines {
		waitFor(t, f.names[i]+" to find Redis gone", func() bool { return !e.Cluster().Available() })
	}
	// Every lease has run out (lease_ttl 2 s, timeout 1 s: a lease is valid for 1 s).
	time.Sleep(1200 * time.Millisecond)
	var sum int64
	var parts []string
	for i, e := range f.engines {
		for _, cp := range e.Compartments() {
			if cp.Name == "feature/chat" {
				sum += cp.MaxConcurrent
				parts = append(parts, fmt.Sprintf("%s %d (holds %d)", f.names[i], cp.MaxConcurrent, cp.InFlight))
				if cp.MaxConcurrent < cp.InFlight {
					t.Errorf("%s's part is %d slots, below the %d it holds", f.names[i], cp.MaxConcurrent, cp.InFlight)
				}
			}
		}
	}
	t.Logf("parts: %v", parts)
	if sum > fleetLimit {
		t.Errorf("the parts add up to %d, above chat's %d: %v", sum, fleetLimit, parts)
	}
	f.release(a...)
	f.release(b...)
	f.release(c...)
}
