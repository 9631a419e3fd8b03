package integration_test

import (
	"context"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// TestQuotaEndpointWithTheOpenAISDK: with quota_endpoint enabled on the example policy, the
// official openai-go client's plain GET of /v1/bulkhead/quota — as tenant acme, identified as
// its chat calls are — gets JSON about acme's own compartments: after one chat call, what is
// left of acme's token budget; the compartments acme shares with other tenants give their
// limits only. The request never reaches the provider.
func TestQuotaEndpointWithTheOpenAISDK(t *testing.T) {
	s := start(t, harness.Options{Env: []string{"LLM_BULKHEAD_QUOTA_ENDPOINT__ENABLED=true"}, Mock: mock.Options{TimeScale: 0.001}})
	url, err := s.ProxyURL()
	if err != nil {
		t.Fatal(err)
	}
	client := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey("test"), option.WithMaxRetries(0),
		option.WithHeader("x-llm-feature", "chat"), option.WithHeader("x-tenant-id", "acme"))
	ctx := context.Background()
	resp, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:     "deepseek-chat",
		MaxTokens: openai.Int(100),
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hi")},
	})
	if err != nil {
		t.Fatalf("chat call: %v", err)
	}
	used := resp.Usage.TotalTokens
	before := len(s.Mock.Requests())

	var q policy.ClientQuota
	if err := client.Get(ctx, "bulkhead/quota", nil, &q); err != nil {
		t.Fatalf("GET /v1/bulkhead/quota: %v", err)
	}
	if n := len(s.Mock.Requests()); n != before {
		t.Errorf("the quota request reached the provider (%d requests, %d before)", n, before)
	}
	if q.Tenant != "acme" || q.Feature != "chat" || q.Tier != "enterprise" {
		t.Fatalf("quota for %q/%q/%q, want acme/chat/enterprise", q.Tenant, q.Feature, q.Tier)
	}
	var own *policy.ClientCompartment
	for i, c := range q.Compartments {
		switch {
		case c.Name == "tenant/acme":
			own = &q.Compartments[i]
			if !c.Own {
				t.Errorf("tenant/acme not marked own")
			}
		case !c.Own:
			if c.InFlight != nil || len(c.Spend) > 0 && c.Spend[0].Spent != "" {
				t.Errorf("shared compartment %s says how it is used: %+v", c.Name, c)
			}
			for _, w := range c.Windows {
				if w.Remaining != nil {
					t.Errorf("shared compartment %s says what is left of %s", c.Name, w.Kind)
				}
			}
		}
	}
	if own == nil {
		t.Fatalf("no tenant/acme in %+v", q.Compartments)
	}
	if own.MaxConcurrent != 30 || own.InFlight == nil || *own.InFlight != 0 || len(own.Windows) != 1 {
		t.Fatalf("tenant/acme: %+v", own)
	}
	w := own.Windows[0]
	if w.Kind != "tokens_per_minute" || w.Limit != 500000 || w.Remaining == nil || *w.Remaining != 500000-used || w.ResetSeconds == nil || *w.ResetSeconds <= 0 {
		t.Errorf("acme's token window: %+v (remaining %v), want 500000 with %d used", w, deref(w.Remaining), used)
	}

	// Another tenant sees its own compartment, nothing of acme's.
	var other policy.ClientQuota
	if err := client.Get(ctx, "bulkhead/quota", nil, &other, option.WithHeader("x-tenant-id", "globex")); err != nil {
		t.Fatal(err)
	}
	for _, c := range other.Compartments {
		if c.Name == "tenant/acme" {
			t.Errorf("globex's quota shows acme's compartment")
		}
		if c.Name == "tenant/globex" && (len(c.Spend) != 1 || c.Spend[0].Limit != "500.00" || c.Spend[0].Remaining != "500.00") {
			t.Errorf("globex's spend: %+v", c.Spend)
		}
	}
}

func deref(p *int64) int64 {
	if p == nil {
		return -1
	}
	return *p
}
