package statefile

import (
	"bytes"
	"errors"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
	"github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

var day0 = time.Date(2026, 3, 14, 0, 0, 0, 0, time.UTC)

// sampleSpend is the spend of sampleState.
func sampleSpend() []spend.SavedWindow {
	return []spend.SavedWindow{
		{Budget: "tenant/acme", Period: "day", Start: day0, End: day0.Add(24 * time.Hour), Settled: 730_000, InFlight: 12_500},
		{Budget: "feature/chat", Period: "month", Start: time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC),
			End: time.Date(2026, 4, 1, 0, 0, 0, 0, time.UTC), Settled: 412_345_678},
	}
}

// minute is the slot index of day0 + 10h in a minute window's one-second slots.
var minute = day0.Add(10*time.Hour).Unix() - 5

func sampleState() State {
	return State{Currency: "USD", Spend: sampleSpend(), Windows: []Window{
		{Compartment: "tenant/acme", Family: "tenant", Key: []string{"tenant"}, Values: []string{"acme"}, Kind: KindTokensPerDay,
			Slot: 24 * time.Minute, Slots: Slots{{Index: 1227187, Amount: 5000}, {Index: 1227190, Amount: 71}}},
		{Compartment: "tenant/acme", Family: "tenant", Key: []string{"tenant"}, Values: []string{"acme"}, Kind: KindRequestsPerMinute,
			Slot: time.Second, Slots: Slots{{Index: minute, Amount: 2}}},
		{Compartment: "tenant/_overflow", Family: "tenant", Key: []string{"tenant"}, Overflow: true, Kind: KindTokensPerMinute,
			Slot: time.Second, Slots: Slots{{Index: minute, Amount: 900}}},
		{Compartment: "feature/chat", Family: "feature", Key: []string{"feature"}, Values: []string{"chat"}, Kind: KindTokensPerMinute,
			Slot: time.Second, Slots: Slots{{Index: minute - 59, Amount: 1}, {Index: minute, Amount: 1200}}},
	}}
}

// sampleUsage is a usage tracker's tables after a few requests and a refusal.
func sampleUsage(t testing.TB) *usage.Saved {
	t.Helper()
	now := day0.Add(10 * time.Hour)
	tr := usage.New([]string{"token_budget", "rate_limit"})
	tr.Configure(usage.Settings{Enabled: true, TableSize: 10}, now.Add(-2*time.Hour))
	tr.Record(now.Add(-90*time.Minute), &usage.Event{Tenant: "acme", Model: "gpt-4o", Refusal: -1, Prompt: 1200, Completion: 300, Cached: 1000, Spend: 4500})
	tr.Record(now, &usage.Event{Tenant: "acme", Model: "gpt-4o", Refusal: -1, Prompt: 10, Completion: 3})
	tr.Record(now, &usage.Event{Tenant: "initech", Model: "claude \"sonnet\"", Refusal: 1})
	return tr.Save(now)
}

// TestStateWithUsage: a state with usage tables is written as version 2 and read back as
// written; one without is written as version 1, which builds from before usage read, and read
// as well. Usage tables in a file that says version 1 are refused.
func TestStateWithUsage(t *testing.T) {
	st := sampleState()
	st.Usage = sampleUsage(t)
	data, err := Encode(st)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(data, []byte(`"version":2`)) || !bytes.Contains(data, []byte(`["initech","claude \"sonnet\"",0,0,0,0,0,0,0,1]`)) {
		t.Fatalf("written as %s", data)
	}
	got, err := Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := Encode(got); err != nil || !bytes.Equal(again, data) {
		t.Fatalf("read back and written again: %v\n%s\nwas\n%s", err, again, data)
	}
	plain, err := Encode(sampleState())
	if err != nil || !bytes.Contains(plain, []byte(`"version":1`)) {
		t.Fatalf("without usage: %v %s", err, plain)
	}
	env, err := parseEnvelope(data)
	if err != nil {
		t.Fatal(err)
	}
	env.Version = 1
	if _, err := Parse(reseal(t, env, got)); reasonOf(t, err) != ReasonCorrupt || !strings.Contains(err.Error(), "usage tables in a file of version 1") {
		t.Fatalf("usage in version 1: %v", err)
	}
	env.Version = 2
	bad := got
	bad.Usage = &usage.Saved{Reasons: []string{""}}
	if _, err := Parse(reseal(t, env, bad)); reasonOf(t, err) != ReasonCorrupt || !strings.Contains(err.Error(), "usage: refusal reason 0") {
		t.Fatalf("damaged usage: %v", err)
	}
}

func TestStateRoundTrip(t *testing.T) {
	st := sampleState()
	data, err := Encode(st)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, st) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, st)
	}
	// A window's slots are [index, amount] pairs, a slot's length in nanoseconds.
	if !bytes.Contains(data, []byte(`"slot_ns":1440000000000,"slots":[[1227187,5000],[1227190,71]]`)) {
		t.Fatalf("tokens_per_day window not written as documented: %s", data)
	}
	// An empty state is a valid file too.
	data, err = Encode(State{Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := Parse(data); err != nil || got.Currency != "EUR" || len(got.Windows) != 0 || len(got.Spend) != 0 {
		t.Fatalf("empty state: %+v, %v", got, err)
	}
}

// TestSpendOnlyFileOfEarlierBuildsIsRead: a file the spend-only format of earlier builds wrote
// (testdata/spend-state-v1.json, written by such a build) gives its spend, so that an upgrade
// keeps it.
func TestSpendOnlyFileOfEarlierBuildsIsRead(t *testing.T) {
	st, err := Read("testdata/spend-state-v1.json")
	if err != nil {
		t.Fatal(err)
	}
	if want := (State{Currency: "USD", Spend: sampleSpend(), Windows: nil}); !reflect.DeepEqual(st, want) {
		t.Fatalf("read %+v, want %+v", st, want)
	}
	data, err := os.ReadFile("testdata/spend-state-v1.json")
	if err != nil {
		t.Fatal(err)
	}
	// Another version of that format is a version this build does not read.
	if _, err := Parse(bytes.Replace(data, []byte(`"version":1`), []byte(`"version":2`), 1)); reasonOf(t, err) != ReasonVersion {
		t.Fatalf("spend-only format version 2: %v, want reason version", err)
	}
}

// reasonOf returns err's reason ("" for nil), failing t unless err is a *StateError.
func reasonOf(t *testing.T, err error) string {
	t.Helper()
	if err == nil {
		return ""
	}
	var se *StateError
	if !errors.As(err, &se) {
		t.Fatalf("error %v is not a *StateError", err)
	}
	return se.Reason
}

func TestStateRejectsDamage(t *testing.T) {
	good, err := Encode(sampleState())
	if err != nil {
		t.Fatal(err)
	}
	reason := func(data []byte) string {
		_, err := Parse(data)
		return reasonOf(t, err)
	}
	// Every truncation is refused (a crash mid-write cannot happen with the atomic writer, but a
	// full disk or a copy cut short can).
	for n := 0; n < len(good)-1; n++ {
		if r := reason(good[:n]); r != ReasonCorrupt {
			t.Fatalf("file cut to %d of %d bytes: reason %q, want corrupt", n, len(good), r)
		}
	}
	// Changing any digit of an amount breaks the checksum, a spend's or a window's.
	for _, digits := range []string{"730000", "5000]"} {
		i := bytes.Index(good, []byte(digits))
		bad := bytes.Clone(good)
		bad[i] = '9'
		if r := reason(bad); r != ReasonCorrupt {
			t.Fatalf("changed amount %s: reason %q", digits, r)
		}
	}
	for _, v := range []string{`"version":3`, `"version":0`} {
		if r := reason(bytes.Replace(good, []byte(`"version":1`), []byte(v), 1)); r != ReasonVersion {
			t.Fatalf("%s: reason %q", v, r)
		}
	}
	for name, data := range map[string]string{
		"other JSON":    `{"tenants": {"acme": 1}}`,
		"empty":         ``,
		"trailing data": string(good) + `{}`,
		"not hex":       strings.Replace(string(good), `"sha256":"`, `"sha256":"zz`, 1),
		"other format":  strings.Replace(string(good), `"format":"llm-bulkhead-state"`, `"format":"llm-bulkhead-other"`, 1),
	} {
		if r := reason([]byte(data)); r != ReasonCorrupt {
			t.Errorf("%s: reason %q, want corrupt", name, r)
		}
	}
	// Content that checksums right but makes no sense is refused as well.
	for name, w := range map[string]spend.SavedWindow{
		"negative":   {Budget: "a", Period: "day", Start: day0, End: day0.Add(time.Hour), Settled: -1},
		"backwards":  {Budget: "a", Period: "day", Start: day0, End: day0.Add(-time.Hour)},
		"no budget":  {Period: "day", Start: day0, End: day0.Add(time.Hour)},
		"bad period": {Budget: "a", Period: "week", Start: day0, End: day0.Add(time.Hour)},
	} {
		if r := reason(forge(t, State{Currency: "USD", Spend: []spend.SavedWindow{w}})); r != ReasonCorrupt {
			t.Errorf("spend %s: reason %q, want corrupt", name, r)
		}
	}
	ok := sampleState().Windows[0]
	for name, change := range map[string]func(w *Window){
		"no compartment":       func(w *Window) { w.Compartment = "" },
		"no family":            func(w *Window) { w.Family = "" },
		"no key":               func(w *Window) { w.Key, w.Values = nil, nil },
		"unknown dimension":    func(w *Window) { w.Key = []string{"colour"} },
		"repeated dimension":   func(w *Window) { w.Key, w.Values = []string{"tenant", "tenant"}, []string{"a", "b"} },
		"values short of key":  func(w *Window) { w.Key = []string{"tenant", "feature"} },
		"empty feature":        func(w *Window) { w.Key, w.Values = []string{"feature"}, []string{""} },
		"overflow with values": func(w *Window) { w.Overflow = true },
		"overflow without tenant": func(w *Window) {
			w.Key, w.Values, w.Overflow = []string{"feature"}, nil, true
		},
		"unknown kind":               func(w *Window) { w.Kind = "tokens_per_week" },
		"no slot length":             func(w *Window) { w.Slot = 0 },
		"slot longer than a day":     func(w *Window) { w.Slot = 25 * time.Hour },
		"no slots":                   func(w *Window) { w.Slots = nil },
		"zero amount":                func(w *Window) { w.Slots = Slots{{Index: 5, Amount: 0}} },
		"negative amount":            func(w *Window) { w.Slots = Slots{{Index: 5, Amount: -3}} },
		"huge amount":                func(w *Window) { w.Slots = Slots{{Index: 5, Amount: 1 << 62}} },
		"negative index":             func(w *Window) { w.Slots = Slots{{Index: -1, Amount: 3}} },
		"index past the end of time": func(w *Window) { w.Slots = Slots{{Index: 1 << 62, Amount: 3}} },
		"slots out of order":         func(w *Window) { w.Slots = Slots{{Index: 7, Amount: 3}, {Index: 6, Amount: 3}} },
		"a slot twice":               func(w *Window) { w.Slots = Slots{{Index: 7, Amount: 3}, {Index: 7, Amount: 3}} },
		"slots wider than a window": func(w *Window) {
			w.Slots = Slots{{Index: 7, Amount: 3}, {Index: 7 + budget.Slots, Amount: 3}}
		},
		"more slots than a window has": func(w *Window) {
			w.Slots = nil
			for i := range budget.Slots + 1 {
				w.Slots = append(w.Slots, budget.SlotCharge{Index: int64(i), Amount: 1})
			}
		},
	} {
		w := ok
		w.Key, w.Values, w.Slots = slices.Clone(ok.Key), slices.Clone(ok.Values), slices.Clone(ok.Slots)
		change(&w)
		st := State{Currency: "USD", Windows: []Window{w}}
		if r := reason(forge(t, st)); r != ReasonCorrupt {
			t.Errorf("window with %s: reason %q, want corrupt", name, r)
		}
		if _, err := Encode(st); err == nil {
			t.Errorf("Encode wrote a window with %s", name)
		}
	}
	for name, dup := range map[string]func(st *State){
		"spend window": func(st *State) { st.Spend = append(st.Spend, st.Spend[0]) },
		"window":       func(st *State) { st.Windows = append(st.Windows, st.Windows[1]) },
	} {
		st := sampleState()
		dup(&st)
		if r := reason(forge(t, st)); r != ReasonCorrupt {
			t.Errorf("duplicate %s: reason %q, want corrupt", name, r)
		}
	}
	// The same kind of window of two compartments, and two kinds of one, are not duplicates.
	if r := reason(good); r != "" {
		t.Fatalf("sample state refused: %s", r)
	}
	if _, err := Encode(State{Currency: "USD", Spend: []spend.SavedWindow{{Budget: "a", Period: "day", Start: day0, End: day0}}}); err == nil {
		t.Error("Encode wrote an empty spend window")
	}
}

// TestEncodeRefusesWhatCouldNotBeRead: a state larger than a state file may be is not written
// (a start would refuse the file), and says so.
func TestEncodeRefusesWhatCouldNotBeRead(t *testing.T) {
	data, err := Encode(sampleState())
	if err != nil {
		t.Fatal(err)
	}
	defer func(m int) { maxSize = m }(maxSize)
	maxSize = len(data) - 1
	if _, err := Encode(sampleState()); err == nil || !strings.Contains(err.Error(), "more than a state file may hold") {
		t.Fatalf("Encode of a state over %d bytes: %v", maxSize, err)
	}
	if _, err := Parse(data); reasonOf(t, err) != ReasonCorrupt {
		t.Fatalf("Parse of a file over %d bytes: %v, want corrupt", maxSize, err)
	}
}

// forge encodes st with a valid checksum, bypassing Encode's checks.
func forge(t *testing.T, st State) []byte {
	t.Helper()
	good, err := Encode(State{Currency: "USD"})
	if err != nil {
		t.Fatal(err)
	}
	env, err := parseEnvelope(good)
	if err != nil {
		t.Fatal(err)
	}
	return reseal(t, env, st)
}
