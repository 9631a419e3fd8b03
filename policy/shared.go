package policy

import (
	"context"
	"errors"
	"os"
	"sync"
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

	mu sync.Mutex
	// watch maps compartment names that went through shared admission to their compartments,
	// held weakly (an evicted tenant compartment goes away) with the sequence number of the
	// last count applied.
	watch map[string]*watched

	// shareCh wakes the worker that rebuilds the snapshot when the share changes.
	shareCh chan struct{}
	stop    chan struct{}
	done    chan struct{}

	unavailable *prometheus.CounterVec
}

type watched struct {
	c   weak.Pointer[bulkhead.Compartment]
	seq int64
}

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
		closed: c.OnUnavailable == "closed", timeout: c.Timeout.D(), watch: map[string]*watched{},
		shareCh: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
		unavailable: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "cluster_unavailable_admissions_total",
			Help: "Admissions decided while the shared state was unavailable: local (this replica's share enforced here) or refused (cluster_unavailable)."},
			[]string{"action"}),
	}
	if reg != nil {
		reg.MustRegister(cs.unavailable)
	}
	e.cluster = cs
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
		e.ledger.UseStore(spend.NewRedisStore(st), cs.closed)
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
	if !cs.store.Available() {
		// While unavailable, this replica enforces its share alone: other replicas' slots, as a
		// late publication reports them, must not hold its requests back.
		return
	}
	cs.mu.Lock()
	w := cs.watch[name]
	if w == nil || seq <= w.seq {
		cs.mu.Unlock()
		return
	}
	w.seq = seq
	c := w.c.Value()
	if c == nil {
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
		w.seq = 0
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

// sharedState follows the store's availability: while it is unavailable and on_unavailable is
// local, every limit becomes this replica's share (limit ÷ live replicas last seen).
func (e *Engine) sharedState(available bool, live int) {
	share := 1
	if available {
		e.carryForeignSpend()
	}
	if !available {
		// What other replicas held no longer counts here: either this replica enforces its
		// share of every limit alone, or it refuses everything. Counts start afresh once the
		// store is back.
		e.sharedReset()
		if !e.cluster.closed {
			share = max(live, 1)
		}
	}
	if e.share.Swap(int64(share)) == int64(share) {
		return
	}
	select {
	case e.cluster.shareCh <- struct{}{}:
	default:
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
// not answer in time the request is decided as cluster.on_unavailable says.
func (e *Engine) admitShared(ctx context.Context, s *Snapshot, r *Request, dims Dims, t *Ticket, onQueue func(time.Duration), now time.Time, d *Decision) {
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

	want := t.want(tokens, dims.Tenant, now)
	want.Pending = true
	deadline := now.Add(want.MaxWait)
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
			cs.unavailable.WithLabelValues("local").Inc()
			// Give the breaker permit back: the local path takes its own.
			if t.brk != nil {
				t.brk.Release(t.permit)
				t.brk = nil
			}
			// The request goes on waiting, if it must, only for what is left of its max wait.
			e.admitLocal(ctx, s, r, dims, t, nil, e.clock.Now(), deadline, d)
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
// unavailable); queue depths stay, as queues are this replica's own, and so do spend budgets:
// the ledger enforces this replica's share of them itself (of what Redis last showed left).
func shareLimits(r config.Resolved, share int64) config.Resolved {
	if share <= 1 {
		return r
	}
	q, sp := r.QueueDepth, r.Spend
	r = r.Scale(1 / float64(share))
	r.QueueDepth, r.Spend = q, sp
	return r
}
