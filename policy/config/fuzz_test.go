package config_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// FuzzLoad: any file either loads into a policy that resolves, or is refused with problems that
// each name a file; never a panic.
func FuzzLoad(f *testing.F) {
	f.Add(examples.DefaultPolicy)
	f.Add([]byte("features:\n  default: {max_concurrent: 1}\n"))
	f.Add([]byte("compartments:\n  - {name: t, key: [tenant], limits_from: tenant}\ntiers: {free: {max_concurrent: 2}}\n"))
	f.Add([]byte("breakers: {a: {base: a}}\n"))
	f.Add([]byte("{"))
	// Decoding and validation problems together, and YAML the loader walks itself.
	f.Add([]byte("features:\n  default: {max_concurrent: -1, max_wait: 5}\n  chat: {max_concurent: 1.5}\n"))
	f.Add([]byte("templates: {t: &t {max_wait: 1s}}\nfeatures: {default: {<<: *t, max_concurrent: 1}, b: *t}\n"))
	f.Add([]byte("features: {default: {max_concurrent: 1, max_concurrent: 2, ratio: .nan}}\npools: [{name: p, max_concurrent: x}]\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := config.Load("fuzz.yaml", data, []string{"LLM_BULKHEAD_SERVER__LOG_LEVEL=debug"})
		if err != nil {
			checkProblems(t, err)
			return
		}
		for _, name := range p.FeatureNames() {
			_ = p.Resolve(p.Features[name].Limits)
		}
		for name := range p.Breakers {
			if _, err := p.ResolveBreaker(name).Config(); err != nil {
				t.Fatalf("a loaded policy has an invalid breaker %s: %v", name, err)
			}
		}
	})
}

// FuzzLoadEnv: any override of the example policy either loads or is refused with problems; a
// problem blamed on the variable is filed under <env>, never under the policy file.
func FuzzLoadEnv(f *testing.F) {
	f.Add("FEATURES__CHAT__MAX_CONCURRENT", "30")
	f.Add("FEATURES__CHAT__MAX_CONCURENT", "30")
	f.Add("SERVER__LOG_LEVEL", "{a: 1}")
	f.Add("COMPARTMENTS__0__NAME", "x")
	f.Add("FEATURS__CHAT", "1")
	f.Add("ENVOY__MESSAGE_TIMEOUT", "5")
	f.Fuzz(func(t *testing.T, name, value string) {
		name = config.EnvPrefix + name
		_, err := config.Load("policy.yaml", examples.DefaultPolicy, []string{name + "=" + value})
		if err == nil {
			return
		}
		for _, pr := range checkProblems(t, err) {
			if strings.Contains(pr.Msg, name+": ") && pr.File != "<env>" {
				t.Fatalf("a problem of the override filed under the policy: %s", pr)
			}
		}
	})
}

// checkProblems checks that err is a non-empty list of problems, each with a file and a message,
// those of environment overrides first, then the file's by line.
func checkProblems(t *testing.T, err error) config.Errors {
	t.Helper()
	var problems config.Errors
	if !errors.As(err, &problems) || len(problems) == 0 {
		t.Fatalf("error %v is not a list of problems", err)
	}
	for i, pr := range problems {
		if pr.File == "" || pr.Msg == "" {
			t.Fatalf("problem without file or message: %+v", pr)
		}
		if i > 0 {
			prev := problems[i-1]
			if (prev.File != "<env>" && pr.File == "<env>") || (prev.File == pr.File && prev.Line > pr.Line) {
				t.Fatalf("problems out of order:\n%s", problems.Error())
			}
		}
	}
	return problems
}

// FuzzSize: a size either parses to a non-negative number that prints back to the same value,
// or is refused.
func FuzzSize(f *testing.F) {
	for _, s := range []string{"8MiB", "1024", "1.5GiB", "-1", "9223372036854775807GiB", "KB"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		var v config.Size
		if err := v.UnmarshalText([]byte(s)); err != nil {
			return
		}
		if v < 0 {
			t.Fatalf("%q parsed to %d", s, v)
		}
		var back config.Size
		if err := back.UnmarshalText([]byte(v.String())); err != nil || back != v {
			t.Fatalf("%q → %d → %q → %d (%v)", s, v, v.String(), back, err)
		}
	})
}
