package breaker

import (
	"fmt"
	"strings"
)

// State is a state of the breaker's state machine. The numbering follows Resilience4j's state
// order, so dashboards that plot the state as a number read the same in both. The zero value is
// Closed. A State is a plain value and safe for concurrent use.
type State uint8

const (
	// Closed permits every call and records outcomes in the sliding window.
	Closed State = iota
	// Open rejects every call until the wait in OPEN has elapsed.
	Open
	// HalfOpen permits a fixed number of probe calls whose outcomes decide between CLOSED and
	// OPEN.
	HalfOpen
	// Disabled permits every call and records nothing. Only an operator enters it.
	Disabled
	// ForcedOpen rejects every call until an operator moves the breaker elsewhere.
	ForcedOpen
	// MetricsOnly permits every call and records outcomes, but never opens: a breach of a
	// threshold is reported once as an event. Only an operator enters it; it is the safe way to
	// try new thresholds on live traffic.
	MetricsOnly
)

var stateNames = [...]string{
	Closed:      "CLOSED",
	Open:        "OPEN",
	HalfOpen:    "HALF_OPEN",
	Disabled:    "DISABLED",
	ForcedOpen:  "FORCED_OPEN",
	MetricsOnly: "METRICS_ONLY",
}

// String returns the Resilience4j name of the state, e.g. "HALF_OPEN". Safe for concurrent use.
func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("State(%d)", uint8(s))
}

// valid reports whether s is one of the six states.
func (s State) valid() bool { return int(s) < len(stateNames) }

// ParseState parses a state name as written by String. Case is ignored so that an admin request
// for "forced_open" works as well as one for "FORCED_OPEN". Safe for concurrent use.
func ParseState(s string) (State, error) {
	for i, name := range stateNames {
		if strings.EqualFold(s, name) {
			return State(i), nil
		}
	}
	return 0, fmt.Errorf("unknown breaker state %q (want one of %s)", s, strings.Join(stateNames[:], ", "))
}

// MarshalText writes the state name, so JSON snapshots carry "OPEN" rather than 1. Safe for
// concurrent use.
func (s State) MarshalText() ([]byte, error) {
	if !s.valid() {
		return nil, fmt.Errorf("cannot marshal invalid breaker state %d", uint8(s))
	}
	return []byte(s.String()), nil
}

// UnmarshalText parses a state name with ParseState. It writes *s, so it is not safe for
// concurrent use with other accesses to *s.
func (s *State) UnmarshalText(b []byte) error {
	v, err := ParseState(string(b))
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// WindowType says how the sliding window bounds the calls it remembers. The zero value is
// CountBased, Resilience4j's default. A WindowType is a plain value and safe for concurrent use.
type WindowType uint8

const (
	// CountBased remembers the outcomes of the last WindowSize calls.
	CountBased WindowType = iota
	// TimeBased remembers the outcomes of the calls recorded in the last WindowSize seconds,
	// in one-second buckets aligned to the epoch second.
	TimeBased
)

var windowTypeNames = [...]string{CountBased: "COUNT_BASED", TimeBased: "TIME_BASED"}

// String returns the Resilience4j name of the window type, e.g. "TIME_BASED". Safe for
// concurrent use.
func (w WindowType) String() string {
	if int(w) < len(windowTypeNames) {
		return windowTypeNames[w]
	}
	return fmt.Sprintf("WindowType(%d)", uint8(w))
}

// ParseWindowType parses "COUNT_BASED" or "TIME_BASED", ignoring case. Safe for concurrent use.
func ParseWindowType(s string) (WindowType, error) {
	for i, name := range windowTypeNames {
		if strings.EqualFold(s, name) {
			return WindowType(i), nil
		}
	}
	return 0, fmt.Errorf("unknown sliding window type %q (want COUNT_BASED or TIME_BASED)", s)
}

// MarshalText writes the window type name. Safe for concurrent use.
func (w WindowType) MarshalText() ([]byte, error) {
	if int(w) >= len(windowTypeNames) {
		return nil, fmt.Errorf("cannot marshal invalid sliding window type %d", uint8(w))
	}
	return []byte(w.String()), nil
}

// UnmarshalText parses a window type name with ParseWindowType. It writes *w, so it is not
// safe for concurrent use with other accesses to *w.
func (w *WindowType) UnmarshalText(b []byte) error {
	v, err := ParseWindowType(string(b))
	if err != nil {
		return err
	}
	*w = v
	return nil
}

// Outcome is the result of a permitted call as the caller judged it. A plain value, safe for
// concurrent use.
type Outcome uint8

const (
	// Success is a call the provider answered well (for example a 2xx, or a 429 the policy treats
	// as neutral). It still counts as slow when its duration exceeds the slow-call duration.
	Success Outcome = iota + 1
	// Failure is a call the provider failed (5xx, timeout, reset before response headers).
	Failure
	// Ignored is a call that says nothing about the provider (a 4xx client error). It records
	// nothing and, in HALF_OPEN, gives its probe permit back. The zero Outcome and any unknown
	// value are treated as Ignored, so a forgotten outcome can never move the breaker.
	Ignored
)

var outcomeNames = [...]string{Success: "success", Failure: "failure", Ignored: "ignored"}

// String returns "success", "failure" or "ignored". Safe for concurrent use.
func (o Outcome) String() string {
	if o >= Success && int(o) < len(outcomeNames) {
		return outcomeNames[o]
	}
	return fmt.Sprintf("Outcome(%d)", uint8(o))
}
