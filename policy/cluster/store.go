package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// Mode is how the Redis deployment is reached.
type Mode string

// Modes.
const (
	Standalone Mode = "standalone"
	Sentinel   Mode = "sentinel"
	Cluster    Mode = "cluster"
)

// Options configure a Store. Durations must be positive; Open fills nothing in.
type Options struct {
	Addresses  []string
	Mode       Mode
	MasterName string
	Username   string
	Password   string
	TLS        *tls.Config
	// KeyPrefix starts every key, inside a hash tag.
	KeyPrefix string
	// ReplicaID names this replica.
	ReplicaID string
	// Timeout bounds one admission's round trip.
	Timeout time.Duration
	// DialTimeout bounds connecting.
	DialTimeout time.Duration
	// WriteTimeout bounds settlements, heartbeats and resyncs.
	WriteTimeout time.Duration
	// LeaseTTL is how long leases outlive the last heartbeat.
	LeaseTTL time.Duration
	// Heartbeat is how often leases are renewed.
	Heartbeat time.Duration
	// SettleInterval is how long settlements may wait to be batched.
	SettleInterval time.Duration
	// MaxPending bounds queued settlements.
	MaxPending int

	Logger     *slog.Logger
	Registerer prometheus.Registerer

	// OnCounts receives a compartment's shared totals (slots and in-flight tokens over live
	// replicas) whenever they change anywhere, with the sequence number ordering such reports
	// (a later report has a larger seq, until Redis loses its state: then OnReset is called).
	OnCounts func(name string, seq, slots, tokens int64)
	// OnReset says sequence numbers start again (Redis lost its state).
	OnReset func()
	// OnState reports availability and the live replicas whenever either changes.
	OnState func(available bool, live int)
	// Watched returns the compartments whose shared totals the heartbeat should report (those
	// with requests waiting here), so that a missed publication delays a waiter by at most one
	// heartbeat.
	Watched func() []string
}

// Slot is one compartment an admission takes a slot in.
type Slot struct {
	Name string
	// Max is the concurrency limit (0 = none); MaxTokens the in-flight-token limit (0 = none).
	Max, MaxTokens int64
	// Tokens is what the request holds against MaxTokens.
	Tokens int64
	Shadow bool
}

// Window is one budget or rate window an admission reserves in, or a settlement settles.
type Window struct {
	Name string
	// Kind distinguishes a compartment's windows: "rpm", "tpm", "tpd".
	Kind   string
	Length time.Duration
	// Capacity per window, and Debt: how far settlement may push the sum beyond it.
	Capacity, Debt int64
	// Amount to reserve (admission only).
	Amount int64
	Shadow bool
}

// settles reports whether w counts tokens, and so is settled to the tokens a request really
// used; a request-rate window keeps the one request it charged at admission.
func (w *Window) settles() bool { return w.Kind != "rpm" }

// Admission is one request's shared reservation.
type Admission struct {
	Lease   uint64
	Slots   []Slot
	Windows []Window
}

// Status is an admission's outcome.
type Status uint8

// Admission outcomes.
const (
	Admitted Status = iota
	// RefusedWindow: Result.Index names the window that has no room.
	RefusedWindow
	// RefusedSlot: Result.Index names the compartment that is full.
	RefusedSlot
)

// Result is what Admit found.
type Result struct {
	Status Status
	// Index of the refusing window or slot.
	Index int
	// RetryAfter is when the refusing window has room (0 for a slot refusal).
	RetryAfter time.Duration
	// Seq orders Others against published counts.
	Seq int64
	// Others holds, per slot, the slots and tokens other live replicas hold (as of Seq).
	Others [][2]int64
	// Remaining and Reset hold, per window after an admission, what is left and when it is all
	// back.
	Remaining []int64
	Reset     []time.Duration
	// WindowLeft and WindowReset are, for a window refusal, what the refusing window has left
	// (negative in debt) and when everything charged to it has aged out; WindowKnown says a
	// reply carried them.
	WindowLeft  int64
	WindowReset time.Duration
	WindowKnown bool
	// Shadowed has bit i set for each window i, and bit len(Windows)+i for each slot i, that
	// would have refused but is in shadow mode.
	Shadowed uint64
}

// ErrUnavailable is returned by Admit when Redis did not answer in time, or answered that this
// replica must first rewrite its state; errors.Is works on every Admit error.
var ErrUnavailable = errors.New("cluster state unavailable")

// lease is what this replica remembers of one admitted request, to rewrite it after Redis lost it.
type lease struct {
	slots []leaseSlot
}

type leaseSlot struct {
	key    string
	tokens int64
}

// settlement is a queued settle-and-release of one lease.
type settlement struct {
	lease   uint64
	actual  int64
	slots   []leaseSlot
	windows []Window
}

// Store is this replica's view of the shared state. Safe for concurrent use.
type Store struct {
	o                                       Options
	client                                  redis.UniversalClient
	tag                                     string // "{prefix}"
	keys                                    struct{ replicas, leases, comps, seq, channel, spendIndex, spendTokens string }
	admit, settle, heartbeat, resync, leave *redis.Script
	spendReserve, spendSettle               *redis.Script

	log *slog.Logger
	met *metrics

	nextLease atomic.Uint64
	available atomic.Bool
	// wasAvailable is set once the store has been available.
	wasAvailable atomic.Bool
	live         atomic.Int64
	// failures counts admissions in a row that timed out.
	failures atomic.Int32

	// rewrite is held for reading by admissions running a script, and for writing by a resync,
	// which must not interleave with them.
	rewrite sync.RWMutex
	leaseMu sync.Mutex
	leases  map[uint64]lease

	pendMu  sync.Mutex
	pending []settlement
	// drops counts settlements dropped from the front of pending, so that a flush removes only
	// what it sent.
	drops int64
	// spendPending are spend settlements not sent yet; spend holds the spend additions not sent
	// yet (see spend.go).
	spendPending []spendOp
	spend        spendShared
	// skewLogged is set while this replica's clock is known to differ from Redis's.
	skewLogged atomic.Bool
	kick       chan struct{}
	probe      chan struct{}

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	closed atomic.Bool

	// availMu guards availHooks: functions told of every change of availability, before
	// admissions see the store available and after they see it unavailable.
	availMu    sync.Mutex
	availHooks []func(available bool)
}

// onAvailability adds f to what is told of changes of availability.
func (s *Store) onAvailability(f func(bool)) {
	s.availMu.Lock()
	s.availHooks = append(s.availHooks, f)
	s.availMu.Unlock()
}

func (s *Store) tellAvailability(ok bool) {
	s.availMu.Lock()
	hooks := s.availHooks
	s.availMu.Unlock()
	for _, f := range hooks {
		f(ok)
	}
}

// Open connects to Redis and starts the heartbeat, settlement and subscription loops. It
// returns at once: the store is unavailable until its first registration succeeds.
func Open(o Options) (*Store, error) {
	logOnce.Do(func() { redis.SetLogger(redisLogger{}) })
	if len(o.Addresses) == 0 {
		return nil, errors.New("cluster: no Redis address")
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.MaxPending <= 0 {
		o.MaxPending = 100000
	}
	pool := max(32, 10*runtime.GOMAXPROCS(0))
	var client redis.UniversalClient
	switch o.Mode {
	case Sentinel:
		client = redis.NewFailoverClient(&redis.FailoverOptions{
			MasterName: o.MasterName, SentinelAddrs: o.Addresses, Username: o.Username, Password: o.Password,
			TLSConfig: o.TLS, DialTimeout: o.DialTimeout, ReadTimeout: o.WriteTimeout, WriteTimeout: o.WriteTimeout,
			ContextTimeoutEnabled: true, PoolSize: pool, MaxRetries: -1,
		})
	case Cluster:
		client = redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: o.Addresses, Username: o.Username, Password: o.Password, TLSConfig: o.TLS,
			DialTimeout: o.DialTimeout, ReadTimeout: o.WriteTimeout, WriteTimeout: o.WriteTimeout,
			ContextTimeoutEnabled: true, PoolSize: pool, MaxRetries: -1,
		})
	default:
		client = redis.NewClient(&redis.Options{
			Addr: o.Addresses[0], Username: o.Username, Password: o.Password, TLSConfig: o.TLS,
			DialTimeout: o.DialTimeout, ReadTimeout: o.WriteTimeout, WriteTimeout: o.WriteTimeout,
			ContextTimeoutEnabled: true, PoolSize: pool, MaxRetries: -1,
		})
	}
	s := &Store{
		o: o, client: client, tag: "{" + o.KeyPrefix + "}", log: o.Logger,
		leases: map[uint64]lease{}, kick: make(chan struct{}, 1), probe: make(chan struct{}, 1),
		admit: redis.NewScript(luaAdmit), settle: redis.NewScript(luaSettle),
		heartbeat: redis.NewScript(luaHeartbeat), resync: redis.NewScript(luaResync), leave: redis.NewScript(luaLeave),
		spendReserve: redis.NewScript(luaSpendReserve), spendSettle: redis.NewScript(luaSpendSettle),
	}
	s.keys.replicas = s.tag + ":r"
	s.keys.leases = s.tag + ":l:" + o.ReplicaID
	s.keys.comps = s.tag + ":rc:" + o.ReplicaID
	s.keys.seq = s.tag + ":seq"
	s.keys.channel = s.tag + ":free"
	s.met = newMetrics(o.Registerer, s)
	s.live.Store(1)
	s.nextLease.Store(uint64(time.Now().UnixNano()))
	s.keys.spendIndex = s.tag + ":spi"
	// Spend reservations are recorded per process: a replica restarted under the same id starts
	// a table of its own.
	s.keys.spendTokens = s.tag + ":spq:" + o.ReplicaID + ":" + strconv.FormatUint(s.nextLease.Load(), 36)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(3)
	go s.heartbeatLoop()
	go s.settleLoop()
	go s.subscribeLoop()
	return s, nil
}

// Available reports whether admissions can use the shared state now.
func (s *Store) Available() bool { return s.available.Load() }

// Live returns the live replicas last seen (at least 1).
func (s *Store) Live() int { return int(max(s.live.Load(), 1)) }

// ReplicaID returns this replica's id.
func (s *Store) ReplicaID() string { return s.o.ReplicaID }

// NextLease returns a lease id unused by this replica.
func (s *Store) NextLease() uint64 { return s.nextLease.Add(1) }

func (s *Store) slotKey(name string) string { return s.tag + ":c:" + name }

func (s *Store) windowKey(w *Window) string {
	return s.tag + ":w:" + w.Name + ":" + w.Kind + ":" + strconv.FormatInt(w.Length.Milliseconds(), 10)
}

func b01(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// Admit runs one admission against the shared state, waiting at most the configured timeout.
// On success with Status Admitted the lease is held until Settle. An error wraps
// ErrUnavailable: nothing is held (an admission whose answer was lost is undone in the
// background).
func (s *Store) Admit(ctx context.Context, a *Admission, r *Result) error {
	if !s.available.Load() {
		return ErrUnavailable
	}
	if !s.rewrite.TryRLock() {
		return fmt.Errorf("%w: rewriting leases", ErrUnavailable)
	}
	defer s.rewrite.RUnlock()
	keys := make([]string, 4, 4+len(a.Slots)+len(a.Windows))
	keys[0], keys[1], keys[2], keys[3] = s.keys.replicas, s.keys.leases, s.keys.comps, s.keys.seq
	args := make([]any, 0, 5+5*len(a.Slots)+6*len(a.Windows))
	args = append(args, s.o.ReplicaID, strconv.FormatUint(a.Lease, 10), s.keys.channel, len(a.Slots), len(a.Windows))
	ls := make([]leaseSlot, len(a.Slots))
	for i := range a.Slots {
		sl := &a.Slots[i]
		k := s.slotKey(sl.Name)
		ls[i] = leaseSlot{key: k, tokens: sl.Tokens}
		keys = append(keys, k)
		args = append(args, len(keys), sl.Max, sl.MaxTokens, sl.Tokens, b01(sl.Shadow))
	}
	for i := range a.Windows {
		w := &a.Windows[i]
		keys = append(keys, s.windowKey(w))
		args = append(args, len(keys), w.Capacity, w.Debt, slotMillis(w.Length), w.Amount, b01(w.Shadow))
	}
	cctx, cancel := context.WithTimeout(ctx, s.o.Timeout)
	start := time.Now()
	res, err := s.admit.Run(cctx, s.client, keys, args...).Int64Slice()
	cancel()
	s.met.observe("admit", start, err)
	if err != nil {
		// The script may have run without its answer reaching us: undo it in the background,
		// after anything queued (undoing a lease Redis never recorded does nothing).
		s.enqueue(settlement{lease: a.Lease, slots: ls, windows: append([]Window(nil), a.Windows...)})
		if ctx.Err() == nil {
			s.noteFailure(err)
		}
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	s.failures.Store(0)
	if len(res) < 4 {
		return fmt.Errorf("%w: short reply", ErrUnavailable)
	}
	switch res[0] {
	case 3:
		s.lost("admission found this replica unregistered")
		return fmt.Errorf("%w: replica not registered", ErrUnavailable)
	case 1:
		*r = Result{Status: RefusedWindow, Index: int(res[1]) - 1, RetryAfter: time.Duration(res[2]) * time.Millisecond}
		if len(res) >= 6 {
			r.WindowLeft, r.WindowReset, r.WindowKnown = res[4], time.Duration(res[5])*time.Millisecond, true
		}
		return nil
	}
	r.Seq = res[3]
	r.Others = r.Others[:0]
	r.Remaining, r.Reset = r.Remaining[:0], r.Reset[:0]
	i := 4
	for range a.Slots {
		if i+1 < len(res) {
			r.Others = append(r.Others, [2]int64{res[i], res[i+1]})
		}
		i += 2
	}
	if res[0] == 2 {
		r.Status, r.Index, r.RetryAfter, r.Shadowed = RefusedSlot, int(res[1])-1, 0, 0
		return nil
	}
	for range a.Windows {
		if i+1 < len(res) {
			r.Remaining = append(r.Remaining, res[i])
			r.Reset = append(r.Reset, time.Duration(res[i+1])*time.Millisecond)
		}
		i += 2
	}
	r.Status, r.Index, r.RetryAfter = Admitted, 0, 0
	if i < len(res) {
		r.Shadowed = uint64(res[i])
	}
	s.leaseMu.Lock()
	s.leases[a.Lease] = lease{slots: ls}
	s.met.leases.Set(float64(len(s.leases)))
	s.leaseMu.Unlock()
	return nil
}

// slotMillis is a window's slot length in milliseconds (a sixtieth, at least 1).
func slotMillis(d time.Duration) int64 { return max(d.Milliseconds()/60, 1) }

// Track records a lease admitted without Redis (while it was unavailable), so that the next
// rewrite of this replica's leases counts it everywhere.
func (s *Store) Track(id uint64, slots []Slot) {
	ls := make([]leaseSlot, len(slots))
	for i := range slots {
		ls[i] = leaseSlot{key: s.slotKey(slots[i].Name), tokens: slots[i].Tokens}
	}
	s.leaseMu.Lock()
	s.leases[id] = lease{slots: ls}
	s.met.leases.Set(float64(len(s.leases)))
	s.leaseMu.Unlock()
}

// Settle queues the settlement of lease id: its slots released, its windows settled from the
// reservation to actual tokens. windows carries each window's limits as at admission (Amount is
// ignored; windows is copied); pass nil for a lease admitted without Redis. It never blocks.
func (s *Store) Settle(id uint64, actual int64, windows []Window) {
	s.leaseMu.Lock()
	l, ok := s.leases[id]
	delete(s.leases, id)
	s.met.leases.Set(float64(len(s.leases)))
	s.leaseMu.Unlock()
	if !ok {
		return
	}
	s.enqueue(settlement{lease: id, actual: actual, slots: l.slots, windows: append([]Window(nil), windows...)})
}

func (s *Store) enqueue(st settlement) {
	s.pendMu.Lock()
	if len(s.pending) >= s.o.MaxPending {
		// Redis has been gone long: forget the oldest settlement. Its slots come back when this
		// replica rewrites its leases; its budget correction is lost (counted).
		copy(s.pending, s.pending[1:])
		s.pending = s.pending[:len(s.pending)-1]
		s.drops++
		s.met.dropped.Inc()
		if s.available.Load() {
			// Its slots would stay taken in Redis: rewrite this replica's leases.
			s.setAvailable(false, "settlements dropped", nil)
		}
	}
	s.pending = append(s.pending, st)
	s.met.queue.Set(float64(len(s.pending)))
	s.pendMu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// noteFailure counts a failed admission; three in a row, or any failure that is not a timeout,
// make the store unavailable until a heartbeat gets through.
func (s *Store) noteFailure(err error) {
	n := s.failures.Add(1)
	// go-redis reports a read that ran past the deadline as a net.Error, not as the context's.
	var ne net.Error
	timeout := errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
	if n >= 3 || !timeout {
		s.setAvailable(false, "Redis did not answer an admission in time", err)
	}
}

// lost marks this replica's shared state as lost: unavailable until its leases are rewritten.
func (s *Store) lost(why string) {
	s.setAvailable(false, why, nil)
}

func (s *Store) setAvailable(ok bool, why string, err error) {
	if ok && !s.available.Load() {
		// Leases that are not valid hold nothing once Redis answers: say so before admissions
		// can see it answer.
		s.tellAvailability(true)
	}
	if s.available.Swap(ok) == ok {
		return
	}
	if !ok {
		s.tellAvailability(false)
	}
	if ok {
		msg := "cluster state shared: limits are enforced across replicas"
		if s.wasAvailable.Swap(true) {
			msg = "cluster state shared again: limits are enforced across replicas"
		}
		s.log.Info(msg, "replica", s.o.ReplicaID, "live_replicas", s.Live())
		s.met.available.Set(1)
	} else {
		s.log.Warn("cluster state unavailable: admissions follow cluster.on_unavailable until Redis answers again",
			"replica", s.o.ReplicaID, "reason", why, "error", err, "live_replicas_last_seen", s.Live())
		s.met.available.Set(0)
		select {
		case s.probe <- struct{}{}:
		default:
		}
	}
	if s.o.OnState != nil {
		s.o.OnState(ok, s.Live())
	}
}

// heartbeatLoop renews this replica's registration, rewrites its leases when Redis lost them,
// and probes quickly while Redis is unavailable.
func (s *Store) heartbeatLoop() {
	defer s.wg.Done()
	every := s.o.Heartbeat
	probe := min(every, 250*time.Millisecond)
	needResync := true
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		case <-s.probe:
		}
		if !s.available.Load() {
			needResync = true
		}
		if needResync {
			if err := s.doResync(); err != nil {
				t.Reset(probe)
				continue
			}
			needResync = false
			s.setAvailable(true, "", nil)
		} else if registered, err := s.beat(); err != nil {
			s.setAvailable(false, "heartbeat failed", err)
			needResync = true
			t.Reset(probe)
			continue
		} else if !registered {
			s.log.Warn("this replica's registration in Redis was gone (Redis restarted, or this replica missed its heartbeats): rewriting its leases",
				"replica", s.o.ReplicaID)
			s.setAvailable(false, "registration lost", nil)
			needResync = true
			t.Reset(0)
			continue
		}
		t.Reset(every)
	}
}

// beat runs one heartbeat; registered is false when this replica must resync.
func (s *Store) beat() (registered bool, err error) {
	keys := []string{s.keys.replicas, s.keys.leases, s.keys.comps, s.keys.seq}
	var names []string
	if s.o.Watched != nil {
		names = s.o.Watched()
		for _, n := range names {
			keys = append(keys, s.slotKey(n))
		}
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	res, err := s.heartbeat.Run(ctx, s.client, keys, s.o.ReplicaID, s.o.LeaseTTL.Milliseconds(), s.keys.channel, s.tag).Int64Slice()
	s.met.observe("heartbeat", start, err)
	if err != nil {
		return false, err
	}
	if len(res) < 3 || res[0] == 0 {
		return false, nil
	}
	s.setLive(res[1])
	if s.o.OnCounts != nil {
		for i, n := range names {
			if j := 3 + 2*i; j+1 < len(res) {
				s.o.OnCounts(n, res[2], res[j], res[j+1])
			}
		}
	}
	return true, nil
}

func (s *Store) setLive(n int64) {
	if old := s.live.Swap(n); old != n {
		s.met.live.Set(float64(n))
		if s.o.OnState != nil && s.available.Load() {
			s.o.OnState(true, int(max(n, 1)))
		}
	}
}

// doResync rewrites this replica's leases from its own record, with admissions held off.
// Settlements queued before it are sent first.
func (s *Store) doResync() error {
	s.rewrite.Lock()
	defer s.rewrite.Unlock()
	if err := s.flush(); err != nil {
		return err
	}
	keys := []string{s.keys.replicas, s.keys.leases, s.keys.comps, s.keys.seq}
	args := []any{s.o.ReplicaID, s.o.LeaseTTL.Milliseconds(), s.keys.channel, s.tag, 0}
	idx := map[string]int{}
	s.leaseMu.Lock()
	args[4] = len(s.leases)
	for id, l := range s.leases {
		args = append(args, strconv.FormatUint(id, 10), len(l.slots))
		for _, sl := range l.slots {
			i, ok := idx[sl.key]
			if !ok {
				keys = append(keys, sl.key)
				i = len(keys)
				idx[sl.key] = i
			}
			args = append(args, i, sl.tokens)
		}
	}
	s.leaseMu.Unlock()
	ctx, cancel := context.WithTimeout(s.ctx, s.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	res, err := s.resync.Run(ctx, s.client, keys, args...).Int64Slice()
	s.met.observe("resync", start, err)
	if err != nil {
		return err
	}
	s.met.resyncs.Inc()
	if s.o.OnReset != nil {
		s.o.OnReset()
	}
	if len(res) >= 1 {
		s.setLive(res[0])
	}
	return nil
}

// settleLoop sends queued settlements in batches.
func (s *Store) settleLoop() {
	defer s.wg.Done()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-s.kick:
		}
		if s.o.SettleInterval > 0 {
			select {
			case <-time.After(s.o.SettleInterval):
			case <-s.ctx.Done():
				return
			}
		}
		for {
			s.rewrite.RLock()
			err := s.flush()
			if err == nil {
				err = s.flushSpend()
			}
			s.rewrite.RUnlock()
			if err == nil {
				break
			}
			// Keep them queued; retry once Redis answers again.
			select {
			case <-s.ctx.Done():
				return
			case <-time.After(250 * time.Millisecond):
			}
		}
	}
}

// maxBatch bounds the settlements sent in one call.
const maxBatch = 256

// flush sends every queued settlement. On error the unsent ones stay queued, in order.
func (s *Store) flush() error {
	for {
		s.pendMu.Lock()
		n := min(len(s.pending), maxBatch)
		batch := append([]settlement(nil), s.pending[:n]...)
		drops := s.drops
		s.pendMu.Unlock()
		if n == 0 {
			return nil
		}
		keys := []string{s.keys.replicas, s.keys.leases, s.keys.comps, s.keys.seq}
		args := []any{s.o.ReplicaID, s.keys.channel, n}
		idx := map[string]int{}
		key := func(k string) int {
			i, ok := idx[k]
			if !ok {
				keys = append(keys, k)
				i = len(keys)
				idx[k] = i
			}
			return i
		}
		for _, st := range batch {
			settles := 0
			for i := range st.windows {
				if st.windows[i].settles() {
					settles++
				}
			}
			args = append(args, strconv.FormatUint(st.lease, 10), st.actual, len(st.slots), settles)
			for _, sl := range st.slots {
				args = append(args, key(sl.key), sl.tokens)
			}
			for i := range st.windows {
				if w := &st.windows[i]; w.settles() {
					args = append(args, key(s.windowKey(w)), i+1, w.Capacity, w.Debt, slotMillis(w.Length))
				}
			}
		}
		ctx, cancel := context.WithTimeout(s.ctx, s.o.WriteTimeout)
		start := time.Now()
		err := s.settle.Run(ctx, s.client, keys, args...).Err()
		cancel()
		s.met.observe("settle", start, err)
		if err != nil {
			return err
		}
		s.pendMu.Lock()
		// Settlements dropped from the front meanwhile were among those sent.
		sent := max(n-int(s.drops-drops), 0)
		s.pending = s.pending[min(sent, len(s.pending)):]
		s.met.queue.Set(float64(len(s.pending)))
		s.pendMu.Unlock()
	}
}

// subscribeLoop applies published slot totals.
func (s *Store) subscribeLoop() {
	defer s.wg.Done()
	for s.ctx.Err() == nil {
		ps := s.client.Subscribe(s.ctx, s.keys.channel)
		ch := ps.Channel(redis.WithChannelHealthCheckInterval(s.o.Heartbeat))
		for msg := range ch {
			s.apply(msg.Payload)
		}
		_ = ps.Close()
		select {
		case <-s.ctx.Done():
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// apply parses one publication: "seq\n<key>\t<slots>\t<tokens>\n…".
func (s *Store) apply(payload string) {
	if s.o.OnCounts == nil {
		return
	}
	line, rest, _ := strings.Cut(payload, "\n")
	seq, err := strconv.ParseInt(line, 10, 64)
	if err != nil {
		return
	}
	prefix := s.tag + ":c:"
	for rest != "" {
		line, rest, _ = strings.Cut(rest, "\n")
		k, counts, ok := strings.Cut(line, "\t")
		ns, ts, ok2 := strings.Cut(counts, "\t")
		if !ok || !ok2 || !strings.HasPrefix(k, prefix) {
			continue
		}
		n, err1 := strconv.ParseInt(ns, 10, 64)
		t, err2 := strconv.ParseInt(ts, 10, 64)
		if err1 != nil || err2 != nil {
			continue
		}
		s.met.updates.Inc()
		s.o.OnCounts(k[len(prefix):], seq, n, t)
	}
}

// Close sends what is queued, gives up this replica's leases and registration at once (so its
// slots are free everywhere without waiting for the lease TTL), and stops. ctx bounds it.
func (s *Store) Close(ctx context.Context) error {
	if s.closed.Swap(true) {
		return nil
	}
	var err error
	if s.available.Load() {
		s.rewrite.Lock()
		if err = s.flush(); err == nil {
			err = s.flushSpend()
		}
		if err == nil {
			keys := []string{s.keys.replicas, s.keys.leases, s.keys.comps, s.keys.seq}
			start := time.Now()
			err = s.leave.Run(ctx, s.client, keys, s.o.ReplicaID, s.keys.channel, s.tag).Err()
			s.met.observe("leave", start, err)
		}
		s.rewrite.Unlock()
	}
	s.available.Store(false)
	s.cancel()
	cerr := s.client.Close()
	s.wg.Wait()
	s.met.unregister()
	return errors.Join(err, cerr)
}

// Info is a point-in-time view of the store for the admin API.
type Info struct {
	ReplicaID string   `json:"replica_id"`
	Mode      string   `json:"mode"`
	Addresses []string `json:"addresses"`
	KeyPrefix string   `json:"key_prefix"`
	Available bool     `json:"available"`
	Live      int      `json:"live_replicas"`
	Leases    int      `json:"leases_held"`
	Pending   int      `json:"settlements_queued"`
	Replicas  []Member `json:"replicas,omitempty"`
	InfoError string   `json:"error,omitempty"`
}

// Member is one replica registered in Redis.
type Member struct {
	ID        string    `json:"id"`
	ExpiresAt time.Time `json:"lease_expires_at"`
	Live      bool      `json:"live"`
}

// Info reports the store's state, asking Redis for the membership (bounded by WriteTimeout).
func (s *Store) Info(ctx context.Context) Info {
	in := Info{ReplicaID: s.o.ReplicaID, Mode: string(s.o.Mode), Addresses: s.o.Addresses, KeyPrefix: s.o.KeyPrefix,
		Available: s.available.Load(), Live: s.Live()}
	s.leaseMu.Lock()
	in.Leases = len(s.leases)
	s.leaseMu.Unlock()
	s.pendMu.Lock()
	in.Pending = len(s.pending)
	s.pendMu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, s.o.WriteTimeout)
	defer cancel()
	zs, err := s.client.ZRangeWithScores(ctx, s.keys.replicas, 0, -1).Result()
	if err != nil {
		in.InfoError = err.Error()
		return in
	}
	t, err := s.client.Time(ctx).Result()
	if err != nil {
		t = time.Now()
	}
	for _, z := range zs {
		id, _ := z.Member.(string)
		exp := time.UnixMilli(int64(z.Score))
		in.Replicas = append(in.Replicas, Member{ID: id, ExpiresAt: exp.UTC(), Live: !exp.Before(t)})
	}
	return in
}

var logOnce sync.Once

// redisLogger passes the Redis client's own messages (reconnection attempts, mostly) to the
// default logger at debug level: the store logs what matters to an operator itself, once per
// change of state, instead of one line per failed dial.
type redisLogger struct{}

func (redisLogger) Printf(ctx context.Context, format string, v ...any) {
	slog.Default().DebugContext(ctx, "redis client: "+fmt.Sprintf(format, v...))
}

// WaitAvailable waits until the store is available or ctx ends, and reports which.
func (s *Store) WaitAvailable(ctx context.Context) bool {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for !s.available.Load() {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
	}
	return true
}
