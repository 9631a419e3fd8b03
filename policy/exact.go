package policy

import (
	"context"
	"errors"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
)

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

// commitShared is exact admission's last step (admit has passed the breaker and spend budgets,
// and staged the windows): as often as the request may wait, a slot in this replica's
// compartments (counting what other replicas hold, as last reported, so that requests queue
// here with their priority and fairness) and one atomic reservation in Redis of every rate,
// budget and slot, in admit's order. A slot another replica took meanwhile sends the request
// back to wait; a window without room refuses it. When Redis does not answer in time the request
// asks again (or is refused, with on_unavailable closed or no wait left) while the store is
// available, and is decided as cluster.on_unavailable says once it is not. deadline, when not
// zero, bounds the wait (what is left of it after an earlier attempt). It reports again as admit
// does (always false: a request that went local and saw Redis answer again is admitted through
// it here).
func (e *Engine) commitShared(ctx context.Context, s *Snapshot, r *Request, dims Dims, t *Ticket, onQueue func(time.Duration), now, deadline time.Time, d *Decision) (again bool) {
	cs := e.cluster
	refuse := func(reason Reason, in string, retry time.Duration) {
		t.undo(now)
		refuseInto(d, reason, in, retry, &dims)
	}
	sh := t.shared
	if sh == nil {
		sh = &sharedTicket{}
		t.shared = sh
	}
	tokens := r.Estimate.Total
	e.sharedRequest(s, t, sh, tokens, t.n)
	sh.lease = cs.store.NextLease()
	sh.adm = cluster.Admission{Lease: sh.lease, Slots: sh.slots, Windows: sh.windows}
	watches := make([]*watched, len(sh.slots))
	for i, sl := range sh.slotOwner {
		watches[i] = cs.watchCompartment(t.insts[sl].c)
	}

	// Until Redis counts every replica's slots again, this replica keeps to its part.
	e.capTicket(t)
	want := t.want(r, &dims, now)
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
				e.rec.ClusterUnavailable("refused")
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
					e.rec.ClusterUnavailable("refused")
					refuse(ReasonClusterUnavailable, "cluster", cs.retryAfter())
					return
				}
				sh.lease = cs.store.NextLease()
				sh.adm.Lease = sh.lease
				want.MaxWait = left
				continue
			}
			e.rec.ClusterUnavailable("local")
			// Give the breaker permit back: the local path takes its own.
			if t.brk != nil {
				t.brk.Release(t.permit)
				t.brk = nil
			}
			// The request goes on waiting, if it must, only for what is left of its max wait, and
			// only until Redis answers again: it then goes through Redis.
			again := e.admit(ctx, s, r, dims, t, nil, e.clock.Now(), deadline, cs.backContext(), false, d)
			cs.store.LocalEnded()
			if again {
				e.admit(ctx, s, r, dims, t, nil, e.clock.Now(), deadline, nil, true, d)
			}
			return false
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
		s.features[dims.Feature].rec.TokensReserved(tokens)
		*d = Decision{Verdict: Admit, Dims: dims}
		return
	}
}

// refusedByWindowFirst makes a refusal by a later step (the provider's breaker, when breaker is
// set, or a spend budget) one by the window exact admission staged and would have refused first,
// as every other mode refuses: request rates before the breaker, any window before spend
// budgets. It asks Redis (charging nothing) only on such a refusal's path, and leaves d as it is
// when Redis does not answer in time or every window has room.
//
// n is how many compartments the request was in (its undo has forgotten them).
func (e *Engine) refusedByWindowFirst(ctx context.Context, s *Snapshot, t *Ticket, n int, tokens int64, breaker bool, d *Decision) {
	sh := t.shared
	if sh == nil {
		sh = &sharedTicket{}
		t.shared = sh
	}
	e.sharedRequest(s, t, sh, tokens, n)
	windows := sh.windows
	if breaker {
		// Only request rates come before the breaker.
		k := 0
		for k < len(windows) && windows[k].Kind == "rpm" {
			k++
		}
		windows = windows[:k]
	}
	if len(windows) == 0 {
		return
	}
	var res cluster.Result
	i, err := e.cluster.store.Peek(ctx, windows, &res)
	if err != nil || i < 0 {
		return
	}
	w := &windows[i]
	reason := ReasonTokenBudget
	if w.Kind == "rpm" {
		reason = ReasonRateLimit
	}
	dims := d.Dims
	refuseInto(d, reason, t.insts[sh.owners[i]].name, res.RetryAfter, &dims)
	d.Limits.refusedByShared(w.Capacity, res.WindowLeft, res.WindowReset, w.Kind == "rpm")
}

// sharedRequest fills sh with the slots and windows of t's compartments: rates first, then
// budgets (the order refusals are reported in), then slots of every compartment with a
// concurrency or in-flight-token limit.
func (e *Engine) sharedRequest(s *Snapshot, t *Ticket, sh *sharedTicket, tokens int64, n int) {
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
	for i := 0; i < n; i++ {
		add(i, "rpm", time.Minute, t.insts[i].limits.RequestsPerMinute, 1)
	}
	for i := 0; i < n; i++ {
		l := t.insts[i].limits
		add(i, "tpm", time.Minute, l.TokensPerMinute, tokens)
		add(i, "tpd", 24*time.Hour, l.TokensPerDay, tokens)
	}
	for i := 0; i < n; i++ {
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
			e.rec.ShadowRefusal(s.label(t.insts[sh.owners[i]]), reason)
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
	e.sharedRequest(s, t, sh, tokens, t.n)
	sh.lease = e.cluster.store.NextLease()
	e.cluster.store.Track(sh.lease, sh.slots)
	t.mode = ticketTracked
}
