package breaker

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// Limits on window sizes. They exist because every breaker allocates its window up front (one
// byte per remembered call, or one bucket per second), and because a breaker that remembers
// hours of traffic reacts too late to protect anything.
const (
	// MaxCountWindow is the largest COUNT_BASED sliding_window_size and the largest
	// permitted_calls_in_half_open.
	MaxCountWindow = 100_000
	// MaxTimeWindowSeconds is the largest TIME_BASED sliding_window_size, one hour.
	MaxTimeWindowSeconds = 3600
)

// defaultMaxWaitFactor caps the grown wait in OPEN when MaxWaitInOpen is 0: exponential growth
// without a cap would, after a few dozen reopenings, keep the breaker open for years.
const defaultMaxWaitFactor = 10

// Config holds the settings of one breaker. Field comments give the policy-file key, the meaning
// of the zero value and Resilience4j's default; Defaults returns those defaults. The zero Config
// is not valid (its thresholds and sizes are 0): start from Defaults and override. A Config is a
// plain value, safe for concurrent use once built.
type Config struct {
	// WindowType is sliding_window_type. The zero value is CountBased (Resilience4j's default).
	WindowType WindowType
	// WindowSize is sliding_window_size: calls for CountBased, seconds for TimeBased. Zero is
	// invalid. Resilience4j's default is 100.
	WindowSize int
	// MinimumCalls is minimum_calls: the fewest buffered calls before the rates are computed;
	// below it the breaker cannot open however bad the calls are. Zero is invalid.
	// Resilience4j's default is 100. In HALF_OPEN the probes are decided after
	// min(MinimumCalls, PermittedCallsInHalfOpen) results, as in Resilience4j.
	MinimumCalls int
	// FailureRateThreshold is failure_rate_threshold, a percentage in (0, 100]: the breaker opens
	// when the failure rate is at or above it. Zero is invalid. Resilience4j's default is 50.
	FailureRateThreshold float64
	// SlowCallRateThreshold is slow_call_rate_threshold, a percentage in (0, 100]: the breaker
	// opens when the share of slow calls is at or above it. 100 opens only when every buffered
	// call was slow. Zero is invalid. Resilience4j's default is 100.
	SlowCallRateThreshold float64
	// SlowCallDuration is slow_call_duration: a call whose recorded duration is longer than this
	// is slow (a failed call can be slow too and then counts for both rates). Zero is invalid.
	// Resilience4j's default is 60s.
	SlowCallDuration time.Duration
	// WaitInOpen is wait_in_open: how long the breaker stays OPEN after its first opening before
	// it lets probes through. Zero is invalid (at least 1ms). Resilience4j's default is 60s.
	WaitInOpen time.Duration
	// WaitInOpenMultiplier is wait_in_open_multiplier: each consecutive opening without a
	// successful close waits this many times longer than the previous one, up to MaxWaitInOpen.
	// 1 keeps the wait constant. Zero is invalid. Default 1.
	WaitInOpenMultiplier float64
	// MaxWaitInOpen is max_wait_in_open, the cap on the grown wait. Zero caps it at
	// 10 × WaitInOpen. Default 0.
	MaxWaitInOpen time.Duration
	// PermittedCallsInHalfOpen is permitted_calls_in_half_open: the number of probe calls
	// HALF_OPEN lets through. Zero is invalid. Resilience4j's default is 10.
	PermittedCallsInHalfOpen int
	// MaxWaitInHalfOpen is max_wait_in_half_open: if the probes have not decided within this
	// time the breaker goes back to OPEN. Zero waits for the probes however long they take
	// (Resilience4j's default).
	MaxWaitInHalfOpen time.Duration
	// AutomaticTransition moves OPEN to HALF_OPEN as soon as the wait has elapsed, as seen by
	// any call that passes an instant (Snapshot, Record, OpenFor, Transition, Reconfigure);
	// without it only Acquire makes that move (the next request after the wait), and Snapshot
	// keeps reporting OPEN with no wait remaining. No timer is involved either way. The zero
	// value, false, is Resilience4j's default.
	AutomaticTransition bool
}

// Defaults returns Resilience4j's default settings: COUNT_BASED window of 100 calls, minimum 100
// calls, failure rate 50 %, slow-call rate 100 %, slow-call duration 60s, 60s in OPEN with no
// growth, 10 probes in HALF_OPEN without time limit, automatic OPEN to HALF_OPEN off. Policy
// files override most of these; an LLM provider rarely wants a 60s slow-call duration. Safe for
// concurrent use.
func Defaults() Config {
	return Config{
		WindowType:               CountBased,
		WindowSize:               100,
		MinimumCalls:             100,
		FailureRateThreshold:     50,
		SlowCallRateThreshold:    100,
		SlowCallDuration:         60 * time.Second,
		WaitInOpen:               60 * time.Second,
		WaitInOpenMultiplier:     1,
		MaxWaitInOpen:            0,
		PermittedCallsInHalfOpen: 10,
		MaxWaitInHalfOpen:        0,
		AutomaticTransition:      false,
	}
}

// FieldError is one invalid setting: the policy-file key and why the value cannot work. It is a
// plain value, safe for concurrent use.
type FieldError struct {
	// Key is the policy-file key, e.g. "minimum_calls".
	Key string
	// Msg says what is wrong and why it matters.
	Msg string
}

// Error formats the problem as "key: message". Safe for concurrent use.
func (e FieldError) Error() string { return e.Key + ": " + e.Msg }

// ConfigErrors is every problem Validate found, in the order of the Config fields. It is a plain
// value, safe for concurrent use once returned.
type ConfigErrors []FieldError

// Error lists the problems, one per line. Safe for concurrent use.
func (e ConfigErrors) Error() string {
	lines := make([]string, len(e))
	for i, fe := range e {
		lines[i] = fe.Error()
	}
	return strings.Join(lines, "\n")
}

// Unwrap exposes each problem to errors.As and errors.Is. Safe for concurrent use.
func (e ConfigErrors) Unwrap() []error {
	errs := make([]error, len(e))
	for i, fe := range e {
		errs[i] = fe
	}
	return errs
}

// Validate reports every setting that cannot work, all at once, as ConfigErrors (nil when the
// Config is valid). Each message names the policy-file key and says why the value is refused.
// It only reads c and is safe for concurrent use.
//
// Where this differs from Resilience4j's builder it is stricter, never looser:
//
//   - minimum_calls above a COUNT_BASED sliding_window_size is refused. Such a window can never
//     hold minimum_calls calls, so the breaker could never open; Resilience4j silently lowers
//     minimum_calls to the window size instead, which hides the mistake.
//   - For TIME_BASED, minimum_calls may exceed sliding_window_size, as in Resilience4j: the size
//     is in seconds and the minimum in calls, and a second can hold any number of calls. A
//     10-second window with minimum_calls 50 simply means "judge the provider only when it
//     served at least 50 calls in the last 10 seconds", a guard against opening on a handful of
//     calls at night.
//   - slow_call_rate_threshold 100 is accepted: it trips, but only when every buffered call was
//     slow (one fast call in the window keeps it closed). The slow-call settings that can never
//     trip are a threshold above 100 (the rate cannot exceed 100 %), refused here, and a
//     slow_call_duration at or above the longest duration the caller can measure (its upstream
//     timeout): no call is ever longer, so none is ever slow. This package cannot see the
//     caller's timeout; the policy loader, which knows it, must check that one.
//   - Window sizes and the probe count are capped (MaxCountWindow, MaxTimeWindowSeconds)
//     because each breaker allocates its window up front.
//   - max_wait_in_half_open between 0 and 1ms is refused: no probe can answer that fast, so the
//     breaker would never close again.
func (c Config) Validate() error {
	var errs ConfigErrors
	add := func(key, format string, args ...any) {
		errs = append(errs, FieldError{Key: key, Msg: fmt.Sprintf(format, args...)})
	}

	typeOK := c.WindowType == CountBased || c.WindowType == TimeBased
	if !typeOK {
		add("sliding_window_type", "is %s; must be COUNT_BASED or TIME_BASED", c.WindowType)
	}
	switch {
	case c.WindowSize < 1:
		add("sliding_window_size", "is %d; must be at least 1: an empty window holds no calls, so the rates could never be computed and the breaker could never open", c.WindowSize)
	case c.WindowType == CountBased && c.WindowSize > MaxCountWindow:
		add("sliding_window_size", "is %d calls; at most %d: the window keeps every remembered call in memory, and a longer memory only delays the reaction to an outage", c.WindowSize, MaxCountWindow)
	case c.WindowType == TimeBased && c.WindowSize > MaxTimeWindowSeconds:
		add("sliding_window_size", "is %d seconds; at most %d (one hour): the window keeps a bucket per second, and a breaker that judges an hour of traffic reacts too late to protect anything", c.WindowSize, MaxTimeWindowSeconds)
	}
	switch {
	case c.MinimumCalls < 1:
		add("minimum_calls", "is %d; must be at least 1: rates computed from no calls mean nothing", c.MinimumCalls)
	case c.WindowType == CountBased && c.WindowSize >= 1 && c.MinimumCalls > c.WindowSize:
		add("minimum_calls", "is %d but the COUNT_BASED sliding_window_size is %d: the window never holds more than %d calls, so the rates would never be evaluated and the breaker could never open (lower minimum_calls or enlarge the window)", c.MinimumCalls, c.WindowSize, c.WindowSize)
	}
	if !(c.FailureRateThreshold > 0 && c.FailureRateThreshold <= 100) {
		add("failure_rate_threshold", "is %v; must be greater than 0 and at most 100 (percent): at 0 the breaker would open on its first evaluation even without failures, and above 100 the failure rate could never reach it", c.FailureRateThreshold)
	}
	if !(c.SlowCallRateThreshold > 0 && c.SlowCallRateThreshold <= 100) {
		add("slow_call_rate_threshold", "is %v; must be greater than 0 and at most 100 (percent): at 0 the breaker would open on its first evaluation even without slow calls, and above 100 the slow-call rate could never reach it, so slow calls could never open the breaker", c.SlowCallRateThreshold)
	}
	if c.SlowCallDuration <= 0 {
		add("slow_call_duration", "is %v; must be greater than 0: a call is slow when it takes longer than this, so at 0 every call would be slow", c.SlowCallDuration)
	}
	if c.WaitInOpen < time.Millisecond {
		add("wait_in_open", "is %v; must be at least 1ms: a breaker that lets probes through the moment it opens never sheds any load", c.WaitInOpen)
	}
	if !(c.WaitInOpenMultiplier >= 1) || math.IsInf(c.WaitInOpenMultiplier, 0) {
		add("wait_in_open_multiplier", "is %v; must be a finite number of at least 1 (1 keeps the wait constant): below 1 each reopening would wait less than the last and probe a failing provider ever faster", c.WaitInOpenMultiplier)
	}
	switch {
	case c.MaxWaitInOpen < 0:
		add("max_wait_in_open", "is %v; must not be negative (0 caps the wait at %d × wait_in_open)", c.MaxWaitInOpen, defaultMaxWaitFactor)
	case c.MaxWaitInOpen > 0 && c.MaxWaitInOpen < c.WaitInOpen:
		add("max_wait_in_open", "is %v, shorter than wait_in_open (%v): the cap would cut even the first wait, so wait_in_open would never apply", c.MaxWaitInOpen, c.WaitInOpen)
	}
	switch {
	case c.PermittedCallsInHalfOpen < 1:
		add("permitted_calls_in_half_open", "is %d; must be at least 1: without probe calls HALF_OPEN could never decide and the breaker would never close again", c.PermittedCallsInHalfOpen)
	case c.PermittedCallsInHalfOpen > MaxCountWindow:
		add("permitted_calls_in_half_open", "is %d; at most %d: the probes are remembered like a COUNT_BASED window, and that many probes is no longer a cautious test", c.PermittedCallsInHalfOpen, MaxCountWindow)
	}
	switch {
	case c.MaxWaitInHalfOpen < 0:
		add("max_wait_in_half_open", "is %v; must not be negative (0 waits for the probes however long they take)", c.MaxWaitInHalfOpen)
	case c.MaxWaitInHalfOpen > 0 && c.MaxWaitInHalfOpen < time.Millisecond:
		add("max_wait_in_half_open", "is %v; must be 0 (no limit) or at least 1ms: no probe can answer that fast, so the breaker would go back to OPEN every time and never close again", c.MaxWaitInHalfOpen)
	}
	if len(errs) == 0 {
		return nil
	}
	return errs
}

// probeMinimum is the number of probe results after which HALF_OPEN decides. Resilience4j gives
// HALF_OPEN a COUNT_BASED window of PermittedCallsInHalfOpen calls and lowers MinimumCalls to
// that size, so with fewer minimum calls than probes it decides before all probes are back.
func (c *Config) probeMinimum() int {
	return min(c.MinimumCalls, c.PermittedCallsInHalfOpen)
}

// waitInOpen is the wait before probes after the attempt-th consecutive opening (1 for the
// first): WaitInOpen × multiplier^(attempt−1), capped. Computed in float64 so a long run of
// reopenings saturates at the cap instead of overflowing.
func (c *Config) waitInOpen(attempt int) time.Duration {
	ceiling := c.MaxWaitInOpen
	if ceiling == 0 {
		ceiling = satMul(c.WaitInOpen, defaultMaxWaitFactor)
	}
	w := c.WaitInOpen
	if attempt > 1 && c.WaitInOpenMultiplier > 1 {
		f := float64(c.WaitInOpen) * math.Pow(c.WaitInOpenMultiplier, float64(attempt-1))
		if f >= float64(ceiling) {
			return ceiling
		}
		w = time.Duration(f)
	}
	return min(w, ceiling)
}

// satMul multiplies a non-negative duration, saturating instead of overflowing.
func satMul(d time.Duration, k int64) time.Duration {
	if d > math.MaxInt64/time.Duration(k) {
		return math.MaxInt64
	}
	return d * time.Duration(k)
}
