package spend_test

import (
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

func zone(t *testing.T, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

func TestCalendarWindows(t *testing.T) {
	utc := time.UTC
	ny := zone(t, "America/New_York")
	berlin := zone(t, "Europe/Berlin")
	at := func(s string) time.Time {
		v, err := time.Parse(time.RFC3339, s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	tests := []struct {
		name      string
		loc       *time.Location
		period    spend.Period
		t         string
		wantStart string
		wantEnd   string
		wantLen   time.Duration
	}{
		{"month ends on the 31st", utc, spend.Month, "2026-01-31T23:59:59Z", "2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z", 31 * 24 * time.Hour},
		{"the 1st starts a new month", utc, spend.Month, "2026-02-01T00:00:00Z", "2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z", 28 * 24 * time.Hour},
		{"leap February", utc, spend.Month, "2028-02-29T12:00:00Z", "2028-02-01T00:00:00Z", "2028-03-01T00:00:00Z", 29 * 24 * time.Hour},
		{"December rolls into the next year", utc, spend.Month, "2026-12-31T23:00:00Z", "2026-12-01T00:00:00Z", "2027-01-01T00:00:00Z", 31 * 24 * time.Hour},
		{"a month in the zone, not in UTC", ny, spend.Month, "2026-02-01T03:00:00Z", "2026-01-01T00:00:00-05:00", "2026-02-01T00:00:00-05:00", 31 * 24 * time.Hour},
		{"a day in the zone", ny, spend.Day, "2026-01-15T04:59:59Z", "2026-01-14T00:00:00-05:00", "2026-01-15T00:00:00-05:00", 24 * time.Hour},
		{"New York spring forward: a 23-hour day", ny, spend.Day, "2026-03-08T12:00:00-04:00", "2026-03-08T00:00:00-05:00", "2026-03-09T00:00:00-04:00", 23 * time.Hour},
		{"New York fall back: a 25-hour day", ny, spend.Day, "2026-11-01T23:30:00-05:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00", 25 * time.Hour},
		{"New York month with a clock change", ny, spend.Month, "2026-03-20T00:00:00-04:00", "2026-03-01T00:00:00-05:00", "2026-04-01T00:00:00-04:00", 31*24*time.Hour - time.Hour},
		{"first of the repeated hours", ny, spend.Hour, "2026-11-01T01:30:00-04:00", "2026-11-01T01:00:00-04:00", "2026-11-01T01:00:00-05:00", time.Hour},
		{"second of the repeated hours", ny, spend.Hour, "2026-11-01T01:30:00-05:00", "2026-11-01T01:00:00-05:00", "2026-11-01T02:00:00-05:00", time.Hour},
		{"the hour before the skipped one", ny, spend.Hour, "2026-03-08T01:59:59-05:00", "2026-03-08T01:00:00-05:00", "2026-03-08T03:00:00-04:00", time.Hour},
		{"Berlin spring forward: a 23-hour day", berlin, spend.Day, "2026-03-29T10:00:00+02:00", "2026-03-29T00:00:00+01:00", "2026-03-30T00:00:00+02:00", 23 * time.Hour},
		{"Berlin fall back: a 25-hour day", berlin, spend.Day, "2026-10-25T02:30:00+01:00", "2026-10-25T00:00:00+02:00", "2026-10-26T00:00:00+01:00", 25 * time.Hour},
		{"Berlin month starts at local midnight", berlin, spend.Month, "2026-03-31T22:30:00Z", "2026-04-01T00:00:00+02:00", "2026-05-01T00:00:00+02:00", 30 * 24 * time.Hour},
		{"an hour in UTC", utc, spend.Hour, "2026-05-05T10:59:59.999Z", "2026-05-05T10:00:00Z", "2026-05-05T11:00:00Z", time.Hour},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cal := spend.NewCalendar(tt.loc)
			start := cal.Start(tt.period, at(tt.t))
			end := cal.End(tt.period, start)
			if !start.Equal(at(tt.wantStart)) {
				t.Errorf("start = %s, want %s", start.Format(time.RFC3339), tt.wantStart)
			}
			if !end.Equal(at(tt.wantEnd)) {
				t.Errorf("end = %s, want %s", end.Format(time.RFC3339), tt.wantEnd)
			}
			if got := end.Sub(start); got != tt.wantLen {
				t.Errorf("window is %s long, want %s", got, tt.wantLen)
			}
			if at(tt.t).Before(start) || !at(tt.t).Before(end) {
				t.Errorf("%s is outside its window [%s, %s)", tt.t, start, end)
			}
		})
	}
}

// Windows follow each other without gap or overlap through a year of clock changes.
func TestCalendarWindowsTile(t *testing.T) {
	for _, name := range []string{"UTC", "America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "Asia/Kolkata", "America/Santiago"} {
		cal := spend.NewCalendar(zone(t, name))
		for _, p := range spend.Periods {
			start := cal.Start(p, time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
			for start.Year() < 2027 {
				end := cal.End(p, start)
				if !end.After(start) {
					t.Fatalf("%s %s: window at %s ends at %s", name, p, start, end)
				}
				mid := start.Add(end.Sub(start) / 2)
				if got := cal.Start(p, mid); !got.Equal(start) {
					t.Fatalf("%s %s: %s is in the window starting %s, want %s", name, p, mid, got, start)
				}
				if got := cal.Start(p, end.Add(-time.Nanosecond)); !got.Equal(start) {
					t.Fatalf("%s %s: the last instant before %s is in the window starting %s, want %s", name, p, end, got, start)
				}
				if got := cal.Start(p, end); !got.Equal(end) {
					t.Fatalf("%s %s: the window holding %s starts %s", name, p, end, got)
				}
				start = end
			}
		}
	}
}

func TestZeroCalendarIsUTC(t *testing.T) {
	var cal spend.Calendar
	got := cal.Start(spend.Day, time.Date(2026, 6, 1, 23, 0, 0, 0, time.FixedZone("x", -3*3600)))
	if want := time.Date(2026, 6, 2, 0, 0, 0, 0, time.UTC); !got.Equal(want) {
		t.Fatalf("start = %s, want %s", got, want)
	}
}
