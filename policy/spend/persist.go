package spend

// The state file keeps spend across restarts of a single process (with a Redis cluster backend
// the shared store keeps it instead). Its format, version 1:
//
//	{"format":"llm-bulkhead-spend-state","version":1,"sha256":"<hex>","state":{…}}
//
// where sha256 is the SHA-256 of the exact bytes of the "state" value, and state is
//
//	{"currency":"USD","windows":[{"budget":…,"period":"day","start":…,"end":…,
//	  "settled_micros":…,"in_flight_micros":…},…]}
//
// A file that fails any check (truncated, corrupt, another version or currency) is renamed
// aside, never overwritten, and spend starts empty.

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
)

// StateVersion is the version of the state file format this build writes and reads.
const StateVersion = 1

// stateFormat names the format, so that another JSON file given as the state file by mistake is
// recognised as such (and kept aside) rather than misread.
const stateFormat = "llm-bulkhead-spend-state"

// maxStateSize bounds what is read from a state file; a larger one is refused as corrupt.
const maxStateSize = 64 << 20

// maxBudgetName bounds a budget's name in the file.
const maxBudgetName = 4096

// maxMicros bounds an amount in the file: a billion units of currency, far beyond any budget.
const maxMicros = 1_000_000_000 * 1_000_000

// SavedWindow is one budget's current window as the state file keeps it.
type SavedWindow struct {
	// Budget names the budget (its compartment and period) as the ledger does.
	Budget string `json:"budget"`
	// Period is the window's calendar length: "hour", "day" or "month".
	Period string `json:"period"`
	// Start and End bound the window: [Start, End).
	Start time.Time `json:"start"`
	End   time.Time `json:"end"`
	// Settled is the spend settled in the window, in micro-units of the currency.
	Settled int64 `json:"settled_micros"`
	// InFlight is the spend reserved in the window by requests still running when the file was
	// written. It is restored as spent: after a crash their settlements never come, and their
	// reservation is the most they can have cost.
	InFlight int64 `json:"in_flight_micros"`
}

// SavedState is the content of a state file.
type SavedState struct {
	// Currency is the policy's currency when the file was written; amounts in another currency
	// are not restored.
	Currency string        `json:"currency"`
	Windows  []SavedWindow `json:"windows"`
}

// envelope is the file's outer object.
type envelope struct {
	Format  string          `json:"format"`
	Version int             `json:"version"`
	SHA256  string          `json:"sha256"`
	State   json.RawMessage `json:"state"`
}

// Reasons a state file was not restored (the reason label of
// llm_bulkhead_spend_state_restore_failures_total).
const (
	ReasonMissing    = "missing"
	ReasonUnreadable = "unreadable"
	ReasonCorrupt    = "corrupt"
	ReasonVersion    = "version"
	ReasonCurrency   = "currency"
)

// StateError says why a state file could not be used.
type StateError struct {
	// Reason is one of the Reason constants.
	Reason string
	Err    error
}

func (e *StateError) Error() string { return e.Reason + ": " + e.Err.Error() }
func (e *StateError) Unwrap() error { return e.Err }

func corrupt(format string, args ...any) error {
	return &StateError{Reason: ReasonCorrupt, Err: fmt.Errorf(format, args...)}
}

// EncodeState returns the state file's bytes for st. Windows are written in the order given.
func EncodeState(st SavedState) ([]byte, error) {
	if st.Windows == nil {
		st.Windows = []SavedWindow{}
	}
	for i := range st.Windows {
		if err := checkWindow(&st.Windows[i]); err != nil {
			return nil, fmt.Errorf("window %d: %w", i, err)
		}
	}
	body, err := json.Marshal(st)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(body)
	out, err := json.Marshal(envelope{Format: stateFormat, Version: StateVersion, SHA256: hex.EncodeToString(sum[:]), State: body})
	if err != nil {
		return nil, err
	}
	return append(out, '\n'), nil
}

// ParseState reads a state file's bytes. Every error is a *StateError.
func ParseState(data []byte) (SavedState, error) {
	var st SavedState
	if len(data) > maxStateSize {
		return st, corrupt("larger than %d bytes", maxStateSize)
	}
	var env envelope
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&env); err != nil {
		return st, corrupt("not a spend state file: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return st, corrupt("trailing data after the state")
	}
	if env.Format != stateFormat {
		return st, corrupt("format is %q, want %q", env.Format, stateFormat)
	}
	if env.Version != StateVersion {
		return st, &StateError{Reason: ReasonVersion, Err: fmt.Errorf("version %d, this build reads version %d", env.Version, StateVersion)}
	}
	want, err := hex.DecodeString(env.SHA256)
	if err != nil || len(want) != sha256.Size {
		return st, corrupt("checksum %q is not a SHA-256 in hex", env.SHA256)
	}
	if sum := sha256.Sum256(env.State); !bytes.Equal(sum[:], want) {
		return st, corrupt("checksum mismatch: the state was changed or cut short")
	}
	sdec := json.NewDecoder(bytes.NewReader(env.State))
	sdec.DisallowUnknownFields()
	if err := sdec.Decode(&st); err != nil {
		return SavedState{}, corrupt("state: %v", err)
	}
	if st.Currency == "" {
		return SavedState{}, corrupt("no currency")
	}
	seen := make(map[windowID]bool, len(st.Windows))
	for i := range st.Windows {
		w := &st.Windows[i]
		if err := checkWindow(w); err != nil {
			return SavedState{}, corrupt("window %d: %v", i, err)
		}
		id := windowID{w.Budget, w.Period, w.Start.UnixNano()}
		if seen[id] {
			return SavedState{}, corrupt("window %d: budget %q, %s from %s, appears twice", i, w.Budget, w.Period, w.Start.Format(time.RFC3339))
		}
		seen[id] = true
	}
	return st, nil
}

type windowID struct {
	budget, period string
	start          int64
}

func checkWindow(w *SavedWindow) error {
	switch {
	case w.Budget == "" || len(w.Budget) > maxBudgetName:
		return fmt.Errorf("budget name of %d bytes", len(w.Budget))
	case w.Period != "hour" && w.Period != "day" && w.Period != "month":
		return fmt.Errorf("period %q is not hour, day or month", w.Period)
	case !w.Start.Before(w.End):
		return fmt.Errorf("window ends (%s) before it starts (%s)", w.End.Format(time.RFC3339), w.Start.Format(time.RFC3339))
	case w.End.Sub(w.Start) > 31*24*time.Hour+time.Hour:
		return fmt.Errorf("window of %s is longer than a month", w.End.Sub(w.Start))
	case w.Settled < 0 || w.Settled > maxMicros || w.InFlight < 0 || w.InFlight > maxMicros:
		return fmt.Errorf("amount out of range (settled %d, in flight %d micro-units)", w.Settled, w.InFlight)
	}
	return nil
}

// ReadState reads and parses the state file at path. Every error is a *StateError; a file
// that does not exist is ReasonMissing.
func ReadState(path string) (SavedState, error) {
	// A FIFO or a device is refused at once: opening a FIFO would wait for a writer forever.
	data, err := files.Read(path, maxStateSize)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return SavedState{}, &StateError{Reason: ReasonMissing, Err: err}
	case errors.Is(err, files.ErrTooLarge):
		return SavedState{}, corrupt("larger than %d bytes", maxStateSize)
	case err != nil:
		return SavedState{}, &StateError{Reason: ReasonUnreadable, Err: err}
	}
	return ParseState(data)
}

// WriteState writes st to path atomically: to a temporary file in the same directory, synced,
// renamed over path, and the directory synced. A crash at any point leaves either the previous
// file or the new one, whole.
func WriteState(path string, st SavedState) error {
	data, err := EncodeState(st)
	if err != nil {
		return err
	}
	return writeAtomic(path, data)
}

func writeAtomic(path string, data []byte) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			_ = os.Remove(tmp)
		}
	}()
	if _, err = f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err = f.Chmod(0o600); err != nil {
		f.Close()
		return err
	}
	if err = f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp, path); err != nil {
		return err
	}
	return syncDir(dir)
}

// syncDir makes a rename in dir durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// keepAside renames a state file that could not be used to <path>.bad-<UTC time>, so that a
// later write does not replace it and an operator can look at it. It returns the new name.
func keepAside(path string, now time.Time) (string, error) {
	aside := path + ".bad-" + now.UTC().Format("20060102T150405.000000000Z")
	if err := os.Rename(path, aside); err != nil {
		return "", err
	}
	return aside, syncDir(filepath.Dir(path))
}
