package usage

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// By is how usage is grouped.
type By uint8

// Groupings.
const (
	ByTenant By = iota
	ByModel
	ByTenantModel
	numBy
)

var byNames = [numBy]string{"tenant", "model", "tenant,model"}

// String returns "tenant", "model" or "tenant,model".
func (b By) String() string {
	if b < numBy {
		return byNames[b]
	}
	return fmt.Sprintf("By(%d)", uint8(b))
}

// Groupings lists every grouping.
func Groupings() []By { return []By{ByTenant, ByModel, ByTenantModel} }

// Window is the span of time a report covers, ending now.
type Window uint8

// Windows.
const (
	// Hour is the last hour, in 5-minute buckets.
	Hour Window = iota
	// Day is the last 24 hours, in hour buckets.
	Day
	// Week is the last 7 days, in day buckets of the time zone.
	Week
	// Month is the calendar month of the time zone so far.
	Month
	numWindows
)

var windowNames = [numWindows]string{"1h", "24h", "7d", "month"}

// String returns "1h", "24h", "7d" or "month".
func (w Window) String() string {
	if w < numWindows {
		return windowNames[w]
	}
	return fmt.Sprintf("Window(%d)", uint8(w))
}

// Bucket lengths. An hour is the hour from the start of the day in the time zone (a day of 23
// or 25 hours has as many), a 5-minute bucket a twelfth of it; a bucket never crosses the
// bucket above it.
const (
	fiveMinutes = 5 * time.Minute
	day         = 24 * time.Hour
)

// Bounds of the table size.
const (
	MinTableSize     = 10
	MaxTableSize     = 10000
	DefaultTableSize = 200
)

// Most tables a grouping keeps at once: the live 5-minute bucket, the closed 5-minute buckets
// of the last hour and of the current hour (at most 13), the closed hours of the last 24 hours
// and of the current day (at most 25, on a day of 25 hours), and the closed days of the last 7
// days and of the current month (at most 30).
const (
	maxFives       = 13
	maxHours       = 25
	maxDays        = 30
	TablesPerGroup = 1 + maxFives + maxHours + maxDays
)

// Memory of a tracker: every table holds at most its size of rows of EntryBytes and their
// names; the live tables also index their rows (LiveIndexBytes a row), and a table allocated in
// pages may round up by one (TableBytes).
const (
	EntryBytes     = int64(unsafe.Sizeof(entry{}))
	LiveIndexBytes = 64
	TableBytes     = int64(unsafe.Sizeof(table{})) + 8192
)

// MaxBytes bounds the memory of a tracker whose tables have size rows, when a row's names (a
// tenant's, a model's, or both) take nameBytes: every table of every grouping full.
func MaxBytes(size int, nameBytes int64) int64 {
	perTable := TableBytes + int64(size)*(EntryBytes+nameBytes)
	return int64(numBy) * (TablesPerGroup*perTable + int64(size)*LiveIndexBytes)
}

// Settings configure a Tracker.
type Settings struct {
	// Enabled turns counting on; off, every table is dropped.
	Enabled bool
	// TableSize is the most groups a table keeps (MinTableSize to MaxTableSize).
	TableSize int
	// Location is the time zone whose days and months the buckets follow (nil: UTC).
	Location *time.Location
	// Tenants are the tenants whose totals since the process started are kept for metrics.
	Tenants []string
}

// Event is one request as usage counts it: a request that finished, or one that was refused.
type Event struct {
	Tenant, Model string
	// Refusal is the index (in the tracker's reasons) of the reason a request was refused for,
	// -1 for a request that was admitted and finished.
	Refusal int
	// Prompt, Completion and Cached are the tokens it was settled at; negative counts are 0.
	Prompt, Completion, Cached int64
	// Spend is what it cost.
	Spend money.Micros
}

type span struct{ start, end time.Time }

// series is one grouping's tables.
type series struct {
	live  *table
	fives []*table
	hours []*table
	days  []*table
	// evicted counts the groups displaced from its closed live tables.
	evicted uint64
	// sent holds, in an outbox, what was taken of the live bucket for its 5-minute bucket and
	// its hour only: its day has yet to take it (one table per day).
	sent []*table
}

// Tracker counts usage by tenant, by model and by both, in bounded memory: a fixed-size table per
// bucket of time for each grouping. Record is the hot path: three updates of the live tables,
// without allocating unless a group takes a row. Safe for concurrent use.
type Tracker struct {
	reasons []string
	on      atomic.Bool

	mu     sync.Mutex
	size   int
	cal    spend.Calendar
	series [numBy]series
	// cur is the live tables' bucket.
	cur span
	// hoursUpTo and daysUpTo are where the closed 5-minute buckets were last folded into hours,
	// and the closed hours into days: every bucket before them is in the level above.
	hoursUpTo, daysUpTo time.Time
	// tenants holds the totals of the tenants metrics name.
	tenants map[string]*Counts
	// shared says to keep an outbox for a fleet store (Share); out is it, nil while the tracker
	// is off or does not share (see fleet.go).
	shared bool
	out    *[numBy]series
	// dayAt is when the outbox's next take reaches the day buckets (see TakeDelta).
	dayAt time.Time
}

// New returns a tracker, off until configured, that counts refusals by reasons (at most
// MaxReasons names).
func New(reasons []string) *Tracker {
	if len(reasons) > MaxReasons {
		panic(fmt.Sprintf("usage: %d refusal reasons, at most %d", len(reasons), MaxReasons))
	}
	return &Tracker{reasons: slices.Clone(reasons)}
}

// Reasons returns the refusal reasons, by index.
func (t *Tracker) Reasons() []string { return t.reasons }

// Enabled reports whether the tracker counts.
func (t *Tracker) Enabled() bool { return t.on.Load() }

// Configure applies s at now. Turning counting off drops every table; turning it on starts
// empty. A new table size applies to the live tables at once (a smaller one drops their
// smallest groups, as a full table does) and to every bucket built after; a new time zone to
// the buckets that start after the live one.
func (t *Tracker) Configure(s Settings, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !s.Enabled {
		t.on.Store(false)
		t.series = [numBy]series{}
		t.out = nil
		t.tenants = nil
		t.size = 0
		t.hoursUpTo, t.daysUpTo = time.Time{}, time.Time{}
		return
	}
	size := min(max(s.TableSize, MinTableSize), MaxTableSize)
	t.cal = spend.NewCalendar(s.Location)
	if t.series[0].live == nil {
		for b := range t.series {
			t.series[b].live = newLive(size, By(b) == ByTenantModel)
		}
		t.cur = t.fiveSpan(now)
		t.hoursUpTo, t.daysUpTo = t.hourSpan(now).start, t.daySpan(now).start
		t.size = size
		t.setLiveSpan()
		if t.shared {
			t.newOutbox()
		}
	} else if size != t.size {
		for b := range t.series {
			t.series[b].live.resize(size)
			if t.out != nil {
				t.out[b].live.resize(size)
			}
		}
	}
	t.size = size
	tenants := make(map[string]*Counts, len(s.Tenants))
	for _, name := range s.Tenants {
		if c := t.tenants[name]; c != nil {
			tenants[name] = c
		} else {
			tenants[name] = &Counts{}
		}
	}
	if len(tenants) == 0 {
		tenants = nil
	}
	t.tenants = tenants
	t.on.Store(true)
}

func (t *Tracker) setLiveSpan() {
	for b := range t.series {
		t.series[b].live.start, t.series[b].live.end = t.cur.start, t.cur.end
		if t.out != nil {
			t.out[b].live.start, t.out[b].live.end = t.cur.start, t.cur.end
		}
	}
}

// delta returns the counts of event ev; ok is false for a refusal of an unknown reason.
func (t *Tracker) delta(ev *Event) (d delta, ok bool) {
	d.refusal = ev.Refusal
	if ev.Refusal >= 0 {
		d.weight = 1
		return d, ev.Refusal < len(t.reasons)
	}
	d.prompt, d.completion = uint64(max(ev.Prompt, 0)), uint64(max(ev.Completion, 0))
	d.cached = min(uint64(max(ev.Cached, 0)), d.prompt)
	d.spend = max(ev.Spend, 0)
	d.weight = 1 + d.prompt + d.completion
	return d, true
}

// Record counts event ev at now (the engine's clock).
func (t *Tracker) Record(now time.Time, ev *Event) {
	if !t.on.Load() {
		return
	}
	d, ok := t.delta(ev)
	if !ok {
		return
	}
	t.mu.Lock()
	if s := &t.series; s[0].live != nil {
		if !now.Before(t.cur.end) {
			t.roll(now)
		}
		// The names are copied at most once for every table.
		var tenant, model string
		recordLive(&s[ByTenant], &s[ByModel], &s[ByTenantModel], ev, &d, &tenant, &model)
		if o := t.out; o != nil {
			recordLive(&o[ByTenant], &o[ByModel], &o[ByTenantModel], ev, &d, &tenant, &model)
		}
		if t.tenants != nil {
			if tc := t.tenants[ev.Tenant]; tc != nil {
				tc.addDelta(&d)
			}
		}
	}
	t.mu.Unlock()
}

// recordLive counts event ev (its counts d) in the live tables of three series. One lookup, of
// the tenant and model, finds the tenant's and the model's rows through its links; tenant and
// model hold the copies of the names made for any table, or receive them.
func recordLive(tenants, models, pairs *series, ev *Event, d *delta, tenant, model *string) {
	pair := pairs.live
	i := pair.add(Key{Tenant: ev.Tenant, Model: ev.Model}, d, tenant, model)
	l := &pair.links[i]
	l[0] = tenants.live.addAt(l[0], Key{Tenant: ev.Tenant}, d, tenant, nil)
	l[1] = models.live.addAt(l[1], Key{Model: ev.Model}, d, nil, model)
}

// Spans of the buckets holding instant at.
func (t *Tracker) daySpan(at time.Time) span {
	start := t.cal.Start(spend.Day, at)
	return span{start, t.cal.End(spend.Day, start)}
}

func (t *Tracker) hourSpan(at time.Time) span {
	d := t.daySpan(at)
	start := d.start.Add(at.Sub(d.start).Truncate(time.Hour))
	return span{start, minTime(start.Add(time.Hour), d.end)}
}

func (t *Tracker) fiveSpan(at time.Time) span {
	h := t.hourSpan(at)
	start := h.start.Add(at.Sub(h.start).Truncate(fiveMinutes))
	return span{start, minTime(start.Add(fiveMinutes), h.end)}
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// roll closes the live bucket, which now is past: its tables join the closed 5-minute buckets,
// every hour and day that ended is built from the buckets below it, and what no window needs
// any more is dropped. t.mu is held.
func (t *Tracker) roll(now time.Time) {
	for b := range t.series {
		s := &t.series[b]
		if len(s.live.rows) > 0 || !s.live.total.IsZero() {
			s.fives = append(s.fives, s.live.frozen())
		}
		s.evicted += s.live.evictions
		s.live.evictions = 0
	}
	t.cur = t.fiveSpan(now)
	for b := range t.series {
		t.series[b].live.reset(t.cur.start, t.cur.end)
	}
	t.rollOutbox(now)
	t.advance(now)
}

// advance builds every hour and day that ended before now from the buckets below it, and
// drops what no window needs any more. t.mu is held.
func (t *Tracker) advance(now time.Time) {
	if hour := t.hourSpan(now).start; t.hoursUpTo.Before(hour) {
		for b := range t.series {
			s := &t.series[b]
			s.hours = append(s.hours, t.fold(s.fives, since(t.hoursUpTo, s.hours), hour, t.hourSpan)...)
		}
		t.hoursUpTo = hour
	}
	if today := t.daySpan(now).start; t.daysUpTo.Before(today) {
		for b := range t.series {
			s := &t.series[b]
			s.days = append(s.days, t.fold(s.hours, since(t.daysUpTo, s.days), today, t.daySpan)...)
		}
		t.daysUpTo = today
	}
	t.prune(now)
}

// since is where folding into level may start: at mark, or after the last bucket the level
// has if that ends later (a restored state file may say otherwise), so that no two buckets of a
// level overlap.
func since(mark time.Time, level []*table) time.Time {
	if n := len(level); n > 0 {
		return maxTime(mark, level[n-1].end)
	}
	return mark
}

// fold merges the tables of tabs that start in [from, to) into one per bucket of the level
// above (spanOf), in time order.
func (t *Tracker) fold(tabs []*table, from, to time.Time, spanOf func(time.Time) span) []*table {
	var out []*table
	var group []*table
	var cur span
	flush := func() {
		if len(group) > 0 {
			m := merge(group, t.size)
			m.start, m.end = cur.start, cur.end
			out = append(out, m)
			group = group[:0]
		}
	}
	for _, tab := range tabs {
		if tab.start.Before(from) || !tab.start.Before(to) {
			continue
		}
		sp := spanOf(tab.start)
		if len(group) > 0 && !sp.start.Equal(cur.start) {
			flush()
		}
		cur = sp
		group = append(group, tab)
	}
	flush()
	return out
}

// prune drops the closed buckets no window needs at now: 5-minute buckets before the last hour
// and the current hour, hours before the last 24 and the current day, days before the last 7
// and the current month — and beyond those, the oldest past the most a level keeps (a clock
// that jumped could leave more).
func (t *Tracker) prune(now time.Time) {
	fives := minTime(t.fiveSpan(now.Add(-time.Hour)).start, t.hoursUpTo)
	hours := minTime(t.hourSpan(now.Add(-day)).start, t.daysUpTo)
	days := minTime(t.daySpan(now.Add(-7*day)).start, t.cal.Start(spend.Month, now))
	for b := range t.series {
		s := &t.series[b]
		s.fives = keepFrom(s.fives, fives, maxFives)
		s.hours = keepFrom(s.hours, hours, maxHours)
		s.days = keepFrom(s.days, days, maxDays)
	}
}

// keepFrom keeps the tables of tabs that start at or after from, at most the last n of them.
func keepFrom(tabs []*table, from time.Time, n int) []*table {
	tabs = slices.DeleteFunc(tabs, func(t *table) bool { return t.start.Before(from) })
	if len(tabs) > n {
		tabs = slices.Delete(tabs, 0, len(tabs)-n)
	}
	return tabs
}

// windowTables returns the tables that make up window w of grouping by at now, and when the
// window starts: the closed buckets of the window's level from the bucket that holds now minus
// the window (the calendar month's start for Month), then the buckets of finer levels since
// the last of those, then a copy of the live table. t.mu is held, and the tracker rolled to now.
func (t *Tracker) windowTables(now time.Time, by By, w Window) (time.Time, []*table) {
	s := &t.series[by]
	var from time.Time
	var out []*table
	add := func(tabs []*table, since time.Time) {
		for _, tab := range tabs {
			if !tab.start.Before(since) {
				out = append(out, tab)
			}
		}
	}
	switch w {
	case Hour:
		from = t.fiveSpan(now.Add(-time.Hour)).start
		add(s.fives, from)
	case Day:
		from = t.hourSpan(now.Add(-day)).start
		add(s.hours, from)
		add(s.fives, maxTime(t.hoursUpTo, from))
	default:
		if w == Week {
			from = t.daySpan(now.Add(-7 * day)).start
		} else {
			from = t.cal.Start(spend.Month, now)
		}
		add(s.days, from)
		add(s.hours, maxTime(t.daysUpTo, from))
		add(s.fives, maxTime(t.hoursUpTo, from))
	}
	if len(s.live.rows) > 0 || !s.live.total.IsZero() {
		out = append(out, s.live.frozen())
	}
	return from, out
}

func maxTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return b
	}
	return a
}

// Query asks for a report.
type Query struct {
	By     By
	Window Window
	// Top is how many groups get a row of their own; the rest are summed in Report.Other.
	Top int
}

// Row is one group's usage in a window.
type Row struct {
	Key Key
	// Counts is what the group counted while it had a row in the window's tables: exact when
	// Overcount is 0, else each count may be short of the group's true count by at most
	// Overcount (spend: by what that many tokens cost).
	Counts Counts
	// Weight is the group's estimated weight (Counts.Weight plus Overcount): never below its
	// true weight, at most Overcount above it. Rows are ranked by it.
	Weight uint64
	// Overcount is how much of Weight may not be the group's own: what groups whose rows it took
	// had counted (Space-Saving's error), and, for buckets without a row for it, the most a group
	// without a row there can have counted.
	Overcount uint64
}

// Report is the usage of one window, by one grouping.
type Report struct {
	By     By
	Window Window
	// From is when the window starts: the start of its first bucket. To is now.
	From, To time.Time
	// Rows are the Top groups of largest weight, largest first.
	Rows []Row
	// Other is everything the rows do not count: the total less the rows' counts. OtherGroups is
	// how many groups with a row in a table of the window are not in Rows (more may have had no
	// row).
	Other       Counts
	OtherGroups int
	// Total is everything the window counted, exactly.
	Total Counts
	// MaxOvercount bounds every row's Overcount: the sum of the slack of the window's tables.
	MaxOvercount uint64
	// TableSize is the table size the live tables have.
	TableSize int
}

// Report returns window q.Window of grouping q.By at now, with its q.Top largest groups; ok is
// false when the tracker is off.
func (t *Tracker) Report(now time.Time, q Query) (r Report, ok bool) {
	t.mu.Lock()
	if t.series[0].live == nil {
		t.mu.Unlock()
		return Report{}, false
	}
	if !now.Before(t.cur.end) {
		t.roll(now)
	}
	from, tabs := t.windowTables(now, q.By, q.Window)
	size := t.size
	t.mu.Unlock()
	return buildReport(q, from, now, size, tabs), true
}

// buildReport sums tabs into a report of q.
func buildReport(q Query, from, now time.Time, size int, tabs []*table) Report {
	m := merge(tabs, 0)
	sortRows(m.rows)
	r := Report{By: q.By, Window: q.Window, From: from, To: now, Total: m.total, Other: m.total, MaxOvercount: m.slack, TableSize: size}
	top := min(max(q.Top, 0), len(m.rows))
	r.Rows = make([]Row, top)
	for i := range top {
		e := &m.rows[i]
		r.Rows[i] = Row{Key: e.key, Counts: e.c, Weight: e.est, Overcount: e.err}
		r.Other.Sub(&e.c)
	}
	r.OtherGroups = len(m.rows) - top
	return r
}

// TenantTotal is what one tenant metrics name counted since the process started (or since the
// tenant was named).
type TenantTotal struct {
	Tenant string
	Counts Counts
}

// TenantTotals returns the totals of the tenants metrics name, by tenant.
func (t *Tracker) TenantTotals() []TenantTotal {
	t.mu.Lock()
	out := make([]TenantTotal, 0, len(t.tenants))
	for name, c := range t.tenants {
		out = append(out, TenantTotal{Tenant: name, Counts: *c})
	}
	t.mu.Unlock()
	slices.SortFunc(out, func(a, b TenantTotal) int { return strings.Compare(a.Tenant, b.Tenant) })
	return out
}

// Stats is what a tracker holds, for metrics.
type Stats struct {
	// Rows counts the rows of every table of each grouping; Tables the tables.
	Rows, Tables [numBy]int
	// Evictions counts, per grouping, the groups displaced from a live table by another, ever.
	Evictions [numBy]uint64
}

// Stats returns what the tracker holds now.
func (t *Tracker) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	var st Stats
	for b := range t.series {
		s := &t.series[b]
		if s.live == nil {
			continue
		}
		st.Tables[b] = 1 + len(s.fives) + len(s.hours) + len(s.days)
		st.Rows[b] = len(s.live.rows)
		for _, l := range [][]*table{s.fives, s.hours, s.days} {
			for _, tab := range l {
				st.Rows[b] += len(tab.rows)
			}
		}
		st.Evictions[b] = s.evicted + s.live.evictions
	}
	return st
}
