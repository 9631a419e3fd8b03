package app_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
)

const spendAppPolicy = `
currency: EUR
time_zone: Europe/Berlin
prices:
  - {match: default, input_per_mtok: 1, output_per_mtok: 2}
features:
  default: {max_concurrent: 10, spend_per_month: 250.5, spend_per_hour: 0.25}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`

// TestAdminSpend: GET /admin/spend lists every spend budget's current window with exact
// amounts, and like every /admin read it needs the token on an exposed listener.
func TestAdminSpend(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte(spendAppPolicy), 0o644); err != nil {
		t.Fatal(err)
	}
	a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	defer a.Shutdown(context.Background())
	code, _, body := get(t, "http://"+a.AdminAddr()+"/admin/spend", "")
	if code != http.StatusOK {
		t.Fatalf("GET /admin/spend: %d %s", code, body)
	}
	var out struct {
		Currency string `json:"currency"`
		TimeZone string `json:"time_zone"`
		Budgets  []struct {
			Budget, Period, WindowStart, WindowEnd string
			Limit, Spent, Reserved, Remaining      json.Number
		} `json:"budgets"`
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&out); err != nil {
		t.Fatal(err)
	}
	if out.Currency != "EUR" || out.TimeZone != "Europe/Berlin" || len(out.Budgets) != 2 {
		t.Fatalf("%s", body)
	}
	for _, want := range []string{`"budget": "feature/default"`, `"period": "month"`, `"limit": 250.50`, `"remaining": 0.25`, `"spent": 0.00`} {
		if !strings.Contains(string(body), want) {
			t.Errorf("body lacks %s:\n%s", want, body)
		}
	}

	_, base := startExposed(t, app.Options{ConfigPath: path, Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"}, LogOutput: io.Discard})
	if code, _, _ := get(t, base+"/admin/spend", ""); code != http.StatusUnauthorized {
		t.Errorf("GET /admin/spend without the token on an exposed listener: %d", code)
	}
	if code, _, _ := get(t, base+"/admin/spend", "s3cret"); code != http.StatusOK {
		t.Errorf("GET /admin/spend with the token: %d", code)
	}
}

// TestExplainSpend: validate --explain shows the currency, zone, prices and the spend budgets of
// the example policy's tenants.
func TestExplainSpend(t *testing.T) {
	p, _, err := app.LoadPolicy("", nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := app.Summarize(p)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	s.Explain(&b)
	if !strings.Contains(b.String(), "Spend (USD, calendar windows in UTC") {
		t.Errorf("explain has no spend section:\n%s", b.String())
	}
	// Rows, whatever the width of the table's columns (the longest glob sets it).
	rows := map[string]bool{}
	for _, line := range strings.Split(b.String(), "\n") {
		rows[strings.Join(strings.Fields(line), " ")] = true
	}
	for _, want := range []string{
		"deepseek-* 0.27 0.07 1.10 1.10",
		"gemini-* 0.30 0.075 2.50 2.50",
		"*anthropic.claude-* 3.00 0.30 15.00 15.00",
		"default 2.50 2.50 10.00 10.00",
		"tenant/<tenant> tenant globex: spend_per_month 500.00",
		"tenant/<tenant> tenant initech: spend_per_day 1.00",
	} {
		if !rows[want] {
			t.Errorf("explain lacks the row %q:\n%s", want, b.String())
		}
	}
}
