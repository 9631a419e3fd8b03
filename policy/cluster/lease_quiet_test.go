package cluster

import (
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// reportsOf counts the lease reports replica l sent, by reason (all of them without).
func reportsOf(l *Leaser, ws ...why) float64 {
	if len(ws) == 0 {
		for w := whyRenew; w < whyCount; w++ {
			ws = append(ws, w)
		}
	}
	var n float64
	for _, w := range ws {
		var m dto.Metric
		if err := l.st.met.leaseReports[w].Write(&m); err != nil {
			panic(err)
		}
		n += m.GetCounter().GetValue()
	}
	return n
}

// A window no longer used is let go: its last chunk expires and goes back, and the lease is not
// reported again (it used to keep asking for a chunk of one, renewed forever).
func TestIdleWindowIsNoLongerReported(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "idlewin", 1, time.Minute)
	lim := LeaseLimits{Windows: []Window{{Name: "tenant/acme", Kind: "tpm", Length: time.Minute, Capacity: 1_000_000}}}
	ls := f.leasers[0].Lease("tenant/acme", lim, nil)
	for range 2 * renewSteps {
		if _, ok := ls.Reserve(0, 100, f.clock.Now()); !ok {
			ls.NeedWindow(0, 100)
			f.leasers[0].Round()
			ls.UnneedWindow(0, 100)
		}
		f.round()
	}
	// The use stops. Its rate halves at every report, so it dies down within a few dozen
	// renewals; after that, nothing is reported.
	for range 60 * renewSteps {
		f.round()
	}
	before := reportsOf(f.leasers[0])
	for range 10 * renewSteps {
		f.round()
	}
	if got := reportsOf(f.leasers[0]) - before; got != 0 {
		ls.mu.Lock()
		defer ls.mu.Unlock()
		t.Fatalf("a window unused for %d rounds was reported %v times in %d more (its chunks: %v)", 60*renewSteps, got, 10*renewSteps, ls.wins[0].chunks)
	}
}
