package cluster

// Store is one state machine (connection, membership, heartbeats, rewrites of this replica's
// slots, availability and exact admission's calls) whose invariants — which goroutine writes
// what, under stateMu or epochMu — are read together; it stays in one file so that they can be.

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

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/internal/throttle"
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

	Logger *slog.Logger

	// OnCounts receives a compartment's shared totals (slots and in-flight tokens over live
	// replicas) whenever they change anywhere, with the sequence number ordering such reports
	// (a later report has a larger seq, until Redis loses its state: then OnReset is called).
	OnCounts func(name string, seq, slots, tokens int64)
	// OnReset says sequence numbers start again (Redis lost its state).
	OnReset func()
	// OnState reports the store's State whenever it changes, one call at a time and in order. A
	// change to unavailable is reported before admissions see the store unavailable, so that
	// the caller can put its limits in order first.
	OnState func(State)
	// Watched returns the compartments whose shared totals the heartbeat should report (those
	// with requests waiting here), so that a missed publication delays a waiter by at most one
	// heartbeat.
	Watched func() []string
	// Leased says admission is leased (a Leaser runs on the store): the scripts loaded ahead
	// are leased admission's rather than exact admission's.
	Leased bool
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

// State is what the store knows of the shared state.
type State struct {
	// Available says admissions can use Redis now.
	Available bool
	// Synced says Redis counts every slot this replica and the others hold, as far as this
	// replica can tell: the shared counts alone decide admissions. It turns false when this
	// replica is cut off from Redis or learns that Redis lost what it held, and true again only
	// once every replica that may have admitted what Redis did not count has rewritten (or
	// confirmed) its slots, or could no longer hold any (its registration expired). Until then
	// the caller keeps to its part of each limit.
	Synced bool
	// Live is the live replicas last seen in Redis (at least 1).
	Live int
	// Gone says, while the store is unavailable, that Redis did not answer a call given the
	// write timeout (a heartbeat, a rewrite of the leases), or refused one, or could not be
	// reached, since this replica was cut off: every replica is cut off too, or soon will be.
	// Until then Redis may only be slow for this replica (three admissions in a row timed out)
	// while it answers the others. A store that never reached Redis is gone. A store that
	// finds Redis gone while already unavailable reports a State with Gone set.
	Gone bool
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

// settlement is a queued settle-and-release of one lease, or (record) the recording in Redis
// of a lease admitted without it.
type settlement struct {
	lease   uint64
	actual  int64
	slots   []leaseSlot
	windows []Window
	record  bool
	// undo marks the undoing of an admission whose answer was lost: Redis may never have
	// counted it.
	undo bool
	// lost marks a release sent in a call whose answer was lost: Redis may have applied it.
	lost bool
}

// ErrorInfo is the last call to Redis that failed.
type ErrorInfo struct {
	Op      string    `json:"op"`
	Message string    `json:"message"`
	At      time.Time `json:"at"`
}

// Store is this replica's view of the shared state. Safe for concurrent use.
type Store struct {
	o                                               Options
	client                                          redis.UniversalClient
	tag                                             string // "{prefix}"
	keys                                            struct{ replicas, leases, comps, seq, epoch, channel, spendIndex, spendTokens string }
	admit, settle, heartbeat, resync, leave, repair *redis.Script
	spendReserve, spendSettle                       *redis.Script
	// peek finds the window an admission would be refused by (see Peek).
	peek *redis.Script
	// subMu guards listeners (channel → what takes its publications, beside the store's own
	// channel) and ps, the subscription they share: one connection, and one health check,
	// per replica.
	subMu     sync.Mutex
	listeners map[string]func(payload string)
	ps        *redis.PubSub

	log *slog.Logger
	met *metrics

	nextLease atomic.Uint64
	// stateMu orders changes of availability and synced-ness, and their reports.
	stateMu   sync.Mutex
	available atomic.Bool
	synced    atomic.Bool
	// downs counts the store's moves to unavailable (written under stateMu). An answer
	// from Redis makes the store available, or synced, only if it was asked for since the last:
	// a heartbeat sent before this replica was cut off, and answered after, says nothing of
	// what it admitted alone meanwhile.
	downs atomic.Uint64
	// gone: see State.Gone (written under stateMu).
	gone atomic.Bool
	// floodedMembers is set while the replica set lists more live members than a deployment
	// can have (logged once per episode); repairLog bounds the lines of noteRepaired.
	floodedMembers atomic.Bool
	repairLog      throttle.Gate
	// repairing is held while corrupt content is deleted; the heartbeat loop waits for it
	// before it registers again, so the registration is not made before the repair that
	// deletes the epoch.
	repairing sync.Mutex
	// rewritten is downs when this replica's slots were last rewritten in Redis. Until they are
	// rewritten after it was cut off (downs differs), the releases sent settle their windows
	// but leave their slots counted: this replica's part of each limit counts them as the others
	// do, and it may take them again on its own (see flush).
	rewritten atomic.Uint64
	// wasAvailable is set once the store has been available.
	wasAvailable atomic.Bool
	live         atomic.Int64
	// failures counts admissions in a row that timed out.
	failures atomic.Int32
	// epoch is the id of the shared state this replica registered in (heartbeat loop only,
	// read by apply under epochMu); members the live replicas' ids last seen.
	epochMu sync.Mutex
	epoch   string
	members []string
	// cause is why this replica must rewrite its state, counted when it has (guarded by epochMu).
	cause string
	// heard is the number of the epoch's last wait this replica heard of, written by the
	// heartbeat loop: a heartbeat confirms only waits that started before it took its view (see
	// luaHeartbeat).
	heard atomic.Int64
	// admitting and admittingTokens count the admissions sent whose outcome this replica has not
	// recorded yet (Redis may hold them already); sent, sentTokens, applied and appliedTokens
	// count admissions sent and queued operations applied, ever. The heartbeat's check of this
	// replica's part in Redis allows for what they may change meanwhile.
	admitting, admittingTokens atomic.Int64
	sent, sentTokens           atomic.Int64
	applied, appliedTokens     atomic.Int64
	lastErr                    atomic.Pointer[ErrorInfo]
	// local counts admissions being decided without Redis (LocalStarted): until they have
	// ended and their leases are recorded in Redis, this replica does not tell the epoch that
	// Redis counts all it holds.
	local       atomic.Int64
	localStarts atomic.Int64

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
	// sending is how many settlements at the front of pending (when drops was sendDrops) a call
	// under way may release slots of: Redis may apply them at any moment.
	sending, sendDrops int64
	// spendPending are spend settlements not sent yet; spend holds the spend additions not sent
	// yet (see spend.go).
	spendPending []spendOp
	spend        spendShared
	// skewLogged is set while this replica's clock is known to differ from Redis's.
	skewLogged atomic.Bool
	kick       chan struct{}
	probe      chan struct{}
	// beatNow asks for a heartbeat at once (the epoch waits for this replica's confirmation).
	beatNow chan struct{}
	// back wakes the settlement loop from its wait between retries: Redis answers again.
	back chan struct{}
	// reload asks the heartbeat loop to load the scripts again (Redis answered NOSCRIPT).
	reload chan struct{}
	// scripts are the sources of the scripts loaded before each registration (see prepare);
	// refusedLoad is set once Redis refused to load them (logged once).
	scripts     []string
	refusedLoad atomic.Bool
	// tried is closed once the first registration was attempted.
	tried     chan struct{}
	triedOnce sync.Once

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

// leasedPool is the connection pool's size per Redis node with leased admission.
const leasedPool = 8

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
	// Exact admission calls Redis from every request in flight; leased admission only from its
	// loops (lease rounds, heartbeats, usage and quota), a few calls at once. Every idle
	// connection costs Redis a little each second, and a fleet's replicas add up: 30 replicas
	// with 32 each kept about 1 000 connections open on every node.
	pool := max(32, 10*runtime.GOMAXPROCS(0))
	if o.Leased {
		pool = leasedPool
	}
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
		beatNow: make(chan struct{}, 1), back: make(chan struct{}, 1), tried: make(chan struct{}),
		reload: make(chan struct{}, 1), scripts: scriptSources(o.Leased),
		admit: redis.NewScript(luaAdmit), settle: redis.NewScript(luaSettle), peek: redis.NewScript(luaPeek),
		heartbeat: redis.NewScript(luaHeartbeat), resync: redis.NewScript(luaResync), leave: redis.NewScript(luaLeave),
		repair:       redis.NewScript(luaRepair),
		spendReserve: redis.NewScript(luaSpendReserve), spendSettle: redis.NewScript(luaSpendSettle),
	}
	s.keys.replicas = s.tag + ":r"
	s.keys.leases = s.tag + ":l:" + o.ReplicaID
	s.keys.comps = s.tag + ":rc:" + o.ReplicaID
	s.keys.seq = s.tag + ":seq"
	s.keys.epoch = s.tag + ":e"
	s.keys.channel = s.tag + ":free"
	s.met = newMetrics()
	s.met.onError = func(op string, err error) { s.noteError(op, err.Error()) }
	s.live.Store(1)
	s.gone.Store(true)
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

// Synced reports whether the shared counts alone decide admissions (see State.Synced).
func (s *Store) Synced() bool { return s.synced.Load() }

// Live returns the live replicas last seen (at least 1).
func (s *Store) Live() int { return int(max(s.live.Load(), 1)) }

// ReplicaID returns this replica's id.
func (s *Store) ReplicaID() string { return s.o.ReplicaID }

// NextLease returns a lease id unused by this replica.
func (s *Store) NextLease() uint64 { return s.nextLease.Add(1) }

// LastError returns the last call to Redis that failed, nil if none has.
func (s *Store) LastError() *ErrorInfo { return s.lastErr.Load() }

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
	var tokens int64
	for i := range a.Slots {
		sl := &a.Slots[i]
		k := s.slotKey(sl.Name)
		ls[i] = leaseSlot{key: k, tokens: sl.Tokens}
		tokens += sl.Tokens
		keys = append(keys, k)
		args = append(args, len(keys), sl.Max, sl.MaxTokens, sl.Tokens, b01(sl.Shadow))
	}
	for i := range a.Windows {
		w := &a.Windows[i]
		keys = append(keys, s.windowKey(w))
		args = append(args, len(keys), w.Capacity, w.Debt, slotMillis(w.Length), w.Amount, b01(w.Shadow))
	}
	// Until its outcome is recorded here, Redis may hold this admission's slots while this
	// replica's lease record does not.
	s.admitting.Add(1)
	s.admittingTokens.Add(tokens)
	s.sent.Add(1)
	s.sentTokens.Add(tokens)
	cctx, cancel := context.WithTimeout(ctx, s.o.Timeout)
	start := time.Now()
	res, err := s.run(cctx, s.admit, keys, args...).Int64Slice()
	cancel()
	s.met.observe("admit", start, err)
	if err != nil {
		// The script may have run without its answer reaching us: undo it in the background,
		// after anything queued (undoing a lease Redis never recorded does nothing).
		s.enqueue(settlement{lease: a.Lease, slots: ls, windows: append([]Window(nil), a.Windows...), undo: true})
		s.admitted(tokens)
		if ctx.Err() == nil {
			s.fail("admit", err, s.typed(keys))
		}
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	s.failures.Store(0)
	if len(res) < 4 {
		s.admitted(tokens)
		return fmt.Errorf("%w: short reply", ErrUnavailable)
	}
	switch res[0] {
	case 3:
		s.admitted(tokens)
		s.lost("admission found this replica unregistered (or its own count in a compartment corrupt)", causeExpired)
		return fmt.Errorf("%w: replica not registered", ErrUnavailable)
	case 1:
		s.admitted(tokens)
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
		s.admitted(tokens)
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
	s.admitted(tokens)
	s.met.leases.Set(float64(len(s.leases)))
	s.leaseMu.Unlock()
	return nil
}

// admitted says an admission's outcome is recorded here (see admitting).
func (s *Store) admitted(tokens int64) {
	s.admitting.Add(-1)
	s.admittingTokens.Add(-tokens)
}

// typed pairs an admission's or settlement's keys (the four of every call, then compartment and
// window keys, all hashes) with the types the scripts write them as, for a repair.
func (s *Store) typed(keys []string) []typedKey {
	out := make([]typedKey, 0, len(keys)+1)
	for i, k := range keys {
		t := "hash"
		switch {
		case i == 0:
			t = "zset"
		case i == 2:
			t = "set"
		case i == 3:
			t = "counter"
		}
		out = append(out, typedKey{k, t})
	}
	return append(out, typedKey{s.keys.epoch, "hash"})
}

// typedKey is a key and the type the scripts write it as.
type typedKey struct{ key, typ string }

// slotMillis is a window's slot length in milliseconds (a sixtieth, at least 1).
func slotMillis(d time.Duration) int64 { return max(d.Milliseconds()/60, 1) }

// Track records a lease admitted without Redis (while it was unavailable): it is recorded in
// Redis with the next settlements sent, and counted by every rewrite of this replica's leases.
func (s *Store) Track(id uint64, slots []Slot) {
	ls := make([]leaseSlot, len(slots))
	for i := range slots {
		ls[i] = leaseSlot{key: s.slotKey(slots[i].Name), tokens: slots[i].Tokens}
	}
	s.leaseMu.Lock()
	s.leases[id] = lease{slots: ls}
	s.met.leases.Set(float64(len(s.leases)))
	// Queued under the lease lock: the heartbeat's view of what this replica holds and of what
	// is still to be sent is taken under it too.
	s.enqueue(settlement{lease: id, actual: -1, slots: ls, record: true})
	s.leaseMu.Unlock()
}

// Unsent returns, per compartment, how much more Redis counts for this replica than it holds:
// the slots and tokens of releases queued and not sent yet, less those of leases admitted
// without Redis and not recorded there yet. Other replicas' view of this one is what Redis
// counts (as last published). The undoing of an admission whose answer was lost is left out:
// Redis may never have counted it; so are releases Redis may have applied or may apply at any
// moment (sent in a call under way, or in one whose answer was lost): counting them would give
// this replica slots the others no longer count. Once this replica is cut off, the releases it
// sends leave their slots counted until it rewrites them (see flush): what Unsent counts stays
// counted in Redis.
func (s *Store) Unsent() map[string][2]int64 {
	prefix := s.tag + ":c:"
	out := map[string][2]int64{}
	s.pendMu.Lock()
	defer s.pendMu.Unlock()
	skip := s.sending - (s.drops - s.sendDrops)
	for i, st := range s.pending {
		sign := int64(1)
		switch {
		case st.undo:
			continue
		case st.record:
			// Counted until Redis surely has it.
			sign = -1
		case st.lost || int64(i) < skip:
			continue
		}
		for _, sl := range st.slots {
			name := strings.TrimPrefix(sl.key, prefix)
			v := out[name]
			v[0] += sign
			v[1] += sign * sl.tokens
			out[name] = v
		}
	}
	return out
}

// LocalStarted says an admission is about to be decided without Redis (it may end with Track),
// and reports whether it may: not once the store is available again, when it must go through
// Redis instead. LocalEnded says it was decided. While any is being decided, this replica does
// not confirm to the epoch that Redis counts everything it holds.
func (s *Store) LocalStarted() bool {
	s.local.Add(1)
	s.localStarts.Add(1)
	// Checked after counting it: a heartbeat that read no admission being decided alone read
	// it after the store was available again, and then this one sees it available.
	if s.available.Load() {
		s.local.Add(-1)
		return false
	}
	return true
}

// LocalEnded: see LocalStarted.
func (s *Store) LocalEnded() { s.local.Add(-1) }

// Settle queues the settlement of lease id: its slots released, its windows settled from the
// reservation to actual tokens. windows carries each window's limits as at admission (Amount is
// ignored; windows is copied); pass nil for a lease admitted without Redis. It never blocks.
func (s *Store) Settle(id uint64, actual int64, windows []Window) {
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	l, ok := s.leases[id]
	delete(s.leases, id)
	s.met.leases.Set(float64(len(s.leases)))
	if !ok {
		return
	}
	s.enqueue(settlement{lease: id, actual: max(actual, 0), slots: l.slots, windows: append([]Window(nil), windows...)})
}

func (s *Store) enqueue(st settlement) {
	s.pendMu.Lock()
	dropped := false
	if len(s.pending) >= s.o.MaxPending {
		// Redis has been gone long: forget the oldest settlement. Its slots come back when this
		// replica rewrites its leases; its budget correction is lost (counted).
		copy(s.pending, s.pending[1:])
		s.pending = s.pending[:len(s.pending)-1]
		s.drops++
		s.met.dropped.Inc()
		dropped = true
	}
	s.pending = append(s.pending, st)
	s.met.queue.Set(float64(len(s.pending)))
	s.pendMu.Unlock()
	if dropped && s.available.Load() {
		// Its slots would stay taken in Redis: rewrite this replica's leases.
		go s.setUnavailable("settlements dropped", nil, false)
	}
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// noteFailure counts a failed call on the request path; three timeouts in a row, or any
// failure that is not a timeout, make the store unavailable until it registers again.
func (s *Store) noteFailure(err error) { s.fail("call", err, nil) }

// fail records a failed call to Redis and decides what it means: a timeout on the request path
// makes the store unavailable at the third in a row (one slow answer makes only its request ask
// again), a heartbeat's at once; Redis refusing a call because a key holds what the
// scripts never write is corrupt content, repaired (keys lists what the call touched, with
// their types) as a loss of the state; anything else makes the store unavailable at once. The
// reason logged says which.
func (s *Store) fail(op string, err error, keys []typedKey) {
	var why string
	// Gone, not just slow (see State.Gone): all but timeouts on the request path, and corrupt
	// content (Redis answers).
	gone := true
	switch kind, detail := classify(err); kind {
	case errTimeout:
		if op == "heartbeat" {
			why = "Redis did not answer a heartbeat in time"
			break
		}
		if s.failures.Add(1) < 3 {
			return
		}
		why, gone = "Redis did not answer three calls in a row in time ("+op+")", false
	case errCorrupt:
		// Unavailable first, for the reason it is: the repair deletes the epoch, and a heartbeat
		// that found the registration gone before this would log a loss of state instead.
		s.repairing.Lock()
		defer s.repairing.Unlock()
		s.setUnavailable("Redis refused a call on corrupt content ("+op+")", err, false)
		s.repairKeys(op, keys, detail)
		return
	case errRefused:
		why = "Redis refused a call (" + op + ")"
	default:
		why = "could not reach Redis (" + op + ")"
	}
	s.setUnavailable(why, err, gone)
}

// Kinds of failed calls.
const (
	errTimeout = iota
	errRefused
	errCorrupt
	errConnection
)

// classify says what kind of failure err is, and for corrupt content the message.
func classify(err error) (int, string) {
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
		// go-redis reports a read that ran past the deadline as a net.Error, not as the context's.
		return errTimeout, ""
	}
	var re redis.Error
	if errors.As(err, &re) {
		msg := re.Error()
		// WRONGTYPE: a key of ours holds another type; the other two are what a script meets in
		// a value it cannot use (a string where a count belongs, a record that is not JSON).
		if strings.HasPrefix(msg, "WRONGTYPE") || strings.Contains(msg, "not an integer") || strings.Contains(msg, "user_script") {
			return errCorrupt, msg
		}
		return errRefused, msg
	}
	return errConnection, ""
}

// Hint says what to check about a failure to reach or use Redis, "" when there is nothing
// particular to say.
func Hint(err error) string {
	if err == nil {
		return ""
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "WRONGPASS"), strings.Contains(msg, "NOAUTH"), strings.Contains(msg, "unauthenticated"),
		strings.Contains(msg, "NOPERM"):
		return "Redis refused this replica's credentials or their permissions: check cluster.username, and the password in the variable cluster.password_env names"
	case strings.Contains(msg, "connection refused"), strings.Contains(msg, "no such host"), strings.Contains(msg, "i/o timeout"),
		strings.Contains(msg, "network is unreachable"):
		return "nothing answered at the address: check cluster.addresses (and cluster.mode) and that Redis runs"
	case strings.Contains(msg, "certificate"), strings.Contains(msg, "tls:"):
		return "the TLS handshake failed: check cluster.tls"
	}
	return ""
}

// repairKeys deletes the keys among keys that hold what the scripts never write (and then the
// epoch, so that every replica rewrites its slots), and logs what it deleted.
func (s *Store) repairKeys(op string, keys []typedKey, detail string) {
	if len(keys) == 0 {
		return
	}
	ks := make([]string, len(keys))
	args := make([]any, 2, 2+len(keys))
	args[0], args[1] = s.keys.channel, s.keys.epoch
	for i, k := range keys {
		ks[i] = k.key
		args = append(args, k.typ)
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	bad, err := s.run(ctx, s.repair, ks, args...).StringSlice()
	s.met.observe("repair", start, err)
	if err != nil || len(bad) == 0 {
		return
	}
	s.met.lost.WithLabelValues(causeCorrupt).Inc()
	s.log.Error("the shared state in Redis held content no replica writes: deleted it, and every replica rewrites the slots it holds",
		"replica", s.o.ReplicaID, "op", op, "error", detail, "deleted", bad)
}

// Causes of a loss of this replica's shared state, for the metric.
const (
	causeLost     = "lost"
	causeExpired  = "expired"
	causeCorrupt  = "corrupt"
	causeReplaced = "replaced"
)

// lost marks this replica's shared state as lost: unavailable until its leases are rewritten.
// cause is counted once the rewrite tells whether Redis lost the whole state instead.
func (s *Store) lost(why, cause string) {
	s.epochMu.Lock()
	if s.cause == "" {
		s.cause = cause
	}
	s.epochMu.Unlock()
	s.setUnavailable(why, nil, false)
}

// setUnavailable reports the store unavailable (and so not synced), logging why and err; gone
// says Redis is gone, not just slow (see State.Gone).
func (s *Store) setUnavailable(why string, err error, gone bool) {
	s.stateMu.Lock()
	defer s.stateMu.Unlock()
	if !s.available.Load() {
		// Already cut off: a call made before that fails late says nothing new.
		if gone {
			s.goneLocked()
		}
		return
	}
	s.downs.Add(1)
	s.gone.Store(gone)
	s.setStateLocked(false, false, why, err)
}

// Gone reports that the store is unavailable and found Redis gone, not just slow for this
// replica (see State.Gone).
func (s *Store) Gone() bool { return !s.available.Load() && s.gone.Load() }

// setGone says Redis did not answer a call given the write timeout while the store is
// unavailable (see State.Gone).
func (s *Store) setGone() {
	s.stateMu.Lock()
	defer s.stateMu.Unlock()
	if !s.available.Load() {
		s.goneLocked()
	}
}

// goneLocked reports Redis gone, once per outage. Called with stateMu held.
func (s *Store) goneLocked() {
	if s.gone.Swap(true) || s.o.OnState == nil {
		return
	}
	s.o.OnState(State{Live: s.Live(), Gone: true})
}

// setAvailable moves the store to available, and synced as given, on an answer from Redis to a
// call made when downs was since: it reports whether it did (not when the store was found
// unavailable after the call was made, or is closed).
func (s *Store) setAvailable(since uint64, synced bool) bool {
	s.stateMu.Lock()
	defer s.stateMu.Unlock()
	if s.closed.Load() || s.downs.Load() != since {
		return false
	}
	s.setStateLocked(true, synced, "", nil)
	return true
}

// setStateLocked moves the store to available and synced as given (synced implies available),
// tells the caller and logs the change. A move to unavailable is told before admissions see it.
// Called with stateMu held.
func (s *Store) setStateLocked(available, synced bool, why string, err error) {
	synced = synced && available
	wasAvailable, wasSynced := s.available.Load(), s.synced.Load()
	if wasAvailable == available && wasSynced == synced {
		return
	}
	if available {
		s.gone.Store(false)
	}
	st := State{Available: available, Synced: synced, Live: s.Live(), Gone: !available && s.gone.Load()}
	if !available {
		s.synced.Store(false)
		s.met.synced.Set(0)
		if s.o.OnState != nil {
			s.o.OnState(st)
		}
		s.available.Store(false)
		s.met.available.Set(0)
		if wasAvailable {
			s.tellAvailability(false)
		}
		if wasAvailable {
			s.log.Warn("cluster state unavailable: admissions follow cluster.on_unavailable until Redis answers again",
				"replica", s.o.ReplicaID, "reason", why, "error", err, "live_replicas_last_seen", s.Live())
		}
		select {
		case s.probe <- struct{}{}:
		default:
		}
		return
	}
	if !wasAvailable {
		// Leases that are not valid hold nothing once Redis answers: say so before admissions
		// can see it answer.
		s.tellAvailability(true)
	}
	s.available.Store(true)
	s.synced.Store(synced)
	s.met.available.Set(1)
	if !wasAvailable {
		select {
		case s.back <- struct{}{}:
		default:
		}
	}
	s.met.synced.Set(b2f(synced))
	if s.o.OnState != nil {
		s.o.OnState(st)
	}
	switch {
	case !wasAvailable && synced:
		msg := "cluster state shared: limits are enforced across replicas"
		if s.wasAvailable.Swap(true) {
			msg = "cluster state shared again: limits are enforced across replicas"
		}
		s.log.Info(msg, "replica", s.o.ReplicaID, "live_replicas", s.Live())
	case !wasAvailable:
		s.wasAvailable.Store(true)
		s.log.Info("registered in Redis; until every replica has rewritten the slots it holds, this replica keeps to its part of each limit",
			"replica", s.o.ReplicaID, "live_replicas", s.Live())
	case synced:
		s.log.Info("every replica's slots are counted in Redis again: limits are enforced across replicas",
			"replica", s.o.ReplicaID, "live_replicas", s.Live())
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// Probing Redis while it is unavailable: the first retry after probeMin (or the heartbeat, if
// shorter), each next one twice as late, up to probeMax (or the heartbeat, if shorter).
const (
	probeMin = 250 * time.Millisecond
	probeMax = 2 * time.Second
)

// heartbeatLoop renews this replica's registration, rewrites its leases when Redis lost them
// (or may not count them all), and probes, backing off, while Redis is unavailable.
func (s *Store) heartbeatLoop() {
	defer s.wg.Done()
	every := s.o.Heartbeat
	base := min(every, probeMin)
	// Backing off no further than a heartbeat: a replica that can reach Redis registers again
	// within a heartbeat, well within the wait the epoch keeps for it.
	most := max(base, min(probeMax, every))
	backoff := base
	needResync := true
	var lastFailure string
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		case <-s.probe:
		case <-s.beatNow:
		case <-s.reload:
			// Redis lost the scripts but may hold the state: load them, and keep the timer.
			_ = s.prepare(false)
			continue
		}
		// Read before anything is asked of Redis: only answers to calls made since the store was
		// last found unavailable can make it available (see downs).
		since := s.downs.Load()
		if !s.available.Load() {
			needResync = true
		}
		if needResync {
			// A repair under way ends before this replica registers again.
			s.repairing.Lock()
			//lint:ignore SA2001 a barrier: it waits for the repair, and guards nothing after
			s.repairing.Unlock()
			// The first requests after the registration find the scripts in Redis and the
			// pool's connections open.
			waiting, err := int64(0), s.prepare(true)
			if err == nil {
				waiting, err = s.doResync()
			}
			s.triedOnce.Do(func() { close(s.tried) })
			if err != nil {
				if kind, _ := classify(err); kind != errCorrupt {
					s.setGone()
				}
				if msg := err.Error(); msg != lastFailure {
					lastFailure = msg
					s.log.Warn("could not register this replica in Redis: admissions follow cluster.on_unavailable; retrying with backoff",
						"replica", s.o.ReplicaID, "error", err, "hint", Hint(err), "retry_in", backoff.String(), "retry_max", most.String())
				}
				t.Reset(backoff)
				backoff = min(2*backoff, most)
				continue
			}
			lastFailure = ""
			if !s.setAvailable(since, waiting == 0) {
				// Closed meanwhile.
				t.Reset(backoff)
				continue
			}
			backoff, needResync = base, false
			if waiting > 0 {
				// Confirm this replica's slots as soon as what it admitted alone is recorded.
				t.Reset(0)
				continue
			}
		} else if hb, err := s.beat(); err != nil {
			s.fail("heartbeat", err, s.beatKeys())
			if !s.available.Load() {
				needResync = true
			}
			t.Reset(base)
			continue
		} else if hb.problem != "" {
			if hb.cause == causeCorrupt {
				s.log.Warn("rewriting the slots this replica holds in Redis", "replica", s.o.ReplicaID, "reason", hb.problem)
			}
			s.lost(hb.problem, hb.cause)
			needResync = true
			t.Reset(0)
			continue
		} else if hb.waiting == 0 && hb.recorded {
			s.setAvailable(since, true)
		} else if hb.again {
			t.Reset(0)
			continue
		}
		next := every
		if s.available.Load() && !s.synced.Load() {
			// Waiting for the other replicas: ask often (a publication says so at once).
			next = base
		}
		t.Reset(next)
	}
}

// beatKeys are the keys every heartbeat touches, with their types.
func (s *Store) beatKeys() []typedKey {
	return []typedKey{{s.keys.replicas, "zset"}, {s.keys.leases, "hash"}, {s.keys.comps, "set"}, {s.keys.seq, "counter"}, {s.keys.epoch, "hash"}}
}

// beatResult is what a heartbeat found.
type beatResult struct {
	// waiting is how many replicas the epoch still waits for; recorded says everything this
	// replica holds was recorded in Redis when the heartbeat ran; again says to confirm again at
	// once (the epoch's wait started after this heartbeat's view was taken).
	waiting         int64
	recorded, again bool
	// problem, when set, is why this replica must rewrite its slots, and cause its kind.
	problem, cause string
}

// holdings is this replica's own view of what it holds, taken for the heartbeat's check.
type holdings struct {
	keys   []string
	n, t   []int64
	idx    map[string]int
	slackN int64
	slackT int64
	// records counts leases admitted without Redis and not recorded there yet, local the
	// admissions being decided without Redis.
	records int
	local   int64
	// sent and applied are the counters when the view was taken.
	sent, sentTokens, applied, appliedTokens int64
}

// holding takes this replica's view of its slots per compartment, and how far Redis may
// legitimately differ from it: by the admissions whose outcome is not recorded yet and the
// operations queued (and, after, by what was sent or applied until the heartbeat ran).
func (s *Store) holding() holdings {
	h := holdings{idx: map[string]int{}}
	// Read before the view: a local admission that ended before has its record queued (or
	// sent) by the time the view is taken.
	h.local = s.local.Load()
	// Read before the view: what changes after it is allowed for by their growth.
	h.sent, h.sentTokens = s.sent.Load(), s.sentTokens.Load()
	h.applied, h.appliedTokens = s.applied.Load(), s.appliedTokens.Load()
	s.leaseMu.Lock()
	h.slackN, h.slackT = s.admitting.Load(), s.admittingTokens.Load()
	for _, l := range s.leases {
		for _, sl := range l.slots {
			i, ok := h.idx[sl.key]
			if !ok {
				i = len(h.keys)
				h.idx[sl.key] = i
				h.keys = append(h.keys, sl.key)
				h.n, h.t = append(h.n, 0), append(h.t, 0)
			}
			h.n[i]++
			h.t[i] += sl.tokens
		}
	}
	s.pendMu.Lock()
	for _, st := range s.pending {
		h.slackN++
		if st.record {
			h.records++
		}
		for _, sl := range st.slots {
			h.slackT += sl.tokens
		}
	}
	s.pendMu.Unlock()
	s.leaseMu.Unlock()
	return h
}

// beat runs one heartbeat.
func (s *Store) beat() (beatResult, error) {
	// Read before the view: the view confirms the waits heard of so far, and no later one.
	heard := s.heard.Load()
	h := s.holding()
	s.epochMu.Lock()
	epoch := s.epoch
	s.epochMu.Unlock()
	keys := []string{s.keys.replicas, s.keys.leases, s.keys.comps, s.keys.seq, s.keys.epoch}
	keys = append(keys, h.keys...)
	var names []string
	if s.o.Watched != nil {
		names = s.o.Watched()
		for _, n := range names {
			keys = append(keys, s.slotKey(n))
		}
	}
	// Confirm, if the epoch waits for this replica, only with nothing admitted without Redis
	// left to record: every admission through Redis is counted there as it is made.
	confirm := h.records == 0 && h.local == 0
	ctx, cancel := context.WithTimeout(s.ctx, s.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	res, err := s.run(ctx, s.heartbeat, keys, s.o.ReplicaID, s.o.LeaseTTL.Milliseconds(), s.keys.channel, s.tag,
		epoch, b01(confirm), len(h.keys), len(names), heard).Slice()
	s.met.observe("heartbeat", start, err)
	if err != nil {
		return beatResult{}, err
	}
	ints := func(i int) int64 {
		if i < len(res) {
			if v, ok := res[i].(int64); ok {
				return v
			}
		}
		return 0
	}
	// The reply's fixed part, then this replica's parts, the most of its other parts, the totals
	// asked for, and the members.
	const head = 7
	m := len(h.keys)
	if len(res) < head+2+2*m+2*len(names) {
		return beatResult{}, errors.New("short heartbeat reply")
	}
	if ints(0) == 0 {
		return beatResult{problem: "this replica's registration in Redis was gone (Redis lost its state or restarted, or this replica missed its heartbeats)", cause: causeExpired}, nil
	}
	out := beatResult{waiting: ints(3), recorded: confirm}
	if g := ints(6); g > heard {
		// A wait this view could not confirm (one this replica had not heard of) may be under
		// way: confirm again at once.
		s.heard.Store(g)
		out.again = confirm && out.waiting > 0
	}
	if n := ints(1); n < 0 {
		s.noteMembership(-1)
	} else {
		s.noteMembership(n)
		ids := make([]string, 0, n)
		for _, v := range res[head+2+2*m+2*len(names):] {
			if id, ok := v.(string); ok {
				ids = append(ids, id)
			}
		}
		s.epochMu.Lock()
		s.members = ids
		s.epochMu.Unlock()
	}
	if bogus := ints(5); bogus > 0 {
		s.met.lost.WithLabelValues(causeCorrupt).Inc()
		s.log.Warn("removed members from the replica set in Redis that no replica registered (their registration ran further ahead than any lease lasts, or too many had expired to drop one by one)",
			"replica", s.o.ReplicaID, "removed", bogus)
	}
	// What Redis holds as this replica's part, against what it holds: beyond what the
	// admissions and settlements under way may change, it cannot be.
	dn := h.slackN + s.sent.Load() - h.sent + s.applied.Load() - h.applied
	dt := h.slackT + s.sentTokens.Load() - h.sentTokens + s.appliedTokens.Load() - h.appliedTokens
	off := func(got, want, slack int64) bool { return got < 0 || got > want+slack || got < want-slack }
	for i := range m {
		gn, gt := ints(head+2*i), ints(head+1+2*i)
		if off(gn, h.n[i], dn) || off(gt, h.t[i], dt) {
			out.problem = fmt.Sprintf("Redis counts %d slots and %d tokens for this replica in %s, where it holds %d and %d", gn, gt, h.keys[i], h.n[i], h.t[i])
			out.cause = causeCorrupt
			return out, nil
		}
	}
	if xn, xt := ints(head+2*m), ints(head+1+2*m); off(xn, 0, dn) || off(xt, 0, dt) {
		out.problem = fmt.Sprintf("Redis counts up to %d slots and %d tokens for this replica in compartments where it holds none", xn, xt)
		out.cause = causeCorrupt
		return out, nil
	}
	if s.o.OnCounts != nil {
		seq := ints(2)
		for i, n := range names {
			j := head + 2 + 2*m + 2*i
			s.o.OnCounts(n, seq, ints(j), ints(j+1))
		}
	}
	return out, nil
}

// noteMembership records the live replicas last seen; -1 says Redis listed more than a
// deployment can have (the count last seen stays).
func (s *Store) noteMembership(n int64) {
	if n < 0 {
		s.met.lost.WithLabelValues(causeCorrupt).Inc()
		msg := fmt.Sprintf("more than %d live members in the replica set: corrupt content, ignored (the shares stay those of %d replicas)", MaxReplicas, s.Live())
		s.noteError("heartbeat", msg)
		if !s.floodedMembers.Swap(true) {
			// Once per episode: every heartbeat finds it until the members expire or are removed.
			s.log.Error(msg, "replica", s.o.ReplicaID, "key", s.keys.replicas)
		}
		return
	}
	if s.floodedMembers.Swap(false) {
		s.log.Info("the replica set holds a believable number of live members again", "replica", s.o.ReplicaID, "live_replicas", n)
	}
	s.setLive(n)
}

// noteRepaired reports content in Redis no replica writes that a lease script deleted, what
// this replica held there rewritten from its own state in the same call: counted, kept as the
// last error and logged (at most once a minute, with the number of repairs held back).
func (s *Store) noteRepaired(op, key string) {
	s.met.lost.WithLabelValues(causeCorrupt).Inc()
	msg := "the shared state in Redis held content no replica writes: deleted it, and this replica rewrote what it holds there"
	s.noteError(op, msg+" ("+key+")")
	if ok, held := s.repairLog.Allow(time.Now(), time.Minute); ok {
		s.log.Error(msg, "replica", s.o.ReplicaID, "op", op, "key", key, "repairs_not_logged", held)
	}
}

func (s *Store) setLive(n int64) {
	n = min(max(n, 1), MaxReplicas)
	if old := s.live.Swap(n); old != n {
		s.met.live.Set(float64(n))
		s.stateMu.Lock()
		if s.o.OnState != nil && s.available.Load() {
			s.o.OnState(State{Available: true, Synced: s.synced.Load(), Live: int(n)})
		}
		s.stateMu.Unlock()
	}
}

// doResync rewrites this replica's leases from its own record, with admissions held off, and
// returns how many replicas the epoch still waits for. Settlements queued before it are sent
// first.
func (s *Store) doResync() (waiting int64, err error) {
	s.rewrite.Lock()
	defer s.rewrite.Unlock()
	// Read before the rewrite: a cut after it is not covered by it.
	since := s.downs.Load()
	if err := s.flush(); err != nil {
		return 0, err
	}
	if waiting, err = s.rewriteLeases(false); err == nil {
		s.rewritten.Store(since)
	}
	return waiting, err
}

// rewriteLeases runs the resync script; cut says to rewrite as a replica cut off whatever it
// looks like. Called with the rewrite lock held.
func (s *Store) rewriteLeases(cut bool) (waiting int64, err error) {
	// Cut off: this replica was available before (and so has been cut off since, or it would
	// not rewrite), or admitted requests (or is admitting some) before it first registered. It
	// may then hold what Redis does not count, and the other replicas too.
	s.epochMu.Lock()
	known := append([]string(nil), s.members...)
	s.epochMu.Unlock()
	if s.wasAvailable.Load() && len(known) < s.Live() {
		// It knew more replicas than it can name (it has not had their ids yet): should the
		// state be lost, the wait lasts its whole term.
		known = append(known, unnamedReplica)
	}
	keys := []string{s.keys.replicas, s.keys.leases, s.keys.comps, s.keys.seq, s.keys.epoch}
	args := []any{s.o.ReplicaID, s.o.LeaseTTL.Milliseconds(), s.keys.channel, s.tag, "0", len(known)}
	for _, id := range known {
		args = append(args, id)
	}
	idx := map[string]int{}
	starts := s.localStarts.Load()
	s.leaseMu.Lock()
	cutoff := cut || s.wasAvailable.Load() || len(s.leases) > 0 || s.local.Load() > 0
	args[4] = b01(cutoff)
	// Done: the leases rewritten are all this replica holds. A replica cut off may still be
	// admitting requests without Redis until it is available again: the epoch then waits for
	// it to confirm, with a heartbeat, once they are recorded.
	args = append(args, b01(!cutoff), len(s.leases))
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
	res, err := s.run(ctx, s.resync, keys, args...).Slice()
	s.met.observe("resync", start, err)
	if err != nil {
		tk := s.beatKeys()
		for _, k := range keys[5:] {
			tk = append(tk, typedKey{k, "hash"})
		}
		if kind, detail := classify(err); kind == errCorrupt {
			s.repairKeys("resync", tk, detail)
		}
		return 0, err
	}
	if len(res) < 7 {
		return 0, errors.New("short resync reply")
	}
	if !cutoff && s.localStarts.Load() != starts {
		// A request was admitted without Redis meanwhile: rewrite again, as a replica cut off.
		return s.rewriteLeases(true)
	}
	live, _ := res[0].(int64)
	epoch, _ := res[2].(string)
	waiting, _ = res[3].(int64)
	lost, _ := res[5].(int64)
	heard, _ := res[6].(int64)
	s.heard.Store(heard)
	s.epochMu.Lock()
	cause := s.cause
	switch {
	case lost == 1 && s.epoch != "":
		cause = causeLost
		s.log.Warn("Redis had lost the shared state (restarted empty, flushed, or failed over to a replica without it): every replica rewrites the slots it holds, and keeps to its part of each limit until all have",
			"replica", s.o.ReplicaID, "waiting_for", waiting)
	case s.epoch != "" && s.epoch != epoch:
		cause = causeReplaced
	}
	if cause != "" {
		s.met.lost.WithLabelValues(cause).Inc()
	}
	s.epoch, s.cause = epoch, ""
	s.epochMu.Unlock()
	s.met.resyncs.Inc()
	if s.o.OnReset != nil {
		s.o.OnReset()
	}
	if live > MaxReplicas {
		live = -1
	} else {
		ids := make([]string, 0, live)
		for _, v := range res[7:] {
			if id, ok := v.(string); ok {
				ids = append(ids, id)
			}
		}
		s.epochMu.Lock()
		s.members = ids
		s.epochMu.Unlock()
	}
	s.noteMembership(live)
	return waiting, nil
}

// unnamedReplica stands for a replica whose id this one does not know: no replica has it (ids
// have no spaces).
const unnamedReplica = "(unnamed replica)"

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
			case <-s.back:
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
		// Cut off, and not rewritten since: this replica's part of each limit counts the slots
		// of its releases not sent as the others do (Unsent), and it may take them again on its
		// own. Redis must go on counting them until the rewrite: the releases settle their
		// windows and drop their leases' records, and leave the slots. Decided under pendMu, as
		// Unsent is read: a part computed before sees this call's releases as under way.
		hold := s.downs.Load() != s.rewritten.Load()
		if !hold {
			s.sending, s.sendDrops = int64(n), drops
		}
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
		var tokens int64
		for _, st := range batch {
			settles := 0
			for i := range st.windows {
				if st.windows[i].settles() {
					settles++
				}
			}
			actual := st.actual
			if st.record {
				actual = -1
			}
			slots := st.slots
			if hold && !st.record && !st.undo {
				// The undoing of a lost admission frees what nobody holds: never held back.
				slots = nil
			}
			args = append(args, strconv.FormatUint(st.lease, 10), actual, len(slots), settles)
			for _, sl := range slots {
				args = append(args, key(sl.key), sl.tokens)
				tokens += sl.tokens
			}
			for i := range st.windows {
				if w := &st.windows[i]; w.settles() {
					args = append(args, key(s.windowKey(w)), i+1, w.Capacity, w.Debt, slotMillis(w.Length))
				}
			}
		}
		ctx, cancel := context.WithTimeout(s.ctx, s.o.WriteTimeout)
		start := time.Now()
		err := s.run(ctx, s.settle, keys, args...).Err()
		cancel()
		s.met.observe("settle", start, err)
		s.pendMu.Lock()
		// Settlements dropped from the front meanwhile were among those sent.
		sent := min(max(n-int(s.drops-drops), 0), len(s.pending))
		s.sending = 0
		if err != nil {
			if !hold {
				// Redis may apply them yet, after this replica counted them as not sent.
				for i := range sent {
					s.pending[i].lost = true
				}
			}
			s.pendMu.Unlock()
			if kind, detail := classify(err); kind == errCorrupt {
				s.repairKeys("settle", s.typed(keys), detail)
			}
			return err
		}
		s.applied.Add(int64(n))
		s.appliedTokens.Add(tokens)
		s.pending = s.pending[sent:]
		s.met.queue.Set(float64(len(s.pending)))
		empty := len(s.pending) == 0
		s.pendMu.Unlock()
		if empty && s.available.Load() && !s.synced.Load() {
			// What this replica admitted alone is recorded: it may confirm its slots now.
			select {
			case s.beatNow <- struct{}{}:
			default:
			}
		}
	}
}

// subscribeLoop applies published slot totals and the epoch's news, and passes the publications
// of the other channels listened to on to their listeners.
func (s *Store) subscribeLoop() {
	defer s.wg.Done()
	for s.ctx.Err() == nil {
		s.subMu.Lock()
		channels := []string{s.keys.channel}
		for c := range s.listeners {
			channels = append(channels, c)
		}
		ps := s.client.Subscribe(s.ctx, channels...)
		s.ps = ps
		s.subMu.Unlock()
		ch := ps.Channel(redis.WithChannelHealthCheckInterval(s.healthCheck()))
		for msg := range ch {
			if msg.Channel == s.keys.channel {
				s.apply(msg.Payload)
				continue
			}
			s.subMu.Lock()
			fn := s.listeners[msg.Channel]
			s.subMu.Unlock()
			if fn != nil {
				fn(msg.Payload)
			}
		}
		s.subMu.Lock()
		s.ps = nil
		s.subMu.Unlock()
		_ = ps.Close()
		select {
		case <-s.ctx.Done():
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// healthCheck is how long the subscription may go without a publication before it is pinged,
// so that a connection that died silently is found and opened anew. Exact admission counts on
// the published totals: a heartbeat. Leased admission learns what is published (a rise of a
// bound, a replica short) from the answers to its own reports too, at least every renewal: half
// a lease ttl, longer than a renewal, is soon enough.
func (s *Store) healthCheck() time.Duration {
	if s.o.Leased {
		return max(s.o.Heartbeat, s.o.LeaseTTL/2)
	}
	return s.o.Heartbeat
}

// listen passes channel's publications to fn (from one goroutine, in order) until unlisten, on
// the subscription the store keeps for its own channel (whose key prefix channel must share,
// for a Redis Cluster to serve both from one node). Publications before listen returns may be
// missed.
func (s *Store) listen(channel string, fn func(payload string)) {
	s.subMu.Lock()
	defer s.subMu.Unlock()
	if s.listeners == nil {
		s.listeners = map[string]func(string){}
	}
	s.listeners[channel] = fn
	if s.ps != nil {
		// A subscription that fails here has failed for every channel: the loop subscribes
		// anew, to this one too.
		_ = s.ps.Subscribe(s.ctx, channel)
	}
}

// unlisten stops passing channel's publications on.
func (s *Store) unlisten(channel string) {
	s.subMu.Lock()
	defer s.subMu.Unlock()
	delete(s.listeners, channel)
	if s.ps != nil {
		_ = s.ps.Unsubscribe(s.ctx, channel)
	}
}

// apply parses one publication: "seq\n<key>\t<slots>\t<tokens>\n…", or "e\t<epoch>\t<waiting>"
// when the epoch's wait changes (or "e\t\t1" when a repair deleted it).
func (s *Store) apply(payload string) {
	if rest, ok := strings.CutPrefix(payload, "e\t"); ok {
		s.applyEpoch(rest)
		return
	}
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
		if err1 != nil || err2 != nil || n < 0 || t < 0 {
			continue
		}
		s.met.updates.Inc()
		s.o.OnCounts(k[len(prefix):], seq, n, t)
	}
}

// applyEpoch acts on news of the epoch ("<epoch>\t<waiting>"): it asks for a heartbeat at once,
// whose answer says whether this replica must confirm its slots, rewrite them, or may count on
// the shared state alone. The news itself decides nothing: it comes on a connection of its own,
// and may be older than the answers this replica last had (a wait that ended before this
// replica's own rewrite started another).
func (s *Store) applyEpoch(msg string) {
	select {
	case s.beatNow <- struct{}{}:
	default:
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
			keys := []string{s.keys.replicas, s.keys.leases, s.keys.comps, s.keys.seq, s.keys.epoch}
			start := time.Now()
			err = s.run(ctx, s.leave, keys, s.o.ReplicaID, s.keys.channel, s.tag).Err()
			s.met.observe("leave", start, err)
		}
		s.rewrite.Unlock()
	}
	s.available.Store(false)
	s.cancel()
	cerr := s.client.Close()
	s.wg.Wait()
	return errors.Join(err, cerr)
}

// Info is a point-in-time view of the store for the admin API.
type Info struct {
	ReplicaID string   `json:"replica_id"`
	Mode      string   `json:"mode"`
	Addresses []string `json:"addresses"`
	KeyPrefix string   `json:"key_prefix"`
	Available bool     `json:"available"`
	// Synced: Redis counts every replica's slots as far as this replica knows (see State).
	Synced   bool     `json:"synced"`
	Live     int      `json:"live_replicas"`
	Leases   int      `json:"leases_held"`
	Pending  int      `json:"settlements_queued"`
	Replicas []Member `json:"replicas,omitempty"`
	// ReplicasListed is how many of the registered members Replicas lists (at most
	// MaxReplicas); more are registered when it is less than ReplicasRegistered.
	ReplicasRegistered int64 `json:"replicas_registered,omitempty"`
	// LastError is the last call to Redis that failed (nil if none has).
	LastError *ErrorInfo `json:"last_error"`
	// InfoError says why the membership could not be read for this view.
	InfoError string `json:"error,omitempty"`
}

// Member is one replica registered in Redis.
type Member struct {
	ID        string    `json:"id"`
	ExpiresAt time.Time `json:"lease_expires_at"`
	Live      bool      `json:"live"`
}

// Info reports the store's state, asking Redis for the membership (bounded by WriteTimeout, and
// to MaxReplicas members).
func (s *Store) Info(ctx context.Context) Info {
	in := Info{ReplicaID: s.o.ReplicaID, Mode: string(s.o.Mode), Addresses: s.o.Addresses, KeyPrefix: s.o.KeyPrefix,
		Available: s.available.Load(), Synced: s.synced.Load(), Live: s.Live(), LastError: s.lastErr.Load()}
	s.leaseMu.Lock()
	in.Leases = len(s.leases)
	s.leaseMu.Unlock()
	s.pendMu.Lock()
	in.Pending = len(s.pending)
	s.pendMu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, s.o.WriteTimeout)
	defer cancel()
	pipe := s.client.Pipeline()
	zc := pipe.ZCard(ctx, s.keys.replicas)
	zs := pipe.ZRangeWithScores(ctx, s.keys.replicas, 0, MaxReplicas-1)
	tc := pipe.Time(ctx)
	if _, err := pipe.Exec(ctx); err != nil && zs.Err() != nil {
		in.InfoError = err.Error()
		return in
	}
	t, err := tc.Result()
	if err != nil {
		t = time.Now()
	}
	in.ReplicasRegistered = zc.Val()
	for _, z := range zs.Val() {
		id, _ := z.Member.(string)
		exp := time.UnixMilli(int64(z.Score))
		in.Replicas = append(in.Replicas, Member{ID: id, ExpiresAt: exp.UTC(), Live: !exp.Before(t)})
	}
	return in
}

// noteError records a failure to report in Info.
func (s *Store) noteError(op, msg string) {
	s.lastErr.Store(&ErrorInfo{Op: op, Message: msg, At: time.Now().UTC()})
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

// WaitRegistration waits until the first registration in Redis was attempted (or ctx ends),
// and returns nil when the store is then available, or why it is not.
func (s *Store) WaitRegistration(ctx context.Context) error {
	select {
	case <-s.tried:
	case <-ctx.Done():
		if !s.available.Load() {
			if e := s.lastErr.Load(); e != nil {
				return errors.New(e.Message)
			}
			return ctx.Err()
		}
	}
	if s.available.Load() {
		return nil
	}
	if e := s.lastErr.Load(); e != nil {
		return errors.New(e.Message)
	}
	return ErrUnavailable
}
