package app_test

import (
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// TestExplainAdaptive: validate --explain shows an adaptive compartment's bounds in the
// compartment table and its settings, defaults applied, in a section of their own.
func TestExplainAdaptive(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(`
classification:
  provider: {default: openai}
providers:
  openai:
    max_concurrent: adaptive
    adaptive: {min: 2, max: 20, interval: 500ms}
  local: {max_concurrent: 8}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := app.Summarize(p)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	s.Explain(&b)
	for _, want := range []string{
		"provider/local   enforce  8               -         80",
		"provider/openai  enforce  adaptive 2-20   -         200",
		"Adaptive limits (learned from time to first token per prompt size",
		"provider/openai  10       2    20   1.5        500ms     5m0s",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("explain lacks %q:\n%s", want, b.String())
		}
	}
	if strings.Count(b.String(), "provider/local") != 1 {
		t.Errorf("a fixed limit is listed among the adaptive ones:\n%s", b.String())
	}
}
