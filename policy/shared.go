package policy

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// clusterState is the engine's side of cluster mode: the shared store, what the engine knows of
// other replicas' slots per compartment, and the per-replica share it enforces while the store
// is unavailable.
type clusterState struct {
	store  *cluster.Store
	closed bool // on_unavailable: closed
	// leaser keeps this replica's leases (cluster.admission: leased); nil with exact admission.
	leaser *cluster.Leaser
	// timeout is cluster.timeout, the retry-after of a cluster_unavailable refusal's floor.
	timeout time.Duration
	// expected is cluster.expected_replicas (0: not set): the fewest replicas the limits are
	// divided by while each enforces its part.
	expected int

	// available is the store's availability as last reported to the engine.
	available atomic.Bool
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

	unavailable *prometheus.CounterVec
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

// sharedTicket is what a ticket admitted through the shared store keeps for settlement.
type sharedTicket struct {
	lease   uint64
	windows []cluster.Window
	// kinds names each window's reason (rate or budget) and owner, for refusals and metrics.
	owners []int
	slots  []cluster.Slot
	// slotOwner maps each slot to its instance index in the ticket.
	slotOwner []int
	adm       cluster.Admission
	res       cluster.Result
	// remaining and reset are the tightest per-minute token budget after admission.
	remaining int64
	reset     time.Duration
	hasTPM    bool
}

func (cs *clusterState) retryAfter() time.Duration { return max(cs.timeout, time.Second) }

// openCluster connects the engine to the shared store the policy names.
func (e *Engine) openCluster(p *config.Policy, reg prometheus.Registerer) error {
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
		shareCh: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
		unavailable: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "cluster_unavailable_admissions_total",
			Help: "Admissions decided while the shared state was unavailable: local (this replica's share enforced here) or refused (cluster_unavailable)."},
			[]string{"action"}),
	}
	if reg != nil {
		reg.MustRegister(cs.unavailable)
	}
	e.cluster = cs
	// Until it first registers, this replica knows nothing of the others: it keeps to its part
	// of each limit (the limit divided by expected_replicas, when set) from the first request.
	cs.capGen.Store(1)
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
		MaxPending: c.MaxPendingSettlements, Logger: e.log, Registerer: reg,
		OnCounts: e.sharedCounts, OnReset: e.sharedReset, OnState: e.sharedState, Watched: e.sharedWatched,
	})
	if err != nil {
		return err
	}
	cs.store = st
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
		e.ledger.UseStore(cluster.NewSpendStore(st), cs.closed)
		if st.Available() {
			// Reached before the ledger used Redis: carry what sharedState could not.
			e.carryForeignSpend()
		}
	}
	go e.shareWorker()
	return nil
}

// closeCluster gives this replica's leases back and stops the store.
func (e *Engine) closeCluster(ctx context.Context) error {
	cs := e.cluster
	if cs == nil {
		return nil
	}
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

// ClusterLeases lists this replica's leases (leased admission; nil otherwise).
func (e *Engine) ClusterLeases() []cluster.LeaseInfo {
	if e.cluster == nil || e.cluster.leaser == nil {
		return nil
	}
	return e.cluster.leaser.Leases()
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

// divisor is what the limits are divided by while each replica enforces its part: the live
// replicas last seen, and at least cluster.expected_replicas.
func (cs *clusterState) divisor(live int) int64 { return int64(max(live, cs.expected, 1)) }

// sharedState follows the store's state. From the moment this replica is cut off from Redis (or
// learns that Redis lost what it held) until Redis counts every replica's slots again, each
// compartment keeps to this replica's part of its concurrency and in-flight-token limits
// (bulkhead.Share): its own slots, as Redis counted them, plus an equal part of the room free
// when the episode began. The store reports the change before any admission sees it, so no
// request is admitted meanwhile against the whole limit. While the store is unavailable and
// on_unavailable is local, budgets and rates are divided too.
func (e *Engine) sharedState(st cluster.State) {
	cs := e.cluster
	cs.stateMu.Lock()
	cs.available.Store(st.Available)
	cs.followBack(st.Available)
	if st.Synced {
		e.uncapAll()
	} else {
		e.capAll(st)
	}
	cs.stateMu.Unlock()
	share := 1
	if st.Available {
		e.carryForeignSpend()
	}
	if !st.Available && !cs.closed {
		share = int(cs.divisor(st.Live))
	}
	if e.share.Swap(int64(share)) == int64(share) {
		return
	}
	select {
	case cs.shareCh <- struct{}{}:
	default:
	}
}

// capAll starts an episode of caps (see sharedState), capping every compartment this replica
// has from what it and the others held as last known; in one already begun it only forgets
// what the others held once the store is unavailable. Called with cs.stateMu held.
func (e *Engine) capAll(st cluster.State) {
	cs := e.cluster
	if cs.capGen.Load() != 0 {
		if !st.Available {
			e.sharedReset()
		}
		return
	}
	gen := cs.nextGen()
	s := e.cur.Load()
	if s == nil {
		cs.capGen.Store(gen)
		return
	}
	n := cs.divisor(st.Live)
	lag := cs.store.Unsent()
	for _, in := range append(s.staticInstances(), s.dynamicInstances()...) {
		e.capInstance(in, gen, n, !st.Available, lag[in.name])
	}
	// Published only now: an admission that sees the episode finds its compartments capped,
	// or caps them itself (capTicket) from the same counts.
	cs.capGen.Store(gen)
	if !st.Available {
		e.sharedReset()
	}
}

// nextGen returns an episode number not used before (never 0).
func (cs *clusterState) nextGen() uint64 {
	cs.genSeq++
	return cs.genSeq + 1
}

// capInstance caps in's compartment for episode gen (a no-op when it has no shared
// concurrency or in-flight-token limit, or is capped for gen already).
func (e *Engine) capInstance(in *instance, gen uint64, n int64, forget bool, lag [2]int64) {
	l := in.limits
	if l.MaxConcurrent <= 0 && l.MaxInflightTokens <= 0 {
		return
	}
	cs := e.cluster
	cs.mu.Lock()
	var slots, tokens int64
	if w := cs.watch[in.name]; w != nil {
		slots, tokens = w.slots, w.tokens
	}
	cs.mu.Unlock()
	e.sched.Cap(in.c, bulkhead.Share{Gen: gen, Replicas: n, Slots: !l.Adaptive.On(),
		Totals: slots, TotalTokens: tokens, Lag: lag[0], LagTokens: lag[1], ForgetRemote: forget})
}

// capTicket caps, for the episode under way, the compartments of t that are not yet: those
// created (or first used) since it began.
func (e *Engine) capTicket(t *Ticket) {
	cs := e.cluster
	gen := cs.capGen.Load()
	if gen == 0 {
		return
	}
	n := cs.divisor(cs.store.Live())
	for i := 0; i < t.n; i++ {
		in := t.insts[i]
		if e.sched.CapGen(in.c) == gen {
			continue
		}
		// Under stateMu, so that an episode ending meanwhile (uncapAll) cannot leave it capped.
		cs.stateMu.Lock()
		if gen = cs.capGen.Load(); gen != 0 {
			e.capInstance(in, gen, n, !cs.available.Load(), cs.store.Unsent()[in.name])
		}
		cs.stateMu.Unlock()
		if gen == 0 {
			return
		}
	}
}

// uncapAll ends the episode of caps: Redis counts every replica's slots again. Called with
// cs.stateMu held.
func (e *Engine) uncapAll() {
	cs := e.cluster
	if cs.capGen.Swap(0) == 0 {
		return
	}
	s := e.cur.Load()
	if s == nil {
		return
	}
	for _, in := range append(s.staticInstances(), s.dynamicInstances()...) {
		e.sched.Uncap(in.c)
	}
	// Compartments no longer in the snapshot but still in use by requests in flight.
	cs.mu.Lock()
	var rest []*bulkhead.Compartment
	for _, w := range cs.watch {
		if c := w.c.Value(); c != nil {
			rest = append(rest, c)
		}
	}
	cs.mu.Unlock()
	for _, c := range rest {
		e.sched.Uncap(c)
	}
}

// shareWorker rebuilds the snapshot with the current share whenever it changes.
func (e *Engine) shareWorker() {
	cs := e.cluster
	defer close(cs.done)
	for {
		select {
		case <-cs.stop:
			return
		case <-cs.shareCh:
		}
		e.applyMu.Lock()
		s := e.cur.Load()
		applied := s != nil && s.share == e.share.Load()
		e.applyMu.Unlock()
		if applied || s == nil {
			continue
		}
		share := e.share.Load()
		if _, err := e.Apply(s.policy); err != nil {
			e.log.Error("could not apply the per-replica share of the limits", "share", share, "error", err)
			continue
		}
		if share > 1 {
			e.log.Warn("enforcing this replica's share of every limit until Redis answers again",
				"live_replicas_last_seen", share)
		} else {
			e.log.Info("enforcing the full limits again, shared across replicas")
		}
	}
}

// admitShared admits through the shared store: the provider's breaker here, then, as often as
// the request may wait, a slot in this replica's compartments (counting what other replicas
// hold, as last reported, so that requests queue here with their priority and fairness) and
// one atomic reservation in Redis of every rate, budget and slot. A slot another replica took
// meanwhile sends the request back to wait; a window without room refuses it. When Redis does
// not answer in time the request asks again (or is refused, with on_unavailable closed or no
// wait left) while the store is available, and is decided as cluster.on_unavailable says once it
// is not. deadline, when not zero, bounds the wait (what is left of it after an earlier
// attempt).
func (e *Engine) admitShared(ctx context.Context, s *Snapshot, r *Request, dims Dims, t *Ticket, onQueue func(time.Duration), now, deadline time.Time, d *Decision) {
	cs := e.cluster
	refuse := func(reason Reason, in string, retry time.Duration) {
		t.undo(now)
		refuseInto(d, reason, in, retry, &dims)
	}
	if e.checkBreaker(s, dims, t, now, d) {
		t.undo(now)
		return
	}
	if e.reserveSpend(ctx, s, r, dims, t, now, d) {
		return
	}
	sh := t.shared
	if sh == nil {
		sh = &sharedTicket{}
		t.shared = sh
	}
	tokens := r.Estimate.Total
	e.sharedRequest(s, t, sh, tokens)
	sh.lease = cs.store.NextLease()
	sh.adm = cluster.Admission{Lease: sh.lease, Slots: sh.slots, Windows: sh.windows}
	watches := make([]*watched, len(sh.slots))
	for i, sl := range sh.slotOwner {
		watches[i] = cs.watchCompartment(t.insts[sl].c)
	}

	// Until Redis counts every replica's slots again, this replica keeps to its part.
	e.capTicket(t)
	want := t.want(tokens, dims.Tenant, now)
	want.Pending = true
	if deadline.IsZero() {
		deadline = now.Add(want.MaxWait)
	} else {
		want.MaxWait = max(min(want.MaxWait, deadline.Sub(now)), 0)
	}
	for {
		if err := e.sched.Acquire(ctx, t.set[:t.n], t.held[:t.n], want, onQueue); err != nil {
			var rf *bulkhead.Refusal
			if errors.As(err, &rf) {
				reason := ReasonBulkheadFull
				if rf.Cause == bulkhead.CauseCancelled {
					reason = ReasonCancelled
				}
				refuse(reason, rf.Compartment.Name(), rf.RetryAfter)
				return
			}
			refuse(ReasonBulkheadFull, "", 0)
			return
		}
		onQueue = nil
		granted := e.clock.Now()
		res := &sh.res
		if err := cs.store.Admit(ctx, &sh.adm, res); err != nil {
			e.sched.Abandon(t.set[:t.n], t.held[:t.n])
			if ctx.Err() != nil {
				refuse(ReasonCancelled, "", 0)
				return
			}
			if cs.closed {
				cs.unavailable.WithLabelValues("refused").Inc()
				refuse(ReasonClusterUnavailable, "cluster", cs.retryAfter())
				return
			}
			// While the replica still counts on Redis (one slow answer), a request decided here
			// would be counted by no other replica: it asks Redis again, under a lease of its
			// own (the one that failed is being undone), for what is left of its max wait. Once
			// the replica is cut off, it is decided here, within the replica's part.
			if cs.store.Available() || !cs.store.LocalStarted() {
				left := deadline.Sub(e.clock.Now())
				if left <= 0 {
					cs.unavailable.WithLabelValues("refused").Inc()
					refuse(ReasonClusterUnavailable, "cluster", cs.retryAfter())
					return
				}
				sh.lease = cs.store.NextLease()
				sh.adm.Lease = sh.lease
				want.MaxWait = left
				continue
			}
			cs.unavailable.WithLabelValues("local").Inc()
			// Give the breaker permit back: the local path takes its own.
			if t.brk != nil {
				t.brk.Release(t.permit)
				t.brk = nil
			}
			// The request goes on waiting, if it must, only for what is left of its max wait, and
			// only until Redis answers again: it then goes through Redis.
			again := e.admitLocal(ctx, s, r, dims, t, nil, e.clock.Now(), deadline, cs.backContext(), d)
			cs.store.LocalEnded()
			if again {
				e.admitShared(ctx, s, r, dims, t, nil, e.clock.Now(), deadline, d)
			}
			return
		}
		for i := range res.Others {
			if i < len(watches) {
				e.sharedOthers(watches[i], t.insts[sh.slotOwner[i]].c, res.Seq, res.Others[i])
			}
		}
		switch res.Status {
		case cluster.RefusedWindow:
			e.sched.Abandon(t.set[:t.n], t.held[:t.n])
			w := &sh.windows[res.Index]
			reason := ReasonTokenBudget
			if w.Kind == "rpm" {
				reason = ReasonRateLimit
			}
			capacity, kind := w.Capacity, w.Kind
			refuse(reason, t.insts[sh.owners[res.Index]].name, res.RetryAfter)
			if res.WindowKnown {
				d.Limits.refusedByShared(capacity, res.WindowLeft, res.WindowReset, kind == "rpm")
			}
			return
		case cluster.RefusedSlot:
			e.sched.Abandon(t.set[:t.n], t.held[:t.n])
			in := t.insts[sh.slotOwner[res.Index]]
			left := deadline.Sub(e.clock.Now())
			if want.MaxWait <= 0 || left <= 0 {
				retry := e.sched.Stats(in.c).AvgHold
				refuse(ReasonBulkheadFull, in.name, max(retry, time.Second))
				return
			}
			// Another replica took the slot: wait here for the next one to free.
			want.MaxWait = left
			continue
		}
		// Admitted.
		e.sched.Confirm(t.set[:t.n], t.held[:t.n])
		t.grantedAt = granted
		e.sharedShadow(s, t, sh, res.Shadowed)
		sh.hasTPM = false
		for i, w := range sh.windows {
			if w.Kind != "tpm" || i >= len(res.Remaining) {
				continue
			}
			if !sh.hasTPM || res.Remaining[i] < sh.remaining {
				sh.remaining, sh.reset, sh.hasTPM = res.Remaining[i], res.Reset[i], true
			}
		}
		t.active = true
		t.mode = ticketShared
		e.inflight.Add(1)
		s.features[dims.Feature].stats.tokensReserved.Add(float64(tokens))
		*d = Decision{Verdict: Admit, Dims: dims}
		return
	}
}

// sharedRequest fills sh with the slots and windows of t's compartments: rates first, then
// budgets (the order refusals are reported in), then slots of every compartment with a
// concurrency or in-flight-token limit.
func (e *Engine) sharedRequest(s *Snapshot, t *Ticket, sh *sharedTicket, tokens int64) {
	sh.slots, sh.slotOwner = sh.slots[:0], sh.slotOwner[:0]
	sh.windows, sh.owners = sh.windows[:0], sh.owners[:0]
	add := func(i int, kind string, length time.Duration, capacity int64, amount int64) {
		if capacity <= 0 {
			return
		}
		l := t.insts[i].limits
		sh.windows = append(sh.windows, cluster.Window{Name: t.insts[i].name, Kind: kind, Length: length,
			Capacity: capacity, Debt: int64(float64(capacity) * l.MaxDebt), Amount: amount, Shadow: l.Shadow})
		sh.owners = append(sh.owners, i)
	}
	for i := 0; i < t.n; i++ {
		add(i, "rpm", time.Minute, t.insts[i].limits.RequestsPerMinute, 1)
	}
	for i := 0; i < t.n; i++ {
		l := t.insts[i].limits
		add(i, "tpm", time.Minute, l.TokensPerMinute, tokens)
		add(i, "tpd", 24*time.Hour, l.TokensPerDay, tokens)
	}
	for i := 0; i < t.n; i++ {
		l := t.insts[i].limits
		maxConcurrent := l.MaxConcurrent
		if l.Adaptive.On() {
			// An adaptive limit is each replica's own (learned from its own requests), enforced
			// here alone; only in-flight tokens are shared.
			maxConcurrent = 0
		}
		if maxConcurrent <= 0 && l.MaxInflightTokens <= 0 {
			continue
		}
		held := tokens
		if l.MaxInflightTokens > 0 {
			held = min(tokens, l.MaxInflightTokens)
		}
		sh.slots = append(sh.slots, cluster.Slot{Name: t.insts[i].name, Max: maxConcurrent, MaxTokens: l.MaxInflightTokens,
			Tokens: held, Shadow: l.Shadow})
		sh.slotOwner = append(sh.slotOwner, i)
	}
}

// sharedShadow counts what shadow-mode windows and compartments would have refused.
func (e *Engine) sharedShadow(s *Snapshot, t *Ticket, sh *sharedTicket, bits uint64) {
	if bits == 0 {
		return
	}
	for i, w := range sh.windows {
		if bits&(1<<uint(i)) != 0 {
			reason := ReasonTokenBudget
			if w.Kind == "rpm" {
				reason = ReasonRateLimit
			}
			e.metrics.countShadow(s.label(t.insts[sh.owners[i]]), reason)
		}
	}
	for i := range sh.slots {
		if bits&(1<<uint(len(sh.windows)+i)) != 0 {
			t.insts[sh.slotOwner[i]].c.CountShadowRefusal()
		}
	}
}

// trackLocal records a request admitted here while the shared state was unavailable, so that
// its slots count on every replica once this one rewrites its leases in Redis.
func (e *Engine) trackLocal(s *Snapshot, t *Ticket, tokens int64) {
	sh := t.shared
	if sh == nil {
		sh = &sharedTicket{}
		t.shared = sh
	}
	e.sharedRequest(s, t, sh, tokens)
	sh.lease = e.cluster.store.NextLease()
	e.cluster.store.Track(sh.lease, sh.slots)
	t.mode = ticketTracked
}

// shareLimits divides r's limits by the share (live replicas while the shared state is
// unavailable); queue depths stay, as queues are this replica's own; so do the concurrency and
// in-flight-token limits: each compartment's cap (sharedState) is this replica's part of them,
// which counts what the replicas held when Redis stopped answering; and so do spend budgets: the
// ledger enforces this replica's share of them itself (of what Redis last showed left).
func shareLimits(r config.Resolved, share int64) config.Resolved {
	if share <= 1 {
		return r
	}
	q, c, t, sp := r.QueueDepth, r.MaxConcurrent, r.MaxInflightTokens, r.Spend
	r = r.Scale(1 / float64(share))
	r.QueueDepth, r.MaxConcurrent, r.MaxInflightTokens, r.Spend = q, c, t, sp
	return r
}
