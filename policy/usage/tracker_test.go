package usage

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

var testReasons = []string{"token_budget", "rate_limit", "spend_budget"}

func newTracker(t testing.TB, size int, loc *time.Location, now time.Time) *Tracker {
	t.Helper()
	tr := New(testReasons)
	tr.Configure(Settings{Enabled: true, TableSize: size, Location: loc}, now)
	return tr
}

func settle(tenant, model string, prompt, completion int64) *Event {
	return &Event{Tenant: tenant, Model: model, Refusal: -1, Prompt: prompt, Completion: completion}
}

func report(t testing.TB, tr *Tracker, now time.Time, by By, w Window, top int) Report {
	t.Helper()
	r, ok := tr.Report(now, Query{By: by, Window: w, Top: top})
	if !ok {
		t.Fatal("the tracker is off")
	}
	return r
}

// tokens returns the prompt plus completion tokens of the row of group k in r (-1: no row).
func tokens(r Report, k Key) int64 {
	for _, row := range r.Rows {
		if row.Key == k {
			return int64(row.Counts.Prompt + row.Counts.Completion)
		}
	}
	return -1
}

// TestWindowsExpire: a request counted at 10:02 on a Wednesday leaves the 1h window once its
// 5-minute bucket is more than an hour old, the 24h window once its hour is, the 7d window once
// its day is, and the month window at the end of the month; each window says where it starts.
func TestWindowsExpire(t *testing.T) {
	t0 := time.Date(2026, 6, 10, 10, 2, 0, 0, time.UTC)
	tr := newTracker(t, 50, nil, t0)
	tr.Record(t0, settle("acme", "gpt-4o", 100, 20))
	acme := Key{Tenant: "acme"}
	cases := []struct {
		at       time.Time
		w        Window
		want     int64
		wantFrom time.Time
	}{
		{t0.Add(30 * time.Minute), Hour, 120, time.Date(2026, 6, 10, 9, 30, 0, 0, time.UTC)},
		{t0.Add(62 * time.Minute), Hour, 120, time.Date(2026, 6, 10, 10, 0, 0, 0, time.UTC)},
		{t0.Add(63 * time.Minute), Hour, -1, time.Date(2026, 6, 10, 10, 5, 0, 0, time.UTC)},
		{t0.Add(63 * time.Minute), Day, 120, time.Date(2026, 6, 9, 11, 0, 0, 0, time.UTC)},
		{t0.Add(24*time.Hour + 57*time.Minute), Day, 120, time.Date(2026, 6, 10, 10, 0, 0, 0, time.UTC)},
		{t0.Add(24*time.Hour + 58*time.Minute), Day, -1, time.Date(2026, 6, 10, 11, 0, 0, 0, time.UTC)},
		{t0.Add(24*time.Hour + 58*time.Minute), Week, 120, time.Date(2026, 6, 4, 0, 0, 0, 0, time.UTC)},
		{time.Date(2026, 6, 17, 23, 59, 0, 0, time.UTC), Week, 120, time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)},
		{time.Date(2026, 6, 18, 0, 0, 0, 0, time.UTC), Week, -1, time.Date(2026, 6, 11, 0, 0, 0, 0, time.UTC)},
		{time.Date(2026, 6, 30, 23, 59, 0, 0, time.UTC), Month, 120, time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)},
		{time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC), Month, -1, time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC)},
	}
	for _, c := range cases {
		r := report(t, tr, c.at, ByTenant, c.w, 10)
		if got := tokens(r, acme); got != c.want || !r.From.Equal(c.wantFrom) || !r.To.Equal(c.at) {
			t.Errorf("%s at %s: acme %d from %s, want %d from %s", c.w, c.at.Format(time.RFC3339), got, r.From.Format(time.RFC3339), c.want, c.wantFrom.Format(time.RFC3339))
		}
		if c.want < 0 && !r.Total.IsZero() {
			t.Errorf("%s at %s: total %+v after acme left", c.w, c.at.Format(time.RFC3339), r.Total)
		}
	}
	// Nothing but the buckets the windows need is kept.
	st := tr.Stats()
	if st.Tables[ByTenant] != 1 {
		t.Errorf("%d tables on the 1st of July, want only the live one", st.Tables[ByTenant])
	}
}

// TestMonthInTimeZone: the month window follows the time zone's calendar: in New York, a
// request at 23:30 on June 30th belongs to June even though it is July in UTC.
func TestMonthInTimeZone(t *testing.T) {
	ny, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Fatal(err)
	}
	june := time.Date(2026, 6, 30, 23, 30, 0, 0, ny)
	tr := newTracker(t, 50, ny, june)
	tr.Record(june, settle("acme", "m", 10, 0))
	july := time.Date(2026, 7, 1, 0, 10, 0, 0, ny)
	tr.Record(july, settle("acme", "m", 1, 0))
	r := report(t, tr, july.Add(time.Minute), ByTenant, Month, 10)
	if got := tokens(r, Key{Tenant: "acme"}); got != 1 || !r.From.Equal(time.Date(2026, 7, 1, 0, 0, 0, 0, ny)) {
		t.Fatalf("July in New York: acme %d from %s, want 1 from midnight local", got, r.From)
	}
	// June's day is a day table of New York's June 30th.
	r = report(t, tr, july.Add(time.Minute), ByTenant, Week, 10)
	if got := tokens(r, Key{Tenant: "acme"}); got != 11 || !r.From.Equal(time.Date(2026, 6, 24, 0, 0, 0, 0, ny)) {
		t.Fatalf("7 days in New York: acme %d from %s", got, r.From)
	}
}

// TestDayOf25Hours: on the day New York's clocks go back, each of its 25 hours is a bucket and
// the day holds them all.
func TestDayOf25Hours(t *testing.T) {
	ny, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Fatal(err)
	}
	start := time.Date(2026, 11, 1, 0, 0, 0, 0, ny)
	end := time.Date(2026, 11, 2, 0, 0, 0, 0, ny)
	if end.Sub(start) != 25*time.Hour {
		t.Fatalf("the day is %s long", end.Sub(start))
	}
	tr := newTracker(t, 50, ny, start)
	for at := start.Add(10 * time.Minute); at.Before(end); at = at.Add(time.Hour) {
		tr.Record(at, settle("acme", "m", 1, 0))
	}
	tr.Record(end.Add(time.Minute), settle("acme", "m", 1000, 0))
	tr.mu.Lock()
	days, hours := tr.series[ByTenant].days, tr.series[ByTenant].hours
	tr.mu.Unlock()
	if len(days) != 1 || !days[0].start.Equal(start) || !days[0].end.Equal(end) || days[0].total.Prompt != 25 {
		t.Fatalf("days %+v", days)
	}
	if len(hours) != 24 { // the last 24 hours: the first of the 25 is past
		t.Fatalf("%d hours kept", len(hours))
	}
	if r := report(t, tr, end.Add(2*time.Minute), ByTenant, Week, 1); r.Total.Prompt != 1025 {
		t.Fatalf("week total %d", r.Total.Prompt)
	}
}

// TestTopAndOther: 30 tenants, top 5: the five heaviest get rows, largest first, and the other
// 25 are summed as the rest, which with the rows makes the total.
func TestTopAndOther(t *testing.T) {
	now := time.Date(2026, 6, 10, 10, 0, 0, 0, time.UTC)
	tr := newTracker(t, 50, nil, now)
	for i := range 30 {
		for range i + 1 {
			tr.Record(now, &Event{Tenant: fmt.Sprintf("t%02d", i), Model: "m", Refusal: -1, Prompt: 100, Completion: 10, Cached: 50, Spend: 7})
		}
		tr.Record(now, &Event{Tenant: fmt.Sprintf("t%02d", i), Model: "m", Refusal: 2})
	}
	r := report(t, tr, now, ByTenant, Hour, 5)
	var names []string
	var sum Counts
	for _, row := range r.Rows {
		names = append(names, row.Key.Tenant)
		sum.Add(&row.Counts)
		if row.Overcount != 0 || row.Weight != row.Counts.Weight() {
			t.Errorf("%s: overcount %d with room for every tenant", row.Key.Tenant, row.Overcount)
		}
	}
	if want := []string{"t29", "t28", "t27", "t26", "t25"}; !slices.Equal(names, want) {
		t.Fatalf("rows %v, want %v", names, want)
	}
	if r.Rows[0].Counts.Requests != 30 || r.Rows[0].Counts.Refusals[2] != 1 || r.Rows[0].Counts.Spend != 210 || r.Rows[0].Counts.Cached != 1500 {
		t.Fatalf("t29: %+v", r.Rows[0].Counts)
	}
	sum.Add(&r.Other)
	if sum != r.Total || r.OtherGroups != 25 || r.Total.Requests != 465 || r.Total.Refusals[2] != 30 {
		t.Fatalf("rows + other %+v, total %+v, %d other groups", sum, r.Total, r.OtherGroups)
	}
	// By model, one group; by tenant and model, 30.
	if r := report(t, tr, now, ByModel, Hour, 5); len(r.Rows) != 1 || r.Rows[0].Key != (Key{Model: "m"}) || r.Rows[0].Counts != r.Total {
		t.Fatalf("by model: %+v", r.Rows)
	}
	if r := report(t, tr, now, ByTenantModel, Hour, 50); len(r.Rows) != 30 || r.Rows[0].Key != (Key{Tenant: "t29", Model: "m"}) {
		t.Fatalf("by tenant and model: %d rows, first %+v", len(r.Rows), r.Rows[0].Key)
	}
}

// TestWindowBounds: nearly 3 days of skewed traffic from 3 000 groups through tables of 40: in every
// window, at several moments, every group's row keeps Space-Saving's bounds against the exact
// counts of the window's span, and the largest overcount is at most N/K per level of buckets
// the window is built of (1h: one, 24h: two, 7 days and month: three).
func TestWindowBounds(t *testing.T) {
	const size = 40
	start := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	tr := newTracker(t, size, nil, start)
	r := rand.New(rand.NewPCG(9, 10))
	zipf := rand.NewZipf(r, 1.1, 2, 2999)
	type ev struct {
		at  time.Time
		key [numBy]Key
		c   Counts
	}
	var evs []ev
	check := func(now time.Time) {
		for _, w := range []Window{Hour, Day, Week, Month} {
			levels := map[Window]uint64{Hour: 1, Day: 2, Week: 3, Month: 3}[w]
			for _, by := range Groupings() {
				rep := report(t, tr, now, by, w, 3000)
				x := exact{}
				for _, e := range evs {
					if !e.at.Before(rep.From) {
						x.add(e.key[by], &e.c)
					}
				}
				var n uint64
				for _, c := range x {
					n += c.Weight()
				}
				if rep.Total.Weight() != n {
					t.Fatalf("%s by %s at %s: total weight %d, counted %d", w, by, now, rep.Total.Weight(), n)
				}
				if rep.MaxOvercount > levels*n/size {
					t.Fatalf("%s by %s at %s: overcount up to %d, above %d × N/K = %d", w, by, now, rep.MaxOvercount, levels, levels*n/size)
				}
				rows := map[Key]Row{}
				for _, row := range rep.Rows {
					rows[row.Key] = row
					if row.Overcount > rep.MaxOvercount {
						t.Fatalf("%v overcount %d above %d", row.Key, row.Overcount, rep.MaxOvercount)
					}
				}
				for k, c := range x {
					row, ok := rows[k]
					if !ok {
						if c.Weight() > rep.MaxOvercount {
							t.Fatalf("%s by %s: %v counted %d and has no row (bound %d)", w, by, k, c.Weight(), rep.MaxOvercount)
						}
						continue
					}
					if row.Weight < c.Weight() || row.Weight-c.Weight() > row.Overcount || !below(&row.Counts, c) || c.Weight()-row.Counts.Weight() > row.Overcount {
						t.Fatalf("%s by %s: %v row %+v for true %+v", w, by, k, row, *c)
					}
				}
			}
		}
	}
	now := start
	for i := range 100000 {
		now = now.Add(time.Duration(r.IntN(6)) * time.Second)
		z := zipf.Uint64()
		tenant, model := fmt.Sprintf("t%d", z), fmt.Sprintf("m%d", z%13)
		e := settle(tenant, model, int64(r.IntN(3000)), int64(r.IntN(300)))
		if r.IntN(6) == 0 {
			e = &Event{Tenant: tenant, Model: model, Refusal: r.IntN(3)}
		}
		tr.Record(now, e)
		var c Counts
		d, _ := tr.delta(e)
		c.addDelta(&d)
		evs = append(evs, ev{at: now, key: [numBy]Key{{Tenant: tenant}, {Model: model}, {Tenant: tenant, Model: model}}, c: c})
		if i%25000 == 24999 {
			check(now)
		}
	}
	if now.Sub(start) < 48*time.Hour {
		t.Fatalf("the traffic spans only %s", now.Sub(start))
	}
	check(now)
	if st := tr.Stats(); st.Evictions[ByTenantModel] == 0 {
		t.Fatal("no group was ever displaced: the tables were never full")
	}
}

// TestConfigure: off drops every table and counts nothing; on again starts empty; a smaller
// table size applies at once; tenants named for metrics keep their totals across
// reconfigurations while named.
func TestConfigure(t *testing.T) {
	now := time.Date(2026, 6, 10, 10, 0, 0, 0, time.UTC)
	tr := New(testReasons)
	tr.Record(now, settle("a", "m", 1, 1))
	if _, ok := tr.Report(now, Query{Top: 1}); ok || tr.Save(now) != nil {
		t.Fatal("a tracker never configured reports")
	}
	tr.Configure(Settings{Enabled: true, TableSize: 20, Tenants: []string{"a", "b"}}, now)
	for i := range 30 {
		tr.Record(now, settle(fmt.Sprint(i), "m", int64(i), 0))
	}
	tr.Record(now, settle("a", "m", 5, 5))
	tr.Record(now, &Event{Tenant: "b", Model: "m", Refusal: 1})
	if st := tr.Stats(); st.Rows[ByTenant] != 20 || st.Evictions[ByTenant] != 12 {
		t.Fatalf("stats %+v", st)
	}
	tr.Configure(Settings{Enabled: true, TableSize: 10, Tenants: []string{"a", "c"}}, now)
	if st := tr.Stats(); st.Rows[ByTenant] != 10 {
		t.Fatalf("after a smaller size: %d rows", st.Rows[ByTenant])
	}
	tr.Record(now, settle("a", "m", 1, 0))
	got := tr.TenantTotals()
	if len(got) != 2 || got[0].Tenant != "a" || got[0].Counts.Prompt != 6 || got[0].Counts.Requests != 2 || got[1].Tenant != "c" || !got[1].Counts.IsZero() {
		t.Fatalf("tenant totals %+v", got)
	}
	tr.Configure(Settings{Enabled: false}, now)
	tr.Record(now, settle("a", "m", 1, 0))
	if _, ok := tr.Report(now, Query{Top: 1}); ok || tr.Enabled() || tr.Stats().Tables[ByTenant] != 0 || len(tr.TenantTotals()) != 0 {
		t.Fatal("off still reports")
	}
	tr.Configure(Settings{Enabled: true, TableSize: 10}, now)
	if r := report(t, tr, now, ByTenant, Hour, 5); !r.Total.IsZero() {
		t.Fatalf("on again: %+v", r.Total)
	}
}

// TestClockBackwards: an event stamped before the live bucket (a clock that went back) counts
// in the live bucket; nothing is lost.
func TestClockBackwards(t *testing.T) {
	now := time.Date(2026, 6, 10, 10, 7, 0, 0, time.UTC)
	tr := newTracker(t, 10, nil, now)
	tr.Record(now, settle("a", "m", 1, 0))
	tr.Record(now.Add(-time.Hour), settle("a", "m", 2, 0))
	if r := report(t, tr, now, ByTenant, Hour, 1); r.Total.Prompt != 3 {
		t.Fatalf("total %+v", r.Total)
	}
}

// BenchmarkRecord measures the record path of a request that finished, for a group with a row
// in every table: what settlement adds to every request.
func BenchmarkRecord(b *testing.B) {
	now := time.Date(2026, 6, 10, 10, 0, 0, 0, time.UTC)
	tr := newTracker(b, DefaultTableSize, nil, now)
	for i := range DefaultTableSize {
		tr.Record(now, settle(fmt.Sprintf("tenant-%d", i), fmt.Sprintf("model-%d", i%20), 1000, 100))
	}
	e := settle("tenant-7", "model-7", 1200, 300)
	b.ReportAllocs()
	for b.Loop() {
		tr.Record(now, e)
	}
}

// BenchmarkRecordChurn measures the record path when each request is of a group without a row,
// which displaces another: the worst case (its names are copied).
func BenchmarkRecordChurn(b *testing.B) {
	now := time.Date(2026, 6, 10, 10, 0, 0, 0, time.UTC)
	tr := newTracker(b, DefaultTableSize, nil, now)
	names := make([]string, 4096)
	for i := range names {
		names[i] = fmt.Sprintf("tenant-%d", i)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		tr.Record(now, &Event{Tenant: names[i%len(names)], Model: "model", Refusal: -1, Prompt: 10})
		i++
	}
}

// BenchmarkReportMonth measures GET /admin/usage's work for a month of full tables.
func BenchmarkReportMonth(b *testing.B) {
	start := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	tr := newTracker(b, DefaultTableSize, nil, start)
	now := start
	for i := range 200000 {
		now = now.Add(12 * time.Second)
		tr.Record(now, settle(fmt.Sprintf("tenant-%d", i%5000), fmt.Sprintf("model-%d", i%50), int64(i%1000), 10))
	}
	b.ReportAllocs()
	for b.Loop() {
		tr.Report(now, Query{By: ByTenantModel, Window: Month, Top: DefaultTop})
	}
}
