// Command bench compares llm-bulkhead, running the example policy, with a no-op ext_proc
// server under the same Envoy simulator load, measures both servers' memory with thousands of
// streams held open, profiles both under load and collects the hot-path Go benchmarks. It prints a Markdown report and writes it, with the JSON behind it, the
// profiles and the raw benchmark output, to --out.
//
// Usage (from the repository root; `make bench` runs it with the defaults):
//
//	go run ./integration/cmd/bench [--quick] [--out DIR] [--concurrency 1,8,64,512] [--reps 5]
//	    [--duration 5s] [--warmup 1s] [--held 10000] [--profile 10s] [--trace] [--micro=true] [--replay=true]
//	    [--server-cpus 1 --load-cpus 0] …
//
// The servers run as child processes: llm-bulkhead from a binary built with `go build`, the
// no-op server (and both profiled servers) as subcommands of this program.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// run is main without the process: it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if bench.IsChild(args) {
		if err := bench.RunChild(ctx, args, stderr); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			return 1
		}
		return 0
	}
	cfg, err := parse(args, stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, "bench:", err)
		return 2
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return 1
	}
	cfg.Self = []string{self}
	cfg.Command = strings.TrimSpace("go run ./integration/cmd/bench " + strings.Join(args, " "))
	rep, err := bench.Run(ctx, cfg, stderr)
	if rep != nil && err == nil {
		fmt.Fprint(stdout, rep.Markdown())
		fmt.Fprintf(stderr, "report written to %s/report.md and %s/report.json\n", cfg.Out, cfg.Out)
	}
	if err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return 1
	}
	return 0
}

// parse reads the flags; --quick changes the defaults of the flags not given.
func parse(args []string, stderr io.Writer) (bench.Config, error) {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("out", "results/bench", "directory for report.md, report.json, profiles and raw benchmark output")
	quick := fs.Bool("quick", false, "a short run: 1 repetition of 1s, 1000 held streams, a 2s profile, short micro-benchmarks")
	conc := fs.String("concurrency", "1,8,64,512", "comma-separated load levels (concurrent streams); empty: no load runs")
	reps := fs.Int("reps", 5, "repetitions per server and level (the servers alternate)")
	dur := fs.Duration("duration", 5*time.Second, "measured part of each run")
	warm := fs.Duration("warmup", time.Second, "unmeasured start of each run")
	msgTimeout := fs.Duration("message-timeout", 30*time.Second, "the simulated filter's message_timeout during the loads")
	held := fs.Int("held", bench.TargetHeldStreams, "streams held open for the memory measurement (0: skip)")
	heldReps := fs.Int("held-reps", 1, "memory measurements per server, each in a fresh process")
	heldTimeout := fs.Duration("held-timeout", 2*time.Minute, "time allowed to open all held streams")
	settle := fs.Duration("settle", time.Second, "quiet time before each memory measurement (and warm-up before the idle one)")
	prof := fs.Duration("profile", 10*time.Second, "length of each server's CPU profile, whole seconds (0: no profiles)")
	profConc := fs.Int("profile-concurrency", 64, "load level while profiling")
	trace := fs.Bool("trace", false, "also take a runtime execution trace of each profiled server (and the replay server) and split each message-and-reply exchange into hand-off, handler, write and the proxy's side")
	micro := fs.Bool("micro", true, "run the hot-path Go benchmarks with go test")
	microTime := fs.String("micro-benchtime", "1s", "-benchtime of the micro-benchmarks")
	microCount := fs.Int("micro-count", 3, "-count of the micro-benchmarks (the report shows medians)")
	bin := fs.String("bulkhead-bin", "", "a prebuilt llm-bulkhead binary (default: go build -tags vtprotobuf ./cmd/llm-bulkhead into a temporary directory)")
	baseline := fs.String("baseline-bin", "", "a second llm-bulkhead binary (an earlier build) loaded in the same rotation, to measure a change against it")
	sameCodec := fs.Bool("same-codec", false, "give the no-op and replay servers llm-bulkhead's gRPC codec, so the difference is llm-bulkhead's work alone")
	replay := fs.Bool("replay", true, "also load the replay server (llm-bulkhead's recorded replies, no policy work) to split the difference")
	serverCPUs := fs.String("server-cpus", "", "pin every server process to these CPUs with taskset, e.g. 1 (empty: not pinned)")
	loadCPUs := fs.String("load-cpus", "", "pin this program, the load generator, to these CPUs, e.g. 0 (empty: not pinned)")
	inProc := fs.Bool("bulkhead-in-process", false, "run llm-bulkhead from this program (same app package) instead of the binary; skips the build")
	if err := fs.Parse(args); err != nil {
		return bench.Config{}, err
	}
	if fs.NArg() > 0 {
		return bench.Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if *quick {
		quickDefaults := map[string]func(){
			"reps":            func() { *reps = 1 },
			"duration":        func() { *dur = time.Second },
			"warmup":          func() { *warm = 300 * time.Millisecond },
			"held":            func() { *held = 1000 },
			"profile":         func() { *prof = 2 * time.Second },
			"micro-benchtime": func() { *microTime = "100ms" },
			"micro-count":     func() { *microCount = 1 },
		}
		for name, set := range quickDefaults {
			if !given[name] {
				set()
			}
		}
	}
	levels, err := parseLevels(*conc)
	if err != nil {
		return bench.Config{}, err
	}
	pinServers, err := bench.ParseCPUList(*serverCPUs)
	if err != nil {
		return bench.Config{}, fmt.Errorf("--server-cpus: %w", err)
	}
	pinLoad, err := bench.ParseCPUList(*loadCPUs)
	if err != nil {
		return bench.Config{}, fmt.Errorf("--load-cpus: %w", err)
	}
	if *prof%time.Second != 0 {
		return bench.Config{}, fmt.Errorf("--profile %s: whole seconds only", *prof)
	}
	return bench.Config{
		Out: *out, Concurrency: levels, Reps: *reps, Warmup: *warm, Duration: *dur, MessageTimeout: *msgTimeout,
		Held: *held, HeldReps: *heldReps, HeldTimeout: *heldTimeout, Settle: *settle,
		ProfileSeconds: int(*prof / time.Second), ProfileConcurrency: *profConc, Trace: *trace,
		Micro: *micro, MicroBenchtime: *microTime, MicroCount: *microCount,
		BulkheadBinary: *bin, BaselineBinary: *baseline, SameCodec: *sameCodec, BulkheadInProcess: *inProc, Replay: *replay,
		ServerCPUs: pinServers, LoadCPUs: pinLoad,
	}, nil
}

func parseLevels(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("--concurrency: %q is not a positive integer", f)
		}
		out = append(out, n)
	}
	return out, nil
}
