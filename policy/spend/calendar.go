package spend

import (
	"time"
	// The zone database is compiled in, so that a time_zone works in images without one.
	_ "time/tzdata"
)

// Period is the length of a spend budget's calendar window.
type Period uint8

// Periods.
const (
	// Hour is a clock hour of the zone: a repeated hour at the end of summer time is two
	// windows, a skipped one none, and an hour in which the offset changes by half an hour
	// ends at the change.
	Hour Period = iota
	// Day runs from midnight to midnight in the zone (23 or 25 hours on the days clocks change).
	Day
	// Month runs from midnight on the 1st to midnight on the next 1st in the zone.
	Month
	numPeriods
)

// Periods lists every period, shortest first.
var Periods = [...]Period{Hour, Day, Month}

// String returns "hour", "day" or "month".
func (p Period) String() string {
	switch p {
	case Hour:
		return "hour"
	case Day:
		return "day"
	case Month:
		return "month"
	}
	return "unknown"
}

// ParsePeriod reads "hour", "day" or "month".
func ParsePeriod(s string) (Period, bool) {
	for _, p := range Periods {
		if p.String() == s {
			return p, true
		}
	}
	return 0, false
}

// Calendar places instants in the windows of a time zone. The zero Calendar is UTC.
type Calendar struct {
	loc *time.Location
}

// NewCalendar returns a calendar in loc (nil means UTC).
func NewCalendar(loc *time.Location) Calendar { return Calendar{loc: loc} }

// Location returns the calendar's zone.
func (c Calendar) Location() *time.Location {
	if c.loc == nil {
		return time.UTC
	}
	return c.loc
}

// Start returns the start of the window of period p that holds t, in the calendar's zone.
func (c Calendar) Start(p Period, t time.Time) time.Time {
	t = t.In(c.Location())
	switch p {
	case Hour:
		// The start of the clock hour: minutes and seconds back from t (unlike time.Date with
		// the hour, this stays in the right one of two repeated hours), but not before the
		// zone's offset last changed (where it changes by half an hour, an hour starts then).
		start := t.Add(-sinceHour(t))
		if zs, _ := t.ZoneBounds(); zs.After(start) {
			start = zs
		}
		return start
	case Day:
		y, m, d := t.Date()
		return c.midnight(y, m, d)
	default:
		y, m, _ := t.Date()
		return c.midnight(y, m, 1)
	}
}

// End returns the end of the window of period p that starts at start: the start of the next.
func (c Calendar) End(p Period, start time.Time) time.Time {
	start = start.In(c.Location())
	switch p {
	case Hour:
		// The next clock hour, or the next change of offset if that comes first.
		end := start.Add(time.Hour - sinceHour(start))
		if _, ze := start.ZoneBounds(); !ze.IsZero() && ze.Before(end) {
			end = ze
		}
		return end
	case Day:
		y, m, d := start.Date()
		return c.midnight(y, m, d+1)
	default:
		y, m, _ := start.Date()
		return c.midnight(y, m+1, 1)
	}
}

// sinceHour is how long ago the clock hour of t began on t's clock.
func sinceHour(t time.Time) time.Duration {
	return time.Duration(t.Minute())*time.Minute + time.Duration(t.Second())*time.Second + time.Duration(t.Nanosecond())
}

// midnight returns the first instant of the given date (normalised: day 32 is the 1st of the
// next month) in the zone. Where the clocks skip midnight (a change at 00:00), the day starts
// when they resume.
func (c Calendar) midnight(y int, m time.Month, d int) time.Time {
	y, m, d = time.Date(y, m, d, 12, 0, 0, 0, time.UTC).Date()
	start := time.Date(y, m, d, 0, 0, 0, 0, c.Location())
	if sy, sm, sd := start.Date(); sy != y || sm != m || sd != d {
		// time.Date placed a skipped midnight in the day before: the day starts an hour later.
		start = time.Date(y, m, d, 1, 0, 0, 0, c.Location())
	}
	return start
}
