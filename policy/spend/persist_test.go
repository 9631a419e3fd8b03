package spend

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

var day0 = time.Date(2026, 3, 14, 0, 0, 0, 0, time.UTC)

func sampleState() SavedState {
	return SavedState{Currency: "USD", Windows: []SavedWindow{
		{Budget: "tenant/acme", Period: "day", Start: day0, End: day0.Add(24 * time.Hour), Settled: 730_000, InFlight: 12_500},
		{Budget: "feature/chat", Period: "month", Start: time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC),
			End: time.Date(2026, 4, 1, 0, 0, 0, 0, time.UTC), Settled: 412_345_678},
	}}
}

func TestStateRoundTrip(t *testing.T) {
	st := sampleState()
	data, err := EncodeState(st)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseState(data)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, st) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, st)
	}
	// An empty state is a valid file too.
	data, err = EncodeState(SavedState{Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := ParseState(data); err != nil || got.Currency != "EUR" || len(got.Windows) != 0 {
		t.Fatalf("empty state: %+v, %v", got, err)
	}
}

func TestStateRejectsDamage(t *testing.T) {
	good, err := EncodeState(sampleState())
	if err != nil {
		t.Fatal(err)
	}
	reason := func(data []byte) string {
		_, err := ParseState(data)
		var se *StateError
		if err == nil {
			return ""
		}
		if !errors.As(err, &se) {
			t.Fatalf("error %v is not a *StateError", err)
		}
		return se.Reason
	}
	// Every truncation is refused (a crash mid-write cannot happen with the atomic writer, but a
	// full disk or a copy cut short can).
	for n := 0; n < len(good)-1; n++ {
		if r := reason(good[:n]); r != ReasonCorrupt {
			t.Fatalf("file cut to %d of %d bytes: reason %q, want corrupt", n, len(good), r)
		}
	}
	// Changing any digit of an amount breaks the checksum.
	i := bytes.Index(good, []byte("730000"))
	bad := bytes.Clone(good)
	bad[i] = '9'
	if r := reason(bad); r != ReasonCorrupt {
		t.Fatalf("changed amount: reason %q", r)
	}
	v2 := bytes.Replace(good, []byte(`"version":1`), []byte(`"version":2`), 1)
	if r := reason(v2); r != ReasonVersion {
		t.Fatalf("version 2: reason %q", r)
	}
	for name, data := range map[string]string{
		"other JSON":    `{"tenants": {"acme": 1}}`,
		"empty":         ``,
		"trailing data": string(good) + `{}`,
		"not hex":       strings.Replace(string(good), `"sha256":"`, `"sha256":"zz`, 1),
	} {
		if r := reason([]byte(data)); r != ReasonCorrupt {
			t.Errorf("%s: reason %q, want corrupt", name, r)
		}
	}
	// Content that checksums right but makes no sense is refused as well.
	for name, w := range map[string]SavedWindow{
		"negative":   {Budget: "a", Period: "day", Start: day0, End: day0.Add(time.Hour), Settled: -1},
		"backwards":  {Budget: "a", Period: "day", Start: day0, End: day0.Add(-time.Hour)},
		"no budget":  {Period: "day", Start: day0, End: day0.Add(time.Hour)},
		"bad period": {Budget: "a", Period: "week", Start: day0, End: day0.Add(time.Hour)},
	} {
		if r := reason(forge(t, SavedState{Currency: "USD", Windows: []SavedWindow{w}})); r != ReasonCorrupt {
			t.Errorf("%s: reason %q, want corrupt", name, r)
		}
	}
	dup := sampleState()
	dup.Windows = append(dup.Windows, dup.Windows[0])
	if r := reason(forge(t, dup)); r != ReasonCorrupt {
		t.Errorf("duplicate window: reason %q, want corrupt", r)
	}
	if _, err := EncodeState(SavedState{Currency: "USD", Windows: []SavedWindow{{Budget: "a", Period: "day", Start: day0, End: day0}}}); err == nil {
		t.Error("EncodeState wrote an empty window")
	}
}

// forge encodes st with a valid checksum, bypassing EncodeState's checks.
func forge(t *testing.T, st SavedState) []byte {
	t.Helper()
	good, err := EncodeState(SavedState{Currency: "USD"})
	if err != nil {
		t.Fatal(err)
	}
	env, err := parseEnvelope(good)
	if err != nil {
		t.Fatal(err)
	}
	return reseal(t, env, st)
}

// fakeSource is a Source keeping windows by budget, replacing them on restore as the ledger does.
type fakeSource struct {
	mu       sync.Mutex
	currency string
	windows  map[string]SavedWindow
}

func newFakeSource() *fakeSource {
	return &fakeSource{currency: "USD", windows: map[string]SavedWindow{}}
}

func (f *fakeSource) set(w SavedWindow) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.windows[w.Budget] = w
}

func (f *fakeSource) SaveState(now time.Time) SavedState {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := SavedState{Currency: f.currency}
	for _, w := range f.windows {
		if !now.Before(w.Start) && now.Before(w.End) {
			st.Windows = append(st.Windows, w)
		}
	}
	return st
}

func (f *fakeSource) RestoreState(st SavedState, now time.Time) (int, error) {
	if st.Currency != f.currency {
		return 0, &StateError{Reason: ReasonCurrency, Err: errors.New("currency " + st.Currency)}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, w := range st.Windows {
		if !now.Before(w.Start) && now.Before(w.End) {
			w.Settled, w.InFlight = w.Settled+w.InFlight, 0
			f.windows[w.Budget] = w
			n++
		}
	}
	return n, nil
}

type fixture struct {
	path string
	src  *fakeSource
	reg  *prometheus.Registry
	logs *bytes.Buffer
	now  time.Time
	p    *Persister
}

func newFixture(t *testing.T, interval time.Duration) *fixture {
	f := &fixture{path: filepath.Join(t.TempDir(), "spend.json"), src: newFakeSource(), reg: prometheus.NewRegistry(),
		logs: &bytes.Buffer{}, now: day0.Add(10 * time.Hour)}
	f.p = NewPersister(PersistOptions{Path: f.path, Interval: interval, Source: f.src, Now: func() time.Time { return f.now },
		Logger: slog.New(slog.NewJSONHandler(f.logs, nil)), Registerer: f.reg})
	return f
}

func (f *fixture) failures(t *testing.T, reason string) float64 {
	return value(t, f.p.met.failures.WithLabelValues(reason))
}

func TestPersisterRestoresWhatItSaved(t *testing.T) {
	f := newFixture(t, time.Minute)
	for _, w := range sampleState().Windows {
		f.src.set(w)
	}
	if err := f.p.Save(); err != nil {
		t.Fatal(err)
	}
	// Nothing but the file in the directory: the temporary file was renamed over it.
	entries, _ := os.ReadDir(filepath.Dir(f.path))
	if len(entries) != 1 || entries[0].Name() != "spend.json" {
		t.Fatalf("directory holds %v", entries)
	}
	if info, _ := os.Stat(f.path); info.Mode().Perm() != 0o600 {
		t.Errorf("state file mode %v, want 0600", info.Mode().Perm())
	}

	g := newFixture(t, time.Minute)
	g.path, g.p.o.Path = f.path, f.path
	if err := g.p.Restore(); err != nil {
		t.Fatal(err)
	}
	// Restoring twice replaces rather than adds.
	if err := g.p.Restore(); err != nil {
		t.Fatal(err)
	}
	w := g.src.windows["tenant/acme"]
	if w.Settled != 730_000+12_500 {
		t.Fatalf("tenant/acme restored at %d micro-units, want settled plus in flight (742500)", w.Settled)
	}
	if got := value(t, g.p.met.restored); got != 2 {
		t.Fatalf("restored windows gauge %v", got)
	}
}

// TestPersisterRefusingLeavesTheFile: with Refuse, a file that cannot be used is reported (an
// error naming it, counted) and left where it is, untouched, for the caller that will not
// start; a missing file is the first start either way.
func TestPersisterRefusingLeavesTheFile(t *testing.T) {
	good, err := EncodeState(sampleState())
	if err != nil {
		t.Fatal(err)
	}
	f := newFixture(t, time.Minute)
	f.p.o.Refuse = true
	var se *StateError
	if err := f.p.Restore(); !errors.As(err, &se) || se.Reason != ReasonMissing {
		t.Fatalf("missing file: %v, want reason missing", err)
	}
	cut := good[:len(good)/2]
	if err := os.WriteFile(f.path, cut, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := f.p.Restore(); !errors.As(err, &se) || se.Reason != ReasonCorrupt {
		t.Fatalf("truncated file: %v, want reason corrupt", err)
	}
	if kept, err := os.ReadFile(f.path); err != nil || !bytes.Equal(kept, cut) {
		t.Fatalf("the file was moved or changed (%v)", err)
	}
	if aside, _ := filepath.Glob(f.path + ".bad-*"); len(aside) != 0 {
		t.Fatalf("kept aside %v although the start is refused", aside)
	}
	if got := f.failures(t, ReasonCorrupt); got != 1 {
		t.Fatalf("restore failures{reason=corrupt} = %v", got)
	}
	if logs := f.logs.String(); !strings.Contains(logs, "not starting") || !strings.Contains(logs, f.path) {
		t.Fatalf("no error line naming the file: %s", logs)
	}
	if len(f.src.windows) != 0 {
		t.Fatalf("restored %v from a bad file", f.src.windows)
	}
}

func TestPersisterStartsEmptyOnBadFiles(t *testing.T) {
	good, err := EncodeState(sampleState())
	if err != nil {
		t.Fatal(err)
	}
	eur := bytes.Clone(good)
	env, _ := parseEnvelope(eur)
	st := sampleState()
	st.Currency = "EUR"
	eur = reseal(t, env, st)
	for _, tc := range []struct {
		name, reason string
		content      []byte // nil: no file
	}{
		{"missing", ReasonMissing, nil},
		{"truncated", ReasonCorrupt, good[:len(good)/2]},
		{"garbage", ReasonCorrupt, []byte("\x00\xff not json")},
		{"wrong version", ReasonVersion, bytes.Replace(good, []byte(`"version":1`), []byte(`"version":7`), 1)},
		{"other currency", ReasonCurrency, eur},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, time.Minute)
			if tc.content != nil {
				if err := os.WriteFile(f.path, tc.content, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			err := f.p.Restore()
			var se *StateError
			if !errors.As(err, &se) || se.Reason != tc.reason {
				t.Fatalf("Restore: %v, want reason %s", err, tc.reason)
			}
			if len(f.src.windows) != 0 {
				t.Fatalf("restored %v from a bad file", f.src.windows)
			}
			if got := f.failures(t, tc.reason); got != 1 {
				t.Fatalf("restore failures{reason=%q} = %v", tc.reason, got)
			}
			logs := f.logs.String()
			if !strings.Contains(logs, `"level":"ERROR"`) || !strings.Contains(logs, f.path) || !strings.Contains(logs, `"reason":"`+tc.reason+`"`) {
				t.Fatalf("no error line naming the file and the reason: %s", logs)
			}
			if _, err := os.Stat(f.path); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the bad file is still at %s (%v): the next write would replace it", f.path, err)
			}
			aside, _ := filepath.Glob(f.path + ".bad-*")
			if tc.content == nil {
				if len(aside) != 0 {
					t.Fatalf("kept aside %v for a missing file", aside)
				}
			} else {
				if len(aside) != 1 {
					t.Fatalf("bad file not kept aside: %v", aside)
				}
				if kept, _ := os.ReadFile(aside[0]); !bytes.Equal(kept, tc.content) {
					t.Fatal("the file kept aside differs from the bad file")
				}
			}
			// The next write starts the file afresh.
			f.src.set(sampleState().Windows[0])
			if err := f.p.Save(); err != nil {
				t.Fatal(err)
			}
			if st, err := ReadState(f.path); err != nil || len(st.Windows) != 1 {
				t.Fatalf("state after a fresh write: %+v, %v", st, err)
			}
		})
	}
}

func TestPersisterSavesOnlyCurrentWindowsAndSkipsUnchanged(t *testing.T) {
	f := newFixture(t, time.Minute)
	old := SavedWindow{Budget: "tenant/old", Period: "day", Start: day0.Add(-24 * time.Hour), End: day0, Settled: 5}
	f.src.set(old)
	f.src.set(sampleState().Windows[0])
	if err := f.p.Save(); err != nil {
		t.Fatal(err)
	}
	st, err := ReadState(f.path)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Windows) != 1 || st.Windows[0].Budget != "tenant/acme" {
		t.Fatalf("saved %+v, want only the current window", st.Windows)
	}
	if err := f.p.Save(); err != nil {
		t.Fatal(err)
	}
	if got := value(t, f.p.met.writes.WithLabelValues("unchanged")); got != 1 {
		t.Fatalf("unchanged writes %v, want 1", got)
	}
	if got := value(t, f.p.met.saved); got != float64(f.now.Unix()) {
		t.Fatalf("saved timestamp %v, want %d", got, f.now.Unix())
	}
}

func TestPersisterWriteFailureIsLoggedOnceAndCounted(t *testing.T) {
	f := newFixture(t, time.Minute)
	f.p.o.Path = filepath.Join(t.TempDir(), "gone", "spend.json")
	f.src.set(sampleState().Windows[0])
	for range 3 {
		if err := f.p.Save(); err == nil {
			t.Fatal("Save into a missing directory succeeded")
		}
	}
	if got := value(t, f.p.met.writes.WithLabelValues("error")); got != 3 {
		t.Fatalf("write errors %v, want 3", got)
	}
	if n := strings.Count(f.logs.String(), "cannot write the spend state file"); n != 1 {
		t.Fatalf("logged the failure %d times, want once per streak", n)
	}
	if err := os.MkdirAll(filepath.Dir(f.p.o.Path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := f.p.Save(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(f.logs.String(), "spend state file written again") {
		t.Fatal("recovery not logged")
	}
}

func TestPersisterWritesEveryIntervalAndAtClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, 10*time.Second)
		f.p.Start()
		w := sampleState().Windows[0]
		w.Settled = 100
		f.src.set(w)
		time.Sleep(9 * time.Second)
		synctest.Wait()
		if _, err := os.Stat(f.path); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("file written before the first interval: %v", err)
		}
		time.Sleep(time.Second)
		synctest.Wait()
		st, err := ReadState(f.path)
		if err != nil || st.Windows[0].Settled != 100 {
			t.Fatalf("after one interval: %+v, %v", st, err)
		}
		// Settled after the last write and before Close: written by Close.
		w.Settled = 250
		f.src.set(w)
		if err := f.p.Close(); err != nil {
			t.Fatal(err)
		}
		if st, err := ReadState(f.path); err != nil || st.Windows[0].Settled != 250 {
			t.Fatalf("after Close: %+v, %v", st, err)
		}
		if err := f.p.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
	})
}

func TestPersisterCloseWithoutStart(t *testing.T) {
	f := newFixture(t, time.Minute)
	f.src.set(sampleState().Windows[0])
	if err := f.p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadState(f.path); err != nil {
		t.Fatal(err)
	}
}

// value reads a counter's or gauge's current value.
func value(t *testing.T, c prometheus.Collector) float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil || len(mfs) != 1 || len(mfs[0].GetMetric()) != 1 {
		t.Fatalf("gathering %v: %v", c, err)
	}
	m := mfs[0].GetMetric()[0]
	if m.GetCounter() != nil {
		return m.GetCounter().GetValue()
	}
	return m.GetGauge().GetValue()
}
