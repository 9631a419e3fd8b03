package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// TestMain lets the test binary serve as the replicas (`serve --config FILE …`, as the
// llm-bulkhead binary takes it), and otherwise checks that no test leaves a goroutine behind.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "serve" {
		os.Exit(serveReplica(os.Args[2:]))
	}
	goleak.VerifyTestMain(m)
}

// serveReplica is `llm-bulkhead serve` with the flags the benchmark gives it.
func serveReplica(args []string) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	cfg := fs.String("config", "", "policy file")
	fs.Bool("watch", false, "ignored: never watched")
	grpcAddr := fs.String("grpc-addr", "127.0.0.1:0", "ext_proc listen address")
	adminAddr := fs.String("admin-addr", "127.0.0.1:0", "admin listen address")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	a, err := app.New(app.Options{ConfigPath: *cfg, GRPCAddr: *grpcAddr, AdminAddr: *adminAddr, LogOutput: os.Stderr})
	if err == nil {
		err = a.Run(ctx, nil)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "serve:", err)
		return 1
	}
	return 0
}

func TestBadFlagsAreRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--concurrency", "0"},
		{"--replicas", "3,1"},
		{"--redis-timeout", "2s"},
		{"--concurrency", "", "--replicas", "0", "--behaviours=false"},
		{"--admission", "exact,bogus"},
		{"--admission", "exact"}, // the behaviours measure leased admission
		{"--redis", "standalone,standalone"},
		{"--limit", "36"}, // 3 replicas × 12 clients: the limit would not bind
		{"--lease-interval", "5s"},
		{"--skew", "0.2"},
		{"extra"},
	} {
		var errOut bytes.Buffer
		if code := run(context.Background(), args, &bytes.Buffer{}, &errOut); code != 2 {
			t.Errorf("%q: exit %d, want 2\n%s", args, code, errOut.String())
		}
	}
}

// The fair shares the behaviours expect are the lease script's: smallest want first, each at most
// an even part of what is left, rounded up.
func TestFairSharesAsTheLeaseScriptGrantsThem(t *testing.T) {
	for _, c := range []struct {
		wants    []int
		capacity int
		want     []int
	}{
		{[]int{12, 12, 12}, 24, []int{8, 8, 8}},
		{[]int{29, 4, 3}, 24, []int{17, 4, 3}},
		{[]int{12, 12, 12, 12}, 24, []int{6, 6, 6, 6}},
		{[]int{0, 5}, 3, []int{0, 3}},
		{[]int{2, 10, 10}, 15, []int{2, 7, 6}},
		{[]int{1, 1}, 24, []int{1, 1}},
	} {
		got := fairShares(c.wants, c.capacity)
		if fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("fairShares(%v, %d) = %v, want %v", c.wants, c.capacity, got, c.want)
		}
	}
	if got := skewed(36, 3, 0.8); fmt.Sprint(got) != "[29 4 3]" {
		t.Errorf("skewed(36, 3, 0.8) = %v, want [29 4 3]", got)
	}
	if got := skewed(40, 4, 0.5); fmt.Sprint(got) != "[20 7 7 6]" {
		t.Errorf("skewed(40, 4, 0.5) = %v, want [20 7 7 6]", got)
	}
}

func TestFollowedIsTheFirstPollAfterTheChange(t *testing.T) {
	trace := []TracePoint{{T: 1, Slots: []int64{17}}, {T: 2, Slots: []int64{8}}, {T: 2.4, Slots: []int64{12}}, {T: 2.6, Slots: []int64{16}}, {T: 3, Slots: []int64{17}}}
	ok := func(tp TracePoint) bool { return tp.Slots[0] >= 16 }
	if got := followed(trace, 2, ok); math.Abs(float64(got)-0.6) > 1e-9 {
		t.Errorf("followed = %v, want 0.6 (a poll before the change does not count)", got)
	}
	if got := followed(trace, 3.5, ok); !math.IsNaN(float64(got)) {
		t.Errorf("never followed: %v, want NaN", got)
	}
}

func sample(side string, conc, rep int, rate, p50, cpu float64) Sample {
	s := Sample{Side: side, Load: bench.Sample{Server: side, Concurrency: conc, Rep: rep, Streams: int(rate), Rate: rate, P50: p50, P99: 2 * p50,
		ServerCPU: cpu, LoadCPU: math.NaN(), ServerCores: 0.5}}
	switch side {
	case Exact:
		s.Work = &Work{Admitted: rate, AdmitCalls: 1, SettleCalls: 0.5, ClientCommands: 1.5, InScripts: 50, RedisCPU: 150,
			LeaseCalls: 0, CallP50: Num(math.NaN()), CallP99: Num(math.NaN())}
	case Leased:
		s.Work = &Work{Admitted: rate, ClientCommands: 0.2, InScripts: 2.5, RedisCPU: 4, LeaseReports: 0.2, ReportsPerReplica: 20,
			Commands: map[string]CommandCost{"evalsha": {Calls: 0.19, Usec: 3.5}, "hgetall": {Calls: 0.19, Usec: 0.4}, "ping": {Calls: 0.01}}}
	}
	return s
}

// Each admission's runs are paired with local's of the same repetition; the added p50 is judged
// against local's own spread.
func TestAggregatePairsRunsOfOneRepetition(t *testing.T) {
	r := &Report{Samples: []Sample{
		sample(SideLocal, 64, 1, 1000, 100, 50), sample(Exact, 64, 1, 800, 150, 60), sample(Leased, 64, 1, 1000, 110, 52),
		sample(Exact, 64, 2, 400, 300, 70), sample(Leased, 64, 2, 500, 180, 55), sample(SideLocal, 64, 2, 500, 200, 55),
		sample(Leased, 64, 3, 2000, 90, 50), sample(SideLocal, 64, 3, 2000, 100, 50), sample(Exact, 64, 3, 1000, 100, 52),
	}}
	r.Levels = Aggregate(r.Samples)
	if len(r.Levels) != 1 || len(r.Levels[0].Modes) != 2 {
		t.Fatalf("levels %+v", r.Levels)
	}
	lv := r.Levels[0]
	ex, le := lv.Modes[0], lv.Modes[1]
	if ex.Admission != Exact || le.Admission != Leased {
		t.Fatalf("admissions %s, %s: want them in the order they first ran", ex.Admission, le.Admission)
	}
	if ex.Ratio.Median != 0.8 || ex.Ratio.Min != 0.5 || ex.Ratio.Max != 0.8 {
		t.Errorf("exact's ratios %+v, want median 0.8 of 0.8, 0.8 and 0.5", ex.Ratio)
	}
	if le.AddedP50.Median != -10 || le.AddedP50.Min != -20 || le.AddedP50.Max != 10 || lv.Noise != 100 {
		t.Errorf("leased's added p50 %+v, noise %v: want −10 [−20–+10] against local's spread of 100", le.AddedP50, lv.Noise)
	}
	r.Targets = r.judge()
	byName := map[string]Target{}
	for _, tg := range r.Targets {
		byName[tg.Name] = tg
	}
	for name, want := range map[string]string{
		"exact: admission-path round trips per admission, one replica, 64 streams": "met",
		"exact: Redis client commands per admission, one replica, 64 streams":      "met",
		"leased: Redis client commands per admission, one replica, 64 streams":     "missed",
		"leased: Redis CPU per admission, one replica, 64 streams":                 "met",
		"leased: added p50 against no cluster, one replica, 64 streams":            "met",
	} {
		if got := byName[name]; got.Status != want {
			t.Errorf("%s: %+v, want %s", name, got, want)
		}
	}
	// A missed target says by how much and what weighs most.
	if m := byName["leased: Redis client commands per admission, one replica, 64 streams"].Measured; !strings.Contains(m, "4.0× the target") ||
		!strings.Contains(m, "EVALSHA 0.190 calls") || !strings.Contains(m, "20.0 lease reports per replica-second") {
		t.Errorf("missed target's measure: %s", m)
	}
	// An added p50 beyond local's spread is not within the noise.
	r.Samples[2].Load.P50 = 300
	r.Samples[4].Load.P50 = 400
	r.Levels = Aggregate(r.Samples)
	for _, tg := range r.judge() {
		if strings.HasPrefix(tg.Name, "leased: added p50") && tg.Status != "missed" {
			t.Errorf("added p50 of +200 against a spread of 100: %+v", tg)
		}
	}
	md := r.Markdown()
	if !strings.Contains(md, "| 64 | exact | 0.800 [0.500–0.800] |") {
		t.Errorf("the report does not show exact's paired ratio:\n%s", md)
	}
	// Unmeasured figures (NaN) are written as null.
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"redis_call_p50_us":null`) || !strings.Contains(string(b), `"load_cpu_us_per_stream":null`) {
		t.Errorf("JSON: %s", b)
	}
}

// TestRunSmall runs the whole program with tiny numbers against real Redis servers, the test
// binary serving as the replicas: the comparison, fleets on one server and on a Redis Cluster,
// skew and churn. It checks what the report holds, and that the compartment's limit held
// throughout, not how fast anything was.
func TestRunSmall(t *testing.T) {
	redistest.Require(t)
	if testing.Short() {
		t.Skip("starts a dozen processes")
	}
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	args := []string{"--out", out, "--bulkhead-bin", os.Args[0], "--policy", "../../../../examples/policy.yaml", "--concurrency", "2", "--reps", "2", "--warmup", "100ms", "--duration", "300ms",
		"--replicas", "2", "--fleet-concurrency", "2", "--fleet-reps", "1", "--fleet-duration", "300ms", "--lease-interval", "50ms", "--lease-ttl", "1s",
		"--behaviour-replicas", "2", "--clients", "3", "--limit", "4", "--hold", "20ms", "--phase", "600ms"}
	if code := run(context.Background(), args, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d\n%s", code, stderr.String())
	}
	md := stdout.String()
	for _, want := range []string{"## Targets", "## One replica per side", "| 2 | leased |", "## Fleets", "| cluster | 2 | exact |",
		"| standalone | 2 | leased |", "## Leased admission: skew and churn", "| skew | replica 1: 3 → 5 of 6 clients (others [1]) | 3 |"} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
	saved, err := os.ReadFile(filepath.Join(out, "report.md"))
	if err != nil || string(saved) != md {
		t.Errorf("report.md differs from what was printed (%v)", err)
	}
	js, err := os.ReadFile(filepath.Join(out, "report.json"))
	if err != nil {
		t.Fatal(err)
	}
	var rep Report
	if err := json.Unmarshal(js, &rep); err != nil {
		t.Fatalf("report.json: %v", err)
	}
	if len(rep.Samples) != 3*2 || len(rep.Levels) != 1 || len(rep.Levels[0].Modes) != 2 || rep.Levels[0].Modes[1].AddedP50.N != 2 {
		t.Errorf("samples %d, levels %+v: want 6 samples, one level with both admissions paired twice", len(rep.Samples), rep.Levels)
	}
	if len(rep.Fleets) != 4 {
		t.Fatalf("fleets %+v: want 2 Redis × 1 size × 2 admissions", rep.Fleets)
	}
	for _, f := range rep.Fleets {
		// Exact admission calls Redis once per admission (a little more when a request that
		// waited for a slot asks again, as on a loaded machine), but for the admissions decided
		// without Redis when it did not answer in time (a loaded machine again); leased never on
		// a request's path. A window this short counts calls and admissions a few requests
		// apart: those in flight at its edges (2 replicas × 2 streams).
		admit, w := f.Work.AdmitCalls.Median, f.Work
		least, most := 0.95, 1.2
		if w.Admitted > 0 {
			least = least*(1-w.WithoutRedis/w.Admitted) - 4/w.Admitted
			most += 4 / w.Admitted
		}
		if f.Admission == Exact && (admit < least || admit > most) || f.Admission == Leased && admit != 0 {
			t.Errorf("%d %s replicas on %s: %.3f admission calls per admission (%.0f of %.0f admissions without Redis)",
				f.Replicas, f.Admission, f.Redis, admit, w.WithoutRedis, w.Admitted)
		}
		if f.Work.ClientCommands.N == 0 || f.Work.RedisCPU.N == 0 || f.Errors != 0 {
			t.Errorf("fleet %+v: Redis's work not measured, or errors", f)
		}
	}
	bh := rep.Behaviour
	if bh == nil {
		t.Fatal("no behaviours in the report")
	}
	if bh.MaxUpstream > int64(bh.Limit) || bh.MaxUpstream == 0 {
		t.Errorf("the upstream held %d requests at once against a limit of %d", bh.MaxUpstream, bh.Limit)
	}
	phases := map[string]bool{}
	for _, tp := range bh.Trace {
		phases[tp.Phase] = true
	}
	for _, p := range []string{"even", "skew", "join", "kill"} {
		if !phases[p] {
			t.Errorf("no poll in phase %s", p)
		}
	}
	if bh.Admitted == 0 || bh.Contended == nil || bh.Contended.Admitted == 0 {
		t.Errorf("behaviours: %d admitted, contended work %+v", bh.Admitted, bh.Contended)
	}
}

// A fleet's Redis CPU target is judged on what the replicas add to Redis's own idle (a Redis
// Cluster's bus costs the same with no client), the whole shown beside it; without an idle
// measure it is judged on the whole.
func TestFleetCPUTargetIsOverRedisIdle(t *testing.T) {
	fleetRun := func(kind string, cpu, over float64) FleetSample {
		return FleetSample{Redis: kind, Replicas: 10, Admission: Leased, Rep: 1,
			Work: Work{Admitted: 1000, ClientCommands: 0.01, RedisCPU: Num(cpu), RedisCPUOverIdle: Num(over)}}
	}
	r := &Report{Fleet: []FleetSample{fleetRun("cluster", 7, 3), fleetRun("standalone", 4, math.NaN())}}
	r.Fleets = AggregateFleets(r.Fleet)
	byName := map[string]Target{}
	for _, tg := range r.judge() {
		byName[tg.Name] = tg
	}
	if tg := byName["leased: Redis CPU per admission, 10 replicas, cluster Redis"]; tg.Status != "met" || !strings.Contains(tg.Measured, "3.0 µs over Redis's own idle (7.0 µs in all)") {
		t.Errorf("3 µs over an idle Redis Cluster, 7 in all: %+v", tg)
	}
	if tg := byName["leased: Redis CPU per admission, 10 replicas, standalone Redis"]; tg.Status != "met" || strings.Contains(tg.Measured, "idle") {
		t.Errorf("4 µs, Redis's idle not measured: %+v", tg)
	}
	r.Fleet[0].Work.RedisCPUOverIdle = 6
	r.Fleets = AggregateFleets(r.Fleet)
	for _, tg := range r.judge() {
		if tg.Name == "leased: Redis CPU per admission, 10 replicas, cluster Redis" && tg.Status != "missed" {
			t.Errorf("6 µs over Redis's idle: %+v", tg)
		}
	}
}
