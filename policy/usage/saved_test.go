package usage

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
)

// traffic records a day and a half of skewed traffic into tr from start, ending at the returned
// time.
func traffic(tr *Tracker, start time.Time, seed uint64) time.Time {
	r := rand.New(rand.NewPCG(seed, seed+1))
	zipf := rand.NewZipf(r, 1.2, 1, 499)
	now := start
	for range 20000 {
		now = now.Add(time.Duration(r.IntN(13)) * time.Second)
		z := zipf.Uint64()
		e := &Event{Tenant: fmt.Sprintf("tenant-%d", z), Model: fmt.Sprintf("model-%d", z%7), Refusal: -1,
			Prompt: int64(r.IntN(4000)), Completion: int64(r.IntN(400)), Spend: money.Micros(r.IntN(900))}
		e.Cached = e.Prompt / 3
		if r.IntN(9) == 0 {
			e = &Event{Tenant: e.Tenant, Model: e.Model, Refusal: r.IntN(len(testReasons))}
		}
		tr.Record(now, e)
	}
	return now
}

func reports(t *testing.T, tr *Tracker, now time.Time) map[string]Report {
	t.Helper()
	out := map[string]Report{}
	for _, w := range []Window{Hour, Day, Week, Month} {
		for _, by := range Groupings() {
			out[w.String()+" by "+by.String()] = report(t, tr, now, by, w, 1000)
		}
	}
	return out
}

func roundTrip(t *testing.T, sv *Saved) *Saved {
	t.Helper()
	data, err := json.Marshal(sv)
	if err != nil {
		t.Fatal(err)
	}
	var back Saved
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatalf("%v in %.300s", err, data)
	}
	if err := back.Check(); err != nil {
		t.Fatal(err)
	}
	return &back
}

// TestSaveRestore: a tracker saved to JSON and restored into a new one at the same instant
// reports every window exactly as the first, and goes on counting into its live bucket.
func TestSaveRestore(t *testing.T) {
	start := time.Date(2026, 6, 3, 7, 0, 0, 0, time.UTC)
	tr := newTracker(t, 60, nil, start)
	now := traffic(tr, start, 1)
	want := reports(t, tr, now)
	back := newTracker(t, 60, nil, now)
	if n := back.Restore(roundTrip(t, tr.Save(now)), now); n < 60 {
		t.Fatalf("%d tables restored", n)
	}
	got := reports(t, back, now)
	for name := range want {
		if !reflect.DeepEqual(got[name], want[name]) {
			t.Errorf("%s after a restore differs:\n got %+v\nwant %+v", name, got[name].Total, want[name].Total)
		}
	}
	if !reflect.DeepEqual(back.Stats().Rows, tr.Stats().Rows) {
		t.Errorf("rows %v, before %v", back.Stats().Rows, tr.Stats().Rows)
	}
	// Both go on alike.
	e := settle("tenant-1", "model-1", 7, 7)
	tr.Record(now, e)
	back.Record(now, e)
	if a, b := report(t, tr, now, ByTenant, Hour, 5), report(t, back, now, ByTenant, Hour, 5); !reflect.DeepEqual(a, b) {
		t.Errorf("after one more request: %+v, before the restart %+v", b.Rows, a.Rows)
	}
}

// TestRestoreLater: restored two hours after it was saved, the saved hour has left the 1h
// window, the live bucket of the file is a closed bucket, and the 24h window still counts it
// all; restored 8 days later, only the month is left.
func TestRestoreLater(t *testing.T) {
	start := time.Date(2026, 6, 3, 7, 0, 0, 0, time.UTC)
	tr := newTracker(t, 60, nil, start)
	saved := traffic(tr, start, 2)
	sv := roundTrip(t, tr.Save(saved))
	day := report(t, tr, saved, ByTenant, Day, 1).Total

	later := saved.Add(2 * time.Hour)
	back := newTracker(t, 60, nil, later)
	back.Restore(sv, later)
	if r := report(t, back, later, ByTenant, Hour, 1); !r.Total.IsZero() {
		t.Errorf("1h two hours after: %+v", r.Total)
	}
	if r := report(t, back, later, ByTenant, Day, 1); r.Total.Weight() == 0 || !below(&r.Total, &day) {
		t.Errorf("24h two hours after: %+v, was %+v", r.Total, day)
	}
	if r := report(t, back, later, ByTenant, Month, 1); r.Total != report(t, tr, later, ByTenant, Month, 1).Total {
		t.Errorf("month two hours after: %+v", r.Total)
	}
	week := saved.Add(8 * 24 * time.Hour)
	back = newTracker(t, 60, nil, week)
	back.Restore(sv, week)
	if r := report(t, back, week, ByModel, Week, 1); !r.Total.IsZero() {
		t.Errorf("7d 8 days after: %+v", r.Total)
	}
	if r := report(t, back, week, ByModel, Month, 1); r.Total != report(t, tr, week, ByModel, Month, 1).Total {
		t.Errorf("month 8 days after: %+v", r.Total)
	}
	if st := back.Stats(); st.Tables[ByModel] > 1+maxDays {
		t.Errorf("%d tables kept", st.Tables[ByModel])
	}
}

// TestRestoreUnderOtherSettings: a smaller table size cuts the restored tables to it, keeping
// their bounds; refusals are matched to reasons by name, and a reason this build does not know
// is dropped.
func TestRestoreUnderOtherSettings(t *testing.T) {
	start := time.Date(2026, 6, 3, 7, 0, 0, 0, time.UTC)
	tr := newTracker(t, 60, nil, start)
	now := traffic(tr, start, 3)
	sv := roundTrip(t, tr.Save(now))
	small := New([]string{"spend_budget", "token_budget"})
	small.Configure(Settings{Enabled: true, TableSize: 15}, now)
	small.Restore(sv, now)
	st := small.Stats()
	for _, by := range Groupings() {
		if st.Rows[by] > st.Tables[by]*15 {
			t.Fatalf("by %s: %d rows in %d tables", by, st.Rows[by], st.Tables[by])
		}
	}
	a, b := report(t, tr, now, ByTenant, Month, 1000), report(t, small, now, ByTenant, Month, 1000)
	if a.Total.Refusals[2] != b.Total.Refusals[0] || a.Total.Refusals[0] != b.Total.Refusals[1] || b.Total.Refusals[2] != 0 {
		t.Fatalf("refusals %v restored as %v", a.Total.Refusals, b.Total.Refusals)
	}
	if a.Total.Prompt != b.Total.Prompt || len(b.Rows) > len(a.Rows) {
		t.Fatalf("prompt %d restored as %d; %d rows, was %d", a.Total.Prompt, b.Total.Prompt, len(b.Rows), len(a.Rows))
	}
	for _, row := range b.Rows[:5] {
		want := tokens(a, row.Key)
		if got := int64(row.Counts.Prompt + row.Counts.Completion); got > want || uint64(want-got) > row.Overcount {
			t.Errorf("%v: %d tokens (overcount %d), %d before", row.Key, got, row.Overcount, want)
		}
	}
}

// TestSavedCheckRefuses: what a tracker never writes is refused, saying what is wrong.
func TestSavedCheckRefuses(t *testing.T) {
	const good = `{"reasons":["token_budget"],"hours_up_to":"2026-06-03T07:00:00Z","days_up_to":"2026-06-03T00:00:00Z","tables":[
{"by":"tenant","level":"5m","start":"2026-06-03T07:00:00Z","end":"2026-06-03T07:05:00Z","slack":5,"total":[3,30,3,0,9,1],"rows":[["a","",0,2,20,2,0,6],["b","",5,1,10,1,0,3,1]]},
{"by":"tenant","level":"live","start":"2026-06-03T07:05:00Z","end":"2026-06-03T07:10:00Z","slack":0,"total":[0,0,0,0,0],"rows":[]}]}`
	var sv Saved
	if err := json.Unmarshal([]byte(good), &sv); err != nil {
		t.Fatal(err)
	}
	if err := sv.Check(); err != nil {
		t.Fatal(err)
	}
	cases := []struct{ name, from, to, want string }{
		{"unknown grouping", `"by":"tenant","level":"5m"`, `"by":"feature","level":"5m"`, `by "feature"`},
		{"unknown level", `"level":"5m"`, `"level":"1w"`, "unknown level"},
		{"a 5-minute bucket of 10", `"end":"2026-06-03T07:05:00Z"`, `"end":"2026-06-03T07:15:00Z"`, "a bucket from"},
		{"out of order", `"start":"2026-06-03T07:05:00Z"`, `"start":"2026-06-03T07:05:00Z"`, ""},
		{"a group twice", `["b","",5`, `["a","",5`, "appears twice"},
		{"a model by tenant", `["b","",5`, `["b","x",5`, "names a model"},
		{"err above slack", `["b","",5`, `["b","",6`, "above the table's slack"},
		{"rows above the total", `[3,30,3,0,9,1]`, `[3,29,3,0,9,1]`, "more than the total"},
		{"refusal of no reason", `0,3,1]]`, `0,3,1,1]]`, "reason 1"},
		{"cached above prompt", `["a","",0,2,20,2,0,6]`, `["a","",0,2,20,2,21,6]`, "cached"},
		{"a negative count", `["a","",0,2,20`, `["a","",0,-2,20`, "not a count"},
		{"a count too large", `["a","",0,2,20`, `["a","",0,2,999999999999999999`, "not a count"},
		{"too few columns", `["a","",0,2,20,2,0,6]`, `["a","",0,2]`, "count columns"},
		{"a name not a string", `["a","",0`, `[1,"",0`, "tenant"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			text := strings.Replace(good, c.from, c.to, 1)
			if c.want == "" {
				// Two live tables: more than a grouping keeps.
				text = strings.Replace(good, `"level":"5m"`, `"level":"live"`, 1)
				c.want = "more than 1 live tables"
			}
			var sv Saved
			err := json.Unmarshal([]byte(text), &sv)
			if err == nil {
				err = sv.Check()
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want it to say %q", err, c.want)
			}
		})
	}
}

// FuzzSaved: whatever a state file holds, reading it never panics, and what Check lets through
// restores into a tracker that reports every window within its bounds.
func FuzzSaved(f *testing.F) {
	start := time.Date(2026, 6, 3, 7, 0, 0, 0, time.UTC)
	tr := newTracker(f, 12, nil, start)
	r := rand.New(rand.NewPCG(4, 5))
	now := start
	for i := range 400 {
		now = now.Add(time.Duration(r.IntN(600)) * time.Second)
		tr.Record(now, settle(fmt.Sprintf("t%d", r.IntN(30)), fmt.Sprintf("m%d", r.IntN(4)), int64(i), 1))
	}
	data, err := json.Marshal(tr.Save(now))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(data)
	f.Add([]byte(`{"reasons":[],"tables":[]}`))
	f.Add([]byte(`{"reasons":["a"],"tables":[{"by":"model","level":"1d","start":"2026-06-01T00:00:00Z","end":"2026-06-02T00:00:00Z","slack":0,"total":[1,1,1,1,1],"rows":[["","m",0,1,1,1,1,1]]}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		var sv Saved
		if json.Unmarshal(data, &sv) != nil || sv.Check() != nil {
			return
		}
		back := newTracker(t, 10, nil, now)
		back.Restore(&sv, now)
		for _, w := range []Window{Hour, Day, Week, Month} {
			for _, by := range Groupings() {
				rep := report(t, back, now.Add(time.Minute), by, w, 5)
				for _, row := range rep.Rows {
					if row.Overcount > rep.MaxOvercount || row.Weight != row.Counts.Weight()+row.Overcount || !below(&row.Counts, &rep.Total) {
						t.Fatalf("%s by %s: row %+v, max overcount %d, total %+v", w, by, row, rep.MaxOvercount, rep.Total)
					}
				}
			}
		}
		if st := back.Stats(); st.Tables[ByTenant] > TablesPerGroup {
			t.Fatalf("%d tables", st.Tables[ByTenant])
		}
		// What was restored saves again into a file that reads back.
		roundTrip(t, back.Save(now.Add(time.Minute)))
	})
}
