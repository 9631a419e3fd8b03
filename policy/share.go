package policy

import (
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// divisor is what the limits are divided by while each replica enforces its part: the live
// replicas last seen, and at least cluster.expected_replicas.
func (cs *clusterState) divisor(live int) int64 { return int64(max(live, cs.expected, 1)) }

// sharedState follows the store's state. From the moment this replica is cut off from Redis (or
// learns that Redis lost what it held) until Redis counts every replica's slots again, each
// compartment keeps to this replica's part of its concurrency and in-flight-token limits
// (bulkhead.Share): its own slots, as Redis counted them, plus an equal part of the room free
// when the episode began. The part is narrow (its own slots alone) while Redis may only be slow
// for this replica and answer the others, who would take that room too, and widened once the
// store finds Redis gone (cluster.State.Gone). The store reports the change before any admission
// sees it, so no request is admitted meanwhile against the whole limit. While the store is
// unavailable and on_unavailable is local, budgets and rates are divided too.
func (e *Engine) sharedState(st cluster.State) {
	cs := e.cluster
	cs.stateMu.Lock()
	was := cs.available.Swap(st.Available)
	cs.gone.Store(st.Gone)
	cs.followBack(st.Available)
	switch {
	case st.Synced:
		e.uncapAll()
	case !st.Available && !was:
		// Still cut off, and Redis found gone: every replica is cut off too.
		e.widenAll()
	default:
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
// has from what it and the others held as last known. In one already begun, a new cut (the
// store unavailable again) lowers each part to the one computed from what is known now, if
// smaller, and forgets what the others held. Called with cs.stateMu held.
func (e *Engine) capAll(st cluster.State) {
	cs := e.cluster
	gen := cs.capGen.Load()
	again := gen != 0
	if again && st.Available {
		return
	}
	if !again {
		gen = cs.nextGen()
	}
	s := e.cur.Load()
	if s == nil {
		cs.capGen.Store(gen)
		return
	}
	n := cs.divisor(st.Live)
	lag := cs.store.Unsent()
	for _, in := range append(s.staticInstances(), s.dynamicInstances()...) {
		// Cut off again before the episode ended (it had rewritten its slots, and may have
		// confirmed them: the others may count on Redis alone by now): its part is no more
		// than what Redis counts for it now plus its share of what is free now.
		e.capInstance(in, gen, n, !st.Available, again, !st.Available && !st.Gone, lag[in.name])
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
func (e *Engine) capInstance(in *instance, gen uint64, n int64, forget, tighten, narrow bool, lag [2]int64) {
	l := in.limits
	if in.fleet != nil || (l.MaxConcurrent <= 0 && l.MaxInflightTokens <= 0) {
		// A leased compartment's part is its lease (fleetLease.LeaseChanged).
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
		Totals: slots, TotalTokens: tokens, Lag: lag[0], LagTokens: lag[1], ForgetRemote: forget, Tighten: tighten, Narrow: narrow})
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
		if in.fleet != nil || e.sched.CapGen(in.c) == gen {
			continue
		}
		// Under stateMu, so that an episode ending meanwhile (uncapAll) cannot leave it capped.
		cs.stateMu.Lock()
		if gen = cs.capGen.Load(); gen != 0 {
			cut := !cs.available.Load()
			e.capInstance(in, gen, n, cut, false, cut && !cs.gone.Load(), cs.store.Unsent()[in.name])
		}
		cs.stateMu.Unlock()
		if gen == 0 {
			return
		}
	}
}

// widenAll gives every compartment of the episode under way its share of the room that was free
// when this replica was cut off: Redis is gone, not just slow for this replica. Called with
// cs.stateMu held.
func (e *Engine) widenAll() {
	cs := e.cluster
	gen := cs.capGen.Load()
	if gen == 0 {
		return
	}
	for _, c := range e.clusterCompartments() {
		e.sched.Widen(c, gen)
	}
}

// uncapAll ends the episode of caps: Redis counts every replica's slots again. Called with
// cs.stateMu held.
func (e *Engine) uncapAll() {
	cs := e.cluster
	if cs.capGen.Swap(0) == 0 {
		return
	}
	for _, c := range e.clusterCompartments() {
		e.sched.Uncap(c)
	}
}

// clusterCompartments lists the compartments of the snapshot and those no longer in it but
// still in use by requests in flight.
func (e *Engine) clusterCompartments() []*bulkhead.Compartment {
	var out []*bulkhead.Compartment
	if s := e.cur.Load(); s != nil {
		for _, in := range append(s.staticInstances(), s.dynamicInstances()...) {
			out = append(out, in.c)
		}
	}
	cs := e.cluster
	cs.mu.Lock()
	for _, w := range cs.watch {
		if c := w.c.Value(); c != nil {
			out = append(out, c)
		}
	}
	cs.mu.Unlock()
	return out
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
