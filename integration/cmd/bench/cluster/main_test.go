package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestBadFlagsAreRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--concurrency", "0"},
		{"--replicas", "1"},
		{"--redis-timeout", "2s"},
		{"--concurrency", "", "--replicas", "0"},
		{"extra"},
	} {
		var errOut bytes.Buffer
		if code := run(context.Background(), args, &bytes.Buffer{}, &errOut); code != 2 {
			t.Errorf("%q: exit %d, want 2\n%s", args, code, errOut.String())
		}
	}
}

func sample(side string, conc, rep int, rate, p50, cpu float64) Sample {
	s := Sample{Side: side, Sample: bench.Sample{Server: side, Concurrency: conc, Rep: rep, Streams: int(rate), Rate: rate, P50: p50, P99: 2 * p50,
		ServerCPU: cpu, LoadCPU: math.NaN(), ServerCores: 0.5}}
	if side == SideRedis {
		s.AdmitCalls, s.SettleCalls, s.Scripts, s.RoundTrips = 1, 0.5, 1.5, 1.6
	}
	return s
}

// The sides' runs are paired by repetition: the ratio of each pair, then their median.
func TestAggregatePairsAdjacentRuns(t *testing.T) {
	r := &Report{Samples: []Sample{
		sample(SideLocal, 64, 1, 1000, 100, 50), sample(SideRedis, 64, 1, 800, 150, 60),
		sample(SideRedis, 64, 2, 400, 300, 70), sample(SideLocal, 64, 2, 500, 200, 55),
		sample(SideLocal, 64, 3, 2000, 100, 50), sample(SideRedis, 64, 3, 1000, 100, 52),
	}}
	r.Levels = Aggregate(r.Samples)
	if len(r.Levels) != 1 {
		t.Fatalf("levels %+v", r.Levels)
	}
	lv := r.Levels[0]
	if lv.Ratio.Median != 0.8 || lv.Ratio.Min != 0.5 || lv.Ratio.Max != 0.8 {
		t.Errorf("ratios %+v, want median 0.8 of 0.8, 0.8 and 0.5", lv.Ratio)
	}
	if lv.AddedP50.Median != 50 || lv.AddedCPU.Median != 10 {
		t.Errorf("added p50 %+v, added CPU %+v", lv.AddedP50, lv.AddedCPU)
	}
	r.Targets = r.judge()
	if len(r.Targets) != 2 || r.Targets[0].Status != "met" || r.Targets[1].Status != "met" {
		t.Errorf("targets %+v", r.Targets)
	}
	r.Samples[1].AdmitCalls = 1.2
	r.Levels = Aggregate(r.Samples)
	if ts := r.judge(); ts[0].Status != "missed" {
		t.Errorf("1.2 admission calls per stream: %+v", ts[0])
	}
	md := r.Markdown()
	if !strings.Contains(md, "| 64 | 0.800 [0.500–0.800] |") {
		t.Errorf("the report does not show the paired ratio:\n%s", md)
	}
	// Unmeasured figures (NaN) are written as null, and the local side has no Redis figures.
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"load_cpu_us_per_stream":null`) || strings.Count(string(b), `"scripts_per_stream":1.5`) != 3 {
		t.Errorf("JSON: %s", b)
	}
}
