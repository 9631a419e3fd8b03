package policy

import (
	"regexp"
	"strings"

	"github.com/llm-bulkhead/llm-bulkhead/policy/apikey"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/glob"
)

// Input is what classification reads from one request. The ext_proc processor implements it
// over Envoy's messages; tests implement it over maps. Implementations should not allocate.
type Input interface {
	// Header returns a request header by lower-case name.
	Header(name string) (string, bool)
	// Path returns the request :path without its query string.
	Path() string
	// BodyField returns a JSON body field by dotted path; false without a (valid) body.
	BodyField(path string) (string, bool)
	// Metadata returns a value of Envoy dynamic metadata forwarded in metadata_context.
	Metadata(namespace string, key []string) (string, bool)
	// Attribute returns an ext_proc request attribute such as "source.address".
	Attribute(name string) (string, bool)
}

// Dims are a request's classified dimensions. Feature, Tier and Provider index the
// snapshot's name tables (Snapshot.FeatureName…); Tenant and Model are open-ended.
type Dims struct {
	Feature  int
	Tier     int
	Provider int
	Tenant   string
	Model    string
	// Priority is the request's own queue priority (classification.priority), valid when
	// HasPriority; without one it waits at its compartments' priority.
	Priority    int64
	HasPriority bool
	// keyRefused is set when an api_key rule found no known key, no later one did, and
	// tenants.unknown_key is reject: admission refuses the request (ReasonUnknownKey).
	keyRefused bool
	// modelGroup indexes the snapshot's model groups (Model's first models glob), set by
	// admission when a family keys or filters by model.
	modelGroup int
	// accounts are the values the providers' quota account sources read (the classifier's
	// accounts, in order), joined by NUL (a byte no value has): a provider's quota is tracked
	// for the account its source gives. One string rather than an array keeps Dims, copied at
	// every step of admission, small.
	accounts string
}

// account returns the value the i-th account source read.
func (d *Dims) account(i int) string {
	s := d.accounts
	for ; i > 0; i-- {
		j := strings.IndexByte(s, 0)
		if j < 0 {
			return ""
		}
		s = s[j+1:]
	}
	if j := strings.IndexByte(s, 0); j >= 0 {
		return s[:j]
	}
	return s
}

// dimNames are the dimensions' names in the policy, by dim.
var dimNames = [numDims]string{config.DimFeature, config.DimTenant, config.DimTier, config.DimProvider, config.DimModel}

type ruleKind uint8

const (
	ruleHeader ruleKind = iota
	rulePathPrefix
	rulePathRegex
	ruleBody
	ruleMetadata
	ruleAttribute
	ruleTenantDirectory
	ruleModelMap
	ruleAPIKey
)

type rule struct {
	kind    ruleKind
	name    string // header, body path, attribute
	ns      string
	key     []string
	prefix  string
	re      *regexp.Regexp
	value   string
	mapping map[string]string
}

type dimension struct {
	rules []rule
	def   string
	// fold lower-cases values (trimming always happens).
	fold bool
}

// classifier evaluates the compiled rules of one snapshot. Immutable.
type classifier struct {
	feature, tenant, tier, provider, model dimension
	// priority reads a request's own queue priority, a value levels lists.
	priority                         dimension
	levels                           map[string]int64
	tiers, providers                 []string
	featureIdx, tierIdx, providerIdx map[string]int
	tenantTier                       map[string]int
	models                           []modelRule
	// accounts read the providers' quota accounts (config.Policy.AccountSources).
	accounts []dimension
	// dirKeys are the API keys of the tenant directory (key_sha256), fileKeys those of
	// tenants.keys_file; rejectUnknownKey is tenants.unknown_key: reject.
	dirKeys, fileKeys *apikey.Table
	rejectUnknownKey  bool
}

type modelRule struct {
	glob     string
	provider int // -1 when the rule sets no provider
	bpt      float64
	maxOut   int64
	// context is the model's context window (0 when the policy does not say).
	context int64
}

func compileDimension(d config.Dimension, fold bool) dimension {
	out := dimension{def: d.Default, fold: fold && !d.CaseSensitive}
	for _, r := range d.Rules {
		cr := rule{value: r.Value, mapping: r.Map}
		switch {
		case r.APIKey:
			cr.kind, cr.name = ruleAPIKey, r.Header
		case r.Header != "":
			cr.kind, cr.name = ruleHeader, r.Header
		case r.PathPrefix != "":
			cr.kind, cr.prefix = rulePathPrefix, r.PathPrefix
		case r.PathRegex != "":
			cr.kind, cr.re = rulePathRegex, regexp.MustCompile(r.PathRegex)
		case r.Body != "":
			cr.kind, cr.name = ruleBody, r.Body
		case r.Metadata != nil:
			cr.kind, cr.ns, cr.key = ruleMetadata, r.Metadata.Namespace, strings.Split(r.Metadata.Key, ".")
		case r.Attribute != "":
			cr.kind, cr.name = ruleAttribute, r.Attribute
		case r.TenantDirectory:
			cr.kind = ruleTenantDirectory
		case r.ModelMap:
			cr.kind = ruleModelMap
		}
		out.rules = append(out.rules, cr)
	}
	return out
}

// invalidValue is a value a rule read that cannot be a dimension's value (config.CheckIdentity):
// the rule is skipped as if it had read nothing.
type invalidValue struct {
	// rule is the index of the rule that read it; -1 when every value was valid.
	rule int
	// err says what is wrong with it.
	err error
}

// eval returns the first rule value that passes accept, or the default; unknown counts values
// rejected by accept. A value is trimmed, checked (config.CheckIdentity: one that could not be
// written into a header is skipped and reported in bad), lower-cased for folded dimensions,
// then mapped. Nothing allocates for values already in normal form.
func (d *dimension) eval(in Input, c *classifier, dims *Dims, accept func(string) bool) (v string, unknown int, bad invalidValue) {
	bad.rule = -1
	for i := range d.rules {
		r := &d.rules[i]
		var got string
		var found bool
		switch r.kind {
		case ruleHeader:
			got, found = in.Header(r.name)
		case rulePathPrefix:
			if strings.HasPrefix(in.Path(), r.prefix) {
				got, found = r.value, true
			}
		case rulePathRegex:
			if m := r.re.FindStringSubmatchIndex(in.Path()); m != nil {
				got = string(r.re.ExpandString(nil, r.value, in.Path(), m))
				found = true
			}
		case ruleBody:
			got, found = in.BodyField(r.name)
		case ruleMetadata:
			got, found = in.Metadata(r.ns, r.key)
		case ruleAttribute:
			got, found = in.Attribute(r.name)
		case ruleTenantDirectory:
			if t, ok := c.tenantTier[dims.Tenant]; ok {
				return c.tiers[t], unknown, bad
			}
		case ruleModelMap:
			if p := c.providerForModel(dims.Model); p >= 0 {
				return c.providers[p], unknown, bad
			}
		case ruleAPIKey:
			if t, ok := c.keyTenant(in, r.name); ok {
				dims.keyRefused = false
				return t, unknown, bad
			}
			// With unknown_key: reject, a request that reached an api_key rule is refused
			// unless a later api_key rule (reading another header) finds its key.
			dims.keyRefused = c.rejectUnknownKey
		}
		if !found {
			continue
		}
		got = strings.TrimSpace(got)
		if got == "" {
			continue
		}
		err := config.CheckIdentity(got)
		if err == nil && d.fold {
			got = strings.ToLower(got)
			// Lower-casing keeps UTF-8 valid and adds no control character, but some runes
			// lengthen.
			if len(got) > config.MaxIdentityBytes {
				err = config.CheckIdentity(got)
			}
		}
		if err != nil {
			if bad.rule < 0 {
				bad = invalidValue{rule: i, err: err}
			}
			continue
		}
		if mapped, ok := r.mapping[got]; ok {
			got = mapped
		}
		if accept == nil || accept(got) {
			return got, unknown, bad
		}
		unknown++
	}
	return d.def, unknown, bad
}

// dimension returns the compiled rules of dimension dim (dimFeature…).
func (c *classifier) dimension(d dim) *dimension {
	return [numDims]*dimension{&c.feature, &c.tenant, &c.tier, &c.provider, &c.model}[d]
}

// source describes where r reads its value, for log lines.
func (r *rule) source() string {
	switch r.kind {
	case ruleHeader:
		return "header " + r.name
	case rulePathPrefix:
		return "path_prefix " + r.prefix
	case rulePathRegex:
		return "path_regex " + r.re.String()
	case ruleBody:
		return "body " + r.name
	case ruleMetadata:
		return "metadata " + r.ns + " " + strings.Join(r.key, ".")
	case ruleAttribute:
		return "attribute " + r.name
	case ruleTenantDirectory:
		return "tenant_directory"
	case ruleAPIKey:
		return "api_key"
	}
	return "model_map"
}

// keyTenant returns the tenant of the API key the request presents: in header when the rule
// names one (its value, or what follows "Bearer "), else in authorization (Bearer) or x-api-key.
// The key is hashed at once and looked up by its hash; it is not kept.
func (c *classifier) keyTenant(in Input, header string) (string, bool) {
	var key string
	if header != "" {
		v, _ := in.Header(header)
		key = bearerToken(v, true)
	} else {
		v, _ := in.Header(config.HeaderAuthorization)
		if key = bearerToken(v, false); key == "" {
			v, _ = in.Header(config.HeaderAPIKey)
			key = strings.TrimSpace(v)
		}
	}
	if key == "" {
		return "", false
	}
	h := apikey.Sum(key)
	if t, ok := c.dirKeys.Lookup(h); ok {
		return t, true
	}
	return c.fileKeys.Lookup(h)
}

// bearerToken returns the token of an authorization value "Bearer <token>" (the scheme in any
// case), trimmed; a value in another scheme gives "" unless raw, when it is the token itself.
func bearerToken(v string, raw bool) string {
	v = strings.TrimSpace(v)
	const scheme = "bearer "
	if len(v) > len(scheme) && strings.EqualFold(v[:len(scheme)], scheme) {
		return strings.TrimSpace(v[len(scheme):])
	}
	if raw {
		return v
	}
	return ""
}

func (c *classifier) providerForModel(model string) int {
	for i := range c.models {
		if c.models[i].provider >= 0 && globMatch(c.models[i].glob, model) {
			return c.models[i].provider
		}
	}
	return -1
}

// modelRuleFor returns the first model rule matching model, or nil.
func (c *classifier) modelRuleFor(model string) *modelRule {
	for i := range c.models {
		if globMatch(c.models[i].glob, model) {
			return &c.models[i]
		}
	}
	return nil
}

// globMatch matches s against a model glob of the policy (package glob: * matches any run of
// characters, ? one). It does not allocate.
func globMatch(pattern, s string) bool { return glob.Match(pattern, s) }
