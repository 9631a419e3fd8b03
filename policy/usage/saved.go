package usage

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
)

// Saved is a tracker's tables as a state file keeps them, so that a restart continues every
// window where it stopped. Its JSON form is
//
//	{"reasons":["token_budget",…],"hours_up_to":"…","days_up_to":"…",
//	 "tables":[{"by":"tenant","level":"5m","start":"…","end":"…","slack":0,
//	   "total":[requests,prompt,completion,cached,spend,refusals…],
//	   "rows":[["acme","",err,requests,prompt,completion,cached,spend,refusals…],…]},…]}
//
// where spend is in millionths of the currency unit and the refusal counts follow reasons
// (trailing zeros left out). Levels are live (the bucket being counted), 5m, 1h and 1d.
type Saved struct {
	// Reasons names the refusal reasons, in the order of the refusal counts of every table.
	Reasons []string `json:"reasons"`
	// HoursUpTo and DaysUpTo are where 5-minute buckets were last folded into hours, and hours
	// into days.
	HoursUpTo time.Time `json:"hours_up_to"`
	DaysUpTo  time.Time `json:"days_up_to"`
	// Tables are every grouping's tables, each level's in time order.
	Tables []SavedTable `json:"tables"`
}

// Levels of a saved table.
const (
	LevelLive = "live"
	LevelFive = "5m"
	LevelHour = "1h"
	LevelDay  = "1d"
)

// SavedTable is one table of a Saved.
type SavedTable struct {
	By    By
	Level string
	Start time.Time
	End   time.Time
	Slack uint64
	Total Counts
	rows  []entry
}

// Bounds of what a saved tracker may hold: every count and the slack fit with room for the sums
// of a window, and names are no longer than a state file's.
const (
	maxSavedCount  = 1 << 48
	maxSavedSlack  = 1 << 52
	maxSavedName   = 4096
	maxSavedReason = 64
)

// Save returns the tracker's tables at now (rolled to now first), nil when it is off. The closed
// tables are shared, not copied: they never change.
func (t *Tracker) Save(now time.Time) *Saved {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.series[0].live == nil {
		return nil
	}
	if !now.Before(t.cur.end) {
		t.roll(now)
	}
	sv := &Saved{Reasons: t.reasons, HoursUpTo: t.hoursUpTo, DaysUpTo: t.daysUpTo}
	for b := range t.series {
		s := &t.series[b]
		add := func(level string, tabs ...*table) {
			for _, tab := range tabs {
				sv.Tables = append(sv.Tables, SavedTable{By: By(b), Level: level, Start: tab.start, End: tab.end, Slack: tab.slack, Total: tab.total, rows: tab.rows})
			}
		}
		add(LevelDay, s.days...)
		add(LevelHour, s.hours...)
		add(LevelFive, s.fives...)
		live := s.live.frozen()
		add(LevelLive, live)
	}
	return sv
}

// Restore replaces the tracker's tables with sv's at now, under the tracker's settings: refusal
// counts are matched to reasons by name (a reason this build does not know is dropped), a table
// larger than the table size loses its smallest groups as a full table would, the live bucket
// is live again if now is still in it, and what no window needs at now is dropped. It returns
// the number of tables restored. sv must have passed Check; an off tracker restores nothing.
func (t *Tracker) Restore(sv *Saved, now time.Time) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.series[0].live == nil || sv == nil {
		return 0
	}
	// to maps the file's reason indexes to the tracker's (-1: unknown).
	to := make([]int, len(sv.Reasons))
	for i, name := range sv.Reasons {
		to[i] = slices.Index(t.reasons, name)
	}
	remap := func(c Counts) Counts {
		out := c
		out.Refusals = [MaxReasons]uint64{}
		for i, n := range c.Refusals {
			if i < len(to) && to[i] >= 0 {
				out.Refusals[to[i]] += n
			}
		}
		return out
	}
	for b := range t.series {
		s := &t.series[b]
		s.fives, s.hours, s.days = nil, nil, nil
		s.live.reset(t.cur.start, t.cur.end)
	}
	n := 0
	var live span
	for i := range sv.Tables {
		st := &sv.Tables[i]
		tab := &table{start: st.Start, end: st.End, size: t.size, slack: st.Slack, total: remap(st.Total), rows: make([]entry, len(st.rows))}
		for j := range st.rows {
			e := st.rows[j]
			e.c = remap(e.c)
			e.est = e.err + e.c.Weight()
			tab.rows[j] = e
		}
		if len(tab.rows) > t.size {
			cut := merge([]*table{tab}, t.size)
			cut.start, cut.end = tab.start, tab.end
			tab = cut
		}
		s := &t.series[st.By]
		n++
		switch st.Level {
		case LevelDay:
			s.days = append(s.days, tab)
		case LevelHour:
			s.hours = append(s.hours, tab)
		case LevelFive:
			s.fives = append(s.fives, tab)
		case LevelLive:
			if now.Before(tab.end) && !now.Before(tab.start) {
				l := s.live
				l.start, l.end, l.total, l.slack = tab.start, tab.end, tab.total, tab.slack
				l.rows = append(l.rows[:0], tab.rows...)
				l.reindex()
				live = span{tab.start, tab.end}
			} else {
				s.fives = append(s.fives, tab)
			}
		}
	}
	if live.end.IsZero() {
		live = t.fiveSpan(now)
	}
	t.cur = live
	t.setLiveSpan()
	// Buckets are folded up to the file's marks, never beyond now (a file from a clock ahead).
	t.hoursUpTo, t.daysUpTo = minTime(sv.HoursUpTo, t.hourSpan(now).start), minTime(sv.DaysUpTo, t.daySpan(now).start)
	for b := range t.series {
		s := &t.series[b]
		// Each level in time order (a live table past its bucket joined the 5-minute buckets
		// last; a clock that went back may have saved others out of order).
		for _, l := range []*[]*table{&s.fives, &s.hours, &s.days} {
			slices.SortStableFunc(*l, func(a, b *table) int { return a.start.Compare(b.start) })
		}
	}
	// What ended while the process was down is folded, and what no window needs dropped.
	if now.Before(t.cur.end) {
		t.advance(now)
	} else {
		t.roll(now)
	}
	return n
}

// maxSpan is the longest bucket of each level: a day of 25 hours, where clocks go back.
func maxSpan(level string) time.Duration {
	switch level {
	case LevelHour:
		return time.Hour
	case LevelDay:
		return 25 * time.Hour
	}
	return fiveMinutes
}

// maxTables is the most tables of one level a grouping keeps.
func maxTables(level string) int {
	switch level {
	case LevelLive:
		return 1
	case LevelFive:
		return maxFives
	case LevelHour:
		return maxHours
	}
	return maxDays
}

// Check reports the first thing in sv a tracker never saves, so that a restore can trust it:
// unknown groupings or levels, more tables than a grouping keeps, buckets longer than their
// level, more rows than MaxTableSize, a group twice in a table, a row with
// the other grouping's name, counts beyond what a table can count or above its total, an err
// above the slack.
func (sv *Saved) Check() error {
	if len(sv.Reasons) > maxSavedReason {
		return fmt.Errorf("%d refusal reasons, at most %d", len(sv.Reasons), maxSavedReason)
	}
	for i, r := range sv.Reasons {
		if r == "" || len(r) > maxSavedReason {
			return fmt.Errorf("refusal reason %d has %d bytes", i, len(r))
		}
	}
	type level struct {
		by    By
		level string
	}
	count := map[level]int{}
	for i := range sv.Tables {
		st := &sv.Tables[i]
		if err := st.check(len(sv.Reasons)); err != nil {
			return fmt.Errorf("table %d (%s, %s): %v", i, st.By, st.Level, err)
		}
		k := level{st.By, st.Level}
		count[k]++
		if count[k] > maxTables(st.Level) {
			return fmt.Errorf("table %d: more than %d %s tables by %s", i, maxTables(st.Level), st.Level, st.By)
		}
	}
	return nil
}

func (st *SavedTable) check(reasons int) error {
	switch {
	case st.By >= numBy:
		return errors.New("unknown grouping")
	case st.Level != LevelLive && st.Level != LevelFive && st.Level != LevelHour && st.Level != LevelDay:
		return errors.New("unknown level")
	case !st.Start.Before(st.End) || st.End.Sub(st.Start) > maxSpan(st.Level):
		return fmt.Errorf("a bucket from %s to %s", st.Start.Format(time.RFC3339Nano), st.End.Format(time.RFC3339Nano))
	case len(st.rows) > MaxTableSize:
		return fmt.Errorf("%d rows, at most %d", len(st.rows), MaxTableSize)
	case st.Slack > maxSavedSlack:
		return fmt.Errorf("slack %d out of range", st.Slack)
	}
	if err := checkCounts(&st.Total, reasons); err != nil {
		return fmt.Errorf("total: %v", err)
	}
	seen := make(map[Key]bool, len(st.rows))
	var sum Counts
	for i := range st.rows {
		e := &st.rows[i]
		k := e.key
		switch {
		case len(k.Tenant) > maxSavedName || len(k.Model) > maxSavedName:
			return fmt.Errorf("row %d: a name of more than %d bytes", i, maxSavedName)
		case st.By == ByTenant && k.Model != "", st.By == ByModel && k.Tenant != "":
			return fmt.Errorf("row %d: a row by %s names a %s", i, st.By, map[By]string{ByTenant: "model", ByModel: "tenant"}[st.By])
		case seen[k]:
			return fmt.Errorf("row %d: tenant %q, model %q appears twice", i, k.Tenant, k.Model)
		case e.err > st.Slack:
			return fmt.Errorf("row %d: err %d above the table's slack %d", i, e.err, st.Slack)
		}
		seen[k] = true
		if err := checkCounts(&e.c, reasons); err != nil {
			return fmt.Errorf("row %d: %v", i, err)
		}
		sum.Add(&e.c)
	}
	if !below(&sum, &st.Total) {
		return errors.New("the rows count more than the total")
	}
	return nil
}

func checkCounts(c *Counts, reasons int) error {
	vals := []uint64{c.Requests, c.Prompt, c.Completion, c.Cached, uint64(c.Spend)}
	if c.Spend < 0 {
		return errors.New("negative spend")
	}
	for i, n := range c.Refusals {
		if n != 0 && i >= reasons {
			return fmt.Errorf("refusals of reason %d, of %d reasons", i, reasons)
		}
		vals = append(vals, n)
	}
	for _, v := range vals {
		if v > maxSavedCount {
			return fmt.Errorf("a count of %d, more than %d", v, uint64(maxSavedCount))
		}
	}
	if c.Cached > c.Prompt {
		return errors.New("more cached tokens than prompt tokens")
	}
	return nil
}

// below reports whether every count of a is at most b's.
func below(a, b *Counts) bool {
	if a.Requests > b.Requests || a.Prompt > b.Prompt || a.Completion > b.Completion || a.Cached > b.Cached || a.Spend > b.Spend {
		return false
	}
	for i := range a.Refusals {
		if a.Refusals[i] > b.Refusals[i] {
			return false
		}
	}
	return true
}

// savedTableJSON is a SavedTable's JSON form but for total and rows, read and written by hand.
type savedTableJSON struct {
	By    string          `json:"by"`
	Level string          `json:"level"`
	Start time.Time       `json:"start"`
	End   time.Time       `json:"end"`
	Slack uint64          `json:"slack"`
	Total json.RawMessage `json:"total"`
	Rows  json.RawMessage `json:"rows"`
}

// MarshalJSON writes the table, its rows without reflection: a state file holds thousands.
func (st SavedTable) MarshalJSON() ([]byte, error) {
	out := make([]byte, 0, 160+len(st.rows)*64)
	out = append(out, `{"by":`...)
	out = strconv.AppendQuote(out, st.By.String())
	out = append(out, `,"level":`...)
	out = strconv.AppendQuote(out, st.Level)
	out = append(out, `,"start":"`...)
	out = st.Start.UTC().AppendFormat(out, time.RFC3339Nano)
	out = append(out, `","end":"`...)
	out = st.End.UTC().AppendFormat(out, time.RFC3339Nano)
	out = append(out, `","slack":`...)
	out = strconv.AppendUint(out, min(st.Slack, maxSavedSlack), 10)
	out = append(out, `,"total":[`...)
	out = appendCounts(out, &st.Total)
	out = append(out, `],"rows":[`...)
	for i := range st.rows {
		e := &st.rows[i]
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, '[')
		out = appendString(out, e.key.Tenant)
		out = append(out, ',')
		out = appendString(out, e.key.Model)
		out = append(out, ',')
		out = strconv.AppendUint(out, min(e.err, maxSavedSlack), 10)
		out = append(out, ',')
		out = appendCounts(out, &e.c)
		out = append(out, ']')
	}
	return append(out, "]}"...), nil
}

// appendCounts writes c's columns: requests, prompt, completion, cached, spend, then the
// refusals up to the last that is not 0. A count beyond what a file may hold is written as that.
func appendCounts(out []byte, c *Counts) []byte {
	n := len(c.Refusals)
	for n > 0 && c.Refusals[n-1] == 0 {
		n--
	}
	vals := [5 + MaxReasons]uint64{c.Requests, c.Prompt, c.Completion, min(c.Cached, c.Prompt), uint64(max(c.Spend, 0))}
	copy(vals[5:], c.Refusals[:n])
	for i, v := range vals[:5+n] {
		if i > 0 {
			out = append(out, ',')
		}
		out = strconv.AppendUint(out, min(v, maxSavedCount), 10)
	}
	return out
}

// appendString writes s as a JSON string.
func appendString(out []byte, s string) []byte {
	simple := utf8.ValidString(s)
	for i := 0; i < len(s) && simple; i++ {
		simple = s[i] >= 0x20 && s[i] != '"' && s[i] != '\\' && s[i] != 0x7f
	}
	if simple {
		out = append(out, '"')
		out = append(out, s...)
		return append(out, '"')
	}
	b, _ := json.Marshal(s)
	return append(out, b...)
}

// UnmarshalJSON reads a table.
func (st *SavedTable) UnmarshalJSON(data []byte) error {
	var j savedTableJSON
	if err := json.Unmarshal(data, &j); err != nil {
		return err
	}
	b, ok := ParseBy(j.By)
	if !ok || j.By == "model,tenant" {
		return fmt.Errorf("by %q is not tenant, model or tenant,model", j.By)
	}
	*st = SavedTable{By: b, Level: j.Level, Start: j.Start, End: j.End, Slack: j.Slack}
	var total []json.RawMessage
	if err := json.Unmarshal(j.Total, &total); err != nil {
		return fmt.Errorf("total: %v", err)
	}
	if err := parseCounts(total, &st.Total); err != nil {
		return fmt.Errorf("total: %v", err)
	}
	var rows [][]json.RawMessage
	if err := json.Unmarshal(j.Rows, &rows); err != nil {
		return fmt.Errorf("rows: %v", err)
	}
	if len(rows) > MaxTableSize {
		return fmt.Errorf("%d rows, at most %d", len(rows), MaxTableSize)
	}
	st.rows = make([]entry, len(rows))
	for i, r := range rows {
		if len(r) < 3 {
			return fmt.Errorf("row %d has %d columns", i, len(r))
		}
		e := &st.rows[i]
		if err := json.Unmarshal(r[0], &e.key.Tenant); err != nil {
			return fmt.Errorf("row %d: tenant: %v", i, err)
		}
		if err := json.Unmarshal(r[1], &e.key.Model); err != nil {
			return fmt.Errorf("row %d: model: %v", i, err)
		}
		v, err := strconv.ParseUint(string(r[2]), 10, 64)
		if err != nil {
			return fmt.Errorf("row %d: err: %v", i, err)
		}
		e.err = v
		if err := parseCounts(r[3:], &e.c); err != nil {
			return fmt.Errorf("row %d: %v", i, err)
		}
		e.est = e.err + e.c.Weight()
	}
	return nil
}

// parseCounts reads the columns appendCounts writes. Refusal columns beyond MaxReasons (reasons
// of a later build) are dropped.
func parseCounts(cols []json.RawMessage, c *Counts) error {
	if len(cols) < 5 {
		return fmt.Errorf("%d count columns, at least 5", len(cols))
	}
	if len(cols) > 5+maxSavedReason {
		return fmt.Errorf("%d count columns, at most %d", len(cols), 5+maxSavedReason)
	}
	for i, col := range cols {
		v, err := strconv.ParseUint(string(col), 10, 64)
		if err != nil || v > maxSavedCount {
			return fmt.Errorf("column %d: %s is not a count", i, strconv.Quote(string(col)))
		}
		switch {
		case i == 0:
			c.Requests = v
		case i == 1:
			c.Prompt = v
		case i == 2:
			c.Completion = v
		case i == 3:
			c.Cached = v
		case i == 4:
			c.Spend = money.Micros(v)
		case i-5 < MaxReasons:
			c.Refusals[i-5] = v
		}
	}
	return nil
}
