package storm

import (
	"bytes"
	_ "embed"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// Configuration is one way of running the scenario: with or without the storm, through
// llm-bulkhead with a policy or straight through the simulator.
type Configuration struct {
	// Name is a short identifier used on the command line and in file names.
	Name string `json:"name"`
	// Label is the configuration's row title in the table.
	Label string `json:"label"`
	// Storm runs the batch job; without it only chat users send.
	Storm bool `json:"storm"`
	// PolicyPath is the policy llm-bulkhead runs. Empty (and no PolicyText) means pass-through:
	// the simulator forwards every request without calling an ext_proc server (all processing
	// skipped), so nothing is classified, queued or refused on the way.
	PolicyPath string `json:"policy,omitempty"`
	// PolicyText, when set, is the policy itself, PolicyPath then only naming it in messages.
	PolicyText []byte `json:"-"`
	// Shadow runs the policy in shadow mode: every compartment family gets mode: shadow and every
	// breaker state METRICS_ONLY, so the server counts what it would refuse and refuses nothing.
	Shadow bool `json:"shadow,omitempty"`
	// Brownout runs the upstream on the scenario's capacity schedule (Scenario.Brownout);
	// without it the upstream keeps the schedule's first capacity.
	Brownout bool `json:"brownout,omitempty"`
	// ProviderLimit, when not empty, replaces max_concurrent of every provider of the policy:
	// a number, or "adaptive" with Adaptive as its adaptive settings.
	ProviderLimit string            `json:"provider_limit,omitempty"`
	Adaptive      map[string]string `json:"adaptive,omitempty"`
	// FollowCapacity sets every provider's max_concurrent to the upstream's capacity in force,
	// reloading the policy at each change of the brownout: an operator who knows the capacity
	// the moment it changes. It shows the best a limit can do that, like every limit here,
	// never revokes a request it admitted. ProviderLimit is then the first capacity.
	FollowCapacity bool `json:"follow_capacity,omitempty"`
	// FollowDelay, with FollowCapacity, makes each change of the limit come this long (in
	// simulated time) after the capacity's: an operator as well informed but as late as a limit
	// learned from the provider's answers must be.
	FollowDelay time.Duration `json:"follow_delay,omitempty"`
	// ProviderQuota gives the scenario's QuotaProvider its account quota
	// (Scenario.ProviderQuota) at the upstream; without it the account has no limit.
	ProviderQuota bool `json:"provider_quota,omitempty"`
	// QuotaMode, when not empty, replaces quota.mode of every provider of the policy that has
	// a quota: off, shadow or enforce.
	QuotaMode string `json:"quota_mode,omitempty"`
}

// PassThrough reports whether the configuration runs without an ext_proc server.
func (c Configuration) PassThrough() bool { return c.PolicyPath == "" && c.PolicyText == nil }

// variant is how DerivePolicy changes the configuration's policy at time scale scale.
func (c Configuration) variant(scale float64) Variant {
	return Variant{Shadow: c.Shadow, TimeScale: scale, ProviderLimit: c.ProviderLimit, Adaptive: c.Adaptive, QuotaMode: c.QuotaMode}
}

// Names of the standard configurations.
const (
	ConfigBaseline       = "baseline"
	ConfigBaselinePolicy = "baseline-policy"
	ConfigNoPolicy       = "no-policy"
	ConfigPolicy         = "policy"
	ConfigShadow         = "shadow"
	ConfigPooled         = "pooled"
)

// StandardConfigurations returns the experiment's configurations in table order: the chat-only
// baseline without and with the example policy, then under the storm: no policy, the example
// policy, the example policy in shadow mode, and the pooled policy. policyPath and pooledPath
// are examples/policy.yaml and examples/policy-pooled.yaml.
func StandardConfigurations(policyPath, pooledPath string) []Configuration {
	return []Configuration{
		{Name: ConfigBaseline, Label: "no storm, no policy (baseline)"},
		{Name: ConfigBaselinePolicy, Label: "no storm, example policy", PolicyPath: policyPath},
		{Name: ConfigNoPolicy, Label: "(a) storm, no policy", Storm: true},
		{Name: ConfigPolicy, Label: "(b) storm, example policy", Storm: true, PolicyPath: policyPath},
		{Name: ConfigShadow, Label: "(c) storm, example policy in shadow mode", Storm: true, PolicyPath: policyPath, Shadow: true},
		{Name: ConfigPooled, Label: "(d) storm, pooled policy", Storm: true, PolicyPath: pooledPath},
	}
}

// DefaultConfigurationNames are the configurations a plain run executes: everything but the
// chat-only run under the policy, which only separates the proxy's own cost.
var DefaultConfigurationNames = []string{ConfigBaseline, ConfigNoPolicy, ConfigPolicy, ConfigShadow, ConfigPooled}

// Names of the brownout configurations.
const (
	ConfigNoBrownout = "no-brownout"
	ConfigStatic10   = "static-10"
	ConfigStatic4    = "static-4"
	ConfigAdaptive   = "adaptive"
	ConfigFollow     = "follow-capacity"
	ConfigFollowLate = "follow-capacity-late"
)

// BrownoutPolicy is the brownout experiment's built-in policy (brownout-policy.yaml): chat
// (priority 10) and batch (priority 1) on one provider, deepseek, with max_concurrent 10 and
// nothing else that refuses.
//
//go:embed brownout-policy.yaml
var BrownoutPolicy []byte

// BrownoutPolicyName names the built-in brownout policy in messages.
const BrownoutPolicyName = "built-in brownout policy"

// DefaultAdaptive are the adaptive settings of the brownout experiment's adaptive
// configuration: the limit may move between 2 and 20 from an initial 10, recomputed every
// 500 ms of simulated time (the default of 1 s reacts too late for a 15-second brownout).
var DefaultAdaptive = map[string]string{"min": "2", "max": "20", "initial": "10", "interval": "500ms"}

// BrownoutConfigurations returns the brownout experiment's configurations in table order: the
// provider's limit at 10 without a brownout (the baseline), then under the brownout the limit
// at 10 (the provider's healthy capacity), at 4 (its brownout capacity), adaptive with the
// settings given, set to the capacity at each change (FollowCapacity), and set to it
// followDelay after each change. policyPath names the policy and policy is its text
// (BrownoutPolicy when nil).
func BrownoutConfigurations(policyPath string, policy []byte, adaptive map[string]string, followDelay time.Duration) []Configuration {
	if policy == nil {
		policy = BrownoutPolicy
	}
	if policyPath == "" {
		policyPath = BrownoutPolicyName
	}
	return []Configuration{
		{Name: ConfigNoBrownout, Label: "no brownout, static limit 10 (baseline)", Storm: true, PolicyPath: policyPath, PolicyText: policy, ProviderLimit: "10"},
		{Name: ConfigStatic10, Label: "brownout, static limit 10", Storm: true, Brownout: true, PolicyPath: policyPath, PolicyText: policy, ProviderLimit: "10"},
		{Name: ConfigStatic4, Label: "brownout, static limit 4", Storm: true, Brownout: true, PolicyPath: policyPath, PolicyText: policy, ProviderLimit: "4"},
		{Name: ConfigAdaptive, Label: "brownout, adaptive limit", Storm: true, Brownout: true, PolicyPath: policyPath, PolicyText: policy, ProviderLimit: "adaptive", Adaptive: adaptive},
		{Name: ConfigFollow, Label: "brownout, limit set to the capacity at each change", Storm: true, Brownout: true, PolicyPath: policyPath, PolicyText: policy, ProviderLimit: "10", FollowCapacity: true},
		{Name: ConfigFollowLate, Label: "brownout, limit set to the capacity " + followDelay.String() + " after each change", Storm: true, Brownout: true, PolicyPath: policyPath, PolicyText: policy, ProviderLimit: "10", FollowCapacity: true, FollowDelay: followDelay},
	}
}

// DefaultFollowDelay is how late the follow-capacity-late configuration follows each change of
// the capacity (simulated time): about when the adaptive limit, in this scenario, can first
// see a drop (the first request admitted after it has waited tolerance times its no-load time
// to first token; its first cut comes 0.12–0.36 s after the change, as the trace samples it).
const DefaultFollowDelay = 250 * time.Millisecond

// BrownoutConfigurationNames are the brownout configurations a plain run executes: all of them.
var BrownoutConfigurationNames = []string{ConfigNoBrownout, ConfigStatic10, ConfigStatic4, ConfigAdaptive, ConfigFollow, ConfigFollowLate}

// Names of the provider quota configurations.
const (
	ConfigNoQuota      = "no-quota"
	ConfigQuotaOff     = "quota-off"
	ConfigQuotaShadow  = "quota-shadow"
	ConfigQuotaEnforce = "quota-enforce"
)

// QuotaPolicy is the provider quota experiment's built-in policy (quota-policy.yaml): chat
// (priority 10) and batch (priority 1) on deepseek, whose quota keeps a fifth for chat, with
// qwen as its fallback.
//
//go:embed quota-policy.yaml
var QuotaPolicy []byte

// QuotaPolicyName names the built-in quota policy in messages.
const QuotaPolicyName = "built-in quota policy"

// QuotaConfigurations returns the provider quota experiment's configurations in table order:
// the account without a quota (the baseline), then with its quota the policy's quota mode off,
// shadow and enforce. policyPath names the policy and policy is its text (QuotaPolicy when
// nil).
func QuotaConfigurations(policyPath string, policy []byte) []Configuration {
	if policy == nil {
		policy = QuotaPolicy
	}
	if policyPath == "" {
		policyPath = QuotaPolicyName
	}
	c := func(name, label string, quota bool, mode string) Configuration {
		return Configuration{Name: name, Label: label, Storm: true, PolicyPath: policyPath, PolicyText: policy, ProviderQuota: quota, QuotaMode: mode}
	}
	return []Configuration{
		c(ConfigNoQuota, "account without a quota, quota off (baseline)", false, "off"),
		c(ConfigQuotaOff, "quota runs out, quota off", true, "off"),
		c(ConfigQuotaShadow, "quota runs out, quota shadow", true, "shadow"),
		c(ConfigQuotaEnforce, "quota runs out, quota enforce", true, "enforce"),
	}
}

// QuotaConfigurationNames are the quota configurations a plain run executes: all of them.
var QuotaConfigurationNames = []string{ConfigNoQuota, ConfigQuotaOff, ConfigQuotaShadow, ConfigQuotaEnforce}

// ParseAdaptive reads adaptive settings written as key=value pairs separated by commas
// ("min=2,max=20,interval=500ms"). It checks the form only; the policy's validation checks the
// keys and values.
func ParseAdaptive(s string) (map[string]string, error) {
	out := map[string]string{}
	if strings.TrimSpace(s) == "" {
		return out, nil
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" || v == "" {
			return nil, fmt.Errorf("adaptive setting %q: want key=value, such as interval=500ms", kv)
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("adaptive setting %q given twice", k)
		}
		out[k] = v
	}
	return out, nil
}

// FormatAdaptive writes adaptive settings as ParseAdaptive reads them, keys sorted.
func FormatAdaptive(m map[string]string) string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	for i, k := range ks {
		ks[i] = k + "=" + m[k]
	}
	return strings.Join(ks, ",")
}

// SelectConfigurations returns the configurations of all named in names, in the order of all.
func SelectConfigurations(all []Configuration, names []string) ([]Configuration, error) {
	var out []Configuration
	var unknown []string
	for _, n := range names {
		if !slices.ContainsFunc(all, func(c Configuration) bool { return c.Name == n }) {
			unknown = append(unknown, n)
		}
	}
	if len(unknown) > 0 {
		known := make([]string, len(all))
		for i, c := range all {
			known[i] = c.Name
		}
		return nil, fmt.Errorf("unknown configuration %s (known: %s)", strings.Join(unknown, ", "), strings.Join(known, ", "))
	}
	for _, c := range all {
		if slices.Contains(names, c.Name) {
			out = append(out, c)
		}
	}
	return out, nil
}

// Variant says how DerivePolicy changes a policy.
type Variant struct {
	// Shadow sets mode: shadow on every compartment family and state: METRICS_ONLY on every
	// breaker, so nothing is refused and everything is counted.
	Shadow bool
	// TimeScale multiplies every wait and breaker duration (1 or 0: unchanged), and the
	// durations of adaptive settings.
	TimeScale float64
	// ProviderLimit, when not empty, sets max_concurrent of every provider: a number, or
	// "adaptive", which also sets the provider's adaptive settings to Adaptive (before scaling);
	// a number removes any adaptive settings.
	ProviderLimit string
	Adaptive      map[string]string
	// QuotaMode, when not empty, sets quota.mode of every provider that has a quota.
	QuotaMode string
}

// scaledKeys are the policy keys holding durations that must follow the time scale: queue waits
// and breaker timings. Token and request budgets are per minute and stay as they are (see the
// package documentation); server and Envoy timeouts bound the processor's own work, which is not
// simulated.
var scaledKeys = map[string]bool{
	"max_wait":              true,
	"slow_call_duration":    true,
	"wait_in_open":          true,
	"max_wait_in_open":      true,
	"max_wait_in_half_open": true,
}

// breakerDefaults are the breaker durations that apply when a breaker without a base leaves them
// unset (config.Breaker's documented defaults); DerivePolicy writes them scaled.
var breakerDefaults = []struct {
	key string
	d   time.Duration
}{{"slow_call_duration", 60 * time.Second}, {"wait_in_open", 60 * time.Second}}

// scaledAdaptiveKeys are the durations of an adaptive limit's settings (under a limit's
// adaptive key), scaled like the waits: how often the limit is recomputed and the baseline
// re-measured.
var scaledAdaptiveKeys = map[string]bool{"interval": true, "remeasure_interval": true}

// scaledSections are the top-level sections whose durations DerivePolicy scales.
var scaledSections = []string{"templates", "features", "tiers", "providers", "breakers", "tenants", "compartments"}

// DerivePolicy returns a copy of the policy file src changed as v says, keeping everything else
// (comments included), and checks that the result loads. name is used in messages.
func DerivePolicy(name string, src []byte, v Variant) ([]byte, error) {
	if v.TimeScale < 0 || math.IsNaN(v.TimeScale) || math.IsInf(v.TimeScale, 0) {
		return nil, fmt.Errorf("time scale %v must be a positive finite number", v.TimeScale)
	}
	var root yaml.Node
	if err := yaml.Unmarshal(src, &root); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if root.Kind != yaml.DocumentNode || len(root.Content) != 1 || root.Content[0].Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%s: a policy file must be a YAML mapping of sections", name)
	}
	doc := root.Content[0]
	if v.ProviderLimit != "" {
		if err := setProviderLimit(doc, v.ProviderLimit, v.Adaptive); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	if v.QuotaMode != "" {
		if err := setQuotaMode(doc, v.QuotaMode); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	if v.TimeScale != 0 && v.TimeScale != 1 {
		if err := scaleDurations(doc, v.TimeScale); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	if v.Shadow {
		if err := shadow(doc); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	var out bytes.Buffer
	fmt.Fprintf(&out, "# Derived from %s by the storm experiment (shadow %v, time scale %v", name, v.Shadow, orOne(v.TimeScale))
	if v.ProviderLimit != "" {
		fmt.Fprintf(&out, ", provider limit %s", v.ProviderLimit)
	}
	if v.QuotaMode != "" {
		fmt.Fprintf(&out, ", quota mode %s", v.QuotaMode)
	}
	out.WriteString(").\n")
	enc := yaml.NewEncoder(&out)
	enc.SetIndent(2)
	if err := enc.Encode(&root); err != nil {
		return nil, err
	}
	if err := enc.Close(); err != nil {
		return nil, err
	}
	if _, err := config.Load(name+" (derived)", out.Bytes(), []string{}); err != nil {
		return nil, fmt.Errorf("derived policy does not load: %w", err)
	}
	return out.Bytes(), nil
}

func orOne(f float64) float64 {
	if f == 0 {
		return 1
	}
	return f
}

// scaleDurations multiplies the durations under scaledKeys in the limit-bearing sections, and
// writes scaled defaults into breakers that rely on them.
func scaleDurations(doc *yaml.Node, scale float64) error {
	var errs []error
	var walk func(n *yaml.Node, path string)
	walk = func(n *yaml.Node, path string) {
		switch n.Kind {
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				k, val := n.Content[i], n.Content[i+1]
				p := path + "." + k.Value
				if (scaledKeys[k.Value] || strings.HasSuffix(path, ".adaptive") && scaledAdaptiveKeys[k.Value]) && val.Kind == yaml.ScalarNode {
					d, err := time.ParseDuration(strings.TrimSpace(val.Value))
					if err != nil {
						errs = append(errs, fmt.Errorf("%s: %q is not a duration", p[1:], val.Value))
						continue
					}
					val.Value = scaleDuration(d, scale).String()
					val.Tag, val.Style = "!!str", 0
					continue
				}
				walk(val, p)
			}
		case yaml.SequenceNode:
			for i, c := range n.Content {
				walk(c, fmt.Sprintf("%s[%d]", path, i))
			}
		}
	}
	for _, sec := range scaledSections {
		if n := mapValue(doc, sec); n != nil {
			walk(n, "."+sec)
		}
	}
	if brs := mapValue(doc, "breakers"); brs != nil && brs.Kind == yaml.MappingNode {
		for i := 0; i+1 < len(brs.Content); i += 2 {
			b := brs.Content[i+1]
			if b.Kind != yaml.MappingNode || mapValue(b, "base") != nil {
				continue
			}
			for _, def := range breakerDefaults {
				if mapValue(b, def.key) == nil {
					setScalar(b, def.key, scaleDuration(def.d, scale).String())
				}
			}
			if t := mapValue(b, "sliding_window_type"); t != nil && strings.EqualFold(t.Value, "TIME_BASED") {
				// A time-based window is measured in seconds.
				if sz := mapValue(b, "sliding_window_size"); sz != nil {
					var n int
					if _, err := fmt.Sscan(sz.Value, &n); err == nil {
						sz.Value = fmt.Sprint(max(1, int(math.Round(float64(n)*scale))))
					}
				}
			}
		}
	}
	return errors.Join(errs...)
}

// setProviderLimit sets max_concurrent of every provider to limit, with adaptive settings when
// limit is "adaptive" and without any otherwise.
func setProviderLimit(doc *yaml.Node, limit string, adaptive map[string]string) error {
	provs := mapValue(doc, "providers")
	if provs == nil || provs.Kind != yaml.MappingNode || len(provs.Content) == 0 {
		return errors.New("a provider limit needs a providers section")
	}
	for i := 1; i < len(provs.Content); i += 2 {
		p := provs.Content[i]
		if p.Kind != yaml.MappingNode {
			return fmt.Errorf("provider %s must be a mapping", provs.Content[i-1].Value)
		}
		p.Style = 0 // block style, so that an added adaptive mapping reads well
		setPlain(p, "max_concurrent", limit)
		deleteKey(p, "adaptive")
		if limit == "adaptive" && len(adaptive) > 0 {
			m := &yaml.Node{Kind: yaml.MappingNode, Style: yaml.FlowStyle}
			ks := make([]string, 0, len(adaptive))
			for k := range adaptive {
				ks = append(ks, k)
			}
			sort.Strings(ks)
			for _, k := range ks {
				m.Content = append(m.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: k}, &yaml.Node{Kind: yaml.ScalarNode, Value: adaptive[k]})
			}
			p.Content = append(p.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: "adaptive"}, m)
		}
	}
	return nil
}

// setQuotaMode sets quota.mode of every provider that has a quota mapping.
func setQuotaMode(doc *yaml.Node, mode string) error {
	provs := mapValue(doc, "providers")
	found := false
	if provs != nil && provs.Kind == yaml.MappingNode {
		for i := 1; i < len(provs.Content); i += 2 {
			if q := mapValue(provs.Content[i], "quota"); q != nil && q.Kind == yaml.MappingNode {
				setScalar(q, "mode", mode)
				found = true
			}
		}
	}
	if !found {
		return errors.New("a quota mode needs a provider with a quota")
	}
	return nil
}

// setPlain sets key to an untagged scalar in mapping n (a number stays a number).
func setPlain(n *yaml.Node, key, value string) {
	setScalar(n, key, value)
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			n.Content[i+1].Tag = ""
		}
	}
}

// deleteKey removes key from mapping n.
func deleteKey(n *yaml.Node, key string) {
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			n.Content = append(n.Content[:i], n.Content[i+2:]...)
			return
		}
	}
}

// scaleDuration multiplies d by scale, keeping at least a millisecond so that a configured wait
// never turns into "refuse at once".
func scaleDuration(d time.Duration, scale float64) time.Duration {
	out := time.Duration(math.Round(float64(d) * scale))
	if d > 0 && out < time.Millisecond {
		out = time.Millisecond
	}
	return out.Round(time.Microsecond)
}

// shadow sets every family's mode to shadow and every breaker's state to METRICS_ONLY.
func shadow(doc *yaml.Node) error {
	fams := mapValue(doc, "compartments")
	if fams == nil {
		// The default family (feature) applies; spell it out so it can carry a mode.
		fams = &yaml.Node{Kind: yaml.SequenceNode, Content: []*yaml.Node{{Kind: yaml.MappingNode}}}
		setScalar(fams.Content[0], "name", config.DimFeature)
		seq := &yaml.Node{Kind: yaml.SequenceNode, Content: []*yaml.Node{{Kind: yaml.ScalarNode, Value: config.DimFeature}}}
		fams.Content[0].Content = append(fams.Content[0].Content, &yaml.Node{Kind: yaml.ScalarNode, Value: "key"}, seq)
		setScalar(fams.Content[0], "limits_from", config.DimFeature)
		doc.Content = append(doc.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: "compartments"}, fams)
	}
	if fams.Kind != yaml.SequenceNode {
		return errors.New("compartments must be a list")
	}
	for _, f := range fams.Content {
		if f.Kind != yaml.MappingNode {
			return errors.New("every compartment family must be a mapping")
		}
		setScalar(f, "mode", "shadow")
	}
	if brs := mapValue(doc, "breakers"); brs != nil {
		if brs.Kind != yaml.MappingNode {
			return errors.New("breakers must be a mapping")
		}
		for i := 1; i < len(brs.Content); i += 2 {
			if brs.Content[i].Kind == yaml.MappingNode {
				setScalar(brs.Content[i], "state", "METRICS_ONLY")
			}
		}
	}
	return nil
}

// mapValue returns the value of key in mapping n, or nil.
func mapValue(n *yaml.Node, key string) *yaml.Node {
	if n == nil || n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	return nil
}

// setScalar sets key to a string scalar in mapping n, replacing any value it had.
func setScalar(n *yaml.Node, key, value string) {
	v := &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: value}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			n.Content[i+1] = v
			return
		}
	}
	n.Content = append(n.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: key}, v)
}
