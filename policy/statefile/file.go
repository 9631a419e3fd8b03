// Package statefile keeps what a single process's budgets have counted across its restarts:
// the windows of token budgets and request rates, the spend of spend budgets, and the usage
// tables by tenant and model, in one file. With a Redis cluster backend the shared store keeps
// the budgets instead.
//
// The file's format, version 2:
//
//	{"format":"llm-bulkhead-state","version":2,"sha256":"<hex>","state":{…}}
//
// where sha256 is the SHA-256 of the exact bytes of the "state" value, and state is
//
//	{"currency":"USD",
//	 "spend":[{"budget":…,"period":"day","start":…,"end":…,"settled_micros":…,"in_flight_micros":…},…],
//	 "windows":[{"compartment":"tenant/acme","family":"tenant","key":["tenant"],"values":["acme"],
//	   "kind":"tokens_per_day","slot_ns":1440000000000,"slots":[[1227187,5000],…]},…],
//	 "usage":{…}}
//
// A window's slots are [index, amount] pairs: slot index spans [index×slot_ns, (index+1)×slot_ns)
// nanoseconds since the Unix epoch, so that a restart resumes each window exactly, and what aged
// out while the process was down is gone. usage is the usage tables (usage.Saved); a state
// without them (usage.enabled: false) is written as version 1, which is version 2 without
// usage, so that a build from before usage can still read it. Both versions are read.
//
// A file of the spend-only format that came before (format "llm-bulkhead-spend-state", version
// 1: a state of currency and spend windows only) is read as well, so that an upgrade keeps the
// spend it holds. A file that fails any check (truncated, corrupt, another version) is renamed
// aside, never overwritten, and every budget starts empty.
//
// Imports: the standard library, budget, spend and usage (the windows and tables it keeps),
// files, and Prometheus for the Persister's metrics. Imported by: package policy (the engine is
// a Source) and the app (which runs the Persister).
package statefile

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
	"github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

// Version is the version of the format this build writes when the state has usage tables;
// without, it writes version 1, which earlier builds read.
const Version = 2

// format names the format, so that another JSON file given as the state file by mistake is
// recognised as such (and kept aside) rather than misread.
const format = "llm-bulkhead-state"

// spendFormat is the spend-only format of earlier builds, which this build reads (version 1).
const spendFormat = "llm-bulkhead-spend-state"

// maxSize bounds what is read from a state file; a larger one is refused as corrupt, and a
// state that would encode larger is not written. A variable for tests.
var maxSize = 64 << 20

// maxName bounds a compartment's, a family's or a key value's name in the file.
const maxName = 4096

// MaxAmount bounds what one slot of a window counts in the file: sums of a window's slots
// cannot overflow. A source saves a slot that counts more (a window restored under a longer slot
// than it was saved with, a capacity beyond it) as MaxAmount.
const MaxAmount = 1 << 53

// maxSlot bounds a window's slot length: a slot is 1/60 of a window, and no window is longer
// than days.
const maxSlot = 24 * time.Hour

// Kinds of window, as their limit is named in the policy.
const (
	KindTokensPerMinute   = "tokens_per_minute"
	KindTokensPerDay      = "tokens_per_day"
	KindRequestsPerMinute = "requests_per_minute"
	// KindSpend counts spend budgets' windows (in Restored).
	KindSpend = "spend"
	// KindUsage counts usage tables (in Restored).
	KindUsage = "usage"
)

// Kinds lists every kind of window, spend and usage tables last.
var Kinds = []string{KindTokensPerMinute, KindTokensPerDay, KindRequestsPerMinute, KindSpend, KindUsage}

// keyDims are the dimensions a compartment family can be keyed by.
var keyDims = []string{"feature", "tenant", "tier", "provider", "model"}

// State is the content of a state file.
type State struct {
	// Currency is the policy's currency when the file was written; spend in another currency is
	// not restored.
	Currency string `json:"currency"`
	// Spend holds the current window of every spend budget with spend in it.
	Spend []spend.SavedWindow `json:"spend"`
	// Windows holds every token budget's and request rate's window with a charge that counts.
	Windows []Window `json:"windows"`
	// Usage holds the usage tables by tenant and model (nil: usage is not counted).
	Usage *usage.Saved `json:"usage,omitempty"`
}

// Window is one compartment's token budget or request rate as the file keeps it.
type Window struct {
	// Compartment names the compartment as metrics and the admin API do.
	Compartment string `json:"compartment"`
	// Family, Key and Values identify the compartment: its family's name, the dimensions the
	// family is keyed by (in the policy's order) and the compartment's value of each, in the same
	// order. The overflow compartment of a tenant-keyed family has no values.
	Family string   `json:"family"`
	Key    []string `json:"key"`
	Values []string `json:"values,omitempty"`
	// Overflow marks the compartment new tenants share when a tenant-keyed family is full.
	Overflow bool `json:"overflow,omitempty"`
	// Kind is tokens_per_minute, tokens_per_day or requests_per_minute.
	Kind string `json:"kind"`
	// Slot is the length of the window's slots (1/60 of the window).
	Slot time.Duration `json:"slot_ns"`
	// Slots are the window's slots with a charge, oldest first.
	Slots Slots `json:"slots"`
}

// Slots are a window's charged slots, written as [index, amount] pairs.
type Slots []budget.SlotCharge

// MarshalJSON writes the slots as [index, amount] pairs.
func (s Slots) MarshalJSON() ([]byte, error) {
	// Written by hand: a file holds a window per tenant, and reflection would cost most of a write.
	out := make([]byte, 0, 2+len(s)*24)
	out = append(out, '[')
	for i, c := range s {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, '[')
		out = strconv.AppendInt(out, c.Index, 10)
		out = append(out, ',')
		out = strconv.AppendInt(out, c.Amount, 10)
		out = append(out, ']')
	}
	return append(out, ']'), nil
}

// UnmarshalJSON reads [index, amount] pairs.
func (s *Slots) UnmarshalJSON(data []byte) error {
	var pairs [][2]int64
	if err := json.Unmarshal(data, &pairs); err != nil {
		return err
	}
	*s = make(Slots, len(pairs))
	for i, p := range pairs {
		(*s)[i] = budget.SlotCharge{Index: p[0], Amount: p[1]}
	}
	return nil
}

// CompartmentID says which compartment w belongs to: the same for each of its windows, and
// for no other compartment's. A compartment of the running policy has an ID of this form too
// (see ID), to find its windows by.
func (w *Window) CompartmentID() string {
	if w.Overflow {
		return ID(w.Family, w.Key, nil) + "\x00overflow"
	}
	return ID(w.Family, w.Key, w.Values)
}

// ID identifies the compartment of family keyed by key whose values are values.
func ID(family string, key, values []string) string {
	var b strings.Builder
	for i, part := range [][]string{{family}, key, values} {
		if i > 0 {
			b.WriteByte(0)
		}
		for _, s := range part {
			// Quoted, parts cannot run into each other whatever bytes a tenant's name holds.
			b.WriteString(strconv.Quote(s))
			b.WriteByte(',')
		}
	}
	return b.String()
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
	// ReasonCurrency: the file's spend is counted in another currency than the policy's, and is
	// not restored (its token budgets and request rates are).
	ReasonCurrency = "currency"
)

// Reasons lists every reason.
var Reasons = []string{ReasonMissing, ReasonUnreadable, ReasonCorrupt, ReasonVersion, ReasonCurrency}

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

// Encode returns the state file's bytes for st. Windows are written in the order given.
func Encode(st State) ([]byte, error) {
	if st.Spend == nil {
		st.Spend = []spend.SavedWindow{}
	}
	if st.Windows == nil {
		st.Windows = []Window{}
	}
	if err := check(&st); err != nil {
		return nil, err
	}
	body, err := json.Marshal(st)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(body)
	version := Version
	if st.Usage == nil {
		version = 1
	}
	out, err := json.Marshal(envelope{Format: format, Version: version, SHA256: hex.EncodeToString(sum[:]), State: body})
	if err != nil {
		return nil, err
	}
	if len(out) >= maxSize {
		return nil, fmt.Errorf("the state takes %d bytes, more than a state file may hold (%d): it is not written", len(out), maxSize)
	}
	return append(out, '\n'), nil
}

// Parse reads a state file's bytes, of this format or of the spend-only one before it. Every
// error is a *StateError.
func Parse(data []byte) (State, error) {
	if len(data) > maxSize {
		return State{}, corrupt("larger than %d bytes", maxSize)
	}
	var env envelope
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&env); err != nil {
		return State{}, corrupt("not a state file: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return State{}, corrupt("trailing data after the state")
	}
	if env.Format != format && env.Format != spendFormat {
		return State{}, corrupt("format is %q, want %q", env.Format, format)
	}
	version := Version
	if env.Format == spendFormat {
		version = 1
	}
	if env.Version < 1 || env.Version > version {
		return State{}, &StateError{Reason: ReasonVersion, Err: fmt.Errorf("%s version %d, this build reads versions 1 to %d", env.Format, env.Version, version)}
	}
	want, err := hex.DecodeString(env.SHA256)
	if err != nil || len(want) != sha256.Size {
		return State{}, corrupt("checksum %q is not a SHA-256 in hex", env.SHA256)
	}
	if sum := sha256.Sum256(env.State); !bytes.Equal(sum[:], want) {
		return State{}, corrupt("checksum mismatch: the state was changed or cut short")
	}
	var st State
	sdec := json.NewDecoder(bytes.NewReader(env.State))
	sdec.DisallowUnknownFields()
	if env.Format == spendFormat {
		var old spend.SavedState
		err = sdec.Decode(&old)
		st = State{Currency: old.Currency, Spend: old.Windows}
	} else {
		err = sdec.Decode(&st)
	}
	if err != nil {
		return State{}, corrupt("state: %v", err)
	}
	if st.Usage != nil && env.Version < 2 {
		return State{}, corrupt("usage tables in a file of version %d", env.Version)
	}
	if err := check(&st); err != nil {
		return State{}, &StateError{Reason: ReasonCorrupt, Err: err}
	}
	return st, nil
}

// check reports the first thing in st a process never saves.
func check(st *State) error {
	if st.Currency == "" {
		return errors.New("no currency")
	}
	type spendID struct {
		budget, period string
		start          int64
	}
	seen := make(map[spendID]bool, len(st.Spend))
	for i := range st.Spend {
		w := &st.Spend[i]
		if err := w.Check(); err != nil {
			return fmt.Errorf("spend window %d: %v", i, err)
		}
		id := spendID{w.Budget, w.Period, w.Start.UnixNano()}
		if seen[id] {
			return fmt.Errorf("spend window %d: budget %q, %s from %s, appears twice", i, w.Budget, w.Period, w.Start.Format(time.RFC3339))
		}
		seen[id] = true
	}
	if st.Usage != nil {
		if err := st.Usage.Check(); err != nil {
			return fmt.Errorf("usage: %v", err)
		}
	}
	ids := make(map[string]bool, len(st.Windows))
	for i := range st.Windows {
		w := &st.Windows[i]
		if err := w.check(); err != nil {
			return fmt.Errorf("window %d (%s, %s): %v", i, w.Compartment, w.Kind, err)
		}
		id := w.Kind + "\x00" + w.CompartmentID()
		if ids[id] {
			return fmt.Errorf("window %d: compartment %q's %s appears twice", i, w.Compartment, w.Kind)
		}
		ids[id] = true
	}
	return nil
}

// check reports what makes no sense in w.
func (w *Window) check() error {
	name := func(what, s string) error {
		if s == "" || len(s) > maxName {
			return fmt.Errorf("%s of %d bytes", what, len(s))
		}
		return nil
	}
	if err := name("compartment name", w.Compartment); err != nil {
		return err
	}
	if err := name("family name", w.Family); err != nil {
		return err
	}
	if len(w.Key) == 0 || len(w.Key) > len(keyDims) {
		return fmt.Errorf("a key of %d dimensions", len(w.Key))
	}
	for i, d := range w.Key {
		if !slices.Contains(keyDims, d) || slices.Index(w.Key, d) != i {
			return fmt.Errorf("key dimension %q is unknown or repeated", d)
		}
	}
	switch {
	case w.Overflow && len(w.Values) != 0:
		return errors.New("an overflow compartment with key values")
	case w.Overflow && !slices.Contains(w.Key, "tenant"):
		return errors.New("an overflow compartment of a family not keyed by tenant")
	case !w.Overflow && len(w.Values) != len(w.Key):
		return fmt.Errorf("%d key values for %d key dimensions", len(w.Values), len(w.Key))
	}
	for i, v := range w.Values {
		// A tenant may be empty (a request whose tenant header was empty); no other value is.
		if len(v) > maxName || v == "" && w.Key[i] != "tenant" {
			return fmt.Errorf("%s of %d bytes", w.Key[i], len(v))
		}
	}
	if w.Kind != KindTokensPerMinute && w.Kind != KindTokensPerDay && w.Kind != KindRequestsPerMinute {
		return fmt.Errorf("kind %q is not %s, %s or %s", w.Kind, KindTokensPerMinute, KindTokensPerDay, KindRequestsPerMinute)
	}
	if w.Slot <= 0 || w.Slot > maxSlot {
		return fmt.Errorf("slot of %d ns is not from 1 ns to %s", int64(w.Slot), maxSlot)
	}
	if len(w.Slots) == 0 || len(w.Slots) > budget.Slots {
		return fmt.Errorf("%d slots, want 1 to %d", len(w.Slots), budget.Slots)
	}
	last := math.MaxInt64 / int64(w.Slot)
	for i, c := range w.Slots {
		switch {
		case c.Index < 0 || c.Index >= last:
			return fmt.Errorf("slot %d: index %d out of range", i, c.Index)
		case c.Amount <= 0 || c.Amount > MaxAmount:
			return fmt.Errorf("slot %d: amount %d out of range", i, c.Amount)
		case i > 0 && c.Index <= w.Slots[i-1].Index:
			return fmt.Errorf("slot %d: index %d not after the slot before", i, c.Index)
		}
	}
	if span := w.Slots[len(w.Slots)-1].Index - w.Slots[0].Index; span >= budget.Slots {
		return fmt.Errorf("slots span %d slots, more than a window", span+1)
	}
	return nil
}

// Read reads and parses the state file at path. Every error is a *StateError; a file that
// does not exist is ReasonMissing.
func Read(path string) (State, error) {
	// A FIFO or a device is refused at once: opening a FIFO would wait for a writer forever.
	data, err := files.Read(path, int64(maxSize))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return State{}, &StateError{Reason: ReasonMissing, Err: err}
	case errors.Is(err, files.ErrTooLarge):
		return State{}, corrupt("larger than %d bytes", maxSize)
	case err != nil:
		return State{}, &StateError{Reason: ReasonUnreadable, Err: err}
	}
	return Parse(data)
}

// Write writes st to path atomically: to a temporary file in the same directory, synced,
// renamed over path, and the directory synced. A crash at any point leaves either the previous
// file or the new one, whole.
func Write(path string, st State) error {
	data, err := Encode(st)
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
