package extproc

import (
	"cmp"
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// Decision logs: every refusal is worth a line at info (an operator asking "why did my call
// fail?" should find it without debug logging), but a storm of refusals must not flood the
// log. Lines are limited per (reason, compartment) and overall, per interval; what is held back
// is counted and reported once the interval ends, one line per (reason, compartment).
const (
	// refusalLogInterval is the interval the limits count in.
	refusalLogInterval = time.Second
	// refusalLinesPerKey is how many refusals of one reason in one compartment are logged per
	// interval.
	refusalLinesPerKey = 5
	// refusalLinesTotal bounds the refusal lines of an interval over all keys: a storm spread
	// over many tenant compartments is bounded too.
	refusalLinesTotal = 50
	// refusalSummariesMax bounds the "suppressed" lines at the end of an interval; the keys
	// beyond it (fewest suppressed first) are summed into one more line.
	refusalSummariesMax = 20
	// maxLoggedValue bounds a logged value that a client chose (the model, the request id).
	maxLoggedValue = 128
)

type refusalKey struct {
	reason      policy.Reason
	compartment string
}

// refusalLog decides which refusals get a log line and reports the rest. Its goroutine starts
// with the first refusal and ends after an interval without any, or when the server closes;
// the request path only takes a short lock. Safe for concurrent use.
type refusalLog struct {
	log *slog.Logger

	mu sync.Mutex
	// logged counts the lines let through this interval, per key; suppressed the rest.
	logged     map[refusalKey]int
	suppressed map[refusalKey]int64
	lines      int
	running    bool
	closed     bool
	wake       chan struct{}
	wg         sync.WaitGroup
}

func newRefusalLog(log *slog.Logger) *refusalLog {
	return &refusalLog{log: log, logged: map[refusalKey]int{}, suppressed: map[refusalKey]int64{}, wake: make(chan struct{}, 1)}
}

// allow reports whether a refusal for reason in compartment gets its own line; if not, it is
// counted for the end of the interval.
func (l *refusalLog) allow(reason policy.Reason, compartment string) bool {
	k := refusalKey{reason, compartment}
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.running && !l.closed {
		l.running = true
		l.wg.Add(1)
		go l.run()
	}
	if n := l.logged[k]; n < refusalLinesPerKey && l.lines < refusalLinesTotal {
		l.logged[k] = n + 1
		l.lines++
		return true
	}
	l.suppressed[k]++
	return false
}

// Close reports what is still held back and stops the goroutine. Idempotent.
func (l *refusalLog) Close() {
	l.mu.Lock()
	l.closed = true
	if l.running {
		select {
		case l.wake <- struct{}{}:
		default:
		}
	}
	l.mu.Unlock()
	l.wg.Wait()
}

func (l *refusalLog) run() {
	defer l.wg.Done()
	t := time.NewTimer(refusalLogInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-l.wake:
		}
		if !l.flush() {
			return
		}
		t.Reset(refusalLogInterval)
	}
}

// flush ends an interval: it logs what was held back and starts counting afresh. It reports
// false, and marks the goroutine stopped, when the log closed or the interval saw no refusal.
func (l *refusalLog) flush() bool {
	l.mu.Lock()
	quiet := l.lines == 0 && len(l.suppressed) == 0
	// held leaves with the counts, or is nil: the map stays the request path's, which may
	// write it as soon as the lock is released.
	var held map[refusalKey]int64
	if len(l.suppressed) > 0 {
		held, l.suppressed = l.suppressed, map[refusalKey]int64{}
	}
	clear(l.logged)
	l.lines = 0
	stop := l.closed || quiet
	if stop {
		l.running = false
	}
	l.mu.Unlock()
	l.report(held)
	return !stop
}

// report writes the "suppressed" lines for the counts held back in an interval: the largest
// refusalSummariesMax one by one, the rest in one line.
func (l *refusalLog) report(held map[refusalKey]int64) {
	if len(held) == 0 {
		return
	}
	type entry struct {
		k refusalKey
		n int64
	}
	all := make([]entry, 0, len(held))
	for k, n := range held {
		all = append(all, entry{k, n})
	}
	slices.SortFunc(all, func(a, b entry) int {
		if c := cmp.Compare(b.n, a.n); c != 0 {
			return c
		}
		if c := cmp.Compare(a.k.reason, b.k.reason); c != 0 {
			return c
		}
		return cmp.Compare(a.k.compartment, b.k.compartment)
	})
	interval := refusalLogInterval.String()
	for i, e := range all {
		if i == refusalSummariesMax {
			var rest int64
			for _, r := range all[i:] {
				rest += r.n
			}
			l.log.Info("refusals not logged one by one in other compartments", "suppressed", rest,
				"pairs", len(all)-i, "interval", interval)
			return
		}
		l.log.Info("refusals not logged one by one", "reason", string(e.k.reason), "compartment", e.k.compartment,
			"suppressed", e.n, "interval", interval)
	}
}

// logRefusal writes a refused request's decision line, if the limits let it through. It runs
// only for refusals. Nothing the client sent is logged but the model name, the tenant the
// policy classified and the request id — never prompts, keys or other header values.
func (p *processor) logRefusal(d policy.Decision, status int) {
	if !p.srv.log.Enabled(p.ctx, slog.LevelInfo) || !p.srv.refusals.allow(d.Reason, d.Compartment) {
		return
	}
	attrs := make([]slog.Attr, 0, 10)
	attrs = append(attrs, slog.String("reason", string(d.Reason)), slog.String("compartment", d.Compartment),
		slog.Int("status", status))
	if classified(d.Reason) {
		n := p.snap.Names(d.Dims)
		attrs = append(attrs, slog.String("feature", n.Feature))
		if n.Tenant != "" {
			attrs = append(attrs, slog.String("tenant", clip(n.Tenant)))
		}
		attrs = append(attrs, slog.String("provider", n.Provider), slog.String("model", clip(n.Model)))
	}
	if retryable(d.Reason) {
		attrs = append(attrs, slog.String("retry_after", d.RetryAfter.Round(time.Millisecond).String()))
	}
	attrs = append(attrs, slog.String("request_id", p.req.id))
	p.srv.log.LogAttrs(context.WithoutCancel(p.ctx), slog.LevelInfo, "request refused", attrs...)
}

// classified reports whether a refusal for reason comes after classification: a body that
// could not be read or held is refused before the request has a feature, tenant or provider.
func classified(r policy.Reason) bool {
	return r != policy.ReasonBadRequest && r != policy.ReasonServerBusy
}

// clip shortens a value a client chose to maxLoggedValue bytes.
func clip(s string) string {
	if len(s) <= maxLoggedValue {
		return s
	}
	return s[:maxLoggedValue] + "…"
}

// refusalRequestID is the id a refusal reports: Envoy's x-request-id when it is one (up to 200
// visible ASCII characters, as a header value must be to be sent back unchanged), else a new
// random UUID, as Envoy would have made.
func refusalRequestID(id string) string {
	if validRequestID(id) {
		return id
	}
	return uuid.NewString()
}

func validRequestID(id string) bool {
	if id == "" || len(id) > 200 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c < 0x21 || c > 0x7e {
			return false
		}
	}
	return true
}
