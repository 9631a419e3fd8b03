package mock

import (
	"container/list"
	"context"
	"maps"
	"sync"
	"time"
)

// pool is a counting semaphore whose waiters are served strictly first in,
// first out, modelling a provider that queues requests when overloaded. A
// limit of zero never makes anyone wait but still counts what is in flight.
// It is safe for concurrent use.
type pool struct {
	mu       sync.Mutex
	limit    int
	inFlight int
	// waiters holds one chan struct{} per waiting request, oldest first; a
	// free slot is handed to the front waiter by closing its channel, so a
	// newcomer can never overtake someone already queued.
	waiters list.List
	// waited counts the requests that had to queue and waitedFor sums how
	// long they queued (real time), since the pool was made or last reset.
	waited    int64
	waitedFor time.Duration
}

// newPool returns a pool admitting limit requests at once (0: unlimited).
func newPool(limit int) *pool {
	return &pool{limit: limit}
}

// acquire takes a slot, waiting in FIFO order while the pool is full, and
// returns how long it waited. It gives up with ctx's error when ctx ends
// first, leaving the queue as if it had never joined.
func (p *pool) acquire(ctx context.Context) (time.Duration, error) {
	p.mu.Lock()
	if p.waiters.Len() == 0 && p.freeLocked() {
		p.inFlight++
		p.mu.Unlock()
		return 0, nil
	}
	queued := time.Now()
	ready := make(chan struct{})
	elem := p.waiters.PushBack(ready)
	p.mu.Unlock()

	select {
	case <-ready:
		wait := time.Since(queued)
		p.mu.Lock()
		p.waited++
		p.waitedFor += wait
		p.mu.Unlock()
		return wait, nil
	case <-ctx.Done():
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-ready:
		// The slot was handed over just as the caller gave up: pass it on.
		p.releaseLocked()
	default:
		p.waiters.Remove(elem)
	}
	return 0, ctx.Err()
}

// freeLocked reports whether a slot is free; p.mu must be held.
func (p *pool) freeLocked() bool {
	return p.limit == 0 || p.inFlight < p.limit
}

// setLimit changes the pool's limit (0: unlimited). Lowering it revokes
// nothing: the requests in service keep their slots and the queue waits until
// fewer than the new limit are in service. Raising it hands the new slots to
// the oldest waiters at once.
func (p *pool) setLimit(limit int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.limit = limit
	p.grantLocked()
}

// grantLocked hands free slots to the front waiters; p.mu must be held.
func (p *pool) grantLocked() {
	for p.freeLocked() {
		front := p.waiters.Front()
		if front == nil {
			return
		}
		p.waiters.Remove(front)
		p.inFlight++
		close(front.Value.(chan struct{}))
	}
}

// release returns a slot taken by acquire, handing it straight to the oldest
// waiter if there is one.
func (p *pool) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.releaseLocked()
}

// releaseLocked is release with p.mu held.
func (p *pool) releaseLocked() {
	p.inFlight--
	p.grantLocked()
}

// stats reports the pool's current occupancy and its waits, converting them
// to simulated time by dividing by scale.
func (p *pool) stats(scale float64) PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return PoolStats{Capacity: p.limit, InFlight: p.inFlight, Queued: p.waiters.Len(),
		Waited: p.waited, WaitSeconds: p.waitedFor.Seconds() / scale}
}

// resetWaits zeroes the wait counters.
func (p *pool) resetWaits() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.waited, p.waitedFor = 0, 0
}

// PoolStats is the occupancy of one capacity pool at one instant. It is a
// plain value and safe for concurrent use.
type PoolStats struct {
	// Capacity is the pool's limit; zero means unlimited.
	Capacity int `json:"capacity"`
	// InFlight is how many requests hold a slot (are being processed).
	InFlight int `json:"in_flight"`
	// Queued is how many requests wait for a slot.
	Queued int `json:"queued"`
	// Waited counts the requests that waited for a slot before being served,
	// and WaitSeconds sums their waits in simulated seconds, since the server
	// started or was last reset. A request that gave up waiting counts in
	// neither.
	Waited      int64   `json:"waited"`
	WaitSeconds float64 `json:"wait_seconds"`
}

// pools holds the whole-provider pool and one pool per x-llm-provider value.
// It is safe for concurrent use.
type pools struct {
	global *pool

	mu         sync.Mutex
	byProvider map[string]*pool
}

// newPools builds the pools for a capacity and per-provider capacities.
func newPools(capacity int, perProvider map[string]int) *pools {
	ps := &pools{
		global:     newPool(capacity),
		byProvider: make(map[string]*pool, len(perProvider)),
	}
	for name, c := range perProvider {
		ps.byProvider[name] = newPool(c)
	}
	return ps
}

// providerPool returns the pool of provider, creating an unlimited one on
// first sight so its occupancy is visible. Past maxTrackedProviders distinct
// names, unknown providers share one unlimited pool, so client-chosen header
// values cannot grow memory without bound.
func (ps *pools) providerPool(provider string) *pool {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if p, ok := ps.byProvider[provider]; ok {
		return p
	}
	if len(ps.byProvider) >= maxTrackedProviders {
		provider = overflowLabel
		if p, ok := ps.byProvider[provider]; ok {
			return p
		}
	}
	p := newPool(0)
	ps.byProvider[provider] = p
	return p
}

// acquire takes a slot in the provider's pool (when provider is not empty)
// and then in the global pool, always in that order so two requests can never
// hold each other's next slot; wait is how long that took in real time. The
// returned release must be called exactly once when err is nil.
func (ps *pools) acquire(ctx context.Context, provider string) (release func(), wait time.Duration, err error) {
	var pp *pool
	if provider != "" {
		pp = ps.providerPool(provider)
		w, err := pp.acquire(ctx)
		if err != nil {
			return nil, 0, err
		}
		wait += w
	}
	w, err := ps.global.acquire(ctx)
	if err != nil {
		if pp != nil {
			pp.release()
		}
		return nil, 0, err
	}
	wait += w
	return func() {
		ps.global.release()
		if pp != nil {
			pp.release()
		}
	}, wait, nil
}

// stats reports the global pool and every provider pool, waits in
// simulated time (real time divided by scale).
func (ps *pools) stats(scale float64) (PoolStats, map[string]PoolStats) {
	ps.mu.Lock()
	byProvider := maps.Clone(ps.byProvider)
	ps.mu.Unlock()
	out := make(map[string]PoolStats, len(byProvider))
	for name, p := range byProvider {
		out[name] = p.stats(scale)
	}
	return ps.global.stats(scale), out
}

// resetWaits zeroes the wait counters of every pool.
func (ps *pools) resetWaits() {
	ps.mu.Lock()
	byProvider := maps.Clone(ps.byProvider)
	ps.mu.Unlock()
	ps.global.resetWaits()
	for _, p := range byProvider {
		p.resetWaits()
	}
}
