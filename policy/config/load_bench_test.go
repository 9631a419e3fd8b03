package config_test

import (
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// BenchmarkLoad measures loading the example policy, the size of a real one, with and without
// environment overrides. Loading is not on the request path, but it runs at startup and on
// every reload, and its allocations show how many times the file is walked.
func BenchmarkLoad(b *testing.B) {
	for _, bc := range []struct {
		name string
		env  []string
	}{
		{"file", nil},
		{"file+env", []string{"LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURRENT=30", "LLM_BULKHEAD_SERVER__LOG_LEVEL=debug"}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := config.Load("policy.yaml", examples.DefaultPolicy, bc.env); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
