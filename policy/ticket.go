package policy

import (
	"strings"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/adaptive"
	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/quota"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// maxCompartments bounds the compartments one request can be in (one per family).
const maxCompartments = config.MaxFamilies

// Ticket is what an admitted request holds: slots, budget reservations and a breaker permit.
// Done releases everything exactly once. The zero Ticket is ready for Admit; a Ticket is
// meant to live inside the per-stream processor (no allocation per request). Admit and Done
// may be called from different goroutines; Done is idempotent and never blocks.
type Ticket struct {
	engine *Engine
	snap   *Snapshot
	dims   Dims
	est    Estimate
	bytes  int64

	n     int
	insts [maxCompartments]*instance
	set   [maxCompartments]*bulkhead.Compartment
	held  [maxCompartments]int64
	rpm   [maxCompartments]budget.Charge
	tpm   [maxCompartments]budget.Charge
	tpd   [maxCompartments]budget.Charge
	// charged says where each window's charge was made (leased admission: the lease, or this
	// process's window).
	charged [maxCompartments][numWins]leasedWindow

	brk    *breaker.Breaker
	permit breaker.Permit

	grantedAt time.Time
	active    bool
	done      atomic.Bool
	// firstToken: FirstToken reported the first token to adaptive limits.
	firstToken atomic.Bool
	// handles are the request's handles in the adaptive limits of its compartments; stalled
	// the process's stalled time when it was admitted (only with an adaptive limit).
	handles [maxCompartments]adaptive.Handle
	stalled time.Duration

	// mode says where the admission's limits were enforced (cluster mode only).
	mode ticketMode
	// shared holds a cluster admission's lease and windows (allocated on first use).
	shared *sharedTicket
	// spend holds the reservation in spend budgets (allocated on first use, only by requests
	// that a spend budget applies to).
	spend *spend.Reservation
	// quota is the tracker of the provider's quota the request holds quotaRes of (nil: the
	// provider's quota is not followed).
	quota    *quota.Tracker
	quotaRes quota.Reservation
}

// ticketMode says where an admission's limits were enforced.
type ticketMode uint8

const (
	// ticketLocal: in this process alone (no cluster).
	ticketLocal ticketMode = iota
	// ticketShared: in the shared state (Redis), with the slots also held here.
	ticketShared
	// ticketTracked: in this process while the shared state was unavailable; the lease is
	// known to the store so that it counts everywhere once the store rewrites its leases.
	ticketTracked
)

// Admitted reports whether the ticket holds an admission not yet released.
func (t *Ticket) Admitted() bool { return t.active && !t.done.Load() }

// GrantedAt returns when the ticket was admitted (the engine's clock): the request's Now when it
// was admitted in this process without waiting, else when it got its slots (after queueing, or
// before asking the cluster's shared store). Zero before admission.
func (t *Ticket) GrantedAt() time.Time { return t.grantedAt }

// JoinCompartments returns the names of Compartments joined with commas, in one allocation.
func (t *Ticket) JoinCompartments() string {
	n := max(t.n-1, 0)
	for i := 0; i < t.n; i++ {
		n += len(t.insts[i].name)
	}
	var b strings.Builder
	b.Grow(n)
	for i := 0; i < t.n; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(t.insts[i].name)
	}
	return b.String()
}

// Compartments returns the names of the compartments the ticket holds slots in.
func (t *Ticket) Compartments() []string {
	out := make([]string, t.n)
	for i := 0; i < t.n; i++ {
		out[i] = t.insts[i].name
	}
	return out
}

// Remaining returns the tightest per-minute token budget among the ticket's compartments at
// now (the engine's clock): tokens left and time until it is full again. ok is false when no
// compartment has one.
func (t *Ticket) Remaining(now time.Time) (tokens int64, reset time.Duration, ok bool) {
	if t.mode == ticketShared {
		sh := t.shared
		return sh.remaining, sh.reset, sh.hasTPM
	}
	for i := 0; i < t.n; i++ {
		in := t.insts[i]
		if in.tpm == nil {
			continue
		}
		var left int64
		var in2 time.Duration
		if f := in.fleet; t.charged[i][winTPM] == chargedLease && f != nil && f.ls != nil {
			var known bool
			if left, in2, known = f.ls.Remaining(f.idx[winTPM]); !known {
				continue
			}
		} else {
			st := in.tpm.State(now)
			left, in2 = st.Remaining, st.ResetIn
		}
		if !ok || left < tokens {
			tokens, reset, ok = left, in2, true
		}
	}
	return tokens, reset, ok
}

// want is what request r, classified as dims, asks of the scheduler: its own priority when
// classification gave it one (classification.priority), else the highest of its enforced
// compartments'; the shortest max_wait among them, cut to what is left before the request's
// own deadline (Request.Deadline): it is never queued past the time its client gives up.
func (t *Ticket) want(r *Request, dims *Dims, now time.Time) bulkhead.Want {
	w := bulkhead.Want{Tokens: r.Estimate.Total, Tenant: dims.Tenant, Now: now}
	first := true
	for i := 0; i < t.n; i++ {
		l := t.insts[i].limits
		if l.Shadow {
			continue
		}
		w.Priority = max(w.Priority, l.Priority)
		if l.HasMaxWait && (first || l.MaxWait < w.MaxWait) {
			w.MaxWait, first = l.MaxWait, false
		}
	}
	if dims.HasPriority {
		w.Priority = dims.Priority
	}
	if !r.Deadline.IsZero() {
		w.MaxWait = max(min(w.MaxWait, r.Deadline.Sub(now)), 0)
	}
	return w
}

// undo returns everything a refused admission took.
func (t *Ticket) undo(now time.Time) {
	t.undoLocal(now)
	for i := 0; i < t.n; i++ {
		if in := t.insts[i]; in.family.dyn != nil {
			in.family.dyn.release(in, now)
		}
	}
	if t.spend != nil {
		t.spend.Release(now)
	}
	t.n = 0
}

// undoLocal gives back what an admission took in this process's own windows, and the breaker
// permit; the ticket keeps its compartments and its spend reservation (another attempt, through
// the cluster's shared store, reuses them).
func (t *Ticket) undoLocal(now time.Time) {
	for i := 0; i < t.n; i++ {
		in := t.insts[i]
		if in.rpm != nil {
			t.refundWindow(i, winRPM, t.rpm[i], now)
		}
		if in.tpm != nil {
			t.refundWindow(i, winTPM, t.tpm[i], now)
		}
		if in.tpd != nil {
			t.refundWindow(i, winTPD, t.tpd[i], now)
		}
		t.rpm[i], t.tpm[i], t.tpd[i] = budget.Charge{}, budget.Charge{}, budget.Charge{}
	}
	if t.brk != nil {
		t.brk.Release(t.permit)
		t.brk = nil
	}
	t.releaseQuota()
}
