package bulkhead

// fairQueue holds the waiters blocked by one compartment. Higher priority levels are served
// first; within a level, tenants are served by deficit round-robin weighted by each waiter's
// token estimate, so one tenant's thousand queued requests cannot starve another tenant's one;
// within a tenant, waiters are served in arrival order.
//
// It is not safe for concurrent use; the Scheduler's mutex guards it.
type fairQueue struct {
	n      int
	levels []*level // sorted by priority, highest first
}

// quantum is the credit (in tokens) a tenant earns per round. One round serves a tenant's
// typical request; a request of many times the quantum waits proportionally more rounds.
const quantum = 4096

type level struct {
	prio    int64
	tenants map[string]*tenantQueue
	active  []*tenantQueue // tenants with waiters, in round-robin order
	cursor  int
}

type tenantQueue struct {
	tenant  string
	waiters []*waiter // FIFO; head at index 0
	deficit int64
	active  bool
}

func (q *fairQueue) len() int { return q.n }

func (q *fairQueue) level(prio int64) *level {
	for i, l := range q.levels {
		if l.prio == prio {
			return l
		}
		if l.prio < prio {
			nl := &level{prio: prio, tenants: map[string]*tenantQueue{}}
			q.levels = append(q.levels, nil)
			copy(q.levels[i+1:], q.levels[i:])
			q.levels[i] = nl
			return nl
		}
	}
	nl := &level{prio: prio, tenants: map[string]*tenantQueue{}}
	q.levels = append(q.levels, nl)
	return nl
}

// push appends w behind the other waiters of its tenant.
func (q *fairQueue) push(w *waiter) {
	l := q.level(w.prio)
	tq := l.tenants[w.tenant]
	if tq == nil {
		tq = &tenantQueue{tenant: w.tenant}
		l.tenants[w.tenant] = tq
	}
	tq.waiters = append(tq.waiters, w)
	if !tq.active {
		tq.active = true
		l.active = append(l.active, tq)
	}
	q.n++
}

// peek returns the waiter that should be served next, advancing the round-robin state as
// deficit round-robin does. It returns nil when the queue is empty.
func (q *fairQueue) peek() *waiter {
	for _, l := range q.levels {
		if len(l.active) == 0 {
			continue
		}
		if l.cursor >= len(l.active) {
			l.cursor = 0
		}
		// Serve the first tenant, from the cursor on, whose credit covers its head waiter.
		if w := l.scan(); w != nil {
			return w
		}
		// Nobody has enough credit: give every active tenant the fewest whole rounds of quantum
		// that lets at least one of them be served, in one step rather than round by round.
		rounds := int64(-1)
		for _, tq := range l.active {
			need := tq.waiters[0].cost - tq.deficit
			r := (need + quantum - 1) / quantum
			if rounds < 0 || r < rounds {
				rounds = r
			}
		}
		for _, tq := range l.active {
			tq.deficit += rounds * quantum
		}
		return l.scan()
	}
	return nil
}

func (l *level) scan() *waiter {
	for i := 0; i < len(l.active); i++ {
		idx := (l.cursor + i) % len(l.active)
		tq := l.active[idx]
		if tq.deficit >= tq.waiters[0].cost {
			l.cursor = idx
			return tq.waiters[0]
		}
	}
	return nil
}

// remove takes w out of the queue. A waiter served at the head pays its cost from its tenant's
// credit; a waiter that gives up (cancelled, timed out) pays nothing.
func (q *fairQueue) remove(w *waiter, served bool) bool {
	for _, l := range q.levels {
		if l.prio != w.prio {
			continue
		}
		tq := l.tenants[w.tenant]
		if tq == nil {
			return false
		}
		for i, x := range tq.waiters {
			if x != w {
				continue
			}
			copy(tq.waiters[i:], tq.waiters[i+1:])
			tq.waiters[len(tq.waiters)-1] = nil
			tq.waiters = tq.waiters[:len(tq.waiters)-1]
			q.n--
			if served {
				tq.deficit -= w.cost
			}
			if len(tq.waiters) == 0 {
				l.deactivate(tq)
				delete(l.tenants, tq.tenant)
			} else if served && tq.deficit < tq.waiters[0].cost {
				// The tenant's credit for this round is spent: the turn passes on.
				l.advancePast(tq)
			}
			return true
		}
		return false
	}
	return false
}

func (l *level) advancePast(tq *tenantQueue) {
	for i, x := range l.active {
		if x == tq {
			l.cursor = (i + 1) % len(l.active)
			return
		}
	}
}

func (l *level) deactivate(tq *tenantQueue) {
	for i, x := range l.active {
		if x != tq {
			continue
		}
		copy(l.active[i:], l.active[i+1:])
		l.active[len(l.active)-1] = nil
		l.active = l.active[:len(l.active)-1]
		if l.cursor > i {
			l.cursor--
		}
		if l.cursor >= len(l.active) {
			l.cursor = 0
		}
		break
	}
	tq.active = false
	tq.deficit = 0
}

// position returns how many waiters would be served before a new waiter of priority prio:
// everyone at a higher or equal priority. Deficit round-robin makes the real order depend on
// tenants; this is the conservative figure used for predicting waits.
func (q *fairQueue) ahead(prio int64) int {
	n := 0
	for _, l := range q.levels {
		if l.prio < prio {
			break
		}
		for _, tq := range l.active {
			n += len(tq.waiters)
		}
	}
	return n
}
