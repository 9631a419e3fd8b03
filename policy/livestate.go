package policy

import (
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/adaptive"
	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
)

// CompartmentState is a compartment's live state as observers read it (package policy/observe
// makes metrics of it). Plain values: reading them changes nothing.
type CompartmentState struct {
	Name, Family string
	// Tenant marks a compartment of a tenant-keyed family (one tenant's, or the family's
	// overflow compartment).
	Tenant bool
	Stats  bulkhead.Stats
	// TPM, TPD and RPM are its token and request budgets' windows (nil: it has none).
	TPM, TPD, RPM *budget.State
	// Adaptive is its adaptive limit's state (nil: its limit is fixed).
	Adaptive *adaptive.State
}

// CompartmentStates returns the state of every compartment of snapshot s at now: static ones in
// family order, then tenant-keyed ones by name.
func (e *Engine) CompartmentStates(s *Snapshot, now time.Time) []CompartmentState {
	static, dynamic := s.staticInstances(), s.dynamicInstances()
	out := make([]CompartmentState, 0, len(static)+len(dynamic))
	for i, in := range append(static, dynamic...) {
		c := CompartmentState{Name: in.name, Family: in.family.name, Tenant: i >= len(static), Stats: e.sched.Stats(in.c)}
		for _, w := range []struct {
			win *budget.Window
			to  **budget.State
		}{{in.tpm, &c.TPM}, {in.tpd, &c.TPD}, {in.rpm, &c.RPM}} {
			if w.win != nil {
				st := w.win.State(now)
				*w.to = &st
			}
		}
		if in.adaptive != nil {
			st := in.adaptive.ctl.State()
			c.Adaptive = &st
		}
		out = append(out, c)
	}
	return out
}

// PoolStats returns the state of every pool.
func (e *Engine) PoolStats() []bulkhead.PoolStats { return e.sched.PoolStats() }

// TenantLabel reports whether metrics of tenant-keyed compartments name the tenant
// (admin.tenant_label); without it they count under "<family>/*".
func (s *Snapshot) TenantLabel() bool { return s.tenantLabel }
