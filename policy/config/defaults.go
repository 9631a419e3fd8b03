package config

// Every default and derived value of a policy in one file, so that what an unset key means can be
// read in one place.

import (
	"fmt"
	"math"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
)

// Defaults that more than one place needs.
const (
	DefaultGRPCAddr          = "127.0.0.1:9002"
	DefaultAdminAddr         = "127.0.0.1:9090"
	DefaultMetadataNamespace = "llm_bulkhead"
	DefaultMaxRequestBody    = 8 << 20
	DefaultFeature           = "default"
	DefaultTenant            = "anonymous"
	DefaultProvider          = "default"
	DefaultModel             = "unknown"
	DefaultTokenEnv          = "LLM_BULKHEAD_ADMIN_TOKEN"
	DefaultMaxStreams        = 20000
	DefaultMaxStreamsPerConn = 5000
	DefaultMaxBufferedBody   = 256 << 20
)

// Cluster backends and modes, and the defaults of the cluster section (applied only when a
// backend is set).
const (
	ClusterRedis      = "redis"
	ClusterStandalone = "standalone"
	ClusterSentinel   = "sentinel"
	ClusterCluster    = "cluster"

	OnUnavailableLocal  = "local"
	OnUnavailableClosed = "closed"

	AdmissionLeased = "leased"
	AdmissionExact  = "exact"

	DefaultClusterKeyPrefix             = "llm-bulkhead"
	DefaultClusterTimeout               = 20 * time.Millisecond
	DefaultClusterDialTimeout           = time.Second
	DefaultClusterWriteTimeout          = time.Second
	DefaultClusterLeaseTTL              = 10 * time.Second
	DefaultClusterSettleInterval        = 2 * time.Millisecond
	DefaultClusterMaxPendingSettlements = 100000
	DefaultClusterLeaseInterval         = 200 * time.Millisecond
)

// MaxReplicaIDBytes bounds cluster.replica_id: it is part of Redis keys and of every lease.
const MaxReplicaIDBytes = 128

// DefaultQuotaPath is quota_endpoint.path's default.
const DefaultQuotaPath = "/v1/bulkhead/quota"

// Provider quota modes (providers.<name>.quota.mode).
const (
	QuotaOff     = "off"
	QuotaShadow  = "shadow"
	QuotaEnforce = "enforce"
)

// Dimension names as used in compartment keys and classification.
const (
	DimFeature  = "feature"
	DimTenant   = "tenant"
	DimTier     = "tier"
	DimProvider = "provider"
	DimModel    = "model"
	// DimPriority names the priority rules (classification.priority); it is not a compartment
	// key.
	DimPriority = "priority"
	// DimAccount names a provider quota's account source (providers.<name>.quota.account); it
	// is not a compartment key.
	DimAccount = "account"
)

// Provider quota accounts: the default account and max_accounts, and how many distinct
// account sources the providers may use together (each is read at classification).
const (
	DefaultQuotaAccount     = "default"
	DefaultMaxQuotaAccounts = 64
	MaxQuotaAccounts        = 4096
	MaxAccountSources       = 4
)

func (p *Policy) applyDefaults() {
	p.QuotaEndpoint.Path = orString(p.QuotaEndpoint.Path, DefaultQuotaPath)
	s := &p.Server
	s.GRPCAddr = orString(s.GRPCAddr, DefaultGRPCAddr)
	s.AdminAddr = orString(s.AdminAddr, DefaultAdminAddr)
	if s.DrainGrace == 0 {
		s.DrainGrace = Duration(15 * time.Second)
	}
	s.LogLevel = orString(s.LogLevel, "info")
	s.MaxStreams = int(orInt(int64(s.MaxStreams), DefaultMaxStreams))
	if s.MaxStreamsPerConnection == 0 {
		s.MaxStreamsPerConnection = min(DefaultMaxStreamsPerConn, max(s.MaxStreams, 1))
	}
	if s.KeepaliveTime == 0 {
		s.KeepaliveTime = Duration(30 * time.Second)
	}
	if s.KeepaliveTimeout == 0 {
		s.KeepaliveTimeout = Duration(10 * time.Second)
	}
	if s.FirstMessageTimeout == 0 {
		s.FirstMessageTimeout = Duration(10 * time.Second)
	}
	if s.StreamIdleTimeout == 0 {
		s.StreamIdleTimeout = Duration(10 * time.Minute)
	}

	p.Admin.TokenEnv = orString(p.Admin.TokenEnv, DefaultTokenEnv)
	p.Currency = orString(p.Currency, "USD")
	p.TimeZone = orString(p.TimeZone, "UTC")

	e := &p.Envoy
	e.RequestBodyMode = orString(e.RequestBodyMode, "BUFFERED")
	e.ResponseBodyMode = orString(e.ResponseBodyMode, "STREAMED")
	if e.MessageTimeout == 0 {
		e.MessageTimeout = Duration(200 * time.Millisecond)
	}
	e.MetadataNamespace = orString(e.MetadataNamespace, DefaultMetadataNamespace)
	if e.MaxRequestBody == 0 {
		e.MaxRequestBody = DefaultMaxRequestBody
	}

	if p.Tenants.DefaultTier == "" {
		if _, ok := p.Tiers["free"]; ok {
			p.Tenants.DefaultTier = "free"
		} else if len(p.Tiers) == 1 {
			for name := range p.Tiers {
				p.Tenants.DefaultTier = name
			}
		}
	}
	p.Tenants.UnknownKey = orString(p.Tenants.UnknownKey, UnknownKeyDefault)
	c := &p.Classification
	c.Feature.Default = orString(c.Feature.Default, DefaultFeature)
	c.Tenant.Default = orString(c.Tenant.Default, DefaultTenant)
	c.Tier.Default = orString(c.Tier.Default, p.Tenants.DefaultTier)
	if c.Tier.Default == "" && len(p.Tiers) == 0 {
		// Without tiers every request is in one tier of this name.
		c.Tier.Default = "none"
	}
	c.Provider.Default = orString(c.Provider.Default, DefaultProvider)
	c.Model.Default = orString(c.Model.Default, DefaultModel)

	est := &p.Estimation
	est.BytesPerToken = orFloat(est.BytesPerToken, 4)
	est.DefaultMaxTokens = orInt(est.DefaultMaxTokens, 1024)
	est.ImageTokens = orInt(est.ImageTokens, 765)
	est.AudioTokens = orInt(est.AudioTokens, 1000)
	est.FileTokens = orInt(est.FileTokens, 2000)
	if est.Learn == nil {
		est.Learn = ptr(true)
	}
	est.LearnWeight = orFloat(est.LearnWeight, 0.05)
	est.MinBytesPerToken = orFloat(est.MinBytesPerToken, 1)
	est.MaxBytesPerToken = orFloat(est.MaxBytesPerToken, 12)
	est.MaxTokens = orInt(est.MaxTokens, 1_000_000)

	if p.Body.InjectIncludeUsage == nil {
		p.Body.InjectIncludeUsage = ptr(true)
	}
	if p.Body.StripAcceptEncoding == nil {
		p.Body.StripAcceptEncoding = ptr(true)
	}

	if p.Compartments == nil {
		p.Compartments = []Family{{Name: DimFeature, Key: []string{DimFeature}, LimitsFrom: DimFeature}}
	}
	for i := range p.Compartments {
		f := &p.Compartments[i]
		if f.MaxInstances == 0 {
			f.MaxInstances = 10000
		}
		if f.IdleTTL == 0 {
			f.IdleTTL = Duration(10 * time.Minute)
		}
	}
	for name, pr := range p.Providers {
		if a := pr.Quota.Account; a != nil {
			a.Default = orString(a.Default, DefaultQuotaAccount)
			pr.Quota.MaxAccounts = int(orInt(int64(pr.Quota.MaxAccounts), DefaultMaxQuotaAccounts))
			p.Providers[name] = pr
		}
	}
	for name, f := range p.Features {
		if f.Degrade != nil && len(f.Degrade.On) == 0 {
			f.Degrade.On = []string{"token_budget", "spend_budget"}
			p.Features[name] = f
		}
	}
	p.Cluster.applyDefaults()
	p.State.applyDefaults(p.Spend)
	p.Refusals.applyDefaults()
	p.Tracing.applyDefaults()
	p.Usage.applyDefaults()
}

// Enabled reports whether limits are shared through a backend (after defaults: "none" is
// normalised to empty).
func (c *Cluster) Enabled() bool { return c.Backend != "" && c.Backend != "none" }

// applyDefaults normalises backend "none" to empty and, only when a backend is set, fills the
// section's defaults. With the backend off every key stays as written, so validation can refuse
// the ones that would do nothing.
func (c *Cluster) applyDefaults() {
	if c.Backend == "none" {
		c.Backend = ""
	}
	if !c.Enabled() {
		return
	}
	// Defaults are filled for any backend, not only redis: an unknown backend is refused anyway,
	// and its other keys are then checked against the defaults a fixed backend would get.
	c.Mode = orString(c.Mode, ClusterStandalone)
	c.KeyPrefix = orString(c.KeyPrefix, DefaultClusterKeyPrefix)
	c.ReplicaID = orString(c.ReplicaID, defaultReplicaID())
	orDuration(&c.Timeout, DefaultClusterTimeout)
	orDuration(&c.DialTimeout, DefaultClusterDialTimeout)
	orDuration(&c.WriteTimeout, DefaultClusterWriteTimeout)
	orDuration(&c.LeaseTTL, DefaultClusterLeaseTTL)
	if c.LeaseTTL > 0 {
		orDuration(&c.Heartbeat, c.LeaseTTL.D()/4)
	} else {
		// A lease_ttl that is refused must not also make the heartbeat derived from it wrong.
		orDuration(&c.Heartbeat, DefaultClusterLeaseTTL/4)
	}
	orDuration(&c.SettleInterval, DefaultClusterSettleInterval)
	c.MaxPendingSettlements = int(orInt(int64(c.MaxPendingSettlements), DefaultClusterMaxPendingSettlements))
	c.OnUnavailable = orString(c.OnUnavailable, OnUnavailableLocal)
	c.Admission = orString(c.Admission, AdmissionLeased)
	orDuration(&c.LeaseInterval, DefaultClusterLeaseInterval)
}

// defaultReplicaID is "<hostname>-<pid>", with whitespace in the host name replaced and the
// host name shortened so the id always passes validation.
func defaultReplicaID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "llm-bulkhead"
	}
	host = strings.Map(func(r rune) rune {
		if unicode.IsSpace(r) || unicode.IsControl(r) {
			return '-'
		}
		return r
	}, host)
	pid := "-" + strconv.Itoa(os.Getpid())
	if len(host)+len(pid) > MaxReplicaIDBytes {
		host = strings.ToValidUTF8(host[:MaxReplicaIDBytes-len(pid)], "")
	}
	return host + pid
}

// Resolved is a limit set with template inheritance and defaults applied. Zero in a count field
// means "no limit".
type Resolved struct {
	// MaxConcurrent is the fixed limit, or adaptive.max when the limit is adaptive.
	MaxConcurrent     int64
	MaxInflightTokens int64
	// Adaptive is the adaptive limit's settings (zero for a fixed limit).
	Adaptive AdaptiveLimit
	// MaxWait is how long a request may queue here; meaningful only when HasMaxWait.
	MaxWait time.Duration
	// HasMaxWait reports whether the limit set (or a template) set max_wait at all. A compartment
	// without one does not limit how long its requests wait.
	HasMaxWait        bool
	QueueDepth        int64
	Priority          int64
	Shadow            bool
	TokensPerMinute   int64
	TokensPerDay      int64
	RequestsPerMinute int64
	MaxDebt           float64
	// Spend holds the spend budgets by period (spend.Hour, spend.Day, spend.Month); 0 = none.
	Spend [3]Amount
}

// AnySpend reports whether the limit set has a spend budget.
func (r Resolved) AnySpend() bool { return r.Spend != [3]Amount{} }

// Resolve applies l's template chain and the documented defaults. It assumes a validated policy;
// a missing template or a cycle simply ends the chain.
func (p *Policy) Resolve(l Limits) Resolved {
	merged, _ := p.inherit(l)
	return finish(merged)
}

// inherit fills l's unset fields from its template chain. It returns the chain of template names
// visited and stops at the first unknown name or repeat (validation reports those).
func (p *Policy) inherit(l Limits) (Limits, []string) {
	var chain []string
	seen := map[string]bool{}
	next := l.Template
	for next != "" && !seen[next] {
		seen[next] = true
		chain = append(chain, next)
		t, ok := p.Templates[next]
		if !ok {
			break
		}
		fillUnset(&l, t)
		next = t.Template
	}
	return l, chain
}

// fillUnset copies every field of src that dst leaves unset.
func fillUnset(dst *Limits, src Limits) {
	setIfNil(&dst.MaxConcurrent, src.MaxConcurrent)
	setIfNil(&dst.Adaptive, src.Adaptive)
	setIfNil(&dst.MaxInflightTokens, src.MaxInflightTokens)
	setIfNil(&dst.MaxWait, src.MaxWait)
	setIfNil(&dst.QueueDepth, src.QueueDepth)
	setIfNil(&dst.Priority, src.Priority)
	setIfNil(&dst.Mode, src.Mode)
	setIfNil(&dst.TokensPerMinute, src.TokensPerMinute)
	setIfNil(&dst.TokensPerDay, src.TokensPerDay)
	setIfNil(&dst.RequestsPerMinute, src.RequestsPerMinute)
	setIfNil(&dst.MaxDebt, src.MaxDebt)
	setIfNil(&dst.SpendPerHour, src.SpendPerHour)
	setIfNil(&dst.SpendPerDay, src.SpendPerDay)
	setIfNil(&dst.SpendPerMonth, src.SpendPerMonth)
}

// Overlay returns base with every field that over sets replaced; used for per-tenant overrides
// on top of a tier template.
func Overlay(base, over Limits) Limits {
	fillUnset(&over, base)
	return over
}

func finish(l Limits) Resolved {
	r := Resolved{
		MaxConcurrent:     int64(deref(l.MaxConcurrent)),
		MaxInflightTokens: deref(l.MaxInflightTokens),
		Priority:          deref(l.Priority),
		Shadow:            deref(l.Mode) == "shadow",
		TokensPerMinute:   deref(l.TokensPerMinute),
		TokensPerDay:      deref(l.TokensPerDay),
		RequestsPerMinute: deref(l.RequestsPerMinute),
		MaxDebt:           1,
		Spend:             [3]Amount{deref(l.SpendPerHour), deref(l.SpendPerDay), deref(l.SpendPerMonth)},
	}
	if l.MaxConcurrent != nil && l.MaxConcurrent.IsAdaptive() {
		r.Adaptive = resolveAdaptive(l.Adaptive)
		r.MaxConcurrent = r.Adaptive.Max
	}
	if l.MaxWait != nil {
		r.MaxWait, r.HasMaxWait = l.MaxWait.D(), true
	}
	if l.MaxDebt != nil {
		r.MaxDebt = *l.MaxDebt
	}
	if l.QueueDepth != nil {
		r.QueueDepth = *l.QueueDepth
	} else if r.MaxConcurrent > 0 {
		r.QueueDepth = 10 * r.MaxConcurrent
	} else {
		r.QueueDepth = 64
	}
	return r
}

// Scale multiplies every count limit by ratio, rounding down but never below 1 for a limit that
// was set (the tier × feature rule: max(1, int(base × ratio))).
func (r Resolved) Scale(ratio float64) Resolved {
	sc := func(v int64) int64 {
		if v <= 0 {
			return v
		}
		return max(1, int64(math.Floor(float64(v)*ratio)))
	}
	r.MaxConcurrent = sc(r.MaxConcurrent)
	r.MaxInflightTokens = sc(r.MaxInflightTokens)
	r.QueueDepth = sc(r.QueueDepth)
	r.TokensPerMinute = sc(r.TokensPerMinute)
	r.TokensPerDay = sc(r.TokensPerDay)
	r.RequestsPerMinute = sc(r.RequestsPerMinute)
	for i, a := range r.Spend {
		// Money scales to the nearest millionth (a float product may fall a hair short).
		if a > 0 {
			r.Spend[i] = Amount(max(1, int64(math.Round(float64(a)*ratio))))
		}
	}
	return r
}

// FeatureNames returns the configured features in name order; when none are configured the
// only feature is the default.
func (p *Policy) FeatureNames() []string {
	return setNames(p.Features, p.Classification.Feature.Default)
}

// TierNames returns the configured tiers in name order (the default tier alone when none).
func (p *Policy) TierNames() []string {
	return setNames(p.Tiers, p.Classification.Tier.Default)
}

// ProviderNames returns the configured providers in name order (the default alone when none).
func (p *Policy) ProviderNames() []string {
	return setNames(p.Providers, p.Classification.Provider.Default)
}

// OtherModels names the compartment of a model-keyed family that models matching no glob of
// the models list share.
const OtherModels = "other"

// ModelGroups returns the values a family keyed by model can have: the distinct globs of the
// models list (lower-cased, as classification matches them) in file order, then OtherModels
// unless a glob is "*" (which every model matches).
func (p *Policy) ModelGroups() []string {
	var out []string
	catchAll := false
	for _, m := range p.Models {
		g := strings.ToLower(m.Match)
		if g == "" || slices.Contains(out, g) {
			continue
		}
		out = append(out, g)
		catchAll = catchAll || g == "*"
	}
	if !catchAll {
		out = append(out, OtherModels)
	}
	return out
}

// RewritesModels reports whether any provider has a models map, so re-routed requests may need
// their body rewritten.
func (p *Policy) RewritesModels() bool {
	for _, pr := range p.Providers {
		if len(pr.Models) > 0 {
			return true
		}
	}
	return false
}

// TracksProviderQuota reports whether a provider's quota is in shadow or enforce mode: each
// request is then held against the quota at its estimate.
func (p *Policy) TracksProviderQuota() bool {
	for _, pr := range p.Providers {
		if pr.Quota.Mode == QuotaShadow || pr.Quota.Mode == QuotaEnforce {
			return true
		}
	}
	return false
}

// AccountRule is the classification rule that reads a provider quota's account.
func (a *QuotaAccount) AccountRule() Rule {
	return Rule{Header: a.Header, Metadata: a.Metadata, Trusted: a.Trusted}
}

// AccountSources returns the distinct account sources of the providers whose quota is tracked
// (mode shadow or enforce) and has an account, in the order of the sorted provider names, and
// each such provider's index into them.
func (p *Policy) AccountSources() (sources []QuotaAccount, of map[string]int) {
	of = map[string]int{}
	for _, name := range sortedKeys(p.Providers) {
		q := p.Providers[name].Quota
		if q.Account == nil || (q.Mode != QuotaShadow && q.Mode != QuotaEnforce) {
			continue
		}
		i := slices.IndexFunc(sources, func(s QuotaAccount) bool { return s.Same(q.Account) })
		if i < 0 {
			i = len(sources)
			sources = append(sources, *q.Account)
		}
		of[name] = i
	}
	return sources, of
}

// Same reports whether a and b read the same account.
func (a QuotaAccount) Same(b *QuotaAccount) bool {
	return a.Header == b.Header && a.Trusted == b.Trusted && a.Default == b.Default &&
		(a.Metadata == nil) == (b.Metadata == nil) && (a.Metadata == nil || *a.Metadata == *b.Metadata)
}

func setNames[V any](m map[string]V, def string) []string {
	if len(m) == 0 {
		if def == "" {
			return nil
		}
		return []string{def}
	}
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, k)
	}
	sort.Strings(names)
	return names
}

// Bool reads an optional boolean with its default already applied.
func Bool(b *bool) bool { return b != nil && *b }

func orString(v, def string) string {
	if v == "" {
		return def
	}
	return v
}

func orInt(v, def int64) int64 {
	if v == 0 {
		return def
	}
	return v
}

func orDuration(v *Duration, def time.Duration) {
	if *v == 0 {
		*v = Duration(def)
	}
}

func orFloat(v, def float64) float64 {
	if v == 0 {
		return def
	}
	return v
}

func ptr[T any](v T) *T { return &v }

func setIfNil[T any](dst **T, src *T) {
	if *dst == nil && src != nil {
		*dst = src
	}
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// eachLimitSet calls fn with the path and value of every limit set that a compartment takes its
// limits from (templates only through them): features, tiers, providers, tenant overrides and
// family limits, in a stable order.
func (p *Policy) eachLimitSet(fn func(path string, l Limits)) {
	for _, n := range sortedKeys(p.Features) {
		fn("features."+n, p.Features[n].Limits)
	}
	for _, n := range sortedKeys(p.Tiers) {
		fn("tiers."+n, p.Tiers[n])
	}
	for _, n := range sortedKeys(p.Providers) {
		fn("providers."+n, p.Providers[n].Limits)
	}
	for i, t := range p.Tenants.Directory {
		if t.Limits != nil {
			fn(fmt.Sprintf("tenants.directory[%d].limits", i), *t.Limits)
		}
	}
	for i, f := range p.Compartments {
		if f.Limits != nil {
			fn(fmt.Sprintf("compartments[%d].limits", i), *f.Limits)
		}
	}
}

// AnyLimits reports whether the policy limits anything: a compartment family reads a limit set
// with a concurrency, token or request limit, or a provider has a breaker.
func (p *Policy) AnyLimits() bool {
	for _, pr := range p.Providers {
		if pr.Breaker != "" {
			return true
		}
	}
	found := false
	p.eachLimitSet(func(_ string, l Limits) {
		r := p.Resolve(l)
		if r.MaxConcurrent > 0 || r.MaxInflightTokens > 0 || r.TokensPerMinute > 0 || r.TokensPerDay > 0 || r.RequestsPerMinute > 0 || r.AnySpend() {
			found = true
		}
	})
	return found
}

// AnyTokenLimits reports whether any limit set of the policy limits tokens (in-flight tokens or a
// token budget), so that request bodies must be read for estimates.
func (p *Policy) AnyTokenLimits() bool {
	found := false
	p.eachLimitSet(func(_ string, l Limits) {
		r := p.Resolve(l)
		if r.MaxInflightTokens > 0 || r.TokensPerMinute > 0 || r.TokensPerDay > 0 {
			found = true
		}
	})
	return found
}

// TopPriority returns the highest queue priority the policy gives any request: of its limit
// sets and of classification.priority's levels.
func (p *Policy) TopPriority() int64 {
	var top int64
	p.eachLimitSet(func(_ string, l Limits) {
		top = max(top, p.Resolve(l).Priority)
	})
	for _, lvl := range p.Classification.Priority.Levels {
		top = max(top, lvl)
	}
	return top
}

// BufferedBodyBytes returns server.max_buffered_body_bytes, or, when the policy does not set it,
// its default for a process whose memory is limited to memLimit bytes (0: no limit): a quarter
// of the limit, at most DefaultMaxBufferedBody and at least envoy.max_request_body.
func (p *Policy) BufferedBodyBytes(memLimit int64) int64 {
	if b := int64(p.Server.MaxBufferedBodyBytes); b > 0 {
		return b
	}
	if memLimit <= 0 {
		return DefaultMaxBufferedBody
	}
	return max(min(memLimit/4, DefaultMaxBufferedBody), int64(p.Envoy.MaxRequestBody))
}
