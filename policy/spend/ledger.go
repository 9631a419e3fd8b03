package spend

import (
	"context"
	"fmt"
	"strconv"
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
}

// Remaining is Limit - Spent - Reserved (negative when settlement overran the limit).
func (u Usage) Remaining() Micros { return u.Limit - u.Spent - u.Reserved }

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
	Budget Budget
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
	store Store
	// fallback takes reservations while the store cannot be reached, so that each budget is
	// still enforced in this process; settlements go where their reservation went.
	fallback *MemoryStore
	cfg      atomic.Pointer[Settings]
	// fellBack counts reservations made in the fallback store.
	fellBack atomic.Uint64
}

// NewLedger returns a ledger keeping its sums in store (nil: a new MemoryStore), in USD and UTC
// until Configure says otherwise.
func NewLedger(store Store) *Ledger {
	if store == nil {
		store = NewMemoryStore()
	}
	l := &Ledger{store: store, fallback: NewMemoryStore()}
	l.cfg.Store(&Settings{Currency: "USD"})
	return l
}

// Store returns the store the ledger keeps its sums in.
func (l *Ledger) Store() Store { return l.store }

// Configure sets the currency (for states and views), the calendar of the windows and whether a
// single request may overrun an untouched window. Windows already counted keep the start they
// had: a new zone applies to windows that start later.
func (l *Ledger) Configure(s Settings) {
	l.cfg.Store(&s)
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
func (l *Ledger) Window(b Budget, now time.Time) Window {
	cfg := l.cfg.Load()
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
// If the store cannot be reached, the reservation is made in the ledger's own memory instead.
func (l *Ledger) Reserve(ctx context.Context, r *Reservation, amount Micros, now time.Time) (Refusal, bool) {
	amount = max(amount, 0)
	for i := 0; i < r.n; i++ {
		r.ws[i] = l.Window(r.bs[i], now)
	}
	ws := r.ws[:r.n]
	store := Store(l.store)
	over, err := store.Reserve(ctx, ws, amount, now)
	if err != nil {
		l.fellBack.Add(1)
		store = l.fallback
		over, _ = store.Reserve(ctx, ws, amount, now)
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

// Usage lists every window not ended at now, in the store and (while the store is or was
// unreachable) in the ledger's own memory.
func (l *Ledger) Usage(now time.Time) []Usage {
	out := l.store.Usage(now)
	if l.fellBack.Load() > 0 {
		out = append(out, l.fallback.Usage(now)...)
	}
	return out
}

// SaveState implements Source: the store's windows with the ledger's currency. A store that
// keeps its own state (not Persistent) gives none.
func (l *Ledger) SaveState(now time.Time) SavedState {
	st := SavedState{Currency: l.Currency(), Windows: []SavedWindow{}}
	if p, ok := l.store.(Persistent); ok {
		st.Windows = p.Save(now)
	}
	return st
}

// RestoreState implements Source. A state counted in another currency than the ledger's is
// refused whole (its amounts would mean something else), as is one the store cannot take.
func (l *Ledger) RestoreState(st SavedState, now time.Time) (int, error) {
	if st.Currency != l.Currency() {
		return 0, &StateError{Reason: ReasonCurrency, Err: fmt.Errorf("the state is counted in %q, the policy in %q", st.Currency, l.Currency())}
	}
	p, ok := l.store.(Persistent)
	if !ok {
		return 0, nil
	}
	n, err := p.Load(st.Windows, now)
	if err != nil {
		return 0, &StateError{Reason: ReasonCorrupt, Err: err}
	}
	return n, nil
}
