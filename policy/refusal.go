package policy

import (
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
)

// RateWindow is a request-rate or token-budget window as a refusal found it: what clients
// see in their rate-limit headers (OpenAI's x-ratelimit-*, Anthropic's anthropic-ratelimit-*).
type RateWindow struct {
	// Limit is the window's capacity: requests or tokens per minute (or per day for a daily
	// token budget).
	Limit int64
	// Remaining is what the window has left, never below 0 (a window in debt has nothing left).
	Remaining int64
	// Reset is how long until everything charged to the window has aged out: when it is full
	// again.
	Reset time.Duration
}

// RefusalLimits are the windows of the compartment that refused a request for its rate or
// budget: the window that had no room, as a request window (rate_limit) or a token window
// (token_budget). A refusal by anything else (concurrency, a breaker, an upstream's
// retry-after) has none: no number is made up for it.
type RefusalLimits struct {
	Requests, Tokens       RateWindow
	HasRequests, HasTokens bool
}

// rateWindow makes a RateWindow of a local window's state.
func rateWindow(st budget.State) RateWindow {
	return RateWindow{Limit: st.Capacity, Remaining: max(st.Remaining, 0), Reset: st.ResetIn}
}

// refusedBy records the window w (requests when rpm, else tokens) that refused, as it stands
// at now, after the refused admission was undone.
func (l *RefusalLimits) refusedBy(w *budget.Window, rpm bool, now time.Time) {
	if w == nil {
		return
	}
	rw := rateWindow(w.State(now))
	if rpm {
		l.Requests, l.HasRequests = rw, true
		return
	}
	l.Tokens, l.HasTokens = rw, true
}

// refusedByWindow records window k of the ticket's i-th compartment that refused: the lease's
// view of the fleet's window when the lease refused, else this process's window.
func (l *RefusalLimits) refusedByWindow(t *Ticket, i, k int, rpm bool, now time.Time) {
	in := t.insts[i]
	if f := in.fleet; t.charged[i][k] == chargedLease && f != nil && f.ls != nil {
		w := in.fleetLimits.RequestsPerMinute
		switch k {
		case winTPM:
			w = in.fleetLimits.TokensPerMinute
		case winTPD:
			w = in.fleetLimits.TokensPerDay
		}
		left, reset, ok := f.ls.Remaining(f.idx[k])
		if ok {
			l.refusedByShared(w, left, reset, rpm)
		}
		return
	}
	l.refusedBy(in.localWindow(k), rpm, now)
}

// refusedByShared records the shared window that refused, from what Redis answered.
func (l *RefusalLimits) refusedByShared(capacity, left int64, reset time.Duration, rpm bool) {
	rw := RateWindow{Limit: capacity, Remaining: min(max(left, 0), capacity), Reset: max(reset, 0)}
	if rpm {
		l.Requests, l.HasRequests = rw, true
		return
	}
	l.Tokens, l.HasTokens = rw, true
}
