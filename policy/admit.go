package policy

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/adaptive"
	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// Reason is a stable refusal code, used alike in the x-bulkhead-reason header, metrics and
// logs.
type Reason string

// Refusal reasons.
const (
	ReasonTokenBudget  Reason = "token_budget"
	ReasonRateLimit    Reason = "rate_limit"
	ReasonBulkheadFull Reason = "bulkhead_full"
	ReasonCircuitOpen  Reason = "circuit_open"
	ReasonBadRequest   Reason = "bad_request"
	// ReasonServerBusy: the server holds as many request bodies as it may
	// (server.max_buffered_body_bytes); the request was refused before it was classified.
	ReasonServerBusy Reason = "server_busy"
	// ReasonCancelled: the client went away while the request was queued; nobody is left to
	// answer.
	ReasonCancelled Reason = "cancelled"
	// ReasonClusterUnavailable: limits are shared through Redis, Redis is slow or gone, and
	// cluster.on_unavailable is closed.
	ReasonClusterUnavailable Reason = "cluster_unavailable"
	// ReasonSpendBudget: a spend budget (spend_per_hour, spend_per_day, spend_per_month) cannot
	// cover the request's worst-case cost until its window resets.
	ReasonSpendBudget Reason = "spend_budget"
)

// Sentinel errors for each refusal reason; Decision.Err wraps one, for errors.Is.
var (
	ErrTokenBudget  = errors.New("token budget exhausted")
	ErrRateLimit    = errors.New("request rate exceeded")
	ErrBulkheadFull = bulkhead.ErrFull
	ErrCircuitOpen  = breaker.ErrOpen
	ErrBadRequest   = errors.New("bad request")
	ErrServerBusy   = errors.New("server busy")
	ErrCancelled    = context.Canceled
	// ErrClusterUnavailable: the shared state could not be reached and the policy refuses then.
	ErrClusterUnavailable = errors.New("cluster state unavailable")
	ErrSpendBudget        = errors.New("spend budget exhausted")
)

// Verdict is what to do with a request.
type Verdict uint8

// Verdicts.
const (
	// Reject refuses the request (ImmediateResponse).
	Reject Verdict = iota
	// Admit lets it through, possibly re-routed to another provider.
	Admit
)

// Decision is the outcome of admission.
type Decision struct {
	Verdict Verdict
	// Reason says why a request was refused, or why it was re-routed.
	Reason Reason
	// Compartment names the compartment (or provider breaker) that refused, or that made the
	// request re-route.
	Compartment string
	// RetryAfter is when a retry can succeed: refill time, predicted queue wait or remaining
	// open time.
	RetryAfter time.Duration
	// Dims are the request's final dimensions (Provider changes on re-route, and Model when the
	// target's models map names another model).
	Dims Dims
	// Rerouted reports that Dims.Provider differs from the classified provider.
	Rerouted bool
	// OriginalModel is the classified model when a re-route changed Dims.Model to the model
	// the target's models map names (an admitted request's body must then be rewritten to
	// Dims.Model); empty otherwise.
	OriginalModel string
	// Limits are the refusing compartment's window that had no room, for a rate_limit or
	// token_budget refusal by a request rate or token budget; empty otherwise.
	Limits RefusalLimits
	// SpendReset is when the refusing spend budget's window ends (a spend_budget refusal).
	SpendReset time.Time
	// SpendOverLimit says the request's worst-case cost is more than the refusing spend
	// budget's whole limit: it would be refused even by an untouched window.
	SpendOverLimit bool
}

// Err returns nil for an admission, else an error wrapping the reason's sentinel.
func (d Decision) Err() error {
	if d.Verdict == Admit {
		return nil
	}
	var base error
	switch d.Reason {
	case ReasonTokenBudget:
		base = ErrTokenBudget
	case ReasonRateLimit:
		base = ErrRateLimit
	case ReasonCircuitOpen:
		base = ErrCircuitOpen
	case ReasonBadRequest:
		base = ErrBadRequest
	case ReasonServerBusy:
		base = ErrServerBusy
	case ReasonCancelled:
		base = ErrCancelled
	case ReasonClusterUnavailable:
		base = ErrClusterUnavailable
	case ReasonSpendBudget:
		base = ErrSpendBudget
	default:
		base = ErrBulkheadFull
	}
	return fmt.Errorf("%s: %w", d.Compartment, base)
}

// RetryAfterSeconds is RetryAfter rounded up to whole seconds, at least 1.
func (d Decision) RetryAfterSeconds() int64 { return bulkhead.RetryAfterSeconds(d.RetryAfter) }

// Message is the human sentence for a refusal: what happened and when to retry. It names only
// the caller's own compartment and never another tenant or internal numbers.
func (d Decision) Message() string {
	secs := d.RetryAfterSeconds()
	unit := "seconds"
	if secs == 1 {
		unit = "second"
	}
	switch d.Reason {
	case ReasonTokenBudget:
		return fmt.Sprintf("Token budget of %s is used up for now. Retry after %d %s.", d.Compartment, secs, unit)
	case ReasonRateLimit:
		return fmt.Sprintf("Too many requests for %s. Retry after %d %s.", d.Compartment, secs, unit)
	case ReasonCircuitOpen:
		return fmt.Sprintf("The upstream provider (%s) is failing and calls to it are paused. Retry after %d %s.", d.Compartment, secs, unit)
	case ReasonBadRequest:
		return "The request body is not a valid JSON object."
	case ReasonServerBusy:
		return fmt.Sprintf("The server is busy. Retry after %d %s.", secs, unit)
	case ReasonCancelled:
		return "The client went away while the request was queued."
	case ReasonClusterUnavailable:
		return fmt.Sprintf("The service cannot check its shared limits right now. Retry after %d %s.", secs, unit)
	case ReasonSpendBudget:
		if d.SpendOverLimit {
			return fmt.Sprintf("The worst-case cost of this request is more than the whole spend budget of %s: ask for fewer output tokens (max_tokens).", d.Compartment)
		}
		return fmt.Sprintf("Spend budget of %s is used up until %s. Retry after %d %s.", d.Compartment, d.SpendReset.UTC().Format(time.RFC3339), secs, unit)
	}
	return fmt.Sprintf("Compartment %s is at capacity. Retry after %d %s.", d.Compartment, secs, unit)
}

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
}

// maxCompartments bounds the compartments one request can be in (one per family).
const maxCompartments = config.MaxFamilies

// Ticket is what an admitted request holds: slots, budget reservations and a breaker permit.
// Done releases everything exactly once. The zero Ticket is ready for Admit; a Ticket is
// meant to live inside the per-stream processor (no allocation per request). Admit and Done
// may be called from different goroutines; Done is idempotent and never blocks.
type Ticket struct {
	engine *Engine
	snap   *Snapshot
	dims   Dims
	est    Estimate
	bytes  int64

	n     int
	insts [maxCompartments]*instance
	set   [maxCompartments]*bulkhead.Compartment
	held  [maxCompartments]int64
	rpm   [maxCompartments]budget.Charge
	tpm   [maxCompartments]budget.Charge
	tpd   [maxCompartments]budget.Charge
	// charged says where each window's charge was made (leased admission: the lease, or this
	// process's window).
	charged [maxCompartments][numWins]leasedWindow

	brk    *breaker.Breaker
	permit breaker.Permit

	grantedAt time.Time
	active    bool
	done      atomic.Bool
	// firstToken: FirstToken reported the first token to adaptive limits.
	firstToken atomic.Bool
	// handles are the request's handles in the adaptive limits of its compartments.
	handles [maxCompartments]adaptive.Handle

	// mode says where the admission's limits were enforced (cluster mode only).
	mode ticketMode
	// shared holds a cluster admission's lease and windows (allocated on first use).
	shared *sharedTicket
	// spend holds the reservation in spend budgets (allocated on first use, only by requests
	// that a spend budget applies to).
	spend *spend.Reservation
}

// ticketMode says where an admission's limits were enforced.
type ticketMode uint8

const (
	// ticketLocal: in this process alone (no cluster).
	ticketLocal ticketMode = iota
	// ticketShared: in the shared state (Redis), with the slots also held here.
	ticketShared
	// ticketTracked: in this process while the shared state was unavailable; the lease is
	// known to the store so that it counts everywhere once the store rewrites its leases.
	ticketTracked
)

// Admitted reports whether the ticket holds an admission not yet released.
func (t *Ticket) Admitted() bool { return t.active && !t.done.Load() }

// GrantedAt returns when the ticket was admitted (the engine's clock): the request's Now when it
// was admitted in this process without waiting, else when it got its slots (after queueing, or
// before asking the cluster's shared store). Zero before admission.
func (t *Ticket) GrantedAt() time.Time { return t.grantedAt }

// JoinCompartments returns the names of Compartments joined with commas, in one allocation.
func (t *Ticket) JoinCompartments() string {
	n := max(t.n-1, 0)
	for i := 0; i < t.n; i++ {
		n += len(t.insts[i].name)
	}
	var b strings.Builder
	b.Grow(n)
	for i := 0; i < t.n; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(t.insts[i].name)
	}
	return b.String()
}

// Compartments returns the names of the compartments the ticket holds slots in.
func (t *Ticket) Compartments() []string {
	out := make([]string, t.n)
	for i := 0; i < t.n; i++ {
		out[i] = t.insts[i].name
	}
	return out
}

// Remaining returns the tightest per-minute token budget among the ticket's compartments at
// now (the engine's clock): tokens left and time until it is full again. ok is false when no
// compartment has one.
func (t *Ticket) Remaining(now time.Time) (tokens int64, reset time.Duration, ok bool) {
	if t.mode == ticketShared {
		sh := t.shared
		return sh.remaining, sh.reset, sh.hasTPM
	}
	for i := 0; i < t.n; i++ {
		in := t.insts[i]
		if in.tpm == nil {
			continue
		}
		var left int64
		var in2 time.Duration
		if f := in.fleet; t.charged[i][winTPM] == chargedLease && f != nil && f.ls != nil {
			var known bool
			if left, in2, known = f.ls.Remaining(f.idx[winTPM]); !known {
				continue
			}
		} else {
			st := in.tpm.State(now)
			left, in2 = st.Remaining, st.ResetIn
		}
		if !ok || left < tokens {
			tokens, reset, ok = left, in2, true
		}
	}
	return tokens, reset, ok
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
			e.metrics.rerouted.WithLabelValues(f.name, s.providers[r.Dims.Provider].name, s.providers[dims.Provider].name, string(firstReason)).Inc()
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
			e.metrics.rerouteNoModel.WithLabelValues(s.features[dims.Feature].name, s.providers[dims.Provider].name, s.providers[next].name).Inc()
			break
		}
		dims.Provider, dims.Model = next, model
	}
	if d.Dims.Model != r.Dims.Model {
		d.OriginalModel = r.Dims.Model
	}
	e.countDecision(s, d)
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
	if reason == ReasonCircuitOpen {
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
	f := s.features[d.Dims.Feature].stats
	if d.Verdict == Admit {
		f.admitted.Inc()
		f.admittedN.Add(1)
		return
	}
	i := reasonIndex(d.Reason)
	f.rejected[i].Inc()
	f.rejectedN[i].Add(1)
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
	t.n, t.brk, t.active, t.mode = 0, nil, false, ticketLocal
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
			cs.unavailable.WithLabelValues("refused").Inc()
			t.undo(now)
			refuseInto(d, ReasonClusterUnavailable, "cluster", cs.retryAfter(), &dims)
			return
		}
	} else if cs != nil {
		if cs.store.Available() {
			e.admitShared(ctx, s, r, dims, t, onQueue, now, time.Time{}, d)
			return
		}
		if cs.closed {
			cs.unavailable.WithLabelValues("refused").Inc()
			t.undo(now)
			refuseInto(d, ReasonClusterUnavailable, "cluster", cs.retryAfter(), &dims)
			return
		}
		if !cs.store.LocalStarted() {
			// Redis answers again: the request goes through it.
			e.admitShared(ctx, s, r, dims, t, onQueue, now, time.Time{}, d)
			return
		}
		cs.unavailable.WithLabelValues("local").Inc()
		again := e.admitLocal(ctx, s, r, dims, t, onQueue, now, time.Time{}, cs.backContext(), d)
		cs.store.LocalEnded()
		if again {
			// Waiting for a slot here, the request saw Redis answer again: it goes through it,
			// for what is left of its max wait.
			e.admitShared(ctx, s, r, dims, t, nil, e.clock.Now(), now.Add(t.want(r.Estimate.Total, dims.Tenant, now).MaxWait), d)
		}
		return
	}
	e.admitLocal(ctx, s, r, dims, t, onQueue, now, time.Time{}, nil, d)
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

// admitLocal runs admission against this process's own compartments and windows: always
// without a cluster, and with one while its shared state is unavailable (the limits are then
// this replica's part). back, when not nil, ends a wait for a slot when the shared state
// answers again: the request then has taken nothing (what it charged here is given back) and
// admitLocal reports again, to be admitted through the shared state instead.
func (e *Engine) admitLocal(ctx context.Context, s *Snapshot, r *Request, dims Dims, t *Ticket, onQueue func(time.Duration), now, deadline time.Time, back context.Context, d *Decision) (again bool) {
	refuse := func(reason Reason, in string, retry time.Duration) {
		t.undo(now)
		refuseInto(d, reason, in, retry, &dims)
	}

	unavailable := func() {
		e.cluster.unavailable.WithLabelValues("refused").Inc()
		refuse(ReasonClusterUnavailable, "cluster", e.cluster.retryAfter())
	}

	// 1. Request rates.
	for i := 0; i < t.n; i++ {
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
			e.metrics.countShadow(s.label(in), ReasonRateLimit)
		}
		t.rpm[i] = ch
	}

	// 2. The provider's breaker, and an upstream retry-after holding this tenant back.
	if e.checkBreaker(s, dims, t, now, d) {
		t.undo(now)
		return false
	}

	// 3. Token budgets, reserved at the estimate.
	tokens := r.Estimate.Total
	for i := 0; i < t.n; i++ {
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
				e.metrics.countShadow(s.label(in), ReasonTokenBudget)
			}
			*wb.ch = ch
		}
	}

	// 3b. Spend budgets, reserved at the worst-case cost.
	if e.reserveSpend(ctx, s, r, dims, t, now, d) {
		return false
	}

	// 4. Concurrency and in-flight tokens, possibly waiting (within this replica's part of them
	// while it cannot count the others' slots: see sharedState).
	if e.cluster != nil {
		e.capTicket(t)
	}
	want := t.want(tokens, dims.Tenant, now)
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
	s.features[dims.Feature].stats.tokensReserved.Add(float64(tokens))
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
			e.metrics.countShadow(bs.label, ReasonRateLimit)
		}
		b := bs.For(dims.Model)
		p, err := b.Acquire(now)
		if err != nil && bs.shadow {
			e.metrics.countShadow(bs.label, ReasonCircuitOpen)
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
			e.logBreakerRefusal(b, retry, fallback, now)
			return refuse(ReasonCircuitOpen, "provider/"+s.providers[dims.Provider].name, retry)
		} else {
			t.brk, t.permit = b, p
		}
	}
	return false
}

// want is what the request asks of the scheduler: the highest priority and the shortest
// max_wait among its enforced compartments.
func (t *Ticket) want(tokens int64, tenant string, now time.Time) bulkhead.Want {
	w := bulkhead.Want{Tokens: tokens, Tenant: tenant, Now: now}
	first := true
	for i := 0; i < t.n; i++ {
		l := t.insts[i].limits
		if l.Shadow {
			continue
		}
		w.Priority = max(w.Priority, l.Priority)
		if l.HasMaxWait && (first || l.MaxWait < w.MaxWait) {
			w.MaxWait, first = l.MaxWait, false
		}
	}
	return w
}

// undo returns everything a refused admission took.
func (t *Ticket) undo(now time.Time) {
	t.undoLocal(now)
	for i := 0; i < t.n; i++ {
		if in := t.insts[i]; in.family.dyn != nil {
			in.family.dyn.release(in, now)
		}
	}
	if t.spend != nil {
		t.spend.Release(now)
	}
	t.n = 0
}

// undoLocal gives back what an admission took in this process's own windows, and the breaker
// permit; the ticket keeps its compartments and its spend reservation (another attempt, through
// the cluster's shared store, reuses them).
func (t *Ticket) undoLocal(now time.Time) {
	for i := 0; i < t.n; i++ {
		in := t.insts[i]
		if in.rpm != nil {
			t.refundWindow(i, winRPM, t.rpm[i], now)
		}
		if in.tpm != nil {
			t.refundWindow(i, winTPM, t.tpm[i], now)
		}
		if in.tpd != nil {
			t.refundWindow(i, winTPD, t.tpd[i], now)
		}
		t.rpm[i], t.tpm[i], t.tpd[i] = budget.Charge{}, budget.Charge{}, budget.Charge{}
	}
	if t.brk != nil {
		t.brk.Release(t.permit)
		t.brk = nil
	}
}

// label is the metrics label of an instance: its name, or its family's "<family>/*" for
// tenant-keyed instances unless tenant labels are enabled.
func (s *Snapshot) label(in *instance) string {
	if in.family.dyn != nil && !s.tenantLabel {
		return in.family.name + "/*"
	}
	return in.name
}

// Outcome is what happened to an admitted request, reported once when its stream ends.
type Outcome struct {
	// Status is the upstream response status, 0 when the stream ended without response headers.
	Status int
	// TTFB is admission to the first token: the arrival of the first response body chunk with
	// generated content (for a stream, the first event with generated text; for a JSON body,
	// its first byte). A response whose body was not read has its Headers time here, and a read
	// body that ended without any content the time it ended. 0 without response headers.
	// slow_call_measure: ttfb compares it with slow_call_duration.
	TTFB time.Duration
	// Headers is admission to the response headers (0 without response headers).
	Headers time.Duration
	// Duration is admission to the end of the stream.
	Duration time.Duration
	// StreamError is an error the response body reported although the status said success
	// (an error event inside a 200 stream, or a 200 JSON body with an error object).
	StreamError StreamError
	// Cancelled reports that the client went away before the response was complete.
	Cancelled bool
	// RetryAfter is the upstream retry-after on a 429 or 503.
	RetryAfter time.Duration
	// Usage is what the response reported.
	Usage Usage
	// Model is the model the response says answered (its model field), empty when it did not
	// say; spend is priced by it.
	Model string
	// InterToken is the mean time between tokens after the first in a streamed response (0
	// when it did not stream or had fewer than two tokens); adaptive limits read it.
	InterToken time.Duration
	// At is when the request ended, read from the engine's clock (Engine.Now) by a caller that
	// reads it anyway; zero: Done reads the clock itself.
	At time.Time
}

// StreamError classifies an error reported inside a successful response.
type StreamError uint8

const (
	// StreamErrorNone: the body reported no error.
	StreamErrorNone StreamError = iota
	// StreamErrorServer: the provider failed the call (overloaded, server error, or an error of
	// unknown type); judged by the breaker's stream_error verdict (a failure by default).
	StreamErrorServer
	// StreamErrorRateLimited: a rate-limit error; judged as an upstream 429 (rate_limited_as).
	StreamErrorRateLimited
	// StreamErrorClient: the request was at fault (an invalid request); judged as a 400.
	StreamErrorClient
)

// Usage is the token use a response reported.
type Usage struct {
	Prompt, Completion, Total, Cached, Reasoning int64
	// Known: the response reported complete usage.
	Known bool
	// PromptKnown: the prompt count was reported even if the completion count was not.
	PromptKnown bool
	// ContentBytes is the generated text seen, for a partial estimate when usage is unknown.
	ContentBytes int64
	// AudioMillis is the audio the response reported it was billed for by duration, in
	// milliseconds (0: none reported), priced per second.
	AudioMillis int64
}

// Settled is how a finished request was charged.
type Settled struct {
	// Prompt and Completion are the settled parts; Total their sum.
	Prompt, Completion, Total int64
	// Estimated reports that the numbers are a partial estimate, not reported usage.
	Estimated bool
	// Clamped reports that the response claimed more than the request could have cost and was
	// settled at that bound instead.
	Clamped bool
	// Cost is what the request was charged in its spend budgets (HasCost: a spend budget
	// applied to it).
	Cost    spend.Micros
	HasCost bool
}

// maxReported bounds any one reported count before arithmetic (2^40, about 10^12 tokens).
const maxReported = 1 << 40

// Settle computes what a request with this outcome is charged: reported usage when known,
// else a partial estimate — the prompt (reported or estimated) plus completion tokens estimated
// from the content seen — for responses that started, the estimated prompt for a request
// cancelled before any response, and nothing for a failure without usage (it was not served).
//
// Reported numbers are not trusted blindly: negative counts count as zero, a total below its
// parts is ignored (a total above them is charged: it covers tokens the parts do not name), and
// each part is clamped to what the request could have cost (Estimate.MaxPrompt and
// MaxCompletion). The result is never negative.
func (t *Ticket) Settle(o Outcome) Settled {
	u := o.Usage
	// Negative counts are zero; beyond maxReported (far more than any bound) is maxReported, so
	// the sums below cannot overflow.
	sane := func(v int64) int64 { return min(max(v, 0), maxReported) }
	var st Settled
	switch {
	case u.Known:
		prompt, completion := sane(u.Prompt), sane(u.Completion)
		if total := sane(u.Total); total > prompt+completion {
			completion = total - prompt
		}
		st = Settled{Prompt: prompt, Completion: completion}
	default:
		prompt := t.est.Prompt
		if u.PromptKnown {
			prompt = sane(u.Prompt)
		}
		switch {
		case o.Status == 0 && o.Cancelled:
			st = Settled{Prompt: prompt, Estimated: true}
		case o.Status == 0 || (o.Status >= 400 && !u.PromptKnown):
			return Settled{Estimated: true}
		default:
			bpt := t.est.BytesPerToken
			if bpt <= 0 {
				bpt = 4
			}
			st = Settled{Prompt: prompt, Completion: int64(float64(sane(u.ContentBytes))/bpt + 0.5), Estimated: true}
		}
	}
	if t.est.Bounded && st.Prompt > t.est.MaxPrompt {
		st.Prompt, st.Clamped = t.est.MaxPrompt, true
	}
	if t.est.Bounded && st.Completion > t.est.MaxCompletion {
		st.Completion, st.Clamped = t.est.MaxCompletion, true
	}
	st.Total = st.Prompt + st.Completion
	return st
}

// Done releases everything the ticket holds and settles it against outcome o: slots back,
// budgets corrected from the estimate to the real use, the breaker told how the call went, the
// estimator taught the model's real prompt ratio. Idempotent; never blocks. The release is
// deferred before any settlement work, so slots, references and the in-flight count come back
// even if settlement fails.
func (t *Ticket) Done(o Outcome) (settled Settled) {
	if !t.active || !t.done.CompareAndSwap(false, true) {
		return Settled{}
	}
	e, s := t.engine, t.snap
	now := o.At
	if now.IsZero() {
		now = e.clock.Now()
	}
	recorded := false
	defer func() {
		if t.brk != nil && !recorded {
			t.brk.Release(t.permit)
		}
		for i := 0; i < t.n; i++ {
			if in := t.insts[i]; in.family.dyn != nil {
				in.family.dyn.release(in, now)
			}
		}
		e.inflight.Add(-1)
	}()
	e.sched.Release(t.set[:t.n], t.held[:t.n], t.grantedAt, now)
	t.observeAdaptive(o, now)
	if t.brk != nil {
		bs := s.providers[t.dims.Provider].breakers
		outcome, d, openFor := bs.judge.outcome(o)
		t.brk.RecordDetail(t.permit, outcome, d, now, breaker.Detail{Status: o.Status, Provider: bs.provider})
		recorded = true
		bs.holdFor(t.dims.Tenant, o.Status, openFor, t.brk, now)
	}
	settled = t.Settle(o)
	settled.Cost, settled.HasCost = t.settleSpend(o, settled, now)
	switch t.mode {
	case ticketShared:
		e.cluster.store.Settle(t.shared.lease, settled.Total, t.shared.windows)
	case ticketTracked:
		e.cluster.store.Settle(t.shared.lease, settled.Total, nil)
		fallthrough
	default:
		for i := 0; i < t.n; i++ {
			in := t.insts[i]
			if in.rpm != nil && t.charged[i][winRPM] == chargedOutage {
				// A request counted here while the lease could not be used counts in the
				// fleet's window too, once Redis answers.
				if f := in.fleet; f != nil && f.ls != nil {
					f.ls.AddBack(f.idx[winRPM], t.rpm[i].Amount())
				}
			}
			if in.tpm != nil {
				t.settleWindow(i, winTPM, t.tpm[i], settled.Total, now)
			}
			if in.tpd != nil {
				t.settleWindow(i, winTPD, t.tpd[i], settled.Total, now)
			}
		}
	}
	f := s.features[t.dims.Feature].stats
	f.promptSettled.Add(float64(settled.Prompt))
	f.completionSettled.Add(float64(settled.Completion))
	if settled.Clamped {
		f.usageClamped.Inc()
		e.logClamp(f.name, t.dims.Model, o.Usage, t.est)
	}
	if o.Usage.Known {
		if t.est.Total > 0 {
			f.estimateError.Observe(float64(settled.Total) / float64(t.est.Total))
		}
		// Learn from the text part only: media items have fixed costs of their own.
		if text := settled.Prompt - t.est.Media; t.bytes > 0 && text > 0 && !settled.Clamped && s.estimation.learn {
			e.est.learn(t.dims.Model, float64(t.bytes)/float64(text), s.startRatio(t.dims.Model), s.estimation)
		}
	} else if o.Status != 0 {
		f.usageUnknown.Inc()
	}
	return settled
}

// logClamp logs a clamped settlement, at most once a minute: one response claiming absurd usage
// is worth a line, a provider doing it on every response is what the metric is for.
func (e *Engine) logClamp(feature, model string, u Usage, est Estimate) {
	if !e.logDue(&e.clampLog) {
		return
	}
	e.log.Warn("reported usage is more than the request could cost; settled at the bound (further cases this minute are only counted in llm_bulkhead_usage_clamped_total)",
		"feature", feature, "model", model, "reported_prompt", u.Prompt, "reported_completion", u.Completion,
		"reported_total", u.Total, "max_prompt", est.MaxPrompt, "max_completion", est.MaxCompletion)
}
