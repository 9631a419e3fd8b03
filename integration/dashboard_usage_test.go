package integration_test

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// TestDashboardUsage: the dashboard lists the top tenants and models of the window chosen (24
// hours first) with their requests, tokens, spend and refusals, the heaviest first; choosing
// another window redraws them; the panel fits a phone's width.
func TestDashboardUsage(t *testing.T) {
	chromium := findChromium(t)
	s := start(t, harness.Options{PolicyPath: writePolicy(t, usageReportPolicy), Mock: mock.Options{TimeScale: 0.001}})
	ctx := context.Background()
	for _, r := range []struct {
		tenant, model string
		n             int
	}{{"acme", "gpt-4o", 3}, {"initech", "gpt-4o-mini", 1}, {"globex", "gpt-4o-mini", 2}} {
		for range r.n {
			if _, err := s.Do(ctx, usageRequest(r.tenant, r.model, false, 0)); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitUsage(t, s, "by=tenant", 5, 1)

	html := renderDashboard(t, chromium, s.AdminURL()+"/")
	tenants := regexp.MustCompile(`<tr class="" data-usage-tenant="([^"]*)"`).FindAllStringSubmatch(html, -1)
	var names []string
	for _, m := range tenants {
		names = append(names, m[1])
	}
	if strings.Join(names, ",") != "acme,globex,initech" {
		t.Fatalf("tenants drawn %v, want acme, globex, initech (heaviest first):\n%s", names, html)
	}
	acme := regexp.MustCompile(`data-usage-tenant="acme".*?</tr>`).FindString(html)
	for _, want := range []string{`>3</td>`, `$0.00`, `>0</td>`} {
		if !strings.Contains(acme, want) {
			t.Errorf("acme's row lacks %q: %s", want, acme)
		}
	}
	globex := regexp.MustCompile(`data-usage-tenant="globex".*?</tr>`).FindString(html)
	if !strings.Contains(globex, `title="rate_limit 1">1</td>`) {
		t.Errorf("globex's refusal not shown: %s", globex)
	}
	for _, want := range []string{`data-usage-model="gpt-4o"`, `data-usage-model="gpt-4o-mini"`} {
		if !strings.Contains(html, want) {
			t.Errorf("the models table lacks %s", want)
		}
	}
	if strings.Contains(html, `id="usage-section" hidden`) {
		t.Error("the usage panel is hidden")
	}

	// On a phone, the panel fits; another window redraws it.
	b := onPhone(t, s.AdminURL()+"/", "the usage rows", `document.querySelectorAll("[data-usage-tenant]").length === 3`, "dashboard-usage-390.png")
	// A request of a fourth tenant: the hour shows it once the page asks for the hour.
	if _, err := s.Do(ctx, usageRequest("umbrella", "gpt-4o", false, 0)); err != nil {
		t.Fatal(err)
	}
	waitUsage(t, s, "by=tenant&window=1h", 6, 1)
	b.eval(`(() => { const w = document.getElementById("usage-window"); w.value = "1h"; w.dispatchEvent(new Event("change")); return true; })()`, nil)
	b.waitUntil(15*time.Second, "the hour's usage", `document.querySelector('[data-usage-tenant="umbrella"]') !== null`)
	var window string
	b.eval(`document.getElementById("usage-window").value`, &window)
	if window != "1h" {
		t.Errorf("window %q", window)
	}
}

// TestDashboardUsageHiddenWhenOff: a policy that does not count usage shows no usage panel.
func TestDashboardUsageHiddenWhenOff(t *testing.T) {
	chromium := findChromium(t)
	s := start(t, harness.Options{PolicyPath: writePolicy(t, strings.Replace(usageReportPolicy, "usage: {tenant_metrics: [acme]}", "usage: {enabled: false}", 1)),
		Mock: mock.Options{TimeScale: 0.001}})
	html := renderDashboard(t, chromium, s.AdminURL()+"/")
	if !strings.Contains(html, `id="usage-section" hidden`) || strings.Contains(html, "data-usage-tenant=") {
		t.Errorf("usage panel drawn without usage:\n%s", html)
	}
}
