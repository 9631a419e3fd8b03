package policy

// GlobMatch exposes the model-map glob to tests.
var GlobMatch = globMatch

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
