package policy

import (
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/statefile"
)

// dynStore holds the instances of one tenant-keyed family, created on demand and evicted when
// idle. It survives reloads that keep the family's name and key. Safe for concurrent use.
//
// Eviction never throws state away: an instance goes only when no request holds it (its lease
// has no references, so nothing is queued or in flight) and every budget window it has
// is empty (everything it charged has aged out). Until then it stays, and when the store is
// full of such instances new tenants share the overflow compartment. A tenant therefore can
// never get a fresh budget by being pushed out by other tenants or by going quiet.
//
// Instances sit in a list ordered by when they were last resolved, least recent at the back.
// Every search for something to evict starts at the back and looks at a bounded number of
// entries, moving those it must keep to the front, so creating an instance costs O(1) amortised
// whatever the store's size, under the store's own lock and never the scheduler's.
type dynStore struct {
	mu      sync.Mutex
	entries map[dynKey]*dynEntry
	// head is the most recently resolved entry, tail the least; nil when empty.
	head, tail *dynEntry
	max        int
	ttl        time.Duration
	overflow   *instance
	// restored holds windows a state file gave tenant compartments that do not exist yet, by
	// compartment ID (statefile.ID): each is restored when its tenant's compartment is created,
	// with the limits its first request brings (see claimRestored).
	restored map[string][]statefile.Window
	// examined counts entries eviction searches looked at (for tests of its cost).
	examined int64
}

// lease is what the store knows of the requests using one tenant compartment. Refreshed
// copies of an instance (after a reload) share it.
type lease struct {
	// refs counts requests that resolved the compartment and have not released it yet (queued
	// or in flight): the store evicts only unreferenced compartments.
	refs atomic.Int64
	// lastUsed is the Unix-nano time of the last resolution or release, for idle expiry.
	lastUsed atomic.Int64
}

// dynEntry is one instance in the store's recency list.
type dynEntry struct {
	key        dynKey
	in         *instance
	prev, next *dynEntry
}

// evictScan bounds the entries one eviction search looks at.
const evictScan = 16

// sweepScan is how many entries from the back each new instance checks for idle expiry, so
// that instances idle past the TTL go without a pass over the whole store.
const sweepScan = 4

func newDynStore() *dynStore { return &dynStore{entries: map[dynKey]*dynEntry{}} }

// resolve returns (creating if needed) the instance of family f for d under snapshot s,
// holding a reference the caller drops with release (or undo).
func (st *dynStore) resolve(s *Snapshot, f *family, d *Dims, now time.Time) *instance {
	key := f.dynKeyOf(d)
	st.mu.Lock()
	defer st.mu.Unlock()
	e := st.entries[key]
	if e == nil {
		st.evictLocked(now, false, sweepScan)
		if len(st.entries) >= st.max && !st.evictLocked(now, true, evictScan) {
			// Everything is busy or still holds budget: new tenants share one overflow
			// compartment rather than growing memory without bound.
			in := st.overflow
			in.lease.refs.Add(1)
			in.lease.lastUsed.Store(now.UnixNano())
			return in
		}
		// The key outlives the request: it must not share memory with the request's message.
		key.tenant = strings.Clone(key.tenant)
		e = &dynEntry{key: key, in: s.newDynamic(f, d)}
		if len(st.restored) > 0 {
			st.claimRestored(e.in, now)
		}
		st.entries[key] = e
	} else {
		st.unlink(e)
		if e.in.gen != s.gen {
			e.in = s.refreshDynamic(f, e.in, d)
		}
	}
	st.pushFront(e)
	e.in.lease.refs.Add(1)
	e.in.lease.lastUsed.Store(now.UnixNano())
	return e.in
}

// peek returns the instance of family f that d falls in if it exists, creating nothing and
// taking no reference (a view of it, e.g. for the quota endpoint); nil when there is none.
func (st *dynStore) peek(f *family, d *Dims) *instance {
	key := f.dynKeyOf(d)
	st.mu.Lock()
	defer st.mu.Unlock()
	if e := st.entries[key]; e != nil {
		return e.in
	}
	return nil
}

// release drops a reference taken by resolve.
func (st *dynStore) release(in *instance, now time.Time) {
	in.lease.lastUsed.Store(now.UnixNano())
	in.lease.refs.Add(-1)
}

// evictLocked looks at up to scan entries from the back of the list. An entry that must stay
// (held, or holding budget) moves to the front; an evictable one goes: when need is set, the
// first one found ends the search (reporting true); otherwise every one idle for the TTL goes,
// and the search stops at the first that is idle but not for long enough (the entries before it
// were resolved more recently still).
func (st *dynStore) evictLocked(now time.Time, need bool, scan int) bool {
	for i := 0; i < scan && st.tail != nil; i++ {
		e := st.tail
		st.examined++
		if !e.in.evictable(now) {
			st.unlink(e)
			st.pushFront(e)
			continue
		}
		if need || now.UnixNano()-e.in.lease.lastUsed.Load() >= int64(st.ttl) {
			st.unlink(e)
			delete(st.entries, e.key)
			e.in.closeFleet()
			if need {
				return true
			}
			continue
		}
		return false
	}
	return false
}

// evictable reports whether forgetting in loses nothing: no request holds it and every budget
// window it has is empty.
func (in *instance) evictable(now time.Time) bool {
	return in.lease.refs.Load() == 0 && in.budgetsEmpty(now)
}

// budgetsEmpty reports whether every budget window of in is empty at now.
func (in *instance) budgetsEmpty(now time.Time) bool {
	for _, w := range [...]*budget.Window{in.tpm, in.tpd, in.rpm} {
		if w != nil && !w.Empty(now) {
			return false
		}
	}
	return true
}

func (st *dynStore) unlink(e *dynEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		st.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		st.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

func (st *dynStore) pushFront(e *dynEntry) {
	e.next = st.head
	if st.head != nil {
		st.head.prev = e
	}
	st.head = e
	if st.tail == nil {
		st.tail = e
	}
}

// instances returns the store's instances and its overflow compartment.
func (st *dynStore) instances() []*instance {
	st.mu.Lock()
	defer st.mu.Unlock()
	out := make([]*instance, 0, len(st.entries)+1)
	for _, e := range st.entries {
		out = append(out, e.in)
	}
	return append(out, st.overflow)
}

// drained reports whether forgetting the whole store loses nothing: every instance, the
// overflow compartment included, is evictable.
func (st *dynStore) drained(now time.Time) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, e := range st.entries {
		if !e.in.evictable(now) {
			return false
		}
	}
	return st.overflow == nil || st.overflow.evictable(now)
}
