package policy

import (
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

type dim uint8

const (
	dimFeature dim = iota
	dimTenant
	dimTier
	dimProvider
	// dimModel keys by model group: the models glob a request's model matches (Snapshot's
	// modelGroups), never the model itself.
	dimModel
	numDims
)

func parseDim(s string) dim {
	switch s {
	case config.DimTenant:
		return dimTenant
	case config.DimTier:
		return dimTier
	case config.DimProvider:
		return dimProvider
	case config.DimModel:
		return dimModel
	}
	return dimFeature
}

// instance is one compartment of a family with the limits and budgets that go with it.
// Immutable once built, apart from the state inside its compartment and windows.
type instance struct {
	name string
	// values are the instance's value of each dimension of its family's key, in key order (none
	// for a tenant-keyed family's overflow compartment): what a state file knows it by.
	values []string
	family *family
	c      *bulkhead.Compartment
	limits config.Resolved
	tpm    *budget.Window
	tpd    *budget.Window
	rpm    *budget.Window
	// lease tracks the requests using an instance of a tenant-keyed family (nil for static
	// families), for eviction.
	lease *lease
	// dynamic marks instances created on demand for a tenant.
	dynamic bool
	gen     uint64
	// spend are the compartment's spend budgets (none without spend_per_* limits).
	spend []spend.Budget
	// adaptive is the compartment's learned limit (nil unless max_concurrent is adaptive).
	adaptive *adaptiveLimit
	// fleetLimits are the limits before the per-replica share divided them (equal to limits
	// but while a cluster's shared state is unavailable): what the fleet shares.
	fleetLimits config.Resolved
	// fleet is the compartment's lease of the fleet's limits (leased cluster admission only).
	fleet *fleetLease
}

// family is a compiled compartment family.
type family struct {
	name  string
	key   []dim
	cfg   config.Family
	where [numDims][]bool // per dim, allowed value indexes (nil = any); tenant filter in whereTenant
	// whereTenant lists allowed tenants (nil = any).
	whereTenant []string

	// Static families (no tenant in key) index instances by the key dims' values.
	strides   []int
	instances []*instance

	// Dynamic families (tenant in key) create instances on demand.
	dyn *dynStore
	// modelGroups names the snapshot's model groups, for dynamic keys.
	modelGroups []string

	// fixed is the family's own limits (nil when they come from limits_from).
	fixed          *config.Resolved
	scaleByFeature bool
	mode           familyMode
}

// dynKey identifies an instance of a tenant-keyed family. The model group is kept by name, which
// stays the same across reloads that add or remove other globs.
type dynKey struct {
	tenant                  string
	model                   string
	feature, tier, provider int
}

func (f *family) applies(d *Dims) bool { return f.matches(d, false) }

// matches checks d against the family's where filters; keyOnly checks only the dimensions in
// the family's key (when building instances, the others are not known yet).
func (f *family) matches(d *Dims, keyOnly bool) bool {
	for i, allowed := range f.where {
		if allowed == nil || (keyOnly && !slices.Contains(f.key, dim(i))) {
			continue
		}
		var idx int
		switch dim(i) {
		case dimFeature:
			idx = d.Feature
		case dimTier:
			idx = d.Tier
		case dimProvider:
			idx = d.Provider
		case dimModel:
			idx = d.modelGroup
		default:
			continue
		}
		if idx < 0 || idx >= len(allowed) || !allowed[idx] {
			return false
		}
	}
	if f.whereTenant != nil && !keyOnly && !slices.Contains(f.whereTenant, d.Tenant) {
		return false
	}
	return true
}

// staticIndex returns the index of d's instance in a static family.
func (f *family) staticIndex(d *Dims) int {
	idx := 0
	for i, k := range f.key {
		var v int
		switch k {
		case dimFeature:
			v = d.Feature
		case dimTier:
			v = d.Tier
		case dimProvider:
			v = d.Provider
		case dimModel:
			v = d.modelGroup
		}
		idx += v * f.strides[i]
	}
	return idx
}

func (f *family) dynKeyOf(d *Dims) dynKey {
	k := dynKey{tenant: d.Tenant, feature: -1, tier: -1, provider: -1}
	for _, kd := range f.key {
		switch kd {
		case dimFeature:
			k.feature = d.Feature
		case dimTier:
			k.tier = d.Tier
		case dimProvider:
			k.provider = d.Provider
		case dimModel:
			k.model = f.modelGroups[d.modelGroup]
		}
	}
	return k
}

// instanceName names the instance of family f for the given key values.
func instanceName(family string, values []string) string {
	return family + "/" + strings.Join(values, "/")
}

// keyValues returns the names of d's values for the dimensions of f's key, in key order.
func (s *Snapshot) keyValues(f *family, d *Dims) []string {
	vals := make([]string, 0, len(f.key))
	for _, k := range f.key {
		switch k {
		case dimFeature:
			vals = append(vals, s.features[d.Feature].name)
		case dimTenant:
			vals = append(vals, d.Tenant)
		case dimTier:
			vals = append(vals, s.tiers[d.Tier])
		case dimProvider:
			vals = append(vals, s.providers[d.Provider].name)
		case dimModel:
			vals = append(vals, s.modelGroups[d.modelGroup])
		}
	}
	return vals
}

func (s *Snapshot) newDynamic(f *family, d *Dims) *instance {
	vals := s.keyValues(f, d)
	for i, k := range f.key {
		if k == dimTenant {
			// The instance outlives the request: its tenant must not share memory with the
			// request's message.
			vals[i] = strings.Clone(vals[i])
		}
	}
	in := &instance{name: instanceName(f.name, vals), values: vals, family: f, dynamic: true, gen: s.gen, lease: &lease{}}
	s.setLimits(in, s.limitsFor(f, d))
	in.c = bulkhead.NewCompartment(in.name, compartmentLimits(in.limits))
	s.attachBudgets(in, nil)
	s.attachAdaptive(in, nil, false)
	s.attachFleet(in, true)
	return in
}

// refreshDynamic returns a copy of in with this snapshot's limits. Instances are immutable once
// published (requests in flight read them without locks); the compartment and budget windows
// carry over and are reconfigured in place, under their own locks.
func (s *Snapshot) refreshDynamic(f *family, in *instance, d *Dims) *instance {
	fresh := &instance{name: in.name, values: in.values, family: f, c: in.c, dynamic: true, gen: s.gen, lease: in.lease}
	s.setLimits(fresh, s.limitsFor(f, d))
	s.engine.sched.SetLimits(fresh.c, compartmentLimits(fresh.limits)) // s is live: apply now
	s.attachBudgets(fresh, in)
	s.attachAdaptive(fresh, in, false)
	s.attachFleet(fresh, true)
	return fresh
}

// limitsFor computes the limits of the instance of f that d falls in, from limit sets resolved
// when the snapshot was built (it runs when a new tenant arrives, so it reads no config).
func (s *Snapshot) limitsFor(f *family, d *Dims) config.Resolved {
	var r config.Resolved
	if f.fixed != nil {
		r = *f.fixed
	} else {
		switch parseDim(f.cfg.LimitsFrom) {
		case dimFeature:
			r = s.limits.feature[d.Feature]
		case dimTier:
			r = s.limits.tier[d.Tier]
		case dimProvider:
			r = s.limits.provider[d.Provider]
		case dimTenant:
			var ok bool
			if r, ok = s.limits.tenant[tenantTier{d.Tenant, d.Tier}]; !ok {
				r = s.limits.tier[d.Tier]
			}
		}
	}
	if f.scaleByFeature {
		r = r.Scale(s.features[d.Feature].ratio)
	}
	switch f.mode {
	case modeShadow:
		r.Shadow = true
	case modeEnforce:
		r.Shadow = false
	}
	return r
}

// setLimits gives in the fleet's limits r, and enforces them divided by the per-replica share.
func (s *Snapshot) setLimits(in *instance, r config.Resolved) {
	in.fleetLimits, in.limits = r, shareLimits(r, s.share)
}

// familyMode is a family's mode override.
type familyMode uint8

const (
	modeAsLimits familyMode = iota // each limit set's own mode
	modeEnforce
	modeShadow
)

// tenantTier keys the limits of a directory tenant with overrides, in one tier.
type tenantTier struct {
	tenant string
	tier   int
}

// resolvedLimits are the policy's limit sets with templates and defaults applied, by the index
// of their feature, tier or provider, and for directory tenants with overrides, by tenant and tier.
type resolvedLimits struct {
	feature, tier, provider []config.Resolved
	tenant                  map[tenantTier]config.Resolved
}

func (s *Snapshot) resolveLimits() {
	p := s.policy
	for _, f := range s.features {
		s.limits.feature = append(s.limits.feature, p.Resolve(p.Features[f.name].Limits))
	}
	for _, t := range s.tiers {
		s.limits.tier = append(s.limits.tier, p.Resolve(p.Tiers[t]))
	}
	for _, pr := range s.providers {
		s.limits.provider = append(s.limits.provider, p.Resolve(p.Providers[pr.name].Limits))
	}
	s.limits.tenant = map[tenantTier]config.Resolved{}
	for _, t := range p.Tenants.Directory {
		if t.Limits == nil {
			continue
		}
		for i, tier := range s.tiers {
			s.limits.tenant[tenantTier{t.ID, i}] = p.Resolve(config.Overlay(p.Tiers[tier], *t.Limits))
		}
	}
}

func compartmentLimits(r config.Resolved) bulkhead.Limits {
	return bulkhead.Limits{
		MaxConcurrent: r.MaxConcurrent, MaxInflightTokens: r.MaxInflightTokens,
		QueueDepth: r.QueueDepth, Priority: r.Priority, Shadow: r.Shadow,
	}
}

// attachBudgets gives in its budget windows, reusing (and reconfiguring) those of prev when
// prev is the same compartment from an earlier snapshot.
func (s *Snapshot) attachBudgets(in, prev *instance) {
	now := s.built
	pick := func(old *budget.Window, capacity int64, window time.Duration) *budget.Window {
		if capacity <= 0 {
			return nil
		}
		if old != nil {
			maxDebt := in.limits.MaxDebt
			s.onCommit(func() { old.Reconfigure(capacity, window, maxDebt, now) })
			return old
		}
		return budget.New(capacity, window, in.limits.MaxDebt, now)
	}
	var otpm, otpd, orpm *budget.Window
	if prev != nil {
		otpm, otpd, orpm = prev.tpm, prev.tpd, prev.rpm
	}
	in.spend = spendBudgets(in.name, in.limits)
	in.tpm = pick(otpm, in.limits.TokensPerMinute, time.Minute)
	in.tpd = pick(otpd, in.limits.TokensPerDay, 24*time.Hour)
	in.rpm = pick(orpm, in.limits.RequestsPerMinute, time.Minute)
}

// buildFamilies compiles the policy's families, carrying compartments and budgets over from
// the previous snapshot where an instance keeps its name.
func (s *Snapshot) buildFamilies(prev *Snapshot) {
	p := s.policy
	oldStatic := map[string]*instance{}
	oldDyn := map[string]*dynStore{}
	if prev != nil {
		for _, f := range prev.families {
			for _, in := range f.instances {
				if in != nil {
					oldStatic[in.name] = in
				}
			}
			if f.dyn != nil {
				oldDyn[familyIdentity(f.cfg)] = f.dyn
			}
		}
	}
	// Compartments an earlier reload removed come back with their state.
	for name, in := range s.engine.retired {
		if oldStatic[name] == nil {
			oldStatic[name] = in
		}
	}
	for id, st := range s.engine.retiredDyn {
		if oldDyn[id] == nil {
			oldDyn[id] = st
		}
	}
	for _, fc := range p.Compartments {
		f := &family{name: fc.Name, cfg: fc, scaleByFeature: fc.ScaleBy == config.DimFeature, modelGroups: s.modelGroups}
		if fc.Limits != nil {
			r := p.Resolve(*fc.Limits)
			f.fixed = &r
		}
		switch fc.Mode {
		case "shadow":
			f.mode = modeShadow
		case "enforce":
			f.mode = modeEnforce
		}
		for _, k := range fc.Key {
			f.key = append(f.key, parseDim(k))
		}
		for d, vals := range fc.Where {
			switch parseDim(d) {
			case dimTenant:
				f.whereTenant = vals
			case dimFeature:
				f.where[dimFeature] = s.allowed(s.featureIdx, vals)
			case dimTier:
				f.where[dimTier] = s.allowed(s.tierIdx, vals)
			case dimProvider:
				f.where[dimProvider] = s.allowed(s.providerIdx, vals)
			case dimModel:
				f.where[dimModel] = s.allowed(s.modelGroupIdx, vals)
			}
		}
		if slices.Contains(f.key, dimTenant) {
			st := oldDyn[familyIdentity(fc)]
			if st == nil {
				st = newDynStore()
			}
			f.dyn = st
			overflow := s.buildOverflow(f, st)
			maxInstances, ttl := fc.MaxInstances, fc.IdleTTL.D()
			s.onCommit(func() {
				st.mu.Lock()
				st.max, st.ttl, st.overflow = maxInstances, ttl, overflow
				st.mu.Unlock()
			})
		} else {
			s.buildStatic(f, oldStatic)
		}
		s.families = append(s.families, f)
	}
}

// familyIdentity is what must stay equal for a tenant-keyed family's instances to carry over.
func familyIdentity(f config.Family) string {
	return f.Name + "|" + strings.Join(f.Key, ",")
}

func (s *Snapshot) allowed(idx map[string]int, vals []string) []bool {
	out := make([]bool, len(idx))
	for _, v := range vals {
		if i, ok := idx[v]; ok {
			out[i] = true
		}
	}
	return out
}

func (s *Snapshot) dimSize(k dim) int {
	switch k {
	case dimFeature:
		return len(s.features)
	case dimTier:
		return len(s.tiers)
	case dimProvider:
		return len(s.providers)
	case dimModel:
		return len(s.modelGroups)
	}
	return 1
}

func (s *Snapshot) buildStatic(f *family, old map[string]*instance) {
	total := 1
	f.strides = make([]int, len(f.key))
	for i := len(f.key) - 1; i >= 0; i-- {
		f.strides[i] = total
		total *= s.dimSize(f.key[i])
	}
	f.instances = make([]*instance, total)
	var d Dims
	for idx := 0; idx < total; idx++ {
		rem := idx
		for i, k := range f.key {
			v := rem / f.strides[i]
			rem %= f.strides[i]
			switch k {
			case dimFeature:
				d.Feature = v
			case dimTier:
				d.Tier = v
			case dimProvider:
				d.Provider = v
			case dimModel:
				d.modelGroup = v
			}
		}
		if !f.matches(&d, true) {
			continue
		}
		vals := s.keyValues(f, &d)
		in := &instance{name: instanceName(f.name, vals), values: vals, family: f, gen: s.gen}
		s.setLimits(in, s.limitsFor(f, &d))
		s.adopt(in, old[in.name])
		f.instances[idx] = in
	}
}

// buildOverflow makes the shared compartment new tenants use when a tenant-keyed family is at
// max_instances with nothing evictable. It has the limits of the default tier, and carries over
// the state of the store's earlier overflow compartment (none for a new store).
func (s *Snapshot) buildOverflow(f *family, st *dynStore) *instance {
	d := Dims{Tenant: "", Tier: s.tierIdx[s.policy.Classification.Tier.Default]}
	in := &instance{name: f.name + "/_overflow", family: f, gen: s.gen}
	s.setLimits(in, s.limitsFor(f, &d))
	st.mu.Lock()
	old := st.overflow
	st.mu.Unlock()
	s.adopt(in, old)
	in.lease = &lease{}
	if old != nil {
		in.lease = old.lease
	}
	return in
}

// adopt gives a newly built static instance its compartment and budgets: those of prev, the
// same compartment in the previous snapshot, with the new limits applied once the snapshot is
// live; or new ones.
func (s *Snapshot) adopt(in, prev *instance) {
	if prev != nil {
		in.c = prev.c
		c, l := in.c, compartmentLimits(in.limits)
		s.onCommit(func() { s.engine.sched.SetLimits(c, l) })
	} else {
		in.c = bulkhead.NewCompartment(in.name, compartmentLimits(in.limits))
	}
	s.attachBudgets(in, prev)
	s.attachAdaptive(in, prev, prev != nil)
	s.attachFleet(in, false)
}

// staticInstances lists every static instance in family order, then name order.
func (s *Snapshot) staticInstances() []*instance {
	var out []*instance
	for _, f := range s.families {
		for _, in := range f.instances {
			if in != nil {
				out = append(out, in)
			}
		}
	}
	return out
}

// dynamicInstances lists the live instances of tenant-keyed families, sorted by name.
func (s *Snapshot) dynamicInstances() []*instance {
	var out []*instance
	for _, f := range s.families {
		if f.dyn == nil {
			continue
		}
		out = append(out, f.dyn.instances()...)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}
