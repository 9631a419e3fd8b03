package main

import (
	"bytes"
	"context"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/integration/storm"
)

// TestMain lets the test binary act as a replica (the demo starts replicas by running its own
// executable with the replica subcommand), and otherwise checks that no test leaves a goroutine
// behind.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == cmdReplica {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		code := runReplica(ctx, os.Args[2:], os.Stderr)
		stop()
		os.Exit(code)
	}
	goleak.VerifyTestMain(m)
}

// A shortened demo: three replicas sharing the example policy through Redis hold its limits for
// the whole fleet, and the same replicas without the cluster section let the fleet exceed them.
func TestFleetHoldsThePolicysLimitsOnlyWhenShared(t *testing.T) {
	redistest.Require(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// cluster.timeout is generous so that a loaded machine never makes a replica decide without
	// Redis: the shared limits would then be held only approximately.
	o := demoOptions(self, "../../../examples/policy.yaml", 3, 8*time.Second, time.Second, 0.4, 1, 10, time.Second)
	var progress bytes.Buffer
	o.Progress = &progress
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := Demo(ctx, o)
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, progress.String())
	}
	var report bytes.Buffer
	printReport(&report, res)
	t.Log("\n" + progress.String() + report.String())

	l := res.Limits
	if l.Batch != 4 || l.PaidTokens != 50000 || l.BatchTokens != 75000 {
		t.Fatalf("limits read from the example policy: %+v, want batch 4 in flight, 50000 paid and 75000 batch tokens a minute", l)
	}
	shared, local := res.Run(ModeShared), res.Run(ModePerProcess)
	if shared == nil || local == nil {
		t.Fatalf("runs: %+v", res.Runs)
	}
	if shared.WithoutRedis != 0 {
		t.Errorf("shared run: %d admissions decided without Redis", shared.WithoutRedis)
	}
	// Shared: the fleet holds every limit, and the storm did reach them.
	if got := shared.Peak[storm.FeatureBatch]; got < 1 || int64(got) > l.Batch {
		t.Errorf("shared run: %d batch requests in flight at once across the fleet, want 1 to %d", got, l.Batch)
	}
	if got := shared.Peak[storm.FeatureChat]; got < 1 || int64(got) > l.Chat {
		t.Errorf("shared run: %d chat requests in flight at once across the fleet, want 1 to %d", got, l.Chat)
	}
	if shared.PaidTokens <= 0 || shared.PaidTokens > l.PaidTokens {
		t.Errorf("shared run: %d batch tokens on paid providers, want some and at most %d", shared.PaidTokens, l.PaidTokens)
	}
	if shared.BatchTokens > l.BatchTokens {
		t.Errorf("shared run: %d batch tokens, want at most %d", shared.BatchTokens, l.BatchTokens)
	}
	if shared.Fleet[storm.FeatureBatch].Degraded == 0 {
		t.Errorf("shared run: no batch request was degraded to the local model once the paid budget was spent")
	}
	// Per process: each replica enforces the limits alone, so the fleet exceeds them.
	if got := local.Peak[storm.FeatureBatch]; int64(got) <= l.Batch {
		t.Errorf("per-process run: %d batch requests in flight at once across the fleet, want more than %d", got, l.Batch)
	}
	if local.PaidTokens <= l.PaidTokens {
		t.Errorf("per-process run: %d batch tokens on paid providers, want more than %d", local.PaidTokens, l.PaidTokens)
	}
	// Every replica took part in both runs.
	for _, run := range res.Runs {
		for i, c := range run.Replicas {
			if len(c) == 0 {
				t.Errorf("%s run: replica r%d decided nothing", run.Mode, i+1)
			}
		}
	}
	if !strings.Contains(report.String(), "EXCEEDED") || !strings.Contains(report.String(), "held") {
		t.Errorf("the report does not say which limits held and which were exceeded:\n%s", report.String())
	}
}

func TestBadUsage(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := run(context.Background(), []string{"--replicas", "1", "--modes", ModePerProcess}, &out, &errOut); code != 1 {
		t.Errorf("one replica: exit %d, want 1\n%s", code, errOut.String())
	}
	if code := run(context.Background(), []string{"extra"}, &out, &errOut); code != 2 {
		t.Errorf("unexpected argument: exit %d, want 2", code)
	}
	if code := run(context.Background(), []string{"--modes", "bogus", "--policy", "../../../examples/policy.yaml"}, &out, &errOut); code != 1 {
		t.Errorf("unknown mode: exit %d, want 1", code)
	}
}
