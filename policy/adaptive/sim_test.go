package adaptive

import (
	"cmp"
	"container/heap"
	"math/rand/v2"
	"slices"
	"time"
)

// provider simulates an LLM provider the way a model server behaves: it works on at most
// capacity requests at once and queues the rest FIFO. A request's first token comes after its
// wait in that queue plus prefill (fixed overhead plus a time per prompt token); its tokens
// then come every interToken. Latencies carry ±jitter.
type provider struct {
	capacity   int
	overhead   time.Duration
	perPrompt  time.Duration // prefill time per prompt token
	interToken time.Duration
	jitter     float64
	// rateLimited answers every request at once with a 429 while true.
	rateLimited bool

	active int
	queue  []*simReq
}

type simReq struct {
	admitted  time.Time
	prompt    int64
	output    int64
	saturated bool
	started   time.Time // when the provider began working on it
	handle    Handle
	// stalled is what the process's stall meter read when it was admitted.
	stalled time.Duration
}

// event is a simulated happening at a point in time.
type event struct {
	at   time.Time
	seq  int
	kind int // evDone, evArrive or evFirst
	req  *simReq
	// itl is what the finished request measured; backoff its 429.
	itl     time.Duration
	backoff bool
}

// Kinds of event, in the order in which the process handles those that came during a stall of
// its own: ends first (each judges the requests still waiting), then first tokens.
const (
	evDone = iota
	evArrive
	evFirst
)

type events []*event

func (e events) Len() int { return len(e) }
func (e events) Less(i, j int) bool {
	if !e[i].at.Equal(e[j].at) {
		return e[i].at.Before(e[j].at)
	}
	return e[i].seq < e[j].seq
}
func (e events) Swap(i, j int) { e[i], e[j] = e[j], e[i] }
func (e *events) Push(x any)   { *e = append(*e, x.(*event)) }
func (e *events) Pop() any {
	old := *e
	x := old[len(old)-1]
	*e = old[:len(old)-1]
	return x
}

// sim runs clients against a compartment whose limit a Controller sets, in front of a
// provider, on a simulated clock. Clients are closed-loop: each sends its next request as soon
// as the previous one ends, so demand always exceeds the limit (the limit is saturated).
type sim struct {
	now   time.Time
	ctl   *Controller
	prov  *provider
	rng   *rand.Rand
	queue events
	seq   int

	// Our compartment.
	inflight int
	waiting  []*simReq

	// prompt and output size the requests clients send.
	prompt, output func(*rand.Rand) int64

	// trace records the limit in force after every completed request.
	trace []point
	// completed counts finished requests.
	completed int

	// stalls are the stretches of time in which our process stalled; lateFirst counts the
	// first tokens it handled late, at the end of one.
	stalls    []span
	lateFirst int
}

// span is a stretch [from, to) of simulated time.
type span struct{ from, to time.Time }

// meterBlind is how much of a stall the process's stall meter does not see: the wake-up it
// misses is due up to a tick after the stall begins, and the lateness it counts starts beyond a
// threshold (package internal/stall: a tick of 25ms and a threshold of 5ms).
const meterBlind = 30 * time.Millisecond

// stalled returns what the process's stall meter reads at t: each stall up to t, less the
// part of it the meter does not see.
func (x *sim) stalled(t time.Time) time.Duration {
	var d time.Duration
	for _, s := range x.stalls {
		end := s.to
		if t.Before(end) {
			end = t
		}
		d += max(end.Sub(s.from)-meterBlind, 0)
	}
	return d
}

// stall stalls our process for d from now, and runs the simulation through it: what happens
// in the stall (first tokens, ends, arrivals) is handled when it ends, ends first.
func (x *sim) stall(d time.Duration) {
	x.stalls = append(x.stalls, span{x.now, x.now.Add(d)})
	x.run(d)
}

type point struct {
	at    time.Time
	limit int64
}

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func newSim(s Settings, p *provider, clients int) *sim { return newSimSeed(s, p, clients, 1) }

// newSimSeed is newSim with the random source seeded by seed.
func newSimSeed(s Settings, p *provider, clients int, seed uint64) *sim {
	x := &sim{now: epoch, prov: p, rng: rand.New(rand.NewPCG(seed, 2))}
	x.ctl = New(s, x.now)
	x.prompt = func(r *rand.Rand) int64 { return 200 + r.Int64N(1800) }
	x.output = func(r *rand.Rand) int64 { return 150 + r.Int64N(100) }
	for range clients {
		x.arrive()
	}
	return x
}

func (x *sim) push(e *event) {
	x.seq++
	e.seq = x.seq
	heap.Push(&x.queue, e)
}

func (x *sim) jit(d time.Duration) time.Duration {
	j := x.prov.jitter
	return time.Duration(float64(d) * (1 - j + 2*j*x.rng.Float64()))
}

// arrive: a client sends a request to our compartment.
func (x *sim) arrive() {
	r := &simReq{prompt: x.prompt(x.rng), output: x.output(x.rng)}
	x.waiting = append(x.waiting, r)
	x.admit()
}

// admit lets waiting requests through while the limit allows.
func (x *sim) admit() {
	limit := int(x.ctl.Limit())
	for len(x.waiting) > 0 && x.inflight < limit {
		r := x.waiting[0]
		x.waiting = x.waiting[1:]
		x.inflight++
		r.admitted = x.now
		r.saturated = x.inflight >= limit || len(x.waiting) > 0
		r.handle = x.begin(r)
		x.send(r)
	}
}

// send hands r to the provider.
func (x *sim) send(r *simReq) {
	p := x.prov
	if p.rateLimited {
		x.push(&event{at: x.now.Add(x.jit(30 * time.Millisecond)), kind: evDone, req: r, backoff: true})
		return
	}
	if p.active >= p.capacity {
		p.queue = append(p.queue, r)
		return
	}
	x.start(r)
}

func (x *sim) start(r *simReq) {
	p := x.prov
	p.active++
	r.started = x.now
	prefill := x.jit(p.overhead + time.Duration(r.prompt)*p.perPrompt)
	itl := x.jit(p.interToken)
	first := x.now.Add(prefill)
	end := first.Add(time.Duration(r.output-1) * itl)
	// The first token is reported when it comes, the inter-token latency when the answer ends,
	// as the server reports them.
	x.push(&event{at: first, kind: evFirst, req: r})
	x.push(&event{at: end, kind: evDone, req: r, itl: itl})
}

// run advances the simulation by d.
func (x *sim) run(d time.Duration) {
	until := x.now.Add(d)
	for x.queue.Len() > 0 && !x.queue[0].at.After(until) {
		e := heap.Pop(&x.queue).(*event)
		s, stalled := x.stallAt(e.at)
		if !stalled {
			x.now = e.at
			x.handle(e)
			continue
		}
		// Our process is stalled: what happens until the stall ends waits for it, and is
		// handled then, ends first.
		late := []*event{e}
		for x.queue.Len() > 0 && x.queue[0].at.Before(s.to) {
			late = append(late, heap.Pop(&x.queue).(*event))
		}
		slices.SortStableFunc(late, func(a, b *event) int { return cmp.Compare(a.kind, b.kind) })
		x.now = s.to
		for _, e := range late {
			if e.kind == evFirst {
				x.lateFirst++
			}
			x.handle(e)
		}
	}
	x.now = until
}

// stallAt returns the stall of our process that t falls in, if any.
func (x *sim) stallAt(t time.Time) (span, bool) {
	for _, s := range x.stalls {
		if !t.Before(s.from) && t.Before(s.to) {
			return s, true
		}
	}
	return span{}, false
}

func (x *sim) handle(e *event) {
	switch e.kind {
	case evArrive:
		x.arrive()
	case evDone:
		x.done(e)
	case evFirst:
		// The first token is timed when the process handles it.
		x.trace = append(x.trace, point{x.now, x.first(e.req)})
		x.admit()
	}
}

func (x *sim) done(e *event) {
	r := e.req
	p := x.prov
	if !e.backoff {
		p.active--
		for p.active < p.capacity && len(p.queue) > 0 {
			next := p.queue[0]
			p.queue = p.queue[1:]
			x.start(next)
		}
	}
	x.inflight--
	x.completed++
	x.observe(Sample{Admitted: r.admitted, InterToken: e.itl, Backoff: e.backoff, Saturated: r.saturated})
	limit := x.finish(r)
	x.trace = append(x.trace, point{x.now, limit})
	// The client thinks for a moment, then sends its next request.
	x.push(&event{at: x.now.Add(x.jit(50 * time.Millisecond)), kind: evArrive})
	x.admit()
}

func (x *sim) observe(s Sample) {
	x.trace = append(x.trace, point{x.now, x.end(s)})
	x.admit()
}

// spans calls f for each stretch of [from, to) with one limit in force, with that limit and
// the stretch's length.
func (x *sim) spans(from, to time.Time, f func(limit int64, d time.Duration)) {
	last, prev := x.ctl.s.Initial, from
	for _, p := range x.trace {
		if p.at.Before(from) {
			last = p.limit
			continue
		}
		if !p.at.Before(to) {
			break
		}
		f(last, p.at.Sub(prev))
		last, prev = p.limit, p.at
	}
	f(last, to.Sub(prev))
}

// limits returns the min, max and time-weighted mean of the limit in force over [from, to).
func (x *sim) limits(from, to time.Time) (lo, hi int64, mean float64) {
	lo, hi = 1<<62, 0
	var sum float64
	x.spans(from, to, func(limit int64, d time.Duration) {
		sum += float64(limit) * d.Seconds()
		lo, hi = min(lo, limit), max(hi, limit)
	})
	return lo, hi, sum / to.Sub(from).Seconds()
}
