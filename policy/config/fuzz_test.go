package config_test

import (
	"errors"
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
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := config.Load("fuzz.yaml", data, []string{"LLM_BULKHEAD_SERVER__LOG_LEVEL=debug"})
		if err != nil {
			var problems config.Errors
			if !errors.As(err, &problems) || len(problems) == 0 {
				t.Fatalf("error %v is not a list of problems", err)
			}
			for _, pr := range problems {
				if pr.File == "" || pr.Msg == "" {
					t.Fatalf("problem without file or message: %+v", pr)
				}
			}
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
