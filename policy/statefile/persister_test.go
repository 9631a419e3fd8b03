package statefile

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

	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// fakeSource is a Source keeping spend windows by budget and token windows by compartment and
// kind, replacing them on restore as the engine does.
type fakeSource struct {
	mu       sync.Mutex
	currency string
	spend    map[string]spend.SavedWindow
	windows  map[string]Window
}

func newFakeSource() *fakeSource {
	return &fakeSource{currency: "USD", spend: map[string]spend.SavedWindow{}, windows: map[string]Window{}}
}

func (f *fakeSource) setSpend(w spend.SavedWindow) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.spend[w.Budget] = w
}

func (f *fakeSource) set(w Window) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.windows[w.Kind+w.CompartmentID()] = w
}

func (f *fakeSource) SaveState(now time.Time) State {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := State{Currency: f.currency}
	for _, w := range f.spend {
		if !now.Before(w.Start) && now.Before(w.End) {
			st.Spend = append(st.Spend, w)
		}
	}
	for _, w := range f.windows {
		st.Windows = append(st.Windows, w)
	}
	return st
}

func (f *fakeSource) RestoreState(st State, now time.Time) (Restored, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := Restored{}
	for _, w := range st.Windows {
		f.windows[w.Kind+w.CompartmentID()] = w
		n[w.Kind]++
	}
	if st.Currency != f.currency {
		return n, &StateError{Reason: ReasonCurrency, Err: errors.New("currency " + st.Currency)}
	}
	for _, w := range st.Spend {
		if !now.Before(w.Start) && now.Before(w.End) {
			w.Settled, w.InFlight = w.Settled+w.InFlight, 0
			f.spend[w.Budget] = w
			n[KindSpend]++
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
	f := &fixture{path: filepath.Join(t.TempDir(), "state.json"), src: newFakeSource(), reg: prometheus.NewRegistry(),
		logs: &bytes.Buffer{}, now: day0.Add(10 * time.Hour)}
	f.p = NewPersister(PersistOptions{Path: f.path, Interval: interval, Source: f.src, Now: func() time.Time { return f.now },
		Logger: slog.New(slog.NewJSONHandler(f.logs, nil)), Registerer: f.reg})
	return f
}

func (f *fixture) failures(t *testing.T, reason string) float64 {
	return value(t, f.p.met.failures.WithLabelValues(reason))
}

// fill gives the source every window of sampleState.
func (f *fixture) fill() {
	for _, w := range sampleState().Spend {
		f.src.setSpend(w)
	}
	for _, w := range sampleState().Windows {
		f.src.set(w)
	}
}

func TestPersisterRestoresWhatItSaved(t *testing.T) {
	f := newFixture(t, time.Minute)
	f.fill()
	if err := f.p.Save(); err != nil {
		t.Fatal(err)
	}
	// Nothing but the file in the directory: the temporary file was renamed over it.
	entries, _ := os.ReadDir(filepath.Dir(f.path))
	if len(entries) != 1 || entries[0].Name() != "state.json" {
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
	w := g.src.spend["tenant/acme"]
	if w.Settled != 730_000+12_500 {
		t.Fatalf("tenant/acme restored at %d micro-units, want settled plus in flight (742500)", w.Settled)
	}
	if !reflect.DeepEqual(g.src.windows, f.src.windows) {
		t.Fatalf("windows restored:\n%+v\nwant what was saved:\n%+v", g.src.windows, f.src.windows)
	}
	for kind, want := range map[string]float64{KindSpend: 2, KindTokensPerMinute: 2, KindTokensPerDay: 1, KindRequestsPerMinute: 1} {
		if got := value(t, g.p.met.restored.WithLabelValues(kind)); got != want {
			t.Errorf("restored windows gauge{kind=%s} %v, want %v", kind, got, want)
		}
	}
}

// TestPersisterRefusingLeavesTheFile: with Refuse, a file that cannot be used is reported (an
// error naming it, counted) and left where it is, untouched, for the caller that will not
// start; a missing file is the first start either way.
func TestPersisterRefusingLeavesTheFile(t *testing.T) {
	good, err := Encode(sampleState())
	if err != nil {
		t.Fatal(err)
	}
	f := newFixture(t, time.Minute)
	f.p.o.Refuse = true
	if err := f.p.Restore(); reasonOf(t, err) != ReasonMissing {
		t.Fatalf("missing file: %v, want reason missing", err)
	}
	cut := good[:len(good)/2]
	if err := os.WriteFile(f.path, cut, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := f.p.Restore(); reasonOf(t, err) != ReasonCorrupt {
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
	if len(f.src.windows) != 0 || len(f.src.spend) != 0 {
		t.Fatalf("restored %v and %v from a bad file", f.src.windows, f.src.spend)
	}
}

func TestPersisterStartsEmptyOnBadFiles(t *testing.T) {
	good, err := Encode(sampleState())
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, reason string
		content      []byte // nil: no file
	}{
		{"missing", ReasonMissing, nil},
		{"truncated", ReasonCorrupt, good[:len(good)/2]},
		{"garbage", ReasonCorrupt, []byte("\x00\xff not json")},
		{"wrong version", ReasonVersion, bytes.Replace(good, []byte(`"version":1`), []byte(`"version":7`), 1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, time.Minute)
			if tc.content != nil {
				if err := os.WriteFile(f.path, tc.content, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if err := f.p.Restore(); reasonOf(t, err) != tc.reason {
				t.Fatalf("Restore: %v, want reason %s", err, tc.reason)
			}
			if len(f.src.windows) != 0 || len(f.src.spend) != 0 {
				t.Fatalf("restored %v and %v from a bad file", f.src.windows, f.src.spend)
			}
			if got := f.failures(t, tc.reason); got != 1 {
				t.Fatalf("restore failures{reason=%q} = %v", tc.reason, got)
			}
			logs := f.logs.String()
			if !strings.Contains(logs, `"level":"ERROR","msg":"state not restored: every budget starts empty"`) ||
				!strings.Contains(logs, f.path) || !strings.Contains(logs, `"reason":"`+tc.reason+`"`) {
				t.Fatalf("no error line naming the file and the reason: %s", logs)
			}
			checkKeptAside(t, f.path, tc.content)
			// The next write starts the file afresh.
			f.src.setSpend(sampleState().Spend[0])
			if err := f.p.Save(); err != nil {
				t.Fatal(err)
			}
			if st, err := Read(f.path); err != nil || len(st.Spend) != 1 {
				t.Fatalf("state after a fresh write: %+v, %v", st, err)
			}
		})
	}
}

// checkKeptAside checks that the file at path that held content (nil: none) was moved aside.
func checkKeptAside(t *testing.T, path string, content []byte) {
	t.Helper()
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the bad file is still at %s (%v): the next write would replace it", path, err)
	}
	aside, _ := filepath.Glob(path + ".bad-*")
	if content == nil {
		if len(aside) != 0 {
			t.Fatalf("kept aside %v for a missing file", aside)
		}
		return
	}
	if len(aside) != 1 {
		t.Fatalf("bad file not kept aside: %v", aside)
	}
	if kept, _ := os.ReadFile(aside[0]); !bytes.Equal(kept, content) {
		t.Fatal("the file kept aside differs from the bad file")
	}
}

// TestPersisterOtherCurrencyKeepsTheWindows: spend counted in another currency is not restored
// (its amounts would mean something else), but the token budgets and request rates of the same
// file are: a currency change does not hand every tenant a fresh tokens_per_day.
func TestPersisterOtherCurrencyKeepsTheWindows(t *testing.T) {
	st := sampleState()
	st.Currency = "EUR"
	eur, err := Encode(st)
	if err != nil {
		t.Fatal(err)
	}
	f := newFixture(t, time.Minute)
	if err := os.WriteFile(f.path, eur, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := f.p.Restore(); reasonOf(t, err) != ReasonCurrency {
		t.Fatalf("Restore: %v, want reason currency", err)
	}
	if len(f.src.spend) != 0 {
		t.Fatalf("restored spend counted in EUR into a USD policy: %v", f.src.spend)
	}
	if len(f.src.windows) != len(st.Windows) {
		t.Fatalf("restored %d token and request windows, want %d", len(f.src.windows), len(st.Windows))
	}
	if got := f.failures(t, ReasonCurrency); got != 1 {
		t.Fatalf("restore failures{reason=currency} = %v", got)
	}
	if got := value(t, f.p.met.restored.WithLabelValues(KindTokensPerMinute)); got != 2 {
		t.Fatalf("restored windows gauge{kind=tokens_per_minute} %v, want 2", got)
	}
	if logs := f.logs.String(); !strings.Contains(logs, "every spend budget starts empty; token budgets and request rates were restored") {
		t.Fatalf("the log does not say what was restored: %s", logs)
	}
	checkKeptAside(t, f.path, eur)
}

func TestPersisterSavesOnlyCurrentWindowsAndSkipsUnchanged(t *testing.T) {
	f := newFixture(t, time.Minute)
	old := spend.SavedWindow{Budget: "tenant/old", Period: "day", Start: day0.Add(-24 * time.Hour), End: day0, Settled: 5}
	f.src.setSpend(old)
	f.src.setSpend(sampleState().Spend[0])
	if err := f.p.Save(); err != nil {
		t.Fatal(err)
	}
	st, err := Read(f.path)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Spend) != 1 || st.Spend[0].Budget != "tenant/acme" {
		t.Fatalf("saved %+v, want only the current window", st.Spend)
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
	f.p.o.Path = filepath.Join(t.TempDir(), "gone", "state.json")
	f.fill()
	for range 3 {
		if err := f.p.Save(); err == nil {
			t.Fatal("Save into a missing directory succeeded")
		}
	}
	if got := value(t, f.p.met.writes.WithLabelValues("error")); got != 3 {
		t.Fatalf("write errors %v, want 3", got)
	}
	if n := strings.Count(f.logs.String(), "cannot write the state file"); n != 1 {
		t.Fatalf("logged the failure %d times, want once per streak", n)
	}
	if err := os.MkdirAll(filepath.Dir(f.p.o.Path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := f.p.Save(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(f.logs.String(), "state file written again") {
		t.Fatal("recovery not logged")
	}
}

func TestPersisterWritesEveryIntervalAndAtClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, 10*time.Second)
		f.p.Start()
		w := sampleState().Windows[0]
		w.Slots[0].Amount = 100
		f.src.set(w)
		time.Sleep(9 * time.Second)
		synctest.Wait()
		if _, err := os.Stat(f.path); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("file written before the first interval: %v", err)
		}
		time.Sleep(time.Second)
		synctest.Wait()
		st, err := Read(f.path)
		if err != nil || st.Windows[0].Slots[0].Amount != 100 {
			t.Fatalf("after one interval: %+v, %v", st, err)
		}
		// Charged after the last write and before Close: written by Close.
		w.Slots[0].Amount = 250
		f.src.set(w)
		if err := f.p.Close(); err != nil {
			t.Fatal(err)
		}
		if st, err := Read(f.path); err != nil || st.Windows[0].Slots[0].Amount != 250 {
			t.Fatalf("after Close: %+v, %v", st, err)
		}
		if err := f.p.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
	})
}

func TestPersisterCloseWithoutStart(t *testing.T) {
	f := newFixture(t, time.Minute)
	f.fill()
	if err := f.p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(f.path); err != nil {
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
