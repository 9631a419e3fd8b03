package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/integration/storm"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestUsageErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"unknown flag", []string{"--nope"}, "flag provided but not defined"},
		{"fast and demo", []string{"--fast", "--demo"}, "exclude each other"},
		{"unknown configuration", []string{"--configs", "policy,storm-of-the-century"}, "storm-of-the-century"},
		{"extra argument", []string{"now"}, "unexpected arguments"},
		{"a run of a minute", []string{"--duration", "1m", "--configs", "baseline", "--policy", "x", "--pooled-policy", "y"}, "shorter than a minute"},
		{"unknown scenario", []string{"--scenario", "flood"}, `unknown scenario "flood"`},
		{"brownout flag on the incident", []string{"--brownout", "10@0s,4@5s"}, "--brownout applies to --scenario brownout only"},
		{"adaptive flag on the incident", []string{"--adaptive", "min=1"}, "--adaptive applies to --scenario brownout only"},
		{"bad brownout schedule", []string{"--scenario", "brownout", "--brownout", "10@5s"}, "--brownout: capacity schedule step 1"},
		{"bad adaptive settings", []string{"--scenario", "brownout", "--adaptive", "min"}, "--adaptive: adaptive setting"},
		{"capacity on the brownout", []string{"--scenario", "brownout", "--capacity", "8"}, "--capacity does not apply to --scenario brownout"},
		{"demo on the brownout", []string{"--scenario", "brownout", "--demo"}, "--demo does not apply"},
		{"unknown brownout configuration", []string{"--scenario", "brownout", "--configs", "static-7"}, "unknown configuration static-7"},
		{"brownout after the run", []string{"--scenario", "brownout", "--brownout", "10@0s,4@50s"}, "changes nothing within the run"},
		{"quota policy on the incident", []string{"--quota-policy", "q.yaml"}, "--quota-policy applies to --scenario quota only"},
		{"quota policy on the brownout", []string{"--scenario", "brownout", "--quota-policy", "q.yaml"}, "--quota-policy does not apply to --scenario brownout"},
		{"brownout schedule on the quota", []string{"--scenario", "quota", "--brownout", "10@0s,4@5s"}, "--brownout does not apply to --scenario quota"},
		{"capacity on the quota", []string{"--scenario", "quota", "--capacity", "8"}, "--capacity does not apply to --scenario quota"},
		{"unknown quota configuration", []string{"--scenario", "quota", "--configs", "quota-sometimes"}, "unknown configuration quota-sometimes"},
		{"adaptive setting the policy refuses", []string{"--scenario", "brownout", "--configs", "adaptive", "--adaptive", "colour=red"}, "colour"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errs bytes.Buffer
			if code := run(context.Background(), tt.args, &out, &errs); code != 2 {
				t.Fatalf("exit %d, want 2; stderr: %s", code, errs.String())
			}
			if !strings.Contains(errs.String(), tt.want) {
				t.Fatalf("stderr %q lacks %q", errs.String(), tt.want)
			}
		})
	}
}

func TestMissingPolicyFile(t *testing.T) {
	var out, errs bytes.Buffer
	code := run(context.Background(), []string{"--configs", "policy", "--policy", "/nonexistent/policy.yaml"}, &out, &errs)
	if code != 1 || !strings.Contains(errs.String(), "repository root") {
		t.Fatalf("exit %d, stderr %q", code, errs.String())
	}
}

func TestTickLine(t *testing.T) {
	got := tickLine(storm.Tick{At: 7500 * time.Millisecond, UpstreamInFlight: 3, Features: []storm.FeatureTick{
		{Feature: storm.FeatureChat, Admitted: 4, Answered: 3, Slowest: 0.6},
		{Feature: storm.FeatureBatch, Admitted: 10, Refused: map[string]int{"token_budget": 40, "bulkhead_full": 26}, Errors: 1, Answered: 8, Slowest: 4.2},
	}})
	want := "t= 7.5s  chat    4 admitted, slowest answer 0.60 s | batch  10 admitted, 66 refused (bulkhead_full 26, token_budget 40), 1 failed, 8 summarised | upstream 3 busy, 0 waiting"
	if got != want {
		t.Fatalf("tickLine =\n%s\nwant\n%s", got, want)
	}
}
