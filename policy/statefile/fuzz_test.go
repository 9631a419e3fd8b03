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
	f.Add(good)
	f.Add(empty)
	f.Add(legacy)
	f.Add(good[:len(good)/2])
	f.Add([]byte(`{"format":"llm-bulkhead-state","version":1,"sha256":"","state":{}}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) {
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
	})
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
}
