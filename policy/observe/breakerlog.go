package observe

import (
	"sync"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/internal/throttle"
	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
)

// breakerLogInterval is the least time between two log lines of one kind (refusals, events)
// for one breaker. The lines held back in between are counted, and the next line that goes
// out says how many (suppressed): a storm of refusals, or a breaker flapping, writes at most
// one line per second per breaker and kind.
const breakerLogInterval = time.Second

// breakerLog is one breaker's log limits, kept by name so that they outlive reloads.
type breakerLog struct {
	refusals, events throttle.Gate
}

// breakerLogs holds the log limits of every breaker the engine has made, by name. Names come
// from the policy (providers and model globs), never from clients, so the map stays bounded.
type breakerLogs struct {
	mu sync.RWMutex
	m  map[string]*breakerLog
}

func (m *Metrics) breakerLog(name string) *breakerLog {
	bl := &m.breakerLogs
	bl.mu.RLock()
	l := bl.m[name]
	bl.mu.RUnlock()
	if l != nil {
		return l
	}
	bl.mu.Lock()
	defer bl.mu.Unlock()
	if l = bl.m[name]; l == nil {
		if bl.m == nil {
			bl.m = map[string]*breakerLog{}
		}
		l = &breakerLog{}
		bl.m[name] = l
	}
	return l
}

// BreakerRefused logs, at info and rate-limited, that breaker b refused a call; fallback is the
// provider the request is re-routed to ("" when it is refused).
func (m *Metrics) BreakerRefused(b *breaker.Breaker, retry time.Duration, fallback string, now time.Time) {
	ok, suppressed := m.breakerLog(b.Name()).refusals.Allow(now, breakerLogInterval)
	if !ok {
		return
	}
	m.log.Info("breaker refused a call", "breaker", b.Name(), "state", b.State().String(), "retry_after", retry.Round(time.Millisecond).String(),
		"fallback", fallback, "suppressed", suppressed)
}

// logBreakerEvent logs a transition or threshold breach at info, rate-limited per breaker.
// Every event is also in the breaker's history (GET /admin/breakers/{name}/events) and the
// metrics, so a line held back loses nothing but the line.
func (m *Metrics) logBreakerEvent(ev breaker.Event, now time.Time) {
	ok, suppressed := m.breakerLog(ev.Name).events.Allow(now, breakerLogInterval)
	if !ok {
		return
	}
	if ev.Kind == breaker.EventThresholdExceeded {
		m.log.Info("breaker threshold exceeded (metrics only, not opening)", "breaker", ev.Name, "state", ev.To.String(),
			"reason", string(ev.Reason), "failure_rate", ev.FailureRate, "slow_rate", ev.SlowRate, "suppressed", suppressed)
		return
	}
	m.log.Info("breaker state changed", "breaker", ev.Name, "from", ev.From.String(), "to", ev.To.String(),
		"reason", string(ev.Reason), "failure_rate", ev.FailureRate, "slow_rate", ev.SlowRate, "suppressed", suppressed)
}
