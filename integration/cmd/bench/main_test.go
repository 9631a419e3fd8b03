package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
)

// TestMain lets the test binary serve as the program's own server children, as the program
// does, and otherwise checks that no test leaves a goroutine behind.
func TestMain(m *testing.M) {
	if bench.IsChild(os.Args[1:]) {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	goleak.VerifyTestMain(m)
}

// TestRunSmall runs the whole program with tiny numbers: the three servers as processes, two
// load levels rotating, held streams, a profile; it checks the report's shape, not its numbers.
func TestRunSmall(t *testing.T) {
	// Race-enabled children would each sleep a second on exit to report late races.
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	args := []string{"--out", out, "--concurrency", "1,4", "--reps", "2", "--warmup", "50ms", "--duration", "250ms",
		"--held", "30", "--settle", "100ms", "--profile", "1s", "--profile-concurrency", "4", "--micro=false", "--bulkhead-in-process"}
	code := run(context.Background(), args, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d\n%s", code, stderr.String())
	}
	md := stdout.String()
	for _, want := range []string{"## Targets", "| Throughput |", "## Throughput and latency", "## Memory with held streams", "## Profile of llm-bulkhead", "## Profile of no-op", "flat%", "| replies ratio | work ratio |"} {
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
	var rep struct {
		Samples []bench.Sample `json:"samples"`
		Levels  []struct {
			Concurrency int `json:"concurrency"`
			Ratio       struct {
				N int `json:"n"`
			} `json:"throughput_ratio"`
			WorkRatio struct {
				N int `json:"n"`
			} `json:"work_ratio"`
		} `json:"levels"`
		Memory  []json.RawMessage `json:"memory"`
		Targets []bench.Target    `json:"targets"`
	}
	if err := json.Unmarshal(js, &rep); err != nil {
		t.Fatalf("report.json: %v", err)
	}
	if len(rep.Samples) != 3*2*2 || len(rep.Levels) != 2 || rep.Levels[1].Concurrency != 4 || rep.Levels[0].Ratio.N != 2 || rep.Levels[0].WorkRatio.N != 2 {
		t.Errorf("samples %d, levels %+v: want 12 samples, levels 1 and 4 with 2 paired ratios each", len(rep.Samples), rep.Levels)
	}
	for _, s := range rep.Samples {
		if s.Errors > 0 {
			t.Errorf("%s at %d: %d errors, first: %s", s.Server, s.Concurrency, s.Errors, s.FirstError)
		}
	}
	if len(rep.Memory) != 2 || len(rep.Targets) == 0 {
		t.Errorf("memory %d, targets %d", len(rep.Memory), len(rep.Targets))
	}
	for _, f := range []string{"llm-bulkhead-cpu.pprof", "llm-bulkhead-allocs.pprof", "no-op-cpu.pprof", "no-op-allocs.pprof"} {
		if st, err := os.Stat(filepath.Join(out, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", f, err)
		}
	}
}

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		check   func(bench.Config) bool
		wantErr bool
	}{
		{"defaults", nil, func(c bench.Config) bool {
			return c.Reps == 5 && c.Duration == 5*time.Second && c.Held == 10000 && c.ProfileSeconds == 10 &&
				slices.Equal(c.Concurrency, []int{1, 8, 64, 512}) && c.Micro && c.Replay && c.Out == "results/bench"
		}, false},
		{"quick shortens what is not given", []string{"--quick", "--reps", "3"}, func(c bench.Config) bool {
			return c.Reps == 3 && c.Duration == time.Second && c.Held == 1000 && c.ProfileSeconds == 2 && c.MicroCount == 1
		}, false},
		{"no load runs", []string{"--concurrency", ""}, func(c bench.Config) bool { return len(c.Concurrency) == 0 }, false},
		{"baseline", []string{"--baseline-bin", "/tmp/old"}, func(c bench.Config) bool { return c.BaselineBinary == "/tmp/old" }, false},
		{"same codec", []string{"--same-codec"}, func(c bench.Config) bool { return c.SameCodec }, false},
		{"bad level", []string{"--concurrency", "1,x"}, nil, true},
		{"zero level", []string{"--concurrency", "0"}, nil, true},
		{"fractional profile", []string{"--profile", "1500ms"}, nil, true},
		{"stray argument", []string{"extra"}, nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stderr bytes.Buffer
			c, err := parse(tt.args, &stderr)
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, want error %t", err, tt.wantErr)
			}
			if tt.check != nil && !tt.check(c) {
				t.Errorf("config %+v", c)
			}
		})
	}
}

// TestBaselineNeedsLoadRuns: a baseline binary is only loaded in the load runs, so asking for
// one without a load level is an error, not a run that silently ignores it.
func TestBaselineNeedsLoadRuns(t *testing.T) {
	var stdout, stderr bytes.Buffer
	args := []string{"--out", t.TempDir(), "--concurrency", "", "--baseline-bin", "/bin/true", "--held", "0", "--profile", "0", "--micro=false"}
	if code := run(context.Background(), args, &stdout, &stderr); code == 0 || !strings.Contains(stderr.String(), "baseline binary is only loaded in the load runs") {
		t.Errorf("exit %d, stderr %q", code, stderr.String())
	}
}
