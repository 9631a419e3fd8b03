package integration_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// tool finds an external program the test needs. Locally a missing tool skips the test; CI sets
// LLM_BULKHEAD_REQUIRE_TOOLS=1 (after installing them) so a missing tool fails instead.
func tool(t *testing.T, name string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("LLM_BULKHEAD_REQUIRE_TOOLS") == "1" {
			t.Fatalf("%s is required (LLM_BULKHEAD_REQUIRE_TOOLS=1) but not installed", name)
		}
		t.Skipf("%s not installed", name)
	}
	return path
}

func run(t *testing.T, stdin []byte, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Stdin = bytes.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestAlertRules checks the shipped Prometheus rules with Prometheus's own tool and runs their
// unit tests.
func TestAlertRules(t *testing.T) {
	promtool := tool(t, "promtool")
	run(t, nil, promtool, "check", "rules", "../examples/alerts.yaml")
	out := run(t, nil, promtool, "test", "rules", "../examples/alerts_test.yaml")
	if !strings.Contains(out, "SUCCESS") {
		t.Fatalf("promtool test rules:\n%s", out)
	}
}

var (
	optsName = regexp.MustCompile(`Name:\s*"([a-z0-9_]+)"`)
	descName = regexp.MustCompile(`Namespace\+"_([a-z0-9_]+)"`)
	docName  = regexp.MustCompile("\\| `(llm_bulkhead_[a-z0-9_]+)`")
)

// definedMetrics reads every metric name defined in the server's source.
func definedMetrics(t *testing.T) []string {
	t.Helper()
	var files []string
	for _, dir := range []string{"../policy", "../extproc", "../cmd/llm-bulkhead/app"} {
		fs, _ := filepath.Glob(filepath.Join(dir, "*.go"))
		files = append(files, fs...)
	}
	seen := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src := string(b)
		if !strings.Contains(src, "prometheus.") {
			continue
		}
		for _, m := range optsName.FindAllStringSubmatch(src, -1) {
			seen["llm_bulkhead_"+m[1]] = true
		}
		for _, m := range descName.FindAllStringSubmatch(src, -1) {
			seen["llm_bulkhead_"+m[1]] = true
		}
	}
	var out []string
	for n := range seen {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// TestMetricsDocumented: every metric the server defines is in docs/metrics.md and every metric
// documented there exists; a real scrape passes promtool's lint.
func TestMetricsDocumented(t *testing.T) {
	doc, err := os.ReadFile("../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, m := range docName.FindAllStringSubmatch(string(doc), -1) {
		documented[m[1]] = true
	}
	defined := definedMetrics(t)
	if len(defined) < 30 {
		t.Fatalf("found only %d metric definitions; the source scan is broken", len(defined))
	}
	for _, n := range defined {
		if !documented[n] {
			t.Errorf("%s is exposed but not documented in docs/metrics.md", n)
		}
		delete(documented, n)
	}
	for n := range documented {
		t.Errorf("%s is documented but the server does not define it", n)
	}

	promtool := tool(t, "promtool")
	s := start(t, harness.Options{PolicyPath: "../examples/policy-pooled.yaml", Mock: mock.Options{TimeScale: 0.001}})
	for i := 0; i < 3; i++ {
		if _, err := s.Do(context.Background(), chatRequest("chat")); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := http.Get(s.AdminURL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if out := run(t, body, promtool, "check", "metrics"); strings.TrimSpace(out) != "" {
		t.Errorf("promtool check metrics:\n%s", out)
	}
	for _, want := range []string{`llm_bulkhead_admitted_total{feature="chat"} 3`, `llm_bulkhead_pool_capacity{pool="interactive_and_batch"} 25`,
		`llm_bulkhead_breaker_state{breaker="deepseek",state="CLOSED"} 1`, `llm_bulkhead_compartment_max_concurrent{compartment="feature/batch_summarize",family="feature"} 10`} {
		if !strings.Contains(string(body), want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
}

// TestDashboard renders the admin dashboard in headless Chromium and checks that its script
// drew the live state: compartments, breakers, features and the ready status.
func TestDashboard(t *testing.T) {
	chromium := ""
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			chromium = p
			break
		}
	}
	if chromium == "" {
		tool(t, "chromium")
	}
	s := start(t, harness.Options{Mock: mock.Options{TimeScale: 0.001}})
	// Some traffic, and one refusal, so the page has something to show.
	g := newGate()
	for i := 0; i < 3; i++ {
		go func() {
			req := batchRequest("acme", 100, 10)
			_, _ = s.Sim.RoundTrip(context.Background(), req, g)
		}()
	}
	for i := 0; i < 3; i++ {
		<-g.arrived
	}
	defer func() {
		for i := 0; i < 3; i++ {
			g.release <- struct{}{}
		}
	}()
	if r, err := s.Do(context.Background(), chatRequest("chat")); err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	forced := chatRequest("chat")
	forced.Headers = append(forced.Headers, envoysim.Header{Key: "x-llm-provider", Value: "qwen"})
	if err := s.App.Engine().ForceBreaker("qwen", "FORCED_OPEN"); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.Do(context.Background(), forced); r.Status != 503 {
		t.Fatalf("forced-open provider answered %d", r.Status)
	}

	dir := t.TempDir()
	args := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--user-data-dir=" + dir,
		"--virtual-time-budget=3000", "--dump-dom", s.AdminURL() + "/"}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, chromium, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	dom, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium: %v\n%s", err, stderr.String())
	}
	html := string(dom)
	for _, want := range []string{
		`data-compartment="feature/chat"`, `data-compartment="tier_feature/enterprise/batch_summarize"`,
		`data-compartment="provider/deepseek"`, `data-breaker="qwen"`, `class="state FORCED_OPEN"`,
		`data-feature="chat"`, `circuit_open 1`, `<b id="status" class="ok">ready</b>`,
	} {
		if !strings.Contains(html, want) {
			t.Errorf("rendered dashboard lacks %s", want)
		}
	}
	// The batch compartment shows its three requests in flight.
	if !regexp.MustCompile(`data-compartment="feature/batch_summarize".*?3 / 5`).MatchString(html) {
		t.Error("feature/batch_summarize does not show 3 / 5 in flight")
	}
	if t.Failed() {
		t.Logf("DOM:\n%s", html)
	}
}

// TestGrafanaDashboard: every query of the shipped Grafana dashboard is valid PromQL (checked by
// promtool as recording rules) and uses only documented metrics.
func TestGrafanaDashboard(t *testing.T) {
	data, err := os.ReadFile("../examples/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatal(err)
	}
	doc, _ := os.ReadFile("../docs/metrics.md")
	metricRef := regexp.MustCompile(`llm_bulkhead_[a-z0-9_]+`)
	var rules strings.Builder
	rules.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	n := 0
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			for _, m := range metricRef.FindAllString(tg.Expr, -1) {
				base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_sum"), "_count")
				if !strings.Contains(string(doc), "`"+base+"`") {
					t.Errorf("panel %q uses %s, which docs/metrics.md does not list", p.Title, m)
				}
			}
			n++
			fmt.Fprintf(&rules, "      - record: dashboard:query%d\n        expr: %q\n", n, tg.Expr)
		}
	}
	promtool := tool(t, "promtool")
	path := filepath.Join(t.TempDir(), "dashboard-rules.yaml")
	if err := os.WriteFile(path, []byte(rules.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, nil, promtool, "check", "rules", path)
}
