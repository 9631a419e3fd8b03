package breaker

import (
	"sync/atomic"
	"time"
)

// Reason is the stable code for why the breaker changed state or raised an event. The same
// strings are used in logs, metrics labels and the admin API. A plain string, safe for
// concurrent use.
type Reason string

// Reasons, one per way into a state.
const (
	// ReasonFailureRate: CLOSED opened because the failure rate reached its threshold, or
	// METRICS_ONLY saw it reach the threshold.
	ReasonFailureRate Reason = "failure_rate"
	// ReasonSlowCallRate: as ReasonFailureRate, for the slow-call rate.
	ReasonSlowCallRate Reason = "slow_call_rate"
	// ReasonProbesSucceeded: HALF_OPEN closed because the probes stayed under both thresholds.
	ReasonProbesSucceeded Reason = "probes_succeeded"
	// ReasonProbeFailed: HALF_OPEN reopened because the probes reached a threshold.
	ReasonProbeFailed Reason = "probe_failed"
	// ReasonWaitElapsed: OPEN moved to HALF_OPEN because its wait was over.
	ReasonWaitElapsed Reason = "wait_elapsed"
	// ReasonHalfOpenTimeout: HALF_OPEN reopened because the probes did not decide within
	// max_wait_in_half_open.
	ReasonHalfOpenTimeout Reason = "half_open_timeout"
	// ReasonForced: an operator chose the state (Transition).
	ReasonForced Reason = "forced"
	// ReasonRetryAfter: the upstream asked to be left alone for a while (OpenFor).
	ReasonRetryAfter Reason = "retry_after"
	// ReasonReconfigured: a configuration reload restarted the state (HALF_OPEN whose probe
	// count changed).
	ReasonReconfigured Reason = "reconfigured"
)

// EventKind tells a state transition from a threshold breach that changed nothing. A plain
// value, safe for concurrent use.
type EventKind uint8

const (
	// EventTransition is a state change. From may equal To when an operator re-enters the
	// current state or a reload restarts it; the state then starts afresh (new generation).
	EventTransition EventKind = iota
	// EventThresholdExceeded is reported in METRICS_ONLY, at most once per rate per stay in the
	// state, when a rate reaches its threshold: where CLOSED would have opened, METRICS_ONLY
	// only says so (Resilience4j's FailureRateExceeded / SlowCallRateExceeded events).
	EventThresholdExceeded
)

// String returns "transition" or "threshold_exceeded". Safe for concurrent use.
func (k EventKind) String() string {
	if k == EventThresholdExceeded {
		return "threshold_exceeded"
	}
	return "transition"
}

// Event describes a state transition or a threshold breach. It is a plain value, safe for
// concurrent use.
type Event struct {
	Kind EventKind
	// Name is the breaker's name.
	Name string
	// From and To are the states before and after; equal for EventThresholdExceeded.
	From, To State
	// Reason says why.
	Reason Reason
	// FailureRate and SlowRate are the rates in percent of the window that justified the
	// event (for a transition, the window of the state being left), −1 below minimum calls.
	FailureRate, SlowRate float64
	// Generation is the generation after the event. Listeners may run concurrently and out of
	// order; the generation orders their events.
	Generation uint64
	// At is the instant passed to the call that caused the event.
	At time.Time
}

// Listener receives events. It is called after the breaker's lock is released, so it may log,
// count, or even call the breaker again; it may be called from several goroutines at once and
// must be safe for concurrent use.
type Listener func(Event)

// Option configures New. Options are plain functions, safe for concurrent use; New applies
// them once, in order.
type Option func(*options)

type options struct {
	listener Listener
	initial  State
}

// WithListener installs a listener from the start, so the first transitions are not missed.
// Safe for concurrent use.
func WithListener(l Listener) Option {
	return func(o *options) { o.listener = l }
}

// WithInitialState starts the breaker in CLOSED (the default), DISABLED, METRICS_ONLY or
// FORCED_OPEN, as a policy file's state key asks, without a transition event. OPEN and
// HALF_OPEN are refused by New: they describe a provider's recent history, which a new breaker
// does not have. Safe for concurrent use.
func WithInitialState(s State) Option {
	return func(o *options) { o.initial = s }
}

// Counts are cumulative call counts since the breaker was created, by kind. The kinds are
// exclusive: every Record lands in exactly one of Success, Failure, SlowSuccess, SlowFailure,
// Ignored or Stale, except in DISABLED, which counts nothing (as Resilience4j publishes no call
// events while disabled). They are monotonic, suitable for Prometheus counters. A plain value,
// safe for concurrent use.
type Counts struct {
	// Success and Failure are calls recorded in a window that were not slow.
	Success, Failure uint64
	// SlowSuccess and SlowFailure are recorded calls longer than the slow-call duration.
	SlowSuccess, SlowFailure uint64
	// NotPermitted are rejected Acquire calls (OPEN, HALF_OPEN without probe permits,
	// FORCED_OPEN).
	NotPermitted uint64
	// Ignored are Ignored outcomes that were current (not stale).
	Ignored uint64
	// Stale are results of permits granted in an older generation, discarded because the
	// breaker changed state while the call was in flight.
	Stale uint64
	// WouldOpen is not a call kind: it counts the stays in METRICS_ONLY in which a rate reached
	// its threshold, where CLOSED would have opened (once per stay, whichever rate came first).
	WouldOpen uint64
}

// counters are the kinds of Counts that lock-free paths increment.
type counters struct {
	notPermitted, ignored, stale atomic.Uint64
}

// recordedCounts are the kinds of Counts that Record increments under the breaker's lock.
type recordedCounts struct {
	success, failure, slowSuccess, slowFailure uint64
	wouldOpen                                  uint64
}

// pending collects the events of one locked operation so they can be delivered after unlocking.
// An operation produces at most two (a lazy timed transition, then the one it caused).
type pending struct {
	n  int
	ev [3]Event
}

func (p *pending) add(e Event) {
	if p.n < len(p.ev) {
		p.ev[p.n] = e
		p.n++
	}
}
