package policy

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/adaptive"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// adaptiveLimit is the learned concurrency limit of one compartment with
// `max_concurrent: adaptive`. It outlives snapshots: a reload that keeps the compartment and its
// adaptive settings keeps it, and with it what was learned.
type adaptiveLimit struct {
	cfg   config.AdaptiveLimit
	ctl   *adaptive.Controller
	c     *bulkhead.Compartment
	sched *bulkhead.Scheduler
	// saturations is the compartment's saturation count at the last observation: a change
	// since says the limit was saturated in between.
	saturations atomic.Uint64

	// mu orders the limits put in force as the controller computed them.
	mu sync.Mutex
	// limit is the limit last put in force.
	limit int64
	// fleet is the compartment's lease with leased cluster admission: the limit is then the
	// fleet's, and the controller's moves are proposed to it rather than put in force here.
	fleet *fleetLease
}

func newAdaptiveLimit(cfg config.AdaptiveLimit, c *bulkhead.Compartment, sched *bulkhead.Scheduler, now time.Time) *adaptiveLimit {
	a := &adaptiveLimit{cfg: cfg, c: c, sched: sched, ctl: adaptive.New(adaptive.Settings{
		Min: cfg.Min, Max: cfg.Max, Initial: cfg.Initial, Tolerance: cfg.Tolerance,
		Interval: cfg.Interval, RemeasureInterval: cfg.RemeasureInterval,
	}, now)}
	a.saturations.Store(c.Saturations())
	return a
}

// apply puts the controller's limit in force.
func (a *adaptiveLimit) apply() {
	a.mu.Lock()
	a.limit = a.ctl.Limit()
	a.sched.SetAdaptiveLimit(a.c, a.limit)
	a.mu.Unlock()
}

// observe feeds one observation at now, the process having stalled for stalled in all, to the
// controller and puts a changed limit in force.
func (a *adaptiveLimit) observe(now time.Time, stalled time.Duration, x adaptive.Sample) {
	sat := a.c.Saturations()
	x.Saturated = a.saturations.Swap(sat) != sat
	a.mu.Lock()
	a.put(a.ctl.Observe(now, stalled, x))
	a.mu.Unlock()
}

// put puts the limit n, just computed by the controller, in force when it changed; a.mu held.
// With a lease the limit is the fleet's: the move is proposed to it, and the lease brings the
// fleet's limit back (learned).
func (a *adaptiveLimit) put(n int64) {
	if n == a.limit {
		return
	}
	if f := a.fleet; f != nil && f.ls != nil {
		f.ls.Propose(a.limit, n)
		a.limit = n
		return
	}
	a.limit = n
	a.sched.SetAdaptiveLimit(a.c, n)
}

// learned takes the fleet's learned limit n (leased cluster admission) as the controller's.
func (a *adaptiveLimit) learned(now time.Time, n int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if n == a.limit {
		return
	}
	a.ctl.SetLimit(now, n)
	a.limit = a.ctl.Limit()
}

// finish ends the request h and puts a changed limit in force.
func (a *adaptiveLimit) finish(now time.Time, stalled time.Duration, h adaptive.Handle) {
	a.mu.Lock()
	a.put(a.ctl.Finish(now, stalled, h))
	a.mu.Unlock()
}

// startAdaptive tells the adaptive limits of the ticket's compartments that the request was
// admitted; they follow its wait for the first token when it asked for a streamed answer
// (whose first token FirstToken reports as it comes). The first admission into an adaptive
// compartment starts the meter of the process's stalls, whose stalled time the limits
// discount.
func (t *Ticket) startAdaptive(stream bool) {
	started := false
	for i := 0; i < t.n; i++ {
		t.handles[i] = 0
		a := t.insts[i].adaptive
		if a == nil {
			continue
		}
		if !started {
			if m := t.engine.stalls; m != nil {
				m.Start()
			}
			t.stalled, started = t.engine.stalled(t.grantedAt), true
		}
		t.handles[i] = a.ctl.Start(t.grantedAt, t.stalled, t.est.Prompt, stream)
	}
}

// attachAdaptive gives in the adaptive limit its limits ask for: prev's when prev (the same
// compartment in the previous snapshot) had one with the same settings, else a new one starting
// at adaptive.initial. live says in's compartment may be serving already (a new snapshot's
// changes are then applied on commit).
func (s *Snapshot) attachAdaptive(in, prev *instance, live bool) {
	cfg := in.limits.Adaptive
	var old *adaptiveLimit
	if prev != nil {
		old = prev.adaptive
	}
	apply := func(f func()) {
		if live {
			s.onCommit(f)
		} else {
			f()
		}
	}
	switch {
	case !cfg.On():
		if old != nil {
			c := in.c
			apply(func() { s.engine.sched.SetAdaptiveLimit(c, 0) })
		}
	case old != nil && old.cfg == cfg && old.c == in.c:
		in.adaptive = old
	default:
		a := newAdaptiveLimit(cfg, in.c, s.engine.sched, s.built)
		in.adaptive = a
		apply(a.apply)
	}
}

// FirstToken reports the request's first token, ttfb after admission, as soon as it comes:
// compartments with an adaptive limit learn the provider's queueing from it without waiting for
// the answer to end. Done reports it for requests that never called FirstToken. It does not
// allocate; calling it after Done does nothing.
func (t *Ticket) FirstToken(ttfb time.Duration) {
	if !t.active || t.done.Load() || ttfb <= 0 || !t.firstToken.CompareAndSwap(false, true) {
		return
	}
	// The first token came ttfb after the grant: no clock to read.
	now := t.grantedAt.Add(ttfb)
	stalled, read := time.Duration(0), false
	for i := 0; i < t.n; i++ {
		a := t.insts[i].adaptive
		if a == nil {
			continue
		}
		if !read {
			stalled, read = t.engine.stalled(now), true
		}
		a.observe(now, stalled, adaptive.Sample{Admitted: t.grantedAt, TTFB: ttfb, PromptTokens: t.est.Prompt, Handle: t.handles[i],
			Stalled: stalled - t.stalled})
	}
}

// observeAdaptive feeds a finished request to the adaptive limits of its compartments and ends
// it there.
func (t *Ticket) observeAdaptive(o Outcome, now time.Time) {
	var x adaptive.Sample
	ok := true
	switch {
	case backoffOutcome(o):
		x.Backoff = true
	case o.Status >= 200 && o.Status < 300 && o.StreamError == StreamErrorNone:
		if o.TTFB > 0 && !t.firstToken.Load() {
			x.TTFB, x.PromptTokens = o.TTFB, t.est.Prompt
		}
		x.InterToken = o.InterToken
		ok = x.TTFB != 0 || x.InterToken != 0
	default:
		// Client errors, cancels and other server errors say nothing about load.
		ok = false
	}
	x.Admitted = t.grantedAt
	stalled, read := time.Duration(0), false
	for i := 0; i < t.n; i++ {
		a := t.insts[i].adaptive
		if a == nil {
			continue
		}
		if !read {
			stalled, read = t.engine.stalled(now), true
			if x.TTFB > 0 {
				// Read at the end: a stall after the first token is discounted from it too.
				x.Stalled = stalled - t.stalled
			}
		}
		if ok {
			x.Handle = t.handles[i]
			a.observe(now, stalled, x)
		}
		a.finish(now, stalled, t.handles[i])
	}
}

// backoffOutcome reports an answer that tells a client to send less: 429, 503, Anthropic's 529
// (overloaded), a rate-limit error inside a 2xx stream, or no response at all (a timeout).
func backoffOutcome(o Outcome) bool {
	switch {
	case o.Status == 429 || o.Status == 503 || o.Status == 529:
		return true
	case o.Status == 0:
		return !o.Cancelled
	}
	return o.StreamError == StreamErrorRateLimited
}

// AdaptiveView is an adaptive limit's state for the admin API and dashboard.
type AdaptiveView struct {
	// Limit is the limit in force; Min and Max its bounds.
	Limit int64 `json:"limit"`
	Min   int64 `json:"min"`
	Max   int64 `json:"max"`
	// Initial, Tolerance, Interval and RemeasureInterval are the compartment's settings.
	Initial           int64   `json:"initial"`
	Tolerance         float64 `json:"tolerance"`
	Interval          string  `json:"interval"`
	RemeasureInterval string  `json:"remeasure_interval"`
	// BaselineTTFB is the no-load time to first token of an empty prompt (TTFB / (1 + prompt
	// tokens / 1000)); BaselineInterToken the no-load time between streamed tokens.
	BaselineTTFB       string `json:"baseline_ttfb,omitempty"`
	BaselineInterToken string `json:"baseline_inter_token,omitempty"`
	// TTFB and InterToken are the last window's medians, normalised like the baselines.
	TTFB       string `json:"ttfb,omitempty"`
	InterToken string `json:"inter_token,omitempty"`
	// Ratio is the last window's larger signal over its baseline.
	Ratio float64 `json:"ratio"`
	// Remeasuring: the limit is held at min while the baselines are measured again.
	Remeasuring bool `json:"remeasuring"`
	// BackoffsLatency and BackoffsUpstream count the limit's cuts for latency beyond tolerance
	// and for upstream 429/503/timeouts; Increases its raises.
	BackoffsLatency  uint64 `json:"backoffs_latency"`
	BackoffsUpstream uint64 `json:"backoffs_upstream"`
	Increases        uint64 `json:"increases"`
}

func (a *adaptiveLimit) view() *AdaptiveView {
	st := a.ctl.State()
	ms := func(d time.Duration) string {
		if d <= 0 {
			return ""
		}
		return d.Round(time.Microsecond * 100).String()
	}
	return &AdaptiveView{
		Limit: st.Limit, Min: a.cfg.Min, Max: a.cfg.Max, Initial: a.cfg.Initial, Tolerance: a.cfg.Tolerance,
		Interval: a.cfg.Interval.String(), RemeasureInterval: a.cfg.RemeasureInterval.String(),
		BaselineTTFB: ms(st.BaselineTTFB), BaselineInterToken: ms(st.BaselineInterToken),
		TTFB: ms(st.TTFB), InterToken: ms(st.InterToken), Ratio: st.Ratio, Remeasuring: st.Remeasuring,
		BackoffsLatency: st.Decreases[adaptive.CauseLatency], BackoffsUpstream: st.Decreases[adaptive.CauseUpstream],
		Increases: st.Increases,
	}
}
