package policy

import (
	"context"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
)

// Leased admission (cluster.admission: leased): each compartment this replica uses holds a lease
// of the fleet's limits — concurrency slots, in-flight tokens and chunks of its request-rate and
// token windows — renewed every lease_interval by the cluster's Leaser. Admission runs the same
// steps as in one process: the scheduler enforces the lease's slots (bulkhead.SetLease), and the
// windows are reserved from the lease's chunks. A request waits on Redis only when a chunk or the
// lease runs short: it asks for a report at once and waits for that round, at most
// cluster.timeout. While the lease cannot be used (Redis slow or gone) a window falls back to this
// replica's own window, holding its share, as cluster.on_unavailable says, and what it counted there
// is added to the fleet's window once Redis answers.

// Window kinds, as indexes of an instance's windows.
const (
	winRPM = iota
	winTPM
	winTPD
	numWins
)

var winKinds = [numWins]string{"rpm", "tpm", "tpd"}

// fleetLease is an instance's lease of its compartment's fleet-wide limits. It is the lease's
// holder: the lease tells it when it changes, and it tells the scheduler.
type fleetLease struct {
	sched *bulkhead.Scheduler
	cs    *clusterState
	c     *bulkhead.Compartment
	ls    *cluster.Lease
	// slots and tokens are the compartment's fleet-wide limits (0: none), for its share while
	// Redis is unavailable.
	slots, tokens int64
	// adaptive is the compartment's learned limit (max_concurrent: adaptive), which the fleet
	// learns as one; nil otherwise.
	adaptive *adaptiveLimit
	now      func() time.Time
	// idx maps a window kind to its index in the lease's windows (-1: the compartment has none).
	idx [numWins]int
}

var _ cluster.LeaseHolder = (*fleetLease)(nil)

func (f *fleetLease) LeaseUsage(freeze bool) cluster.LeaseUsage {
	in, tok, w, wt := f.sched.LeaseUsage(f.c, freeze)
	return cluster.LeaseUsage{InFlight: in, Tokens: tok, Waiting: w, WaitingTokens: wt}
}

// LeaseChanged puts the lease in force. A lease that is not valid (not granted yet, or not
// renewed in time) holds nothing while Redis answers. While Redis is unavailable the compartment
// holds this replica's part of its limits instead (on_unavailable: closed refuses before the
// compartment is asked): what Redis last recorded for it plus an equal part of what is free
// under the latest bound it heard on what every lease holds — so the parts of replicas that were
// all granted, and heard the last bound, add up to no more than the limit — or, for a replica that never reached Redis, the limit
// divided by the replicas (the live ones last seen, and at least cluster.expected_replicas).
func (f *fleetLease) LeaseChanged(st cluster.LeaseState) {
	if a := f.adaptive; a != nil && st.Learned > 0 {
		a.learned(f.now(), st.Learned)
	}
	switch {
	case st.Valid:
		f.sched.SetLease(f.c, st.Slots, st.Tokens, !st.Available)
	case st.Available:
		f.sched.SetLease(f.c, 0, 0, false)
	case st.Known:
		n := f.cs.divisor(f.cs.store.Live())
		f.sched.SetLease(f.c, st.Granted+st.Free/n, st.GrantedTokens+st.FreeTokens/n, true)
	default:
		n := f.cs.divisor(f.cs.store.Live())
		f.sched.SetLease(f.c, max(f.slots/n, 1), max(f.tokens/n, 1), true)
	}
}

// leaseLimits are the limits instance in shares with the fleet through its lease.
func leaseLimits(in *instance) (cluster.LeaseLimits, [numWins]int) {
	l := in.fleetLimits
	lim := cluster.LeaseLimits{MaxConcurrent: l.MaxConcurrent, MaxTokens: l.MaxInflightTokens}
	if a := l.Adaptive; a.On() {
		// A learned limit is the fleet's: one limit for the provider, which every replica's
		// controller moves and every replica leases a share of.
		lim.MaxConcurrent = 0
		lim.Learned = cluster.LearnedLimit{Min: a.Min, Max: a.Max, Initial: a.Initial, Step: a.Interval}
	}
	idx := [numWins]int{-1, -1, -1}
	add := func(k int, length time.Duration, capacity int64) {
		if capacity <= 0 {
			return
		}
		idx[k] = len(lim.Windows)
		lim.Windows = append(lim.Windows, cluster.Window{Name: in.name, Kind: winKinds[k], Length: length,
			Capacity: capacity, Debt: int64(float64(capacity) * l.MaxDebt), Shadow: l.Shadow})
	}
	add(winRPM, time.Minute, l.RequestsPerMinute)
	add(winTPM, time.Minute, l.TokensPerMinute)
	add(winTPD, 24*time.Hour, l.TokensPerDay)
	return lim, idx
}

// attachFleet gives in its lease when admission is leased. live says s is the live snapshot
// (a tenant's compartment made at a request): the lease is taken at once; otherwise when s is
// committed.
func (s *Snapshot) attachFleet(in *instance, live bool) {
	cs := s.engine.cluster
	if cs == nil || cs.leaser == nil {
		return
	}
	lim, idx := leaseLimits(in)
	if lim.MaxConcurrent <= 0 && lim.MaxTokens <= 0 && lim.Learned.Max <= 0 && len(lim.Windows) == 0 {
		return
	}
	f := &fleetLease{sched: s.engine.sched, cs: cs, c: in.c, idx: idx, slots: lim.MaxConcurrent, tokens: lim.MaxTokens,
		adaptive: in.adaptive, now: s.engine.clock.Now}
	if lim.Learned.Max > 0 {
		f.slots = lim.Learned.Initial
	}
	in.fleet = f
	if in.adaptive != nil {
		in.adaptive.mu.Lock()
		in.adaptive.fleet = f
		in.adaptive.mu.Unlock()
	}
	take := func() {
		f.ls = cs.leaser.Lease(in.name, lim, f)
		f.sched.SetLeaseDrained(f.c, f.ls.Drained)
		f.LeaseChanged(f.ls.State(s.engine.clock.Now()))
	}
	if live {
		take()
	} else {
		s.onCommit(take)
	}
}

// closeFleet gives an evicted instance's lease back.
func (in *instance) closeFleet() {
	if in.fleet != nil && in.fleet.ls != nil {
		in.fleet.ls.Close()
	}
}

// leasedWindow says where a ticket's charge in one window was made.
type leasedWindow uint8

const (
	// chargedLocal: in this process's window (no lease).
	chargedLocal leasedWindow = iota
	// chargedLease: in the lease's chunks.
	chargedLease
	// chargedOutage: in this process's window while the lease could not be used; what it
	// costs is added to the fleet's window once Redis answers.
	chargedOutage
)

// localWindow returns instance in's own window of kind k.
func (in *instance) localWindow(k int) *budget.Window {
	switch k {
	case winRPM:
		return in.rpm
	case winTPM:
		return in.tpm
	}
	return in.tpd
}

// reserveWindow reserves n in window k of the ticket's i-th compartment: in its lease when
// admission is leased, else (or while the lease cannot be used) in its own window. shadow takes
// the amount whether it fits or not, and reports whether it fit. unavailable reports that the
// lease could not be used and cluster.on_unavailable is closed.
func (e *Engine) reserveWindow(ctx context.Context, t *Ticket, i, k int, n int64, shadow bool, now time.Time) (ch budget.Charge, ok bool, wait time.Duration, unavailable bool) {
	in := t.insts[i]
	if f := in.fleet; f != nil && f.ls != nil && f.idx[k] >= 0 {
		ls, wi := f.ls, f.idx[k]
		cs := e.cluster
		// The chunks may be short: ask for more, and try again after the round (another
		// request here may have taken what it brought, so until cluster.timeout has passed).
		// answered: a round asked for after this request's need ended.
		deadline := now.Add(cs.timeout)
		needed, answered := false, false
		defer func() {
			if needed {
				ls.UnneedWindow(wi, n)
			}
		}()
		for attempt := 0; ; attempt++ {
			if ch, ok = ls.Reserve(wi, n, now); ok {
				t.charged[i][k] = chargedLease
				return ch, true, 0, false
			}
			if wait = ls.Wait(wi, n); attempt > 0 && wait > 0 {
				// The fleet's window has no room for n.
				t.charged[i][k] = chargedLease
				if shadow {
					return ls.Take(wi, n, now), false, wait, false
				}
				return budget.Charge{}, false, wait, false
			}
			if !needed {
				ls.NeedWindow(wi, n)
				needed = true
			}
			if !cs.store.Available() || !e.awaitLease(ctx, "window", deadline) {
				break
			}
			answered = true
			now = e.clock.Now()
		}
		if ctx.Err() != nil || (cs.store.Available() && cs.leaser.Answering() && answered) {
			// The lease answers but could not cover n in time (another request here took what
			// the round brought): refuse, sooner retried. Without a round of its own answered
			// within cluster.timeout, Redis is too slow for this request, which says nothing of
			// the window's room: this replica's share decides, as while Redis is gone.
			t.charged[i][k] = chargedLease
			return budget.Charge{}, false, cs.leaser.Interval(), false
		}
		// Redis did not answer in time, or is gone: this replica's share, here.
		if cs.closed {
			return budget.Charge{}, false, 0, true
		}
		e.rec.ClusterUnavailable("local")
		t.charged[i][k] = chargedOutage
	} else {
		t.charged[i][k] = chargedLocal
	}
	w := in.localWindow(k)
	if ch, ok, wait = w.Reserve(n, now); !ok && shadow {
		ch = w.Take(n, now)
	}
	return ch, ok, wait, false
}

// awaitLease asks for a round of lease reports now and waits for it to end, until deadline, and
// reports whether it ended in time. kind names what the request lacks, for the metric.
func (e *Engine) awaitLease(ctx context.Context, kind string, deadline time.Time) bool {
	return e.cluster.leaser.Await(ctx, kind, deadline.Sub(e.clock.Now()))
}

// leaseGrew asks the ticket's leases to grow by the request, which found no room, and tries
// again after each round of reports, a few times: a request is not refused, nor queued, for a
// lease that has not had the chance to follow demand.
//
// onQueue, when not nil, is told before a wait that may outlast Envoy's message timeout (a
// compartment's recovery), with the longest wait the request may now have; told reports that it
// was, and the caller must not tell it again.
func (e *Engine) leaseGrew(ctx context.Context, t *Ticket, want bulkhead.Want, onQueue func(time.Duration)) (grew, told bool) {
	cs := e.cluster
	if cs == nil || cs.leaser == nil {
		return false, false
	}
	// A request waits for its leases to grow, until cluster.timeout has passed, and while a
	// compartment recovers (Redis lost its leases, or this is a new deployment's first use of
	// Redis: no lease grows) until the recovery is over, rather than be refused for a lease that
	// could not follow demand yet. A lease that a round did not grow to what its requests need
	// cannot grow until another replica gives some back: the request queues as it would without
	// a lease (its queue counts it in every compartment it needs, so each of their reports asks
	// for it, and the others give back what they do not use at their next report).
	start := e.clock.Now()
	deadline, recovered := start.Add(cs.timeout), start.Add(cs.leaser.Recovery()+cs.leaser.Interval())
	t.needLeases(want.Tokens)
	defer t.unneedLeases(want.Tokens)
	for cs.store.Available() {
		switch {
		case t.leasesCanGrow(e.sched, want.Tokens):
			if !e.awaitLease(ctx, "slot", deadline) {
				return false, told
			}
		case t.leasesRecovering():
			if onQueue != nil && !told {
				onQueue(recovered.Sub(e.clock.Now()) + want.MaxWait)
				told = true
			}
			if !e.awaitRound(ctx, recovered) {
				return false, told
			}
		default:
			return false, told
		}
		if e.sched.TryAcquire(t.set[:t.n], t.held[:t.n], want) {
			return true, told
		}
	}
	return false, told
}

// queueHook is onQueue unless the request was told already (a lease's recovery).
func queueHook(onQueue func(time.Duration), told bool) func(time.Duration) {
	if told {
		return nil
	}
	return onQueue
}

// awaitRound waits for the next regular round of lease reports, until deadline.
func (e *Engine) awaitRound(ctx context.Context, deadline time.Time) bool {
	left := deadline.Sub(e.clock.Now())
	if left <= 0 {
		return false
	}
	t := time.NewTimer(left)
	defer t.Stop()
	select {
	case <-e.cluster.leaser.Next():
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

// leasesRecovering reports whether a lease of the ticket's compartments recovers.
func (t *Ticket) leasesRecovering() bool {
	for i := 0; i < t.n; i++ {
		if f := t.insts[i].fleet; f != nil && f.ls != nil && f.ls.Recovering() {
			return true
		}
	}
	return false
}

// unneedLeases withdraws what needLeases asked for.
func (t *Ticket) unneedLeases(tokens int64) {
	for i := 0; i < t.n; i++ {
		if f := t.insts[i].fleet; f != nil && f.ls != nil {
			f.ls.Unneed(tokens)
		}
	}
}

// needLeases asks for the ticket's leases to grow by the request (tokens in flight): it found no
// room in them, and is about to wait for one.
func (t *Ticket) needLeases(tokens int64) {
	for i := 0; i < t.n; i++ {
		if f := t.insts[i].fleet; f != nil && f.ls != nil {
			f.ls.Need(tokens)
		}
	}
}

// leasesCanGrow reports whether a round of reports can grow the ticket's leases that have no room
// for a request of tokens now: there is one, and none of them recovers or was found short of
// what its requests need by the last report. A lease with room for the request need not grow.
func (t *Ticket) leasesCanGrow(sched *bulkhead.Scheduler, tokens int64) bool {
	any := false
	for i := 0; i < t.n; i++ {
		if f := t.insts[i].fleet; f != nil && f.ls != nil && !sched.Fits(t.set[i], tokens) {
			if !f.ls.CanGrow() {
				return false
			}
			any = true
		}
	}
	return any
}

// leasesValid reports whether every lease of the ticket's compartments is in force at now.
func (t *Ticket) leasesValid(now time.Time) bool {
	for i := 0; i < t.n; i++ {
		if f := t.insts[i].fleet; f != nil && f.ls != nil && !f.ls.Valid(now) {
			return false
		}
	}
	return true
}

// refundWindow gives back charge ch of window k of the ticket's i-th compartment.
func (t *Ticket) refundWindow(i, k int, ch budget.Charge, now time.Time) {
	if ch.Amount() <= 0 {
		return
	}
	in := t.insts[i]
	if t.charged[i][k] == chargedLease {
		in.fleet.ls.Refund(in.fleet.idx[k], ch, now)
		return
	}
	in.localWindow(k).Refund(ch, now)
}

// settleWindow settles charge ch of window k of the ticket's i-th compartment to actual.
func (t *Ticket) settleWindow(i, k int, ch budget.Charge, actual int64, now time.Time) {
	in := t.insts[i]
	switch t.charged[i][k] {
	case chargedLease:
		in.fleet.ls.Settle(in.fleet.idx[k], ch, actual, now)
		return
	case chargedOutage:
		// Counted here while the lease could not be used: the fleet's window counts it too,
		// once Redis answers.
		if f := in.fleet; f != nil && f.ls != nil {
			f.ls.AddBack(f.idx[k], actual)
		}
	}
	in.localWindow(k).Settle(ch, actual, now)
}
