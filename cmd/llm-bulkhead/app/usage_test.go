package app_test

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// usageAppPolicy prices gpt-x in euros, lets each tenant send three requests a minute, and names
// acme for metrics of its own.
const usageAppPolicy = `
currency: EUR
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  model:
    rules: [{header: x-model}]
prices:
  - {match: "gpt-x", input_per_mtok: 2.00, output_per_mtok: 10.00}
  - {match: default, input_per_mtok: 1.00, output_per_mtok: 1.00}
tiers:
  free: {requests_per_minute: 3}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant}
usage: {table_size: 10, tenant_metrics: [acme]}
`

// fixedClock is a clock that says what it is told.
type fixedClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fixedClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// startUsageApp starts the server on yaml at 2026-06-10 10:00 UTC and sends, through its engine,
// three requests of acme to gpt-x (1000 prompt, 100 completion tokens each), a fourth that its
// rate refuses, and one of initech to a model whose name a spreadsheet would take for a formula.
func startUsageApp(t *testing.T, yaml string) (*app.App, string) {
	t.Helper()
	a := runUsageApp(t, yaml, t.TempDir())
	e := a.Engine()
	send := func(tenant, model string) policy.Decision {
		s := e.Snapshot()
		r := policy.Request{Dims: s.Classify(headerInput{"x-tenant-id": tenant, "x-model": model}), Estimate: policy.Estimate{Prompt: 1000, Output: 100, Total: 1100}}
		tk := &policy.Ticket{}
		d := e.Admit(context.Background(), s, &r, tk, nil)
		if d.Verdict == policy.Admit {
			tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 1000, Completion: 100, Total: 1100, Known: true}})
		}
		return d
	}
	for range 3 {
		if d := send("acme", "gpt-x"); d.Verdict != policy.Admit {
			t.Fatal(d)
		}
	}
	if d := send("acme", "gpt-x"); d.Reason != policy.ReasonRateLimit {
		t.Fatalf("fourth request: %+v", d)
	}
	if d := send("initech", "=HYPERLINK(\"x\")"); d.Verdict != policy.Admit {
		t.Fatal(d)
	}
	return a, "http://" + a.AdminAddr()
}

// runUsageApp starts the server on yaml, written in dir, at 2026-06-10 10:00 UTC.
func runUsageApp(t *testing.T, yaml, dir string) *app.App {
	t.Helper()
	path := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	clk := &fixedClock{now: time.Date(2026, 6, 10, 10, 0, 0, 0, time.UTC)}
	a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: io.Discard, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Shutdown(context.Background()) })
	return a
}

// TestAdminUsage: GET /admin/usage reports the top groups of a window with their tokens,
// requests, refusals by reason and spend in the policy's currency, the rest as _other, and the
// window's totals; by tenant, a row names no model.
func TestAdminUsage(t *testing.T) {
	_, base := startUsageApp(t, usageAppPolicy)
	code, _, body := get(t, base+"/admin/usage?by=tenant,model&window=1h", "")
	if code != http.StatusOK {
		t.Fatalf("%d %s", code, body)
	}
	var out struct {
		By, Window, From, To, Scope, Currency string
		TableSize                             int    `json:"table_size"`
		MaxOvercount                          uint64 `json:"max_overcount"`
		Totals                                struct {
			Requests, Tokens, Refused uint64
			Spend                     json.Number
		}
		Rows []map[string]any
	}
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.UseNumber()
	if err := dec.Decode(&out); err != nil {
		t.Fatal(err)
	}
	if out.By != "tenant,model" || out.Window != "1h" || out.From != "2026-06-10T09:00:00Z" || out.To != "2026-06-10T10:00:00Z" ||
		out.Scope != "process" || out.Currency != "EUR" || out.TableSize != 10 || out.MaxOvercount != 0 || len(out.Rows) != 2 {
		t.Fatalf("%s", body)
	}
	// 3 × (1000 × 2.00 + 100 × 10.00) = 9000 millionths; initech's 1100 tokens at 1.00.
	if out.Totals.Requests != 4 || out.Totals.Tokens != 4400 || out.Totals.Refused != 1 || out.Totals.Spend != "0.0101" {
		t.Fatalf("totals %+v", out.Totals)
	}
	acme := out.Rows[0]
	for k, want := range map[string]any{"tenant": "acme", "model": "gpt-x", "requests": json.Number("3"), "prompt_tokens": json.Number("3000"),
		"completion_tokens": json.Number("300"), "cached_tokens": json.Number("0"), "tokens": json.Number("3300"), "spend": json.Number("0.009"),
		"refused": json.Number("1"), "overcount": json.Number("0")} {
		if acme[k] != want {
			t.Errorf("acme's %s = %v, want %v", k, acme[k], want)
		}
	}
	if r, _ := acme["refusals"].(map[string]any); len(r) != 1 || r["rate_limit"] != json.Number("1") {
		t.Errorf("acme's refusals %v", acme["refusals"])
	}

	// Top 1: the rest is _other.
	_, _, body = get(t, base+"/admin/usage?by=tenant&window=24h&top=1", "")
	var top struct{ Rows []map[string]any }
	if err := json.Unmarshal(body, &top); err != nil {
		t.Fatal(err)
	}
	if len(top.Rows) != 2 || top.Rows[0]["tenant"] != "acme" || top.Rows[1]["tenant"] != "_other" || top.Rows[1]["other"] != true ||
		top.Rows[1]["groups"] != 1.0 || top.Rows[1]["requests"] != 1.0 {
		t.Fatalf("top 1: %s", body)
	}
	for _, row := range top.Rows {
		if _, ok := row["model"]; ok {
			t.Fatalf("a row by tenant names a model: %s", body)
		}
	}
	_, _, body = get(t, base+"/admin/usage?by=model&window=month", "")
	if !strings.Contains(string(body), `"model": "gpt-x"`) || strings.Contains(string(body), `"tenant"`) {
		t.Fatalf("by model: %s", body)
	}
}

// TestAdminUsageCSV: format=csv gives a header of the grouping's names and every count, a line
// per row and _other; a name a spreadsheet would read as a formula is quoted.
func TestAdminUsageCSV(t *testing.T) {
	_, base := startUsageApp(t, usageAppPolicy)
	resp, err := http.Get(base + "/admin/usage?by=tenant,model&window=7d&format=csv")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/csv; charset=utf-8" ||
		resp.Header.Get("Content-Disposition") != `attachment; filename="usage-7d-by-tenant-model.csv"` {
		t.Fatalf("%d %v", resp.StatusCode, resp.Header)
	}
	recs, err := csv.NewReader(resp.Body).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	head := strings.Join(recs[0], ",")
	if !strings.HasPrefix(head, "tenant,model,requests,prompt_tokens,completion_tokens,cached_tokens,tokens,spend,refused,refused_token_budget,refused_rate_limit,") ||
		!strings.HasSuffix(head, ",overcount") {
		t.Fatalf("header %s", head)
	}
	col := map[string]int{}
	for i, name := range recs[0] {
		col[name] = i
	}
	if len(recs) != 3 {
		t.Fatalf("%d lines: %v", len(recs), recs)
	}
	acme, initech := recs[1], recs[2]
	if acme[0] != "acme" || acme[1] != "gpt-x" || acme[col["requests"]] != "3" || acme[col["tokens"]] != "3300" || acme[col["spend"]] != "0.009" ||
		acme[col["refused_rate_limit"]] != "1" || acme[col["refused"]] != "1" || acme[col["overcount"]] != "0" {
		t.Errorf("acme: %v", acme)
	}
	if initech[1] != `'=hyperlink("x")` { // models are lower-cased
		t.Errorf("a formula-looking model written as %q", initech[1])
	}
	_, _, body := get(t, base+"/admin/usage?by=tenant&window=7d&top=1&format=csv", "")
	lines := strings.Split(strings.TrimSpace(string(body)), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "tenant,requests,") || !strings.HasPrefix(lines[2], "_other,1,1000,100,0,1100,0.0011,0,") {
		t.Fatalf("by tenant, top 1:\n%s", body)
	}
}

// TestAdminUsageRefusesBadParameters: a parameter the endpoint does not know, or a value it
// cannot use, is answered 400 with what is allowed.
func TestAdminUsageRefusesBadParameters(t *testing.T) {
	_, base := startUsageApp(t, usageAppPolicy)
	for query, want := range map[string]string{
		"by=feature":           `by=\"feature\": group by tenant, model or tenant,model`,
		"window=30d":           `window=\"30d\": the windows are 1h, 24h, 7d and month`,
		"top=0":                `top=\"0\": give a whole number from 1 to 1000`,
		"top=5000":             `top=\"5000\"`,
		"format=xlsx":          `format=\"xlsx\": the formats are json and csv`,
		"tenant=acme":          `unknown parameter \"tenant\": the parameters are by, window, top, format and scope`,
		"window=1h&window=24h": "parameter window is given 2 times",
		"scope=fleet":          "scope=fleet applies in cluster mode",
		"scope=replica":        "scope=replica applies in cluster mode",
	} {
		code, _, body := get(t, base+"/admin/usage?"+query, "")
		if code != http.StatusBadRequest || !strings.Contains(string(body), want) {
			t.Errorf("%s: %d %s, want 400 saying %s", query, code, body, want)
		}
	}
}

// TestAdminUsageOffAndGuarded: with usage.enabled false the endpoint answers 404 saying so; on
// an exposed listener it needs the admin token like every /admin read.
func TestAdminUsageOffAndGuarded(t *testing.T) {
	_, base := startUsageApp(t, strings.Replace(usageAppPolicy, "usage: {table_size: 10, tenant_metrics: [acme]}", "usage: {enabled: false}", 1))
	if code, _, body := get(t, base+"/admin/usage", ""); code != http.StatusNotFound || !strings.Contains(string(body), "usage.enabled: false") {
		t.Fatalf("%d %s", code, body)
	}
	_, exposed := startExposed(t, app.Options{Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"}, LogOutput: io.Discard})
	if code, _, _ := get(t, exposed+"/admin/usage", ""); code != http.StatusUnauthorized {
		t.Errorf("without the token on an exposed listener: %d", code)
	}
	if code, _, _ := get(t, exposed+"/admin/usage", "s3cret"); code != http.StatusOK {
		t.Errorf("with the token: %d", code)
	}
}

// TestUsageMetrics: the tenants usage.tenant_metrics names have series of their own and no
// other tenant does; the tables' rows, count and evictions are reported by grouping.
func TestUsageMetrics(t *testing.T) {
	_, base := startUsageApp(t, usageAppPolicy)
	_, _, body := get(t, base+"/metrics", "")
	text := string(body)
	for _, want := range []string{
		`llm_bulkhead_tenant_requests_total{tenant="acme"} 3`,
		`llm_bulkhead_tenant_refusals_total{reason="rate_limit",tenant="acme"} 1`,
		`llm_bulkhead_tenant_tokens_total{kind="prompt",tenant="acme"} 3000`,
		`llm_bulkhead_tenant_tokens_total{kind="completion",tenant="acme"} 300`,
		`llm_bulkhead_tenant_spend_total{tenant="acme"} 0.009`,
		`llm_bulkhead_usage_table_rows{by="tenant_model"} 2`,
		`llm_bulkhead_usage_tables{by="tenant"} 1`,
		`llm_bulkhead_usage_evictions_total{by="model"} 0`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if strings.Contains(text, "initech") {
		t.Error("a tenant usage.tenant_metrics does not name has a series")
	}
}

// TestUsageSurvivesARestartThroughTheStateFile: a server stopped and started again on the same
// state file reports the usage it reported before it stopped.
func TestUsageSurvivesARestartThroughTheStateFile(t *testing.T) {
	dir := t.TempDir()
	yaml := usageAppPolicy + "state: {file: " + filepath.Join(dir, "state.json") + "}\n"
	a, base := startUsageApp(t, yaml)
	_, _, before := get(t, base+"/admin/usage?by=tenant,model&window=24h", "")
	a.Shutdown(context.Background())

	b := runUsageApp(t, yaml, t.TempDir())
	_, _, after := get(t, "http://"+b.AdminAddr()+"/admin/usage?by=tenant,model&window=24h", "")
	if string(after) != string(before) || !strings.Contains(string(after), `"tenant": "acme"`) {
		t.Fatalf("after the restart:\n%s\nbefore:\n%s", after, before)
	}
}
