// Command cluster measures what cluster mode costs: llm-bulkhead admitting through Redis
// against llm-bulkhead admitting locally, under the same Envoy simulator load in the same run,
// and what one Redis does for three replicas. It prints a Markdown report and writes it, with
// the JSON behind it, to --out.
//
// Usage (from the repository root; `make bench-cluster` runs it with the defaults):
//
//	go run ./integration/cmd/bench/cluster [--concurrency 1,64] [--reps 3] [--duration 3s]
//	    [--warmup 1s] [--replicas 3] [--fleet-concurrency 64] [--out DIR] …
//
// The servers are llm-bulkhead processes built with `go build` (or --bulkhead-bin) running
// examples/policy.yaml with the benchmark's limit overrides (every stream admitted, see
// integration/bench.LimitOverrides): "local" without a cluster section, "redis" with one naming
// a redis-server this program starts on a free loopback port (it must be on PATH).
//
// Measured, per load level and repetition, the two servers alternating:
//   - streams/s, per-stream latency p50/p99 and the server's CPU per stream (integration/bench's
//     closed-loop load), and the redis/local ratios and differences of each pair of runs;
//   - on the Redis side: Redis's command counters (INFO commandstats and total_commands_processed)
//     before and after, divided by the admissions the replica counted: scripts (round trips) per
//     stream, all client commands per stream, commands run inside Redis per stream; Redis's CPU
//     time (/proc/<pid>/stat) per stream; the replica's own count of admission and settlement
//     calls and its histogram of the admission script's round trip.
//
// Then three replicas with the cluster section share one Redis, each under the same load at
// --fleet-concurrency streams: total streams/s, Redis's CPU use and CPU per stream, and the
// ceiling that implies for one Redis core.
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
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is main without the process: it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parse(args, stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, "bench-cluster:", err)
		return 2
	}
	cfg.Command = strings.TrimSpace("go run ./integration/cmd/bench/cluster " + strings.Join(args, " "))
	rep, err := Run(ctx, cfg, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "bench-cluster:", err)
		return 1
	}
	fmt.Fprint(stdout, rep.Markdown())
	fmt.Fprintf(stderr, "report written to %s/report.md and %s/report.json\n", cfg.Out, cfg.Out)
	return 0
}

// Config is one benchmark run.
type Config struct {
	Out string
	// Levels are the concurrencies at which local and Redis admission are compared.
	Levels []int
	Reps   int
	// Warmup and Duration are each load run's unmeasured and measured parts.
	Warmup, Duration time.Duration
	MessageTimeout   time.Duration
	// Replicas, FleetConcurrency (per replica) and FleetReps shape the fleet run (0 replicas:
	// none).
	Replicas, FleetConcurrency, FleetReps int
	// RedisTimeout is the cluster.timeout of the Redis side.
	RedisTimeout time.Duration
	// PolicyPath is the policy both sides run (with LimitOverrides).
	PolicyPath string
	// BulkheadBinary is a prebuilt llm-bulkhead; empty builds one.
	BulkheadBinary string
	Command        string
}

func parse(args []string, stderr io.Writer) (Config, error) {
	fs := flag.NewFlagSet("bench-cluster", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("out", "results/bench-cluster", "directory for report.md and report.json")
	levels := fs.String("concurrency", "1,64", "comma-separated load levels (concurrent streams) for local against Redis admission")
	reps := fs.Int("reps", 3, "repetitions per side and level (the sides alternate)")
	dur := fs.Duration("duration", 3*time.Second, "measured part of each load run")
	warm := fs.Duration("warmup", time.Second, "unmeasured start of each load run")
	msgTimeout := fs.Duration("message-timeout", 30*time.Second, "the simulated filter's message_timeout")
	replicas := fs.Int("replicas", 3, "replicas sharing one Redis in the fleet run (0: no fleet run)")
	fleetConc := fs.Int("fleet-concurrency", 64, "concurrent streams per replica in the fleet run")
	fleetReps := fs.Int("fleet-reps", 3, "repetitions of the fleet run")
	redisTimeout := fs.Duration("redis-timeout", time.Second, "cluster.timeout of the Redis side (at most 1s): long, so that a loaded machine never turns a Redis admission into a local one")
	policyPath := fs.String("policy", "examples/policy.yaml", "the policy both sides run")
	bin := fs.String("bulkhead-bin", "", "a prebuilt llm-bulkhead binary (default: go build -tags vtprotobuf ./cmd/llm-bulkhead into a temporary directory)")
	if err := fs.Parse(args); err != nil {
		return Config{}, err
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var lv []int
	for _, f := range strings.Split(*levels, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return Config{}, fmt.Errorf("--concurrency: %q is not a positive integer", f)
		}
		lv = append(lv, n)
	}
	cfg := Config{Out: *out, Levels: lv, Reps: *reps, Warmup: *warm, Duration: *dur, MessageTimeout: *msgTimeout,
		Replicas: *replicas, FleetConcurrency: *fleetConc, FleetReps: *fleetReps, RedisTimeout: *redisTimeout,
		PolicyPath: *policyPath, BulkheadBinary: *bin}
	return cfg, cfg.validate()
}

func (c Config) validate() error {
	var errs []error
	if c.Out == "" {
		errs = append(errs, errors.New("--out is required"))
	}
	if len(c.Levels) == 0 && c.Replicas == 0 {
		errs = append(errs, errors.New("nothing to measure: no --concurrency level and --replicas 0"))
	}
	if c.Reps < 1 || c.Duration <= 0 || c.Warmup < 0 {
		errs = append(errs, errors.New("load runs need --reps ≥ 1, a positive --duration and a non-negative --warmup"))
	}
	if c.Replicas == 1 || c.Replicas < 0 || (c.Replicas > 1 && (c.FleetConcurrency < 1 || c.FleetReps < 1)) {
		errs = append(errs, errors.New("the fleet run needs --replicas ≥ 2 (or 0: none), --fleet-concurrency ≥ 1 and --fleet-reps ≥ 1"))
	}
	if c.RedisTimeout <= 0 || c.RedisTimeout > time.Second {
		errs = append(errs, errors.New("--redis-timeout must lie in (0, 1s] (cluster.timeout's range)"))
	}
	if c.MessageTimeout <= 0 {
		errs = append(errs, errors.New("--message-timeout must be positive"))
	}
	return errors.Join(errs...)
}
