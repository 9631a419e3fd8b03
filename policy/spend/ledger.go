package spend

// The ledger, its reservations and the store interfaces it talks to in one file: a reservation's
// lifetime (reserve, settle or release, carry across a time-zone change) spans all three.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// Budget is one spend limit of one compartment. Values are compared and copied freely.
type Budget struct {
	// Name is the compartment's name, e.g. "tenant/acme" or "tier_feature/free/chat".
	Name   string
	Period Period
	Limit  Micros
	// Shadow counts what would be refused and refuses nothing.
	Shadow bool
}

// WindowID identifies one calendar window of one budget.
type WindowID struct {
	Budget string
	Period Period
	// Start is the window's first instant, in Unix seconds.
	Start int64
}

// Key is the window's stable text form, "<budget>|<period>|<start in Unix seconds>", for
// stores that keep windows by name.
func (w WindowID) Key() string {
	return w.Budget + "|" + w.Period.String() + "|" + strconv.FormatInt(w.Start, 10)
}

// ParseWindowKey reads a window back from Key's text form (the budget may itself hold "|").
func ParseWindowKey(key string) (WindowID, bool) {
	rest, start, ok1 := cutLast(key)
	budget, period, ok2 := cutLast(rest)
	p, ok3 := ParsePeriod(period)
	at, err := strconv.ParseInt(start, 10, 64)
	if !ok1 || !ok2 || !ok3 || err != nil || budget == "" {
		return WindowID{}, false
	}
	return WindowID{Budget: budget, Period: p, Start: at}, true
}

func cutLast(s string) (before, after string, ok bool) {
	i := strings.LastIndexByte(s, '|')
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+1:], true
}

// Window is a budget's window with the limit it has.
type Window struct {
	ID    WindowID
	Limit Micros
	// End is when the window ends and the budget resets.
	End    time.Time
	Shadow bool
	// AllowSingleOverrun lets one request whose worst case is more than the whole limit run in
	// a window nothing was spent or reserved in yet (spend.allow_single_overrun); otherwise a
	// reservation that does not fit is refused even by an untouched window.
	AllowSingleOverrun bool
}

// Usage is what a window holds.
type Usage struct {
	Window
	// Spent is the settled cost (including restored spend).
	Spent Micros
	// Reserved is the worst-case cost of admitted requests not settled yet.
	Reserved Micros
	// Leased is, with leased cluster admission, what replicas' chunks of the window hold
	// unused: counted against the limit, as Reserved is.
	Leased Micros
	// Local is, with a Shared store, what this process counted in its own memory because the
	// store did not answer in time (included in Spent and Reserved while Pending says the store
	// does not have it yet); zero otherwise.
	Local Local
}

// Local is what a process counted in one window of its own memory while its shared store did
// not answer.
type Local struct {
	// Spent and Reserved are what it counted there, settled and in flight.
	Spent, Reserved Micros
	// Pending is what of it the shared store does not have yet.
	Pending Pending
}

// Pending is spend counted in a process's memory that its shared store has not applied yet.
type Pending struct {
	// Reserved is the change to the reserved sum (negative once such a reservation ended) and
	// Settled the settled spend.
	Reserved, Settled Micros
}

// Shared is a Store outside this process (Redis) that every replica of a fleet keeps its sums
// in. It may fail to answer a reservation: the Ledger then decides it in its own memory, against
// this replica's share of what the store last showed left, and hands what it counted there to
// AddLocal, so that the store counts it too once it answers.
type Shared interface {
	Store
	// Replicas returns the live replicas the budgets are shared among, at least 1.
	Replicas() int
	// Gone reports that the store found its backend gone, not merely slow for this process:
	// only then may a reservation it could not take be decided in this process's memory (see
	// Ledger.Reserve). While it is only slow, others may still reserve there.
	Gone() bool
	// Seen returns the window's sums as the store last reported them; ok is false when it never
	// did (or the window has ended).
	Seen(id WindowID, now time.Time) (u Usage, ok bool)
	// AddLocal queues spend counted in this process's memory, to be added to every window of ws:
	// reserved (negative when such a reservation ended) and settled. The store applies each
	// addition exactly once, in order, as soon as it answers. It never blocks.
	AddLocal(ws []Window, reserved, settled Micros)
	// Pending returns what AddLocal queued that the store has not applied yet, by window.
	Pending() map[WindowID]Pending
	// PendingTotal returns the sum of what AddLocal queued that the store has not applied yet,
	// reserved plus settled, each addition once whatever its windows.
	PendingTotal() Micros
}

// Remaining is Limit - Spent - Reserved - Leased (negative when settlement overran the limit).
func (u Usage) Remaining() Micros { return u.Limit - u.Spent - u.Reserved - u.Leased }

// Store keeps the sums of every window. Implementations are safe for concurrent use.
type Store interface {
	// Reserve adds amount to the reserved sum of every window of ws if each enforced window has
	// room for it: spent + reserved + amount ≤ limit, or, for a window that allows a single
	// overrun, nothing spent or reserved in it at all. All or nothing. over has bit i set for each window i without room, shadow
	// windows included; when an enforced window is over, nothing changed. A non-nil error says
	// the store could not be asked; nothing changed.
	Reserve(ctx context.Context, ws []Window, amount Micros, now time.Time) (over uint64, err error)
	// Settle turns a reservation into its real cost in every window of ws: reserved goes back,
	// actual is added to the spent sum. Windows that have ended are ignored. It must not block
	// for long.
	Settle(ws []Window, reserved, actual Micros, now time.Time)
	// Release gives a reservation back (the request never reached the provider).
	Release(ws []Window, reserved Micros, now time.Time)
	// Usage lists every window that has not ended at now, ordered by WindowID.Key.
	Usage(now time.Time) []Usage
	// Get returns one window's sums; ok is false when the store holds nothing for it.
	Get(id WindowID, now time.Time) (u Usage, ok bool)
}

// Move carries the spend of one window into another: From is a window of a budget's period in
// a time zone the policy no longer uses, To the window of the same budget and period that the
// policy's zone makes current.
type Move struct {
	From WindowID
	To   Window
}

// Carrier is a Store that can carry spend from window to window (see Ledger.CarryForeign).
type Carrier interface {
	// Carry makes each move's To count what its From holds (settled and reserved alike), without
	// ever counting it twice however often the same moves, or moves back, are made. It returns
	// how many windows changed. Moves whose From or To has ended at now are skipped.
	Carry(moves []Move, now time.Time) (int, error)
}

// Persistent is a Store whose content someone must save to outlive the process (MemoryStore;
// a shared store keeps its own).
type Persistent interface {
	// Save returns every window not ended at now with spend in it.
	Save(now time.Time) []SavedWindow
	// Load takes saved windows back (see MemoryStore.Load) and returns how many it restored.
	Load(saved []SavedWindow, now time.Time) (int, error)
}

// MaxWindows is the most windows one reservation can hold: three periods in each of up to
// eight compartments.
const MaxWindows = 24

// Reservation is what an admitted request holds in the ledger. Fill it with Reset and Add,
// reserve it with Ledger.Reserve, and end it with Settle or Release, exactly once. A
// Reservation is not safe for concurrent use; its owner (a policy Ticket) guarantees that.
type Reservation struct {
	store  Store
	n      int
	ws     [MaxWindows]Window
	bs     [MaxWindows]Budget
	amount Micros
	over   uint64
	active bool
}

// Reset empties the reservation for a new request. A reservation still active is released
// first (it must not leak).
func (r *Reservation) Reset(now time.Time) {
	if r.active {
		r.Release(now)
	}
	r.n, r.amount, r.over, r.store = 0, 0, 0, nil
}

// Add adds budget b to those the next Reserve charges. It reports false when the reservation
// already holds MaxWindows budgets (b is then not charged).
func (r *Reservation) Add(b Budget) bool {
	if r.n >= MaxWindows {
		return false
	}
	r.bs[r.n] = b
	r.n++
	return true
}

// Len returns the number of budgets added.
func (r *Reservation) Len() int { return r.n }

// Active reports that the reservation holds a reserved amount not yet settled or released.
func (r *Reservation) Active() bool { return r.active }

// Amount returns the amount reserved in each window.
func (r *Reservation) Amount() Micros { return r.amount }

// Windows returns the windows reserved in (valid until the next Reset).
func (r *Reservation) Windows() []Window { return r.ws[:r.n] }

// Budgets returns the budgets added.
func (r *Reservation) Budgets() []Budget { return r.bs[:r.n] }

// Over returns a bit per window (in Windows order) that had no room: for an admitted
// reservation, the shadow budgets that would have refused it.
func (r *Reservation) Over() uint64 { return r.over }

// Settle charges the real cost actual instead of the reserved amount. Exactly once: later
// calls, and calls on a reservation that was never made, do nothing.
func (r *Reservation) Settle(actual Micros, now time.Time) {
	if !r.active {
		return
	}
	r.active = false
	r.store.Settle(r.ws[:r.n], r.amount, max(actual, 0), now)
}

// Release gives the whole reservation back (the request never reached the provider). Like
// Settle, it acts at most once.
func (r *Reservation) Release(now time.Time) {
	if !r.active {
		return
	}
	r.active = false
	r.store.Release(r.ws[:r.n], r.amount, now)
}

// Refusal says which budget refused a reservation.
type Refusal struct {
	// Unavailable says the shared store did not answer and the ledger refuses rather than
	// decide in its own memory (cluster.on_unavailable: closed); Budget and Window are then
	// unset.
	Unavailable bool
	Budget      Budget
	// Window is the refusing window; its End is when the budget resets.
	Window Window
	// Spent and Reserved are the window's sums when it refused.
	Spent, Reserved Micros
}

// Settings are the policy's settings a ledger follows; a policy reload changes them.
type Settings struct {
	// Currency is the code of the currency amounts are counted in, for states and views.
	Currency string
	// Calendar places instants in windows.
	Calendar Calendar
	// AllowSingleOverrun lets a request whose worst case is more than a whole budget run in a
	// window nothing was spent or reserved in (see Window.AllowSingleOverrun).
	AllowSingleOverrun bool
}

// Ledger reserves and settles spend in the windows of budgets, in a Store. It outlives policy
// reloads. Safe for concurrent use.
type Ledger struct {
	st atomic.Pointer[stores]
	// fallback takes reservations while the store cannot be reached, so that each budget is
	// still enforced in this process. Settlements go where their reservation went.
	fallback *MemoryStore
	cfg      atomic.Pointer[Settings]
	// fellBack counts reservations made in the fallback store.
	fellBack atomic.Uint64
}

// NewLedger returns a ledger keeping its sums in store (nil: a new MemoryStore), in USD and UTC
// until Configure says otherwise.
func NewLedger(store Store) *Ledger {
	l := &Ledger{fallback: NewMemoryStore()}
	l.cfg.Store(&Settings{Currency: "USD"})
	l.UseStore(store, false)
	return l
}

// stores are where a ledger keeps its sums.
type stores struct {
	store Store
	// shared is store when it is a Shared one; nil otherwise.
	shared Shared
	// closed refuses a reservation the shared store did not answer, instead of deciding it here.
	closed bool
	// local is the fallback store as reservations the store could not take use it: it adds
	// what it counts to the shared store.
	local *localStore
}

// UseStore makes the ledger keep its sums in store (nil: a new MemoryStore), before it serves
// any reservation. With a Shared store, a reservation the store does not answer is refused when
// closed is set, and otherwise decided in this process's memory (see Reserve).
func (l *Ledger) UseStore(store Store, closed bool) {
	if store == nil {
		store = NewMemoryStore()
	}
	st := &stores{store: store, closed: closed}
	st.shared, _ = store.(Shared)
	st.local = &localStore{MemoryStore: l.fallback, shared: st.shared}
	l.st.Store(st)
}

// Store returns the store the ledger keeps its sums in.
func (l *Ledger) Store() Store { return l.st.Load().store }

// Configure sets the currency (for states and views), the calendar of the windows and whether a
// single request may overrun an untouched window. When the calendar's zone changes, the spend
// already counted in each budget's current window carries into the window the new zone makes
// current (see CarryForeign), so that a new zone never gives a budget back what was spent; it
// returns how many windows that changed, and the error of a store that could not carry (then
// CarryForeign should be called again once it can).
func (l *Ledger) Configure(s Settings, now time.Time) (carried int, err error) {
	old := l.cfg.Load()
	if old.Calendar.Location().String() == s.Calendar.Location().String() {
		l.cfg.Store(&s)
		return 0, nil
	}
	// Before the switch, so that the first reservation in a new window finds the spend there;
	// and again after it, for what was reserved in the old windows meanwhile (carrying twice
	// counts nothing twice).
	n1, err1 := l.carry(s.Calendar, now)
	l.cfg.Store(&s)
	n2, err2 := l.carry(s.Calendar, now)
	return max(n1, n2), errors.Join(err1, err2)
}

// CarryForeign carries into each budget's current window the spend of every window that holds
// now but that the calendar does not make current: windows of a time zone the policy used
// before (a reload or a restart changed time_zone), restored from a state file or kept in Redis
// by replicas that still use it. The current window then counts at least what such a window
// holds: a zone change never gives back what was spent, and carrying again, or back when the
// zone is changed back, counts nothing twice. It returns how many windows changed.
func (l *Ledger) CarryForeign(now time.Time) (int, error) {
	return l.carry(l.Calendar(), now)
}

func (l *Ledger) carry(cal Calendar, now time.Time) (int, error) {
	store := l.Store()
	c, ok := store.(Carrier)
	if !ok {
		return 0, nil
	}
	var moves []Move
	at := now.Unix()
	for _, u := range store.Usage(now) {
		if u.ID.Start > at || !u.End.After(now) {
			continue // not a window holding now
		}
		start := cal.Start(u.ID.Period, now)
		if start.Unix() == u.ID.Start {
			continue // current
		}
		moves = append(moves, Move{From: u.ID, To: Window{ID: WindowID{Budget: u.ID.Budget, Period: u.ID.Period, Start: start.Unix()},
			Limit: u.Limit, End: cal.End(u.ID.Period, start), Shadow: u.Shadow}})
	}
	if len(moves) == 0 {
		return 0, nil
	}
	return c.Carry(moves, now)
}

// Settings returns the settings the ledger follows.
func (l *Ledger) Settings() Settings { return *l.cfg.Load() }

// Currency returns the configured currency code.
func (l *Ledger) Currency() string { return l.cfg.Load().Currency }

// Calendar returns the configured calendar.
func (l *Ledger) Calendar() Calendar { return l.cfg.Load().Calendar }

// FellBack returns how many reservations were made in the ledger's own memory because the
// store could not be reached.
func (l *Ledger) FellBack() uint64 { return l.fellBack.Load() }

// Window returns the window of b that holds now.
func (l *Ledger) Window(b Budget, now time.Time) Window { return l.cfg.Load().window(b, now) }

// window returns the window of b that holds now under these settings.
func (cfg *Settings) window(b Budget, now time.Time) Window {
	start := cfg.Calendar.Start(b.Period, now)
	return Window{
		ID:                 WindowID{Budget: b.Name, Period: b.Period, Start: start.Unix()},
		Limit:              b.Limit,
		End:                cfg.Calendar.End(b.Period, start),
		Shadow:             b.Shadow,
		AllowSingleOverrun: cfg.AllowSingleOverrun,
	}
}

// Reserve reserves amount in the current window of every budget added to r, all or nothing.
// On a refusal r holds nothing and the Refusal names the first enforced budget without room.
//
// If the store cannot be reached, the reservation is decided in the ledger's own memory instead,
// against this process's share of each budget: what the shared store last showed left in the
// window (the whole limit if it never showed the window) divided by the live replicas, less
// what this process already counted there on its own. What it reserves there, and later
// settles, is added to the shared store (see Shared.AddLocal). A shared store that did not
// answer in time but is not found gone (Shared.Gone: it may be answering the other replicas,
// whose reservations the share cannot see) refuses instead, as a ledger whose shared store is
// closed does (Refusal.Unavailable): a timeout never becomes money the fleet cannot count.
func (l *Ledger) Reserve(ctx context.Context, r *Reservation, amount Micros, now time.Time) (Refusal, bool) {
	amount = max(amount, 0)
	cfg := l.cfg.Load()
	for i := 0; i < r.n; i++ {
		r.ws[i] = cfg.window(r.bs[i], now)
	}
	ws := r.ws[:r.n]
	st := l.st.Load()
	store := st.store
	over, err := store.Reserve(ctx, ws, amount, now)
	if err != nil {
		if st.closed || (st.shared != nil && !st.shared.Gone()) {
			return Refusal{Unavailable: true}, false
		}
		l.fellBack.Add(1)
		store = st.local
		over = st.local.reserve(ctx, ws, amount, now)
	}
	for i := range ws {
		if over&(1<<uint(i)) != 0 && !ws[i].Shadow {
			rf := Refusal{Budget: r.bs[i], Window: ws[i]}
			if u, ok := store.Get(ws[i].ID, now); ok {
				rf.Spent, rf.Reserved = u.Spent, u.Reserved
			}
			return rf, false
		}
	}
	r.store, r.amount, r.over, r.active = store, amount, over, true
	return Refusal{}, true
}

// localStore is the ledger's own memory for reservations its store could not take. With a
// shared store, each budget there is this process's share of what the shared store last showed
// left, and what it counts is added to the shared store.
type localStore struct {
	*MemoryStore
	shared Shared
}

// share returns the window as this process may count it on its own: its share of what the
// shared store last showed left (the whole limit when it never showed the window), divided by
// the live replicas; a single overrun only where the shared window was seen untouched or never.
func (s *localStore) share(w Window, now time.Time) Window {
	if s.shared == nil {
		return w
	}
	seen, _ := s.shared.Seen(w.ID, now)
	used := seen.Spent + seen.Reserved + seen.Leased
	w.Limit = max(w.Limit-used, 0) / Micros(max(s.shared.Replicas(), 1))
	w.AllowSingleOverrun = w.AllowSingleOverrun && used == 0
	return w
}

// reserve reserves amount in every window of ws, each at this process's share, and queues it
// for the shared store once made.
func (s *localStore) reserve(ctx context.Context, ws []Window, amount Micros, now time.Time) uint64 {
	var buf [MaxWindows]Window
	lws := buf[:len(ws)]
	for i, w := range ws {
		lws[i] = s.share(w, now)
	}
	over, _ := s.MemoryStore.Reserve(ctx, lws, amount, now)
	refused := false
	for i := range ws {
		refused = refused || over&(1<<uint(i)) != 0 && !ws[i].Shadow
	}
	if !refused && s.shared != nil {
		s.shared.AddLocal(ws, amount, 0)
	}
	return over
}

// Settle implements Store: here, and added to the shared store.
func (s *localStore) Settle(ws []Window, reserved, actual Micros, now time.Time) {
	s.MemoryStore.Settle(ws, reserved, actual, now)
	if s.shared != nil {
		s.shared.AddLocal(ws, -reserved, actual)
	}
}

// Release implements Store: here, and added to the shared store.
func (s *localStore) Release(ws []Window, reserved Micros, now time.Time) {
	s.MemoryStore.Release(ws, reserved, now)
	if s.shared != nil {
		s.shared.AddLocal(ws, -reserved, 0)
	}
}

// Usage lists every window not ended at now. With a shared store, each window's sums include
// what this process counted in its own memory that the shared store has not applied yet, and
// Local says what it counted there; windows only this process knows (counted while the shared
// store could not be reached) are listed too. Without one, the store's windows and (while the
// store is or was unreachable) those of the ledger's own memory.
func (l *Ledger) Usage(now time.Time) []Usage {
	st := l.st.Load()
	out := st.store.Usage(now)
	if st.shared == nil {
		if l.fellBack.Load() > 0 {
			out = append(out, l.fallback.Usage(now)...)
		}
		return out
	}
	pending := st.shared.Pending()
	local := map[WindowID]Usage{}
	if l.fellBack.Load() > 0 {
		for _, u := range l.fallback.Usage(now) {
			local[u.ID] = u
		}
	}
	if len(pending) == 0 && len(local) == 0 {
		return out
	}
	seen := make(map[WindowID]bool, len(out))
	for i := range out {
		seen[out[i].ID] = true
		addLocal(&out[i], local, pending)
	}
	for id, u := range local {
		if !seen[id] {
			u.Spent, u.Reserved, u.Leased = 0, 0, 0
			addLocal(&u, local, pending)
			out = append(out, u)
		}
	}
	SortUsage(out)
	return out
}

// addLocal adds to u what this process counted in its own memory for its window.
func addLocal(u *Usage, local map[WindowID]Usage, pending map[WindowID]Pending) {
	p := pending[u.ID]
	u.Spent = max(u.Spent+p.Settled, 0)
	u.Reserved = max(u.Reserved+p.Reserved, 0)
	if lu, ok := local[u.ID]; ok || p != (Pending{}) {
		u.Local = Local{Spent: lu.Spent, Reserved: lu.Reserved, Pending: p}
	}
}

// LocalLimit returns what this process may count in b's window at now on its own while its
// shared store does not answer: its share (the budget divided by the live replicas) of what the
// store last showed left. ok is false without a shared store.
func (l *Ledger) LocalLimit(b Budget, now time.Time) (Micros, bool) {
	st := l.st.Load()
	if st.shared == nil {
		return 0, false
	}
	return st.local.share(l.Window(b, now), now).Limit, true
}

// PendingTotal returns what this process counted in its own memory that its shared store has
// not applied yet, net of reservations that ended, each request once whatever its windows (0
// without a shared store).
func (l *Ledger) PendingTotal() Micros {
	st := l.st.Load()
	if st.shared == nil {
		return 0
	}
	return st.shared.PendingTotal()
}

// Shared reports whether the ledger keeps its sums in a shared store.
func (l *Ledger) Shared() bool { return l.st.Load().shared != nil }

// SaveState returns the store's windows with the ledger's currency, for a state file. A store
// that keeps its own state (not Persistent) gives none.
func (l *Ledger) SaveState(now time.Time) SavedState {
	st := SavedState{Currency: l.Currency(), Windows: []SavedWindow{}}
	if p, ok := l.Store().(Persistent); ok {
		st.Windows = p.Save(now)
	}
	return st
}

// RestoreState replaces (never adds to) the spend of each budget whose current window at now is
// one of st's, and returns how many windows it restored. A state counted in another currency
// than the ledger's is refused whole (its amounts would mean something else) with an error
// wrapping ErrOtherCurrency, as is one the store cannot take.
func (l *Ledger) RestoreState(st SavedState, now time.Time) (int, error) {
	if st.Currency != l.Currency() {
		return 0, fmt.Errorf("the state is counted in %q, the policy in %q: %w", st.Currency, l.Currency(), ErrOtherCurrency)
	}
	p, ok := l.Store().(Persistent)
	if !ok {
		return 0, nil
	}
	n, err := p.Load(st.Windows, now)
	if err != nil {
		return 0, err
	}
	// A file written under another time_zone holds windows the policy's zone does not make
	// current: their spend carries into the current ones.
	_, _ = l.CarryForeign(now)
	return n, nil
}
