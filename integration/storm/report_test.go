package storm

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// chatRun builds a run of configuration name whose chat requests took the given latencies;
// a negative latency is a refusal for bulkhead_full.
func chatRun(name string, rep int, sc Scenario, lat ...float64) *RunResult {
	r := &RunResult{Configuration: name, Repetition: rep, Refusals: map[string]map[string]int{}, Errors: map[string]map[string]int{}}
	for i, l := range lat {
		s := Sample{Tenant: "acme", Start: float64(i), Latency: l, Outcome: OutcomeOK}
		if l < 0 {
			s.Latency, s.Outcome, s.Reason = 0.01, OutcomeRefused, "bulkhead_full"
			inc(r.Refusals, FeatureChat, "bulkhead_full")
		}
		r.Chat = append(r.Chat, s)
	}
	return r
}

// fakeReport has a baseline and a protected storm configuration, two runs each.
func fakeReport() *Report {
	sc := DefaultScenario()
	sc.BatchWorkers, sc.BatchPerWorker = 2, 2
	rep := &Report{Repeat: 2, TimeScale: 0.1, Capacity: 10, Seed: 1, Scenario: sc, Machine: thisMachine(), WallSeconds: 12,
		Configurations: []*ConfigSummary{
			{Configuration: Configuration{Name: ConfigBaseline, Label: "no storm, no policy (baseline)"}},
			{Configuration: Configuration{Name: ConfigPolicy, Label: "(b) storm, example <policy>", Storm: true, PolicyPath: "p.yaml"}},
		}}
	base := []*RunResult{chatRun(ConfigBaseline, 0, sc, 0.4, 0.5, 0.6), chatRun(ConfigBaseline, 1, sc, 0.4, 0.5, 0.8)}
	storm := []*RunResult{chatRun(ConfigPolicy, 0, sc, 0.5, 0.5, 0.6, -1), chatRun(ConfigPolicy, 1, sc, 0.5, 0.6, 0.7)}
	start, end := 0.5, 2.5
	for i, r := range storm {
		r.StormStart, r.StormEnd = &start, &end
		r.Batch = []Sample{
			{Tenant: "acme", Latency: 1 + float64(i), Outcome: OutcomeOK, Attempts: 1},
			{Tenant: "acme", Latency: 3, Outcome: OutcomeOK, Attempts: 2},
			{Tenant: "acme", Latency: 0.1, Outcome: OutcomeRefused, Reason: "token_budget", Attempts: 1},
			{Tenant: "acme", Latency: 2, Outcome: OutcomeError, Reason: "message_timeout", Attempts: 1},
		}
		inc(r.Refusals, FeatureBatch, "token_budget")
		inc(r.Refusals, FeatureBatch, "bulkhead_full")
		inc(r.Errors, FeatureBatch, "message_timeout")
	}
	for i, r := range append(base, storm...) {
		r.StallMillis = float64(10 * (i + 1))
		r.Summary = summarizeRun(r, sc)
		rep.Runs = append(rep.Runs, r)
	}
	rep.summarize()
	return rep
}

func TestSummarizeRunCountsFailuresAtTheTimeout(t *testing.T) {
	sc := DefaultScenario()
	r := chatRun("x", 0, sc, 0.5, -1)
	s := summarizeRun(r, sc)
	if s.ChatRequests != 2 || s.ChatOK != 1 || s.ChatRefused != 1 || s.ChatErrors != 0 {
		t.Fatalf("counts = %+v", s)
	}
	if *s.ChatP99 < 29 || *s.ChatServedP99 != 0.5 {
		t.Fatalf("P99 = %v (want near the 30 s timeout), served P99 = %v (want 0.5)", *s.ChatP99, *s.ChatServedP99)
	}
	if s.ChatStormP99 != nil || s.BatchP99 != nil {
		t.Fatal("storm numbers without a storm")
	}
}

func TestReportSummaries(t *testing.T) {
	rep := fakeReport()
	p := rep.Config(ConfigPolicy)
	if p.Runs != 2 || p.BatchDocuments != 4 {
		t.Fatalf("runs %d, documents %d", p.Runs, p.BatchDocuments)
	}
	if want := (Stat{Median: 2, Min: 2, Max: 2, N: 2}); p.BatchDone != want {
		t.Errorf("batch done = %+v, want %+v", p.BatchDone, want)
	}
	if want := (Stat{Median: 5, Min: 5, Max: 5, N: 2}); p.BatchAttempts != want {
		t.Errorf("batch attempts = %+v, want %+v", p.BatchAttempts, want)
	}
	// The chat refusal of the first run counts 1 there and 0 in the second.
	if want := (Stat{Median: 0.5, Min: 0, Max: 1, N: 2}); p.Refused[FeatureChat]["bulkhead_full"] != want {
		t.Errorf("chat refusals = %+v, want %+v", p.Refused[FeatureChat]["bulkhead_full"], want)
	}
	if p.ChatStormP99.N != 2 {
		t.Errorf("storm-window P99 over %d runs, want 2", p.ChatStormP99.N)
	}
	if b := rep.Config(ConfigBaseline); b.BatchDone.N != 0 || b.BatchP99.N != 0 {
		t.Errorf("the baseline has batch numbers: %+v", b)
	}
	ratio, ok := rep.Ratio(ConfigPolicy)
	if !ok || ratio < 1 {
		t.Fatalf("ratio = %v, %v", ratio, ok)
	}
	if _, ok := rep.Ratio("missing"); ok {
		t.Error("a ratio for a missing configuration")
	}
}

func TestMarkdown(t *testing.T) {
	md := fakeReport().Markdown()
	lines := strings.Split(strings.TrimSpace(md), "\n")
	if !strings.HasPrefix(lines[0], "| configuration | chat P50 (s) |") || !strings.Contains(lines[0], "batch done (of 4)") {
		t.Fatalf("header: %s", lines[0])
	}
	if lines[1] != "|---|---|---|---|---|---|---|---|" {
		t.Fatalf("separator: %s", lines[1])
	}
	wantRows := map[string][]string{
		"| no storm, no policy (baseline) |": {"| 0.50 |", "| 0 of 3 |", "| — | — | none |"},
		"| (b) storm, example <policy> |": {
			" (0.55–0.60) |", // P50 of 0.5, 0.5, 0.6, 30 and of 0.5, 0.6, 0.7
			"| 0.5 (0–1) of 3.5 (3–4) |",
			"| 2 |",
			"batch: bulkhead_full 1, token_budget 1; chat: bulkhead_full 0.5 (0–1); failed without refusal: batch: message_timeout 1 |",
		},
	}
	for prefix, cells := range wantRows {
		var row string
		for _, l := range lines {
			if strings.HasPrefix(l, prefix) {
				row = l
			}
		}
		if row == "" {
			t.Fatalf("no row %s in\n%s", prefix, md)
		}
		if n := strings.Count(row, "|"); n != 9 {
			t.Errorf("row %s has %d bars, want 9", prefix, n)
		}
		for _, c := range cells {
			if !strings.Contains(row, c) {
				t.Errorf("row %s lacks %q:\n%s", prefix, c, row)
			}
		}
	}
	if !strings.Contains(md, "target ≤ 1.3×): policy ") {
		t.Errorf("no target line:\n%s", md)
	}
	if !strings.Contains(md, "×10 in simulated time): baseline 15 (10–20), policy 35 (30–40).") {
		t.Errorf("no stall line:\n%s", md)
	}
}

func TestRefusedCellShadow(t *testing.T) {
	cs := &ConfigSummary{Refused: map[string]map[string]Stat{}, Shadow: map[string]Stat{
		"token_budget": {Median: 40, Min: 40, Max: 40, N: 3}, "bulkhead_full": {Median: 90, Min: 80, Max: 95, N: 3}}}
	if got, want := refusedCell(cs), "none; would refuse: bulkhead_full 90 (80–95), token_budget 40"; got != want {
		t.Fatalf("refusedCell = %q, want %q", got, want)
	}
}

func TestFormatting(t *testing.T) {
	tests := []struct{ got, want string }{
		{seconds(Stat{}), "—"},
		{seconds(Stat{Median: 1.234, Min: 1.234, Max: 1.234, N: 3}), "1.23"},
		{seconds(Stat{Median: 1.2, Min: 1, Max: 1.5, N: 3}), "1.20 (1.00–1.50)"},
		{count(Stat{Median: 10, Min: 10, Max: 10, N: 1}), "10"},
		{count(Stat{Median: 2.5, Min: 2, Max: 3, N: 2}), "2.5 (2–3)"},
		{tickLabel(0.2), "0.2 s"},
		{tickLabel(10), "10 s"},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("got %q, want %q", tt.got, tt.want)
		}
	}
}

// wellFormed decodes svg as XML and returns how many elements of each name it has.
func wellFormed(t *testing.T, svg []byte) map[string]int {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(svg))
	n := map[string]int{}
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			return n
		}
		if err != nil {
			t.Fatalf("not well-formed XML: %v\n%s", err, svg)
		}
		if se, ok := tok.(xml.StartElement); ok {
			n[se.Name.Local]++
		}
	}
}

func TestSVG(t *testing.T) {
	rep := fakeReport()
	svg := rep.SVG()
	n := wellFormed(t, svg)
	if n["svg"] != 1 || n["polyline"] != 2 {
		t.Fatalf("elements = %v, want one svg and a polyline per configuration", n)
	}
	s := string(svg)
	for _, want := range []string{"example &lt;policy&gt; (n=7)", "(baseline) (n=6)", "1.3 × baseline P99", `stroke-dasharray`} {
		if !strings.Contains(s, want) {
			t.Errorf("SVG lacks %q", want)
		}
	}
}

func TestPercentileChartEdges(t *testing.T) {
	// No data at all still draws axes; an empty series gets a legend entry only.
	n := wellFormed(t, PercentileChart("empty", []Series{{Label: "none"}}, 0, ""))
	if n["polyline"] != 0 || n["text"] == 0 {
		t.Fatalf("elements = %v", n)
	}
	long := strings.Repeat("x", 60)
	s := string(PercentileChart("t", []Series{{Label: long, Values: []float64{0.5, 0.7, 30}}}, 0.6, "mark"))
	if !strings.Contains(s, strings.Repeat("x", 39)+"… (n=3)") {
		t.Error("long legend labels are not shortened")
	}
	if !strings.Contains(s, ">0.1 s<") || !strings.Contains(s, ">100 s<") {
		t.Error("the latency axis does not span the decades around the data")
	}
	// A small sample still shows the axis up to 99%; a large one reaches 99.9%.
	if !strings.Contains(s, ">99%<") || strings.Contains(s, ">99.9%<") {
		t.Error("three values: want the axis to end at 99%")
	}
	big := make([]float64, 2000)
	for i := range big {
		big[i] = 0.4 + float64(i)/1000
	}
	if s := string(PercentileChart("t", []Series{{Label: "big", Values: big}}, 0, "")); !strings.Contains(s, ">99.9%<") {
		t.Error("2000 values: want the axis to reach 99.9%")
	}
}

func TestNines(t *testing.T) {
	for _, tt := range []struct{ q, want float64 }{{0, 0}, {0.9, 1}, {0.99, 2}, {0.999, 3}} {
		if got := nines(tt.q); math.Abs(got-tt.want) > 1e-9 {
			t.Errorf("nines(%v) = %v, want %v", tt.q, got, tt.want)
		}
	}
}

func TestWriteFiles(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "out")
	rep := fakeReport()
	if err := rep.WriteFiles(dir); err != nil {
		t.Fatal(err)
	}
	md, err := os.ReadFile(filepath.Join(dir, FileTable))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(md), rep.Markdown()) || !strings.Contains(string(md), "("+FileChart+")") {
		t.Errorf("%s lacks the table or the chart link", FileTable)
	}
	var back Report
	js, err := os.ReadFile(filepath.Join(dir, FileJSON))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(js, &struct {
		Runs *[]*RunResult `json:"runs"`
	}{&back.Runs}); err != nil {
		t.Fatal(err)
	}
	if len(back.Runs) != 4 || len(back.Runs[2].Batch) != 4 {
		t.Errorf("JSON holds %d runs", len(back.Runs))
	}
	if _, err := os.Stat(filepath.Join(dir, FileChart)); err != nil {
		t.Error(err)
	}
}

func TestClassify(t *testing.T) {
	refusal := envoysim.Headers{{Key: "x-bulkhead-reason", Value: "token_budget"}, {Key: "retry-after", Value: "7"}}
	tests := []struct {
		name            string
		res             envoysim.Result
		outcome, reason string
		retry           time.Duration
	}{
		{"answered", envoysim.Result{Status: 200}, OutcomeOK, "", time.Second},
		{"refused", envoysim.Result{Status: 429, Local: envoysim.LocalImmediate, Headers: refusal}, OutcomeRefused, "token_budget", 7 * time.Second},
		{"immediate without a reason", envoysim.Result{Status: 403, Local: envoysim.LocalImmediate}, OutcomeError, "immediate_403", time.Second},
		{"message timeout", envoysim.Result{Status: 504, Local: envoysim.LocalMessageTimeout}, OutcomeError, "message_timeout", time.Second},
		{"client gave up", envoysim.Result{Canceled: true}, OutcomeError, "timeout", time.Second},
		{"reset", envoysim.Result{Status: 200, Reset: true}, OutcomeError, "reset", time.Second},
		{"upstream error", envoysim.Result{Status: 500}, OutcomeError, "status_500", time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, r := Classify(&tt.res)
			if o != tt.outcome || r != tt.reason {
				t.Fatalf("Classify = %s, %s; want %s, %s", o, r, tt.outcome, tt.reason)
			}
			if got := retryAfter(&tt.res); got != tt.retry {
				t.Fatalf("retryAfter = %v, want %v", got, tt.retry)
			}
		})
	}
}
