package mock

import (
	"container/list"
	"context"
	"maps"
	"sync"
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
	// released slot is handed to the front waiter by closing its channel, so a
	// newcomer can never overtake someone already queued.
	waiters list.List
}

// newPool returns a pool admitting limit requests at once (0: unlimited).
func newPool(limit int) *pool {
	return &pool{limit: limit}
}

// acquire takes a slot, waiting in FIFO order while the pool is full. It
// gives up with ctx's error when ctx ends first, leaving the queue as if it
// had never joined.
func (p *pool) acquire(ctx context.Context) error {
	p.mu.Lock()
	if p.waiters.Len() == 0 && (p.limit == 0 || p.inFlight < p.limit) {
		p.inFlight++
		p.mu.Unlock()
		return nil
	}
	ready := make(chan struct{})
	elem := p.waiters.PushBack(ready)
	p.mu.Unlock()

	select {
	case <-ready:
		return nil
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
	return ctx.Err()
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
	if front := p.waiters.Front(); front != nil {
		p.waiters.Remove(front)
		close(front.Value.(chan struct{}))
		return
	}
	p.inFlight--
}

// stats reports the pool's current occupancy.
func (p *pool) stats() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return PoolStats{Capacity: p.limit, InFlight: p.inFlight, Queued: p.waiters.Len()}
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
// hold each other's next slot. The returned release must be called exactly
// once when err is nil.
func (ps *pools) acquire(ctx context.Context, provider string) (release func(), err error) {
	var pp *pool
	if provider != "" {
		pp = ps.providerPool(provider)
		if err := pp.acquire(ctx); err != nil {
			return nil, err
		}
	}
	if err := ps.global.acquire(ctx); err != nil {
		if pp != nil {
			pp.release()
		}
		return nil, err
	}
	return func() {
		ps.global.release()
		if pp != nil {
			pp.release()
		}
	}, nil
}

// stats reports the global pool and every provider pool.
func (ps *pools) stats() (PoolStats, map[string]PoolStats) {
	ps.mu.Lock()
	byProvider := maps.Clone(ps.byProvider)
	ps.mu.Unlock()
	out := make(map[string]PoolStats, len(byProvider))
	for name, p := range byProvider {
		out[name] = p.stats()
	}
	return ps.global.stats(), out
}
