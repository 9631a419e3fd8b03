package policy

import "fmt"

// EvictionExamined returns how many tenant compartments eviction searches have looked at, over
// every tenant-keyed family of e.
func EvictionExamined(e *Engine) int64 {
	var n int64
	for _, f := range e.Snapshot().families {
		if f.dyn != nil {
			f.dyn.mu.Lock()
			n += f.dyn.examined
			f.dyn.mu.Unlock()
		}
	}
	return n
}

// BuildSteps names the steps of building a snapshot.
var BuildSteps = buildSteps

// FailBuildAt makes every later Apply of e fail after the named build step (none when step is
// empty).
func FailBuildAt(e *Engine, step string) {
	e.applyMu.Lock()
	defer e.applyMu.Unlock()
	if step == "" {
		e.afterBuildStep = nil
		return
	}
	e.afterBuildStep = func(s string) error {
		if s == step {
			return fmt.Errorf("injected failure after %s", s)
		}
		return nil
	}
}

// PriceTable compiles a policy's prices list as a snapshot does.
var PriceTable = priceTable

// NextLeaseRound returns a channel closed when e's next round of lease reports has ended (nil
// without leased admission).
func NextLeaseRound(e *Engine) <-chan struct{} {
	if e.cluster == nil || e.cluster.leaser == nil {
		return nil
	}
	return e.cluster.leaser.Next()
}
