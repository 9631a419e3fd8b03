package cluster

// Leaser and Lease are kept together: a round builds, sends and applies every lease's report
// under the lease's lock, and the invariants they keep (leases never add up above a limit, a
// report sent again applies once) span all three steps.

import (
	"context"
	"errors"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
)

// Leased admission: each replica holds, per compartment it uses, a lease of the compartment's
// limits — concurrency slots, in-flight tokens, and chunks of its request-rate and token windows —
// and admits requests against it here, with no call to Redis on a request's path. A Leaser
// reports each lease's use every interval and receives the new lease (luaLease): leases never add
// up to more than a limit, a lease shrinks only as its own holdings drain, and the rest is shared
// by demand, max-min fair.

// LeaseOptions configure a Leaser.
type LeaseOptions struct {
	// Interval is how often a lease in use is reported and renewed.
	Interval time.Duration
	// Now is the clock; time.Now when nil.
	Now func() time.Time
}

// LeaseLimits are one compartment's limits as this replica's policy has them.
type LeaseLimits struct {
	// MaxConcurrent and MaxTokens are the concurrency and in-flight-token limits (0: none).
	MaxConcurrent, MaxTokens int64
	// Windows are the request-rate and token windows, in the order the caller refers to them.
	Windows []Window
	// Learned, when Max is positive, makes the concurrency limit one the fleet learns
	// (max_concurrent: adaptive): MaxConcurrent is then ignored, and the limit starts at Initial,
	// within Min and Max, moved by Propose.
	Learned LearnedLimit
}

// LearnedLimit bounds a concurrency limit the fleet learns.
type LearnedLimit struct {
	Min, Max, Initial int64
	// Step is how often the limit may rise, for the whole fleet.
	Step time.Duration
}

// LeaseUsage is what a compartment holds and wants here, as the caller counts it.
type LeaseUsage struct {
	// InFlight and Tokens are the slots and in-flight tokens requests hold now.
	InFlight, Tokens int64
	// Waiting and WaitingTokens are what queued requests ask for.
	Waiting, WaitingTokens int64
}

// LeaseHolder owns a lease: the compartment whose limits it carries on this replica.
type LeaseHolder interface {
	// LeaseUsage returns what the compartment holds and wants here. With freeze it first stops
	// admitting beyond what it holds now, until the next LeaseChanged: a replica about to give
	// slots back reports what it holds at that instant, so that nothing is admitted on the slots
	// while Redis hands them to another replica.
	LeaseUsage(freeze bool) LeaseUsage
	// LeaseChanged applies the lease. It is called from the lease loop and must not block.
	LeaseChanged(LeaseState)
}

// LeaseState is a lease as the caller enforces it.
type LeaseState struct {
	// Slots and Tokens are the concurrency and in-flight tokens this replica may hold (when the
	// compartment has such a limit).
	Slots, Tokens int64
	// Valid reports that the lease is in force. When false it holds nothing: it was not granted
	// yet, or Redis has not renewed it within the lease ttl.
	Valid bool
	// Learned is the fleet's learned concurrency limit, as of the last report (0: the
	// compartment's limit is not learned, or no report yet).
	Learned int64
	// Granted and GrantedTokens are what Redis recorded for this replica at the last report
	// (no more than the report said was held, when its answer was lost), and Free and
	// FreeTokens what is free under the latest bound this replica heard on what every lease
	// holds (see luaLease): while Redis is unavailable and the lease has run out, this
	// replica's part of the limits is its grant and an equal part of what is free
	// (cluster.on_unavailable: local). A grant changes only at its holder's report, and every
	// rise of the bound is told to every replica, so the parts of replicas that heard the last
	// bound add up to no more than the limit.
	Granted, GrantedTokens, Free, FreeTokens int64
	// Known reports that a report got through at least once (the fields above are Redis's).
	Known bool
	// Available reports that Redis answers. A lease that is not valid while Redis is
	// unavailable leaves the caller to enforce cluster.on_unavailable. The holder is told its
	// lease again whenever Redis's availability changes: before admissions see Redis available,
	// and after they see it unavailable.
	Available bool
}

// Leaser keeps this replica's leases. Safe for concurrent use.
type Leaser struct {
	st     *Store
	o      LeaseOptions
	script *redis.Script
	// epochScript keeps the deployment's epoch; epochKey is its key, which lease scripts read
	// too except in Redis Cluster (where a script reaches one slot only: they use the epoch the
	// replica knows); known is the epoch as this replica knows it ("" until it learns one).
	epochScript    *redis.Script
	epochKey       string
	epochInScripts bool
	knownMu        sync.Mutex
	known          string
	// epochAt is when (Now, in UnixNano) the epoch was last learned from Redis: by a refresh of
	// its own, or by a lease report's answer from a script that keeps it (outside Redis
	// Cluster), which is as good.
	epochAt atomic.Int64
	// refreshes counts the epoch's refreshes of its own (refreshEpoch).
	refreshes atomic.Int64
	// renew is the longest gap between two reports of a lease that holds something: a lease
	// that is steady (its use within it, nobody else short) is reported that often, one in use
	// and changing every interval. recovery is how long a compartment whose hash was lost keeps
	// every lease from growing: more than renew and a report's round trip. halfLife is how fast
	// the recent peak of a compartment's use fades (Lease.observe); spendRenew is the longest
	// gap between two reports of a spend window in use.
	renew, recovery, halfLife, spendRenew time.Duration
	// channel carries the names of compartments where a replica is short while others hold
	// more than their share: their holders report at once.
	channel string

	mu     sync.Mutex
	leases map[string]*Lease
	kick   chan struct{}
	// done is closed after each round of reports, and replaced.
	roundMu sync.Mutex
	round   chan struct{}
	seq     atomic.Int64
	// answering: the last round's reports got answers.
	answering atomic.Bool
	// inc names this process among the replica's incarnations, for report numbers.
	inc string
	// manual: no loop runs (the listener does); tests call Round themselves.
	manual bool
	// spend holds this replica's parts of spend windows.
	spend *spendLeases

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// NewLeaser starts the lease loop of store s. Close stops it.
func NewLeaser(s *Store, o LeaseOptions) *Leaser { return newLeaser(s, o, false) }

// newLeaser makes a Leaser; manual leaves the loop out (tests run the rounds).
func newLeaser(s *Store, o LeaseOptions, manual bool) *Leaser {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Interval <= 0 {
		o.Interval = 200 * time.Millisecond
	}
	l := &Leaser{st: s, o: o, script: redis.NewScript(luaLease), leases: map[string]*Lease{},
		kick: make(chan struct{}, 1), round: make(chan struct{}), manual: manual}
	l.epochScript, l.epochKey, l.epochInScripts = redis.NewScript(luaEpoch), s.tag+":le", s.o.Mode != Cluster
	// A steady lease is reported every renewSteps intervals, and at least twice while a lease
	// stays valid; the recovery time covers that, a late tick and a report's round trip.
	l.renew = max(min(renewSteps*o.Interval, l.validFor()/2), o.Interval)
	l.recovery = l.renew + o.Interval + s.o.Timeout
	l.halfLife, l.spendRenew = fadeSteps*o.Interval, spendRenewSteps*o.Interval
	l.channel = s.tag + ":lease"
	l.inc = strconv.FormatUint(uint64(time.Now().UnixNano())&(1<<52-1), 10)
	l.spend = newSpendLeases(l)
	s.onAvailability(l.availability)
	l.ctx, l.cancel = context.WithCancel(context.Background())
	s.listen(l.channel, l.heard)
	if !l.manual {
		l.wg.Add(1)
		go l.loop()
	}
	return l
}

// renewSteps is how many intervals a steady lease goes between reports, at most (five seconds at
// the default interval, less under a short lease ttl: a lease is renewed at least twice while it
// stays valid; a replica's steady compartments cost Redis a report each that often, and a
// window's chunks last as long); fadeSteps how many the recent peak of a compartment's use
// takes to halve; spendRenewSteps how many a spend window in use goes between reports.
const (
	renewSteps      = 25
	fadeSteps       = 5
	spendRenewSteps = 5
)

// heard makes the leases of compartments named on the channel due: a replica there is short,
// and the others' wants in Redis may be from before their demand fell. A lease that holds more
// than its requests use (in flight and queued) is reported at once, giving that back; any other
// at the next round: every short replica's report names the compartment, and rounds for each
// would follow each other back to back (once given back, a lease holds no more than its
// requests use, and further news starts no round). A name this replica published itself is no
// news: it is the one that is short there (its lease must not shrink for it). It takes rises of
// the bound on the leases too, and news of tight spend windows.
func (l *Leaser) heard(payload string) {
	if name, s, ok := grownOf(payload); ok {
		if ls := l.leaseOf(name); ls != nil {
			ls.heardBound(s)
		}
		return
	}
	if key, ok := strings.CutPrefix(payload, "sp:"); ok {
		// A spend window is tight: give back its unused chunk at once.
		if l.spend.tighten(key) {
			l.Kick()
		}
		return
	}
	name, from := shortOf(payload)
	if from == l.st.o.ReplicaID {
		return
	}
	if ls := l.leaseOf(name); ls != nil && ls.heard() {
		l.Kick()
	}
}

// leaseOf returns this replica's lease of the compartment name, nil when it holds none.
func (l *Leaser) leaseOf(name string) *Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.leases[name]
}

// heardBound takes a rise of the bound on what the compartment's leases hold: what is free is
// less.
func (ls *Lease) heardBound(s sums) {
	ls.mu.Lock()
	ls.sums.take(s)
	ls.mu.Unlock()
}

// heard takes the news that another replica is short in the lease's compartment, and reports
// whether the lease holds more than its requests use: what it would give back now.
func (ls *Lease) heard() (spare bool) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.pressure = true
	ls.mark(whyHeard)
	return ls.spare(ls.usage(false))
}

// sums is a bound on what every lease of a compartment holds, and its number.
type sums struct{ seq, slots, tokens int64 }

// take keeps the later of s and o: the one of the larger number, or of the same number the
// larger (the bound is lowered without a new number: the larger counts on less free room).
func (s *sums) take(o sums) {
	switch {
	case o.seq > s.seq:
		*s = o
	case o.seq == s.seq:
		s.slots, s.tokens = max(s.slots, o.slots), max(s.tokens, o.tokens)
	}
}

// grownOf reads a publication that the bound on what a compartment's leases hold rose:
// "g\t<number>\t<slots>\t<tokens>\t<compartment>".
func grownOf(payload string) (name string, s sums, ok bool) {
	rest, ok := strings.CutPrefix(payload, "g\t")
	if !ok {
		return "", s, false
	}
	f := strings.SplitN(rest, "\t", 4)
	if len(f) != 4 {
		return "", s, false
	}
	var err [3]error
	s.seq, err[0] = strconv.ParseInt(f[0], 10, 64)
	s.slots, err[1] = strconv.ParseInt(f[1], 10, 64)
	s.tokens, err[2] = strconv.ParseInt(f[2], 10, 64)
	if err[0] != nil || err[1] != nil || err[2] != nil || s.seq < 0 || s.slots < 0 || s.tokens < 0 {
		return "", s, false
	}
	return f[3], s, true
}

// spare reports whether the lease holds more than its requests use, u (in flight and queued).
func (ls *Lease) spare(u LeaseUsage) bool {
	return ls.target > u.InFlight+u.Waiting || ls.ttarget > u.Tokens+u.WaitingTokens
}

// shortOf reads a publication that a replica is short in a compartment: "<compartment>\n<replica>"
// (a replica id has no control characters), or the compartment's name alone.
func shortOf(payload string) (name, from string) {
	if i := strings.LastIndexByte(payload, '\n'); i >= 0 {
		return payload[:i], payload[i+1:]
	}
	return payload, ""
}

// Lease returns this replica's lease of compartment name, making it on first use; h (nil for a
// compartment with windows only) is told the lease whenever it changes. A later call with the
// same name updates the limits and holder and keeps the lease.
func (l *Leaser) Lease(name string, lim LeaseLimits, h LeaseHolder) *Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	ls := l.leases[name]
	if ls == nil {
		tag := "{" + l.st.o.KeyPrefix + "|" + name + "}"
		ls = &Lease{name: name, l: l, key: tag + ":ls", tag: tag}
		l.leases[name] = ls
	}
	ls.mu.Lock()
	ls.setLimits(lim)
	ls.holder = h
	ls.closed = false
	ls.mu.Unlock()
	return ls
}

// Close stops the loop, after giving back every lease (one last report each), bounded by ctx.
func (l *Leaser) Close(ctx context.Context) {
	l.mu.Lock()
	all := make([]*Lease, 0, len(l.leases))
	for _, ls := range l.leases {
		all = append(all, ls)
	}
	l.mu.Unlock()
	for _, ls := range all {
		ls.mu.Lock()
		ls.closed = true
		ls.mu.Unlock()
	}
	l.st.unlisten(l.channel)
	l.cancel()
	l.wg.Wait()
	if l.st.Available() {
		whys := make([]why, len(all))
		for i := range whys {
			whys[i] = whyOther
		}
		l.report(ctx, all, whys, l.spend.build(l.o.Now(), true), true)
	}
}

// validFor is how long a lease is trusted after the report that renewed it was sent: Redis keeps
// it lease ttl after it ran the script, so this replica, counting from before it sent the report,
// stops relying on it a margin earlier.
func (l *Leaser) validFor() time.Duration {
	ttl := l.st.o.LeaseTTL
	return max(ttl-ttl/10-l.st.o.Timeout, ttl/2)
}

// Kick asks for a round of reports now (a request waits for a lease to grow).
func (l *Leaser) Kick() {
	select {
	case l.kick <- struct{}{}:
	default:
	}
}

// Next returns a channel closed when the round of reports after the current one has ended.
func (l *Leaser) Next() <-chan struct{} {
	l.roundMu.Lock()
	defer l.roundMu.Unlock()
	return l.round
}

// LeaseInfo is one lease as the admin API shows it.
type LeaseInfo struct {
	Compartment string `json:"compartment"`
	// Slots and Tokens are what this replica may hold now; Granted and TokensGranted what Redis
	// recorded for it (more while it drains down to its target).
	Slots         int64 `json:"slots"`
	Granted       int64 `json:"slots_granted"`
	Tokens        int64 `json:"inflight_tokens"`
	TokensGranted int64 `json:"inflight_tokens_granted"`
	// Valid: renewed within the lease ttl. Recovering: Redis lost the compartment's leases, and
	// none grows until every holder has reported. Contended: another replica wants more than it
	// holds.
	Valid      bool `json:"valid"`
	Recovering bool `json:"recovering,omitempty"`
	Contended  bool `json:"contended,omitempty"`
	// Windows are the window chunks held: per window kind, what is left of them.
	Windows map[string]int64 `json:"window_chunks,omitempty"`
}

// Leases lists this replica's leases, by compartment name.
func (l *Leaser) Leases() []LeaseInfo {
	now := l.o.Now()
	l.mu.Lock()
	all := make([]*Lease, 0, len(l.leases))
	for _, ls := range l.leases {
		all = append(all, ls)
	}
	l.mu.Unlock()
	out := make([]LeaseInfo, 0, len(all))
	for _, ls := range all {
		ls.mu.Lock()
		in := LeaseInfo{Compartment: ls.name, Slots: ls.target, Granted: ls.grant, Tokens: ls.ttarget, TokensGranted: ls.tgrant,
			Valid: ls.Valid(now), Recovering: ls.recovers, Contended: ls.pressure}
		for i := range ls.wins {
			if i >= len(ls.lim.Windows) {
				break
			}
			var have int64
			for _, ch := range ls.wins[i].chunks {
				if now.Before(ch.until) {
					have += ch.left
				}
			}
			if in.Windows == nil {
				in.Windows = map[string]int64{}
			}
			in.Windows[ls.lim.Windows[i].Kind] = have
		}
		ls.mu.Unlock()
		out = append(out, in)
	}
	slices.SortFunc(out, func(a, b LeaseInfo) int { return strings.Compare(a.Compartment, b.Compartment) })
	return out
}

// Epoch returns the deployment's epoch as this replica knows it ("" before it learned one).
func (l *Leaser) Epoch() string {
	l.knownMu.Lock()
	defer l.knownMu.Unlock()
	return l.known
}

func (l *Leaser) learnEpoch(e string) {
	if e == "" {
		return
	}
	l.knownMu.Lock()
	l.known = e
	l.knownMu.Unlock()
}

// refreshEpoch learns the deployment's epoch (making it when Redis has none).
func (l *Leaser) refreshEpoch(ctx context.Context) error {
	l.refreshes.Add(1)
	ctx, cancel := context.WithTimeout(ctx, l.st.o.WriteTimeout)
	defer cancel()
	e, err := l.st.run(ctx, l.epochScript, []string{l.epochKey}, l.Epoch(), l.recovery.Milliseconds()).Text()
	if err == nil {
		l.learnEpoch(e)
	}
	return err
}

// leaseReply reads a lease script's answer: integers, and the epoch (a string) at index 9,
// returned as 0 in the slice and learned by the caller from leaseEpoch.
func leaseReply(c *redis.Cmd) ([]int64, error) {
	v, err := c.Slice()
	if err != nil {
		return nil, err
	}
	out := make([]int64, len(v))
	for i, x := range v {
		switch x := x.(type) {
		case int64:
			out[i] = x
		case string:
			if i != 9 {
				return nil, errors.New("lease script: unexpected string in its answer")
			}
		default:
			return nil, errors.New("lease script: unexpected value in its answer")
		}
	}
	return out, nil
}

// leaseEpoch returns the epoch in a lease script's answer.
func leaseEpoch(c *redis.Cmd) string {
	v, err := c.Slice()
	if err != nil || len(v) < 10 {
		return ""
	}
	s, _ := v[9].(string)
	return s
}

// Recovery returns how long a compartment whose leases Redis lost keeps them from growing.
func (l *Leaser) Recovery() time.Duration { return l.recovery }

// Recovering reports whether the lease's compartment recovers: Redis lost its leases (or this
// is a new deployment's first use of Redis), and no lease grows until every holder has reported.
func (ls *Lease) Recovering() bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.recovers
}

// Interval returns the lease interval.
func (l *Leaser) Interval() time.Duration { return l.o.Interval }

// Answering reports whether the last round of reports got its answers.
func (l *Leaser) Answering() bool { return l.answering.Load() }

// CountWait counts a request that waited for a lease to grow.
func (l *Leaser) CountWait(kind string) { l.st.met.leaseWaits.WithLabelValues(kind).Inc() }

func (l *Leaser) loop() {
	defer l.wg.Done()
	t := time.NewTicker(l.o.Interval)
	defer t.Stop()
	for {
		select {
		case <-l.ctx.Done():
			return
		case <-t.C:
		case <-l.kick:
		}
		if now := l.o.Now(); now.UnixNano()-l.epochAt.Load() >= int64(l.renew) && l.st.Available() {
			// Known before Redis can lose its state, the epoch tells whoever first finds it
			// gone that it was lost, not new.
			if l.refreshEpoch(l.ctx) == nil {
				l.epochAt.Store(now.UnixNano())
			}
		}
		l.Round()
	}
}

// Round reports every lease that is due, and wakes whoever waits for the round (Next).
func (l *Leaser) Round() {
	l.roundMu.Lock()
	done := l.round
	l.round = make(chan struct{})
	l.roundMu.Unlock()
	defer close(done)
	now := l.o.Now()
	available := l.st.Available()
	l.mu.Lock()
	due := make([]*Lease, 0, len(l.leases))
	whys := make([]why, 0, len(l.leases))
	idle := make([]*Lease, 0)
	for name, ls := range l.leases {
		ls.mu.Lock()
		w, drop := ls.due(now)
		ls.mu.Unlock()
		switch {
		case drop:
			delete(l.leases, name)
		case w != whyNone:
			due = append(due, ls)
			whys = append(whys, w)
		default:
			idle = append(idle, ls)
		}
	}
	l.mu.Unlock()
	if len(due) > 0 && available {
		// The round costs Redis a round trip anyway: steady leases past half their renewal
		// ride along, renewed early. A replica's compartments so come to be reported together,
		// one round trip a renewal instead of one each.
		kept := idle[:0]
		for _, ls := range idle {
			ls.mu.Lock()
			early := ls.renewsEarly(now)
			ls.mu.Unlock()
			if early {
				due = append(due, ls)
				whys = append(whys, whyRenew)
			} else {
				kept = append(kept, ls)
			}
		}
		idle = kept
	}
	var sr *spendReport
	if available {
		sr = l.spend.build(now, false)
	}
	if (len(due) > 0 || sr != nil) && available {
		ctx, cancel := context.WithTimeout(l.ctx, l.st.o.Timeout)
		l.report(ctx, due, whys, sr, false)
		cancel()
	} else {
		idle = append(idle, due...)
	}
	// Leases not reported may have run out meanwhile: tell their owners.
	for _, ls := range idle {
		ls.notify(now)
	}
}

// availability tells every holder its lease as it stands with Redis available or not (the store
// calls it when that changes).
func (l *Leaser) availability(available bool) {
	now := l.o.Now()
	l.mu.Lock()
	all := make([]*Lease, 0, len(l.leases))
	for _, ls := range l.leases {
		all = append(all, ls)
	}
	l.mu.Unlock()
	for _, ls := range all {
		ls.mu.Lock()
		st := ls.stateAt(now, available)
		ls.applied = st
		h := ls.holder
		ls.mu.Unlock()
		if h != nil {
			h.LeaseChanged(st)
		}
	}
}

// report sends one report per lease (whys[i] is why due[i] is sent), and sr (the spend windows'
// report, when not nil), pipelined (one round trip per Redis node), and applies the answers.
// final gives everything back.
func (l *Leaser) report(ctx context.Context, due []*Lease, whys []why, sr *spendReport, final bool) {
	now := l.o.Now()
	pipe := l.st.client.Pipeline()
	reps := make([]*leaseReport, len(due))
	cmds := make([]*redis.Cmd, len(due))
	var scmd *redis.Cmd
	for i, ls := range due {
		ls.mu.Lock()
		reps[i] = ls.build(now, final)
		ls.mu.Unlock()
		cmds[i] = l.script.EvalSha(ctx, pipe, reps[i].keys, reps[i].args...)
	}
	if sr != nil {
		scmd = l.spend.script.EvalSha(ctx, pipe, sr.keys, sr.args...)
	}
	start := time.Now()
	_, err := pipe.Exec(ctx)
	if err != nil && isNoScript(err) {
		l.st.scriptsLost()
		pipe = l.st.client.Pipeline()
		for i := range due {
			cmds[i] = l.script.Eval(ctx, pipe, reps[i].keys, reps[i].args...)
		}
		if sr != nil {
			scmd = l.spend.script.Eval(ctx, pipe, sr.keys, sr.args...)
		}
		_, err = pipe.Exec(ctx)
	}
	l.st.met.observe("lease", start, err)
	for _, w := range whys {
		l.st.met.leaseReports[w].Inc()
	}
	if sr != nil {
		l.st.met.leaseReports[whySpend].Inc()
		if res, serr := spendReply(scmd); serr != nil {
			l.spend.failed(sr)
		} else {
			l.spend.apply(sr, res, now)
		}
	}
	for i, ls := range due {
		res, cerr := leaseReply(cmds[i])
		ls.mu.Lock()
		if cerr != nil {
			ls.failed(reps[i])
		} else {
			ls.apply(reps[i], res, now)
			if e := leaseEpoch(cmds[i]); e != "" {
				l.learnEpoch(e)
				if l.epochInScripts {
					l.epochAt.Store(now.UnixNano())
				}
			}
		}
		ls.mu.Unlock()
		if cerr == nil && len(res) > 0 && res[0] == 2 {
			l.st.noteRepaired("lease", ls.key)
		}
		ls.notify(now)
	}
	l.answering.Store(err == nil)
	if err != nil && ctx.Err() == nil && l.ctx.Err() == nil {
		l.st.noteFailure(err)
	}
}

// notify tells the lease's holder its state when it changed.
func (ls *Lease) notify(now time.Time) {
	ls.mu.Lock()
	st, changed := ls.state(now)
	h := ls.holder
	ls.mu.Unlock()
	if changed && h != nil {
		h.LeaseChanged(st)
	}
}

// usage asks the holder what the compartment holds and wants.
func (ls *Lease) usage(freeze bool) LeaseUsage {
	if ls.holder == nil {
		return LeaseUsage{}
	}
	return ls.holder.LeaseUsage(freeze)
}

func isNoScript(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT")
}

// Lease is this replica's lease of one compartment. Safe for concurrent use: requests reserve
// window chunks through it; the Leaser reports and renews it.
type Lease struct {
	name string
	l    *Leaser
	key  string
	tag  string

	mu     sync.Mutex
	lim    LeaseLimits
	wkeys  []string
	holder LeaseHolder
	closed bool

	// Slots and tokens: granted by Redis, and the target this replica shrinks to.
	grant, target   int64
	tgrant, ttarget int64
	// sums is the latest bound heard (by a report's answer or another replica's publication)
	// on what every lease of the compartment holds, and its number.
	sums sums
	// sent is when the last report that got through was sent; the lease is valid until sent +
	// the Leaser's validFor (validUntil, in UnixNano, read without the lock).
	sent       time.Time
	validUntil atomic.Int64
	applied    LeaseState
	pressure   bool
	recovers   bool
	// starved: the last report's answer covered less than its requests needed (the rest of the
	// limit is in other replicas' leases, or beyond this replica's fair share): another round
	// cannot grow the lease before another replica's report gives some back.
	starved  bool
	lastSent time.Time
	// urgent is why the lease is to be reported at the next round (0: nothing urgent).
	urgent why
	// drained: a request above the lease (it shrank below what was held) ended since the last
	// round; set without the lock (the holder's scheduler does, under its own).
	drained atomic.Bool
	// needSlots and needTokens are what requests that found the lease full asked for since the
	// last report (they may not be queued yet).
	needSlots, needTokens int64
	// learned is the fleet's learned limit at the last report; proposeFrom and proposeTo this
	// replica's proposal to move it (from the learned limit its controller moved from).
	learned, proposeFrom, proposeTo int64
	// peak and peakTokens are the recent peak of what the compartment held and waited for,
	// decaying: a lease is not given back between two requests.
	peak, peakTokens float64
	observed         time.Time
	wins             []allowance
	// resend is a report whose answer was lost: the next report carries its sequence number and
	// what it gave back, so that Redis applies them once.
	resend *leaseReport
}

// allowance is this replica's part of one window: chunks granted and not yet used.
type allowance struct {
	// pace is twice the window's even pace over chunkSpan: the most a chunk holds. Below 2 the
	// window is reserved one request at a time, and what comes back goes back at once.
	pace   int64
	chunks []chunk // oldest first
	// slotLen and length are the window's slot and length; moves are chunks' unused parts moved
	// from the slot they were charged in (or last moved to) to a later one, to report by moveBy
	// (before the earliest slot moved from ages out of the window, allowing for a late round).
	slotLen, length time.Duration
	moves           []move
	moveBy          time.Time
	// debt is what settled requests cost beyond what their chunks covered, charged to the window
	// at the next report.
	debt int64
	// returns are chunks' unused parts to give back, by the slot they were charged in.
	returns []chunk
	// used is what was reserved since the last report; rate its average per interval.
	used int64
	rate float64
	// need is the largest single reservation that found too little here since the last report,
	// needSum what all of them asked for.
	need, needSum int64
	// remaining, reset and wait are what the window had at the last report: its room, when all
	// of it is back, and (for a need that did not fit) when it would.
	remaining int64
	reset     time.Duration
	wait      time.Duration
	known     bool
}

type chunk struct {
	slot, left int64
	until      time.Time
	// slotEnd is when slot ends, as this replica's clock reads it (at the earliest: the report
	// was sent before Redis ran it).
	slotEnd time.Time
}

// move is n of a chunk moved from slot from to slot to.
type move struct{ from, to, n int64 }

// rebase moves what chunk ch still holds to the slot now falls in, once its slot has ended: a
// request taking from it now uses it in that slot, and the window must count the use there
// (counted in an earlier slot, it would age out of the window sooner than it should).
func (a *allowance) rebase(ch *chunk, now time.Time) {
	if ch.left <= 0 || ch.slotEnd.IsZero() || now.Before(ch.slotEnd) || a.slotLen <= 0 {
		return
	}
	steps := 1 + int64(now.Sub(ch.slotEnd)/a.slotLen)
	to := ch.slot + steps
	// The slot moved from ages out of the window a window's length after it began.
	if by := ch.slotEnd.Add(a.length - a.slotLen - a.slotLen); a.moveBy.IsZero() || by.Before(a.moveBy) {
		a.moveBy = by
	}
	k := 0
	for k < len(a.moves) && (a.moves[k].from != ch.slot || a.moves[k].to != to) {
		k++
	}
	if k == len(a.moves) {
		a.moves = append(a.moves, move{from: ch.slot, to: to})
	}
	a.moves[k].n += ch.left
	ch.slot, ch.slotEnd = to, ch.slotEnd.Add(time.Duration(steps)*a.slotLen)
}

func (ls *Lease) setLimits(lim LeaseLimits) {
	ls.lim = lim
	keys := make([]string, len(lim.Windows))
	for i := range lim.Windows {
		w := &lim.Windows[i]
		keys[i] = ls.tag + ":w:" + w.Kind + ":" + strconv.FormatInt(w.Length.Milliseconds(), 10)
	}
	if !slicesEqual(keys, ls.wkeys) {
		// Other windows: chunks of the old ones stay charged there until they age out.
		ls.wins = make([]allowance, len(keys))
		ls.resend = nil
	}
	for i := range lim.Windows {
		w := &lim.Windows[i]
		ls.wins[i].pace = int64(math.Ceil(2 * float64(w.Capacity) * float64(ls.chunkSpan(w)) / float64(w.Length)))
		ls.wins[i].slotLen, ls.wins[i].length = time.Duration(slotMillis(w.Length))*time.Millisecond, w.Length
	}
	ls.wkeys = keys
	ls.mark(whyOther)
}

func slicesEqual(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// chunkValidity is how long a granted chunk may be used: long enough to last from one renewal to
// the next (a steady replica need not report sooner for its chunks), at least 500 ms, and at
// most a quarter of the window. A chunk outlives the slot it was charged in: what it still
// holds is moved to the slot a request takes from it in (allowance.rebase), so a use is never
// counted earlier than it ran; the moves are reported long before the chunk's first slot ages
// out of the window.
func (ls *Lease) chunkValidity(w *Window) time.Duration {
	return min(max(ls.l.renew, 500*time.Millisecond), w.Length/4)
}

// chunkSpan is the time over which a chunk's most (twice the window's even pace over it) is
// counted: two intervals, at least 500 ms, within the window's slot.
func (ls *Lease) chunkSpan(w *Window) time.Duration {
	return min(max(2*ls.l.o.Interval, 500*time.Millisecond), windowSlot(w))
}

// windowSlot is the window's resolution: a sixtieth of it.
func windowSlot(w *Window) time.Duration { return max(w.Length/60, time.Millisecond) }

// chunkCover is how many intervals at the recent rate a chunk is asked for: until the renewal
// after the next (or the chunk's end, when sooner) and one more, at least three.
func (ls *Lease) chunkCover(w *Window) float64 {
	steps := int64(min(ls.chunkValidity(w), ls.l.renew) / ls.l.o.Interval)
	return float64(max(steps+1, 3))
}

// idleRate is the use of a window per interval, on average, below which the window is idle.
const idleRate = 0.01

// haveAt returns what the chunks hold that is still theirs to use at t.
func (a *allowance) haveAt(t time.Time) int64 {
	var have int64
	for _, ch := range a.chunks {
		if t.Before(ch.until) {
			have += ch.left
		}
	}
	return have
}

// windowDue reports whether window i has news that cannot wait for the lease's renewal: a
// request waits for its chunks; a chunk's remainder was moved from a slot about to age out of
// the window (a round or two before it does); at the recent rate, what they hold that is still valid at the
// next round runs out before the round after; or there is something to give back or charge
// while the window is tight (one request at a time, no report yet, a need that did not fit, or
// less than a quarter of its capacity free, less what is owed, at the last report): the
// others may be waiting for it. Otherwise what expired or was under-estimated goes with the
// next report, at the latest the renewal.
func (ls *Lease) windowDue(i int, now time.Time) bool {
	a := &ls.wins[i]
	switch {
	case a.need > 0:
		return true
	case len(a.moves) > 0 && !now.Add(2*ls.l.o.Interval+ls.l.st.o.Timeout).Before(a.moveBy):
		return true
	case a.rate > idleRate && float64(a.haveAt(now.Add(ls.l.o.Interval))) < 2*a.rate:
		return true
	case len(a.returns) == 0 && a.debt == 0:
		return false
	}
	return a.pace < 2 || !a.known || a.wait > 0 || 4*(a.remaining-a.debt) < ls.lim.Windows[i].Capacity
}

// Reserve takes n from window i's chunks. ok is false, and nothing is taken, when they hold less
// than n: the request should wait for the next report (Kick, then Round) and try again.
func (ls *Lease) Reserve(i int, n int64, now time.Time) (budget.Charge, bool) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	a := &ls.wins[i]
	a.expire(now)
	var have int64
	for _, ch := range a.chunks {
		have += ch.left
	}
	if have < n {
		ls.mark(whyShort)
		return budget.Charge{}, false
	}
	a.used += n
	return budget.MakeCharge(a.consume(n, now), n), true
}

// NeedWindow says that a request waits for n more of window i than its chunks hold, until
// UnneedWindow: reports ask for it (a need that fits the window's room is granted whole).
func (ls *Lease) NeedWindow(i int, n int64) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if i >= len(ls.wins) {
		return
	}
	a := &ls.wins[i]
	a.need = max(a.need, n)
	a.needSum += n
	ls.mark(whyShort)
}

// UnneedWindow withdraws a need of n that NeedWindow added: the request got its chunk, or gave up.
func (ls *Lease) UnneedWindow(i int, n int64) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if i >= len(ls.wins) {
		return
	}
	a := &ls.wins[i]
	a.needSum = max(a.needSum-n, 0)
	if a.needSum == 0 {
		a.need = 0
	}
}

// consume takes n from the chunks, oldest first, and returns the slot of the oldest it took from
// (a refund to that slot can only free what was charged there or later: never too early; a
// used-up chunk's slot may hold nothing any more, its requests refunded, and a refund there
// would be lost), or of the oldest chunk when it took from none. What the chunks do not cover is
// debt.
func (a *allowance) consume(n int64, now time.Time) (slot int64) {
	took := false
	for k := 0; k < len(a.chunks) && n > 0; k++ {
		ch := &a.chunks[k]
		a.rebase(ch, now)
		take := min(ch.left, n)
		if k == 0 || take > 0 && !took {
			slot = ch.slot
		}
		took = took || take > 0
		ch.left -= take
		n -= take
	}
	a.debt += n
	return slot
}

// Take charges n to window i whether or not its chunks cover it (a window in shadow mode): what
// they do not cover is charged at the next report.
func (ls *Lease) Take(i int, n int64, now time.Time) budget.Charge {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	a := &ls.wins[i]
	a.expire(now)
	a.used += n
	return budget.MakeCharge(a.consume(n, now), n)
}

// AddBack charges n to window i at the next report: what this replica counted in a window of
// its own while the lease could not be used (Redis unavailable), so that the fleet's window
// counts it once Redis answers again.
func (ls *Lease) AddBack(i int, n int64) {
	if n <= 0 {
		return
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if i < len(ls.wins) {
		ls.wins[i].debt += n
	}
}

// Settle corrects charge c of window i to actual: an over-estimate goes back to the chunk it
// came from (or to the window, once that chunk has expired), an under-estimate is taken from the
// chunks or charged at the next report.
func (ls *Lease) Settle(i int, c budget.Charge, actual int64, now time.Time) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if i >= len(ls.wins) {
		return
	}
	ls.settle(&ls.wins[i], c, c.Amount()-actual, now)
}

// Refund gives charge c of window i back whole (a refused admission's).
func (ls *Lease) Refund(i int, c budget.Charge, now time.Time) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if i >= len(ls.wins) || c.Amount() <= 0 {
		return
	}
	a := &ls.wins[i]
	a.used -= min(c.Amount(), a.used)
	ls.settle(a, c, c.Amount(), now)
}

func (ls *Lease) settle(a *allowance, c budget.Charge, back int64, now time.Time) {
	a.expire(now)
	switch {
	case back > 0:
		back = min(back, c.Amount())
		if a.pace < 2 {
			// Reserved one request at a time: give it back to the fleet at once.
			a.giveBack(c.Slot(), back)
			ls.mark(whyWindow)
			ls.l.Kick()
			return
		}
		for k := range a.chunks {
			if a.chunks[k].slot == c.Slot() {
				a.chunks[k].left += back
				return
			}
		}
		a.giveBack(c.Slot(), back)
	case back < 0:
		a.consume(-back, now)
	}
}

func (a *allowance) giveBack(slot, n int64) {
	for k := range a.returns {
		if a.returns[k].slot == slot {
			a.returns[k].left += n
			return
		}
	}
	a.returns = append(a.returns, chunk{slot: slot, left: n})
}

// expire moves chunks past their validity to the returns.
func (a *allowance) expire(now time.Time) {
	k := 0
	for k < len(a.chunks) && !now.Before(a.chunks[k].until) {
		if a.chunks[k].left > 0 {
			a.giveBack(a.chunks[k].slot, a.chunks[k].left)
		}
		k++
	}
	if k > 0 {
		a.chunks = append(a.chunks[:0], a.chunks[k:]...)
	}
}

// Remaining returns window i's room at the last report, less what this replica used since, and
// when it is all back; ok is false before the first report.
func (ls *Lease) Remaining(i int) (left int64, reset time.Duration, ok bool) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if i >= len(ls.wins) {
		return 0, 0, false
	}
	a := &ls.wins[i]
	var have int64
	for _, ch := range a.chunks {
		have += ch.left
	}
	return a.remaining + have, a.reset, a.known
}

// Wait returns, for window i, how long until a reservation of n would fit the window as the last
// report found it (0 when unknown).
func (ls *Lease) Wait(i int, n int64) time.Duration {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if i >= len(ls.wins) {
		return 0
	}
	return ls.wins[i].wait
}

// State returns the lease as the caller should enforce it now.
func (ls *Lease) State(now time.Time) LeaseState {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	st, _ := ls.state(now)
	return st
}

// Close gives the lease back: it is reported holding what its compartment still holds and
// wanting nothing, with its chunks returned, until it holds nothing; then it is forgotten. A
// later Leaser.Lease of the same name takes it up again.
func (ls *Lease) Close() {
	ls.mu.Lock()
	ls.closed = true
	ls.mark(whyOther)
	ls.mu.Unlock()
}

// Valid reports, without locking, whether the lease is in force at now.
func (ls *Lease) Valid(now time.Time) bool { return now.UnixNano() < ls.validUntil.Load() }

// Urgent asks for this lease to be reported at the next round, and for the round to come now.
func (ls *Lease) Urgent() {
	ls.mu.Lock()
	ls.mark(whyOther)
	ls.mu.Unlock()
	ls.l.Kick()
}

// Drained says that a request held above the lease ended: the lease shrank below what its
// compartment held (another replica's fair share, a lowered limit), and the slot (or tokens) it
// freed are to be handed on at once rather than at the next interval. It does not block, and
// takes no lock: the holder calls it under its own.
func (ls *Lease) Drained() {
	ls.drained.Store(true)
	ls.l.Kick()
}

// Propose asks for the fleet's learned limit to move as this replica's controller moved its own
// view of it, from from to to. A cut is reported at once.
func (ls *Lease) Propose(from, to int64) {
	if from <= 0 || to <= 0 || from == to {
		return
	}
	ls.mu.Lock()
	if ls.proposeFrom == 0 {
		ls.proposeFrom = from
	}
	ls.proposeTo = to
	cut := to < from
	if cut {
		ls.mark(whyOther)
	}
	ls.mu.Unlock()
	if cut {
		ls.l.Kick()
	}
}

// Need asks for a slot (and tokens in flight) more than the lease holds, at the next round: a
// request found no room in one of its compartments, and this lease is one of them. Unneed
// withdraws it (the request got its slot, or queued: its queue counts it then). Whether to ask
// for the round now is the request's to decide (Await), once it knows whether a round can help
// every lease it lacks room in (CanGrow): a request that will queue anyway must not start one.
func (ls *Lease) Need(tokens int64) {
	ls.mu.Lock()
	ls.mark(whyShort)
	ls.needSlots++
	ls.needTokens += tokens
	ls.mu.Unlock()
}

// CanGrow reports whether a report can grow the lease now: its compartment does not recover, and
// the last report's answer covered what its requests needed (otherwise another replica must give
// some back first: the requests wait in the queue, which every report counts, that report named
// the compartment to the others, and they give back what they do not use at their next report).
// A contended lease (another replica wants more than it holds) may still grow to its fair share
// of what no lease holds: its first report tells.
func (ls *Lease) CanGrow() bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return !ls.recovers && !ls.starved
}

// Unneed withdraws a need that Need added.
func (ls *Lease) Unneed(tokens int64) {
	ls.mu.Lock()
	ls.needSlots = max(ls.needSlots-1, 0)
	ls.needTokens = max(ls.needTokens-tokens, 0)
	ls.mu.Unlock()
}

func (ls *Lease) state(now time.Time) (LeaseState, bool) {
	st := ls.stateAt(now, ls.l.st.Available())
	changed := st != ls.applied
	ls.applied = st
	return st, changed
}

func (ls *Lease) stateAt(now time.Time, available bool) LeaseState {
	st := LeaseState{Slots: ls.target, Tokens: ls.ttarget, Valid: ls.Valid(now), Available: available, Learned: ls.learned,
		Granted: ls.grant, GrantedTokens: ls.tgrant, Known: !ls.sent.IsZero()}
	slots := ls.lim.MaxConcurrent
	if ls.lim.Learned.Max > 0 {
		slots = ls.learned
	}
	st.Free, st.FreeTokens = max(slots-ls.sums.slots, 0), max(ls.lim.MaxTokens-ls.sums.tokens, 0)
	if r := ls.resend; r != nil {
		// The last report got no answer: Redis may have applied it, shrinking the grant to what
		// it said was held, and passed the rest on to others. Count on no more than is true
		// either way.
		st.Granted, st.GrantedTokens = min(st.Granted, r.held), min(st.GrantedTokens, r.heldTokens)
	}
	return st
}

// why is what makes a lease due for a report: the reason label of
// llm_bulkhead_cluster_lease_reports_total.
type why uint8

const (
	whyNone why = iota
	// whyRenew: steady, renewed every renewSteps intervals (Leaser.renew).
	whyRenew
	// whyChanged: the compartment's requests fill its lease, or queue for it.
	whyChanged
	// whyContended: another replica wants more than it holds, or the compartment recovers.
	whyContended
	// whyWindow: a window's chunks run low, or there is something to give back or charge.
	whyWindow
	// whyShort: a request here found the lease (slots or a window's chunk) short.
	whyShort
	// whyHeard: another replica published that it is short in the compartment.
	whyHeard
	// whyDrained: a request held above a lease that shrank ended.
	whyDrained
	// whyResend: the last report got no answer.
	whyResend
	// whyOther: the lease was taken up or its limits changed, it was closed, or the learned
	// limit was cut.
	whyOther
	// whySpend: the round's report of the spend windows in use.
	whySpend
	whyCount
)

var whyNames = [whyCount]string{"", "renew", "changed", "contended", "window", "short", "heard_short", "drained", "resend", "other", "spend"}

func (w why) String() string { return whyNames[w] }

// mark makes the lease due at the next round for w, unless it already is for another reason.
func (ls *Lease) mark(w why) {
	if ls.urgent == whyNone {
		ls.urgent = w
	}
}

// due says why the lease should be reported at this round (whyNone: it need not be), and drop
// whether it holds nothing, wants nothing, and can be forgotten.
func (ls *Lease) due(now time.Time) (w why, drop bool) {
	u := ls.usage(false)
	if !ls.pressure {
		ls.observe(u, now)
	}
	holds := ls.grant > 0 || ls.tgrant > 0
	busy := u.InFlight > 0 || u.Waiting > 0 || u.Tokens > 0
	// steady: nothing to say that cannot wait for the renewal — the lease covers what is used
	// with room to spare, nobody waits, and every window holds enough for its pace.
	var unsteady why
	switch {
	case ls.pressure || ls.recovers:
		unsteady = whyContended
	case u.Waiting > 0 || ls.needSlots > 0 || ls.proposeTo != 0 ||
		(ls.lim.MaxConcurrent > 0 || ls.lim.Learned.Max > 0) && u.InFlight >= ls.target ||
		ls.lim.MaxTokens > 0 && u.Tokens >= ls.ttarget:
		unsteady = whyChanged
	}
	for i := range ls.wins {
		a := &ls.wins[i]
		a.expire(now)
		if len(a.chunks) > 0 || len(a.returns) > 0 || len(a.moves) > 0 || a.debt > 0 || a.used > 0 || a.need > 0 || a.rate > idleRate {
			busy = true
		}
		if unsteady == whyNone && ls.windowDue(i, now) {
			unsteady = whyWindow
		}
	}
	if ls.drained.Swap(false) {
		ls.mark(whyDrained)
	}
	switch {
	case ls.resend != nil:
		return whyResend, false
	case ls.urgent != whyNone:
		return ls.urgent, false
	case !holds && !busy:
		// Nothing to report; a lease its owner closed can be forgotten.
		return whyNone, ls.closed
	case unsteady != whyNone:
		return unsteady, false
	case now.Sub(ls.lastSent) >= ls.l.renew:
		// Steady: renewed often enough that a compartment whose hash Redis lost hears from
		// every holder within its recovery.
		return whyRenew, false
	}
	return whyNone, false
}

// renewsEarly reports whether a lease that is not due would gain from a report in a round that
// goes to Redis anyway: it holds something, and is past half its renewal.
func (ls *Lease) renewsEarly(now time.Time) bool {
	if ls.closed || 2*now.Sub(ls.lastSent) < ls.l.renew {
		return false
	}
	if ls.grant > 0 || ls.tgrant > 0 {
		return true
	}
	for i := range ls.wins {
		if len(ls.wins[i].chunks) > 0 {
			return true
		}
	}
	return false
}

// observe takes the compartment's use u at now into its recent peak of what it held and waited
// for, sampled every round whether reported or not, and halving every fadeSteps intervals: a lease is not
// handed back between two requests only to be asked for again, and a compartment whose
// requests come and go within its lease (in flight up one moment, down the next) stays steady.
func (ls *Lease) observe(u LeaseUsage, now time.Time) {
	decay := 0.5
	if since := now.Sub(ls.observed); since < ls.l.halfLife {
		decay = math.Exp2(-float64(max(since, 0)) / float64(ls.l.halfLife))
	}
	ls.observed = now
	ls.peak = max(float64(u.InFlight+u.Waiting+ls.needSlots), ls.peak*decay)
	ls.peakTokens = max(float64(u.Tokens+u.WaitingTokens+ls.needTokens), ls.peakTokens*decay)
}

// leaseReport is one report's keys and arguments, with the returns and debt it sent per window.
type leaseReport struct {
	keys    []string
	args    []any
	seq     int64
	returns [][]chunk
	moves   [][]move
	debt    []int64
	// held and heldTokens are what the report says this replica holds: Redis's grant is never
	// below them once it applies the report.
	held, heldTokens int64
	// need and needTokens are what its requests needed (in flight, queued and asking), for the
	// limits the compartment has (0 otherwise).
	need, needTokens int64
}

// build makes the report of the lease's use, taking the returns and debt it sends (failed keeps
// them for the report that sends them again). final gives everything back.
func (ls *Lease) build(now time.Time, final bool) *leaseReport {
	u := ls.usage(false)
	if ls.pressure && ls.spare(u) && !final {
		// Another replica wants more than it holds, and this one holds slots that neither its
		// requests in flight nor those queued for them use: stop admitting on them and report
		// what is held now, so that Redis can pass them on at once instead of a report later.
		u = ls.usage(true)
		ls.target, ls.ttarget = min(ls.target, u.InFlight+u.Waiting), min(ls.ttarget, u.Tokens+u.WaitingTokens)
		// The holder now enforces less than it was last told: tell it again after the answer.
		ls.applied.Slots = -1
	}
	prev := ls.resend
	ls.urgent = 0
	ls.lastSent = now
	r := &leaseReport{}
	if prev != nil {
		r.seq = prev.seq
	} else {
		r.seq = ls.l.seq.Add(1)
	}
	r.keys = append(make([]string, 0, 3+len(ls.wkeys)), ls.key)
	epoch := "0"
	if ls.l.epochInScripts {
		r.keys = append(r.keys, ls.l.epochKey, ls.l.st.keys.replicas)
		epoch = "1"
	}
	r.keys = append(r.keys, ls.wkeys...)
	// What this replica holds: its target, or more while requests above it drain. Always what
	// is true now, also in a report sent again.
	hs := max(ls.target, u.InFlight)
	ht := max(ls.ttarget, u.Tokens)
	slotLimit := ls.lim.MaxConcurrent
	if ls.lim.Learned.Max > 0 {
		slotLimit = ls.lim.Learned.Max
	}
	// Demand is what is held and waited for now, or, unless another replica is short, the
	// recent peak of it (observe).
	need, needTokens := u.InFlight+u.Waiting+ls.needSlots, u.Tokens+u.WaitingTokens+ls.needTokens
	if ls.pressure {
		ls.peak, ls.peakTokens = float64(need), float64(needTokens)
	} else {
		ls.observe(u, now)
	}
	ws := wantOf(u.InFlight, max(int64(math.Ceil(ls.peak-0.5))-u.InFlight, 0), slotLimit, !ls.pressure)
	wt := wantOf(u.Tokens, max(int64(math.Ceil(ls.peakTokens-0.5))-u.Tokens, 0), ls.lim.MaxTokens, !ls.pressure)
	if final || ls.closed {
		hs, ht = u.InFlight, u.Tokens
		ws, wt = 0, 0
		need, needTokens = 0, 0
	}
	if ls.lim.MaxConcurrent <= 0 && ls.lim.Learned.Max <= 0 {
		hs, ws, need = 0, 0, 0
	}
	if ls.lim.MaxTokens <= 0 {
		ht, wt, needTokens = 0, 0, 0
	}
	r.held, r.heldTokens = hs, ht
	ttl := ls.l.st.o.LeaseTTL.Milliseconds()
	maxSlots := ls.lim.MaxConcurrent
	if ls.lim.Learned.Max > 0 {
		maxSlots = max(ls.learned, ls.lim.Learned.Initial) // the script uses the fleet's
	}
	// No lease covers more than the limit (a request of more tokens than the limit holds the
	// limit's worth).
	r.need, r.needTokens = min(need, maxSlots), min(needTokens, ls.lim.MaxTokens)
	ll := ls.lim.Learned
	r.args = append(make([]any, 0, 24+10*len(ls.wins)), ls.l.st.o.ReplicaID, ttl, epoch, ls.l.recovery.Milliseconds(), ls.l.inc+":"+strconv.FormatInt(r.seq, 10),
		maxSlots, hs, u.InFlight, ws, ls.lim.MaxTokens, ht, u.Tokens, wt, len(ls.wins),
		ll.Min, ll.Max, ll.Initial, ll.Step.Milliseconds(), ls.proposeFrom, ls.proposeTo, ls.l.channel, ls.name, strconv.FormatInt(r.need, 10)+":"+strconv.FormatInt(r.needTokens, 10), ls.l.Epoch())
	ls.proposeFrom, ls.proposeTo = 0, 0
	r.returns = make([][]chunk, len(ls.wins))
	r.moves = make([][]move, len(ls.wins))
	r.debt = make([]int64, len(ls.wins))
	elapsed := now.Sub(ls.sent)
	for i := range ls.wins {
		a := &ls.wins[i]
		w := &ls.lim.Windows[i]
		a.expire(now)
		// The rate of use per interval, smoothed (reports come every interval, every renewal,
		// or sooner when asked for).
		per := float64(a.used)
		if elapsed > 0 && !ls.sent.IsZero() {
			per = per * float64(ls.l.o.Interval) / float64(max(elapsed, ls.l.o.Interval/4))
		}
		a.rate = 0.5*a.rate + 0.5*per
		a.used = 0
		// What the chunks hold that is still valid at the next round: one that ends before
		// then is no reason to ask for less.
		have := a.haveAt(now.Add(ls.l.o.Interval))
		// Enough at the recent rate until the renewal after this report (chunkCover), but never
		// more than twice the window's even pace over chunkSpan: a chunk is charged to the
		// window when it is granted, so a replica holding it keeps it from the others. A window
		// whose pace is below one a chunk (a few requests a minute) is reserved one request at
		// a time.
		want := max(min(int64(math.Ceil(ls.chunkCover(w)*a.rate)), a.pace)-have, 0)
		if a.pace < 2 || a.rate <= idleRate {
			// One at a time, or no use to speak of: nothing ahead of requests (an idle lease
			// lets its last chunk expire, gives it back, and is not reported again).
			want = 0
		}
		// Every request waiting for the chunks asks for its part: ask for all of it.
		want = max(want, a.needSum-have)
		need := a.need
		if final || ls.closed || w.Shadow {
			want = 0
		}
		if final || ls.closed {
			need = 0
			for _, ch := range a.chunks {
				if ch.left > 0 {
					a.giveBack(ch.slot, ch.left)
				}
			}
			a.chunks = nil
		}
		if prev != nil && i < len(prev.returns) {
			// The lost report's returns and debt go again, under its number; what came since
			// waits for the next report.
			r.returns[i], r.debt[i], r.moves[i] = prev.returns[i], prev.debt[i], prev.moves[i]
		} else {
			r.returns[i], r.debt[i], r.moves[i] = a.returns, a.debt, a.moves
			a.returns, a.debt, a.moves, a.moveBy = nil, 0, nil, time.Time{}
		}
		r.args = append(r.args, w.Kind, w.Capacity, w.Debt, slotMillis(w.Length), want, need, r.debt[i], len(r.returns[i]))
		for _, ch := range r.returns[i] {
			r.args = append(r.args, ch.slot, ch.left)
		}
		r.args = append(r.args, len(r.moves[i]))
		for _, m := range r.moves[i] {
			r.args = append(r.args, m.from, m.to, m.n)
		}
	}
	return r
}

// wantOf is the slots (or tokens) a compartment asks for: what it holds and what waits, plus, when
// no other replica wants more than it holds (headroom), half as much again (at least 2) for what
// arrives before the next report; within the limit.
func wantOf(used, waiting, limit int64, headroom bool) int64 {
	want := used + waiting
	if limit <= 0 || want == 0 {
		return 0
	}
	if headroom {
		want += max(2, want/2)
	}
	return min(want, limit)
}

// failed puts back what a report that got no answer sent: it is sent again as it was (its
// sequence number makes Redis apply it once).
func (ls *Lease) failed(r *leaseReport) {
	ls.resend = r
	ls.mark(whyResend)
}

// apply takes the answer to report r sent at now.
func (ls *Lease) apply(r *leaseReport, res []int64, now time.Time) {
	ls.resend = nil
	if len(res) < 13 {
		return
	}
	ls.grant, ls.target, ls.tgrant, ls.ttarget = res[1], res[2], res[3], res[4]
	ls.pressure, ls.recovers = res[5] == 1, res[6] == 1
	ls.starved = ls.target < r.need || ls.ttarget < r.needTokens
	ls.sent = now
	ls.validUntil.Store(now.Add(ls.l.validFor()).UnixNano())
	ls.learned = res[8]
	ls.sums.take(sums{seq: res[12], slots: res[10], tokens: res[11]})
	i := 13
	for k := range ls.wins {
		if i+5 >= len(res) || k >= len(ls.lim.Windows) {
			break
		}
		a := &ls.wins[k]
		g, slot := res[i], res[i+1]
		if g > 0 {
			a.chunks = append(a.chunks, chunk{slot: slot, left: g, until: now.Add(ls.chunkValidity(&ls.lim.Windows[k])),
				slotEnd: now.Add(time.Duration(max(res[i+5], 0)) * time.Millisecond)})
		}
		a.remaining, a.reset, a.wait, a.known = res[i+2], time.Duration(res[i+3])*time.Millisecond, time.Duration(res[i+4])*time.Millisecond, true
		i += 6
	}
}
