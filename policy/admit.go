package policy

import (
	"context"
	"errors"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
)

// Request is what admission needs to know about one request.
type Request struct {
	Dims     Dims
	Estimate Estimate
	// PromptBytes is the scanned prompt text size, for learning the bytes-per-token ratio.
	PromptBytes int64
	// CanRewriteModel reports that the caller can rewrite the request body's model (it holds
	// the whole body, a JSON object). Without it, a re-route to a provider whose models map
	// would change the model does not happen.
	CanRewriteModel bool
	// Stream reports that the request asks for a streamed answer: adaptive limits then follow
	// its wait for the first token (see Ticket.FirstToken).
	Stream bool
	// Now is when the request arrived, read from the engine's clock (Engine.Now) by a caller
	// that reads it anyway; zero: admission reads the clock itself. A request admitted in this
	// process without waiting is granted at Now (Ticket.GrantedAt); one that queued, or goes
	// through the cluster's shared store, when it got its slots.
	Now time.Time
	// Deadline is when the request's client gives up on it (Envoy's
	// x-envoy-expected-rq-timeout-ms, or gRPC's grpc-timeout, counted from the request's
	// arrival); zero: it did not say. The request is never queued past it, and is refused at
	// once when the predicted wait would take it past it.
	Deadline time.Time
}

// Admit decides on request r under snapshot s, filling t on admission. It may block up to the
// request's max_wait while queued; onQueue (may be nil) is called once before blocking with the
// longest possible wait, so the caller can extend Envoy's message timeout. A refused request
// holds nothing. When a provider's breaker is open and it has a fallback, or a feature's
// degrade rule applies, admission is retried with the other provider (never in a loop).
//
// The path that admits without waiting does not allocate.
func (e *Engine) Admit(ctx context.Context, s *Snapshot, r *Request, t *Ticket, onQueue func(time.Duration)) Decision {
	var d Decision
	e.AdmitInto(ctx, s, r, t, onQueue, &d)
	return d
}

// AdmitInto is Admit writing the decision to *d. The request path uses it: a decision passed up
// by value through every step of admission left a copy in each step's stack frame, and a deeper
// stack is one the goroutine serving the stream has to grow (copying it) first.
func (e *Engine) AdmitInto(ctx context.Context, s *Snapshot, r *Request, t *Ticket, onQueue func(time.Duration), d *Decision) {
	dims := r.Dims
	if dims.keyRefused {
		// No known API key, and the policy refuses such requests: nothing is charged.
		refuseInto(d, ReasonUnknownKey, "", 0, &dims)
		e.countDecision(s, d)
		e.recordRefusal(s, r, d)
		return
	}
	var visited uint64
	var firstReason Reason
	var firstIn string
	// Every attempt tries a provider not tried before, so the loop ends by one of its breaks;
	// its bound is only a guard.
	for attempt := 0; attempt <= len(s.providers); attempt++ {
		visited |= 1 << uint(dims.Provider)
		e.tryAdmit(ctx, s, r, dims, t, onQueue, d)
		if attempt > 0 && d.Verdict == Admit {
			d.Rerouted, d.Reason, d.Compartment = true, firstReason, firstIn
			f := s.features[dims.Feature]
			e.rec.Rerouted(f.name, s.providers[r.Dims.Provider].name, s.providers[dims.Provider].name, firstReason)
		}
		if d.Verdict == Admit || d.Reason == ReasonCancelled {
			break
		}
		if attempt == 0 {
			firstReason, firstIn = d.Reason, d.Compartment
		}
		next := s.rerouteTarget(dims, d.Reason)
		if next < 0 || visited&(1<<uint(next)) != 0 {
			break
		}
		model, ok := s.modelFor(next, r)
		if !ok {
			// The target may not serve this model: refuse as the provider did rather than send it.
			e.rec.RerouteUnmapped(s.features[dims.Feature].name, s.providers[dims.Provider].name, s.providers[next].name)
			break
		}
		dims.Provider, dims.Model = next, model
	}
	if d.Dims.Model != r.Dims.Model {
		d.OriginalModel = r.Dims.Model
	}
	e.countDecision(s, d)
	e.recordRefusal(s, r, d)
}

// modelFor returns the model request r is sent as when re-routed to provider p: the first entry
// of p's models map that matches r's classified model, or that model unchanged when p has no
// map. ok is false when p has a map without an entry for the model, or the entry changes the
// model and the caller cannot rewrite the body: p is then no option for r.
func (s *Snapshot) modelFor(p int, r *Request) (model string, ok bool) {
	models := s.providers[p].models
	if models == nil {
		return r.Dims.Model, true
	}
	for i := range models {
		m := &models[i]
		if !globMatch(m.glob, r.Dims.Model) {
			continue
		}
		if m.keep || m.model == r.Dims.Model {
			return r.Dims.Model, true
		}
		return m.model, r.CanRewriteModel
	}
	return "", false
}

// rerouteTarget returns the provider to try after a refusal for reason, or -1.
func (s *Snapshot) rerouteTarget(d Dims, reason Reason) int {
	if reason == ReasonCircuitOpen || reason == ReasonProviderQuota {
		return s.providers[d.Provider].fallback
	}
	if dg := s.features[d.Feature].degrade; dg != nil {
		for _, on := range dg.On {
			if Reason(on) == reason {
				if i, ok := s.providerIdx[dg.Provider]; ok && i != d.Provider {
					return i
				}
			}
		}
	}
	return -1
}

func (e *Engine) countDecision(s *Snapshot, d *Decision) {
	f := s.features[d.Dims.Feature].rec
	if d.Verdict == Admit {
		f.Admitted()
		return
	}
	f.Rejected(d.Reason)
}

// tryAdmit runs the admission steps for one provider choice: rate limits, the provider's
// breaker, token budgets, then concurrency. A failure at any step undoes the earlier ones.
func (e *Engine) tryAdmit(ctx context.Context, s *Snapshot, r *Request, dims Dims, t *Ticket, onQueue func(time.Duration), d *Decision) {
	now := r.Now
	if now.IsZero() {
		now = e.clock.Now()
	}
	if s.modelKeyed {
		dims.modelGroup = s.modelGroup(dims.Model)
	}
	t.engine, t.snap, t.dims, t.est, t.bytes = e, s, dims, r.Estimate, r.PromptBytes
	t.n, t.brk, t.active, t.mode, t.quota = 0, nil, false, ticketLocal, nil
	t.done.Store(false)
	t.firstToken.Store(false)
	for _, f := range s.families {
		if !f.applies(&dims) {
			continue
		}
		var in *instance
		if f.dyn != nil {
			in = f.dyn.resolve(s, f, &dims, now)
		} else {
			in = f.instances[f.staticIndex(&dims)]
		}
		if in == nil {
			continue
		}
		t.insts[t.n], t.set[t.n] = in, in.c
		t.rpm[t.n], t.tpm[t.n], t.tpd[t.n] = budget.Charge{}, budget.Charge{}, budget.Charge{}
		t.charged[t.n] = [numWins]leasedWindow{}
		t.n++
	}
	if cs := e.cluster; cs != nil && cs.leaser != nil {
		if cs.closed && !cs.store.Available() && !t.leasesValid(now) {
			// Redis is gone and the leases ran out: on_unavailable closed refuses.
			e.rec.ClusterUnavailable("refused")
			t.undo(now)
			refuseInto(d, ReasonClusterUnavailable, "cluster", cs.retryAfter(), &dims)
			return
		}
	} else if cs != nil {
		if cs.store.Available() {
			e.admit(ctx, s, r, dims, t, onQueue, now, time.Time{}, nil, true, d)
			return
		}
		if cs.closed {
			e.rec.ClusterUnavailable("refused")
			t.undo(now)
			refuseInto(d, ReasonClusterUnavailable, "cluster", cs.retryAfter(), &dims)
			return
		}
		if !cs.store.LocalStarted() {
			// Redis answers again: the request goes through it.
			e.admit(ctx, s, r, dims, t, onQueue, now, time.Time{}, nil, true, d)
			return
		}
		e.rec.ClusterUnavailable("local")
		again := e.admit(ctx, s, r, dims, t, onQueue, now, time.Time{}, cs.backContext(), false, d)
		cs.store.LocalEnded()
		if again {
			// Waiting for a slot here, the request saw Redis answer again: it goes through it,
			// for what is left of its max wait.
			e.admit(ctx, s, r, dims, t, nil, e.clock.Now(), now.Add(t.want(r, &dims, now).MaxWait), nil, true, d)
		}
		return
	}
	e.admit(ctx, s, r, dims, t, onQueue, now, time.Time{}, nil, false, d)
}

// acquireLocal waits for t's slots here, as Acquire does, and stops waiting (a cancelled
// refusal) once back is done, when back is not nil.
func (e *Engine) acquireLocal(ctx context.Context, t *Ticket, want bulkhead.Want, onQueue func(time.Duration), back context.Context) error {
	if back == nil {
		return e.sched.Acquire(ctx, t.set[:t.n], t.held[:t.n], want, onQueue)
	}
	wctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(back, cancel)
	err := e.sched.Acquire(wctx, t.set[:t.n], t.held[:t.n], want, onQueue)
	stop()
	cancel()
	return err
}

// refuseInto writes to *d the decision refusing a request with dims for reason, by compartment
// in. It is kept out of line: inlined at each refusal of the admission path, every copy would
// keep a decision-sized temporary in that path's stack frame, which every admitted request's
// goroutine then has to have room for.
//
//go:noinline
func refuseInto(d *Decision, reason Reason, in string, retry time.Duration, dims *Dims) {
	*d = Decision{Verdict: Reject, Reason: reason, Compartment: in, RetryAfter: retry, Dims: *dims}
}

// admit is the admission pipeline, one for every mode: request rates, the provider's breaker,
// token budgets, spend budgets, then concurrency and in-flight tokens (queueing with priority,
// tenant fairness and max_wait), each step undoing the earlier ones when it refuses. Where a
// compartment's counters are is the steps' business, not the order's:
//
//   - this process's windows and compartments: without a cluster, and with one while its shared
//     state is unavailable (the limits are then this replica's part);
//   - the compartment's lease of the fleet's limits (leased cluster admission, see leased.go);
//   - Redis, per request (exact cluster admission, viaRedis): the windows and the slots are
//     checked and taken together by one script at the last step (commitShared), so the first
//     steps only stage them; when the breaker or a spend budget refuses, Redis is asked which
//     window, if any, would have refused first (the refusal's reason is then that window's, as
//     in every other mode).
//
// back, when not nil, ends a wait for a slot here when the shared state answers again: the
// request then has taken nothing (what it charged here is given back) and admit reports again,
// to be admitted through the shared state instead.
func (e *Engine) admit(ctx context.Context, s *Snapshot, r *Request, dims Dims, t *Ticket, onQueue func(time.Duration), now, deadline time.Time, back context.Context, viaRedis bool, d *Decision) (again bool) {
	refuse := func(reason Reason, in string, retry time.Duration) {
		t.undo(now)
		refuseInto(d, reason, in, retry, &dims)
	}
	tokens, n := r.Estimate.Total, t.n

	unavailable := func() {
		e.rec.ClusterUnavailable("refused")
		refuse(ReasonClusterUnavailable, "cluster", e.cluster.retryAfter())
	}

	// 1. Request rates (staged for Redis's script with exact admission).
	for i := 0; i < t.n && !viaRedis; i++ {
		in := t.insts[i]
		if in.rpm == nil {
			continue
		}
		ch, ok, wait, off := e.reserveWindow(ctx, t, i, winRPM, 1, in.limits.Shadow, now)
		if off {
			unavailable()
			return
		}
		if !ok {
			if !in.limits.Shadow {
				refuse(ReasonRateLimit, in.name, wait)
				d.Limits.refusedByWindow(t, i, winRPM, true, now)
				return false
			}
			e.rec.ShadowRefusal(s.label(in), ReasonRateLimit)
		}
		t.rpm[i] = ch
	}

	// 2. The provider's breaker, and an upstream retry-after holding this tenant back; then
	// the provider's own quota, as its responses last told it.
	if e.checkBreaker(s, dims, t, now, d) || e.reserveQuota(s, r, &dims, t, now, d) {
		t.undo(now)
		if viaRedis {
			e.refusedByWindowFirst(ctx, s, t, n, tokens, true, d)
		}
		return false
	}

	// 3. Token budgets, reserved at the estimate (staged with exact admission).
	for i := 0; i < t.n && !viaRedis; i++ {
		in := t.insts[i]
		for _, wb := range [2]struct {
			k  int
			w  *budget.Window
			ch *budget.Charge
		}{{winTPM, in.tpm, &t.tpm[i]}, {winTPD, in.tpd, &t.tpd[i]}} {
			if wb.w == nil {
				continue
			}
			ch, ok, wait, off := e.reserveWindow(ctx, t, i, wb.k, tokens, in.limits.Shadow, now)
			if off {
				unavailable()
				return
			}
			if !ok {
				if !in.limits.Shadow {
					refuse(ReasonTokenBudget, in.name, wait)
					d.Limits.refusedByWindow(t, i, wb.k, false, now)
					return false
				}
				e.rec.ShadowRefusal(s.label(in), ReasonTokenBudget)
			}
			*wb.ch = ch
		}
	}

	// 3b. Spend budgets, reserved at the worst-case cost.
	if e.reserveSpend(ctx, s, r, dims, t, now, d) {
		if viaRedis && d.Reason == ReasonSpendBudget {
			e.refusedByWindowFirst(ctx, s, t, n, tokens, false, d)
		}
		return false
	}
	if viaRedis {
		// 1, 3 and 4 in one script: the windows in order, then the slots.
		return e.commitShared(ctx, s, r, dims, t, onQueue, now, deadline, d)
	}

	// 4. Concurrency and in-flight tokens, possibly waiting (within this replica's part of them
	// while it cannot count the others' slots: see sharedState).
	if e.cluster != nil {
		e.capTicket(t)
	}
	want := t.want(r, &dims, now)
	if !deadline.IsZero() {
		want.MaxWait = max(min(want.MaxWait, deadline.Sub(now)), 0)
	}
	if e.sched.TryAcquire(t.set[:t.n], t.held[:t.n], want) {
		t.grantedAt = now
	} else if grew, told := e.leaseGrew(ctx, t, want, onQueue); grew {
		// A lease grew in a round the request asked for.
		t.grantedAt = e.clock.Now()
	} else if err := e.acquireLocal(ctx, t, want, queueHook(onQueue, told), back); err != nil {
		if back != nil && back.Err() != nil && ctx.Err() == nil {
			// The shared state answers again: ask it instead.
			t.undoLocal(e.clock.Now())
			return true
		}
		var rf *bulkhead.Refusal
		if errors.As(err, &rf) {
			reason := ReasonBulkheadFull
			if rf.Cause == bulkhead.CauseCancelled {
				reason = ReasonCancelled
			}
			refuse(reason, rf.Compartment.Name(), rf.RetryAfter)
			return false
		}
		refuse(ReasonBulkheadFull, "", 0)
		return false
	} else {
		t.grantedAt = e.clock.Now()
	}
	t.active = true
	t.startAdaptive(r.Stream)
	if e.cluster != nil && e.cluster.leaser == nil {
		e.trackLocal(s, t, tokens)
	}
	e.inflight.Add(1)
	s.features[dims.Feature].rec.TokensReserved(tokens)
	*d = Decision{Verdict: Admit, Dims: dims}
	return false
}

// checkBreaker runs the provider's breaker for dims, and an upstream retry-after holding this
// tenant back. On a pass it leaves the breaker's permit in t; on a refusal it returns the
// decision in *d (t keeps what it held: the caller undoes it).
//
// A provider whose limits run in shadow refuses nothing here: the refusal is counted and the
// call goes on without a permit, so its outcome is not recorded and the breaker runs its course
// (OPEN, then probes) as if it were enforced.
func (e *Engine) checkBreaker(s *Snapshot, dims Dims, t *Ticket, now time.Time, d *Decision) (refused bool) {
	refuse := func(reason Reason, in string, retry time.Duration) bool {
		refuseInto(d, reason, in, retry, &dims)
		return true
	}
	if bs := s.providers[dims.Provider].breakers; bs != nil {
		if wait := bs.holds.until(dims.Tenant, now); wait > 0 {
			if !bs.shadow {
				return refuse(ReasonRateLimit, "provider/"+s.providers[dims.Provider].name, wait)
			}
			e.rec.ShadowRefusal(bs.label, ReasonRateLimit)
		}
		b := bs.For(dims.Model)
		p, err := b.Acquire(now)
		if err != nil && bs.shadow {
			e.rec.ShadowRefusal(bs.label, ReasonCircuitOpen)
		} else if err != nil {
			retry := b.RemainingOpen(now)
			// OPEN refuses up to and including the instant its wait ends, where RemainingOpen
			// already says 0: probes are then a moment away, not a whole wait_in_open.
			// FORCED_OPEN (no end) and HALF_OPEN without probe permits get wait_in_open.
			if retry <= 0 && b.State() != breaker.Open {
				retry = bs.cfg.WaitInOpen
			}
			fallback := ""
			if fb := s.providers[dims.Provider].fallback; fb >= 0 {
				fallback = s.providers[fb].name
			}
			e.rec.BreakerRefused(b, retry, fallback, now)
			return refuse(ReasonCircuitOpen, "provider/"+s.providers[dims.Provider].name, retry)
		} else {
			t.brk, t.permit = b, p
		}
	}
	return false
}

// label is the metrics label of an instance: its name, or its family's "<family>/*" for
// tenant-keyed instances unless tenant labels are enabled.
func (s *Snapshot) label(in *instance) string {
	if in.family.dyn != nil && !s.tenantLabel {
		return in.family.name + "/*"
	}
	return in.name
}
