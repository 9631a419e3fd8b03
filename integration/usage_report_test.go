package integration_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// usageReportPolicy prices every model at 1 millionth a prompt token and 2 a completion token
// (no spend budget), lets globex send one request a minute, and names acme for metrics.
const usageReportPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  tier:
    rules: [{tenant_directory: true}]
  model:
    rules: [{body: model}]
prices:
  - {match: default, input_per_mtok: 1.00, output_per_mtok: 2.00}
features:
  default: {max_concurrent: 100}
tenants:
  directory:
    - {id: globex, tier: limited}
tiers:
  free: {max_concurrent: 100}
  limited: {requests_per_minute: 1}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
usage: {tenant_metrics: [acme]}
`

// usageRequest is a chat completion of tenant to model (an Anthropic message for claude
// models), streamed or not, with cached of its prompt tokens reported as cached.
func usageRequest(tenant, model string, stream bool, cached int) *envoysim.Request {
	path := "/v1/chat/completions"
	body := fmt.Sprintf(`{"model":%q,"stream":%v,"stream_options":{"include_usage":true},"max_tokens":12,"messages":[{"role":"user","content":"Count the tokens of %s, please."}]}`,
		model, stream, tenant)
	if strings.HasPrefix(model, "claude") {
		path = "/v1/messages"
		body = fmt.Sprintf(`{"model":%q,"stream":%v,"max_tokens":12,"messages":[{"role":"user","content":"Count the tokens of %s, please."}]}`, model, stream, tenant)
	}
	return &envoysim.Request{Method: "POST", Path: path, Body: []byte(body), Headers: envoysim.Headers{
		{Key: "content-type", Value: "application/json"}, {Key: "x-tenant-id", Value: tenant},
		{Key: mock.HeaderCachedTokens, Value: strconv.Itoa(cached)}}}
}

// pairUsage is what the test counted for a tenant and model from the mock's responses.
type pairUsage struct {
	Requests, Prompt, Completion, Cached, Refused uint64
}

type usageRow struct {
	Tenant           string            `json:"tenant"`
	Model            string            `json:"model"`
	Requests         uint64            `json:"requests"`
	PromptTokens     uint64            `json:"prompt_tokens"`
	CompletionTokens uint64            `json:"completion_tokens"`
	CachedTokens     uint64            `json:"cached_tokens"`
	Spend            float64           `json:"spend"`
	Refused          uint64            `json:"refused"`
	Refusals         map[string]uint64 `json:"refusals"`
	Overcount        uint64            `json:"overcount"`
	Other            bool              `json:"other"`
}

type usageReport struct {
	Scope  string     `json:"scope"`
	Totals usageRow   `json:"totals"`
	Rows   []usageRow `json:"rows"`
}

// waitUsage returns GET /admin/usage?query once its totals count requests finished and refused
// (the last responses are settled when their streams end, after the client has them).
func waitUsage(t *testing.T, s *harness.Stack, query string, requests, refused uint64) usageReport {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var r usageReport
		if err := s.Get("/admin/usage?"+query, &r); err != nil {
			t.Fatal(err)
		}
		if r.Totals.Requests == requests && r.Totals.Refused == refused {
			return r
		}
		if time.Now().After(deadline) {
			t.Fatalf("usage never counted %d requests and %d refusals: %+v", requests, refused, r.Totals)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestUsageByTenantAndModelIsWhatWasSent: requests of three tenants to four models, streamed or
// not, through Envoy's ext_proc (envoysim) to the mock provider: /admin/usage by tenant and
// model counts for each pair exactly the requests sent, the prompt, completion and cached tokens
// the provider reported for them, and what those cost at the policy's prices; the refusal of
// globex's second request counts as a rate_limit refusal of globex on its model; by tenant, the
// pairs add up; the tenant metrics name acme alone.
func TestUsageByTenantAndModelIsWhatWasSent(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, usageReportPolicy), Mock: mock.Options{TimeScale: 0.001}})
	ctx := context.Background()
	want := map[[2]string]*pairUsage{}
	var requests, refused uint64
	send := func(tenant, model string, stream bool, cached int) {
		t.Helper()
		r, err := s.Do(ctx, usageRequest(tenant, model, stream, cached))
		if err != nil {
			t.Fatal(err)
		}
		k := [2]string{tenant, model}
		if want[k] == nil {
			want[k] = &pairUsage{}
		}
		if r.Status == 429 && r.Headers.Get("x-bulkhead-reason") == "rate_limit" {
			want[k].Refused++
			refused++
			return
		}
		if r.Status != 200 {
			t.Fatalf("%s on %s: %d %s", tenant, model, r.Status, r.Body)
		}
		prompt, err1 := strconv.ParseUint(r.Headers.Get(mock.HeaderPromptTokens), 10, 64)
		completion, err2 := strconv.ParseUint(r.Headers.Get(mock.HeaderCompletionTokens), 10, 64)
		if err1 != nil || err2 != nil || prompt == 0 || completion == 0 {
			t.Fatalf("the mock did not say what it reported: %v", r.Headers)
		}
		want[k].Requests++
		want[k].Prompt += prompt
		want[k].Completion += completion
		want[k].Cached += uint64(min(cached, int(prompt)))
		requests++
	}
	for i := range 3 {
		send("acme", "gpt-4o", i == 1, 4)
	}
	send("acme", "gpt-4o-mini", false, 0)
	send("acme", "gpt-4o-mini", true, 0)
	send("initech", "gpt-4o", false, 6)
	send("initech", "claude-3-5-haiku", true, 0)
	send("globex", "gpt-4o-mini", false, 0)
	send("globex", "gpt-4o-mini", false, 0) // its rate is one a minute
	if refused != 1 {
		t.Fatalf("globex's second request was not refused by its rate (%d refusals)", refused)
	}

	rep := waitUsage(t, s, "by=tenant,model&window=1h", requests, refused)
	if rep.Scope != "process" || len(rep.Rows) != len(want) {
		t.Fatalf("%d rows for %d pairs: %+v", len(rep.Rows), len(want), rep.Rows)
	}
	var total pairUsage
	for _, row := range rep.Rows {
		w := want[[2]string{row.Tenant, row.Model}]
		if w == nil {
			t.Errorf("a row for %s on %s, which sent nothing", row.Tenant, row.Model)
			continue
		}
		got := pairUsage{Requests: row.Requests, Prompt: row.PromptTokens, Completion: row.CompletionTokens, Cached: row.CachedTokens, Refused: row.Refused}
		if got != *w || row.Overcount != 0 || row.Refusals["rate_limit"] != w.Refused {
			t.Errorf("%s on %s: %+v, sent %+v", row.Tenant, row.Model, row, *w)
		}
		if cost := float64(w.Prompt+2*w.Completion) / 1e6; row.Spend < cost-1e-9 || row.Spend > cost+1e-9 {
			t.Errorf("%s on %s cost %v, want %v", row.Tenant, row.Model, row.Spend, cost)
		}
		total.Prompt += w.Prompt
	}
	if rep.Totals.PromptTokens != total.Prompt {
		t.Errorf("total prompt %d, sent %d", rep.Totals.PromptTokens, total.Prompt)
	}

	byTenant := waitUsage(t, s, "by=tenant&window=24h&top=2", requests, refused)
	acme := pairUsage{}
	for k, w := range want {
		if k[0] == "acme" {
			acme.Requests += w.Requests
			acme.Prompt += w.Prompt
			acme.Completion += w.Completion
			acme.Cached += w.Cached
		}
	}
	if len(byTenant.Rows) != 3 || byTenant.Rows[0].Tenant != "acme" || byTenant.Rows[0].Requests != acme.Requests ||
		byTenant.Rows[0].PromptTokens != acme.Prompt || !byTenant.Rows[2].Other || byTenant.Rows[2].Tenant != "_other" {
		t.Errorf("by tenant, top 2: %+v, acme sent %+v", byTenant.Rows, acme)
	}

	metrics, err := s.Scrape()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{
		fmt.Sprintf(`llm_bulkhead_tenant_requests_total{tenant="acme"} %d`, acme.Requests),
		fmt.Sprintf(`llm_bulkhead_tenant_tokens_total{kind="prompt",tenant="acme"} %d`, acme.Prompt),
		fmt.Sprintf(`llm_bulkhead_tenant_tokens_total{kind="cached",tenant="acme"} %d`, acme.Cached),
	} {
		if !strings.Contains(metrics, line) {
			t.Errorf("/metrics lacks %s", line)
		}
	}
	if strings.Contains(metrics, `tenant="initech"`) || strings.Contains(metrics, `tenant="globex"`) {
		t.Error("a tenant usage.tenant_metrics does not name has series")
	}
}

// TestUsageNamesTenantsNeverKeys: with API-key tenants, /admin/usage (JSON and CSV) and the
// metrics name the tenant a key belongs to and never the key, nor its hash.
func TestUsageNamesTenantsNeverKeys(t *testing.T) {
	const key = "sk-live-usage-5b0c7f1e9d2a4c6e8f0a1b3c5d7e9f11"
	sum := sha256.Sum256([]byte(key))
	hash := hex.EncodeToString(sum[:])
	yaml := fmt.Sprintf(`
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  tenant:
    rules: [{api_key: true, trusted: true}]
  model:
    rules: [{body: model}]
tenants:
  unknown_key: reject
  directory:
    - {id: acme, tier: free, key_sha256: [%s]}
tiers: {free: {}}
features:
  default: {max_concurrent: 100}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
usage: {tenant_metrics: [acme]}
`, hash)
	s := start(t, harness.Options{PolicyPath: writePolicy(t, yaml), Mock: mock.Options{TimeScale: 0.001}})
	req := usageRequest("", "gpt-4o", false, 0)
	req.Headers = append(req.Headers, envoysim.Header{Key: "authorization", Value: "Bearer " + key})
	if r, err := s.Do(context.Background(), req); err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	bad := usageRequest("", "gpt-4o", false, 0)
	bad.Headers = append(bad.Headers, envoysim.Header{Key: "authorization", Value: "Bearer " + key + "x"})
	if r, err := s.Do(context.Background(), bad); err != nil || r.Status != 401 {
		t.Fatalf("an unknown key: %v %v", r, err)
	}
	rep := waitUsage(t, s, "by=tenant,model&window=1h", 1, 1)
	if len(rep.Rows) != 2 || rep.Rows[0].Tenant != "acme" {
		t.Fatalf("rows %+v", rep.Rows)
	}
	for _, path := range []string{"/admin/usage?by=tenant,model&window=1h", "/admin/usage?by=tenant&format=csv", "/admin/usage?by=model&window=month&format=csv", "/metrics"} {
		resp, err := http.Get(s.AdminURL() + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, secret := range []string{key, key[:16], hash, hash[:16]} {
			if strings.Contains(string(body), secret) {
				t.Errorf("%s shows %q", path, secret)
			}
		}
		if path != "/admin/usage?by=model&window=month&format=csv" && !strings.Contains(string(body), "acme") {
			t.Errorf("%s does not name acme:\n%s", path, body)
		}
	}
}
