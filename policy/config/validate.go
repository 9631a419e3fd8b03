package config

// Validate reports every problem of a policy at once, a function per section in the order of
// schema.go; the two files change together, and splitting this one by section would only
// scatter that order.

import (
	"fmt"
	"math"
	"net"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/llm-bulkhead/llm-bulkhead/policy/apikey"
)

var (
	namePattern   = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]*$`)
	headerPattern = regexp.MustCompile(`^[a-z0-9!#$%&'*+.^_|~-]+$`)
	bodyModes     = []string{"NONE", "BUFFERED", "STREAMED", "BUFFERED_PARTIAL"}
	logLevels     = []string{"debug", "info", "warn", "error"}
	modes         = []string{"enforce", "shadow"}
	// familyDims can key a compartment family and filter it (where); limitDims can give a
	// family its limits.
	familyDims = []string{DimFeature, DimTenant, DimTier, DimProvider, DimModel}
	limitDims  = []string{DimFeature, DimTenant, DimTier, DimProvider}
	// Reasons that can be degraded into a re-route.
	degradeReasons = []string{"token_budget", "rate_limit", "bulkhead_full", "spend_budget"}
	clusterModes   = []string{ClusterStandalone, ClusterSentinel, ClusterCluster}
	onUnavailable  = []string{OnUnavailableLocal, OnUnavailableClosed}
	admissions     = []string{AdmissionLeased, AdmissionExact}
	envNamePattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

// validate checks a decoded policy with defaults applied and records every problem.
func validate(ps *problems, p *Policy) {
	v := &validator{ps: ps, p: p}
	v.server()
	v.envoy()
	v.sets()
	v.classification()
	v.tenants()
	v.models()
	v.estimation()
	v.body()
	v.templates()
	v.limitSets()
	v.spend()
	v.state()
	v.providers()
	v.reroutes()
	v.breakers()
	v.families()
	v.pools()
	v.cluster()
	v.refusals()
	v.tracing()
	v.usage()
	v.waits()
	v.limitsSomething()
}

// limitsSomething refuses a policy without a single limit unless it says allow_empty: an empty,
// comment-only or truncated file would otherwise load and turn every limit off.
func (v *validator) limitsSomething() {
	if v.p.AllowEmpty || len(v.ps.list) > 0 || v.p.AnyLimits() {
		// Other problems (a negative limit, a bad mode) say more than "nothing is limited".
		return
	}
	v.add("", "the policy sets no limit at all (no max_concurrent, max_inflight_tokens, token budget, request rate or breaker): "+
		"every request would be admitted. Add limits, or set allow_empty: true if that is what you mean")
}

type validator struct {
	ps *problems
	p  *Policy
}

func (v *validator) add(path, format string, args ...any) { v.ps.add(path, format, args...) }

// own records a problem found by looking at the value at path alone, against fixed bounds: it
// stands even when another key of the same entry could not be decoded (see problems.dropInside).
func (v *validator) own(path, format string, args ...any) { v.ps.addOwn(path, format, args...) }

func (v *validator) oneOf(path, got string, allowed []string) {
	if !slices.Contains(allowed, got) {
		v.own(path, "%q is not one of %s", got, strings.Join(allowed, ", "))
	}
}

func (v *validator) name(path, name, what string) {
	if !namePattern.MatchString(name) {
		v.own(path, "%s name %q must be lower-case letters, digits, '_' or '-', starting with a letter or digit", what, name)
	}
}

func (v *validator) server() {
	v.oneOf("server.log_level", v.p.Server.LogLevel, logLevels)
	if v.p.Server.DrainGrace < 0 {
		v.own("server.drain_grace", "must not be negative")
	}
	v.streamLimits()
	v.serverListener()
	if v.p.Admin.TokenEnv == "" {
		v.add("admin.token_env", "must name an environment variable")
	}
}

// maxStreamsLimit is the largest server.max_streams accepted: far beyond what one process
// serves, small enough that a typo cannot lift the bound altogether.
const maxStreamsLimit = 1_000_000

// streamLimits checks the server's bounds on what Envoy's streams may hold. Zero values were
// replaced by defaults, so anything not positive here was written that way.
func (v *validator) streamLimits() {
	s := v.p.Server
	if s.MaxStreams < 1 || s.MaxStreams > maxStreamsLimit {
		v.own("server.max_streams", "must be between 1 and %d, got %d", maxStreamsLimit, s.MaxStreams)
	}
	switch {
	case s.MaxStreamsPerConnection < 1:
		v.own("server.max_streams_per_connection", "must be at least 1, got %d", s.MaxStreamsPerConnection)
	case s.MaxStreams >= 1 && s.MaxStreamsPerConnection > s.MaxStreams:
		v.add("server.max_streams_per_connection", "must not exceed server.max_streams (%d), got %d", s.MaxStreams, s.MaxStreamsPerConnection)
	}
	if s.KeepaliveTime.D() < time.Second {
		v.own("server.keepalive_time", "must be at least 1s (gRPC pings no more often), got %s", s.KeepaliveTime)
	}
	if s.KeepaliveTimeout <= 0 {
		v.own("server.keepalive_timeout", "must be positive, got %s", s.KeepaliveTimeout)
	}
	if s.FirstMessageTimeout <= 0 {
		v.own("server.first_message_timeout", "must be positive, got %s", s.FirstMessageTimeout)
	}
	if s.StreamIdleTimeout <= 0 {
		v.own("server.stream_idle_timeout", "must be positive (and longer than any route timeout in Envoy), got %s", s.StreamIdleTimeout)
	}
	if s.MaxBufferedBodyBytes != 0 && s.MaxBufferedBodyBytes < v.p.Envoy.MaxRequestBody {
		v.add("server.max_buffered_body_bytes", "%s is less than envoy.max_request_body (%s): the largest body Envoy sends could never be held",
			s.MaxBufferedBodyBytes, v.p.Envoy.MaxRequestBody)
	}
}

func (v *validator) envoy() {
	e := v.p.Envoy
	v.oneOf("envoy.request_body_mode", e.RequestBodyMode, bodyModes)
	v.oneOf("envoy.response_body_mode", e.ResponseBodyMode, bodyModes)
	if e.MessageTimeout <= 0 {
		v.own("envoy.message_timeout", "must be positive")
	}
	if e.MaxMessageTimeout < 0 {
		v.own("envoy.max_message_timeout", "must not be negative")
	} else if e.MaxMessageTimeout > 0 && e.MaxMessageTimeout.D() < time.Millisecond {
		v.own("envoy.max_message_timeout", "Envoy ignores values under 1ms; use 0 to disable overrides")
	}
	if e.MaxRequestBody < 1024 {
		v.own("envoy.max_request_body", "must be at least 1KiB, got %d bytes", e.MaxRequestBody)
	}
	if !namePattern.MatchString(strings.ReplaceAll(e.MetadataNamespace, ".", "_")) {
		v.own("envoy.metadata_namespace", "%q is not a valid metadata namespace", e.MetadataNamespace)
	}
}

// sets checks the names of features, tiers and providers and that each dimension's default is
// one of them.
func (v *validator) sets() {
	for _, n := range sortedKeys(v.p.Features) {
		v.name("features."+n, n, "feature")
	}
	for _, n := range sortedKeys(v.p.Tiers) {
		v.name("tiers."+n, n, "tier")
	}
	for _, n := range sortedKeys(v.p.Providers) {
		v.name("providers."+n, n, "provider")
	}
	if len(v.p.Providers) > MaxProviders {
		v.add("providers", "%d providers, at most %d", len(v.p.Providers), MaxProviders)
	}
	c := v.p.Classification
	if len(v.p.Features) > 0 && !hasKey(v.p.Features, c.Feature.Default) {
		v.add("classification.feature.default", "feature %q is not in features (%s); every request needs a feature with limits", c.Feature.Default, strings.Join(sortedKeys(v.p.Features), ", "))
	}
	if len(v.p.Providers) > 0 && !hasKey(v.p.Providers, c.Provider.Default) {
		v.add("classification.provider.default", "provider %q is not in providers (%s)", c.Provider.Default, strings.Join(sortedKeys(v.p.Providers), ", "))
	}
	if len(v.p.Tiers) > 0 {
		if c.Tier.Default == "" {
			v.add("tenants.default_tier", "must be set when there are several tiers and none is named free")
		} else if !hasKey(v.p.Tiers, c.Tier.Default) {
			v.add("classification.tier.default", "tier %q is not in tiers (%s)", c.Tier.Default, strings.Join(sortedKeys(v.p.Tiers), ", "))
		}
	}
}

// valueSet returns the allowed values of a dimension, or nil when the dimension is open (tenant,
// model).
func (v *validator) valueSet(dim string) []string {
	switch dim {
	case DimFeature:
		return v.p.FeatureNames()
	case DimTier:
		return v.p.TierNames()
	case DimProvider:
		return v.p.ProviderNames()
	case DimPriority:
		return sortedKeys(v.p.Classification.Priority.Levels)
	}
	return nil
}

// trustedOnly reports whether dimension dim takes values only from trusted sources: a request
// must not choose its own tenant, tier or queue priority.
func trustedOnly(dim string) bool {
	return dim == DimTenant || dim == DimTier || dim == DimPriority || dim == DimAccount
}

// priority checks classification.priority: levels name values a rule can yield, and rules have
// levels to yield.
func (v *validator) priority() {
	pr := v.p.Classification.Priority
	for i, r := range pr.Rules {
		v.rule(fmt.Sprintf("classification.priority.rules[%d]", i), DimPriority, r)
	}
	if len(pr.Rules) > 0 && len(pr.Levels) == 0 {
		v.add("classification.priority.levels", "priority rules need levels: the priority each value they read gives a request, e.g. {interactive: 10, batch: 1}")
	}
	if len(pr.Levels) > 0 && len(pr.Rules) == 0 {
		v.add("classification.priority.rules", "priority levels need rules that read a request's value, e.g. [{header: x-llm-priority, trusted: true}]")
	}
	for _, name := range sortedKeys(pr.Levels) {
		if err := CheckIdentity(name); err != nil {
			v.add("classification.priority.levels."+name, "%q can never match: classification skips values with %v", name, err)
		} else if name != strings.ToLower(strings.TrimSpace(name)) {
			v.add("classification.priority.levels."+name, "%q can never match: values are trimmed and lower-cased before they are looked up", name)
		}
	}
}

// quotaEndpoint checks quota_endpoint.path: an absolute path without a query, which no LLM API
// of the server's uses (a client's LLM request must never be answered with its quota).
func (v *validator) quotaEndpoint() {
	q := v.p.QuotaEndpoint
	if !q.Enabled {
		return
	}
	switch {
	case !strings.HasPrefix(q.Path, "/") || strings.ContainsAny(q.Path, "?#") || strings.ContainsFunc(q.Path, func(r rune) bool { return r <= ' ' || r == 0x7f }):
		v.add("quota_endpoint.path", "%q is not an absolute request path (starting with /, without query, spaces or control characters)", q.Path)
	case reservedAPIPath(q.Path):
		v.add("quota_endpoint.path", "%q is the path of an LLM API the server meters: its requests would be answered with the quota", q.Path)
	}
}

func (v *validator) classification() {
	c := v.p.Classification
	v.priority()
	v.quotaEndpoint()
	dims := []struct {
		name string
		d    Dimension
	}{
		{DimFeature, c.Feature}, {DimTenant, c.Tenant}, {DimTier, c.Tier}, {DimProvider, c.Provider}, {DimModel, c.Model},
	}
	for _, d := range dims {
		for i, r := range d.d.Rules {
			v.rule(fmt.Sprintf("classification.%s.rules[%d]", d.name, i), d.name, r)
		}
		// The defaults of feature, tier and provider name entries (sets checks them); those of
		// the open dimensions are used as they are.
		if v.valueSet(d.name) == nil {
			if err := CheckIdentity(d.d.Default); err != nil {
				v.add("classification."+d.name+".default", "%q cannot be a %s: %v", d.d.Default, d.name, err)
			}
		}
	}
	if srcs, _ := v.p.AccountSources(); len(srcs) > MaxAccountSources {
		v.add("providers", "the providers' quotas read their accounts from %d different sources, at most %d can be read (use the same header or metadata for several providers)", len(srcs), MaxAccountSources)
	}
}

// quotaAccount checks a provider quota's account source, as a classification rule reading a
// header (trusted) or Envoy metadata, and max_accounts.
func (v *validator) quotaAccount(path string, q ProviderQuota) {
	a := q.Account
	if a == nil {
		if q.MaxAccounts != 0 {
			v.add(path+".max_accounts", "bounds the accounts of account, which is not set")
		}
		return
	}
	if q.Mode == "" || q.Mode == QuotaOff {
		v.add(path+".account", "the quota is not tracked (mode off): set mode shadow or enforce, or remove account")
	}
	switch {
	case a.Header == "" && a.Metadata == nil:
		v.add(path+".account", "needs a source: header or metadata")
	case a.Header != "" && a.Metadata != nil:
		v.add(path+".account", "reads one source, header or metadata, not both")
	default:
		v.rule(path+".account", DimAccount, a.AccountRule())
	}
	if slices.Contains([]string{HeaderAuthorization, HeaderAPIKey, "api-key", "proxy-authorization"}, a.Header) {
		v.add(path+".account.header", "%q holds a credential: an account is shown by /admin/quotas and in metric labels; read a header that names the account (set by the route that picks the key)", a.Header)
	}
	if err := CheckIdentity(a.Default); err != nil {
		v.add(path+".account.default", "%q cannot be an account: %v", a.Default, err)
	}
	if q.MaxAccounts < 1 || q.MaxAccounts > MaxQuotaAccounts {
		v.add(path+".max_accounts", "must be between 1 and %d, got %d", MaxQuotaAccounts, q.MaxAccounts)
	}
}

func (v *validator) rule(path, dim string, r Rule) {
	var sources []string
	if r.APIKey {
		sources = append(sources, "api_key")
	}
	if r.Header != "" && !r.APIKey {
		sources = append(sources, "header")
	}
	if r.PathPrefix != "" {
		sources = append(sources, "path_prefix")
	}
	if r.PathRegex != "" {
		sources = append(sources, "path_regex")
	}
	if r.Body != "" {
		sources = append(sources, "body")
	}
	if r.Metadata != nil {
		sources = append(sources, "metadata")
	}
	if r.Attribute != "" {
		sources = append(sources, "attribute")
	}
	if r.TenantDirectory {
		sources = append(sources, "tenant_directory")
	}
	if r.ModelMap {
		sources = append(sources, "model_map")
	}
	switch len(sources) {
	case 0:
		v.add(path, "a rule needs exactly one source: header, path_prefix, path_regex, body, metadata, attribute, api_key, tenant_directory or model_map")
		return
	case 1:
	default:
		v.add(path, "a rule has exactly one source, this one has %s; split it into several rules", strings.Join(sources, " and "))
		return
	}
	src := sources[0]
	switch src {
	case "header":
		if !headerPattern.MatchString(r.Header) {
			v.add(path+".header", "%q is not a lower-case header name (Envoy sends header names in lower case)", r.Header)
		}
		if trustedOnly(dim) && !r.Trusted {
			from := "trusted metadata or the tenant directory"
			if dim == DimPriority || dim == DimAccount {
				from = "trusted metadata"
			}
			article := "a"
			if dim == DimAccount {
				article = "an"
			}
			v.add(path+".header", "header %q is supplied by the client, so %s %s taken from it can be forged; take %s from %s, or set trusted: true only if Envoy strips the client's copy (see envoy/identity.yaml)", r.Header, article, dim, dim, from)
		}
	case "path_prefix":
		if !strings.HasPrefix(r.PathPrefix, "/") {
			v.add(path+".path_prefix", "%q must start with /", r.PathPrefix)
		}
		if r.Value == "" {
			v.add(path+".value", "a path_prefix rule must say which value it assigns")
		}
	case "path_regex":
		if _, err := regexp.Compile(r.PathRegex); err != nil {
			v.add(path+".path_regex", "invalid regular expression: %v", err)
		}
		if r.Value == "" {
			v.add(path+".value", "a path_regex rule must say which value it assigns ($1 for the first group)")
		}
	case "body":
		if strings.HasPrefix(r.Body, ".") || strings.HasSuffix(r.Body, ".") || strings.Contains(r.Body, "..") {
			v.add(path+".body", "%q is not a dotted path like metadata.feature", r.Body)
		}
		if trustedOnly(dim) && !r.Trusted {
			v.add(path+".body", "the request body is written by the client, so a %s taken from it can be forged; set trusted: true only if a trusted party writes this field", dim)
		}
	case "metadata":
		if r.Metadata.Namespace == "" || r.Metadata.Key == "" {
			v.add(path+".metadata", "needs both namespace and key")
		}
	case "api_key":
		v.apiKeyRule(path, dim, r)
	case "tenant_directory":
		if dim != DimTier {
			v.add(path+".tenant_directory", "only tier rules can read the tenant directory")
		}
	case "model_map":
		if dim != DimProvider {
			v.add(path+".model_map", "only provider rules can use the model map")
		}
	}
	if r.Trusted && src != "header" && src != "body" && src != "api_key" {
		v.add(path+".trusted", "only header, body and api_key rules take trusted; %s is trusted already", src)
	}
	if r.StripClientKey && src != "api_key" {
		v.add(path+".strip_client_key", "only api_key rules take strip_client_key")
	}
	if r.Value != "" && src != "path_prefix" && src != "path_regex" {
		v.add(path+".value", "value is only for path_prefix and path_regex rules (use map to translate values)")
	}
	for _, from := range sortedKeys(r.Map) {
		if err := CheckIdentity(from); err != nil {
			v.add(path+".map."+from, "%q can never match: classification skips values with %v", from, err)
		}
	}
	set := v.valueSet(dim)
	if set == nil {
		// An open dimension (tenant, model) takes these values as they are.
		if err := CheckIdentity(r.Value); err != nil && !strings.Contains(r.Value, "$") {
			v.add(path+".value", "%q cannot be a %s: %v", r.Value, dim, err)
		}
		for _, from := range sortedKeys(r.Map) {
			if err := CheckIdentity(r.Map[from]); err != nil {
				v.add(path+".map."+from, "%q cannot be a %s: %v", r.Map[from], dim, err)
			}
		}
		return
	}
	if r.Value != "" && !strings.Contains(r.Value, "$") && !slices.Contains(set, r.Value) {
		v.add(path+".value", "%s %q is not one of %s", dim, r.Value, strings.Join(set, ", "))
	}
	for _, from := range sortedKeys(r.Map) {
		if to := r.Map[from]; !slices.Contains(set, to) {
			v.add(path+".map."+from, "%s %q is not one of %s", dim, to, strings.Join(set, ", "))
		}
	}
}

// apiKeyRule checks a rule that gives the tenant of the request's API key.
func (v *validator) apiKeyRule(path, dim string, r Rule) {
	if dim != DimTenant {
		v.add(path+".api_key", "only tenant rules can read API keys")
		return
	}
	if r.Header != "" && !headerPattern.MatchString(r.Header) {
		v.add(path+".header", "%q is not a lower-case header name (Envoy sends header names in lower case)", r.Header)
	}
	if !r.Trusted {
		v.add(path+".api_key", "a tenant taken from a header is trusted only when the policy says so: set trusted: true to take tenants from API keys")
	}
	if len(r.Map) > 0 {
		v.add(path+".map", "an api_key rule gives the tenant its key belongs to; there is nothing to map")
	}
}

// readsAPIKeys reports whether a tenant rule reads API keys.
func (p *Policy) readsAPIKeys() bool {
	return slices.ContainsFunc(p.Classification.Tenant.Rules, func(r Rule) bool { return r.APIKey })
}

// StripHeaders returns the headers the api_key rules with strip_client_key remove from
// admitted requests, each once.
func (p *Policy) StripHeaders() []string {
	var out []string
	for _, r := range p.Classification.Tenant.Rules {
		if !r.APIKey || !r.StripClientKey {
			continue
		}
		names := []string{HeaderAuthorization, HeaderAPIKey}
		if r.Header != "" {
			names = []string{r.Header}
		}
		for _, n := range names {
			if !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	return out
}

// The headers an api_key rule reads a key from when it names none.
const (
	HeaderAuthorization = "authorization"
	HeaderAPIKey        = "x-api-key"
)

// keys checks the API key settings of the tenant directory.
func (v *validator) keys() {
	t := v.p.Tenants
	if !slices.Contains([]string{UnknownKeyDefault, UnknownKeyReject}, t.UnknownKey) {
		v.own("tenants.unknown_key", "%q is not one of default, reject", t.UnknownKey)
	}
	seen := map[apikey.Hash]string{}
	listed := false
	for i, tn := range t.Directory {
		for j, hx := range tn.KeySHA256 {
			listed = true
			path := fmt.Sprintf("tenants.directory[%d].key_sha256[%d]", i, j)
			h, err := apikey.ParseHash(strings.TrimSpace(hx))
			if err != nil {
				v.add(path, "%v: write the key's hash (printf %%s \"$KEY\" | sha256sum), never the key", err)
				continue
			}
			if at, dup := seen[h]; dup {
				v.add(path, "key %s… is listed already, at %s: a key belongs to one tenant, once", h.Prefix(), at)
				continue
			}
			seen[h] = path
		}
	}
	if v.p.readsAPIKeys() {
		return
	}
	switch {
	case t.KeysFile != "":
		v.add("tenants.keys_file", "no classification.tenant rule reads API keys: add `- {api_key: true, trusted: true}` to its rules, or remove keys_file")
	case listed:
		v.add("tenants.directory", "tenants have key_sha256 but no classification.tenant rule reads API keys: add `- {api_key: true, trusted: true}` to its rules")
	case t.UnknownKey == UnknownKeyReject:
		v.add("tenants.unknown_key", "reject applies to api_key rules, and no classification.tenant rule reads API keys")
	}
}

func (v *validator) tenants() {
	v.keys()
	seen := map[string]int{}
	for i, t := range v.p.Tenants.Directory {
		path := fmt.Sprintf("tenants.directory[%d]", i)
		if strings.TrimSpace(t.ID) == "" {
			v.add(path+".id", "a tenant needs an id")
		} else if err := CheckIdentity(t.ID); err != nil {
			v.add(path+".id", "%q can never be a request's tenant: classification skips values with %v", t.ID, err)
		} else if j, dup := seen[t.ID]; dup {
			v.add(path+".id", "tenant %q is already listed at tenants.directory[%d]", t.ID, j)
		} else {
			seen[t.ID] = i
		}
		if t.Tier == "" {
			v.add(path+".tier", "a tenant needs a tier")
		} else if !hasKey(v.p.Tiers, t.Tier) {
			v.add(path+".tier", "tier %q is not in tiers (%s)", t.Tier, strings.Join(sortedKeys(v.p.Tiers), ", "))
		}
	}
}

func (v *validator) models() {
	for i, m := range v.p.Models {
		path := fmt.Sprintf("models[%d]", i)
		if m.Match == "" {
			v.add(path+".match", "needs a model name or glob such as deepseek-*")
		}
		if m.Provider != "" && !slices.Contains(v.p.ProviderNames(), m.Provider) {
			v.add(path+".provider", "provider %q is not one of %s", m.Provider, strings.Join(v.p.ProviderNames(), ", "))
		}
		if m.BytesPerToken < 0 {
			v.own(path+".bytes_per_token", "must not be negative")
		}
		if m.ContextTokens < 0 {
			v.own(path+".context_tokens", "must not be negative")
		}
		if m.DefaultMaxTokens < 0 {
			v.own(path+".default_max_tokens", "must not be negative")
		}
	}
}

func (v *validator) estimation() {
	e := v.p.Estimation
	if e.BytesPerToken <= 0 {
		v.add("estimation.bytes_per_token", "must be positive")
	}
	if e.MinBytesPerToken <= 0 || e.MinBytesPerToken > e.MaxBytesPerToken {
		v.add("estimation.min_bytes_per_token", "must be positive and at most max_bytes_per_token (%g)", e.MaxBytesPerToken)
	}
	if e.BytesPerToken < e.MinBytesPerToken || e.BytesPerToken > e.MaxBytesPerToken {
		v.add("estimation.bytes_per_token", "%g is outside [min_bytes_per_token, max_bytes_per_token] = [%g, %g]", e.BytesPerToken, e.MinBytesPerToken, e.MaxBytesPerToken)
	}
	if e.LearnWeight <= 0 || e.LearnWeight > 1 {
		v.add("estimation.learn_weight", "must be in (0, 1], got %g", e.LearnWeight)
	}
	for _, f := range []struct {
		path string
		n    int64
	}{
		{"estimation.default_max_tokens", e.DefaultMaxTokens}, {"estimation.image_tokens", e.ImageTokens},
		{"estimation.audio_tokens", e.AudioTokens}, {"estimation.file_tokens", e.FileTokens}, {"estimation.max_tokens", e.MaxTokens},
	} {
		if f.n < 0 {
			v.own(f.path, "must not be negative")
		}
	}
}

func (v *validator) body() {
	for i, prefix := range v.p.Body.RequireValidJSON {
		if !strings.HasPrefix(prefix, "/") {
			v.add(fmt.Sprintf("body.require_valid_json[%d]", i), "%q must be a path prefix starting with /", prefix)
		}
	}
	if len(v.p.Body.RequireValidJSON) > 0 && v.p.Envoy.RequestBodyMode != "BUFFERED" {
		v.add("body.require_valid_json", "checking bodies needs envoy.request_body_mode BUFFERED, not %s", v.p.Envoy.RequestBodyMode)
	}
	if v.p.RulesReadBody() && v.p.Envoy.RequestBodyMode != "BUFFERED" {
		v.add("envoy.request_body_mode", "%s cannot serve rules that read the request body: use BUFFERED (in other modes the request leaves Envoy before the whole body is seen, or Envoy ignores header changes made after it)", v.p.Envoy.RequestBodyMode)
	}
}

// RulesReadBody reports whether any classification rule reads a request body field.
func (p *Policy) RulesReadBody() bool {
	c := p.Classification
	for _, d := range []Dimension{c.Feature, c.Tenant, c.Tier, c.Provider, c.Model} {
		for _, r := range d.Rules {
			if r.Body != "" {
				return true
			}
		}
	}
	return false
}

func (v *validator) templates() {
	for _, name := range sortedKeys(v.p.Templates) {
		v.name("templates."+name, name, "template")
	}
}

// limitSet checks one limit set: its template chain and every value.
func (v *validator) limitSet(path string, l Limits) {
	merged, chain := v.p.inherit(l)
	if len(chain) > 0 {
		last := chain[len(chain)-1]
		if _, ok := v.p.Templates[last]; !ok {
			v.add(path+".template", "template %q is not defined in templates%s", last, knownList(sortedKeys(v.p.Templates)))
		} else if t := v.p.Templates[last]; t.Template != "" {
			v.add(path+".template", "template chain %s loops", strings.Join(append(chain, t.Template), " → "))
		}
	}
	nonNeg := func(key string, p *int64) {
		if p != nil && *p < 0 {
			v.own(path+"."+key, "must not be negative, got %d", *p)
		}
	}
	if l.MaxConcurrent != nil && !l.MaxConcurrent.IsAdaptive() && *l.MaxConcurrent < 0 {
		v.own(path+".max_concurrent", "must not be negative, got %d", *l.MaxConcurrent)
	}
	v.adaptive(path, l, merged, strings.HasPrefix(path, "templates."))
	nonNeg("max_inflight_tokens", l.MaxInflightTokens)
	nonNeg("queue_depth", l.QueueDepth)
	nonNeg("tokens_per_minute", l.TokensPerMinute)
	nonNeg("tokens_per_day", l.TokensPerDay)
	nonNeg("requests_per_minute", l.RequestsPerMinute)
	if l.MaxWait != nil && *l.MaxWait < 0 {
		v.own(path+".max_wait", "must not be negative")
	}
	if l.Mode != nil {
		v.oneOf(path+".mode", *l.Mode, modes)
	}
	if l.MaxDebt != nil && (*l.MaxDebt < 0 || *l.MaxDebt > 10) {
		v.own(path+".max_debt", "must be in [0, 10] (a fraction of the budget's capacity), got %g", *l.MaxDebt)
	}
}

func (v *validator) limitSets() {
	for _, name := range sortedKeys(v.p.Templates) {
		v.limitSet("templates."+name, v.p.Templates[name])
	}
	for _, name := range sortedKeys(v.p.Features) {
		f := v.p.Features[name]
		v.limitSet("features."+name, f.Limits)
		if f.Ratio != nil && (*f.Ratio <= 0 || *f.Ratio > 1) {
			v.own("features."+name+".ratio", "must be in (0, 1], got %g", *f.Ratio)
		}
		if d := f.Degrade; d != nil {
			if !slices.Contains(v.p.ProviderNames(), d.Provider) {
				v.add("features."+name+".degrade.provider", "provider %q is not in providers%s", d.Provider, knownList(v.p.ProviderNames()))
			}
			for i, r := range d.On {
				v.oneOf(fmt.Sprintf("features.%s.degrade.on[%d]", name, i), r, degradeReasons)
			}
		}
	}
	for _, name := range sortedKeys(v.p.Tiers) {
		v.limitSet("tiers."+name, v.p.Tiers[name])
	}
	for i, t := range v.p.Tenants.Directory {
		if t.Limits != nil {
			v.limitSet(fmt.Sprintf("tenants.directory[%d].limits", i), *t.Limits)
		}
	}
}

func (v *validator) providers() {
	for _, name := range sortedKeys(v.p.Providers) {
		pr := v.p.Providers[name]
		path := "providers." + name
		v.limitSet(path, pr.Limits)
		if pr.Breaker != "" && !hasKey(v.p.Breakers, pr.Breaker) {
			v.add(path+".breaker", "breaker %q is not defined in breakers%s", pr.Breaker, knownList(sortedKeys(v.p.Breakers)))
		}
		if pr.BreakerPerModel && pr.Breaker == "" {
			v.add(path+".breaker_per_model", "needs a breaker")
		}
		v.providerModels(path, name, pr)
		switch pr.Quota.Mode {
		case "", QuotaOff, QuotaShadow, QuotaEnforce:
		default:
			v.add(path+".quota.mode", "%q is not off, shadow or enforce", pr.Quota.Mode)
		}
		if pr.Quota.Reserve < 0 || pr.Quota.Reserve > 0.9 || math.IsNaN(pr.Quota.Reserve) {
			v.add(path+".quota.reserve", "must be between 0 and 0.9 (a share of each quota's limit), got %v", pr.Quota.Reserve)
		}
		v.quotaAccount(path+".quota", pr.Quota)
		if pr.Fallback == "" {
			continue
		}
		if !hasKey(v.p.Providers, pr.Fallback) {
			v.add(path+".fallback", "provider %q is not in providers%s", pr.Fallback, knownList(sortedKeys(v.p.Providers)))
			continue
		}
		if pr.Breaker == "" && pr.Quota.Mode != QuotaEnforce {
			v.add(path+".fallback", "a fallback is used while the breaker is open or the quota is short, but %s has no breaker and no quota in enforce mode", name)
		}
		chain := []string{name}
		for cur := pr.Fallback; cur != ""; cur = v.p.Providers[cur].Fallback {
			if slices.Contains(chain, cur) {
				v.add(path+".fallback", "fallback chain %s loops", strings.Join(append(chain, cur), " → "))
				break
			}
			chain = append(chain, cur)
		}
	}
}

// maxModelMappings bounds a provider's models map: a re-route scans it.
const maxModelMappings = 256

// providerModels checks a provider's models map: every entry can match, and every model it
// names can be written into a request body.
func (v *validator) providerModels(path, name string, pr Provider) {
	if len(pr.Models) == 0 {
		return
	}
	path += ".models"
	if len(pr.Models) > maxModelMappings {
		v.add(path, "%d entries, at most %d", len(pr.Models), maxModelMappings)
	}
	if v.p.Envoy.RequestBodyMode != "BUFFERED" {
		v.add(path, "rewriting the model of a request re-routed to %s needs its body: envoy.request_body_mode must be BUFFERED, not %s", name, v.p.Envoy.RequestBodyMode)
	}
	seen := map[string]int{}
	catchAll := -1
	for i, m := range pr.Models {
		ip := fmt.Sprintf("%s[%d]", path, i)
		g := strings.ToLower(m.Match)
		switch j, dup := seen[g]; {
		case m.Match == "":
			v.add(ip+".match", "needs a model name or glob such as deepseek-*")
		case catchAll >= 0:
			v.add(ip+".match", "%q is never used: %s[%d] matches every model first (the first match wins)", m.Match, path, catchAll)
		case dup:
			v.add(ip+".match", "%q is never used: %s[%d] has the same match (the first match wins)", m.Match, path, j)
		default:
			seen[g] = i
			if g == "*" {
				catchAll = i
			}
		}
		switch {
		case m.Model == "":
			v.add(ip+".model", "needs the model to send %s (or \"*\" to send the request's model unchanged)", name)
		case m.Model == "*":
		case strings.ContainsAny(m.Model, "*?"):
			v.add(ip+".model", "%q is the model name sent, not a glob; \"*\" alone sends the request's model unchanged", m.Model)
		case strings.TrimSpace(m.Model) != m.Model || strings.IndexFunc(m.Model, func(r rune) bool { return r < 0x20 || r == 0x7f }) >= 0:
			v.add(ip+".model", "%q must be a model name without surrounding spaces or control characters", m.Model)
		}
	}
}

// reroutes refuses a re-route that would send models unchanged to a provider that need not
// serve them: a fallback or degrade target without a models map, reached from a provider the
// models list gives models to. (With a map, a model it does not cover is not re-routed.)
func (v *validator) reroutes() {
	owned := map[string][]string{} // provider → the globs the models list gives it
	for _, m := range v.p.Models {
		if m.Provider != "" && m.Match != "" {
			owned[m.Provider] = append(owned[m.Provider], m.Match)
		}
	}
	check := func(path, target string, sources []string) {
		if pr, ok := v.p.Providers[target]; !ok || len(pr.Models) > 0 {
			return
		}
		var globs, from []string
		for _, src := range sources {
			if src != target && len(owned[src]) > 0 {
				from = append(from, src)
				globs = append(globs, owned[src]...)
			}
		}
		if len(from) == 0 {
			return
		}
		v.add(path, "re-routes requests for %s's models (%s) to %s, which has no models map, so their model would reach %s unchanged: "+
			"set providers.%s.models to the model %s should be sent (\"*\" sends the same name, for a provider that serves it)",
			strings.Join(from, ", "), strings.Join(globs, ", "), target, target, target, target)
	}
	for _, name := range sortedKeys(v.p.Providers) {
		seen := map[string]bool{name: true}
		for cur := v.p.Providers[name].Fallback; cur != "" && !seen[cur]; cur = v.p.Providers[cur].Fallback {
			seen[cur] = true
			check("providers."+name+".fallback", cur, []string{name})
		}
	}
	for _, name := range sortedKeys(v.p.Features) {
		if d := v.p.Features[name].Degrade; d != nil {
			check("features."+name+".degrade.provider", d.Provider, sortedKeys(v.p.Providers))
		}
	}
}

func (v *validator) breakers() {
	for _, name := range sortedKeys(v.p.Breakers) {
		path := "breakers." + name
		v.name(path, name, "breaker")
		seen := []string{name}
		for cur := v.p.Breakers[name].Base; cur != ""; cur = v.p.Breakers[cur].Base {
			if !hasKey(v.p.Breakers, cur) {
				v.add(path+".base", "breaker %q is not defined in breakers", cur)
				break
			}
			if slices.Contains(seen, cur) {
				v.add(path+".base", "breaker chain %s loops", strings.Join(append(seen, cur), " → "))
				break
			}
			seen = append(seen, cur)
		}
		validateBreaker(v, path, v.p.Breakers[name])
	}
}

// breakerChainBroken reports whether a problem was already recorded for path's base chain, so
// its resolved values would be misleading.
func (v *validator) breakerChainBroken(path string) bool {
	for _, pr := range v.ps.list {
		if pr.Path == path+".base" {
			return true
		}
	}
	return false
}

// MaxFamilies is the most compartment families a policy may have (a request takes one slot per
// family, held in a fixed-size ticket).
const MaxFamilies = 8

// MaxProviders is the most providers a policy may have.
const MaxProviders = 64

func (v *validator) families() {
	if len(v.p.Compartments) > MaxFamilies {
		v.add("compartments", "%d families, at most %d: every request takes a slot in each, so more would only add cost", len(v.p.Compartments), MaxFamilies)
	}
	names := map[string]int{}
	for i, f := range v.p.Compartments {
		path := fmt.Sprintf("compartments[%d]", i)
		v.name(path+".name", f.Name, "compartment family")
		if j, dup := names[f.Name]; dup {
			v.add(path+".name", "family %q is already defined at compartments[%d]", f.Name, j)
		}
		names[f.Name] = i
		if len(f.Key) == 0 {
			v.add(path+".key", "needs at least one dimension (%s)", strings.Join(familyDims, ", "))
		}
		seen := map[string]bool{}
		for j, d := range f.Key {
			if !slices.Contains(familyDims, d) {
				v.add(fmt.Sprintf("%s.key[%d]", path, j), "%q is not a dimension a compartment can be keyed by (%s)", d, strings.Join(familyDims, ", "))
			}
			if seen[d] {
				v.add(fmt.Sprintf("%s.key[%d]", path, j), "dimension %q appears twice", d)
			}
			seen[d] = true
		}
		if seen[DimModel] || hasKey(f.Where, DimModel) {
			v.modelFamily(path)
		}
		switch {
		case f.LimitsFrom == "" && f.Limits == nil:
			v.add(path, "needs limits_from (feature, tier, provider or tenant) or limits")
		case f.LimitsFrom != "" && f.Limits != nil:
			v.add(path+".limits", "limits and limits_from exclude each other")
		case f.Limits != nil:
			v.limitSet(path+".limits", *f.Limits)
		default:
			if !slices.Contains(limitDims, f.LimitsFrom) {
				v.add(path+".limits_from", "%q is not one of %s", f.LimitsFrom, strings.Join(limitDims, ", "))
			} else if !seen[f.LimitsFrom] {
				v.add(path+".limits_from", "limits come from the %s of each instance, so %s must be in key", f.LimitsFrom, f.LimitsFrom)
			}
			if f.LimitsFrom == DimTier || f.LimitsFrom == DimTenant {
				if len(v.p.Tiers) == 0 {
					v.add(path+".limits_from", "limits from %s need tiers to be defined", f.LimitsFrom)
				}
			}
		}
		if f.ScaleBy != "" {
			if f.ScaleBy != DimFeature {
				v.add(path+".scale_by", "only feature has a ratio to scale by")
			} else if !seen[DimFeature] {
				v.add(path+".scale_by", "scaling by feature needs feature in key")
			}
		}
		if f.Mode != "" {
			v.oneOf(path+".mode", f.Mode, modes)
		}
		for _, dim := range sortedKeys(f.Where) {
			set := v.valueSet(dim)
			if dim == DimModel {
				set = v.p.ModelGroups()
			}
			if !slices.Contains(familyDims, dim) {
				v.add(path+".where."+dim, "%q is not a dimension (%s)", dim, strings.Join(familyDims, ", "))
				continue
			}
			for j, val := range f.Where[dim] {
				if set != nil && !slices.Contains(set, val) {
					v.add(fmt.Sprintf("%s.where.%s[%d]", path, dim, j), "%s %q is not one of %s", dim, val, strings.Join(set, ", "))
				}
			}
		}
		if f.MaxInstances < 1 {
			v.own(path+".max_instances", "must be at least 1")
		}
		if f.IdleTTL < 0 {
			v.own(path+".idle_ttl", "must not be negative")
		}
	}
	v.unusedLimits()
}

// modelFamily checks what a family keyed or filtered by model needs: globs to key by, and a
// name for unmatched models that no glob takes.
func (v *validator) modelFamily(path string) {
	if len(v.p.Models) == 0 {
		v.add(path, "keys or filters by model, but the models list is empty: models key compartments only by its globs (a client's model name never makes one), so every request would share one")
		return
	}
	for i, m := range v.p.Models {
		if strings.ToLower(m.Match) == OtherModels {
			v.add(fmt.Sprintf("models[%d].match", i), "%q is the name of the compartment that unmatched models share in %s; a glob cannot take it", m.Match, path)
		}
	}
}

// unusedLimits refuses limits that no family reads: Resilience4j's classic pitfall of a setting
// that silently does nothing.
func (v *validator) unusedLimits() {
	from := map[string]bool{}
	for _, f := range v.p.Compartments {
		from[f.LimitsFrom] = true
	}
	check := func(dim, path string, l Limits) {
		if from[dim] || (dim == DimTier && from[DimTenant]) {
			return
		}
		if l.MaxConcurrent != nil || l.MaxInflightTokens != nil || l.TokensPerMinute != nil || l.TokensPerDay != nil || l.RequestsPerMinute != nil || l.anySpend() {
			v.add(path, "sets limits, but no compartment family takes limits_from: %s, so they would do nothing", dim)
		}
	}
	for _, n := range sortedKeys(v.p.Features) {
		check(DimFeature, "features."+n, v.p.Features[n].Limits)
	}
	for _, n := range sortedKeys(v.p.Providers) {
		check(DimProvider, "providers."+n, v.p.Providers[n].Limits)
	}
	for _, n := range sortedKeys(v.p.Tiers) {
		check(DimTier, "tiers."+n, v.p.Tiers[n])
	}
}

func (v *validator) pools() {
	inPool := map[string]string{}
	for i, pl := range v.p.Pools {
		path := fmt.Sprintf("pools[%d]", i)
		v.name(path+".name", pl.Name, "pool")
		if pl.MaxConcurrent < 1 {
			v.own(path+".max_concurrent", "a pool needs a capacity of at least 1")
		}
		if len(pl.Members) < 2 {
			v.add(path+".members", "a pool shares capacity between at least two compartments")
		}
		var guaranteed int64
		family := ""
		if len(pl.Members) > 64 {
			v.add(path+".members", "a pool has at most 64 members")
		}
		for j, m := range pl.Members {
			mp := fmt.Sprintf("%s.members[%d]", path, j)
			fam, _, _ := strings.Cut(m.Compartment, "/")
			if family == "" {
				family = fam
			} else if fam != family {
				v.add(mp+".compartment", "%s is in family %s but the pool's first member is in %s: a request is in one compartment per family, so only one family's compartments can share a pool without counting a request twice", m.Compartment, fam, family)
			}
			if err := v.p.staticInstance(m.Compartment); err != "" {
				v.add(mp+".compartment", "%s", err)
			}
			if other, dup := inPool[m.Compartment]; dup {
				v.add(mp+".compartment", "%s is already a member of pool %s; a compartment belongs to one pool", m.Compartment, other)
			}
			inPool[m.Compartment] = pl.Name
			if m.Guaranteed < 0 {
				v.own(mp+".guaranteed", "must not be negative")
			}
			maxv := m.Max
			if maxv == 0 {
				maxv = pl.MaxConcurrent
			}
			if maxv < m.Guaranteed {
				v.add(mp+".max", "max %d is below guaranteed %d", maxv, m.Guaranteed)
			}
			if maxv > pl.MaxConcurrent {
				v.add(mp+".max", "max %d exceeds the pool's capacity %d", maxv, pl.MaxConcurrent)
			}
			guaranteed += m.Guaranteed
		}
		if guaranteed > pl.MaxConcurrent {
			v.add(path+".members", "guaranteed shares add up to %d, more than the pool's capacity %d: a guarantee that cannot be met is not a guarantee", guaranteed, pl.MaxConcurrent)
		}
	}
}

// Bounds of the cluster section's values.
const (
	maxClusterTimeout  = time.Second
	minClusterLeaseTTL = time.Second
	// maxClusterLeaseTTL and maxExpectedReplicas are the bounds the shared state's scripts hold
	// Redis's content to (policy/cluster: maxLeaseTTL, MaxReplicas).
	maxClusterLeaseTTL       = time.Hour
	maxExpectedReplicas      = 1000
	maxClusterSettleInterval = 100 * time.Millisecond
	minPendingSettlements    = 1000
	minClusterLeaseInterval  = 10 * time.Millisecond
)

// cluster checks the cluster section. With the backend off, every other key it sets would do
// nothing, so each is refused; with a backend, every value is checked (defaults are filled).
func (v *validator) cluster() {
	c := v.p.Cluster
	if !c.Enabled() {
		for _, key := range setKeys(reflect.ValueOf(c), "cluster") {
			if key != "cluster.backend" {
				v.add(key, "is set but cluster.backend is empty (or none), so it would do nothing: set backend: redis to share limits across replicas, or remove it")
			}
		}
		return
	}
	if c.Backend != ClusterRedis {
		v.add("cluster.backend", "%q is not a cluster backend: use redis, or none (or leave it out) to enforce limits per process", c.Backend)
	}
	v.clusterAddresses(c)
	if c.Mode == ClusterSentinel {
		if c.MasterName == "" {
			v.add("cluster.master_name", "sentinel mode needs the name of the master set the sentinels watch")
		}
	} else if c.MasterName != "" {
		v.add("cluster.master_name", "is only for sentinel mode, not %s", c.Mode)
	}
	if c.PasswordEnv != "" {
		if !envNamePattern.MatchString(c.PasswordEnv) {
			v.add("cluster.password_env", "%q is not an environment variable name (letters, digits and '_', not starting with a digit); write the variable's name here, never the password", c.PasswordEnv)
		} else if strings.HasPrefix(strings.ToUpper(c.PasswordEnv), EnvPrefix) && strings.Contains(c.PasswordEnv, "__") {
			v.add("cluster.password_env", "%s would be read as a policy override (%s… with a double underscore); choose another name", c.PasswordEnv, EnvPrefix)
		}
	}
	v.clusterTLS(c.TLS)
	if c.KeyPrefix == "" {
		v.add("cluster.key_prefix", "must not be empty")
	} else if strings.ContainsAny(c.KeyPrefix, "{}") || strings.IndexFunc(c.KeyPrefix, spaceOrControl) >= 0 {
		v.add("cluster.key_prefix", "%q must not contain '{', '}', whitespace or control characters: it is written inside the hash tag {…} that keeps every key in one Redis Cluster slot", c.KeyPrefix)
	}
	switch {
	case c.ReplicaID == "":
		v.add("cluster.replica_id", "must not be empty")
	case strings.IndexFunc(c.ReplicaID, spaceOrControl) >= 0:
		v.add("cluster.replica_id", "%q must not contain whitespace or control characters", c.ReplicaID)
	case len(c.ReplicaID) > MaxReplicaIDBytes:
		v.add("cluster.replica_id", "is %d bytes long, at most %d", len(c.ReplicaID), MaxReplicaIDBytes)
	}
	if c.Timeout <= 0 || c.Timeout.D() > maxClusterTimeout {
		v.add("cluster.timeout", "must be positive and at most %s (every admission waits up to this long for Redis), got %s", maxClusterTimeout, c.Timeout)
	}
	if c.DialTimeout <= 0 {
		v.add("cluster.dial_timeout", "must be positive, got %s", c.DialTimeout)
	}
	if c.WriteTimeout <= 0 {
		v.add("cluster.write_timeout", "must be positive, got %s", c.WriteTimeout)
	}
	leaseOK := c.LeaseTTL.D() >= minClusterLeaseTTL && c.LeaseTTL.D() <= maxClusterLeaseTTL
	switch {
	case c.LeaseTTL.D() < minClusterLeaseTTL:
		v.add("cluster.lease_ttl", "must be at least %s, got %s", minClusterLeaseTTL, c.LeaseTTL)
	case !leaseOK:
		v.add("cluster.lease_ttl", "must be at most %s (a replica that dies keeps its slots taken this long, and a registration further ahead is taken for corrupt content), got %s", maxClusterLeaseTTL, c.LeaseTTL)
	}
	if c.Heartbeat <= 0 {
		v.add("cluster.heartbeat", "must be positive, got %s", c.Heartbeat)
	} else if leaseOK && 2*c.Heartbeat > c.LeaseTTL {
		v.add("cluster.heartbeat", "%s is more than half of cluster.lease_ttl (%s): one late heartbeat would let the replica's leases expire while it is alive; use at most %s", c.Heartbeat, c.LeaseTTL, c.LeaseTTL/2)
	}
	if c.SettleInterval < 0 || c.SettleInterval.D() > maxClusterSettleInterval {
		v.add("cluster.settle_interval", "must be between 0s and %s, got %s", maxClusterSettleInterval, c.SettleInterval)
	}
	if c.MaxPendingSettlements < minPendingSettlements {
		v.add("cluster.max_pending_settlements", "must be at least %d, got %d", minPendingSettlements, c.MaxPendingSettlements)
	}
	if !slices.Contains(onUnavailable, c.OnUnavailable) {
		v.add("cluster.on_unavailable", "%q is not one of %s", c.OnUnavailable, strings.Join(onUnavailable, ", "))
	}
	if !slices.Contains(admissions, c.Admission) {
		v.add("cluster.admission", "%q is not one of %s", c.Admission, strings.Join(admissions, ", "))
	}
	if c.LeaseInterval.D() < minClusterLeaseInterval {
		v.add("cluster.lease_interval", "must be at least %s, got %s", minClusterLeaseInterval, c.LeaseInterval)
	} else if leaseOK && 4*c.LeaseInterval > c.LeaseTTL {
		v.add("cluster.lease_interval", "%s is more than a quarter of cluster.lease_ttl (%s): leases would expire between two reports that renew them; use at most %s", c.LeaseInterval, c.LeaseTTL, c.LeaseTTL/4)
	}
	if c.ExpectedReplicas < 0 || c.ExpectedReplicas > maxExpectedReplicas {
		v.add("cluster.expected_replicas", "must be between 1 and %d (or left out), got %d", maxExpectedReplicas, c.ExpectedReplicas)
	}
	if len(v.p.Pools) > 0 {
		v.add("pools", "pools are enforced per process and cannot be shared across replicas yet, so with cluster.backend %s each replica would lend and borrow its own capacity: remove pools or the cluster backend", c.Backend)
	}
}

// clusterAddresses checks the mode and the addresses it needs.
func (v *validator) clusterAddresses(c Cluster) {
	modeOK := slices.Contains(clusterModes, c.Mode)
	if !modeOK {
		v.add("cluster.mode", "%q is not one of %s", c.Mode, strings.Join(clusterModes, ", "))
	}
	switch {
	case len(c.Addresses) == 0:
		v.add("cluster.addresses", "cluster.backend %s needs at least one host:port address", c.Backend)
	case c.Mode == ClusterStandalone && len(c.Addresses) > 1:
		v.add("cluster.addresses", "standalone mode takes exactly one address, got %d; list sentinels with mode: sentinel, cluster nodes with mode: cluster", len(c.Addresses))
	}
	seen := map[string]int{}
	for i, a := range c.Addresses {
		path := fmt.Sprintf("cluster.addresses[%d]", i)
		if msg := hostPortProblem(a); msg != "" {
			v.add(path, "%q %s", a, msg)
			continue
		}
		if j, dup := seen[a]; dup {
			v.add(path, "%q is already listed at cluster.addresses[%d]", a, j)
			continue
		}
		seen[a] = i
	}
}

// hostPortProblem says what keeps address from being a host:port, or "".
func hostPortProblem(address string) string {
	host, port, err := net.SplitHostPort(address)
	if err != nil {
		return "is not a host:port address (write it like redis:6379 or [::1]:6379)"
	}
	if host == "" {
		return "has no host"
	}
	if strings.IndexFunc(host, spaceOrControl) >= 0 {
		return "has whitespace in its host"
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 || port != strconv.Itoa(n) {
		return "needs a numeric port between 1 and 65535"
	}
	return ""
}

// clusterTLS checks TLS to Redis: a client certificate needs its key, and settings without
// enabled: true would silently not be used.
func (v *validator) clusterTLS(t ClusterTLS) {
	if (t.CertFile == "") != (t.KeyFile == "") {
		// Blamed on the key that is written, so the problem has its line.
		if t.CertFile == "" {
			v.add("cluster.tls.key_file", "is set without cert_file: a client certificate needs both (or neither)")
		} else {
			v.add("cluster.tls.cert_file", "is set without key_file: a client certificate needs both (or neither)")
		}
	}
	if !t.Enabled {
		for _, key := range setKeys(reflect.ValueOf(t), "cluster.tls") {
			v.add(key, "is set but cluster.tls.enabled is false, so it would not be used: set enabled: true, or remove it")
		}
	}
}

// setKeys returns the key paths of the fields of the struct v that are set (not zero; an empty
// list counts as unset), descending into nested structs, in field order.
func setKeys(v reflect.Value, path string) []string {
	var out []string
	info := structInfoOf(v.Type())
	for i := range v.NumField() {
		f := v.Field(i)
		tag, _, _ := strings.Cut(v.Type().Field(i).Tag.Get("koanf"), ",")
		if _, ok := info.fields[tag]; !ok {
			continue
		}
		sub := joinPath(path, tag)
		switch {
		case f.Kind() == reflect.Struct:
			out = append(out, setKeys(f, sub)...)
		case f.Kind() == reflect.Slice:
			if f.Len() > 0 {
				out = append(out, sub)
			}
		case !f.IsZero():
			out = append(out, sub)
		}
	}
	return out
}

func spaceOrControl(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }

// staticInstance checks that name ("family/v1/v2") names a compartment that exists regardless
// of traffic: a family keyed only by feature, tier, provider and model, with values from their
// sets (for model, the model groups).
func (p *Policy) staticInstance(name string) string {
	parts := strings.Split(name, "/")
	for _, f := range p.Compartments {
		if f.Name != parts[0] {
			continue
		}
		if len(parts)-1 != len(f.Key) {
			return fmt.Sprintf("%s: family %s is keyed by %s, so its instances are named %s/<%s>", name, f.Name, strings.Join(f.Key, ", "), f.Name, strings.Join(f.Key, ">/<"))
		}
		for i, dim := range f.Key {
			var set []string
			switch dim {
			case DimFeature:
				set = p.FeatureNames()
			case DimTier:
				set = p.TierNames()
			case DimProvider:
				set = p.ProviderNames()
			case DimModel:
				set = p.ModelGroups()
			default:
				return fmt.Sprintf("%s: instances keyed by %s come and go with traffic and cannot join a pool", name, dim)
			}
			if !slices.Contains(set, parts[i+1]) {
				return fmt.Sprintf("%s: %s %q is not one of %s", name, dim, parts[i+1], strings.Join(set, ", "))
			}
		}
		return ""
	}
	return fmt.Sprintf("%s: no compartment family named %q", name, parts[0])
}

// waits checks every limit set's max_wait against Envoy's message timeouts: a request queued
// longer than message_timeout is answered 504 by Envoy unless the server extends the timeout,
// which needs max_message_timeout.
func (v *validator) waits() {
	e := v.p.Envoy
	check := func(path string, l Limits) {
		r := v.p.Resolve(l)
		if !r.HasMaxWait || r.MaxWait < e.MessageTimeout.D() {
			return
		}
		if e.MaxMessageTimeout == 0 {
			v.add(path+".max_wait", "%s is not shorter than envoy.message_timeout (%s), and envoy.max_message_timeout is 0, so Envoy would answer 504 while the request waits; set envoy.max_message_timeout (and the filter's max_message_timeout) above %s, or lower max_wait", r.MaxWait, e.MessageTimeout, r.MaxWait)
		} else if r.MaxWait >= e.MaxMessageTimeout.D() {
			v.add(path+".max_wait", "%s is not shorter than envoy.max_message_timeout (%s): the server cannot keep Envoy waiting that long; raise max_message_timeout or lower max_wait", r.MaxWait, e.MaxMessageTimeout)
		}
	}
	v.p.eachLimitSet(check)
}

func hasKey[V any](m map[string]V, k string) bool {
	_, ok := m[k]
	return ok
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func knownList(names []string) string {
	if len(names) == 0 {
		return " (none are defined)"
	}
	return " (" + strings.Join(names, ", ") + ")"
}

// apiPathPrefixes are the paths of the LLM APIs the server meters (extproc/llmapi knows them
// in full); quota_endpoint.path must not be one of them.
var apiPathPrefixes = []string{"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
	"/v1/audio/", "/v1/images/", "/openai/", "/v1beta/models/", "/v1/models/", "/model/"}

func reservedAPIPath(path string) bool {
	for _, p := range apiPathPrefixes {
		if strings.HasPrefix(path, p) {
			return true
		}
	}
	return false
}
