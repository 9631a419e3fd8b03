package usage

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// exact is what a test counted itself, by group.
type exact map[Key]*Counts

func (x exact) add(k Key, c *Counts) {
	if x[k] == nil {
		x[k] = &Counts{}
	}
	x[k].Add(c)
}

// checkBounds checks Space-Saving's promise for every group of x against table t: a group with
// a row has an estimate never below its true weight and at most its err above, counts never
// above its true ones and short by at most its err; a group without one counted at most the
// slack; and every err is at most the slack.
func checkBounds(t *testing.T, tab *table, x exact) {
	t.Helper()
	rows := map[Key]*entry{}
	for i := range tab.rows {
		e := &tab.rows[i]
		rows[e.key] = e
		if e.err > tab.slack {
			t.Fatalf("%v: err %d above the slack %d", e.key, e.err, tab.slack)
		}
		if e.est != e.err+e.c.Weight() {
			t.Fatalf("%v: est %d, err %d + weight %d", e.key, e.est, e.err, e.c.Weight())
		}
	}
	for k, c := range x {
		w := c.Weight()
		e := rows[k]
		if e == nil {
			if w > tab.slack {
				t.Fatalf("%v counted %d without a row; slack %d", k, w, tab.slack)
			}
			continue
		}
		if e.est < w || e.est-w > e.err {
			t.Fatalf("%v: est %d (err %d) for a true weight of %d", k, e.est, e.err, w)
		}
		if !below(&e.c, c) || w-e.c.Weight() > e.err {
			t.Fatalf("%v: counts %+v for true %+v (err %d)", k, e.c, *c, e.err)
		}
	}
}

// deltaOf is the delta of c, the counts of one event.
func deltaOf(c Counts) *delta {
	d := &delta{refusal: -1, prompt: c.Prompt, completion: c.Completion, cached: c.Cached, spend: c.Spend, weight: c.Weight()}
	for i, n := range c.Refusals {
		if n > 0 {
			d.refusal = i
		}
	}
	return d
}

// put counts the event of counts c for k in tab.
func put(tab *table, k Key, c Counts) { tab.add(k, deltaOf(c), nil, nil) }

func event(r *rand.Rand, reasons int) Counts {
	var c Counts
	if r.IntN(5) == 0 {
		c.Refusals[r.IntN(reasons)] = 1
		return c
	}
	c.Requests = 1
	c.Prompt, c.Completion = uint64(r.IntN(2000)), uint64(r.IntN(500))
	c.Cached = c.Prompt / 2
	c.Spend = 17
	return c
}

// TestTableSpaceSaving: a live table of 50 rows fed 20 000 events of 2 000 groups, most of the
// weight on a few: each group's estimate and counts keep Space-Saving's bounds, the smallest
// estimate of the full table is at most the total weight over the size, and the heavy groups
// are ranked exactly.
func TestTableSpaceSaving(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	tab := newLive(50, false)
	x := exact{}
	zipf := rand.NewZipf(r, 1.3, 1, 1999)
	for range 20000 {
		k := Key{Tenant: fmt.Sprintf("t%d", zipf.Uint64())}
		c := event(r, 3)
		put(tab, k, c)
		x.add(k, &c)
		if len(tab.rows) > 50 {
			t.Fatalf("%d rows", len(tab.rows))
		}
	}
	f := tab.frozen()
	checkBounds(t, f, x)
	if n := f.total.Weight(); f.slack > n/50 {
		t.Fatalf("slack %d above N/K = %d", f.slack, n/50)
	}
	if f.slack == 0 || tab.evictions == 0 {
		t.Fatalf("the table never filled (slack %d, evictions %d): the test checks nothing", f.slack, tab.evictions)
	}
	var sum Counts
	for k := range x {
		sum.Add(x[k])
	}
	if sum != f.total {
		t.Fatalf("total %+v, counted %+v", f.total, sum)
	}
	sortRows(f.rows)
	for i, want := range []string{"t0", "t1", "t2"} {
		if f.rows[i].key.Tenant != want {
			t.Fatalf("row %d is %v, want %s", i, f.rows[i].key, want)
		}
	}
}

// TestTableExactWhileRoomy: as long as the groups fit, every row is exact.
func TestTableExactWhileRoomy(t *testing.T) {
	tab := newLive(10, false)
	x := exact{}
	r := rand.New(rand.NewPCG(3, 4))
	for range 1000 {
		k := Key{Tenant: fmt.Sprintf("t%d", r.IntN(10)), Model: "m"}
		c := event(r, 2)
		put(tab, k, c)
		x.add(k, &c)
	}
	f := tab.frozen()
	if f.slack != 0 || len(f.rows) != 10 {
		t.Fatalf("slack %d, %d rows", f.slack, len(f.rows))
	}
	for _, e := range f.rows {
		if e.err != 0 || e.c != *x[e.key] {
			t.Fatalf("%v: %+v err %d, want %+v", e.key, e.c, e.err, *x[e.key])
		}
	}
}

// TestTableDisplacedGroupInherits: a new group in a full table takes the row of the smallest
// estimate, which becomes its err; its counts are its own.
func TestTableDisplacedGroupInherits(t *testing.T) {
	tab := newLive(2, false)
	one := Counts{Requests: 1, Prompt: 9}
	for _, k := range []string{"a", "a", "b", "c"} {
		put(tab, Key{Tenant: k}, one)
	}
	f := tab.frozen()
	sortRows(f.rows)
	if len(f.rows) != 2 || f.rows[0].key.Tenant != "a" || f.rows[0].est != 20 || f.rows[1].key.Tenant != "c" || f.rows[1].err != 10 || f.rows[1].est != 20 ||
		f.rows[1].c != one || f.slack != 10 || tab.evictions != 1 {
		t.Fatalf("rows %+v slack %d evictions %d", f.rows, f.slack, tab.evictions)
	}
}

// TestMergeKeepsBounds: merging tables sums what each counted, and a merge cut to the table
// size keeps every group's bounds against the events of all of them, the slack at most the sum
// of theirs plus the merged weight over the size.
func TestMergeKeepsBounds(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	zipf := rand.NewZipf(r, 1.2, 1, 999)
	x := exact{}
	var tabs []*table
	var slacks uint64
	for b := range 12 {
		tab := newLive(40, false)
		tab.start = time.Unix(int64(b)*300, 0)
		tab.end = tab.start.Add(5 * time.Minute)
		for range 3000 {
			k := Key{Tenant: fmt.Sprintf("t%d", zipf.Uint64()), Model: "m"}
			c := event(r, 4)
			put(tab, k, c)
			x.add(k, &c)
		}
		f := tab.frozen()
		slacks += f.slack
		tabs = append(tabs, f)
	}
	all := merge(tabs, 0)
	checkBounds(t, all, x)
	if all.slack != slacks || !all.start.Equal(time.Unix(0, 0)) || !all.end.Equal(time.Unix(3600, 0)) {
		t.Fatalf("slack %d (sum %d), span %s–%s", all.slack, slacks, all.start, all.end)
	}
	cut := merge(tabs, 40)
	if len(cut.rows) != 40 {
		t.Fatalf("%d rows", len(cut.rows))
	}
	checkBounds(t, cut, x)
	if n := cut.total.Weight(); cut.slack > slacks+n/41 {
		t.Fatalf("slack %d above %d + N/(K+1) = %d", cut.slack, slacks, slacks+n/41)
	}
}

// TestResizeKeepsBounds: a live table made smaller keeps its largest groups and stays a valid
// summary to count on.
func TestResizeKeepsBounds(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	tab := newLive(30, false)
	x := exact{}
	feed := func(n int) {
		for range n {
			k := Key{Model: fmt.Sprintf("m%d", r.IntN(60))}
			c := event(r, 1)
			put(tab, k, c)
			x.add(k, &c)
		}
	}
	feed(2000)
	tab.resize(10)
	if len(tab.rows) != 10 || len(tab.idx) != 10 || len(tab.heap) != 10 {
		t.Fatalf("rows %d idx %d heap %d", len(tab.rows), len(tab.idx), len(tab.heap))
	}
	feed(2000)
	checkBounds(t, tab.frozen(), x)
	tab.resize(40)
	feed(2000)
	checkBounds(t, tab.frozen(), x)
}
