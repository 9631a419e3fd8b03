package spend

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"
)

// MemoryStore keeps window sums in this process. It forgets a window once the window has ended.
// Safe for concurrent use.
type MemoryStore struct {
	mu      sync.Mutex
	windows map[WindowID]*memWindow
	// sweepAt is when ended windows are next dropped.
	sweepAt time.Time
}

var _ Carrier = (*MemoryStore)(nil)

type memWindow struct {
	w Window
	// spent is settled here; restored was restored from a saved state (replaced, never added
	// to, by a later restore); carried was carried from a window of another time zone (see
	// Carry); before is restored plus carried, kept so that the admission path adds no more.
	spent, restored, carried, before, reserved Micros
}

// setBefore updates before after restored or carried changed.
func (m *memWindow) setBefore() { m.before = satAdd(m.restored, m.carried) }

// settled is everything counted as spent in the window.
func (m *memWindow) settled() Micros { return satAdd(m.spent, m.before) }

func (m *memWindow) used() Micros { return satAdd(m.settled(), m.reserved) }

func (m *memWindow) usage() Usage {
	return Usage{Window: m.w, Spent: m.settled(), Reserved: m.reserved}
}

// sweepEvery is how often ended windows are dropped.
const sweepEvery = time.Minute

// NewMemoryStore returns an empty store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{windows: map[WindowID]*memWindow{}}
}

// window returns the sums of w, creating them; the limit follows the latest reservation.
// s.mu is held.
func (s *MemoryStore) window(w Window, now time.Time) *memWindow {
	if !now.Before(s.sweepAt) {
		s.sweep(now)
	}
	m := s.windows[w.ID]
	if m == nil {
		m = &memWindow{w: w}
		s.windows[w.ID] = m
	}
	m.w.Limit, m.w.Shadow = w.Limit, w.Shadow
	return m
}

// sweep drops windows that have ended. s.mu is held.
func (s *MemoryStore) sweep(now time.Time) {
	for id, m := range s.windows {
		if !m.w.End.After(now) {
			delete(s.windows, id)
		}
	}
	s.sweepAt = now.Add(sweepEvery)
}

// Reserve implements Store.
func (s *MemoryStore) Reserve(_ context.Context, ws []Window, amount Micros, now time.Time) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var over uint64
	refused := false
	// The windows found, so that each is looked up once (a reservation has at most MaxWindows).
	var found [MaxWindows]*memWindow
	for i := range ws {
		w := &ws[i]
		m := s.window(*w, now)
		if i < MaxWindows {
			found[i] = m
		}
		if used := m.used(); used > w.Limit-amount && !(w.AllowSingleOverrun && used == 0) {
			over |= 1 << uint(i)
			refused = refused || !w.Shadow
		}
	}
	if refused {
		return over, nil
	}
	for i := range ws {
		m := s.windows[ws[i].ID]
		if i < MaxWindows {
			m = found[i]
		}
		m.reserved = satAdd(m.reserved, amount)
	}
	return over, nil
}

// Settle implements Store.
func (s *MemoryStore) Settle(ws []Window, reserved, actual Micros, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, w := range ws {
		m := s.windows[w.ID]
		if m == nil || !m.w.End.After(now) {
			continue // ended: the budget has reset, the cost no longer counts
		}
		m.reserved = max(m.reserved-reserved, 0)
		m.spent = satAdd(m.spent, actual)
	}
}

// Release implements Store.
func (s *MemoryStore) Release(ws []Window, reserved Micros, _ time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, w := range ws {
		if m := s.windows[w.ID]; m != nil {
			m.reserved = max(m.reserved-reserved, 0)
		}
	}
}

// Get implements Store.
func (s *MemoryStore) Get(id WindowID, now time.Time) (Usage, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.windows[id]
	if m == nil || !m.w.End.After(now) {
		return Usage{}, false
	}
	return m.usage(), true
}

// Usage implements Store.
func (s *MemoryStore) Usage(now time.Time) []Usage {
	s.mu.Lock()
	out := make([]Usage, 0, len(s.windows))
	for _, m := range s.windows {
		if m.w.End.After(now) {
			out = append(out, m.usage())
		}
	}
	s.mu.Unlock()
	SortUsage(out)
	return out
}

// SortUsage orders us as Store.Usage lists windows.
func SortUsage(us []Usage) {
	sort.Slice(us, func(i, j int) bool { return windowLess(us[i].ID, us[j].ID) })
}

func windowLess(a, b WindowID) bool {
	if a.Budget != b.Budget {
		return a.Budget < b.Budget
	}
	if a.Period != b.Period {
		return a.Period < b.Period
	}
	return a.Start < b.Start
}

// Save implements Persistent: every window not ended at now with spend in it. Reservations in
// flight are saved apart from settled spend (SavedWindow.InFlight).
func (s *MemoryStore) Save(now time.Time) []SavedWindow {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []SavedWindow{}
	for _, m := range s.windows {
		if !m.w.End.After(now) || m.used() == 0 {
			continue
		}
		out = append(out, SavedWindow{
			Budget: m.w.ID.Budget, Period: m.w.ID.Period.String(),
			Start: time.Unix(m.w.ID.Start, 0).UTC(), End: m.w.End.UTC(),
			Settled: int64(m.settled()), InFlight: int64(m.reserved),
		})
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Budget != b.Budget {
			return a.Budget < b.Budget
		}
		if a.Period != b.Period {
			return periodRank(a.Period) < periodRank(b.Period)
		}
		return a.Start.Before(b.Start)
	})
	return out
}

func periodRank(s string) Period {
	p, _ := ParsePeriod(s)
	return p
}

// Load implements Persistent. It never counts anything twice: each saved window's spend
// (settled and in flight alike: after a crash the settlements of requests in flight never come)
// replaces what an earlier Load gave that window, and is never added to it, so loading the same
// windows again changes nothing; spend counted here since the store started is kept beside it.
// Windows that have ended by now are skipped (their budget has reset). Windows that make no
// sense are refused all together: nothing changes.
func (s *MemoryStore) Load(saved []SavedWindow, now time.Time) (int, error) {
	type item struct {
		id    WindowID
		end   time.Time
		spent Micros
	}
	items := make([]item, 0, len(saved))
	for i, w := range saved {
		p, ok := ParsePeriod(w.Period)
		switch {
		case !ok:
			return 0, fmt.Errorf("window %d: unknown period %q", i, w.Period)
		case w.Budget == "":
			return 0, fmt.Errorf("window %d: no budget name", i)
		case !w.End.After(w.Start):
			return 0, fmt.Errorf("window %d (%s): ends before it starts", i, w.Budget)
		case w.Settled < 0 || w.InFlight < 0:
			return 0, fmt.Errorf("window %d (%s): negative amount", i, w.Budget)
		}
		if !w.End.After(now) {
			continue
		}
		items = append(items, item{id: WindowID{Budget: w.Budget, Period: p, Start: w.Start.Unix()}, end: w.End,
			spent: satAdd(Micros(w.Settled), Micros(w.InFlight))})
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, it := range items {
		m := s.windows[it.id]
		if m == nil {
			m = &memWindow{w: Window{ID: it.id, End: it.end}}
			s.windows[it.id] = m
		}
		m.restored = it.spent
		m.setBefore()
	}
	return len(items), nil
}

// Carry implements Carrier. A window of this process holds everything spent in it, so carrying
// is a floor: after it, To counts at least what From holds (settled and reserved) besides what
// To has in flight; carrying again, or back and forth, never counts anything twice.
func (s *MemoryStore) Carry(moves []Move, now time.Time) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, mv := range moves {
		src := s.windows[mv.From]
		if src == nil || !src.w.End.After(now) || mv.From == mv.To.ID || !mv.To.End.After(now) {
			continue
		}
		dst := s.window(mv.To, now)
		if need := src.used() - satAdd(dst.spent, dst.restored); need > dst.carried {
			dst.carried = need
			dst.setBefore()
			n++
		}
	}
	return n, nil
}

func satAdd(a, b Micros) Micros {
	if b > 0 && a > maxSum-b {
		return maxSum
	}
	return a + b
}

const maxSum = Micros(1<<63 - 1)
