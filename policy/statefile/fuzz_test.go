package statefile

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"reflect"
	"testing"
	"time"
)

// parseEnvelope reads a state file's outer object without checking it.
func parseEnvelope(data []byte) (envelope, error) {
	var env envelope
	err := json.Unmarshal(data, &env)
	return env, err
}

// reseal replaces env's state with st and gives it a valid checksum.
func reseal(t *testing.T, env envelope, st any) []byte {
	t.Helper()
	body, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(body)
	env.State, env.SHA256 = body, hex.EncodeToString(sum[:])
	out, err := json.Marshal(env)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// FuzzParse: no input panics the parser; every error is a *StateError; whatever it accepts is
// a state Encode writes back to an equal state.
func FuzzParse(f *testing.F) {
	good, err := Encode(sampleState())
	if err != nil {
		f.Fatal(err)
	}
	empty, _ := Encode(State{Currency: "USD"})
	legacy, err := os.ReadFile("testdata/spend-state-v1.json")
	if err != nil {
		f.Fatal(err)
	}
	withUsage := sampleState()
	withUsage.Usage = sampleUsage(f)
	used, err := Encode(withUsage)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add(used)
	f.Add(empty)
	f.Add(legacy)
	f.Add(good[:len(good)/2])
	f.Add([]byte(`{"format":"llm-bulkhead-state","version":1,"sha256":"","state":{}}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) { checkParse(t, data) })
}

// FuzzParseSealed: the state inside a file whose checksum is right, which FuzzParse's inputs
// rarely reach, is checked as strictly: anything Parse accepts is a state Encode writes back.
func FuzzParseSealed(f *testing.F) {
	good, err := Encode(sampleState())
	if err != nil {
		f.Fatal(err)
	}
	env, err := parseEnvelope(good)
	if err != nil {
		f.Fatal(err)
	}
	f.Add([]byte(env.State), false)
	withUsage := sampleState()
	withUsage.Usage = sampleUsage(f)
	used, err := Encode(withUsage)
	if err != nil {
		f.Fatal(err)
	}
	if env, err := parseEnvelope(used); err == nil {
		f.Add([]byte(env.State), false)
	}
	f.Add([]byte(`{"currency":"USD","windows":[{"compartment":"tenant/","family":"tenant","key":["tenant"],"values":[""],`+
		`"kind":"tokens_per_day","slot_ns":1440000000000,"slots":[[0,1]]}]}`), false)
	f.Add([]byte(`{"currency":"USD","windows":[{"budget":"a","period":"day","start":"2026-03-14T00:00:00Z",`+
		`"end":"2026-03-15T00:00:00Z","settled_micros":1,"in_flight_micros":0}]}`), true)
	f.Add([]byte(`{"currency":"USD","spend":null,"windows":[{"slots":[[1,2,3]]}]}`), false)
	f.Add([]byte(`{"currency":"USD","usage":{"reasons":["a"],"hours_up_to":"2026-03-14T10:00:00+05:30","days_up_to":"2026-03-14T00:00:00Z",`+
		`"tables":[{"by":"tenant","level":"1h","start":"2026-03-14T09:00:00+01:00","end":"2026-03-14T10:00:00+01:00","slack":0,"total":[1,2,3,1,4,1],"rows":[["a","",0,1,2,3,1,4,1]]}]}}`), false)
	f.Fuzz(func(t *testing.T, state []byte, legacy bool) {
		env := env
		env.Version = Version
		if legacy {
			env.Format, env.Version = spendFormat, 1
		}
		var raw json.RawMessage
		if json.Unmarshal(state, &raw) != nil {
			return // not a JSON value: the envelope could not hold it
		}
		checkParse(t, reseal(t, env, raw))
	})
}

// checkParse fails t if Parse panics on data, returns an error that is not a *StateError, or
// accepts a state that does not survive a round trip through Encode.
func checkParse(t *testing.T, data []byte) {
	t.Helper()
	st, err := Parse(data)
	if err != nil {
		reasonOf(t, err)
		return
	}
	out, err := Encode(st)
	if err != nil {
		t.Fatalf("accepted a state Encode refuses: %v", err)
	}
	again, err := Parse(out)
	if err != nil {
		t.Fatalf("re-encoded state does not parse: %v", err)
	}
	normalise(&st)
	normalise(&again)
	if !reflect.DeepEqual(st, again) {
		t.Fatalf("round trip changed the state:\n%+v\n%+v", st, again)
	}
}

// normalise makes empty lists nil and times their instant, which is all a state says of them.
func normalise(st *State) {
	if len(st.Spend) == 0 {
		st.Spend = nil
	}
	if len(st.Windows) == 0 {
		st.Windows = nil
	}
	for i := range st.Spend {
		w := &st.Spend[i]
		w.Start, w.End = time.Unix(0, w.Start.UnixNano()), time.Unix(0, w.End.UnixNano())
	}
	for i := range st.Windows {
		if len(st.Windows[i].Values) == 0 {
			st.Windows[i].Values = nil
		}
	}
	if u := st.Usage; u != nil {
		instant := func(t *time.Time) { *t = time.Unix(0, t.UnixNano()) }
		instant(&u.HoursUpTo)
		instant(&u.DaysUpTo)
		for i := range u.Tables {
			instant(&u.Tables[i].Start)
			instant(&u.Tables[i].End)
		}
	}
}
