package usage

import (
	"slices"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// A fleet of replicas (cluster mode) keeps its usage in a store they share, one table per
// grouping and bucket of time at each level (5-minute buckets, hours and days), so that a window
// of the fleet is read from the buckets of one level, as a state file's tracker reads its own.
// A tracker that shares (Share) keeps, besides its own tables, what it counted that the store
// has not taken yet (its outbox, TakeDelta): live tables of the current bucket, counted as its
// own tables are, and the closed ones. Each table of the outbox is added to the store's table of
// its bucket and of the buckets above it (a 5-minute table to its 5-minute bucket, its hour and
// its day), so that every event reaches every level once.
//
// The outbox stays bounded while the store cannot be reached: a closed 5-minute table that no
// 1h window can ask for any more is merged into its hour's (to be added to the hour and the day
// only), an hour no 24h window can ask for into its day's, and a day no 7d or month window can
// ask for is dropped. So it holds at most as many tables as the tracker's own tables.

// Bucket is one bucket of time of a level (LevelFive, LevelHour or LevelDay).
type Bucket struct {
	Level      string
	Start, End time.Time
}

// TableRow is one group's row in a table a fleet store keeps: what the group counted while it
// had the row (Counts, exact), and Err, how much of its estimate (Counts.Weight()+Err) may be
// other groups' (see Row.Overcount).
type TableRow struct {
	Key    Key
	Err    uint64
	Counts Counts
}

// FleetTable is one grouping's table of one bucket, as a fleet store keeps it, or what one
// replica adds to it.
type FleetTable struct {
	By By
	Bucket
	// Slack bounds the weight of every group without a row (see the package doc).
	Slack uint64
	// Total is everything the bucket counted, of groups with a row or not.
	Total Counts
	Rows  []TableRow
}

// Delta is a table of what a tracker counted that a fleet store has not taken yet, and the
// buckets of the store it is to be added to.
type Delta struct {
	Table   FleetTable
	Targets []Bucket
}

// Keep is how long after its end a fleet store keeps a bucket of level: a little more than the
// longest a window can ask for it (a 5-minute bucket by the 1h window, an hour by the 24h one, a
// day by the month, the 1st of a month of 31 days until the month ends).
func Keep(level string) time.Duration {
	switch level {
	case LevelFive:
		return 2 * time.Hour
	case LevelHour:
		return 2 * day
	}
	return 35 * day
}

// Share makes the tracker keep, besides its tables, what it counts for a fleet store to take
// with TakeDelta (cluster mode); off, what was not taken is dropped. Safe for concurrent use.
func (t *Tracker) Share(on bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.shared = on
	t.out = nil
	if on && t.series[0].live != nil {
		t.newOutbox()
	}
}

// newOutbox starts an empty outbox. t.mu is held and the tracker on.
func (t *Tracker) newOutbox() {
	t.out = &[numBy]series{}
	for b := range t.out {
		t.out[b].live = newLive(t.size, By(b) == ByTenantModel)
		t.out[b].live.start, t.out[b].live.end = t.cur.start, t.cur.end
	}
}

// TableSize returns the most groups a table keeps (0 while the tracker is off).
func (t *Tracker) TableSize() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.size
}

// DayEvery is how often, at most, what a tracker counted reaches the fleet's day buckets: a take
// (TakeDelta) adds the live bucket to its 5-minute bucket and its hour every time, to its day at
// most this often, and when the live bucket closes. The 1h and 24h windows (read from 5-minute
// and hour buckets) follow the fleet take by take; the 7d and month windows lag up to a minute
// more. A fleet store merges each delta into every bucket it names: most takes cost it a third
// less.
const DayEvery = time.Minute

// TakeDelta returns what the tracker counted since the last TakeDelta (rolled to now first), and
// empties its outbox; nil when it does not share, or counted nothing. The caller adds each
// delta's table to the store's tables of its targets, once. What the live bucket counted reaches
// the day bucket at most every DayEvery (held back meanwhile, merged), unless all is set: all
// empties the outbox (the tracker stops sharing, or its process stops).
func (t *Tracker) TakeDelta(now time.Time, all bool) []Delta {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.out == nil {
		return nil
	}
	if !now.Before(t.cur.end) {
		t.roll(now)
	}
	daily := all || !now.Before(t.dayAt)
	if daily {
		t.dayAt = now.Add(DayEvery)
	}
	var out []Delta
	for b := range t.out {
		s := &t.out[b]
		if daily {
			s.days, s.sent = t.foldInto(s.days, s.sent, t.daySpan), nil
		}
		for _, l := range []struct {
			level string
			tabs  []*table
		}{{LevelDay, s.days}, {LevelHour, s.hours}, {LevelFive, s.fives}} {
			for _, tab := range l.tabs {
				out = append(out, t.deltaOf(By(b), l.level, tab))
			}
		}
		if len(s.live.rows) > 0 || !s.live.total.IsZero() {
			d := t.deltaOf(By(b), LevelFive, s.live)
			if !daily {
				// Its 5-minute bucket and its hour, for now.
				d.Targets = d.Targets[:2]
				s.sent = t.foldInto(s.sent, []*table{s.live.frozen()}, t.daySpan)
			}
			out = append(out, d)
		}
		s.fives, s.hours, s.days = nil, nil, nil
		s.live.reset(t.cur.start, t.cur.end)
	}
	return out
}

// deltaOf returns tab as a delta of grouping by at level, with the buckets it is added to. t.mu
// is held.
func (t *Tracker) deltaOf(by By, level string, tab *table) Delta {
	ft := FleetTable{By: by, Bucket: Bucket{Level: level, Start: tab.start, End: tab.end}, Slack: tab.slack, Total: tab.total,
		Rows: make([]TableRow, len(tab.rows))}
	for i := range tab.rows {
		e := &tab.rows[i]
		ft.Rows[i] = TableRow{Key: e.key, Err: e.err, Counts: e.c}
	}
	d := Delta{Table: ft}
	if level == LevelFive {
		d.Targets = append(d.Targets, ft.Bucket)
	}
	if level != LevelDay {
		h := t.hourSpan(tab.start)
		d.Targets = append(d.Targets, Bucket{Level: LevelHour, Start: h.start, End: h.end})
	}
	dy := t.daySpan(tab.start)
	return Delta{Table: ft, Targets: append(d.Targets, Bucket{Level: LevelDay, Start: dy.start, End: dy.end})}
}

// rollOutbox closes the outbox's live tables with the tracker's, and keeps the outbox bounded
// (see the top of this file). t.mu is held; t.cur is the new live bucket.
func (t *Tracker) rollOutbox(now time.Time) {
	if t.out == nil {
		return
	}
	fives := t.fiveSpan(now.Add(-time.Hour)).start
	hours := t.hourSpan(now.Add(-day)).start
	days := minTime(t.daySpan(now.Add(-7*day)).start, t.cal.Start(spend.Month, now))
	for b := range t.out {
		s := &t.out[b]
		// What was taken of the closed live bucket for its 5-minute bucket and hour only goes to
		// its day at the next take.
		s.days, s.sent = t.foldInto(s.days, s.sent, t.daySpan), nil
		if len(s.live.rows) > 0 || !s.live.total.IsZero() {
			s.fives = append(s.fives, s.live.frozen())
		}
		s.live.reset(t.cur.start, t.cur.end)
		var stale []*table
		if s.fives, stale = splitAt(s.fives, fives); len(stale) > 0 {
			s.hours = t.foldInto(s.hours, stale, t.hourSpan)
		}
		if s.hours, stale = splitAt(s.hours, hours); len(stale) > 0 {
			s.days = t.foldInto(s.days, stale, t.daySpan)
		}
		s.days, _ = splitAt(s.days, days)
	}
}

// splitAt returns the tables of tabs that start at or after from, and the others.
func splitAt(tabs []*table, from time.Time) (keep, before []*table) {
	for _, tab := range tabs {
		if tab.start.Before(from) {
			before = append(before, tab)
		} else {
			keep = append(keep, tab)
		}
	}
	return keep, before
}

// foldInto merges each table of stale into the table of up of the bucket above it (spanOf), or
// a new one, and returns up.
func (t *Tracker) foldInto(up, stale []*table, spanOf func(time.Time) span) []*table {
	for _, tab := range stale {
		sp := spanOf(tab.start)
		group := []*table{tab}
		i := slices.IndexFunc(up, func(u *table) bool { return u.start.Equal(sp.start) })
		if i >= 0 {
			group = append(group, up[i])
		}
		m := merge(group, t.size)
		m.start, m.end = sp.start, sp.end
		if i >= 0 {
			up[i] = m
		} else {
			up = append(up, m)
		}
	}
	return up
}

// FleetWindow returns when window w starts at now and the buckets a fleet store reads it from:
// the buckets of the window's level from the one that holds now minus the window (the calendar
// month's start for Month) to the one that holds now — the span the tracker's own report
// covers.
func (t *Tracker) FleetWindow(now time.Time, w Window) (from time.Time, buckets []Bucket) {
	t.mu.Lock()
	defer t.mu.Unlock()
	level, spanOf := LevelDay, t.daySpan
	switch w {
	case Hour:
		level, spanOf = LevelFive, t.fiveSpan
		from = t.fiveSpan(now.Add(-time.Hour)).start
	case Day:
		level, spanOf = LevelHour, t.hourSpan
		from = t.hourSpan(now.Add(-day)).start
	case Week:
		from = t.daySpan(now.Add(-7 * day)).start
	default:
		from = t.cal.Start(spend.Month, now)
	}
	for at := from; !at.After(now); {
		sp := spanOf(at)
		buckets = append(buckets, Bucket{Level: level, Start: sp.start, End: sp.end})
		if !sp.end.After(at) {
			break
		}
		at = sp.end
	}
	return from, buckets
}

// FleetReport returns the report of q over tabs, a fleet store's tables of the window FleetWindow
// gave (starting at from), as Report would: its rows are the groups of largest estimate, every
// count summed over the tables. ok is false when the tracker is off.
func (t *Tracker) FleetReport(q Query, from, now time.Time, tabs []FleetTable) (Report, bool) {
	size := t.TableSize()
	if size == 0 {
		return Report{}, false
	}
	in := make([]*table, 0, len(tabs))
	for i := range tabs {
		ft := &tabs[i]
		tab := &table{start: ft.Start, end: ft.End, size: size, slack: ft.Slack, total: ft.Total, rows: make([]entry, len(ft.Rows))}
		for j, r := range ft.Rows {
			tab.rows[j] = entry{key: r.Key, err: r.Err, est: r.Err + r.Counts.Weight(), c: r.Counts}
		}
		in = append(in, tab)
	}
	return buildReport(q, from, now, size, in), true
}
