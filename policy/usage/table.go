package usage

import (
	"cmp"
	"slices"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
)

// MaxReasons bounds the refusal reasons a tracker counts (the length of Counts.Refusals).
const MaxReasons = 12

// Key is a group: a tenant, a model, or a tenant and a model. The dimension a grouping does not
// use is empty.
type Key struct {
	Tenant, Model string
}

func (k Key) compare(o Key) int {
	if c := strings.Compare(k.Tenant, o.Tenant); c != 0 {
		return c
	}
	return strings.Compare(k.Model, o.Model)
}

// Counts is what a group, a bucket or a window counted.
type Counts struct {
	// Requests counts admitted requests that finished (settled).
	Requests uint64
	// Prompt, Completion and Cached are the settled tokens: prompt and completion as the
	// budgets were charged, cached the prompt tokens the response said were served from a cache
	// (part of Prompt).
	Prompt, Completion, Cached uint64
	// Spend is what the requests cost, priced as spend budgets price them.
	Spend money.Micros
	// Refusals counts refused requests by reason, indexed as the tracker's reasons.
	Refusals [MaxReasons]uint64
}

// Weight is what a group is ranked by: its prompt and completion tokens, plus one for each
// request and each refusal, so that a group refused without ever using a token still ranks.
func (c *Counts) Weight() uint64 {
	w := c.Requests + c.Prompt + c.Completion
	for _, r := range c.Refusals {
		w += r
	}
	return w
}

// RefusalsTotal returns the refusals of every reason.
func (c *Counts) RefusalsTotal() uint64 {
	var n uint64
	for _, r := range c.Refusals {
		n += r
	}
	return n
}

// Add adds o to c.
func (c *Counts) Add(o *Counts) {
	c.Requests += o.Requests
	c.Prompt += o.Prompt
	c.Completion += o.Completion
	c.Cached += o.Cached
	c.Spend += o.Spend
	for i := range c.Refusals {
		c.Refusals[i] += o.Refusals[i]
	}
}

// Sub subtracts o from c, never going below zero.
func (c *Counts) Sub(o *Counts) {
	sub := func(a, b uint64) uint64 {
		if b > a {
			return 0
		}
		return a - b
	}
	c.Requests = sub(c.Requests, o.Requests)
	c.Prompt = sub(c.Prompt, o.Prompt)
	c.Completion = sub(c.Completion, o.Completion)
	c.Cached = sub(c.Cached, o.Cached)
	c.Spend = max(c.Spend-o.Spend, 0)
	for i := range c.Refusals {
		c.Refusals[i] = sub(c.Refusals[i], o.Refusals[i])
	}
}

// delta is one event's counts: a request that finished, or a refusal (refusal ≥ 0), and its
// weight.
type delta struct {
	prompt, completion, cached uint64
	spend                      money.Micros
	refusal                    int
	weight                     uint64
}

// addDelta adds event d to c.
func (c *Counts) addDelta(d *delta) {
	if d.refusal >= 0 {
		c.Refusals[d.refusal]++
		return
	}
	c.Requests++
	c.Prompt += d.prompt
	c.Completion += d.completion
	c.Cached += d.cached
	c.Spend += d.spend
}

// IsZero reports whether nothing was counted.
func (c *Counts) IsZero() bool { return *c == Counts{} }

// entry is one group's place in a table, as Space-Saving keeps it: what the group counted since
// it took the place (c, exact), and err, the weight of the group whose place it took — what its
// estimate may count that is not its own. est = err + c.Weight(), the estimate it is ranked by:
// never below the group's true weight in the table's span, and at most err above it.
type entry struct {
	key Key
	err uint64
	est uint64
	c   Counts
}

// table is the groups of one bucket of time, at most size of them. A live table (idx set) is
// the bucket being counted: a Space-Saving summary (Metwally, Agrawal and El Abbadi, 2005) with
// a min-heap of its rows by estimate. A frozen table (idx nil) is a closed bucket, or the merge
// of closed buckets; its rows are in no particular order and never change.
//
// slack bounds the weight of every group the table has no row for: in a live table the largest
// estimate a displaced group had (the smallest estimate of the full table when it was displaced,
// or the largest a resize dropped), 0 while no group was displaced. Every row's err is at most
// slack.
type table struct {
	start, end time.Time
	size       int
	rows       []entry
	slack      uint64
	// total is the exact sum of every event of the bucket, of groups with a row or not.
	total Counts

	// Live tables only: idx finds a group's row; heap holds row indexes as a min-heap by
	// estimate, and pos each row's place in it. links, in the live table by tenant and model,
	// remembers for each row the rows of its tenant and its model in the live tables by tenant
	// and by model (-1: not known), so that a request looks up one group, not three.
	idx   map[Key]int32
	heap  []int32
	pos   []int32
	links [][2]int32
	// evictions counts the groups displaced (live tables only).
	evictions uint64
}

// newLive returns an empty live table of size rows; linked keeps links (the table by tenant and
// model).
func newLive(size int, linked bool) *table {
	t := &table{size: size, idx: make(map[Key]int32, size), rows: make([]entry, 0, size),
		heap: make([]int32, 0, size), pos: make([]int32, 0, size)}
	if linked {
		t.links = make([][2]int32, 0, size)
	}
	return t
}

// add counts event d for group k and returns the group's row. A group without a row takes a
// free one (inheriting the slack as its err: a table grown by a resize may have displaced it
// before), else the row of the group with the smallest estimate, whose estimate it inherits as
// its err. The key's strings are copied when the group takes a row (the caller's may be reused);
// tenant and model, when set, hold copies made for another table, or receive the copies made.
func (t *table) add(k Key, d *delta, tenant, model *string) int32 {
	if i, ok := t.idx[k]; ok {
		t.bump(i, d)
		return i
	}
	t.total.addDelta(d)
	k = Key{Tenant: interned(tenant, k.Tenant), Model: interned(model, k.Model)}
	e := entry{key: k, err: t.slack, est: t.slack + d.weight}
	e.c.addDelta(d)
	if len(t.rows) < t.size {
		i := int32(len(t.rows))
		t.rows = append(t.rows, e)
		t.pos = append(t.pos, int32(len(t.heap)))
		t.heap = append(t.heap, i)
		if t.links != nil {
			t.links = append(t.links, [2]int32{-1, -1})
		}
		t.idx[k] = i
		t.up(len(t.heap) - 1)
		return i
	}
	i := t.heap[0]
	old := &t.rows[i]
	delete(t.idx, old.key)
	m := old.est
	e.err, e.est = m, m+d.weight
	*old = e
	if t.links != nil {
		t.links[i] = [2]int32{-1, -1}
	}
	t.idx[k] = i
	t.evictions++
	t.slack = max(t.slack, m)
	t.down(0)
	return i
}

// addAt is add for a group whose row may be row hint (-1: not known), as a link remembers it.
func (t *table) addAt(hint int32, k Key, d *delta, tenant, model *string) int32 {
	if hint >= 0 && int(hint) < len(t.rows) && t.rows[hint].key == k {
		t.bump(hint, d)
		return hint
	}
	return t.add(k, d, tenant, model)
}

// bump counts event d for the group of row i.
func (t *table) bump(i int32, d *delta) {
	t.total.addDelta(d)
	e := &t.rows[i]
	e.est += d.weight
	e.c.addDelta(d)
	t.down(int(t.pos[i]))
}

// interned returns *cp, copying s into it first if it is not set yet. Empty strings need no copy.
func interned(cp *string, s string) string {
	if s == "" {
		return ""
	}
	if cp == nil {
		return strings.Clone(s)
	}
	if *cp == "" {
		*cp = strings.Clone(s)
	}
	return *cp
}

func (t *table) less(a, b int) bool { return t.rows[t.heap[a]].est < t.rows[t.heap[b]].est }

func (t *table) swap(a, b int) {
	t.heap[a], t.heap[b] = t.heap[b], t.heap[a]
	t.pos[t.heap[a]] = int32(a)
	t.pos[t.heap[b]] = int32(b)
}

func (t *table) up(j int) {
	for j > 0 {
		p := (j - 1) / 2
		if !t.less(j, p) {
			return
		}
		t.swap(j, p)
		j = p
	}
}

func (t *table) down(j int) {
	n := len(t.heap)
	for {
		l := 2*j + 1
		if l >= n {
			return
		}
		c := l
		if r := l + 1; r < n && t.less(r, l) {
			c = r
		}
		if !t.less(c, j) {
			return
		}
		t.swap(j, c)
		j = c
	}
}

// frozen returns a frozen copy of live table t.
func (t *table) frozen() *table {
	return &table{start: t.start, end: t.end, size: t.size, rows: slices.Clone(t.rows), slack: t.slack, total: t.total}
}

// reset empties live table t for the bucket [start, end), keeping its memory.
func (t *table) reset(start, end time.Time) {
	clear(t.idx)
	clear(t.rows) // the strings belong to the frozen copy now
	t.rows, t.heap, t.pos = t.rows[:0], t.heap[:0], t.pos[:0]
	if t.links != nil {
		t.links = t.links[:0]
	}
	t.total, t.slack, t.start, t.end = Counts{}, 0, start, end
}

// resize changes a live table's size. A smaller size drops the rows of the smallest estimates,
// as displaced groups.
func (t *table) resize(size int) {
	t.size = size
	if len(t.rows) <= size {
		if cap(t.rows) < size {
			t.rows = slices.Grow(t.rows, size-len(t.rows))
		}
		return
	}
	sortRows(t.rows)
	t.slack = max(t.slack, t.rows[size].est)
	t.evictions += uint64(len(t.rows) - size)
	clear(t.rows[size:])
	t.rows = t.rows[:size]
	t.reindex()
}

// reindex rebuilds a live table's index and heap from its rows.
func (t *table) reindex() {
	if t.idx == nil {
		t.idx = make(map[Key]int32, t.size)
	}
	clear(t.idx)
	t.heap, t.pos = t.heap[:0], t.pos[:0]
	if t.links != nil {
		t.links = t.links[:0]
	}
	for i := range t.rows {
		t.idx[t.rows[i].key] = int32(i)
		t.heap = append(t.heap, int32(i))
		t.pos = append(t.pos, int32(i))
		if t.links != nil {
			t.links = append(t.links, [2]int32{-1, -1})
		}
	}
	for j := len(t.heap)/2 - 1; j >= 0; j-- {
		t.down(j)
	}
}

// sortRows orders rows by estimate, largest first, then by key.
func sortRows(rows []entry) {
	slices.SortFunc(rows, func(a, b entry) int {
		if c := cmp.Compare(b.est, a.est); c != 0 {
			return c
		}
		return a.key.compare(b.key)
	})
}

// merge returns the frozen table of every event of tabs, with at most size rows (0: as many as
// the groups). A group's estimate and err are the sums of its rows' and, for each table without
// a row for it, of that table's slack: its counts only what its rows counted. Rows beyond size
// (the smallest estimates) are dropped and the largest dropped estimate becomes the slack; every
// group then keeps the guarantee it had in each table: its estimate is never below its true
// weight, and err (at most slack) bounds how far above. The span is from the first start to the
// last end.
func merge(tabs []*table, size int) *table {
	out := &table{size: size}
	if len(tabs) == 0 {
		return out
	}
	n := 0
	for _, t := range tabs {
		n = max(n, len(t.rows))
	}
	idx := make(map[Key]int, n)
	// present sums, per row of out, the slack of the tables that had a row for it.
	present := make([]uint64, 0, n)
	var slack uint64
	out.start, out.end = tabs[0].start, tabs[0].end
	for _, t := range tabs {
		slack += t.slack
		out.total.Add(&t.total)
		if t.start.Before(out.start) {
			out.start = t.start
		}
		if t.end.After(out.end) {
			out.end = t.end
		}
		for i := range t.rows {
			r := &t.rows[i]
			j, ok := idx[r.key]
			if !ok {
				j = len(out.rows)
				idx[r.key] = j
				out.rows = append(out.rows, entry{key: r.key})
				present = append(present, 0)
			}
			o := &out.rows[j]
			o.err += r.err
			o.c.Add(&r.c)
			present[j] += t.slack
		}
	}
	for j := range out.rows {
		o := &out.rows[j]
		o.err += slack - present[j]
		o.est = o.err + o.c.Weight()
	}
	out.slack = slack
	if size == 0 {
		return out
	}
	if len(out.rows) > size {
		sortRows(out.rows)
		out.slack = max(slack, out.rows[size].est)
		out.rows = out.rows[:size]
	}
	// A table that is kept holds no more memory than its rows take.
	out.rows = slices.Clone(out.rows)
	return out
}
