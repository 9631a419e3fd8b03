package storm

import (
	"context"
	"strings"
	"testing"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
)

// TestDeriveQuotaMode: a quota mode replaces quota.mode of every provider with a quota and
// keeps the rest of it (the reserve); a policy without a provider quota has nothing to set.
func TestDeriveQuotaMode(t *testing.T) {
	for _, mode := range []string{"off", "shadow", "enforce"} {
		b, err := DerivePolicy("quota", QuotaPolicy, Variant{QuotaMode: mode, TimeScale: 0.25})
		if err != nil {
			t.Fatal(err)
		}
		var p struct {
			Providers map[string]struct {
				Quota *struct {
					Mode    string  `yaml:"mode"`
					Reserve float64 `yaml:"reserve"`
				} `yaml:"quota"`
			} `yaml:"providers"`
		}
		if err := yaml.Unmarshal(b, &p); err != nil {
			t.Fatal(err)
		}
		if q := p.Providers["deepseek"].Quota; q == nil || q.Mode != mode || q.Reserve != 0.2 {
			t.Errorf("mode %s: deepseek's quota %+v, want mode %s with reserve 0.2", mode, q, mode)
		}
		if p.Providers["qwen"].Quota != nil {
			t.Errorf("mode %s: qwen got a quota", mode)
		}
	}
	if _, err := DerivePolicy("brownout", BrownoutPolicy, Variant{QuotaMode: "enforce"}); err == nil || !strings.Contains(err.Error(), "provider with a quota") {
		t.Errorf("a quota mode without a provider quota: %v", err)
	}
	if _, err := DerivePolicy("quota", QuotaPolicy, Variant{QuotaMode: "always"}); err == nil {
		t.Error("quota mode always was accepted")
	}
}

// TestQuotaScenario: the scenario is valid, its quota is written in its JSON, and a quota
// without a limit or window is refused, as is a configuration with a quota in a scenario
// without one.
func TestQuotaScenario(t *testing.T) {
	sc := QuotaScenario()
	if err := sc.Validate(); err != nil {
		t.Fatal(err)
	}
	b, err := sc.MarshalJSON()
	if err != nil || !strings.Contains(string(b), `"provider_quota":"120 requests and 300000 tokens per 20s"`) {
		t.Fatalf("JSON %s, %v", b, err)
	}
	sc.ProviderQuota = mock.RequestQuota{Window: time.Second}
	if err := sc.Validate(); err == nil || !strings.Contains(err.Error(), "request or token limit") {
		t.Errorf("a quota without limits: %v", err)
	}
	o := Options{Scenario: BrownoutScenario(), Configurations: QuotaConfigurations("", nil)}
	if err := o.validate(); err == nil || !strings.Contains(err.Error(), "quota provider") {
		t.Errorf("quota configurations on a scenario without a quota: %v", err)
	}
}

// TestQuotaSmoke runs a short provider quota experiment four times faster than real time
// through every quota configuration: deepseek's account allows 12 requests a 6-second window
// (15 s in all), which the load uses up in each window. It checks what each mode promises in
// counts, not latencies: without a quota deepseek refuses nothing; with quota off its 429s
// reach the clients and nothing is counted; in shadow they still do, and the requests the quota
// could not cover are counted but none re-routed; in enforce no 429 of deepseek reaches a
// client, the requests the quota cannot cover go to qwen, and deepseek serves more than one
// window's quota: the window refilled at its reset.
func TestQuotaSmoke(t *testing.T) {
	sc := QuotaScenario()
	sc.Duration = 15 * time.Second
	sc.Chat = []TenantShare{{Tenant: "acme", Users: 4}, {Tenant: "globex", Users: 2}}
	sc.ThinkMin, sc.ThinkMax = time.Second, 2*time.Second
	sc.BatchWorkers = 4
	sc.ProviderQuota = mock.RequestQuota{Limit: 12, Window: 6 * time.Second}
	cfgs := QuotaConfigurations("", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := Run(ctx, Options{Scenario: sc, Configurations: cfgs, TimeScale: 0.25, Seed: 3, Capacity: 20})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != len(cfgs) {
		t.Fatalf("%d runs for %d configurations", len(rep.Runs), len(cfgs))
	}
	for _, r := range rep.Runs {
		t.Run(r.Configuration, func(t *testing.T) {
			s := r.Summary
			if s.BatchDone == 0 || s.ChatOK == 0 {
				t.Fatalf("%d documents and %d chat answers", s.BatchDone, s.ChatOK)
			}
			switch r.Configuration {
			case ConfigNoQuota:
				if s.ProviderQuotaRefused != 0 || s.QuotaShort != 0 || s.QuotaRerouted != 0 {
					t.Errorf("without a quota: %d provider 429s, %d short, %d re-routed", s.ProviderQuotaRefused, s.QuotaShort, s.QuotaRerouted)
				}
			case ConfigQuotaOff:
				if s.ProviderQuotaRefused == 0 || s.Provider429sToClients == 0 || s.QuotaShort != 0 || s.QuotaRerouted != 0 {
					t.Errorf("quota off: %d provider 429s (%d to clients), %d short, %d re-routed; want 429s reaching clients and nothing counted",
						s.ProviderQuotaRefused, s.Provider429sToClients, s.QuotaShort, s.QuotaRerouted)
				}
			case ConfigQuotaShadow:
				if s.ProviderQuotaRefused == 0 || s.Provider429sToClients == 0 || s.QuotaShort == 0 || s.QuotaRerouted != 0 {
					t.Errorf("shadow: %d provider 429s (%d to clients), %d short, %d re-routed; want 429s as with off, and the short counted",
						s.ProviderQuotaRefused, s.Provider429sToClients, s.QuotaShort, s.QuotaRerouted)
				}
			case ConfigQuotaEnforce:
				if s.ProviderQuotaRefused != 0 || s.Provider429sToClients != 0 {
					t.Errorf("enforce: deepseek refused %d requests, %d 429s reached clients; want none", s.ProviderQuotaRefused, s.Provider429sToClients)
				}
				if s.QuotaRerouted == 0 || r.UpstreamByProvider["qwen"] == 0 || s.QuotaShort < s.QuotaRerouted {
					t.Errorf("enforce: %d re-routed, %d short, qwen received %d; want the requests deepseek could not take on qwen",
						s.QuotaRerouted, s.QuotaShort, r.UpstreamByProvider["qwen"])
				}
				if n := r.UpstreamByProvider["deepseek"]; n <= int64(sc.ProviderQuota.Limit) {
					t.Errorf("enforce: deepseek received %d requests, no more than one window's %d: the quota never refilled", n, sc.ProviderQuota.Limit)
				}
			}
		})
	}
	md := rep.Markdown()
	for _, want := range []string{"provider 429s to clients", "quota runs out, quota enforce", "Enforce: provider 429s to clients"} {
		if !strings.Contains(md, want) {
			t.Errorf("table lacks %q:\n%s", want, md)
		}
	}
}
