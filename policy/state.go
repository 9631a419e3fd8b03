package policy

import (
	"errors"
	"slices"
	"sort"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
	"github.com/llm-bulkhead/llm-bulkhead/policy/statefile"
)

// The engine is the statefile.Source of a single process: it saves and restores every token
// budget's and request rate's window — static compartments, tenant compartments and the
// overflow compartments of tenant-keyed families — beside the spend ledger's windows.
var _ statefile.Source = (*Engine)(nil)

// windowKinds are the kinds of window an instance may have, in the order they are saved.
var windowKinds = [...]string{statefile.KindTokensPerMinute, statefile.KindTokensPerDay, statefile.KindRequestsPerMinute}

// window returns in's window of kind (nil when its limits set none).
func (in *instance) window(kind string) *budget.Window {
	switch kind {
	case statefile.KindTokensPerMinute:
		return in.tpm
	case statefile.KindTokensPerDay:
		return in.tpd
	case statefile.KindRequestsPerMinute:
		return in.rpm
	}
	return nil
}

// stateID identifies in, an instance of f, as a state file does (statefile.Window.CompartmentID).
func (f *family) stateID(in *instance) string {
	w := statefile.Window{Family: f.name, Key: f.cfg.Key, Values: in.values, Overflow: in.values == nil}
	return w.CompartmentID()
}

// appendWindows appends every window of in, an instance of f, with a charge that counts at now.
func (f *family) appendWindows(out []statefile.Window, in *instance, now time.Time) []statefile.Window {
	for _, kind := range windowKinds {
		w := in.window(kind)
		if w == nil {
			continue
		}
		slot, charges := w.Save(now)
		if len(charges) == 0 {
			continue
		}
		for i := range charges {
			// Far beyond any budget: only a window restored from slots shorter than its own, or
			// given a capacity near it, comes here, and a file must still hold it.
			charges[i].Amount = min(charges[i].Amount, statefile.MaxAmount)
		}
		out = append(out, statefile.Window{Compartment: in.name, Family: f.name, Key: f.cfg.Key, Values: in.values,
			Overflow: in.values == nil, Kind: kind, Slot: slot, Slots: charges})
	}
	return out
}

// SaveState implements statefile.Source: the spend ledger's windows, every window of a token
// budget or request rate with a charge that counts at now — including those a state file gave
// tenants that have not come back since — and the usage tables.
func (e *Engine) SaveState(now time.Time) statefile.State {
	sp := e.ledger.SaveState(now)
	st := statefile.State{Currency: sp.Currency, Spend: sp.Windows, Windows: []statefile.Window{}, Usage: e.usage.Save(now)}
	s := e.Snapshot()
	for _, f := range s.families {
		if f.dyn == nil {
			for _, in := range f.instances {
				if in != nil {
					st.Windows = f.appendWindows(st.Windows, in, now)
				}
			}
			continue
		}
		ins, pending := f.dyn.forSave(now)
		// A stable order, so that a state that did not change is not written again.
		sort.Slice(ins, func(i, j int) bool {
			if ins[i].name != ins[j].name {
				return ins[i].name < ins[j].name
			}
			return f.stateID(ins[i]) < f.stateID(ins[j])
		})
		for _, in := range ins {
			st.Windows = f.appendWindows(st.Windows, in, now)
		}
		st.Windows = append(st.Windows, pending...)
	}
	return st
}

// forSave returns the store's instances (its overflow compartment included) and the restored
// windows of tenants not back yet with a charge that still counts at now, forgetting the others.
func (st *dynStore) forSave(now time.Time) ([]*instance, []statefile.Window) {
	st.mu.Lock()
	defer st.mu.Unlock()
	ins := make([]*instance, 0, len(st.entries)+1)
	for _, e := range st.entries {
		ins = append(ins, e.in)
	}
	if st.overflow != nil {
		ins = append(ins, st.overflow)
	}
	var pending []statefile.Window
	for id, ws := range st.restored {
		kept := ws[:0]
		for _, w := range ws {
			if w.Slots = counting(w, now); len(w.Slots) > 0 {
				kept = append(kept, w)
			}
		}
		ws = kept
		if len(ws) == 0 {
			delete(st.restored, id)
			continue
		}
		st.restored[id] = ws
		pending = append(pending, ws...)
	}
	sort.Slice(pending, func(i, j int) bool {
		a, b := pending[i], pending[j]
		if a.Compartment != b.Compartment {
			return a.Compartment < b.Compartment
		}
		if ia, ib := a.CompartmentID(), b.CompartmentID(); ia != ib {
			return ia < ib
		}
		return a.Kind < b.Kind
	})
	return ins, pending
}

// counting returns the slots of w that still count at now: a slot leaves its window when the
// window's length has passed since it began.
func counting(w statefile.Window, now time.Time) statefile.Slots {
	cur := now.UnixNano() / int64(w.Slot)
	i := 0
	for i < len(w.Slots) && w.Slots[i].Index <= cur-budget.Slots {
		i++
	}
	return w.Slots[i:]
}

// RestoreState implements statefile.Source. Each window of st whose compartment the policy has,
// with a limit of its kind, replaces what that window counts, under the policy's capacity and
// length (budget.Window.Restore); the windows of tenants are restored when each tenant's
// compartment is next created, with the limits its request brings. Windows of compartments the
// policy no longer has (another family, another key, a removed value or limit) are dropped.
// Spend in another currency is refused as the ledger says; the rest is restored all the same.
func (e *Engine) RestoreState(st statefile.State, now time.Time) (statefile.Restored, error) {
	n := statefile.Restored{}
	s := e.Snapshot()
	live := map[string]*instance{}
	stores := map[string]*family{}
	for _, f := range s.families {
		if f.dyn == nil {
			for _, in := range f.instances {
				if in != nil {
					live[f.stateID(in)] = in
				}
			}
			continue
		}
		stores[statefile.ID(f.name, f.cfg.Key, nil)] = f
		ins, _ := f.dyn.forSave(now)
		for _, in := range ins {
			live[f.stateID(in)] = in
		}
	}
	pending := map[*dynStore][]statefile.Window{}
	for _, w := range st.Windows {
		if in := live[w.CompartmentID()]; in != nil {
			if win := in.window(w.Kind); win != nil && win.Restore(w.Slot, w.Slots, now) > 0 {
				n[w.Kind]++
			}
			continue
		}
		f := stores[statefile.ID(w.Family, w.Key, nil)]
		if f == nil || w.Overflow || !s.couldHave(f, w.Values) {
			continue
		}
		if w.Slots = counting(w, now); len(w.Slots) > 0 {
			pending[f.dyn] = append(pending[f.dyn], w)
			n[w.Kind]++
		}
	}
	for ds, ws := range pending {
		ds.mu.Lock()
		ds.restored = map[string][]statefile.Window{}
		for _, w := range ws {
			id := w.CompartmentID()
			ds.restored[id] = append(ds.restored[id], w)
		}
		ds.mu.Unlock()
	}
	n[statefile.KindUsage] = e.usage.Restore(st.Usage, now)
	spent, err := e.ledger.RestoreState(spend.SavedState{Currency: st.Currency, Windows: st.Spend}, now)
	n[statefile.KindSpend] = spent
	return n, spendRestoreError(err)
}

// couldHave reports whether f, a tenant-keyed family, could have a compartment with these
// values of its key: each names a value the policy has, and passes the family's filters.
func (s *Snapshot) couldHave(f *family, values []string) bool {
	var d Dims
	for i, k := range f.key {
		v, ok := values[i], true
		switch k {
		case dimFeature:
			d.Feature, ok = s.featureIdx[v]
		case dimTier:
			d.Tier, ok = s.tierIdx[v]
		case dimProvider:
			d.Provider, ok = s.providerIdx[v]
		case dimModel:
			d.modelGroup, ok = s.modelGroupIdx[v]
		case dimTenant:
			d.Tenant = v
		}
		if !ok {
			return false
		}
	}
	return f.matches(&d, true) && (f.whereTenant == nil || slices.Contains(f.whereTenant, d.Tenant))
}

// claimRestored restores into in, a tenant compartment just created, the windows a state file
// kept for it, under its own limits: a window whose limit it no longer has is dropped. st.mu is
// held.
func (st *dynStore) claimRestored(in *instance, now time.Time) {
	id := in.family.stateID(in)
	ws, ok := st.restored[id]
	if !ok {
		return
	}
	delete(st.restored, id)
	for _, w := range ws {
		if win := in.window(w.Kind); win != nil {
			win.Restore(w.Slot, w.Slots, now)
		}
	}
}

// spendRestoreError says why the ledger refused the file's spend, as a state file error.
func spendRestoreError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, spend.ErrOtherCurrency):
		return &statefile.StateError{Reason: statefile.ReasonCurrency, Err: err}
	}
	return &statefile.StateError{Reason: statefile.ReasonCorrupt, Err: err}
}
