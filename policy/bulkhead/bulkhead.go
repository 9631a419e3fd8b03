// Package bulkhead implements compartments: concurrency and in-flight-token limits with a
// bounded, deadline-aware, tenant-fair priority queue, and pools that let compartments borrow
// each other's idle capacity.
//
// A request takes a slot in every compartment it belongs to, all or nothing. All compartments
// of a Scheduler share one mutex, so taking several slots is atomic and two requests can never
// deadlock; a request never holds a slot while it waits for another. A waiting request sits in
// the queue of the compartment that blocks it; when that compartment frees capacity, its queue is
// served fairly, and a waiter then blocked by another compartment moves to that one's queue.
//
// Imports: only the standard library. Imported by: package policy (which composes the
// compartments) and policy/observe (which reads their Stats).
package bulkhead

// The Scheduler's one lock covers compartments, queues, pools, caps and leases: room and
// dispatch read all of them together, so their code stays in one file.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// ErrFull is the cause of every refusal for lack of capacity; check with errors.Is.
var ErrFull = errors.New("bulkhead full")

// Limits are a compartment's limits. Zero means no limit for MaxConcurrent and
// MaxInflightTokens.
type Limits struct {
	MaxConcurrent     int64
	MaxInflightTokens int64
	// QueueDepth bounds the waiters blocked by this compartment.
	QueueDepth int64
	// Priority orders this compartment's waiters in a shared pool (higher first).
	Priority int64
	// Shadow counts what would be refused and refuses nothing.
	Shadow bool
}

// Compartment is one bulkhead. Its mutable state is guarded by its Scheduler; counters are
// atomics readable at any time. Safe for concurrent use through the Scheduler.
type Compartment struct {
	name string

	// Guarded by Scheduler.mu.
	limits   Limits
	inflight int64
	tokens   int64
	queue    fairQueue
	member   *member
	avgHold  float64 // EWMA of slot hold time, nanoseconds; 0 until the first release
	// remote and remoteTokens are the slots and in-flight tokens other replicas hold when the
	// limits are shared (cluster mode), as last reported: they count against the limits here,
	// so that requests queue in this replica instead of asking Redis for slots that are taken.
	remote, remoteTokens int64
	// pending and pendingTokens are the part of inflight and tokens taken by requests whose
	// shared admission is still being decided (cluster mode): they keep the room here, and count
	// as in flight or admitted only once confirmed.
	pending, pendingTokens int64
	// adaptive, when positive, is the concurrency limit in force instead of
	// limits.MaxConcurrent: a limit learned at run time (SetAdaptiveLimit). It is this
	// replica's own, so slots other replicas hold do not count against it.
	adaptive int64
	// leased: the limits are the fleet's, and this replica may hold leaseSlots slots and
	// leaseTokens in-flight tokens of them (leased cluster admission, SetLease). The configured
	// limits still predict queue waits: capacity comes back from the whole fleet.
	// leasePart says the lease is this replica's part of the limits while the fleet's shared
	// state is unavailable: Stats then shows it as the limits in force.
	leased, leasePart       bool
	leaseSlots, leaseTokens int64
	// wanted and wantedTokens count the requests queued in any compartment whose set includes
	// c, and the tokens they estimate: a request waits in one queue at a time (the compartment
	// that holds it back) but needs a slot here too, so c's lease must cover it whichever
	// compartment it waits in.
	wanted, wantedTokens int64
	// leaseDrained, when set (SetLeaseDrained), is called when a release frees a slot (or
	// in-flight tokens) above c's lease: the lease shrank below what c held, and what the
	// release frees is the fleet's to hand on. Called under the scheduler's lock: it must not
	// block nor call the scheduler.
	leaseDrained func()
	// capped is set while this replica may hold only its part of the limits (cluster mode,
	// while the replicas cannot count each other's slots: see Cap): at most capSlots slots and
	// capTokens in-flight tokens (negative: that limit is not capped). capGen names the episode
	// the cap was computed for. wideSlots and wideTokens are the part with its share of the room
	// that was free, which a narrow cap holds back until Widen.
	capped                bool
	capSlots, capTokens   int64
	wideSlots, wideTokens int64
	capGen                uint64

	admitted       atomic.Uint64
	saturations    atomic.Uint64
	refused        atomic.Uint64
	shadowRefusals atomic.Uint64
	queued         atomic.Uint64
	timedOut       atomic.Uint64
}

// NewCompartment returns a compartment named name with limits l. Register it with no Scheduler:
// any Scheduler may serve it, but one compartment must only ever be used with one Scheduler.
func NewCompartment(name string, l Limits) *Compartment {
	return &Compartment{name: name, limits: l}
}

// Name returns the compartment's name, e.g. "feature/chat".
func (c *Compartment) Name() string { return c.name }

// CountShadowRefusal counts a refusal a shadow-mode compartment would have made elsewhere
// (in the shared state of a cluster).
func (c *Compartment) CountShadowRefusal() { c.shadowRefusals.Add(1) }

// Stats is a point-in-time view of a compartment.
type Stats struct {
	Name string
	// Limits are the limits in force: MaxConcurrent is the adaptive limit when there is one.
	Limits Limits
	// Adaptive reports that MaxConcurrent is an adaptive limit (SetAdaptiveLimit).
	Adaptive       bool
	InFlight       int64
	InFlightTokens int64
	Queued         int
	// Remote and RemoteTokens are what other replicas hold (cluster mode), as last reported.
	Remote, RemoteTokens int64
	// Pending counts slots held here while their shared admission is decided (not in InFlight).
	Pending int64
	// Capped says Limits are this replica's part of the compartment's limits (see Cap).
	Capped bool
	// Leased says the limits are the fleet's and this replica holds a lease of LeaseSlots slots
	// and LeaseTokens in-flight tokens of them (SetLease); LeasePart that the lease is this
	// replica's part of the limits while the fleet cannot be asked.
	Leased, LeasePart       bool
	LeaseSlots, LeaseTokens int64
	// Pool, Guaranteed and PoolMax describe pool membership (Pool empty when none).
	Pool            string
	Guaranteed      int64
	PoolMax         int64
	AvgHold         time.Duration
	Admitted        uint64
	Refused         uint64
	ShadowRefusals  uint64
	QueuedTotal     uint64
	TimedOutInQueue uint64
}

// Pool is capacity shared by member compartments. Guarded by its Scheduler.
type Pool struct {
	name     string
	capacity int64
	inflight int64
	members  []*member
}

type member struct {
	c          *Compartment
	pool       *Pool
	guaranteed int64
	max        int64
}

// PoolMember configures one member of a pool.
type PoolMember struct {
	Compartment *Compartment
	Guaranteed  int64
	Max         int64
}

// PoolStats is a point-in-time view of a pool.
type PoolStats struct {
	Name     string
	Capacity int64
	InFlight int64
}

// Scheduler serves a set of compartments and pools. Safe for concurrent use.
type Scheduler struct {
	mu    sync.Mutex
	pools []*Pool

	// Now returns the current time for wait measurements; nil means time.Now. Waiting itself
	// uses the runtime's timers, so tests control it with testing/synctest.
	Now func() time.Time

	// checkTake, when set (tests only), runs under the lock after every grant.
	checkTake func(set []*Compartment)

	// OnWait, if set, is called (outside the lock) after a request that had to queue either got
	// its slots or gave up; waited is the time spent queued. Set it before first use.
	OnWait func(c *Compartment, waited time.Duration, admitted bool)
}

// Want describes what a request asks for.
type Want struct {
	// Tokens is the request's token estimate, held in every compartment with an in-flight-token
	// limit until release (clamped to the limit, so an oversized request fits an empty compartment).
	Tokens int64
	// Tenant keys fairness inside queues.
	Tenant string
	// Priority orders waiters (higher first).
	Priority int64
	// MaxWait is the longest the request may queue; 0 refuses at once when full.
	MaxWait time.Duration
	// Now is the admission time.
	Now time.Time
	// Pending takes the slots provisionally: they keep the room but count as in flight (and the
	// request as admitted) only after Confirm. Abandon gives back slots never confirmed.
	Pending bool
}

// Cause says why a request was refused.
type Cause uint8

// Refusal causes.
const (
	// CauseFull: no capacity and the request may not wait.
	CauseFull Cause = iota
	// CauseQueueFull: the queue is at its depth.
	CauseQueueFull
	// CauseWaitTooLong: the predicted wait exceeds the request's max wait.
	CauseWaitTooLong
	// CauseTimedOut: the request waited its max wait without getting a slot.
	CauseTimedOut
	// CauseCancelled: the request's context ended while it waited.
	CauseCancelled
)

// String names the cause for logs.
func (c Cause) String() string {
	switch c {
	case CauseFull:
		return "full"
	case CauseQueueFull:
		return "queue_full"
	case CauseWaitTooLong:
		return "predicted_wait_too_long"
	case CauseTimedOut:
		return "timed_out"
	case CauseCancelled:
		return "cancelled"
	}
	return "unknown"
}

// Refusal is the error Acquire returns when it does not grant. It wraps ErrFull, or the
// context's error for CauseCancelled.
type Refusal struct {
	// Compartment is the compartment that refused.
	Compartment *Compartment
	Cause       Cause
	// RetryAfter is the predicted time until a slot frees (0 when unknown).
	RetryAfter time.Duration
	ctxErr     error
}

func (r *Refusal) Error() string {
	return fmt.Sprintf("compartment %s: %s", r.Compartment.name, r.Cause)
}

// Unwrap returns ErrFull, or the context error of a cancelled wait.
func (r *Refusal) Unwrap() error {
	if r.Cause == CauseCancelled {
		return r.ctxErr
	}
	return ErrFull
}

// waiter is a request queued for slots. Guarded by Scheduler.mu except ready.
type waiter struct {
	set     []*Compartment
	held    []int64
	tokens  int64
	cost    int64
	tenant  string
	prio    int64
	pending bool
	in      *Compartment // the compartment whose queue holds it
	granted bool
	ready   chan struct{}
	since   time.Time
}

// TryAcquire is Acquire's path that does not wait: it takes a slot in every compartment of set
// and reports true, or takes nothing and reports false when one of them has no room now (or
// others wait before w). It takes the lock once and does not allocate.
func (s *Scheduler) TryAcquire(set []*Compartment, held []int64, w Want) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tryTake(set, held, w)
}

// tryTake takes what w wants when there is room for it now. Called with s.mu held.
func (s *Scheduler) tryTake(set []*Compartment, held []int64, w Want) bool {
	if s.blocker(set, w.Tokens, true) != nil {
		return false
	}
	s.take(set, held, w.Tokens, w.Pending)
	return true
}

// Acquire takes a slot in every compartment of set, or none. On success held[i] is set to the
// tokens held in set[i]; pass the same set and held to Release. When capacity is short and
// w.MaxWait allows, it queues; onQueue (may be nil) is called once, outside the lock, with the
// longest time the request may now wait, before Acquire blocks. It returns a *Refusal on refusal.
//
// The uncontended path takes the lock once and does not allocate.
func (s *Scheduler) Acquire(ctx context.Context, set []*Compartment, held []int64, w Want, onQueue func(time.Duration)) error {
	s.mu.Lock()
	if s.tryTake(set, held, w) {
		s.mu.Unlock()
		return nil
	}
	return s.queue(ctx, set, held, w, onQueue)
}

// queue is Acquire's slow path; it is entered with s.mu held and releases it.
func (s *Scheduler) queue(ctx context.Context, set []*Compartment, held []int64, want Want, onQueue func(time.Duration)) error {
	b := s.blocker(set, want.Tokens, true)
	ahead := b.queue.ahead(want.Priority)
	predicted := b.predict(ahead)
	refuse := func(cause Cause, retry time.Duration) error {
		b.refused.Add(1)
		s.mu.Unlock()
		return &Refusal{Compartment: b, Cause: cause, RetryAfter: retry}
	}
	switch {
	case want.MaxWait <= 0:
		return refuse(CauseFull, max(predicted, b.holdEstimate()))
	case int64(b.queue.len()) >= b.limits.QueueDepth:
		return refuse(CauseQueueFull, max(predicted, b.holdEstimate()))
	case predicted > want.MaxWait:
		return refuse(CauseWaitTooLong, predicted)
	}
	wt := &waiter{
		set: set, held: held, tokens: want.Tokens, cost: max(want.Tokens, 1),
		tenant: want.Tenant, prio: want.Priority, pending: want.Pending, in: b, ready: make(chan struct{}, 1), since: want.Now,
	}
	b.queue.push(wt)
	wt.count(1)
	b.queued.Add(1)
	s.mu.Unlock()

	if onQueue != nil {
		onQueue(want.MaxWait)
	}
	timer := time.NewTimer(want.MaxWait)
	defer timer.Stop()
	var ctxErr error
	select {
	case <-wt.ready:
		s.observeWait(wt, true)
		return nil
	case <-ctx.Done():
		ctxErr = ctx.Err()
	case <-timer.C:
	}

	s.mu.Lock()
	if wt.granted {
		// Granted while we were giving up: the slots are ours, and the caller releases them.
		s.mu.Unlock()
		s.observeWait(wt, true)
		return nil
	}
	in := wt.in
	in.queue.remove(wt, false)
	wt.count(-1)
	// The leaver may have been the head blocking smaller waiters behind it.
	s.dispatch(in)
	in.refused.Add(1)
	cause := CauseTimedOut
	if ctxErr != nil {
		cause = CauseCancelled
	} else {
		in.timedOut.Add(1)
	}
	retry := max(in.predict(in.queue.ahead(wt.prio)), in.holdEstimate())
	s.mu.Unlock()
	s.observeWait(wt, false)
	return &Refusal{Compartment: in, Cause: cause, RetryAfter: retry, ctxErr: ctxErr}
}

// count adds the waiter to (n = 1) or removes it from (n = -1) the demand of every compartment
// of its set. Called with s.mu held.
func (w *waiter) count(n int64) {
	for _, c := range w.set {
		c.wanted += n
		c.wantedTokens += n * w.tokens
	}
}

func (s *Scheduler) observeWait(w *waiter, admitted bool) {
	if s.OnWait != nil {
		// The waiter's clock started at admission; the wall time since is the wait.
		s.OnWait(w.in, s.now().Sub(w.since), admitted)
	}
}

func (s *Scheduler) now() time.Time {
	if s.Now != nil {
		return s.Now()
	}
	return time.Now()
}

// Release gives back the slots Acquire took. now is the release time; heldSince the grant time
// (for the hold-time average that predicts waits).
func (s *Scheduler) Release(set []*Compartment, held []int64, heldSince, now time.Time) {
	s.mu.Lock()
	s.giveBack(set, held, float64(now.Sub(heldSince)))
	s.mu.Unlock()
}

// giveBack frees set's slots and serves the queues that were waiting for them; a positive hold
// (nanoseconds) feeds the hold-time average. Called with s.mu held.
func (s *Scheduler) giveBack(set []*Compartment, held []int64, hold float64) {
	for i, c := range set {
		if c.leased && c.leaseDrained != nil && c.overLease() {
			c.leaseDrained()
		}
		c.inflight--
		c.tokens -= held[i]
		if m := c.member; m != nil {
			m.pool.inflight--
		}
		if hold > 0 {
			if c.avgHold == 0 {
				c.avgHold = hold
			} else {
				c.avgHold += 0.1 * (hold - c.avgHold)
			}
		}
	}
	for _, c := range set {
		if c.queue.len() > 0 {
			s.dispatch(c)
		}
		if m := c.member; m != nil {
			s.dispatchPool(m.pool)
		}
	}
}

// Confirm turns slots taken with Want.Pending into ordinary ones: they count as in flight, and
// the request as admitted, from now on. Release them as usual.
func (s *Scheduler) Confirm(set []*Compartment, held []int64) {
	s.mu.Lock()
	for i, c := range set {
		c.pending--
		c.pendingTokens -= held[i]
		c.admitted.Add(1)
	}
	s.mu.Unlock()
}

// Abandon gives back slots taken with Want.Pending and never confirmed. The hold-time average
// is not touched: the request never ran.
func (s *Scheduler) Abandon(set []*Compartment, held []int64) {
	s.mu.Lock()
	for i, c := range set {
		c.pending--
		c.pendingTokens -= held[i]
	}
	s.giveBack(set, held, 0)
	s.mu.Unlock()
}

// blocker returns the first compartment of set (in order) that cannot take a request of tokens
// now, or nil. A compartment with waiters blocks newcomers so they cannot jump its queue. A
// request already queued is held back only by capacity: were it also held back by other queues,
// two queues whose heads wait on each other would stall with capacity free.
func (s *Scheduler) blocker(set []*Compartment, tokens int64, newcomer bool) *Compartment {
	for _, c := range set {
		if c.limits.Shadow {
			continue
		}
		if newcomer && c.queue.len() > 0 {
			return c
		}
		if !s.room(c, tokens) {
			return c
		}
	}
	return nil
}

// Fits reports whether c alone (and its pool) has capacity now for one more request of tokens.
func (s *Scheduler) Fits(c *Compartment, tokens int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.room(c, tokens)
}

// room reports whether c alone (and its pool) has capacity for one more request.
func (s *Scheduler) room(c *Compartment, tokens int64) bool {
	l := c.limits
	if m := c.member; m != nil {
		if c.inflight >= m.max || m.pool.inflight >= m.pool.capacity {
			return false
		}
		if c.inflight >= m.guaranteed && s.guaranteedWaiting(m) {
			return false
		}
	} else if c.leased {
		if l.MaxConcurrent > 0 && c.inflight >= c.leaseSlots {
			return false
		}
		if l.MaxInflightTokens > 0 && c.tokens+min(tokens, l.MaxInflightTokens) > c.leaseTokens {
			return false
		}
		return true
	} else if c.adaptive > 0 {
		if c.inflight >= c.adaptive {
			return false
		}
	} else if l.MaxConcurrent > 0 && c.inflight+c.remote >= l.MaxConcurrent {
		return false
	}
	if used := c.tokens + c.remoteTokens; l.MaxInflightTokens > 0 && used > 0 && used+min(tokens, l.MaxInflightTokens) > l.MaxInflightTokens {
		return false
	}
	if c.capped {
		if c.capSlots >= 0 && c.inflight >= c.capSlots {
			return false
		}
		if c.capTokens >= 0 && c.tokens+min(tokens, l.MaxInflightTokens) > c.capTokens {
			return false
		}
	}
	return true
}

// guaranteedWaiting reports whether another member of m's pool is below its guarantee with
// requests waiting: idle capacity is then theirs, not m's to borrow.
func (s *Scheduler) guaranteedWaiting(m *member) bool {
	for _, o := range m.pool.members {
		if o != m && o.c.inflight < o.guaranteed && o.c.queue.len() > 0 {
			return true
		}
	}
	return false
}

// take occupies a slot in every compartment of set and counts shadow refusals. Pending slots are
// counted as admitted by Confirm.
func (s *Scheduler) take(set []*Compartment, held []int64, tokens int64, pending bool) {
	for i, c := range set {
		l := c.limits
		h := tokens
		if l.MaxInflightTokens > 0 {
			h = min(tokens, l.MaxInflightTokens)
		}
		lim := c.maxConcurrent()
		if l.Shadow {
			over := (lim > 0 && c.inflight >= lim) ||
				(l.MaxInflightTokens > 0 && c.tokens > 0 && c.tokens+h > l.MaxInflightTokens)
			if over {
				c.shadowRefusals.Add(1)
			}
		}
		if c.leased {
			// A learned limit leased from the fleet is saturated at this replica's lease.
			lim = c.leaseSlots
		}
		if c.adaptive > 0 && (c.inflight+1 >= lim || c.queue.len() > 0) {
			c.saturations.Add(1)
		}
		c.inflight++
		c.tokens += h
		held[i] = h
		if m := c.member; m != nil {
			m.pool.inflight++
		}
		if pending {
			c.pending++
			c.pendingTokens += h
		} else {
			c.admitted.Add(1)
		}
	}
	if s.checkTake != nil {
		s.checkTake(set)
	}
}

// dispatch serves c's queue while its head waiters can be admitted, moving a head that another
// compartment's capacity now blocks to that compartment's queue. It reports whether it granted
// anyone.
func (s *Scheduler) dispatch(c *Compartment) bool {
	granted := false
	for c.queue.len() > 0 {
		w := c.queue.peek()
		b := s.blocker(w.set, w.tokens, false)
		switch {
		case b == nil:
			c.queue.remove(w, true)
			w.count(-1)
			s.take(w.set, w.held, w.tokens, w.pending)
			w.granted = true
			w.ready <- struct{}{}
			granted = true
		case b == c:
			return granted
		default:
			c.queue.remove(w, true)
			w.in = b
			b.queue.push(w)
		}
	}
	return granted
}

// dispatchPool offers a pool's free capacity to its members: members below their guarantee
// first, then higher priority first. Every round grants someone or stops, so it ends.
func (s *Scheduler) dispatchPool(p *Pool) {
	for p.inflight < p.capacity {
		var tried uint64
		granted := false
		for range p.members {
			var best *member
			bi := -1
			for i, m := range p.members {
				if tried&(1<<i) != 0 || m.c.queue.len() == 0 {
					continue
				}
				if best == nil || better(m, best) {
					best, bi = m, i
				}
			}
			if best == nil {
				break
			}
			tried |= 1 << bi
			if s.dispatch(best.c) {
				granted = true
				break
			}
		}
		if !granted {
			return
		}
	}
}

func better(a, b *member) bool {
	aUnder, bUnder := a.c.inflight < a.guaranteed, b.c.inflight < b.guaranteed
	if aUnder != bUnder {
		return aUnder
	}
	return a.c.limits.Priority > b.c.limits.Priority
}

// predict estimates how long a request with ahead waiters in front of it will wait in c.
func (c *Compartment) predict(ahead int) time.Duration {
	if c.avgHold == 0 {
		return 0
	}
	slots := c.maxConcurrent()
	if m := c.member; m != nil {
		slots = m.max
	}
	if slots <= 0 {
		slots = max(c.inflight, 1)
	}
	return time.Duration(float64(ahead+1) * c.avgHold / float64(slots))
}

// holdEstimate is the expected time until one slot frees when nothing better is known.
func (c *Compartment) holdEstimate() time.Duration {
	slots := max(c.maxConcurrent(), 1)
	return time.Duration(c.avgHold / float64(slots))
}

// maxConcurrent is the concurrency limit in force: the adaptive one when set. Called with the
// Scheduler's lock held.
func (c *Compartment) maxConcurrent() int64 {
	if c.adaptive > 0 {
		return c.adaptive
	}
	if c.capped && c.capSlots >= 0 && c.capSlots < c.limits.MaxConcurrent {
		return c.capSlots
	}
	return c.limits.MaxConcurrent
}

// SetAdaptiveLimit puts n in force as c's concurrency limit instead of its configured
// MaxConcurrent (n <= 0 returns to the configured one). SetLimits leaves it in place. A lower
// limit revokes nothing: requests in flight keep their slots and nothing new is admitted until
// use drops below it; a higher one admits waiters at once. The predicted wait of a queued
// request is computed from the limit in force. Counted in flight against n are this replica's
// requests only: an adaptive limit is per replica.
func (s *Scheduler) SetAdaptiveLimit(c *Compartment, n int64) {
	s.mu.Lock()
	c.adaptive = max(n, 0)
	if c.queue.len() > 0 {
		s.dispatch(c)
	}
	s.mu.Unlock()
}

// SetLease puts a lease of c's limits in force (leased cluster admission): this replica may hold
// slots of its concurrency limit and tokens of its in-flight-token limit. part says the lease is
// this replica's part of the limits while the fleet cannot be asked (Stats shows it as the
// limits); otherwise the limits shown stay the fleet's. A smaller lease revokes nothing: requests
// in flight keep their slots and nothing new is admitted until use drops below it; a larger one
// admits waiters at once.
func (s *Scheduler) SetLease(c *Compartment, slots, tokens int64, part bool) {
	s.mu.Lock()
	c.leased, c.leasePart, c.leaseSlots, c.leaseTokens = true, part, max(slots, 0), max(tokens, 0)
	if c.queue.len() > 0 {
		s.dispatch(c)
	}
	s.mu.Unlock()
}

// SetLeaseDrained has f called whenever a release frees a slot, or in-flight tokens, above c's
// lease (see SetLease): the lease shrank below what c held. f is called under the scheduler's
// lock: it must not block nor call the scheduler. nil removes it.
func (s *Scheduler) SetLeaseDrained(c *Compartment, f func()) {
	s.mu.Lock()
	c.leaseDrained = f
	s.mu.Unlock()
}

// overLease reports whether c holds more than its lease, of slots or in-flight tokens.
func (c *Compartment) overLease() bool {
	return c.limits.MaxConcurrent > 0 && c.inflight > c.leaseSlots || c.limits.MaxInflightTokens > 0 && c.tokens > c.leaseTokens
}

// LeaseUsage returns what c holds here and what the requests queued for a slot in c wait for:
// every queued request whose set includes c, whichever compartment's queue holds it. With
// freeze, c first stops admitting beyond what it holds and what they need (its lease shrinks to
// its use) until the next SetLease.
func (s *Scheduler) LeaseUsage(c *Compartment, freeze bool) (inflight, tokens, waiting, waitingTokens int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if freeze && c.leased {
		c.leaseSlots, c.leaseTokens = min(c.leaseSlots, c.inflight+c.wanted), min(c.leaseTokens, c.tokens+c.wantedTokens)
	}
	return c.inflight, c.tokens, c.wanted, c.wantedTokens
}

// Saturations counts the admissions into c that took its last slot under an adaptive limit, or
// came while requests waited: the sign that the limit, not demand, bounds c.
func (c *Compartment) Saturations() uint64 { return c.saturations.Load() }

// SetLimits changes c's limits. Lowering a limit below current use admits nothing new until
// use drops below it; raising it admits waiters at once.
func (s *Scheduler) SetLimits(c *Compartment, l Limits) {
	s.mu.Lock()
	c.limits = l
	if c.queue.len() > 0 {
		// A raised limit, or a switch to shadow mode, lets waiters go at once.
		s.dispatch(c)
	}
	if m := c.member; m != nil {
		s.dispatchPool(m.pool)
	}
	s.mu.Unlock()
}

// SetRemote sets the slots and in-flight tokens other replicas hold in c (cluster mode). Room
// that a decrease frees goes to c's waiters at once.
func (s *Scheduler) SetRemote(c *Compartment, slots, tokens int64) {
	s.mu.Lock()
	s.setRemote(c, max(slots, 0), max(tokens, 0))
	s.mu.Unlock()
}

// SetRemoteTotal is SetRemote from totals over every replica, this one included: what c holds
// here (confirmed; pending slots are not in the totals yet) is subtracted.
func (s *Scheduler) SetRemoteTotal(c *Compartment, slots, tokens int64) {
	s.mu.Lock()
	s.setRemote(c, max(slots-(c.inflight-c.pending), 0), max(tokens-(c.tokens-c.pendingTokens), 0))
	s.mu.Unlock()
}

func (s *Scheduler) setRemote(c *Compartment, slots, tokens int64) {
	freed := slots < c.remote || tokens < c.remoteTokens
	c.remote, c.remoteTokens = slots, tokens
	if freed && c.queue.len() > 0 {
		s.dispatch(c)
	}
}

// Share says which part of a compartment's limits one replica may hold while the replicas
// cannot count each other's slots (cluster mode: the shared state is unavailable, or Redis does
// not yet hold every replica's slots again). Every replica computes its part from what the
// shared state was last known to count: what it counted for this replica (slots that ended
// since, their releases not sent, included) plus an equal part of the room free there. A
// replica admits nothing between the moment the shared state stops answering and the moment it
// notices (its slots only end meanwhile), so none ever holds more than its part: the parts add
// up to the limit at most, whatever each replica does alone, as long as the replicas had heard
// the shared state's last counts and each divides by at least the number of replicas.
//
// The share of the free room is safe only when every replica is cut off: one cut off alone (the
// others still reach the shared state) would take room the others take too. A narrow part is
// the replica's own slots alone, which the others go on counting whatever happens; Widen gives
// it its share of the free room once the shared state is known to be gone, not just slow.
type Share struct {
	// Gen names the episode: Cap leaves a compartment already capped for Gen as it is.
	Gen uint64
	// Replicas divides the limits (at least 1).
	Replicas int64
	// Slots caps the concurrency limit: false for an adaptive limit, this replica's own.
	Slots bool
	// Totals and TotalTokens are what every replica held (this one included), as last heard;
	// what the others held is taken as the larger of these less this replica's own and the
	// compartment's remote counts.
	Totals, TotalTokens int64
	// Lag and LagTokens are how much more the others count for this replica than it holds: its
	// releases they have not heard of yet, less its slots admitted without Redis and not
	// recorded there yet. It must not count what the others may not (an admission whose answer
	// was lost, say): the part is what they count plus an equal part of what they think free.
	Lag, LagTokens int64
	// ForgetRemote resets the remote counts: while the replicas do not reach each other through
	// the shared state, only the cap accounts for what the others hold.
	ForgetRemote bool
	// Tighten lowers the part of a compartment already capped for Gen to the part computed now,
	// when that is smaller: the replica was cut off again before the episode ended, and the
	// others may have taken what its first part left them since.
	Tighten bool
	// Narrow holds the part to what the others count for this replica until Widen.
	Narrow bool
}

// Cap puts c under its part of its limits for the episode sh describes, unless it already is,
// and returns the slots and in-flight tokens it may now hold (negative: not capped). Requests in
// flight keep their slots; no new one is admitted beyond the part.
func (s *Scheduler) Cap(c *Compartment, sh Share) (slots, tokens int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	again := c.capped && c.capGen == sh.Gen
	if again && !sh.Tighten {
		return c.capSlots, c.capTokens
	}
	n := max(sh.Replicas, 1)
	// part returns this replica's own slots as the others count them, and its part with its
	// share of the free room.
	part := func(limit, held, pending, lag, remote, total int64) (own, wide int64) {
		if limit <= 0 {
			return -1, -1
		}
		// What the others know of this replica: they count it as holding seen (its slots that
		// ended since, their releases not sent, included; its slots admitted without Redis
		// and not recorded there, excluded: the lag says both). Never more than they count:
		// the part is built on it.
		seen := max(held-pending+lag, 0)
		others := max(remote, total-seen, 0)
		free := max(limit-seen-others, 0)
		return seen, seen + free/n
	}
	ownSlots, wideSlots := int64(-1), int64(-1)
	if sh.Slots {
		ownSlots, wideSlots = part(c.limits.MaxConcurrent, c.inflight, c.pending, sh.Lag, c.remote, sh.Totals)
	}
	ownTokens, wideTokens := part(c.limits.MaxInflightTokens, c.tokens, c.pendingTokens, sh.LagTokens, c.remoteTokens, sh.TotalTokens)
	if again {
		// Never beyond the part of the episode's start: the others' parts were computed with it.
		wideSlots, wideTokens = lowerCap(c.wideSlots, wideSlots), lowerCap(c.wideTokens, wideTokens)
		ownSlots, ownTokens = lowerCap(wideSlots, ownSlots), lowerCap(wideTokens, ownTokens)
	}
	c.wideSlots, c.wideTokens = wideSlots, wideTokens
	c.capSlots, c.capTokens = wideSlots, wideTokens
	if sh.Narrow {
		c.capSlots, c.capTokens = ownSlots, ownTokens
	}
	c.capped, c.capGen = true, sh.Gen
	if sh.ForgetRemote {
		c.remote, c.remoteTokens = 0, 0
	}
	return c.capSlots, c.capTokens
}

// Widen gives c, capped for episode gen, its share of the room that was free (see Share.Narrow).
// Waiters go at once if there is room.
func (s *Scheduler) Widen(c *Compartment, gen uint64) {
	s.mu.Lock()
	if c.capped && c.capGen == gen && (c.capSlots != c.wideSlots || c.capTokens != c.wideTokens) {
		c.capSlots, c.capTokens = c.wideSlots, c.wideTokens
		if c.queue.len() > 0 {
			s.dispatch(c)
		}
	}
	s.mu.Unlock()
}

// lowerCap returns the lower of two caps, where a negative one is no cap.
func lowerCap(a, b int64) int64 {
	switch {
	case a < 0:
		return b
	case b < 0:
		return a
	}
	return min(a, b)
}

// Uncap lifts c's cap: the replicas count each other's slots again. Waiters the cap held back go
// at once if there is room.
func (s *Scheduler) Uncap(c *Compartment) {
	s.mu.Lock()
	if c.capped {
		c.capped, c.capGen = false, 0
		if c.queue.len() > 0 {
			s.dispatch(c)
		}
	}
	s.mu.Unlock()
}

// CapGen returns the episode c is capped for, 0 when it is not capped.
func (s *Scheduler) CapGen(c *Compartment) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !c.capped {
		return 0
	}
	return c.capGen
}

// Remote returns what other replicas hold in c, as last reported.
func (s *Scheduler) Remote(c *Compartment) (slots, tokens int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return c.remote, c.remoteTokens
}

// Waiting reports whether requests are queued in c.
func (s *Scheduler) Waiting(c *Compartment) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return c.queue.len() > 0
}

// SetPools replaces every pool. Compartments not in any pool leave their old one; capacity in
// use carries over (a pool's use is recomputed from its members' in-flight counts).
func (s *Scheduler) SetPools(pools []PoolSpec) []*Pool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.pools {
		for _, m := range p.members {
			m.c.member = nil
		}
	}
	out := make([]*Pool, 0, len(pools))
	for _, spec := range pools {
		p := &Pool{name: spec.Name, capacity: spec.Capacity}
		for _, pm := range spec.Members {
			m := &member{c: pm.Compartment, pool: p, guaranteed: pm.Guaranteed, max: pm.Max}
			pm.Compartment.member = m
			p.members = append(p.members, m)
			p.inflight += pm.Compartment.inflight
		}
		out = append(out, p)
	}
	s.pools = out
	for _, p := range out {
		s.dispatchPool(p)
	}
	return out
}

// PoolSpec configures a pool for SetPools.
type PoolSpec struct {
	Name     string
	Capacity int64
	Members  []PoolMember
}

// Stats returns a point-in-time view of c.
func (s *Scheduler) Stats(c *Compartment) Stats {
	s.mu.Lock()
	st := Stats{
		Name: c.name, Limits: c.limits, InFlight: c.inflight - c.pending, InFlightTokens: c.tokens - c.pendingTokens,
		Adaptive: c.adaptive > 0,
		Queued:   c.queue.len(), AvgHold: time.Duration(c.avgHold), Remote: c.remote, RemoteTokens: c.remoteTokens,
		Pending: c.pending,
	}
	if m := c.member; m != nil {
		st.Pool, st.Guaranteed, st.PoolMax = m.pool.name, m.guaranteed, m.max
	}
	st.Limits.MaxConcurrent = c.maxConcurrent()
	if c.capped && c.capTokens >= 0 && c.capTokens < st.Limits.MaxInflightTokens {
		st.Limits.MaxInflightTokens = c.capTokens
	}
	st.Capped = c.capped
	st.Leased, st.LeasePart, st.LeaseSlots, st.LeaseTokens = c.leased, c.leasePart, c.leaseSlots, c.leaseTokens
	if c.leased && c.leasePart {
		if c.limits.MaxConcurrent > 0 && c.adaptive == 0 {
			st.Limits.MaxConcurrent = min(c.leaseSlots, c.limits.MaxConcurrent)
		}
		if c.limits.MaxInflightTokens > 0 {
			st.Limits.MaxInflightTokens = min(c.leaseTokens, c.limits.MaxInflightTokens)
		}
		st.Capped = true
	}
	s.mu.Unlock()
	st.Admitted = c.admitted.Load()
	st.Refused = c.refused.Load()
	st.ShadowRefusals = c.shadowRefusals.Load()
	st.QueuedTotal = c.queued.Load()
	st.TimedOutInQueue = c.timedOut.Load()
	return st
}

// PoolStats returns a point-in-time view of every pool.
func (s *Scheduler) PoolStats() []PoolStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]PoolStats, len(s.pools))
	for i, p := range s.pools {
		out[i] = PoolStats{Name: p.name, Capacity: p.capacity, InFlight: p.inflight}
	}
	return out
}

// Idle reports whether c has nothing in flight and no request queued for it (in its queue or,
// needing a slot here too, in another's).
func (s *Scheduler) Idle(c *Compartment) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return c.inflight == 0 && c.queue.len() == 0 && c.wanted == 0
}

// RetryAfterSeconds rounds a predicted wait up to whole seconds, at least 1, as the
// retry-after header needs.
func RetryAfterSeconds(d time.Duration) int64 {
	return max(1, int64(math.Ceil(d.Seconds())))
}
