package spend

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
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
func reseal(t *testing.T, env envelope, st SavedState) []byte {
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

// FuzzParseState: no input panics the parser; every error is a *StateError; whatever it
// accepts is a state EncodeState writes back to an equal state.
func FuzzParseState(f *testing.F) {
	good, err := EncodeState(sampleState())
	if err != nil {
		f.Fatal(err)
	}
	empty, _ := EncodeState(SavedState{Currency: "USD"})
	f.Add(good)
	f.Add(empty)
	f.Add(good[:len(good)/2])
	f.Add([]byte(`{"format":"llm-bulkhead-spend-state","version":1,"sha256":"","state":{}}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := ParseState(data)
		if err != nil {
			var se *StateError
			if !errors.As(err, &se) {
				t.Fatalf("error %v is not a *StateError", err)
			}
			return
		}
		out, err := EncodeState(st)
		if err != nil {
			t.Fatalf("accepted a state EncodeState refuses: %v", err)
		}
		again, err := ParseState(out)
		if err != nil {
			t.Fatalf("re-encoded state does not parse: %v", err)
		}
		if len(st.Windows) == 0 {
			st.Windows = nil
		}
		if len(again.Windows) == 0 {
			again.Windows = nil
		}
		for i := range st.Windows {
			// Times compare as instants; their zone is not part of the state.
			if !st.Windows[i].Start.Equal(again.Windows[i].Start) || !st.Windows[i].End.Equal(again.Windows[i].End) {
				t.Fatalf("window %d changed in a round trip", i)
			}
			st.Windows[i].Start, st.Windows[i].End = time.Time{}, time.Time{}
			again.Windows[i].Start, again.Windows[i].End = time.Time{}, time.Time{}
		}
		if !reflect.DeepEqual(st, again) {
			t.Fatalf("round trip changed the state:\n%+v\n%+v", st, again)
		}
	})
}
