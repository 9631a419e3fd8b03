package integration_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
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
	for _, dir := range []string{"../policy", "../policy/observe", "../policy/cluster", "../policy/spend", "../policy/statefile", "../extproc", "../cmd/llm-bulkhead/app"} {
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
	body := lintedScrape(t, s, promtool)
	for _, want := range []string{`llm_bulkhead_admitted_total{feature="chat"} 3`, `llm_bulkhead_pool_capacity{pool="interactive_and_batch"} 25`,
		`llm_bulkhead_breaker_state{breaker="deepseek",state="CLOSED"} 1`, `llm_bulkhead_compartment_max_concurrent{compartment="feature/batch_summarize",family="feature"} 10`} {
		if !strings.Contains(body, want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
}

// lintedScrape returns the server's /metrics, which promtool's lint must pass.
func lintedScrape(t *testing.T, s *harness.Stack, promtool string) string {
	t.Helper()
	body, err := s.Scrape()
	if err != nil {
		t.Fatal(err)
	}
	if out := run(t, []byte(body), promtool, "check", "metrics"); strings.TrimSpace(out) != "" {
		t.Errorf("promtool check metrics:\n%s", out)
	}
	return body
}

// TestClusterMetricsExposed: a replica sharing its limits through Redis, with either admission,
// exposes every cluster metric docs/metrics.md lists (once Redis went away, so that the error and
// unavailable series exist too), and the scrape passes promtool's lint.
func TestClusterMetricsExposed(t *testing.T) {
	promtool := tool(t, "promtool")
	doc, err := os.ReadFile("../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{"exact", "leased"} {
		t.Run(mode, func(t *testing.T) {
			rd := redistest.Standalone(t)
			s := start(t, harness.Options{PolicyPath: dashboardClusterPolicy(t, rd.Addr(), "metrics-"+mode, mode), Mock: mock.Options{TimeScale: 0.001}})
			if r, err := s.Do(context.Background(), chatRequest("chat")); err != nil || r.Status != 200 {
				t.Fatalf("%v %v", r, err)
			}
			rd.Kill()
			e := s.App.Engine()
			waitFor(t, func() bool { return !e.Cluster().Available() })
			// Exact admission decides on the replica's part (on_unavailable local); leased
			// admission against the lease it holds.
			if r, err := s.Do(context.Background(), chatRequest("chat")); err != nil || r.Status != 200 {
				t.Fatalf("with Redis gone: %v %v", r, err)
			}
			body := lintedScrape(t, s, promtool)
			n := 0
			for _, m := range docName.FindAllStringSubmatch(string(doc), -1) {
				if !strings.HasPrefix(m[1], "llm_bulkhead_cluster_") {
					continue
				}
				n++
				if !regexp.MustCompile(`(?m)^# TYPE ` + m[1] + ` `).MatchString(body) {
					t.Errorf("%s is documented but a replica in cluster mode does not expose it", m[1])
				}
			}
			if n < 10 {
				t.Errorf("docs/metrics.md lists %d cluster metrics, want every one of them", n)
			}
			want := []string{`llm_bulkhead_cluster_available 0`}
			if mode == "exact" {
				want = append(want, `llm_bulkhead_cluster_unavailable_admissions_total{action="local"} 1`)
			}
			for _, w := range want {
				if !strings.Contains(body, w) {
					t.Errorf("scrape lacks %s", w)
				}
			}
		})
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
			Type    string `json:"type"`
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
		if p.Type == "row" {
			// A row only heads the panels below it.
			if len(p.Targets) != 0 {
				t.Errorf("row %q has queries", p.Title)
			}
			continue
		}
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
