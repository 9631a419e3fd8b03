package fleet

import (
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Redis 7's INFO stats and commandstats, trimmed.
const infoText = "# Stats\r\ntotal_connections_received:4\r\ntotal_commands_processed:1234\r\n\r\n" +
	"# Commandstats\r\n" +
	"cmdstat_evalsha:calls=100,usec=16000,usec_per_call=160.00,rejected_calls=0,failed_calls=0\r\n" +
	"cmdstat_eval:calls=2,usec=500,usec_per_call=250.00,rejected_calls=0,failed_calls=0\r\n" +
	"cmdstat_hgetall:calls=700,usec=7000,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n" +
	"cmdstat_publish:calls=100,usec=900,usec_per_call=9.00,rejected_calls=0,failed_calls=0\r\n" +
	"cmdstat_subscribe:calls=1,usec=3,usec_per_call=3.00,rejected_calls=0,failed_calls=0\r\n" +
	"cmdstat_ping:calls=4,usec=4,usec_per_call=1.00,rejected_calls=0,failed_calls=0\r\n" +
	"cmdstat_info:calls=2,usec=90,usec_per_call=45.00,rejected_calls=0,failed_calls=0\r\n" +
	"cmdstat_config|resetstat:calls=1,usec=38,usec_per_call=38.00,rejected_calls=0,failed_calls=0\r\n"

func TestCommandsSplitRoundTripsFromScriptWork(t *testing.T) {
	c, err := ParseCommands(ParseInfo(infoText))
	if err != nil {
		t.Fatal(err)
	}
	if c.Processed != 1234 || c.Calls["config|resetstat"] != 1 {
		t.Fatalf("parsed %+v", c)
	}
	if got := c.Scripts(); got != 102 {
		t.Errorf("scripts = %d, want 102 (EVALSHA and EVAL)", got)
	}
	if got := c.ScriptUsec(); got != 16500 {
		t.Errorf("script time = %dµs, want 16500", got)
	}
	// Client commands: the scripts, SUBSCRIBE, PING and CONFIG; not INFO (the readings), not
	// HGETALL or PUBLISH (run inside the scripts).
	if got := c.ClientCommands(); got != 102+1+4+1 {
		t.Errorf("client commands = %d, want 108", got)
	}
	if got := c.InScripts(); got != 800 {
		t.Errorf("commands inside scripts = %d, want 800", got)
	}
	before, _ := ParseCommands(ParseInfo("total_commands_processed:1000\r\ncmdstat_evalsha:calls=40,usec=6000,usec_per_call=1\r\n"))
	d := c.Sub(before)
	if d.Processed != 234 || d.Calls["evalsha"] != 60 || d.Usec["evalsha"] != 10000 || d.Calls["hgetall"] != 700 {
		t.Errorf("difference %+v", d)
	}
	// Two servers' readings add up; a command whose count comes to 0 is left out.
	sum := d.Add(before)
	if sum.Processed != 1234 || sum.Calls["evalsha"] != 100 || sum.Usec["evalsha"] != 16000 || sum.Calls["hgetall"] != 700 {
		t.Errorf("sum %+v", sum)
	}
	if z := before.Sub(before); len(z.Calls) != 0 || len(z.Usec) != 0 || z.Processed != 0 {
		t.Errorf("a reading minus itself: %+v", z)
	}
	if _, err := ParseCommands(ParseInfo("# Stats\r\n")); err == nil {
		t.Error("INFO without total_commands_processed parsed")
	}
}

// Every command policy/cluster's scripts run counts as run inside a script, not as one a client
// sent: otherwise the commands per admission would count a script's work as round trips.
func TestScriptCommandsCoverTheScripts(t *testing.T) {
	files, err := filepath.Glob("../../../../policy/cluster/*.go")
	if err != nil {
		t.Fatal(err)
	}
	call := regexp.MustCompile(`redis\.p?call\('([A-Za-z]+)'`)
	seen := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range call.FindAllSubmatch(b, -1) {
			seen[strings.ToLower(string(m[1]))] = true
		}
	}
	if len(seen) < 10 {
		t.Fatalf("found only %v in policy/cluster's scripts: has the source moved?", seen)
	}
	for name := range seen {
		if !scriptCommands[name] {
			t.Errorf("the scripts run %s, which is not among scriptCommands", strings.ToUpper(name))
		}
	}
}

const metricsText = `# HELP llm_bulkhead_cluster_redis_seconds Round-trip time.
# TYPE llm_bulkhead_cluster_redis_seconds histogram
llm_bulkhead_cluster_redis_seconds_bucket{op="admit",le="0.0002"} 0
llm_bulkhead_cluster_redis_seconds_bucket{op="admit",le="0.0005"} 50
llm_bulkhead_cluster_redis_seconds_bucket{op="admit",le="0.001"} 90
llm_bulkhead_cluster_redis_seconds_bucket{op="admit",le="+Inf"} 100
llm_bulkhead_cluster_redis_seconds_sum{op="admit"} 0.07
llm_bulkhead_cluster_redis_seconds_count{op="admit"} 100
llm_bulkhead_cluster_redis_seconds_count{op="settle"} 7
llm_bulkhead_admitted_total{feature="chat"} 60
llm_bulkhead_admitted_total{feature="batch_summarize"} 40
llm_bulkhead_rejected_total{feature="chat",reason="a \"quoted\", reason"} 3
llm_bulkhead_cluster_leases 0
`

func TestMetricsSumsAndHistograms(t *testing.T) {
	m := ParseMetrics([]byte(metricsText))
	if got := m.Sum("llm_bulkhead_admitted_total"); got != 100 {
		t.Errorf("admitted over every feature = %v, want 100", got)
	}
	if got := m.Sum("llm_bulkhead_admitted_total", "feature", "chat"); got != 60 {
		t.Errorf("chat admitted = %v, want 60", got)
	}
	if got := m.Sum("llm_bulkhead_cluster_redis_seconds_count", "op", "settle"); got != 7 {
		t.Errorf("settle calls = %v, want 7", got)
	}
	if got := m.Sum("llm_bulkhead_rejected_total", "reason", `a "quoted", reason`); got != 3 {
		t.Errorf("a label with quotes and a comma: %v, want 3", got)
	}
	h := m.Histogram("llm_bulkhead_cluster_redis_seconds", "op", "admit")
	if h.Count() != 100 || len(h) != 4 || !math.IsInf(h[3].LE, 1) {
		t.Fatalf("histogram %+v", h)
	}
	// The median lies at the top of the 0.2–0.5 ms bucket; the 70th percentile halfway
	// through the next; the 99th in +Inf, reported as the highest finite bound.
	for _, c := range []struct{ q, want float64 }{{0.5, 0.0005}, {0.7, 0.00075}, {0.99, 0.001}} {
		if got := h.Quantile(c.q); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("q%v = %v, want %v", c.q, got, c.want)
		}
	}
	before := Buckets{{LE: 0.0002, Count: 0}, {LE: 0.0005, Count: 50}, {LE: 0.001, Count: 50}, {LE: math.Inf(1), Count: 50}}
	if d := h.Sub(before); d.Count() != 50 || math.Abs(d.Quantile(0.5)-0.0008125) > 1e-12 {
		t.Errorf("difference %+v, median %v", d, d.Quantile(0.5))
	}
	if !math.IsNaN(Buckets(nil).Quantile(0.5)) {
		t.Error("the quantile of nothing is a number")
	}
}

func TestClusterSectionIsReplacedAndRemoved(t *testing.T) {
	src, err := os.ReadFile("../../../../examples/policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	b, err := WithCluster("policy.yaml", src, Cluster{Addrs: []string{"127.0.0.1:6390"}, KeyPrefix: "demo-1", Timeout: 250e6})
	if err != nil {
		t.Fatal(err)
	}
	p, err := config.Load("shared.yaml", b, []string{})
	if err != nil {
		t.Fatal(err)
	}
	c := p.Cluster
	if !c.Enabled() || c.Addresses[0] != "127.0.0.1:6390" || c.KeyPrefix != "demo-1" || c.Timeout.D().String() != "250ms" {
		t.Errorf("cluster section %+v", c)
	}
	if len(p.Features) != 5 || !strings.Contains(string(b), "# The compartments every request passes through") {
		t.Error("the rest of the policy, comments included, was not kept")
	}
	// Writing it again replaces the section rather than adding a second one.
	b2, err := WithCluster("shared.yaml", b, Cluster{Addrs: []string{"127.0.0.1:6391", "127.0.0.1:6392", "127.0.0.1:6393"}, Mode: "cluster",
		Admission: "exact", LeaseInterval: 50e6, LeaseTTL: 2e9})
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b2), "\ncluster:"); n != 1 {
		t.Errorf("%d cluster sections", n)
	}
	p2, err := config.Load("shared.yaml", b2, []string{})
	if err != nil {
		t.Fatal(err)
	}
	if c := p2.Cluster; len(c.Addresses) != 3 || c.Mode != "cluster" || c.Admission != "exact" || c.LeaseInterval.D().String() != "50ms" ||
		c.LeaseTTL.D().String() != "2s" || c.KeyPrefix != "llm-bulkhead" {
		t.Errorf("second cluster section %+v", c)
	}
	b3, err := WithoutCluster("shared.yaml", b2)
	if err != nil {
		t.Fatal(err)
	}
	if p, err := config.Load("local.yaml", b3, []string{}); err != nil || p.Cluster.Enabled() {
		t.Errorf("without the section: cluster %+v, %v", p.Cluster, err)
	}
	if _, err := WithCluster("policy.yaml", src, Cluster{}); err == nil {
		t.Error("a cluster section without an address was written")
	}
}
