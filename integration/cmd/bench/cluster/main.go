// Command cluster measures what cluster mode costs, for each of its admissions side by side in
// one run: "exact" (one script in Redis per admission) and "leased" (each replica admits against
// a lease of the fleet's limits, renewed every lease interval). It prints a Markdown report and
// writes it, with the JSON behind it, to --out.
//
// Usage (from the repository root; `make bench-cluster` runs it with the defaults):
//
//	go run ./integration/cmd/bench/cluster [--admission exact,leased] [--concurrency 1,64] [--reps 3]
//	    [--replicas 3,10,30] [--redis standalone,cluster] [--fleet-concurrency 4] [--behaviours] [--out DIR] …
//
// The servers are llm-bulkhead processes built with `go build` (or --bulkhead-bin) running
// examples/policy.yaml with the benchmark's limit overrides (every stream admitted, see
// integration/bench.LimitOverrides), with or without a cluster section naming a redis-server this
// program starts on a free loopback port (redis-server, and redis-cli for a Redis Cluster, must be
// on PATH). Three parts:
//
//  1. One replica per side — "local" (no cluster section) and one per admission, each admission
//     with a redis-server of its own — under the same closed-loop load, the sides rotating which
//     goes first: streams/s, per-stream latency p50/p99 and the server's CPU per stream; each
//     admission's added latency and CPU against local, per repetition; and, over each run's
//     measured window, Redis's work per admission: the commands clients sent (INFO commandstats,
//     without those the scripts run), the commands run inside scripts, Redis's CPU time
//     (/proc/<pid>/stat), the replica's own calls to Redis by operation.
//  2. Fleets: for each Redis (one server, or a three-node Redis Cluster), each number of replicas
//     and each admission, a fresh fleet of separate processes under --fleet-concurrency streams
//     each: total streams/s and the same Redis work per admission, summed over the Redis nodes.
//     Redis's CPU with no client connected is read first, over 3 s (its own timers; a Redis
//     Cluster's bus between its nodes), and the CPU target is judged on what the fleet adds.
//  3. Behaviours of leased admission (--behaviours): replicas sharing a compartment whose
//     max_concurrent (--limit) binds, behind an upstream that holds each request --hold and counts
//     the requests it holds at once. Skew: one replica gets --skew of the clients; how many lease
//     intervals until its lease follows (GET /admin/cluster). Churn: a replica joins, then one is
//     killed with SIGKILL; how long until the leases rebalance. Throughout, the most requests the
//     upstream held at once, and the most the replicas' GET /admin/compartments said they held,
//     against the limit.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
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

// Admissions (cluster.admission) and the Redis of a fleet.
const (
	Exact           = "exact"
	Leased          = "leased"
	RedisStandalone = "standalone"
	RedisCluster    = "cluster"
)

// Config is one benchmark run.
type Config struct {
	Out string
	// Admissions are the cluster admissions measured, each against local and in every fleet.
	Admissions []string
	// Levels are the concurrencies at which the sides are compared (none: no comparison).
	Levels []int
	Reps   int
	// Warmup and Duration are each load run's unmeasured and measured parts.
	Warmup, Duration time.Duration
	MessageTimeout   time.Duration
	// Replicas are the fleets' sizes (none: no fleet runs), Redis the Redis they share
	// (standalone, cluster); FleetConcurrency is per replica.
	Replicas                    []int
	Redis                       []string
	FleetConcurrency, FleetReps int
	// FleetDuration is each fleet run's measured part.
	FleetDuration time.Duration
	// RedisTimeout, LeaseInterval and LeaseTTL are the cluster section's timeout,
	// lease_interval and lease_ttl.
	RedisTimeout, LeaseInterval, LeaseTTL time.Duration
	// Behaviours runs skew and churn (leased admission) with BehaviourReplicas replicas, Clients
	// closed-loop clients each, a compartment limited to Limit, an upstream holding each request
	// Hold; Skew is the share of the clients one replica gets; Phase the length of each phase.
	Behaviours        bool
	BehaviourReplicas int
	Clients, Limit    int
	Skew              float64
	Hold, Phase       time.Duration
	// PolicyPath is the policy every side runs (with LimitOverrides).
	PolicyPath string
	// BulkheadBinary is a prebuilt llm-bulkhead; empty builds one.
	BulkheadBinary string
	Command        string
}

func parse(args []string, stderr io.Writer) (Config, error) {
	fs := flag.NewFlagSet("bench-cluster", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("out", "results/bench-cluster", "directory for report.md and report.json")
	admissions := fs.String("admission", Exact+","+Leased, "cluster admissions to measure, comma-separated: exact (one script per admission), leased (admission against a lease)")
	levels := fs.String("concurrency", "1,64", "comma-separated load levels (concurrent streams) at which one replica of each admission is compared with one without a cluster (empty: no comparison)")
	reps := fs.Int("reps", 3, "repetitions per side and level (the sides rotate which goes first)")
	dur := fs.Duration("duration", 3*time.Second, "measured part of each load run")
	warm := fs.Duration("warmup", time.Second, "unmeasured start of each load run")
	msgTimeout := fs.Duration("message-timeout", 30*time.Second, "the simulated filter's message_timeout")
	replicas := fs.String("replicas", "3,10,30", "fleet sizes, comma-separated: replicas (separate processes) sharing one Redis, each under --fleet-concurrency streams (0 or empty: no fleet runs)")
	redisKinds := fs.String("redis", RedisStandalone+","+RedisCluster, "the Redis the fleets share, comma-separated: standalone (one redis-server), cluster (a Redis Cluster of three masters)")
	fleetConc := fs.Int("fleet-concurrency", 4, "concurrent streams per replica in the fleet runs (modest: every replica, Redis and the load share this machine's cores)")
	fleetReps := fs.Int("fleet-reps", 2, "load runs per fleet")
	fleetDur := fs.Duration("fleet-duration", 10*time.Second, "measured part of each fleet run: a multiple of the replicas' usage flush (every "+
		cluster.UsageFlushInterval.String()+", all at once in a fleet started together), so that every window holds as many")
	redisTimeout := fs.Duration("redis-timeout", time.Second, "cluster.timeout (at most 1s): long, so that a loaded machine never turns an exact admission into a local one")
	leaseInterval := fs.Duration("lease-interval", 200*time.Millisecond, "cluster.lease_interval of the leased sides")
	leaseTTL := fs.Duration("lease-ttl", 10*time.Second, "cluster.lease_ttl of every cluster side (the churn's killed replica's share comes back after it)")
	behaviours := fs.Bool("behaviours", true, "measure leased admission's skew and churn (needs --admission to include leased)")
	behReplicas := fs.Int("behaviour-replicas", 3, "replicas of the skew and churn runs (one more joins during the churn)")
	clients := fs.Int("clients", 12, "closed-loop clients per replica in the skew and churn runs, before the skew")
	limit := fs.Int("limit", 24, "max_concurrent of feature/chat in the skew and churn runs: less than the clients, so that it binds")
	skew := fs.Float64("skew", 0.8, "share of all clients that the skewed replica gets")
	hold := fs.Duration("hold", 50*time.Millisecond, "how long the skew and churn runs' upstream holds each request")
	phase := fs.Duration("phase", 3*time.Second, "length of each phase of the skew and churn runs (the kill's lasts lease_ttl more)")
	policyPath := fs.String("policy", "examples/policy.yaml", "the policy every side runs")
	bin := fs.String("bulkhead-bin", "", "a prebuilt llm-bulkhead binary (default: go build -tags vtprotobuf ./cmd/llm-bulkhead into a temporary directory)")
	if err := fs.Parse(args); err != nil {
		return Config{}, err
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var errs []error
	lv, err := positiveInts("--concurrency", *levels, false)
	errs = append(errs, err)
	rs, err := positiveInts("--replicas", *replicas, true)
	errs = append(errs, err)
	adm, err := names("--admission", *admissions, Exact, Leased)
	errs = append(errs, err)
	rk, err := names("--redis", *redisKinds, RedisStandalone, RedisCluster)
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return Config{}, err
	}
	cfg := Config{Out: *out, Admissions: adm, Levels: lv, Reps: *reps, Warmup: *warm, Duration: *dur, MessageTimeout: *msgTimeout,
		Replicas: rs, Redis: rk, FleetConcurrency: *fleetConc, FleetReps: *fleetReps, FleetDuration: *fleetDur, RedisTimeout: *redisTimeout,
		LeaseInterval: *leaseInterval, LeaseTTL: *leaseTTL, Behaviours: *behaviours, BehaviourReplicas: *behReplicas,
		Clients: *clients, Limit: *limit, Skew: *skew, Hold: *hold, Phase: *phase, PolicyPath: *policyPath, BulkheadBinary: *bin}
	return cfg, cfg.validate()
}

// positiveInts reads a comma-separated list of positive integers; zero0 lets "0" stand for none.
func positiveInts(flag, s string, zero0 bool) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if zero0 && err == nil && n == 0 {
			continue
		}
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%s: %q is not a positive integer", flag, f)
		}
		out = append(out, n)
	}
	return out, nil
}

// names reads a comma-separated list of some of known, each once.
func names(flag, s string, known ...string) ([]string, error) {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		if !slices.Contains(known, f) || slices.Contains(out, f) {
			return nil, fmt.Errorf("%s: %q is not one of %s (each once)", flag, f, strings.Join(known, ", "))
		}
		out = append(out, f)
	}
	return out, nil
}

// leased reports whether the run measures leased admission.
func (c Config) leased() bool { return slices.Contains(c.Admissions, Leased) }

func (c Config) validate() error {
	var errs []error
	if c.Out == "" {
		errs = append(errs, errors.New("--out is required"))
	}
	if len(c.Admissions) == 0 {
		errs = append(errs, errors.New("--admission names no admission"))
	}
	if len(c.Levels) == 0 && len(c.Replicas) == 0 && !c.Behaviours {
		errs = append(errs, errors.New("nothing to measure: no --concurrency level, no --replicas and --behaviours=false"))
	}
	if c.Reps < 1 || c.Duration <= 0 || c.Warmup < 0 {
		errs = append(errs, errors.New("load runs need --reps ≥ 1, a positive --duration and a non-negative --warmup"))
	}
	if len(c.Replicas) > 0 {
		if slices.Contains(c.Replicas, 1) || c.FleetConcurrency < 1 || c.FleetReps < 1 || c.FleetDuration <= 0 || len(c.Redis) == 0 {
			errs = append(errs, errors.New("the fleet runs need --replicas of 2 or more (0: none), --fleet-concurrency ≥ 1, --fleet-reps ≥ 1, a positive --fleet-duration and a --redis"))
		}
	}
	if c.RedisTimeout <= 0 || c.RedisTimeout > time.Second {
		errs = append(errs, errors.New("--redis-timeout must lie in (0, 1s] (cluster.timeout's range)"))
	}
	if c.LeaseTTL < time.Second || c.LeaseInterval < 10*time.Millisecond || 4*c.LeaseInterval > c.LeaseTTL {
		errs = append(errs, errors.New("--lease-ttl must be at least 1s and --lease-interval between 10ms and a quarter of it (the policy's own bounds)"))
	}
	if c.MessageTimeout <= 0 {
		errs = append(errs, errors.New("--message-timeout must be positive"))
	}
	if c.Behaviours {
		switch {
		case !c.leased():
			errs = append(errs, errors.New("--behaviours measure leased admission: add leased to --admission, or --behaviours=false"))
		case c.BehaviourReplicas < 2 || c.Clients < 1 || c.Limit < c.BehaviourReplicas+1 || c.Limit >= c.BehaviourReplicas*c.Clients:
			errs = append(errs, errors.New("the skew and churn runs need --behaviour-replicas ≥ 2, and a --limit above the replicas' number and below all their --clients (so that it binds)"))
		case c.Skew <= 1/float64(c.BehaviourReplicas) || c.Skew >= 1 || c.Hold <= 0 || c.Phase <= 0:
			errs = append(errs, errors.New("--skew must lie between an even share and 1, and --hold and --phase must be positive"))
		}
	}
	return errors.Join(errs...)
}
