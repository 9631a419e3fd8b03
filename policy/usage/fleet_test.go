package usage

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// exactStore is a fleet store without a bound on its rows: what the deltas added, exactly.
type exactStore map[Bucket]map[By]*FleetTable

func (s exactStore) add(ds []Delta) {
	for _, d := range ds {
		for _, b := range d.Targets {
			if s[b] == nil {
				s[b] = map[By]*FleetTable{}
			}
			ft := s[b][d.Table.By]
			if ft == nil {
				ft = &FleetTable{By: d.Table.By, Bucket: b}
				s[b][d.Table.By] = ft
			}
			ft.Total.Add(&d.Table.Total)
		next:
			for _, r := range d.Table.Rows {
				for i := range ft.Rows {
					if ft.Rows[i].Key == r.Key {
						ft.Rows[i].Counts.Add(&r.Counts)
						continue next
					}
				}
				ft.Rows = append(ft.Rows, TableRow{Key: r.Key, Counts: r.Counts})
			}
		}
	}
}

func (s exactStore) report(t *testing.T, tr *Tracker, now time.Time, q Query) Report {
	t.Helper()
	from, buckets := tr.FleetWindow(now, q.Window)
	var tabs []FleetTable
	for _, b := range buckets {
		if ft := s[b][q.By]; ft != nil {
			tabs = append(tabs, *ft)
		}
	}
	r, ok := tr.FleetReport(q, from, now, tabs)
	if !ok {
		t.Fatal("the tracker is off")
	}
	return r
}

// TestDeltasAddUpToTheTrackersWindows: a tracker that shares hands over, delta by delta (every
// few seconds, or after a store outage of hours or days), everything it counted, each event to
// the store's bucket of every level once: every window read from the store's buckets is the
// tracker's own, row for row, over weeks of traffic in a time zone with a change of clocks.
func TestDeltasAddUpToTheTrackersWindows(t *testing.T) {
	paris, err := time.LoadLocation("Europe/Paris")
	if err != nil {
		t.Skip(err)
	}
	t0 := time.Date(2026, 3, 20, 9, 0, 0, 0, paris)
	for _, gap := range []time.Duration{7 * time.Second, 40 * time.Minute, 5 * time.Hour, 30 * time.Hour} {
		t.Run(gap.String(), func(t *testing.T) {
			tr := newTracker(t, 1000, paris, t0)
			tr.Share(true)
			store := exactStore{}
			rng := rand.New(rand.NewPCG(1, uint64(gap)))
			now := t0
			taken := t0
			for now.Before(t0.Add(12 * day)) {
				now = now.Add(time.Duration(rng.IntN(int(20 * time.Minute))))
				ev := settle(fmt.Sprintf("t%d", rng.IntN(8)), fmt.Sprintf("m%d", rng.IntN(5)), int64(rng.IntN(500)), int64(rng.IntN(100)))
				if rng.IntN(5) == 0 {
					ev = &Event{Tenant: ev.Tenant, Model: ev.Model, Refusal: rng.IntN(len(testReasons))}
				}
				tr.Record(now, ev)
				if now.Sub(taken) >= gap {
					store.add(tr.TakeDelta(now, false))
					taken = now
				}
			}
			store.add(tr.TakeDelta(now, true))
			for _, by := range Groupings() {
				for w := range numWindows {
					q := Query{By: by, Window: w, Top: 100}
					got, want := store.report(t, tr, now, q), report(t, tr, now, by, w, 100)
					if gap > time.Hour && w == Hour {
						// An outage longer than the window leaves its 5-minute buckets behind:
						// only the last bucket's delta, taken at the end, reached them.
						continue
					}
					if gap > day && w == Day {
						continue
					}
					if got.Total != want.Total || got.From != want.From || len(got.Rows) != len(want.Rows) {
						t.Fatalf("%s %s: store's total %+v from %s (%d rows), tracker's %+v from %s (%d rows)", by, w,
							got.Total, got.From, len(got.Rows), want.Total, want.From, len(want.Rows))
					}
					for i := range got.Rows {
						if got.Rows[i].Key != want.Rows[i].Key || got.Rows[i].Counts != want.Rows[i].Counts {
							t.Fatalf("%s %s row %d: store's %+v, tracker's %+v", by, w, i, got.Rows[i], want.Rows[i])
						}
					}
				}
			}
		})
	}
}

// TestOutboxStaysBounded: with nothing taken for 40 days, the outbox holds no more tables than
// the tracker's own, and what it still holds is what windows can ask for.
func TestOutboxStaysBounded(t *testing.T) {
	t0 := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	tr := newTracker(t, 10, nil, t0)
	tr.Share(true)
	now := t0
	for i := range 40 * 24 * 12 {
		now = t0.Add(time.Duration(i) * fiveMinutes)
		tr.Record(now, settle(fmt.Sprintf("t%d", i%50), "m", 10, 1))
	}
	ds := tr.TakeDelta(now, false)
	levels := map[string]int{}
	for _, d := range ds {
		levels[d.Table.Level]++
		if len(d.Table.Rows) > 10 {
			t.Fatalf("a delta of %d rows, table size 10", len(d.Table.Rows))
		}
	}
	if n := len(ds); n > int(numBy)*TablesPerGroup {
		t.Fatalf("%d tables in the outbox, the tracker keeps at most %d", n, int(numBy)*TablesPerGroup)
	}
	if levels[LevelFive] != 3*13 || levels[LevelHour] != 3*24 || levels[LevelDay] != 3*9 {
		t.Fatalf("outbox levels %v", levels)
	}
	if ds := tr.TakeDelta(now, false); ds != nil {
		t.Fatalf("a second take found %d tables", len(ds))
	}
}

// TestDayBucketsTakeAMinuteAtMost: a tracker taken every 5 s keeps the store's 1h and 24h windows
// the tracker's at every take, and adds to the day buckets (the 7d and month windows) at most
// once a minute, each event once: after a last take of everything, every window is the
// tracker's.
func TestDayBucketsTakeAMinuteAtMost(t *testing.T) {
	t0 := time.Date(2026, 6, 1, 10, 2, 0, 0, time.UTC)
	tr := newTracker(t, 100, nil, t0)
	tr.Share(true)
	store := exactStore{}
	same := func(now time.Time, ws ...Window) {
		t.Helper()
		for _, by := range Groupings() {
			for _, w := range ws {
				got, want := store.report(t, tr, now, Query{By: by, Window: w, Top: 100}), report(t, tr, now, by, w, 100)
				if got.Total != want.Total || len(got.Rows) != len(want.Rows) {
					t.Fatalf("%s %s at %s: store's total %+v (%d rows), tracker's %+v (%d rows)", by, w, now.Sub(t0),
						got.Total, len(got.Rows), want.Total, len(want.Rows))
				}
			}
		}
	}
	const takes = 60 // 5 minutes, across a 5-minute bucket's end
	dayTakes := 0
	now := t0
	for i := range takes {
		for range 5 {
			now = now.Add(time.Second)
			tr.Record(now, settle(fmt.Sprintf("t%d", i%7), "m", 10, 1))
		}
		ds := tr.TakeDelta(now, false)
		for _, d := range ds {
			if d.Targets[len(d.Targets)-1].Level == LevelDay {
				dayTakes++
				break
			}
		}
		store.add(ds)
		same(now, Hour, Day)
	}
	if most := int(takes*5*time.Second/DayEvery) + 2; dayTakes > most {
		t.Fatalf("%d of %d takes reached the day buckets, want at most %d", dayTakes, takes, most)
	}
	store.add(tr.TakeDelta(now, true))
	same(now, Hour, Day, Week, Month)
}
