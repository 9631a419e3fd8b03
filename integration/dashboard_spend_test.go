package integration_test

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// TestDashboardSpend: the dashboard's spend panel shows each budget's window: what was settled,
// what requests in flight reserved (striped), the limit, the share used (orange from 80 %) and
// when it resets; it is hidden for a policy without spend budgets, and fits a phone's width.
func TestDashboardSpend(t *testing.T) {
	if now := time.Now().UTC(); now.Add(2*time.Minute).Day() != now.Day() {
		t.Skip("too close to midnight UTC: chat's daily spend budget would reset during the test")
	}
	chromium := findChromium(t)
	s := start(t, harness.Options{PolicyPath: writePolicy(t, spendClusterPolicy), Mock: mock.Options{TimeScale: 0.001}})
	ctx := context.Background()
	// Five requests settled at $0.15: $0.75.
	for range 5 {
		if r, err := s.Do(ctx, pricedChat()); err != nil || r.Status != 200 {
			t.Fatalf("%v %v", r, err)
		}
	}
	// And one held in flight, its worst case reserved.
	g := newGate()
	done := make(chan struct{})
	go func() {
		_, _ = s.Sim.RoundTrip(ctx, pricedChat(), g)
		close(done)
	}()
	<-g.arrived
	defer func() {
		g.release <- struct{}{}
		<-done
	}()
	var view struct {
		Budgets []struct {
			Budget, Period string
			Reserved       float64
		}
	}
	if err := s.Get("/admin/spend", &view); err != nil {
		t.Fatal(err)
	}
	if len(view.Budgets) != 1 || view.Budgets[0].Reserved <= 0 {
		t.Fatalf("/admin/spend: %+v", view)
	}
	reserved := view.Budgets[0].Reserved
	used := 0.75 + reserved
	wantNums := fmt.Sprintf("$%.2f / $1.00", used)

	html := renderDashboard(t, chromium, s.AdminURL()+"/")
	row := regexp.MustCompile(`<div class="row" data-spend="feature/chat\|day">.*?</div></div></div>`).FindString(html)
	if row == "" {
		t.Fatalf("no spend row for feature/chat's daily budget in:\n%s", html)
	}
	for _, want := range []string{wantNums, fmt.Sprintf("%d %%", int(100*used+0.5)), "per day · resets", `class="high"`, `class="high reserved"`,
		"$0.75 settled"} {
		if !strings.Contains(row, want) {
			t.Errorf("spend row lacks %q:\n%s", want, row)
		}
	}
	if strings.Contains(html, `id="spend-section" hidden`) {
		t.Error("the spend panel is hidden with a spend budget in the policy")
	}

	// On a phone the panel fits.
	b := onPhone(t, s.AdminURL()+"/", "the spend row",
		`document.querySelector('[data-spend="feature/chat|day"] .held')?.textContent === `+jsString(wantNums), "dashboard-spend-390.png")
	var filled struct{ Settled, Reserved float64 }
	b.eval(`(() => { const bar = document.querySelector('[data-spend="feature/chat|day"] [data-bar="spend"]'), w = bar.getBoundingClientRect().width;
	  const [s, r] = bar.querySelectorAll("i"); return {settled: s.getBoundingClientRect().width / w, reserved: r.getBoundingClientRect().width / w}; })()`, &filled)
	if filled.Settled < 0.74 || filled.Settled > 0.76 || filled.Reserved < reserved-0.01 || filled.Reserved > reserved+0.01 {
		t.Errorf("bar: settled %.3f, reserved %.3f of its width; want 0.75 and %.3f", filled.Settled, filled.Reserved, reserved)
	}
}

// TestDashboardSpendHiddenWithoutBudgets: a policy without spend budgets shows no spend panel.
func TestDashboardSpendHiddenWithoutBudgets(t *testing.T) {
	chromium := findChromium(t)
	s := start(t, harness.Options{PolicyPath: writePolicy(t, paidBatchPolicy), Mock: mock.Options{TimeScale: 0.001}})
	html := renderDashboard(t, chromium, s.AdminURL()+"/")
	if !strings.Contains(html, `id="spend-section" hidden`) || strings.Contains(html, "data-spend=") {
		t.Errorf("spend panel drawn for a policy without spend budgets:\n%s", html)
	}
}
