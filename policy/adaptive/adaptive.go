// Package adaptive learns a compartment's concurrency limit from how an LLM provider answers:
// the time to first token for a given prompt size (queueing and prefill at the provider), the
// time between streamed tokens (decode load), and upstream 429, 503 and timeouts.
//
// Whole-request latency, which general-purpose adaptive limiters read, mostly measures how long
// an answer is; this package never looks at it. A long answer with a normal decode speed leaves
// the limit alone.
//
// The algorithm is a gradient on LLM signals. Each observation of a request (its first token,
// its end) is a Sample. Every Settings.Interval, once a window holds MinSamples samples of one
// signal, the controller takes the window's median time to first token over its prompt size
// class's no-load baseline and its median inter-token latency over that baseline. The larger
// ratio r decides:
//
//   - upstream back-off (429, 503, timeouts) in the window: limit × (1 − f/2), f the share of
//     the window's requests that got one (a storm halves the limit per interval);
//   - r > Tolerance: limit × (1 − (1 − Tolerance/r)/2) below r = 2 × Tolerance, limit ×
//     Tolerance/r above, at most halving it;
//   - otherwise, when the limit was saturated (a request was admitted at the limit, or queued)
//     and the window's 90th percentile TTFB ratio is within Tolerance too: limit + max(1,
//     limit/20), the step doubling with each window in a row that raises it while the limit
//     is below the highest one congestion ever cut (so a capacity that came back is found in
//     a few windows, and a limit at the capacity probes one step beyond it), except that a
//     run below the limit the latest cut fell from stops there first;
//   - otherwise the limit holds.
//
// Between windows, the controller follows the requests still waiting for their first token
// (Start, Finish): one that has waited more than Tolerance times its class's baseline, scaled
// to its prompt, is queued at the provider. When requests newly turn out queued (at least one,
// or a tenth of the limit) while the limit is in full use, the limit drops at once to the
// requests in flight that are not queued, the provider's apparent concurrency, but never
// below half of what it was an Interval earlier; within an Interval of such a cut it cuts
// again only when more requests are queued than the cut found. A brownout is thus seen while
// the first requests it catches are still waiting, not once they have answered, and a probe
// one request above the capacity costs one cut, not two.
//
// Requests admitted before the limit last fell are ignored (they ran under a higher limit),
// unless their first token took more than twice as long as those the cut answered; those
// admitted under a lower limit than the one in force count towards cuts but only requests
// admitted since the last change let the limit grow. The median makes one slow
// request unable to move a window; the half step for a mild excess damps the oscillation
// around the capacity.
//
// Baselines fall a quarter of the way to any window median below them and never rise on their
// own: every Settings.RemeasureInterval the controller holds the limit at Min until
// ProbeSamples requests admitted at that level produce their first token, and their medians
// rescale the baselines (as Envoy's gradient controller re-measures its minimum RTT). A
// baseline therefore cannot drift upward with sustained load; it rises only when the provider
// is measured slower with almost nothing in flight. A limit held at Min for pinnedWindows
// windows with latency beyond tolerance starts a re-measurement at once. The first baseline is
// the lower quartile of the first window: of a burst admitted at once, the earliest requests
// found the provider idle.
//
// Stalls of this process (a CPU-throttled container, a loaded machine, a long garbage
// collection) are not the provider's: a first token that reached the socket during a stall is
// processed at its end, as if it had just come, and every request waiting across it would look
// queued. Start, Observe and Finish take the process's cumulative stalled time with the current
// time; a wait is judged, and a time to first token counted, without the stalled time that
// overlapped it. A time to first token the process stalled during is only known to lie within
// the stall: the baselines take its upper bound.
//
// The package is pure: it starts no goroutines and reads no clock. Every method takes the
// current time and the stalled time, so tests drive it with a simulated provider.
//
// Imports: only the standard library. Imported by: package policy (which runs one controller
// per adaptive compartment) and policy/observe (which reads its State).
package adaptive

// The limiter is one controller — its signals, baselines, moves and the state it reports — kept
// in one file so that each decision can be read beside the state it reads.

import (
	"math"
	"math/bits"
	"slices"
	"sync"
	"time"
)

// Settings configure a Controller.
type Settings struct {
	// Min and Max bound the limit; Initial is where it starts.
	Min, Max, Initial int64
	// Tolerance is the latency ratio over the baseline still taken as healthy (> 1).
	Tolerance float64
	// Interval is how often the limit is recomputed.
	Interval time.Duration
	// RemeasureInterval is how often the baselines are measured again.
	RemeasureInterval time.Duration
}

// Tuning constants, documented in docs/adaptive.md.
const (
	// MinSamples is the fewest samples of one signal a window needs before it moves the limit
	// (or observations, for a window with upstream back-offs).
	MinSamples = 5
	// ProbeSamples is how many requests admitted during a re-measurement make the baseline.
	ProbeSamples = 5
	// PromptUnit normalises time to first token within a prompt size class: a request's TTFB
	// is divided by 1 + prompt tokens / PromptUnit.
	PromptUnit = 1000
	// sizeClasses is the number of prompt size classes: under 256 tokens, then each doubling
	// up to 16384 and more. Each class has a TTFB baseline of its own.
	sizeClasses = 8
	// windowCap bounds the samples a window keeps per signal (the latest win).
	windowCap = 64
	// growFraction is the additive increase, as a share of the limit (at least 1).
	growFraction = 0.05
	// pinnedWindows is how many consecutive windows at min with latency beyond tolerance
	// trigger a re-measurement of the baselines.
	pinnedWindows = 3
	// trackCap is how many requests waiting for their first token a controller follows; those
	// admitted while as many wait are counted in flight only.
	trackCap = 256
)

// Sample is one observation of a request of the compartment: its first token, or its end.
type Sample struct {
	// Admitted is when the request got its slot.
	Admitted time.Time
	// TTFB is admission to the first token; 0 when not observed here.
	TTFB time.Duration
	// PromptTokens is the request's estimated prompt size.
	PromptTokens int64
	// InterToken is the mean time between tokens after the first, for a streamed response
	// with at least two tokens; 0 otherwise.
	InterToken time.Duration
	// Backoff: the provider said to back off (429, 503) or did not answer in time.
	Backoff bool
	// Saturated: the limit was reached, or requests waited, while the request was admitted.
	Saturated bool
	// Handle is the request's handle from Start (0 when it was not started). With a TTFB it
	// ends the request's wait for its first token.
	Handle Handle
	// Stalled is how long this process was stalled between the admission and the first token
	// (the growth of the stalled time given to Start and Observe): TTFB less Stalled is
	// judged, the whole TTFB (an upper bound) moves the baselines down, and only a TTFB with
	// no stall counts in a re-measurement.
	Stalled time.Duration
}

// Handle identifies a request from Start to Finish; 0 is none.
type Handle uint64

// untracked is the handle of a request counted in flight but not followed to its first token
// (its first token is not observed as it comes, or trackCap requests were waiting for theirs).
const untracked Handle = 1 << 63

// waiter is a request waiting for its first token.
type waiter struct {
	admitted int64   // Unix nanoseconds
	stalled  int64   // the process's stalled nanoseconds at admission
	expect   float64 // 1 + prompt tokens / PromptUnit: its TTFB is expect × its class's baseline
	class    uint8
	state    uint8 // waiting, queued or gone
}

const (
	waiting uint8 = iota
	queued
	gone
)

// Cause says why the limit moved down.
type Cause uint8

// Causes of a decrease.
const (
	// CauseLatency: a signal was beyond tolerance.
	CauseLatency Cause = iota
	// CauseUpstream: the provider returned 429 or 503, or did not answer.
	CauseUpstream
)

// State is a point-in-time view of a controller.
type State struct {
	// Limit is the limit in force (Min while re-measuring).
	Limit int64
	// Learned is the limit the algorithm holds (what Limit returns to after a re-measurement).
	Learned float64
	// BaselineTTFB is the no-load time to first token of the most common prompt size class,
	// normalised (TTFB / (1 + prompt tokens / PromptUnit)); BaselineInterToken the no-load
	// time between tokens. 0 until known.
	BaselineTTFB, BaselineInterToken time.Duration
	// TTFB is the last window's median TTFB ratio to its class's baseline, times
	// BaselineTTFB; InterToken the last window's median inter-token latency.
	TTFB, InterToken time.Duration
	// Ratio is the last window's larger signal over its baseline.
	Ratio float64
	// Remeasuring reports a baseline re-measurement in progress.
	Remeasuring bool
	// Decreases counts the limit's cuts by cause; Increases its raises.
	Decreases [2]uint64
	Increases uint64
	// Windows counts the windows that were evaluated.
	Windows uint64
}

// Controller learns one compartment's limit. Safe for concurrent use.
type Controller struct {
	mu sync.Mutex
	s  Settings

	limit float64
	// changedAt is when the limit in force last changed, decreasedAt when it last fell.
	// Requests admitted before decreasedAt ran under a higher limit and say nothing about the
	// one in force; those admitted between the two ran under a lower one, so their congestion
	// counts (it can only be worse now) but their good latency does not prove the higher
	// limit healthy: only requests admitted since changedAt let the limit grow.
	changedAt, decreasedAt time.Time

	// The current window: observations, back-offs, saturation; per signal, the samples.
	windowStart time.Time
	count       int
	backoffs    int
	saturated   bool
	// ttfbRatio holds each TTFB over its class's baseline; class the normalised TTFBs of each
	// class, for the baselines.
	ttfbRatio ring
	class     [sizeClasses]ring
	itl       ring
	// staleRatio and staleITL hold the samples of requests admitted under a lower limit.
	staleRatio, staleITL ring

	baseTTFB  [sizeClasses]float64 // seconds, normalised; 0 until known
	classSeen [sizeClasses]uint64
	baseITL   float64

	// Re-measurement.
	probing    bool
	probeStart time.Time
	nextProbe  time.Time
	probeRatio ring
	probeClass [sizeClasses]ring
	probeITL   ring
	probeCount int

	lastTTFBRatio, lastITL, lastRatio float64
	// lastITLRatio is the latest window's inter-token latency over its baseline.
	lastITLRatio float64
	// pinned counts consecutive windows that ended at min with latency beyond tolerance.
	pinned int

	decreases          [2]uint64
	increases, windows uint64

	// The requests in flight (Start to Finish), and those of them waiting for their first
	// token: waiters[seq % trackCap] for head <= seq < tail, in admission order.
	inflight   int
	waiters    [trackCap]waiter
	head, tail uint64
	// queuedNow counts the waiters judged queued at the provider; queuedSeen says a request was
	// judged queued during the window (the limit then does not grow). floorLimit is the limit
	// at floorSince: within an Interval of it the queue rule cuts to no less than half of it.
	queuedNow  int
	queuedSeen bool
	floorLimit float64
	floorSince time.Time
	// cutAt is when the queue rule last cut the limit, cutQueued how many requests it then
	// found queued: within an Interval it cuts again only for a longer queue.
	cutAt     time.Time
	cutQueued int
	// growRun counts the windows in a row that raised the limit. ceiling is the highest limit
	// congestion ever made fall: below it each raise of a run is twice the one before (up to
	// it), above it every raise is one step.
	growRun int
	ceiling float64
	// lastCut is the limit the latest cut fell from: a run of raises below it stops there, so
	// that a limit climbing back probes one step above the capacity it last found, not a
	// doubled step.
	lastCut float64

	scratch [2 * windowCap]float64
}

// New returns a controller at s.Initial, its first window starting at now.
func New(s Settings, now time.Time) *Controller {
	c := &Controller{s: s, limit: float64(s.Initial), windowStart: now}
	c.nextProbe = now.Add(s.RemeasureInterval)
	return c
}

// Settings returns the controller's settings.
func (c *Controller) Settings() Settings { return c.s }

// Limit returns the limit in force.
func (c *Controller) Limit() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.current()
}

func (c *Controller) current() int64 {
	if c.probing {
		return c.s.Min
	}
	return min(max(int64(c.limit), c.s.Min), c.s.Max)
}

// SetLimit puts n in force as the learned limit (within Min and Max): a limit learned elsewhere
// too (a fleet of replicas learns one limit, each proposing its own moves). Requests admitted
// before a lower limit ran under a higher one, as after a cut of the controller's own.
func (c *Controller) SetLimit(now time.Time, n int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v := float64(min(max(n, c.s.Min), c.s.Max))
	if v == c.limit {
		return
	}
	if v < c.limit {
		c.decreasedAt = now
	}
	c.limit, c.changedAt = v, now
}

// sizeClass returns the prompt size class of a prompt of n tokens.
func sizeClass(n int64) int {
	return min(bits.Len64(uint64(max(n, 0))/256), sizeClasses-1)
}

// Observe records an observation at now, when the process had been stalled for stalled in
// all (never less than the stalled time given to an earlier call), and returns the limit in
// force afterwards. It does not allocate.
func (c *Controller) Observe(now time.Time, stalled time.Duration, x Sample) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.scan(now, stalled)
	if x.TTFB > 0 && c.release(x.Handle) == queued {
		// Its wait was counted while it lasted (the queue rule answered it): its time to
		// first token is not counted a second time.
		x.TTFB = 0
		if x.InterToken == 0 && !x.Backoff {
			return c.current()
		}
	}
	// A TTFB the process stalled during is judged without the stall, but the first token may
	// have come at any moment of it: the TTFB is only known within the stall's length. The
	// baselines take it whole, an upper bound: one that is lower still proves the provider
	// faster, and a first baseline learned through a loaded machine's frequent stalls is the
	// provider's speed, not only what the queued requests' exact samples show.
	// A re-measurement may raise the baselines: it takes exact TTFBs only.
	bound, exact := x.TTFB, x.Stalled <= 0
	if !exact {
		x.TTFB = max(x.TTFB-x.Stalled, 0)
	}
	fresh := c.probing || !x.Admitted.Before(c.changedAt)
	if !c.probing && x.Admitted.Before(c.decreasedAt) {
		// Admitted under a higher limit: it says nothing about the limit in force, and the
		// congestion it met was answered by the cut.
		return c.current()
	}
	c.count++
	if x.Backoff {
		c.backoffs++
	}
	if x.Saturated && fresh {
		c.saturated = true
	}
	cls, ttfb, ratio := 0, 0.0, 0.0
	if x.TTFB > 0 && !x.Backoff {
		cls = sizeClass(x.PromptTokens)
		scale := 1 + float64(max(x.PromptTokens, 0))/PromptUnit
		ttfb = x.TTFB.Seconds() / scale
		c.class[cls].add(bound.Seconds() / scale)
		c.classSeen[cls]++
		if b := c.baseTTFB[cls]; b > 0 {
			ratio = ttfb / b
			if fresh {
				c.ttfbRatio.add(ratio)
			} else {
				c.staleRatio.add(ratio)
			}
		}
	}
	itl := x.InterToken.Seconds()
	if itl > 0 {
		if fresh {
			c.itl.add(itl)
		} else {
			c.staleITL.add(itl)
		}
	}
	if c.probing {
		if !exact {
			ttfb, ratio = 0, 0
		}
		c.probe(now, x, cls, ttfb, ratio, itl)
		return c.current()
	}
	if now.Sub(c.windowStart) >= c.s.Interval && c.ready() {
		before := c.current()
		c.evaluate()
		if after := c.current(); after != before {
			c.changedAt = now
			if after < before {
				c.decreasedAt = now
			}
		}
		c.reset(now)
		if c.baseline() > 0 && (!now.Before(c.nextProbe) || c.pinned >= pinnedWindows) {
			c.probing, c.probeStart = true, now
			c.changedAt, c.decreasedAt = now, now
			c.probeRatio.clear()
			c.probeITL.clear()
			for i := range c.probeClass {
				c.probeClass[i].clear()
			}
			c.probeCount = 0
			c.pinned = 0
		}
	}
	return c.current()
}

// Start records that a request was admitted at now (the process's stalled time then being
// stalled), with an estimated prompt of promptTokens, and returns its handle for Observe and
// Finish. When follow is set (the request's first token
// will be observed as it comes, as for a streamed answer) the controller follows its wait: a
// request waiting longer than Tolerance times its no-load time to first token is queued at
// the provider, which the controller knows without waiting for the token. It does not
// allocate.
func (c *Controller) Start(now time.Time, stalled time.Duration, promptTokens int64, follow bool) Handle {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.inflight++
	if !follow || c.tail-c.head >= trackCap {
		return untracked
	}
	c.waiters[c.tail%trackCap] = waiter{
		admitted: now.UnixNano(),
		stalled:  int64(stalled),
		expect:   1 + float64(max(promptTokens, 0))/PromptUnit,
		class:    uint8(sizeClass(promptTokens)),
	}
	c.tail++
	return Handle(c.tail)
}

// Finish records the end of the request h (whatever its outcome) at now, the process's stalled
// time then being stalled, and returns the limit in force afterwards. Every handle Start
// returned must be finished once. It does not allocate.
func (c *Controller) Finish(now time.Time, stalled time.Duration, h Handle) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if h == 0 {
		return c.current()
	}
	c.inflight--
	c.release(h)
	c.scan(now, stalled)
	return c.current()
}

// release ends h's wait for its first token and returns the state it had.
func (c *Controller) release(h Handle) uint8 {
	if h == 0 || h&untracked != 0 {
		return gone
	}
	seq := uint64(h) - 1
	if seq < c.head || seq >= c.tail {
		return gone
	}
	w := &c.waiters[seq%trackCap]
	st := w.state
	if st == queued {
		c.queuedNow--
	}
	w.state = gone
	for c.head < c.tail && c.waiters[c.head%trackCap].state == gone {
		c.head++
	}
	return st
}

// scan judges the requests still waiting for their first token: one that has waited more than
// Tolerance times its class's baseline (scaled to its prompt), not counting the time the
// process was stalled since it was admitted, is queued at the provider. When
// requests newly turn out queued while the limit is saturated, the queue rule puts the limit
// at the number of requests in flight that are not queued, the provider's apparent
// concurrency, but within an Interval never below half the limit it started from.
func (c *Controller) scan(now time.Time, stalled time.Duration) {
	if c.probing || c.head == c.tail {
		return
	}
	floorBase := 0.0
	for _, b := range c.baseTTFB {
		if b > 0 && (floorBase == 0 || b < floorBase) {
			floorBase = b
		}
	}
	if floorBase == 0 {
		return
	}
	t, st := now.UnixNano(), int64(stalled)
	newly := 0
	for seq := c.head; seq < c.tail; seq++ {
		w := &c.waiters[seq%trackCap]
		// The process cannot have been stalled longer than the time that passed, so a later
		// admission has waited no longer than an earlier one.
		waited := float64(t-w.admitted-max(st-w.stalled, 0)) / 1e9
		if waited <= c.s.Tolerance*floorBase {
			break // it and every later admission waited less than any threshold
		}
		if w.state != waiting {
			continue
		}
		if b := c.baseTTFB[w.class]; b > 0 && waited > c.s.Tolerance*b*w.expect {
			w.state = queued
			c.queuedNow++
			newly++
		}
	}
	if newly == 0 {
		return
	}
	c.queuedSeen = true
	if c.queuedNow < max(1, int(c.limit/10)) || int64(c.inflight) < c.current() {
		return
	}
	if now.Sub(c.cutAt) < c.s.Interval && c.queuedNow <= c.cutQueued {
		// Within an Interval of a cut, the queue is no longer than the cut found it: a request
		// found queued since (one admitted under the higher limit that reached its threshold
		// later, as another left the queue) is the congestion the cut answered, not more of it.
		return
	}
	if now.Sub(c.floorSince) >= c.s.Interval {
		c.floorLimit, c.floorSince = c.limit, now
	}
	target := max(float64(c.inflight-c.queuedNow), c.floorLimit/2, float64(c.s.Min))
	if target >= c.limit {
		return
	}
	before := c.current()
	c.ceiling, c.lastCut = max(c.ceiling, c.limit), c.limit
	c.limit, c.growRun = target, 0
	c.cutAt, c.cutQueued = now, c.queuedNow
	c.decreases[CauseLatency]++
	if after := c.current(); after != before {
		c.changedAt, c.decreasedAt = now, now
		// The window's samples came from requests admitted under the higher limit: they
		// say nothing about the new one, and the congestion they show was just answered.
		c.reset(now)
		c.queuedSeen = true
	}
}

// ready reports whether the window has enough to judge: MinSamples of one signal (or of
// TTFBs of any class, while baselines are still unknown), or back-offs among MinSamples
// observations.
func (c *Controller) ready() bool {
	if c.ttfbRatio.n >= MinSamples || c.itl.n >= MinSamples {
		return true
	}
	// Requests admitted under a lower limit close a window early when they show congestion.
	if c.ttfbRatio.n+c.staleRatio.n >= MinSamples && c.quantile2(&c.ttfbRatio, &c.staleRatio, 0.5) > c.s.Tolerance {
		return true
	}
	if c.baseITL > 0 && c.itl.n+c.staleITL.n >= MinSamples && c.quantile2(&c.itl, &c.staleITL, 0.5)/c.baseITL > c.s.Tolerance {
		return true
	}
	if c.backoffs > 0 && c.count >= MinSamples {
		return true
	}
	n := 0
	for i := range c.class {
		n += c.class[i].n
	}
	return n >= MinSamples
}

// probe handles an observation during a re-measurement: only requests admitted after it
// started ran at the low limit and count. It ends after ProbeSamples of them, or, when traffic
// is too thin to bring them, after ten intervals or 30s (whichever is longer) without new
// baselines.
func (c *Controller) probe(now time.Time, x Sample, cls int, ttfb, ratio, itl float64) {
	if !x.Admitted.Before(c.probeStart) {
		if ttfb > 0 {
			c.probeCount++
			c.probeClass[cls].add(ttfb)
			if ratio > 0 {
				c.probeRatio.add(ratio)
			}
		}
		if itl > 0 {
			c.probeITL.add(itl)
		}
	}
	done := c.probeCount >= ProbeSamples
	if !done && now.Sub(c.probeStart) < max(10*c.s.Interval, 30*time.Second) {
		return
	}
	if done {
		// Every class's baseline moves by the factor measured; classes measured for the
		// first time take their median.
		if f := c.quantile(&c.probeRatio, 0.5); f > 0 {
			for i := range c.baseTTFB {
				c.baseTTFB[i] *= f
			}
		}
		for i := range c.probeClass {
			if c.baseTTFB[i] == 0 {
				c.baseTTFB[i] = c.quantile(&c.probeClass[i], 0.5)
			}
		}
		if m := c.quantile(&c.probeITL, 0.5); m > 0 {
			c.baseITL = m
		}
	}
	c.probing = false
	c.changedAt = now
	c.nextProbe = now.Add(c.s.RemeasureInterval)
	c.reset(now)
}

func (c *Controller) reset(now time.Time) {
	c.windowStart = now
	c.count, c.backoffs, c.saturated, c.queuedSeen = 0, 0, false, false
	c.ttfbRatio.clear()
	c.itl.clear()
	c.staleRatio.clear()
	c.staleITL.clear()
	for i := range c.class {
		c.class[i].clear()
	}
}

// evaluate moves the limit from the window that just closed.
func (c *Controller) evaluate() {
	c.windows++
	// Signals are judged against the baselines known before this window.
	// r, the median over every sample that counts, decides cuts; growth needs requests
	// admitted under the limit in force, their slowest tenth of first tokens within tolerance
	// too, so that a limit with a request or two queued at the provider holds rather than grows.
	r, judged, grow := 0.0, false, false
	if c.ttfbRatio.n+c.staleRatio.n >= 3 {
		m := c.quantile2(&c.ttfbRatio, &c.staleRatio, 0.5)
		c.lastTTFBRatio, r, judged = m, m, true
	}
	if c.ttfbRatio.n >= 3 {
		grow = c.quantile(&c.ttfbRatio, 0.5) <= c.s.Tolerance && c.quantile(&c.ttfbRatio, 0.9) <= c.s.Tolerance
	}
	mITL := c.quantile2(&c.itl, &c.staleITL, 0.5)
	if mITL > 0 {
		c.lastITL = mITL
	}
	// Inter-token latencies come only as answers end, often in fewer windows than first
	// tokens: a slow decode seen in an earlier window holds the limit (no growth) until
	// answers since show the decode again.
	if c.itl.n+c.staleITL.n >= 3 && c.baseITL > 0 {
		c.lastITLRatio = mITL / c.baseITL
		r, judged = max(r, c.lastITLRatio), true
	}
	if c.lastITLRatio > c.s.Tolerance {
		grow = false
	}
	// Baselines: the first is the lower quartile of the first window that measures it (of a
	// burst, the earliest requests found the provider idle); later they only fall, a quarter
	// of the way to a window median below them, so that one window of noise cannot drag them
	// down.
	for i := range c.class {
		if c.class[i].n == 0 {
			continue
		}
		if c.baseTTFB[i] == 0 {
			c.baseTTFB[i] = c.quantile(&c.class[i], 0.25)
		} else {
			c.baseTTFB[i] = fall(c.baseTTFB[i], c.quantile(&c.class[i], 0.5))
		}
	}
	if c.itl.n > 0 {
		if c.baseITL == 0 {
			c.baseITL = c.quantile(&c.itl, 0.25)
		} else {
			c.baseITL = fall(c.baseITL, mITL)
		}
	}
	if judged {
		c.lastRatio = r
	}
	lo, hi := float64(c.s.Min), float64(c.s.Max)
	raised := false
	switch {
	case c.backoffs > 0:
		c.ceiling, c.lastCut = max(c.ceiling, c.limit), c.limit
		f := float64(c.backoffs) / float64(c.count)
		c.limit = max(lo, c.limit*(1-f/2))
		c.decreases[CauseUpstream]++
	case judged && r > c.s.Tolerance:
		// Half the gradient when the excess is mild (it damps oscillation around the
		// capacity); the whole of it, at most halving, when the provider's queue is long.
		c.ceiling, c.lastCut = max(c.ceiling, c.limit), c.limit
		g := c.s.Tolerance / r
		if r < 2*c.s.Tolerance {
			g = 1 - (1-g)/2
		}
		c.limit = max(lo, c.limit*max(g, 0.5))
		c.decreases[CauseLatency]++
	case grow && c.saturated && !c.queuedSeen && c.queuedNow == 0 && c.limit < hi:
		// One step (5%, at least 1) at or above the highest limit congestion ever cut: a limit
		// at the capacity probes one step beyond it and falls back. Below that level the step
		// doubles with each window in a row that raises it, up to the level: a provider whose
		// capacity came back is found within a few windows, while one still short stops the
		// run at its first step (the probe queues, and the cut ends the run).
		step := max(1, c.limit*growFraction)
		if c.limit < c.ceiling {
			step = max(step, min(step*float64(uint(1)<<min(c.growRun, 8)), c.ceiling-c.limit))
		}
		if c.limit < c.lastCut {
			step = min(step, max(1, c.lastCut-c.limit))
		}
		c.limit = min(hi, c.limit+step)
		c.increases++
		raised = true
	}
	switch {
	case raised:
		c.growRun++
	case (judged && !grow) || c.backoffs > 0 || c.queuedSeen || c.queuedNow > 0:
		// A window that held the limit on evidence (latency, a request queued at the
		// provider) ends the run; one that had nothing to judge leaves it.
		c.growRun = 0
	}
	c.limit = min(max(c.limit, lo), hi)
	// Pinned at min with latency still beyond tolerance: the traffic here no longer explains
	// the latency, so the baselines are suspect (the provider became slower, or a baseline
	// fell on noise). Measure them again now rather than at the next remeasure interval.
	if judged && r > c.s.Tolerance && c.limit <= lo {
		c.pinned++
	} else {
		c.pinned = 0
	}
}

// fall moves a baseline a quarter of the way down to a lower median; never up.
func fall(base, m float64) float64 {
	if m > 0 && m < base {
		return base - (base-m)/4
	}
	return base
}

// baseline returns the TTFB baseline of the most common prompt size class (0 when none).
func (c *Controller) baseline() float64 {
	best := -1
	for i, b := range c.baseTTFB {
		if b > 0 && (best < 0 || c.classSeen[i] > c.classSeen[best]) {
			best = i
		}
	}
	if best < 0 {
		return 0
	}
	return c.baseTTFB[best]
}

// quantile returns the q-quantile of r's values (0 when empty). It sorts a copy in the
// controller's scratch space, so it does not allocate.
func (c *Controller) quantile(r *ring, q float64) float64 {
	return c.quantile2(r, &noValues, q)
}

// noValues is an empty ring, for quantile.
var noValues ring

// quantile2 is quantile over the values of a and b together.
func (c *Controller) quantile2(a, b *ring, q float64) float64 {
	n := copy(c.scratch[:], a.values())
	n += copy(c.scratch[n:], b.values())
	if n == 0 {
		return 0
	}
	v := c.scratch[:n]
	slices.Sort(v)
	return v[int(math.Round(q*float64(n-1)))]
}

// State returns a point-in-time view.
func (c *Controller) State() State {
	c.mu.Lock()
	defer c.mu.Unlock()
	base := c.baseline()
	return State{
		Limit: c.current(), Learned: c.limit,
		BaselineTTFB: seconds(base), BaselineInterToken: seconds(c.baseITL),
		TTFB: seconds(c.lastTTFBRatio * base), InterToken: seconds(c.lastITL), Ratio: c.lastRatio,
		Remeasuring: c.probing, Decreases: c.decreases, Increases: c.increases, Windows: c.windows,
	}
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// ring keeps the latest windowCap values of a window.
type ring struct {
	buf  [windowCap]float64
	n    int
	next int
}

func (r *ring) add(v float64) {
	r.buf[r.next] = v
	r.next = (r.next + 1) % windowCap
	if r.n < windowCap {
		r.n++
	}
}

func (r *ring) clear() { r.n, r.next = 0, 0 }

func (r *ring) values() []float64 { return r.buf[:r.n] }
