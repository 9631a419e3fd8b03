package storm

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestStormSmoke runs a small storm twenty times faster than real time through every default
// configuration and checks its structure: every configuration ran, the counts add up, pass-
// through refuses nothing, enforce mode refuses batch requests for their compartments and
// budgets, and shadow mode refuses nothing while counting what it would refuse. Latencies are
// the report's business, not this test's.
func TestStormSmoke(t *testing.T) {
	sc := DefaultScenario()
	sc.Duration = 10 * time.Second
	sc.Chat = []TenantShare{{Tenant: "acme", Users: 6}, {Tenant: "globex", Users: 2}}
	sc.ThinkMin, sc.ThinkMax = time.Second, 3*time.Second
	sc.StormAt = 2 * time.Second
	// Sequential workers keep the burst small enough for Envoy's 200 ms message timeout under
	// the race detector; ten of them still overrun the batch compartments and budget.
	sc.BatchWorkerConcurrency = 1
	cfgs, err := SelectConfigurations(StandardConfigurations(examplePolicy, pooledPolicy), DefaultConfigurationNames)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ticks, admitted := 0, 0
	rep, err := Run(ctx, Options{Scenario: sc, Configurations: cfgs, TimeScale: 0.05, Seed: 7, Capacity: 10,
		ProgressInterval: 50 * time.Millisecond,
		Progress: func(t Tick) {
			ticks++
			for _, f := range t.Features {
				admitted += f.Admitted
			}
		}})
	if err != nil {
		t.Fatal(err)
	}

	if len(rep.Runs) != len(cfgs) {
		t.Fatalf("%d runs for %d configurations", len(rep.Runs), len(cfgs))
	}
	for _, cs := range rep.Configurations {
		if cs.Runs != 1 {
			t.Errorf("%s ran %d times, want 1", cs.Name, cs.Runs)
		}
	}
	docs := sc.BatchWorkers * sc.BatchPerWorker
	for _, r := range rep.Runs {
		t.Run(r.Configuration, func(t *testing.T) {
			t.Logf("%.2f s of wall time", r.WallSeconds)
			cfg := rep.Config(r.Configuration).Configuration
			s := r.Summary
			// Every chat request is answered, refused or failed, and the counts agree.
			if s.ChatRequests == 0 || s.ChatRequests != len(r.Chat) || s.ChatOK+s.ChatRefused+s.ChatErrors != s.ChatRequests {
				t.Errorf("chat: %d requests, %d samples, %d ok + %d refused + %d failed", s.ChatRequests, len(r.Chat), s.ChatOK, s.ChatRefused, s.ChatErrors)
			}
			if sum(r.Refusals[FeatureChat]) != s.ChatRefused || sum(r.Errors[FeatureChat]) != s.ChatErrors || r.Answered[FeatureChat] != s.ChatOK {
				t.Errorf("chat counters %v / %v / %d disagree with the samples %+v", r.Refusals[FeatureChat], r.Errors[FeatureChat], r.Answered[FeatureChat], s)
			}
			if r.Admitted[FeatureChat] < s.ChatOK {
				t.Errorf("%d chat answers but only %d reached the upstream", s.ChatOK, r.Admitted[FeatureChat])
			}
			// Every document ends once; every attempt is answered, refused or failed.
			if cfg.Storm {
				if len(r.Batch) != docs || s.BatchDocuments != docs {
					t.Errorf("%d documents reported of %d", len(r.Batch), docs)
				}
				attempts := r.Answered[FeatureBatch] + sum(r.Refusals[FeatureBatch]) + sum(r.Errors[FeatureBatch])
				if s.BatchAttempts != attempts || s.BatchDone != r.Answered[FeatureBatch] {
					t.Errorf("batch: %d attempts, %d done; counters say %d answered, %v refused, %v failed",
						s.BatchAttempts, s.BatchDone, r.Answered[FeatureBatch], r.Refusals[FeatureBatch], r.Errors[FeatureBatch])
				}
				if r.StormStart == nil || r.StormEnd == nil || *r.StormEnd < *r.StormStart {
					t.Errorf("storm window %v–%v", r.StormStart, r.StormEnd)
				}
			} else if len(r.Batch) != 0 || r.Admitted[FeatureBatch] != 0 {
				t.Errorf("batch traffic without a storm: %d documents", len(r.Batch))
			}

			switch {
			case cfg.PassThrough():
				if len(r.Refusals) != 0 || r.Engine != nil {
					t.Errorf("pass-through refused %v (engine %v)", r.Refusals, r.Engine)
				}
				if cfg.Storm && (s.BatchDone != docs || r.Admitted[FeatureBatch] != docs) {
					t.Errorf("pass-through finished %d of %d documents (errors %v)", s.BatchDone, docs, r.Errors)
				}
			case cfg.Shadow:
				if len(r.Refusals) != 0 {
					t.Errorf("shadow mode refused %v", r.Refusals)
				}
				if sum(s.Shadow) == 0 {
					t.Errorf("shadow mode counted nothing it would refuse: %v", r.Engine.ShadowRejections)
				}
			default:
				b := r.Refusals[FeatureBatch]
				if b["bulkhead_full"]+b["token_budget"] == 0 {
					t.Errorf("enforce mode refused no batch request for its compartments or budgets: %v", r.Refusals)
				}
				// Every refusal names its compartment, the counts by compartment add up to the
				// counts by reason, and every refusing compartment's limits were read.
				for feature, byComp := range r.RefusedBy {
					byReason := map[string]int{}
					for comp, reasons := range byComp {
						if comp == "" {
							t.Errorf("%s refusals without a compartment: %v", feature, reasons)
						}
						if l, ok := r.Engine.Limits[comp]; !ok || l == (CompartmentLimits{}) {
							t.Errorf("no limits read for %s: %+v", comp, r.Engine.Limits)
						}
						for reason, n := range reasons {
							byReason[reason] += n
						}
					}
					if !maps.Equal(byReason, r.Refusals[feature]) {
						t.Errorf("%s: refusals by compartment add up to %v, by reason %v", feature, byReason, r.Refusals[feature])
					}
				}
				for _, d := range r.Batch {
					if d.Outcome == OutcomeRefused && (d.Compartment == "" || d.RetryAfter <= 0) {
						t.Errorf("given-up document without its compartment or retry-after: %+v", d)
					}
				}
				// What the clients were told agrees with what the engine decided, except where
				// Envoy's message timeout answered a request before the engine did.
				for _, d := range r.Engine.Decisions {
					if d.Feature != FeatureBatch {
						continue
					}
					late := sum(r.Errors[FeatureBatch])
					for _, reason := range []string{"bulkhead_full", "token_budget"} {
						if n := int(d.Rejected[reason]); n < b[reason] || n > b[reason]+late {
							t.Errorf("%s: engine refused %d, clients saw %d refusals and %d other failures", reason, n, b[reason], late)
						}
					}
				}
			}
		})
	}
	total := 0
	for _, r := range rep.Runs {
		total += sum(r.Admitted)
	}
	if ticks == 0 || admitted == 0 || admitted > total {
		t.Errorf("%d progress reports counted %d admissions of %d", ticks, admitted, total)
	}

	dir := t.TempDir()
	if err := rep.WriteFiles(dir); err != nil {
		t.Fatal(err)
	}
	svg, err := os.ReadFile(filepath.Join(dir, FileChart))
	if err != nil {
		t.Fatal(err)
	}
	if n := wellFormed(t, svg); n["polyline"] != len(cfgs) {
		t.Errorf("%d lines in the chart, want %d", n["polyline"], len(cfgs))
	}
	if rows := strings.Count(rep.Markdown(), "\n| "); rows != len(cfgs) {
		t.Errorf("%d table rows, want %d", rows, len(cfgs))
	}
}
