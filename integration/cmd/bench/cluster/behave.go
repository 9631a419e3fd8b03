package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
	"github.com/llm-bulkhead/llm-bulkhead/integration/cmd/clusterdemo/fleet"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

const (
	// chatCompartment is the compartment whose max_concurrent the behaviours set (every benchmark
	// request is a chat request), chatLimitEnv the policy override that sets it.
	chatCompartment = "feature/chat"
	chatLimitEnv    = "LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURRENT"
	// pollEvery is how often the behaviours read every replica's leases and compartments.
	pollEvery = 25 * time.Millisecond
)

// Behaviour is what the skew and churn runs of leased admission found. A lease has followed
// when it is within one slot of its max-min fair share of the limit among what the replicas'
// clients ask for (what the lease script grants once every replica has reported its demand).
type Behaviour struct {
	Replicas      int     `json:"replicas"`
	Clients       int     `json:"clients_per_replica"`
	Limit         int     `json:"limit"`
	Skew          float64 `json:"skew"`
	Hold          string  `json:"hold"`
	Phase         string  `json:"phase"`
	LeaseInterval string  `json:"lease_interval"`
	LeaseTTL      string  `json:"lease_ttl"`

	// Skew: one replica's clients go from an even share to Skew of all. Expected is its fair
	// share then; Before and After its lease (slots) at the end of the even phase and of the
	// skewed one; Followed the seconds from the change until its lease was within a slot of
	// Expected (null: not within the phase), Intervals the same in lease intervals; ShareBefore
	// and ShareAfter its part of the fleet's admissions over the second half of each phase.
	SkewClients   []int `json:"skew_clients"`
	SkewExpected  int   `json:"skew_expected_slots"`
	SkewBefore    int64 `json:"skew_slots_before"`
	SkewAfter     int64 `json:"skew_slots_after"`
	SkewFollowed  Num   `json:"skew_followed_seconds"`
	SkewIntervals Num   `json:"skew_followed_intervals"`
	ShareBefore   Num   `json:"skew_admissions_share_before"`
	ShareAfter    Num   `json:"skew_admissions_share_after"`

	// Join: a replica starts with Clients clients; JoinStart is how long its process took to
	// listen; JoinFollowed the seconds from its first client until its lease was within a slot
	// of JoinExpected; JoinSlots its lease at the phase's end.
	JoinStart     Num   `json:"join_start_seconds"`
	JoinExpected  int   `json:"join_expected_slots"`
	JoinFollowed  Num   `json:"join_followed_seconds"`
	JoinIntervals Num   `json:"join_followed_intervals"`
	JoinSlots     int64 `json:"join_slots"`

	// Kill: a replica holding KillHeld slots is killed (SIGKILL); KillRebalanced is the seconds
	// until every survivor's lease was within a slot of its fair share of the whole limit
	// (KillExpected), which needs the killed replica's leases to expire (lease_ttl after its
	// last report).
	KillHeld       int64 `json:"kill_slots_held"`
	KillExpected   []int `json:"kill_expected_slots"`
	KillRebalanced Num   `json:"kill_rebalanced_seconds"`

	// MaxUpstream is the most requests the upstream held at once over the whole run (exact:
	// each is inside the admitting replica's hold); MaxAdminSum the most the replicas'
	// /admin/compartments in-flight added up to in one poll (read one replica after the other,
	// so a slot passed on between two reads may count twice).
	MaxUpstream int64 `json:"max_upstream_in_flight"`
	MaxAdminSum int64 `json:"max_admin_in_flight_sum"`
	// Admitted, Refused and Failed count the clients' requests; LeaseWaits the replicas'
	// llm_bulkhead_cluster_lease_waits_total by kind (the killed replica's not included).
	Admitted   int64              `json:"admitted"`
	Refused    int64              `json:"refused"`
	Failed     int64              `json:"failed"`
	FirstError string             `json:"first_error,omitempty"`
	LeaseWaits map[string]float64 `json:"lease_waits"`
	PollErrors int                `json:"poll_errors"`
	// Contended is Redis's and the replicas' work per admission over the second half of the
	// first even phase, while every replica's requests queue for the limit (not polled then).
	Contended *Work `json:"contended_work,omitempty"`
	// Trace is every poll: its time (seconds from the start), the phase, and per replica (by
	// the order they started) its lease's slots and its in-flight requests (-1: not running).
	Trace []TracePoint `json:"trace"`
}

// TracePoint is one poll of the behaviours' replicas.
type TracePoint struct {
	T        float64 `json:"t"`
	Phase    string  `json:"phase"`
	Slots    []int64 `json:"slots"`
	InFlight []int64 `json:"in_flight"`
	Upstream int64   `json:"upstream"`
}

// fairShares returns the max-min fair shares of capacity among wants, as the lease script
// computes them: the smallest want first, each given at most an even part of what is left
// (rounded up), ties in the order given.
func fairShares(wants []int, capacity int) []int {
	order := make([]int, len(wants))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return wants[a] - wants[b] })
	out := make([]int, len(wants))
	left := capacity
	for k, i := range order {
		if wants[i] <= 0 {
			continue
		}
		give := min(wants[i], (left+len(order)-k-1)/(len(order)-k))
		out[i] = give
		left -= give
	}
	return out
}

// skewed splits total clients: first gets share of them, the others the rest, evenly (the
// first of them one more while it does not divide).
func skewed(total, replicas int, share float64) []int {
	out := make([]int, replicas)
	out[0] = int(math.Round(share * float64(total)))
	rest := total - out[0]
	for i := 1; i < replicas; i++ {
		out[i] = rest / (replicas - 1)
		if i <= rest%(replicas-1) {
			out[i]++
		}
	}
	return out
}

// followed returns the seconds from since until the first poll at which ok held (NaN: none).
func followed(trace []TracePoint, since float64, ok func(TracePoint) bool) Num {
	for _, tp := range trace {
		if tp.T >= since && ok(tp) {
			return Num(tp.T - since)
		}
	}
	return Num(math.NaN())
}

// countingUpstream holds every request for hold, counting the requests it holds at once, then
// answers as the benchmark's upstream does.
type countingUpstream struct {
	inner     envoysim.Upstream
	hold      time.Duration
	cur, peak atomic.Int64
}

func (u *countingUpstream) Serve(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
	if _, err := io.Copy(io.Discard, req.Body); err != nil {
		return nil, err
	}
	n := u.cur.Add(1)
	for p := u.peak.Load(); n > p && !u.peak.CompareAndSwap(p, n); p = u.peak.Load() {
	}
	t := time.NewTimer(u.hold)
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	t.Stop()
	u.cur.Add(-1)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return u.inner.Serve(ctx, req)
}

// clients runs closed-loop clients through one replica, as many as set says.
type clients struct {
	sim  *envoysim.Sim
	req  *envoysim.Request
	up   envoysim.Upstream
	hold time.Duration

	mu       sync.Mutex
	stops    []chan struct{}
	firstErr string
	wg       sync.WaitGroup

	ok, refused, failed atomic.Int64
}

// set starts or stops clients until n run. A stopped client finishes its request first.
func (c *clients) set(ctx context.Context, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.stops) < n {
		stop := make(chan struct{})
		c.stops = append(c.stops, stop)
		c.wg.Go(func() { c.loop(ctx, stop) })
	}
	for len(c.stops) > n {
		close(c.stops[len(c.stops)-1])
		c.stops = c.stops[:len(c.stops)-1]
	}
}

// stop stops every client and waits for them.
func (c *clients) stop() {
	c.set(context.Background(), 0)
	c.wg.Wait()
}

func (c *clients) loop(ctx context.Context, stop chan struct{}) {
	stopped := func() bool {
		select {
		case <-stop:
			return true
		default:
			return ctx.Err() != nil
		}
	}
	for !stopped() {
		res, err := c.sim.RoundTrip(ctx, c.req, c.up)
		if stopped() {
			return // what a stopped client's request met (its replica killed) is not counted
		}
		var bad error
		switch {
		case err != nil:
			bad = err
		case res.Local != envoysim.NotLocal && (res.Status == 429 || res.Status == 503):
			c.refused.Add(1)
			time.Sleep(c.hold) // a refused client backs off as long as a request holds its slot
			continue
		default:
			bad = bench.Check(res, true)
		}
		if bad == nil {
			c.ok.Add(1)
			continue
		}
		c.failed.Add(1)
		c.mu.Lock()
		if c.firstErr == "" {
			c.firstErr = bad.Error()
		}
		c.mu.Unlock()
		time.Sleep(c.hold)
	}
}

// member is one replica of the behaviours.
type member struct {
	r    *fleet.Replica
	sim  *envoysim.Sim
	cl   *clients
	dead atomic.Bool
}

// behaviourRun is the fleet of the skew and churn runs.
type behaviourRun struct {
	b     *bencher
	file  string
	up    *countingUpstream
	start time.Time

	mu       sync.Mutex
	members  []*member
	phase    string
	trace    []TracePoint
	maxAdmin int64
	pollErrs int
	// quiet pauses the polls (each GET /admin/cluster costs Redis two commands) while Redis's
	// work is measured.
	quiet atomic.Bool
}

// add starts n replicas, numbered on from the others, and opens their simulators (with first,
// sending one request through each); they get no clients yet.
func (br *behaviourRun) add(ctx context.Context, n int, first bool) ([]*member, error) {
	br.mu.Lock()
	before := len(br.members)
	br.mu.Unlock()
	env := chatLimitEnv + "=" + strconv.Itoa(br.b.cfg.Limit)
	rs, err := fleet.StartReplicas(n, func(i int) bench.Spec { return br.b.spec(br.file, fmt.Sprintf("b%d", before+i+1), true, env) })
	if err != nil {
		return nil, err
	}
	sims, err := br.b.open(ctx, rs, first)
	if err != nil {
		_ = fleet.StopReplicas(rs)
		return nil, err
	}
	ms := make([]*member, n)
	for i := range rs {
		ms[i] = &member{r: rs[i], sim: sims[i], cl: &clients{sim: sims[i], req: br.b.req, up: br.up, hold: br.b.cfg.Hold}}
	}
	br.mu.Lock()
	br.members = append(br.members, ms...)
	br.mu.Unlock()
	return ms, nil
}

// kill stops m's clients from starting requests and kills its process.
func (br *behaviourRun) kill(m *member) {
	m.dead.Store(true)
	m.cl.set(context.Background(), 0)
	m.r.Kill()
}

// close stops every client and replica.
func (br *behaviourRun) close() {
	br.mu.Lock()
	ms := slices.Clone(br.members)
	br.mu.Unlock()
	var wg sync.WaitGroup
	for _, m := range ms {
		wg.Go(func() {
			m.cl.stop()
			_ = m.sim.Close()
			if !m.dead.Load() {
				_ = m.r.Stop()
			}
		})
	}
	wg.Wait()
}

// setPhase names the phase that begins now and returns its start, seconds from the run's start.
func (br *behaviourRun) setPhase(name string) float64 {
	br.mu.Lock()
	defer br.mu.Unlock()
	br.phase = name
	return time.Since(br.start).Seconds()
}

// poll reads every running replica's lease of the chat compartment and its in-flight requests
// until ctx ends.
func (br *behaviourRun) poll(ctx context.Context) {
	t := time.NewTicker(pollEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if br.quiet.Load() {
			continue
		}
		br.mu.Lock()
		ms := slices.Clone(br.members)
		phase := br.phase
		br.mu.Unlock()
		tp := TracePoint{Phase: phase, Slots: make([]int64, len(ms)), InFlight: make([]int64, len(ms)), Upstream: br.up.cur.Load()}
		errs := make([]error, len(ms))
		var wg sync.WaitGroup
		for i, m := range ms {
			tp.Slots[i], tp.InFlight[i] = -1, -1
			if m.dead.Load() {
				continue
			}
			wg.Go(func() {
				v, err := m.r.Cluster(ctx)
				if err != nil {
					errs[i] = err
					return
				}
				cs, err := m.r.Compartments(ctx)
				if err != nil {
					errs[i] = err
					return
				}
				tp.Slots[i] = v.Lease(chatCompartment).Slots
				for _, c := range cs {
					if c.Name == chatCompartment {
						tp.InFlight[i] = c.InFlight
					}
				}
			})
		}
		wg.Wait()
		tp.T = time.Since(br.start).Seconds()
		var sum int64
		for i, f := range tp.InFlight {
			if f > 0 {
				sum += f
			}
			if errs[i] != nil && !ms[i].dead.Load() && ctx.Err() == nil {
				br.mu.Lock()
				br.pollErrs++
				br.mu.Unlock()
				tp.Slots[i], tp.InFlight[i] = -1, -1
			}
		}
		br.mu.Lock()
		br.trace = append(br.trace, tp)
		br.maxAdmin = max(br.maxAdmin, sum)
		br.mu.Unlock()
	}
}

// snapshot returns the trace so far and each member's admitted requests.
func (br *behaviourRun) snapshot() ([]TracePoint, []int64) {
	br.mu.Lock()
	defer br.mu.Unlock()
	ok := make([]int64, len(br.members))
	for i, m := range br.members {
		ok[i] = m.cl.ok.Load()
	}
	return slices.Clone(br.trace), ok
}

// lastSlots returns each member's lease at the last poll that read it.
func lastSlots(trace []TracePoint, n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = -1
		for k := len(trace) - 1; k >= 0; k-- {
			if i < len(trace[k].Slots) && trace[k].Slots[i] >= 0 {
				out[i] = trace[k].Slots[i]
				break
			}
		}
	}
	return out
}

// share is member i's part of the admissions between two counts.
func share(before, after []int64, i int) Num {
	var all int64
	for k := range before {
		all += after[k] - before[k]
	}
	if all <= 0 {
		return Num(math.NaN())
	}
	return Num(float64(after[i]-before[i]) / float64(all))
}

// behaviours runs skew, then churn, on a fleet of leased replicas sharing one standalone Redis
// whose chat compartment is limited to cfg.Limit.
func (b *bencher) behaviours(ctx context.Context) error {
	cfg := b.cfg
	be, err := b.startRedis(ctx, RedisStandalone)
	if err != nil {
		return err
	}
	defer be.Stop()
	file, err := b.policy(be, Leased, "behaviours")
	if err != nil {
		return err
	}
	br := &behaviourRun{b: b, file: file, up: &countingUpstream{inner: bench.SSEUpstream(), hold: cfg.Hold}}
	defer br.close()
	n := cfg.BehaviourReplicas
	ms, err := br.add(ctx, n, true)
	if err != nil {
		return err
	}
	bh := &Behaviour{Replicas: n, Clients: cfg.Clients, Limit: cfg.Limit, Skew: cfg.Skew, Hold: cfg.Hold.String(), Phase: cfg.Phase.String(),
		LeaseInterval: cfg.LeaseInterval.String(), LeaseTTL: cfg.LeaseTTL.String()}
	b.rep.Behaviour = bh
	br.start = time.Now()
	pctx, stopPoll := context.WithCancel(ctx)
	var pwg sync.WaitGroup
	pwg.Go(func() { br.poll(pctx) })
	defer func() {
		stopPoll()
		pwg.Wait()
	}()
	wait := func(d time.Duration) error {
		if !bench.SleepUntil(ctx, time.Now().Add(d)) {
			return ctx.Err()
		}
		for _, m := range ms {
			if !m.dead.Load() {
				if err := m.r.Alive(); err != nil {
					return err
				}
			}
		}
		return nil
	}
	interval := cfg.LeaseInterval.Seconds()
	within := func(slots int64, fair int) bool { return slots >= int64(fair)-1 }

	// Even: every replica has cfg.Clients clients.
	br.setPhase("even")
	for _, m := range ms {
		m.cl.set(ctx, cfg.Clients)
	}
	b.logf("skew and churn: %d leased replicas, %d clients each, %s limited to %d, upstream holding each request %s",
		n, cfg.Clients, chatCompartment, cfg.Limit, cfg.Hold)
	if err := wait(cfg.Phase / 2); err != nil {
		return err
	}
	rs := make([]*fleet.Replica, len(ms))
	for i, m := range ms {
		rs[i] = m.r
	}
	_, okMid := br.snapshot()
	br.quiet.Store(true)
	r0, err := read(ctx, be, rs)
	if err != nil {
		return err
	}
	if err := wait(cfg.Phase - cfg.Phase/2); err != nil {
		return err
	}
	r1, err := read(ctx, be, rs)
	if err != nil {
		return err
	}
	br.quiet.Store(false)
	trace, okEnd := br.snapshot()
	contended := workOf(r0, r1, Leased, math.NaN())
	bh.Contended = &contended
	bh.ShareBefore = share(okMid, okEnd, 0)
	bh.SkewBefore = lastSlots(trace, n)[0]

	// Skew: replica 1 gets cfg.Skew of the clients.
	bh.SkewClients = skewed(n*cfg.Clients, n, cfg.Skew)
	bh.SkewExpected = fairShares(bh.SkewClients, cfg.Limit)[0]
	t0 := br.setPhase("skew")
	for i, m := range ms {
		m.cl.set(ctx, bh.SkewClients[i])
	}
	if err := wait(cfg.Phase / 2); err != nil {
		return err
	}
	_, okMid = br.snapshot()
	if err := wait(cfg.Phase - cfg.Phase/2); err != nil {
		return err
	}
	trace, okEnd = br.snapshot()
	bh.ShareAfter = share(okMid, okEnd, 0)
	bh.SkewAfter = lastSlots(trace, n)[0]
	bh.SkewFollowed = followed(trace, t0, func(tp TracePoint) bool { return within(tp.Slots[0], bh.SkewExpected) })
	bh.SkewIntervals = bh.SkewFollowed / Num(interval)
	b.logf("skew: replica b1 %d of %d clients; its lease %d → %d slots (fair share %d), followed in %.2fs = %.1f lease intervals; its admissions %.0f%% → %.0f%%",
		bh.SkewClients[0], n*cfg.Clients, bh.SkewBefore, bh.SkewAfter, bh.SkewExpected, bh.SkewFollowed, bh.SkewIntervals, 100*float64(bh.ShareBefore), 100*float64(bh.ShareAfter))

	// Even again, then a replica joins.
	br.setPhase("even")
	for _, m := range ms {
		m.cl.set(ctx, cfg.Clients)
	}
	if err := wait(cfg.Phase); err != nil {
		return err
	}
	started := time.Now()
	joined, err := br.add(ctx, 1, false)
	if err != nil {
		return err
	}
	bh.JoinStart = Num(time.Since(started).Seconds())
	ms = append(ms, joined...)
	wants := make([]int, len(ms))
	for i := range wants {
		wants[i] = cfg.Clients
	}
	bh.JoinExpected = fairShares(wants, cfg.Limit)[n]
	t1 := br.setPhase("join")
	joined[0].cl.set(ctx, cfg.Clients)
	if err := wait(cfg.Phase); err != nil {
		return err
	}
	trace, _ = br.snapshot()
	bh.JoinSlots = lastSlots(trace, len(ms))[n]
	bh.JoinFollowed = followed(trace, t1, func(tp TracePoint) bool { return n < len(tp.Slots) && within(tp.Slots[n], bh.JoinExpected) })
	bh.JoinIntervals = bh.JoinFollowed / Num(interval)
	b.logf("join: replica b%d listened after %.2fs; its lease reached %d slots (fair share %d) %.2fs = %.1f lease intervals after its first client",
		n+1, bh.JoinStart, bh.JoinSlots, bh.JoinExpected, bh.JoinFollowed, bh.JoinIntervals)

	// Kill replica 1.
	bh.KillHeld = lastSlots(trace, len(ms))[0]
	bh.KillExpected = fairShares(wants[1:], cfg.Limit)
	t2 := br.setPhase("kill")
	br.kill(ms[0])
	if err := wait(cfg.LeaseTTL + cfg.LeaseInterval + cfg.Phase); err != nil {
		return err
	}
	trace, _ = br.snapshot()
	bh.KillRebalanced = followed(trace, t2, func(tp TracePoint) bool {
		for i, fair := range bh.KillExpected {
			if !within(tp.Slots[i+1], fair) {
				return false
			}
		}
		return true
	})
	b.logf("kill: replica b1 held %d slots; the survivors' leases reached their fair shares %v %.2fs later (lease_ttl %s)",
		bh.KillHeld, bh.KillExpected, bh.KillRebalanced, cfg.LeaseTTL)

	// The replicas' lease waits, before they stop.
	bh.LeaseWaits = map[string]float64{}
	for _, m := range ms[1:] {
		met, err := m.r.Metrics(ctx)
		if err != nil {
			return err
		}
		for _, kind := range []string{"slot", "window"} {
			bh.LeaseWaits[kind] += met.Sum("llm_bulkhead_cluster_lease_waits_total", "kind", kind)
		}
	}
	stopPoll()
	pwg.Wait()
	br.mu.Lock()
	bh.Trace, bh.MaxAdminSum, bh.PollErrors = br.trace, br.maxAdmin, br.pollErrs
	br.mu.Unlock()
	bh.MaxUpstream = br.up.peak.Load()
	for _, m := range ms {
		bh.Admitted += m.cl.ok.Load()
		bh.Refused += m.cl.refused.Load()
		bh.Failed += m.cl.failed.Load()
		if bh.FirstError == "" {
			m.cl.mu.Lock()
			bh.FirstError = m.cl.firstErr
			m.cl.mu.Unlock()
		}
	}
	b.logf("concurrency: the upstream held at most %d requests at once, the replicas' in-flight added up to at most %d (limit %d); %d admitted, %d refused, %d failed",
		bh.MaxUpstream, bh.MaxAdminSum, cfg.Limit, bh.Admitted, bh.Refused, bh.Failed)
	if bh.PollErrors > 0 {
		b.logf("%d polls of a running replica failed", bh.PollErrors)
	}
	return ctx.Err()
}
