package bench

import (
	"encoding/json"
	"math"
	"strings"
	"testing"
)

func TestAggregatePairsRepetitions(t *testing.T) {
	// Given two repetitions at one level; in the second the machine was slower for both.
	samples := []Sample{
		{Server: SideNoop, Concurrency: 64, Rep: 1, Rate: 1000, P50: 100, P99: 300, ServerCPU: 40},
		{Server: SideBulkhead, Concurrency: 64, Rep: 1, Rate: 950, P50: 110, P99: 330, ServerCPU: 50},
		{Server: SideBulkhead, Concurrency: 64, Rep: 2, Rate: 480, P50: 220, P99: 700, ServerCPU: 58, Errors: 2},
		{Server: SideNoop, Concurrency: 64, Rep: 2, Rate: 500, P50: 200, P99: 600, ServerCPU: 44},
		{Server: SideNoop, Concurrency: 1, Rep: 1, Rate: 2000, P50: 400, P99: 900, ServerCPU: math.NaN()},
		{Server: SideBulkhead, Concurrency: 1, Rep: 1, Rate: 1900, P50: 420, P99: 1000, ServerCPU: math.NaN()},
	}
	// When they are aggregated
	levels := Aggregate(samples)
	// Then each level pairs the runs of the same repetition
	if len(levels) != 2 || levels[0].Concurrency != 1 || levels[1].Concurrency != 64 {
		t.Fatalf("levels %+v, want 1 and 64 in order", levels)
	}
	lv := levels[1]
	if lv.Ratio != (Spread{Median: 0.955, Min: 0.95, Max: 0.96, N: 2}) {
		t.Errorf("ratio %+v, want the paired ratios 0.95 and 0.96", lv.Ratio)
	}
	if lv.AddedP50 != (Spread{Median: 15, Min: 10, Max: 20, N: 2}) || lv.AddedP99 != (Spread{Median: 65, Min: 30, Max: 100, N: 2}) {
		t.Errorf("added p50 %+v, p99 %+v", lv.AddedP50, lv.AddedP99)
	}
	if lv.AddedCPU.Median != 12 || lv.Bulkhead.Errors != 2 || lv.Noop.Errors != 0 {
		t.Errorf("added CPU %+v, errors %d/%d", lv.AddedCPU, lv.Bulkhead.Errors, lv.Noop.Errors)
	}
	if lv.Noop.Rate != (Spread{Median: 750, Min: 500, Max: 1000, N: 2}) {
		t.Errorf("no-op rate %+v", lv.Noop.Rate)
	}
	if levels[0].AddedCPU.N != 0 {
		t.Errorf("CPU not read gives no added CPU, got %+v", levels[0].AddedCPU)
	}
	if lv.Replay != nil || lv.WorkRatio.N != 0 {
		t.Errorf("no replay samples, yet replay stats %+v, work ratio %+v", lv.Replay, lv.WorkRatio)
	}
}

func TestAggregateSplitsByReplay(t *testing.T) {
	// Given a level with the replay server between the two
	samples := []Sample{
		{Server: SideNoop, Concurrency: 64, Rep: 1, Rate: 1000, P50: 100, ServerCPU: 40},
		{Server: SideReplay, Concurrency: 64, Rep: 1, Rate: 800, P50: 120, ServerCPU: 45},
		{Server: SideBulkhead, Concurrency: 64, Rep: 1, Rate: 720, P50: 130, ServerCPU: 60},
	}
	// When aggregated
	lv := Aggregate(samples)[0]
	// Then the whole ratio splits into the replies' part and the work's part
	if lv.Replay == nil || lv.Replay.Rate.Median != 800 {
		t.Fatalf("replay stats %+v", lv.Replay)
	}
	if lv.Ratio.Median != 0.72 || lv.RepliesRatio.Median != 0.8 || lv.WorkRatio.Median != 0.9 {
		t.Errorf("ratio %v = replies %v × work %v, want 0.72 = 0.8 × 0.9", lv.Ratio.Median, lv.RepliesRatio.Median, lv.WorkRatio.Median)
	}
	if lv.WorkAddedP50.Median != 10 || lv.WorkAddedCPU.Median != 15 {
		t.Errorf("work added p50 %v, CPU %v, want 10 and 15", lv.WorkAddedP50.Median, lv.WorkAddedCPU.Median)
	}
}

func TestAggregateComparesWithTheBaseline(t *testing.T) {
	// Given two repetitions with a baseline binary; the machine is slower in the second, for all
	samples := []Sample{
		{Server: SideNoop, Concurrency: 8, Rep: 1, Rate: 1000, ServerCPU: 100},
		{Server: SideBaseline, Concurrency: 8, Rep: 1, Rate: 800, ServerCPU: 130},
		{Server: SideBulkhead, Concurrency: 8, Rep: 1, Rate: 880, ServerCPU: 118},
		{Server: SideBaseline, Concurrency: 8, Rep: 2, Rate: 400, ServerCPU: 170},
		{Server: SideBulkhead, Concurrency: 8, Rep: 2, Rate: 420, ServerCPU: 160},
		{Server: SideNoop, Concurrency: 8, Rep: 2, Rate: 500, ServerCPU: 140},
	}
	// When aggregated
	r := &Report{Samples: samples, BaselineCommand: "llm-bulkhead serve (prebuilt binary /tmp/old)"}
	r.finish()
	lv := r.Levels[0]
	// Then the change is paired within each repetition, not across the drift
	if lv.Baseline == nil || lv.Baseline.ServerCPU.Median != 150 {
		t.Fatalf("baseline stats %+v", lv.Baseline)
	}
	if lv.BaselineAddedCPU != (Spread{Median: 30, Min: 30, Max: 30, N: 2}) || lv.AddedCPU != (Spread{Median: 19, Min: 18, Max: 20, N: 2}) {
		t.Errorf("added CPU: baseline %+v, llm-bulkhead %+v", lv.BaselineAddedCPU, lv.AddedCPU)
	}
	if lv.ChangeCPU != (Spread{Median: -11, Min: -12, Max: -10, N: 2}) || math.Abs(lv.ChangeRatio.Median-1.075) > 1e-9 || lv.ChangeRatio.N != 2 {
		t.Errorf("change: CPU %+v, throughput %+v", lv.ChangeCPU, lv.ChangeRatio)
	}
	md := r.Markdown()
	for _, want := range []string{"- Baseline: llm-bulkhead serve (prebuilt binary /tmp/old)", "| 8 | baseline | 600 [400–800] |",
		"| 8 | +30.0 [+30.0–+30.0] | +19.0 [+18.0–+20.0] | -11.0 [-12.0–-10.0] | 1.075 [1.050–1.100] |"} {
		if !strings.Contains(md, want) {
			t.Errorf("Markdown lacks %q:\n%s", want, md)
		}
	}
}

func TestJudge(t *testing.T) {
	r := &Report{
		Samples: []Sample{
			{Server: SideNoop, Concurrency: 1, Rep: 1, Rate: 1000, P50: 500},
			{Server: SideBulkhead, Concurrency: 1, Rep: 1, Rate: 950, P50: 520},
			{Server: SideNoop, Concurrency: 512, Rep: 1, Rate: 1000, P50: 5000},
			{Server: SideBulkhead, Concurrency: 512, Rep: 1, Rate: 850, P50: 6000},
		},
		Memory: []Memory{{Server: SideBulkhead, Held: 10000, IdleRSS: 20 << 20, HeldRSS: 200 << 20, RSSPerStream: 18 << 10}},
		Micro: []GoBench{
			{Package: module + "/policy", Name: "BenchmarkAdmitDone", AllocsPerOp: 0},
			{Package: module + "/extproc/llmapi", Name: "BenchmarkScanRequest/llmapi/1MiB", MBPerSec: 1200},
			{Package: module + "/extproc/llmapi", Name: "BenchmarkUsageScanner/openai_sse/16KiB_writes", MBPerSec: 500},
		},
	}
	r.finish()
	want := map[string]string{
		"Throughput":                Failed, // 0.85 at 512
		"Added latency":             Held,   // +20 µs at 1
		"Memory":                    Held,
		"Allocation-free admission": Held,
		"Body scan":                 Held,
		"SSE usage scan":            Failed,
	}
	for _, tg := range r.Targets {
		if want[tg.Name] != tg.Status {
			t.Errorf("%s: %s (%s), want %s", tg.Name, tg.Status, tg.Measured, want[tg.Name])
		}
		delete(want, tg.Name)
	}
	if len(want) > 0 {
		t.Errorf("targets not judged: %v", want)
	}

	// Fewer held streams than the target are extrapolated, not judged.
	r.Memory = []Memory{{Server: SideBulkhead, Held: 1000, IdleRSS: 20 << 20, HeldRSS: 40 << 20, RSSPerStream: 20 << 10}}
	r.Micro = nil
	r.finish()
	for _, tg := range r.Targets {
		if tg.Name == "Memory" && (tg.Status != NotMeasured || !strings.Contains(tg.Measured, "extrapolated to 10000: 215.3 MiB")) {
			t.Errorf("memory target with 1000 held: %+v", tg)
		}
		if tg.Name == "Allocation-free admission" && tg.Status != NotMeasured {
			t.Errorf("no micro-benchmarks, yet %+v", tg)
		}
	}
}

func TestReportRenders(t *testing.T) {
	r := &Report{
		Samples: []Sample{
			{Server: SideNoop, Concurrency: 1, Rep: 1, Rate: 1000, P50: 500, ServerCPU: math.NaN(), LoadCPU: math.NaN(), ServerCores: math.NaN()},
			{Server: SideBulkhead, Concurrency: 1, Rep: 1, Rate: 950, P50: 520, Errors: 1, FirstError: "status 503", ServerCPU: math.NaN(), LoadCPU: math.NaN(), ServerCores: math.NaN()},
		},
		Memory: []Memory{{Server: SideNoop, Held: 10, IdleHeap: math.NaN(), HeldHeap: math.NaN(), AfterHeap: math.NaN(), HeapPerStream: math.NaN()}},
		Micro:  []GoBench{{Package: module + "/policy", Name: "BenchmarkAdmitDone", NsPerOp: 2000, BytesPerOp: 0, AllocsPerOp: 0, MBPerSec: -1, Runs: 3}},
	}
	r.finish()
	md := r.Markdown()
	for _, want := range []string{"| Throughput |", "| 1 | llm-bulkhead | 950 |", "status 503", "use gRPC's default codec", "| policy | BenchmarkAdmitDone | 2000.0 | 0 | 0 | — | 3 |", "## Memory with held streams"} {
		if !strings.Contains(md, want) {
			t.Errorf("Markdown lacks %q:\n%s", want, md)
		}
	}
	// NaN (not measured) must not break the JSON.
	js, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(js), `"server_cpu_us_per_stream":null`) || !strings.Contains(string(js), `"idle_heap_inuse_bytes":null`) {
		t.Errorf("NaN not written as null: %s", js)
	}
}
