package breaker

// A breaker's states, its sliding windows and its transitions are one state machine under one
// lock, kept in one file so that every transition can be read beside the counts it reads.

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

var (
	// ErrOpen is returned by Acquire while the breaker is OPEN, or HALF_OPEN with every probe
	// permit taken.
	ErrOpen = errors.New("circuit breaker is open")
	// ErrForcedOpen is returned by Acquire while an operator holds the breaker FORCED_OPEN. It
	// wraps ErrOpen, so errors.Is(err, ErrOpen) holds for both refusals.
	ErrForcedOpen = fmt.Errorf("%w: forced open by an operator", ErrOpen)
	// ErrIllegalTransition is returned by Transition for a move Resilience4j forbids.
	ErrIllegalTransition = errors.New("illegal circuit breaker state transition")
)

// Permit is the right to make one call, granted by Acquire. It remembers the generation (the
// stay in a state) it was granted in; Record and Release ignore a permit whose generation has
// passed. Hand every permit back exactly once, with Record or Release, to the Breaker that
// granted it. The zero Permit belongs to no generation. A Permit is a small value (no
// allocation), safe to copy and for concurrent use.
type Permit struct {
	gen   uint64
	state State
}

// Generation is the generation the permit was granted in (0 for the zero Permit). Safe for
// concurrent use.
func (p Permit) Generation() uint64 { return p.gen }

// State is the state the permit was granted in; HalfOpen marks a probe. Safe for concurrent use.
func (p Permit) State() State { return p.state }

// Snapshot is the breaker's state and window as of one instant, for the admin API and metrics.
// It is a plain value, safe for concurrent use.
type Snapshot struct {
	Name       string `json:"name"`
	State      State  `json:"state"`
	Generation uint64 `json:"generation"`
	// FailureRate and SlowRate are in percent, −1 while fewer than minimum calls are buffered.
	// In OPEN they describe the window that caused the opening; in DISABLED and FORCED_OPEN
	// there is no window and they are −1.
	FailureRate float64 `json:"failure_rate"`
	SlowRate    float64 `json:"slow_rate"`
	// BufferedCalls is the number of calls in the window; SuccessfulCalls are those that did not
	// fail (slow or not), FailedCalls those that did, SlowCalls those that were slow (failed or
	// not) and SlowFailedCalls those both slow and failed.
	BufferedCalls   int `json:"buffered_calls"`
	SuccessfulCalls int `json:"successful_calls"`
	FailedCalls     int `json:"failed_calls"`
	SlowCalls       int `json:"slow_calls"`
	SlowFailedCalls int `json:"slow_failed_calls"`
	// NotPermittedCalls counts refusals since the current state was entered.
	NotPermittedCalls int64 `json:"not_permitted_calls"`
	// EnteredAt is the instant the current state was entered.
	EnteredAt time.Time `json:"entered_at"`
	// WaitRemaining is, in OPEN, the time left before probes are allowed; 0 otherwise.
	WaitRemaining time.Duration `json:"wait_remaining"`
	// ProbesRemaining is, in HALF_OPEN, the number of probe permits not yet taken; 0 otherwise.
	ProbesRemaining int `json:"probes_remaining"`
	// ConsecutiveOpenings counts openings since the breaker last closed; it drives the growth
	// of the wait in OPEN.
	ConsecutiveOpenings int `json:"consecutive_openings"`
}

// Breaker is a Resilience4j-style circuit breaker for one provider. It is safe for concurrent
// use: a mutex guards the state machine, while the calls every request makes in a steady state
// (Acquire in CLOSED, DISABLED, METRICS_ONLY and FORCED_OPEN, Acquire in OPEN before the wait
// has elapsed, Release and Ignored outside HALF_OPEN) and State and RemainingOpen read atomic
// mirrors and take no lock. Record takes the lock: it must update the window. A Breaker must
// not be copied.
type Breaker struct {
	name string
	// epoch is the instant given to New. Internal times are nanoseconds since epoch, taken with
	// Time.Sub, which uses the monotonic clock when both instants carry one, so a wall-clock
	// step does not disturb a breaker fed with time.Now().
	epoch time.Time
	// epochFrac is epoch's offset within its wall-clock second, so TIME_BASED buckets start on
	// epoch seconds as in Resilience4j.
	epochFrac int64

	// Atomic mirrors, written under mu and read by the lock-free paths.
	word      atomic.Uint64 // generation<<8 | state
	openUntil atomic.Int64  // end of the wait in OPEN, internal nanoseconds
	// hwm mirrors clock, but only while OPEN, the one state whose lock-free path needs the
	// time: an atomic store on every Record would cost more than the rest of it.
	hwm      atomic.Int64
	notPerm  atomic.Int64 // refusals since the current state was entered
	counts   counters
	listener atomic.Pointer[Listener]

	mu        sync.Mutex
	clock     int64 // latest internal time seen; time never runs backwards past it
	recorded  recordedCounts
	cfg       Config
	state     State
	gen       uint64
	attempts  int // consecutive openings since the last close, Resilience4j's "attempts"
	enteredAt time.Time
	enteredN  int64
	until     int64 // end of the wait in OPEN
	permits   int   // probe permits left in HALF_OPEN
	exceeded  [2]bool
	closedWin window // window of CLOSED and METRICS_ONLY
	probeWin  window // window of HALF_OPEN
	// cur is the window Snapshot reports: closedWin, probeWin, or nil. OPEN keeps the window of
	// the state it came from, so the rate that opened the breaker stays visible.
	cur *window
	// hist keeps the last recorded calls and events for History.
	hist history
}

// New returns a breaker named name (used in events and snapshots) in CLOSED, or in the state
// chosen by WithInitialState, as of now. It returns the Validate errors, prefixed with the name,
// if cfg is invalid. Safe for concurrent use; the Breaker it returns is too.
func New(name string, cfg Config, now time.Time, opts ...Option) (*Breaker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("breaker %q: %w", name, err)
	}
	o := options{initial: Closed}
	for _, opt := range opts {
		opt(&o)
	}
	switch o.initial {
	case Closed, Disabled, MetricsOnly, ForcedOpen:
	default:
		return nil, fmt.Errorf("breaker %q: cannot start in %s: a new breaker has no history to justify it; start in CLOSED, DISABLED, METRICS_ONLY or FORCED_OPEN", name, o.initial)
	}
	b := &Breaker{
		name:      name,
		epoch:     now,
		epochFrac: int64(now.Nanosecond()),
		cfg:       cfg,
		state:     o.initial,
		gen:       1,
		enteredAt: now,
		closedWin: newWindow(cfg.WindowType, cfg.WindowSize, 0),
		probeWin:  newWindow(CountBased, cfg.PermittedCallsInHalfOpen, 0),
	}
	switch o.initial {
	case Closed, MetricsOnly:
		b.cur = &b.closedWin
	case ForcedOpen:
		b.attempts = 1
	}
	b.word.Store(b.gen<<8 | uint64(b.state))
	if o.listener != nil {
		b.listener.Store(&o.listener)
	}
	return b, nil
}

// Name returns the name given to New. Safe for concurrent use.
func (b *Breaker) Name() string { return b.name }

// State returns the state as of the last operation, without applying timed transitions that
// are due (Snapshot does). It takes no lock. Safe for concurrent use.
func (b *Breaker) State() State { return State(b.word.Load() & 0xff) }

// Config returns the settings in force. Safe for concurrent use.
func (b *Breaker) Config() Config {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cfg
}

// SetListener replaces the listener (nil removes it). Events of operations already running may
// still reach the previous one. Safe for concurrent use.
func (b *Breaker) SetListener(l Listener) {
	if l == nil {
		b.listener.Store(nil)
		return
	}
	b.listener.Store(&l)
}

// Counts returns the cumulative call counts. The recorded kinds are counted under the lock that
// Record holds anyway, so the hot path pays nothing extra and Counts takes the lock briefly; the
// kinds counted on lock-free paths are atomics. Each kind is exact, though the kinds are not read
// at one single instant. Safe for concurrent use.
func (b *Breaker) Counts() Counts {
	b.mu.Lock()
	r := b.recorded
	b.mu.Unlock()
	return Counts{
		WouldOpen:    r.wouldOpen,
		Success:      r.success,
		Failure:      r.failure,
		SlowSuccess:  r.slowSuccess,
		SlowFailure:  r.slowFailure,
		NotPermitted: b.counts.notPermitted.Load(),
		Ignored:      b.counts.ignored.Load(),
		Stale:        b.counts.stale.Load(),
	}
}

// Acquire asks to make one call at now. CLOSED, METRICS_ONLY and DISABLED always permit. OPEN
// refuses with ErrOpen until its wait has elapsed (strictly after the end of the wait, as in
// Resilience4j); the first Acquire after that moves the breaker to HALF_OPEN, whatever
// AutomaticTransition says. HALF_OPEN permits while probe permits remain and refuses with ErrOpen
// after. FORCED_OPEN refuses with ErrForcedOpen. Every refusal is counted as not permitted.
// Safe for concurrent use; it takes no lock in CLOSED, METRICS_ONLY, DISABLED and FORCED_OPEN,
// nor in OPEN while the wait lasts.
func (b *Breaker) Acquire(now time.Time) (Permit, error) {
	w := b.word.Load()
	switch st := State(w & 0xff); st {
	case Closed, MetricsOnly, Disabled:
		return Permit{gen: w >> 8, state: st}, nil
	case ForcedOpen:
		b.refused()
		return Permit{}, ErrForcedOpen
	case Open:
		n := int64(now.Sub(b.epoch))
		if h := b.hwm.Load(); n < h {
			n = h
		}
		if n <= b.openUntil.Load() {
			b.refused()
			return Permit{}, ErrOpen
		}
	}
	var ev pending
	p, err := b.acquireLocked(now, &ev)
	b.emit(&ev)
	return p, err
}

// Unlimited returns a permit for a call made without asking the breaker — a retry the proxy
// made on its own — when the breaker is CLOSED or METRICS_ONLY, where every call is permitted
// and a permit limits nothing. In any other state it returns false and counts nothing: the call
// was not the breaker's to refuse, and OPEN or HALF_OPEN judge only the calls they permitted.
// Safe for concurrent use; it takes no lock.
func (b *Breaker) Unlimited() (Permit, bool) {
	w := b.word.Load()
	switch st := State(w & 0xff); st {
	case Closed, MetricsOnly:
		return Permit{gen: w >> 8, state: st}, true
	}
	return Permit{}, false
}

func (b *Breaker) acquireLocked(now time.Time, ev *pending) (Permit, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.tick(now)
	b.advance(n, now, true, ev)
	switch b.state {
	case Closed, MetricsOnly, Disabled:
		return Permit{gen: b.gen, state: b.state}, nil
	case HalfOpen:
		if b.permits > 0 {
			b.permits--
			return Permit{gen: b.gen, state: HalfOpen}, nil
		}
		b.refused()
		return Permit{}, ErrOpen
	case ForcedOpen:
		b.refused()
		return Permit{}, ErrForcedOpen
	default:
		b.refused()
		return Permit{}, ErrOpen
	}
}

func (b *Breaker) refused() {
	b.notPerm.Add(1)
	b.counts.notPermitted.Add(1)
}

// Release hands back a permit whose call never reached the provider (the request was refused
// later in admission, or cancelled before it was sent). In HALF_OPEN the probe permit becomes
// available again; in other states there is nothing to give back. A permit of an older
// generation is ignored. Call it at most once per permit, and never after Record. Safe for
// concurrent use; it takes no lock unless p is a probe.
func (b *Breaker) Release(p Permit) {
	if p.state != HalfOpen {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	// Release takes no instant, so it applies no timed transition; the next call that does will
	// (a half-open timeout then makes this permit stale, which is harmless).
	if p.gen == b.gen && b.state == HalfOpen && b.permits < b.cfg.PermittedCallsInHalfOpen {
		b.permits++
	}
}

// Record records the result of a permitted call that reached the provider: its outcome and its
// duration d, compared with SlowCallDuration (the caller picks the measure; time to first byte
// by default, so a long streamed answer is not a slow provider). In CLOSED and METRICS_ONLY the
// outcome enters the sliding window and, once minimum calls are buffered, the failure and slow
// rates are compared with their thresholds: CLOSED opens, METRICS_ONLY reports the breach once.
// In HALF_OPEN it enters the probe window; once min(MinimumCalls, PermittedCallsInHalfOpen)
// probes are back the breaker reopens if a rate is at or above its threshold and closes
// otherwise. DISABLED records nothing. Ignored (or an unknown outcome) records nothing and gives
// a probe permit back. A permit of an older generation is counted as stale and changes nothing.
// Safe for concurrent use.
func (b *Breaker) Record(p Permit, o Outcome, d time.Duration, now time.Time) {
	b.RecordDetail(p, o, d, now, Detail{})
}

// RecordDetail is Record with what the caller knows about the call (status, provider), which
// the breaker's history keeps with each call a window records (see History). It allocates
// nothing. Safe for concurrent use.
func (b *Breaker) RecordDetail(p Permit, o Outcome, d time.Duration, now time.Time, dt Detail) {
	if o != Success && o != Failure {
		b.ignore(p, now)
		return
	}
	var ev pending
	b.recordLocked(p, o, d, now, dt, &ev)
	b.emit(&ev)
}

func (b *Breaker) recordLocked(p Permit, o Outcome, d time.Duration, now time.Time, dt Detail, ev *pending) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.tick(now)
	b.advance(n, now, false, ev)
	if p.gen != b.gen {
		b.counts.stale.Add(1)
		return
	}
	var bits uint8
	if o == Failure {
		bits |= bitFailed
	}
	if d > b.cfg.SlowCallDuration {
		bits |= bitSlow
	}
	switch b.state {
	case Disabled:
		return
	case Closed, MetricsOnly:
		b.closedWin.record(bits, b.second(n))
		b.countKind(bits)
		b.hist.call(n, d, bits, dt)
		b.evaluateClosed(n, now, ev)
	case HalfOpen:
		b.probeWin.record(bits, 0)
		b.countKind(bits)
		b.hist.call(n, d, bits, dt)
		b.evaluateProbes(n, now, ev)
	default:
		// No permit is ever granted in OPEN or FORCED_OPEN, so a current-generation permit
		// cannot come from there; treat a forged one as stale.
		b.counts.stale.Add(1)
	}
}

func (b *Breaker) countKind(bits uint8) {
	switch bits {
	case 0:
		b.recorded.success++
	case bitFailed:
		b.recorded.failure++
	case bitSlow:
		b.recorded.slowSuccess++
	default:
		b.recorded.slowFailure++
	}
}

// ignore handles an Ignored outcome: nothing is recorded, and a probe permit goes back.
func (b *Breaker) ignore(p Permit, now time.Time) {
	if p.state != HalfOpen {
		w := b.word.Load()
		switch {
		case p.gen != w>>8:
			b.counts.stale.Add(1)
		case State(w&0xff) != Disabled:
			b.counts.ignored.Add(1)
		}
		return
	}
	var ev pending
	b.ignoreProbeLocked(p, now, &ev)
	b.emit(&ev)
}

func (b *Breaker) ignoreProbeLocked(p Permit, now time.Time, ev *pending) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.tick(now)
	b.advance(n, now, false, ev)
	if p.gen != b.gen || b.state != HalfOpen {
		b.counts.stale.Add(1)
		return
	}
	b.counts.ignored.Add(1)
	if b.permits < b.cfg.PermittedCallsInHalfOpen {
		b.permits++
	}
}

// evaluateClosed compares the CLOSED or METRICS_ONLY window with the thresholds.
func (b *Breaker) evaluateClosed(n int64, now time.Time, ev *pending) {
	fr, sr := b.closedWin.sum.rates(b.cfg.MinimumCalls)
	if fr < 0 {
		return
	}
	failed, slow := fr >= b.cfg.FailureRateThreshold, sr >= b.cfg.SlowCallRateThreshold
	if !failed && !slow {
		return
	}
	if b.state == MetricsOnly {
		// Resilience4j reports each breach once per stay in METRICS_ONLY and never opens. The
		// first breach of a stay is where CLOSED would have opened.
		if !b.exceeded[0] && !b.exceeded[1] {
			b.recorded.wouldOpen++
		}
		for i, hit := range [2]bool{failed, slow} {
			if !hit || b.exceeded[i] {
				continue
			}
			b.exceeded[i] = true
			reason := ReasonFailureRate
			if i == 1 {
				reason = ReasonSlowCallRate
			}
			b.raise(Event{Kind: EventThresholdExceeded, Name: b.name, From: MetricsOnly, To: MetricsOnly,
				Reason: reason, FailureRate: fr, SlowRate: sr, Generation: b.gen, At: now}, ev)
		}
		return
	}
	reason := ReasonFailureRate
	if !failed {
		reason = ReasonSlowCallRate
	}
	b.moveTo(Open, reason, n, now, 0, ev)
}

// evaluateProbes decides HALF_OPEN once enough probes are back.
func (b *Breaker) evaluateProbes(n int64, now time.Time, ev *pending) {
	fr, sr := b.probeWin.sum.rates(b.cfg.probeMinimum())
	if fr < 0 {
		return
	}
	if fr >= b.cfg.FailureRateThreshold || sr >= b.cfg.SlowCallRateThreshold {
		b.moveTo(Open, ReasonProbeFailed, n, now, 0, ev)
		return
	}
	b.moveTo(Closed, ReasonProbesSucceeded, n, now, 0, ev)
}

// OpenFor holds the breaker OPEN for at least d from now, as Resilience4j's
// transitionToOpenStateFor does when an upstream 429 or 503 carries a retry-after: from CLOSED
// or HALF_OPEN it opens for d; in OPEN it extends the wait to now+d if that is later and
// otherwise changes nothing, so a short retry-after never cuts a longer wait. Like Resilience4j
// it does not count as a further consecutive opening, so the grown wait is unaffected. It does
// nothing in DISABLED, FORCED_OPEN and METRICS_ONLY (an operator's choice outranks an upstream
// hint), or when d is not positive. The caller caps d: a retry-after of a day opens for a day.
// Safe for concurrent use.
func (b *Breaker) OpenFor(d time.Duration, now time.Time) {
	if d <= 0 {
		return
	}
	var ev pending
	b.openForLocked(d, now, &ev)
	b.emit(&ev)
}

func (b *Breaker) openForLocked(d time.Duration, now time.Time, ev *pending) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.tick(now)
	b.advance(n, now, false, ev)
	switch b.state {
	case Closed, HalfOpen:
	case Open:
		if b.until >= satAdd(n, d) {
			return
		}
	default:
		return
	}
	b.moveTo(Open, ReasonRetryAfter, n, now, d, ev)
}

// Transition moves the breaker to state to at an operator's request (admin API). Every
// transition starts a new generation and a fresh stay in the state, even to the current state:
// CLOSED resets the window (Resilience4j's reset), OPEN restarts the wait and counts as a
// further opening, HALF_OPEN hands out fresh probe permits, METRICS_ONLY starts a fresh window.
// As in Resilience4j, CLOSED cannot go straight to HALF_OPEN, nor METRICS_ONLY to OPEN or
// HALF_OPEN; those return ErrIllegalTransition. Safe for concurrent use.
func (b *Breaker) Transition(to State, now time.Time) error {
	if !to.valid() {
		return fmt.Errorf("breaker %q: cannot move to unknown state %s", b.name, to)
	}
	var ev pending
	err := b.transitionLocked(to, now, &ev)
	b.emit(&ev)
	return err
}

func (b *Breaker) transitionLocked(to State, now time.Time, ev *pending) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.tick(now)
	b.advance(n, now, false, ev)
	switch {
	case b.state == Closed && to == HalfOpen:
		return fmt.Errorf("%w: breaker %q cannot move from CLOSED to HALF_OPEN: probes test a provider after an opening; move it to OPEN first", ErrIllegalTransition, b.name)
	case b.state == MetricsOnly && (to == Open || to == HalfOpen):
		return fmt.Errorf("%w: breaker %q cannot move from METRICS_ONLY to %s: a breaker that was only observing must start enforcing from CLOSED, with a fresh window", ErrIllegalTransition, b.name, to)
	}
	b.moveTo(to, ReasonForced, n, now, 0, ev)
	return nil
}

// Reconfigure applies new settings after a configuration reload, as of now. The state, its
// generation and the outstanding permits are kept. The CLOSED/METRICS_ONLY window is kept when
// sliding_window_type and sliding_window_size are unchanged; otherwise it starts empty, in the
// same state. The probe window is kept when permitted_calls_in_half_open is unchanged; otherwise
// it starts empty and, in HALF_OPEN, the probing restarts (a new generation, event reason
// "reconfigured") so the new probe count applies. Thresholds, minimum calls and the slow-call
// duration apply from the next recorded call; the half-open time limit applies at once; a wait
// in OPEN already running keeps its end. It returns the Validate errors and changes nothing if
// cfg is invalid. Safe for concurrent use.
func (b *Breaker) Reconfigure(cfg Config, now time.Time) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("breaker %q: %w", b.name, err)
	}
	var ev pending
	b.reconfigureLocked(cfg, now, &ev)
	b.emit(&ev)
	return nil
}

func (b *Breaker) reconfigureLocked(cfg Config, now time.Time, ev *pending) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.tick(now)
	b.advance(n, now, false, ev)
	old := b.cfg
	b.cfg = cfg
	if old.WindowType != cfg.WindowType || old.WindowSize != cfg.WindowSize {
		b.closedWin = newWindow(cfg.WindowType, cfg.WindowSize, b.second(n))
	}
	if old.PermittedCallsInHalfOpen != cfg.PermittedCallsInHalfOpen {
		b.probeWin = newWindow(CountBased, cfg.PermittedCallsInHalfOpen, 0)
		if b.state == HalfOpen {
			b.moveTo(HalfOpen, ReasonReconfigured, n, now, 0, ev)
		}
	}
}

// RemainingOpen returns how long the breaker will still refuse calls before probes are
// allowed, for a retry-after: the rest of the wait in OPEN, 0 when the wait is over or the
// breaker is not OPEN. FORCED_OPEN has no end and reports 0; the caller picks its own
// retry-after. It takes no lock. Safe for concurrent use.
func (b *Breaker) RemainingOpen(now time.Time) time.Duration {
	if b.State() != Open {
		return 0
	}
	n := int64(now.Sub(b.epoch))
	if h := b.hwm.Load(); n < h {
		n = h
	}
	if r := b.openUntil.Load() - n; r > 0 {
		return time.Duration(r)
	}
	return 0
}

// Snapshot returns the state and window as of now, applying the timed transitions that are due:
// HALF_OPEN back to OPEN after max_wait_in_half_open, and OPEN to HALF_OPEN after the wait when
// AutomaticTransition is on. Safe for concurrent use.
func (b *Breaker) Snapshot(now time.Time) Snapshot {
	var ev pending
	s := b.snapshotLocked(now, &ev)
	b.emit(&ev)
	return s
}

func (b *Breaker) snapshotLocked(now time.Time, ev *pending) Snapshot {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.tick(now)
	b.advance(n, now, false, ev)
	s := Snapshot{
		Name:                b.name,
		State:               b.state,
		Generation:          b.gen,
		NotPermittedCalls:   b.notPerm.Load(),
		EnteredAt:           b.enteredAt,
		ConsecutiveOpenings: b.attempts,
	}
	t, minimum := b.window(n)
	s.FailureRate, s.SlowRate = t.rates(minimum)
	s.BufferedCalls = int(t.calls)
	s.FailedCalls = int(t.failed)
	s.SuccessfulCalls = int(t.calls - t.failed)
	s.SlowCalls = int(t.slow)
	s.SlowFailedCalls = int(t.slowFailed)
	switch b.state {
	case Open:
		s.WaitRemaining = time.Duration(max(b.until-n, 0))
	case HalfOpen:
		s.ProbesRemaining = b.permits
	}
	return s
}

// window returns the totals of the reported window as of internal time n and the minimum calls
// that apply to it.
func (b *Breaker) window(n int64) (totals, int) {
	switch b.cur {
	case &b.closedWin:
		return b.closedWin.totalsAt(b.second(n)), b.cfg.MinimumCalls
	case &b.probeWin:
		return b.probeWin.sum, b.cfg.probeMinimum()
	default:
		return totals{}, 1
	}
}

// tick converts now to internal nanoseconds and advances the high-water mark. An instant
// before the mark (a clock that went backwards, or callers racing with slightly different
// instants) is treated as the mark: no time has passed.
func (b *Breaker) tick(now time.Time) int64 {
	n := int64(now.Sub(b.epoch))
	if n <= b.clock {
		return b.clock
	}
	b.clock = n
	if b.state == Open {
		b.hwm.Store(n)
	}
	return n
}

// second is the epoch-aligned second, relative to epoch's second, of internal time n (≥ 0).
func (b *Breaker) second(n int64) int64 {
	const s = int64(time.Second)
	return n/s + (n%s+b.epochFrac)/s
}

// advance applies the timed transitions that are due at internal time n: HALF_OPEN times out
// after max_wait_in_half_open; OPEN moves to HALF_OPEN strictly after its wait when a call
// wants a permit (acquiring) or AutomaticTransition is on. The instant the transition is noticed
// is the instant it takes effect, so a wait in OPEN that follows a half-open timeout starts now.
func (b *Breaker) advance(n int64, now time.Time, acquiring bool, ev *pending) {
	switch b.state {
	case HalfOpen:
		if mw := int64(b.cfg.MaxWaitInHalfOpen); mw > 0 && n-b.enteredN >= mw {
			b.moveTo(Open, ReasonHalfOpenTimeout, n, now, 0, ev)
		}
	case Open:
		if (acquiring || b.cfg.AutomaticTransition) && n > b.until {
			b.moveTo(HalfOpen, ReasonWaitElapsed, n, now, 0, ev)
		}
	}
}

// moveTo enters state to at internal time n, starting a new generation, and queues the event.
// openFor > 0 opens for exactly that long without counting a further opening (OpenFor);
// otherwise OPEN waits according to the backoff.
func (b *Breaker) moveTo(to State, reason Reason, n int64, now time.Time, openFor time.Duration, ev *pending) {
	from := b.state
	t, minimum := b.window(n)
	fr, sr := t.rates(minimum)

	b.gen++
	switch to {
	case Closed:
		b.attempts = 0
		b.closedWin.reset(b.second(n))
		b.cur = &b.closedWin
	case MetricsOnly:
		b.attempts = 0
		b.closedWin.reset(b.second(n))
		b.cur = &b.closedWin
		b.exceeded = [2]bool{}
	case Open:
		if openFor > 0 {
			b.until = satAdd(n, openFor)
		} else {
			b.attempts++
			b.until = satAdd(n, b.cfg.waitInOpen(b.attempts))
		}
		// OPEN keeps the window of the state it came from.
		b.openUntil.Store(b.until)
		b.hwm.Store(b.clock)
	case HalfOpen:
		b.probeWin.reset(0)
		b.permits = b.cfg.PermittedCallsInHalfOpen
		b.cur = &b.probeWin
	case Disabled:
		b.attempts = 0
		b.cur = nil
	case ForcedOpen:
		b.attempts++
		b.cur = nil
	}
	b.state = to
	b.enteredAt = now
	b.enteredN = n
	b.notPerm.Store(0)
	b.word.Store(b.gen<<8 | uint64(to))
	b.raise(Event{Kind: EventTransition, Name: b.name, From: from, To: to, Reason: reason,
		FailureRate: fr, SlowRate: sr, Generation: b.gen, At: now}, ev)
}

// raise keeps e in the history and queues it for the listener. The caller holds the lock.
func (b *Breaker) raise(e Event, ev *pending) {
	b.hist.event(e)
	ev.add(e)
}

// emit delivers queued events to the listener, outside the lock.
func (b *Breaker) emit(ev *pending) {
	if ev.n == 0 {
		return
	}
	l := b.listener.Load()
	if l == nil {
		return
	}
	for i := range ev.n {
		(*l)(ev.ev[i])
	}
}

// satAdd adds a non-negative duration to internal time n, saturating instead of overflowing.
func satAdd(n int64, d time.Duration) int64 {
	if int64(d) > math.MaxInt64-n {
		return math.MaxInt64
	}
	return n + int64(d)
}
