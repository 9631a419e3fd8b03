package config_test

import (
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

const refusalsBase = `
features:
  default: {max_concurrent: 5}
`

func TestRefusalsDefaults(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(refusalsBase), nil)
	if err != nil {
		t.Fatal(err)
	}
	if r := p.Refusals; r.NoRetryAbove == nil || r.NoRetryAbove.D() != config.DefaultNoRetryAbove || r.RateLimitHeaders == nil || !*r.RateLimitHeaders {
		t.Errorf("defaults %+v", r)
	}
	if p.Refusals.NoRetryAboveOrDefault() != 10*time.Second || !p.Refusals.RateLimitHeadersOrDefault() {
		t.Error("accessors disagree with the defaults")
	}
	// A policy that was never loaded (no defaults applied) reads the same.
	var zero config.Refusals
	if zero.NoRetryAboveOrDefault() != config.DefaultNoRetryAbove || !zero.RateLimitHeadersOrDefault() {
		t.Error("the zero Refusals does not read as the defaults")
	}
}

func TestRefusalsExplicitValues(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(refusalsBase+"refusals: {no_retry_above: 0s, ratelimit_headers: false}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	// 0 means never, not "use the default".
	if p.Refusals.NoRetryAboveOrDefault() != 0 || p.Refusals.RateLimitHeadersOrDefault() {
		t.Errorf("%+v", p.Refusals)
	}
	p, err = config.Load("p.yaml", []byte(refusalsBase+"refusals: {no_retry_above: 45s}\n"), nil)
	if err != nil || p.Refusals.NoRetryAboveOrDefault() != 45*time.Second {
		t.Errorf("%v %v", p, err)
	}
}

func TestRefusalsProblems(t *testing.T) {
	got := loadProblems(t, refusalsBase+"refusals:\n  no_retry_above: -1s\n  no_retry_abov: 2s\n", nil)
	if len(got) != 2 || !strings.Contains(strings.Join(got, "\n"), "refusals.no_retry_above") ||
		!strings.Contains(strings.Join(got, "\n"), "no_retry_abov") {
		t.Errorf("problems %q", got)
	}
}
