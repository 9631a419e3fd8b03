package policy

import (
	"context"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
	"github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

// clusterState is the engine's side of cluster mode: the shared store, what the engine knows of
// other replicas' slots per compartment, and the per-replica share it enforces while the store
// is unavailable.
type clusterState struct {
	store  *cluster.Store
	closed bool // on_unavailable: closed
	// leaser keeps this replica's leases (cluster.admission: leased); nil with exact admission.
	leaser *cluster.Leaser
	// usage adds what the engine's usage tracker counts to the fleet's tables in Redis.
	usage *cluster.UsageStore
	// timeout is cluster.timeout, the retry-after of a cluster_unavailable refusal's floor.
	timeout time.Duration
	// expected is cluster.expected_replicas (0: not set): the fewest replicas the limits are
	// divided by while each enforces its part.
	expected int

	// available is the store's availability as last reported to the engine; gone says, while
	// it is unavailable, that Redis is gone, not just slow for this replica (cluster.State.Gone).
	available, gone atomic.Bool
	// capGen names the episode during which every compartment keeps to this replica's part of
	// its limits (bulkhead.Share): from the moment this replica is cut off from Redis (or
	// learns that Redis lost what it held) until Redis counts every replica's slots again. 0
	// outside one. Written under stateMu.
	capGen  atomic.Uint64
	stateMu sync.Mutex
	genSeq  uint64 // guarded by stateMu
	// back is done once the store is available again: requests waiting for a slot here while it
	// was unavailable then go through it. A new one is made each time it becomes unavailable.
	back atomic.Pointer[backState]

	mu sync.Mutex
	// watch maps compartment names to what is known of them: the compartment (held weakly: an
	// evicted tenant compartment goes away) once a request here went through shared admission
	// in it, the sequence number of the last count applied, and the totals last heard over every
	// replica (kept for names without a compartment here too, so that a compartment first used
	// during an outage knows what the others held).
	watch map[string]*watched

	// shareCh wakes the worker that rebuilds the snapshot when the share changes.
	shareCh chan struct{}
	stop    chan struct{}
	done    chan struct{}
	// quotaDone is closed when the worker sharing provider quotas (quotaWorker) has stopped.
	quotaDone chan struct{}
}

// backState is a context done once the shared state answers again.
type backState struct {
	ctx    context.Context
	cancel context.CancelFunc
}

// backContext returns the context done once the shared state answers again.
func (cs *clusterState) backContext() context.Context {
	if b := cs.back.Load(); b != nil {
		return b.ctx
	}
	return context.Background()
}

// followBack keeps back in step with the store's availability. Called with cs.stateMu held.
func (cs *clusterState) followBack(available bool) {
	b := cs.back.Load()
	switch {
	case available && b != nil:
		b.cancel()
	case !available && (b == nil || b.ctx.Err() != nil):
		ctx, cancel := context.WithCancel(context.Background())
		cs.back.Store(&backState{ctx: ctx, cancel: cancel})
	}
}

type watched struct {
	c   weak.Pointer[bulkhead.Compartment]
	seq int64
	// slots and tokens are the totals last heard, over every replica.
	slots, tokens int64
}

// maxHeard bounds the names kept only for their totals: beyond it, totals of compartments
// without one here are not kept (a compartment first used during an outage then counts what
// its own remote counts say).
const maxHeard = 100000

func (cs *clusterState) retryAfter() time.Duration { return max(cs.timeout, time.Second) }

// openCluster connects the engine to the shared store the policy names.
func (e *Engine) openCluster(p *config.Policy) error {
	c := p.Cluster
	if c.Backend != "redis" {
		return nil
	}
	tlsCfg, err := c.TLS.Config()
	if err != nil {
		return err
	}
	password := ""
	if c.PasswordEnv != "" {
		password = os.Getenv(c.PasswordEnv)
	}
	cs := &clusterState{
		closed: c.OnUnavailable == "closed", timeout: c.Timeout.D(), expected: c.ExpectedReplicas, watch: map[string]*watched{},
		shareCh: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}), quotaDone: make(chan struct{}),
	}
	e.cluster = cs
	// Until it first registers, this replica knows nothing of the others: it keeps to its part
	// of each limit (the limit divided by expected_replicas, when set) from the first request.
	cs.capGen.Store(1)
	cs.gone.Store(true)
	cs.followBack(false)
	if cs.expected > 1 && !cs.closed {
		e.share.Store(int64(cs.expected))
		if _, err := e.Apply(p); err != nil {
			return err
		}
	}
	st, err := cluster.Open(cluster.Options{
		Addresses: c.Addresses, Mode: cluster.Mode(c.Mode), MasterName: c.MasterName, Username: c.Username,
		Password: password, TLS: tlsCfg, KeyPrefix: c.KeyPrefix, ReplicaID: c.ReplicaID,
		Timeout: c.Timeout.D(), DialTimeout: c.DialTimeout.D(), WriteTimeout: c.WriteTimeout.D(),
		LeaseTTL: c.LeaseTTL.D(), Heartbeat: c.Heartbeat.D(), SettleInterval: c.SettleInterval.D(),
		MaxPending: c.MaxPendingSettlements, Logger: e.log,
		OnCounts: e.sharedCounts, OnReset: e.sharedReset, OnState: e.sharedState, Watched: e.sharedWatched,
		Leased: c.Admission == config.AdmissionLeased,
	})
	if err != nil {
		return err
	}
	cs.store = st
	// Usage is the fleet's: what this replica counts goes to Redis in the background.
	cs.usage = cluster.NewUsageStore(st, e.usage, cluster.UsageOptions{Now: e.clock.Now})
	if c.Admission == config.AdmissionLeased {
		cs.leaser = cluster.NewLeaser(st, cluster.LeaseOptions{Interval: c.LeaseInterval.D(), Now: e.clock.Now})
		// Compartments built before the store opened take their leases now.
		e.applyMu.Lock()
		if s := e.cur.Load(); s != nil {
			for _, in := range s.staticInstances() {
				s.attachFleet(in, true)
			}
		}
		e.applyMu.Unlock()
	}
	if _, ok := e.ledger.Store().(*spend.MemoryStore); ok {
		// Spend budgets are shared too, unless the caller gave a store of its own. No request
		// has been served yet: nothing is in the memory store.
		ss := cluster.NewSpendStore(st)
		if cs.leaser != nil {
			// Spend windows are leased in chunks like token windows.
			ss.UseLeases(cs.leaser)
		}
		e.ledger.UseStore(ss, cs.closed)
		if st.Available() {
			// Reached before the ledger used Redis: carry what sharedState could not.
			e.carryForeignSpend()
		}
	}
	go e.shareWorker()
	go e.quotaWorker(c.LeaseInterval.D(), c.LeaseTTL.D())
	return nil
}

// closeCluster gives this replica's leases back and stops the store.
func (e *Engine) closeCluster(ctx context.Context) error {
	cs := e.cluster
	if cs == nil {
		return nil
	}
	// What this replica counted reaches the fleet's tables before it leaves.
	cs.usage.Close(ctx)
	if cs.leaser != nil {
		cs.leaser.Close(ctx)
	}
	err := cs.store.Close(ctx)
	select {
	case <-cs.stop:
	default:
		close(cs.stop)
	}
	<-cs.done
	<-cs.quotaDone
	return err
}

// ClusterAdmission returns cluster.admission: leased or exact ("" without a cluster).
func (e *Engine) ClusterAdmission() string {
	switch {
	case e.cluster == nil:
		return ""
	case e.cluster.leaser != nil:
		return config.AdmissionLeased
	}
	return config.AdmissionExact
}

// ClusterSpendLeases lists this replica's chunks of spend windows (leased admission; nil
// otherwise).
func (e *Engine) ClusterSpendLeases() []cluster.SpendLeaseInfo {
	if e.cluster == nil || e.cluster.leaser == nil {
		return nil
	}
	return e.cluster.leaser.SpendLeases()
}

// ClusterLeases lists this replica's leases (leased admission; nil otherwise).
func (e *Engine) ClusterLeases() []cluster.LeaseInfo {
	if e.cluster == nil || e.cluster.leaser == nil {
		return nil
	}
	return e.cluster.leaser.Leases()
}

// FleetUsage returns window q of the fleet's usage (cluster mode): ok is false without a
// cluster; an error says Redis could not be asked (it wraps cluster.ErrUnavailable) or usage is
// not counted (cluster.ErrUsageOff).
func (e *Engine) FleetUsage(ctx context.Context, q usage.Query) (r usage.Report, ok bool, err error) {
	if e.cluster == nil {
		return usage.Report{}, false, nil
	}
	r, err = e.cluster.usage.Report(ctx, q)
	return r, true, err
}

// Cluster returns the shared store, nil without one.
func (e *Engine) Cluster() *cluster.Store {
	if e.cluster == nil {
		return nil
	}
	return e.cluster.store
}

// watchCompartment remembers c under its name so that published counts reach it.
func (cs *clusterState) watchCompartment(c *bulkhead.Compartment) *watched {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	w := cs.watch[c.Name()]
	if w == nil || w.c.Value() != c {
		w = &watched{c: weak.Make(c)}
		cs.watch[c.Name()] = w
	}
	return w
}

// sharedCounts applies totals published by any replica.
func (e *Engine) sharedCounts(name string, seq, slots, tokens int64) {
	cs := e.cluster
	if !cs.available.Load() {
		// While unavailable, this replica enforces its part alone: other replicas' slots, as a
		// late publication reports them, must not hold its requests back.
		return
	}
	cs.mu.Lock()
	w := cs.watch[name]
	if w == nil {
		if len(cs.watch) >= maxHeard || slots == 0 && tokens == 0 {
			cs.mu.Unlock()
			return
		}
		w = &watched{}
		cs.watch[name] = w
	}
	if seq <= w.seq {
		cs.mu.Unlock()
		return
	}
	w.seq, w.slots, w.tokens = seq, slots, tokens
	c := w.c.Value()
	if c == nil && slots == 0 && tokens == 0 {
		delete(cs.watch, name)
	}
	cs.mu.Unlock()
	if c != nil {
		e.sched.SetRemoteTotal(c, slots, tokens)
	}
}

// sharedOthers applies what an admission's reply said other replicas hold.
func (e *Engine) sharedOthers(w *watched, c *bulkhead.Compartment, seq int64, others [2]int64) {
	cs := e.cluster
	cs.mu.Lock()
	if seq < w.seq {
		cs.mu.Unlock()
		return
	}
	w.seq = seq
	cs.mu.Unlock()
	e.sched.SetRemote(c, others[0], others[1])
}

// sharedReset forgets sequence numbers and other replicas' slots: Redis lost its state (or this
// replica re-registered), and the counts that follow start afresh.
func (e *Engine) sharedReset() {
	cs := e.cluster
	cs.mu.Lock()
	var cs2 []*bulkhead.Compartment
	for name, w := range cs.watch {
		w.seq, w.slots, w.tokens = 0, 0, 0
		if c := w.c.Value(); c != nil {
			cs2 = append(cs2, c)
		} else {
			delete(cs.watch, name)
		}
	}
	cs.mu.Unlock()
	for _, c := range cs2 {
		e.sched.SetRemote(c, 0, 0)
	}
}

// sharedWatched lists the compartments with requests queued here, for the heartbeat to report.
func (e *Engine) sharedWatched() []string {
	cs := e.cluster
	cs.mu.Lock()
	defer cs.mu.Unlock()
	var out []string
	for name, w := range cs.watch {
		c := w.c.Value()
		if c == nil {
			delete(cs.watch, name)
			continue
		}
		if e.sched.Waiting(c) {
			out = append(out, name)
		}
	}
	return out
}
