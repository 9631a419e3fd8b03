// Command clusterdemo shows cluster mode at work: three llm-bulkhead replicas run the example
// policy, a batch storm and chat users are spread over them round robin (as Envoy spreads its
// streams over the replicas of the ext_proc cluster), and every limit the policy sets holds for
// the whole fleet because the replicas keep them in one Redis. For contrast it runs the same
// traffic again with the policy's cluster section removed: each replica then enforces every
// limit on its own, and the fleet admits about three times as much.
//
//	clusterdemo [--replicas 3] [--duration 20s] [--time-scale 0.4] [--modes shared,per-process] …
//
// It starts redis-server (on a free port of 127.0.0.1, without persistence; it must be on
// PATH), the replicas (this program run as `clusterdemo replica --config FILE`: the server of
// `llm-bulkhead serve`), mockllm and the Envoy simulator, and stops them all when it ends or is
// interrupted. Run it from the repository root (the default policy path is relative to it);
// `make cluster-demo` does.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/integration/cmd/clusterdemo/fleet"
	"github.com/llm-bulkhead/llm-bulkhead/integration/storm"
)

// cmdReplica is the subcommand that runs one replica.
const cmdReplica = "replica"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the whole command; it returns the exit status: 0 success, 1 failure, 2 bad usage.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == cmdReplica {
		return runReplica(ctx, args[1:], stderr)
	}
	fs := flag.NewFlagSet("clusterdemo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		policyPath   = fs.String("policy", "examples/policy.yaml", "the policy every replica runs (its cluster section is replaced)")
		replicas     = fs.Int("replicas", 3, "llm-bulkhead replicas")
		duration     = fs.Duration("duration", 20*time.Second, "simulated length of each run (under a minute: token budgets count per minute)")
		stormAt      = fs.Duration("storm-at", 2*time.Second, "simulated time at which the batch export starts")
		scale        = fs.Float64("time-scale", 0.4, "time scale of mockllm, think times and the policy's waits (1 is real time)")
		seed         = fs.Uint64("seed", 1, "seed of think times and mockllm latencies")
		capacity     = fs.Int("capacity", 10, "requests the mock LLM serves at once; the rest queue FIFO (0: unlimited)")
		redisTimeout = fs.Duration("redis-timeout", 250*time.Millisecond, "the replicas' cluster.timeout (the policy default, 20ms, is meant for a Redis on its own machine; three replicas, mockllm and the load share this one)")
		modes        = fs.String("modes", ModeShared+","+ModePerProcess, "runs, in order: "+ModeShared+" (the policy with a cluster section) and "+ModePerProcess+" (without)")
		jsonOut      = fs.String("json", "", "also write the results as JSON to this file")
	)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "clusterdemo: unexpected arguments %q\n", fs.Args())
		return 2
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintln(stderr, "clusterdemo:", err)
		return 1
	}
	o := demoOptions(self, *policyPath, *replicas, *duration, *stormAt, *scale, *seed, *capacity, *redisTimeout)
	o.Modes = strings.Split(*modes, ",")
	o.Progress = stdout
	o.RedisStarted = func(addr string) { fmt.Fprintf(stdout, "redis-server listening on %s\n", addr) }
	printIntro(stdout, o)
	start := time.Now()
	res, err := Demo(ctx, o)
	if err != nil && ctx.Err() != nil {
		fmt.Fprintln(stderr, "clusterdemo: interrupted; every process it started is stopped")
		return 1
	}
	if err != nil {
		fmt.Fprintln(stderr, "clusterdemo:", err)
		switch {
		case errors.Is(err, fleet.ErrNoRedis):
			fmt.Fprintln(stderr, "clusterdemo: install redis-server (e.g. apt-get install redis-server), or run --modes per-process")
		case errors.Is(err, os.ErrNotExist):
			fmt.Fprintln(stderr, "clusterdemo: run it from the repository root, or pass --policy")
		}
		return 1
	}
	printReport(stdout, res)
	fmt.Fprintf(stdout, "\n(%.0f s)\n", time.Since(start).Seconds())
	if *jsonOut != "" {
		b, err := json.MarshalIndent(res, "", "  ")
		if err == nil {
			err = os.WriteFile(*jsonOut, append(b, '\n'), 0o644)
		}
		if err != nil {
			fmt.Fprintln(stderr, "clusterdemo:", err)
			return 1
		}
	}
	return 0
}

// demoOptions are the demo's options: the storm experiment's traffic, shortened.
func demoOptions(self, policyPath string, replicas int, duration, stormAt time.Duration, scale float64, seed uint64, capacity int, redisTimeout time.Duration) Options {
	sc := storm.DefaultScenario()
	sc.Duration, sc.StormAt = duration, stormAt
	return Options{
		PolicyPath: policyPath, Replicas: replicas, Scenario: sc, TimeScale: scale, Seed: seed, Capacity: capacity,
		RedisTimeout: redisTimeout,
		ReplicaArgv:  func(file string) []string { return []string{self, cmdReplica, "--config", file} },
	}
}

// runReplica serves one replica, as `llm-bulkhead serve --config FILE` on free loopback ports
// would, until ctx ends; then it drains and gives its shared slots back.
func runReplica(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet(cmdReplica, flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := fs.String("config", "", "policy file")
	grpcAddr := fs.String("grpc-addr", "127.0.0.1:0", "ext_proc gRPC listen address")
	adminAddr := fs.String("admin-addr", "127.0.0.1:0", "admin HTTP listen address")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	a, err := app.New(app.Options{ConfigPath: *cfg, GRPCAddr: *grpcAddr, AdminAddr: *adminAddr, LogOutput: stderr})
	if err != nil {
		fmt.Fprintln(stderr, "replica:", err)
		return 1
	}
	if err := a.Run(ctx, nil); err != nil {
		fmt.Fprintln(stderr, "replica:", err)
		return 1
	}
	return 0
}

func printIntro(w io.Writer, o Options) {
	sc := o.Scenario
	fmt.Fprintf(w, "Cluster demo: %d llm-bulkhead replicas run %s; envoysim sends each request to the next replica\n"+
		"(round robin). %d chat users of acme and globex send 2K-token chat requests; %v in, acme's export sends\n"+
		"%d 5K-token summaries at once and retries each refusal after its retry-after. mockllm answers in\n"+
		"(0.2 s + tokens/10000 s) × uniform(0.9, 1.3) and serves %d at a time. t is simulated time (%.1f× real time).\n"+
		"First the replicas share the policy's limits through Redis, then each enforces them on its own.\n",
		o.Replicas, o.PolicyPath, sc.ChatUsers(), sc.StormAt, sc.BatchWorkers*sc.BatchPerWorker, o.Capacity, 1/o.TimeScale)
}

// printReport prints each run's counts per replica, the fleet's peaks against the policy's
// limits, and the comparison.
func printReport(w io.Writer, res *Result) {
	l := res.Limits
	fmt.Fprintf(w, "\nThe policy's limits on this traffic (meant for the whole fleet):\n")
	batchNote := ""
	if l.BatchFrom != "feature/"+storm.FeatureBatch && l.BatchFeature > 0 {
		batchNote = fmt.Sprintf(" (feature/%s allows %d)", storm.FeatureBatch, l.BatchFeature)
	}
	fmt.Fprintf(w, "  batch requests in flight   %6d  %s%s\n", l.Batch, l.BatchFrom, batchNote)
	if l.BatchTokens > 0 {
		fmt.Fprintf(w, "  batch tokens a minute      %6d  %s (on any provider)\n", l.BatchTokens, l.BatchTokensFrom)
	}
	fmt.Fprintf(w, "  chat requests in flight    %6d  feature/%s\n", l.Chat, storm.FeatureChat)
	if l.PaidTokens > 0 {
		fmt.Fprintf(w, "  paid batch tokens a minute %6d  %s (batch on %s; beyond it the degrade rule sends batch to local)\n",
			l.PaidTokens, l.PaidFrom, strings.Join(l.PaidProviders, ", "))
	}
	for _, run := range res.Runs {
		fmt.Fprintf(w, "\n== %s: what each replica decided ==\n", run.Mode)
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "replica\tchat admitted\trefused\tbatch admitted\tdegraded\trefused\t")
		row := func(name string, c map[string]*Counts) {
			ch, bt := orZero(c[storm.FeatureChat]), orZero(c[storm.FeatureBatch])
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t\n", name, ch.Admitted, ch.RefusedTotal(), bt.Admitted, bt.Degraded, bt.RefusedTotal())
		}
		for i, c := range run.Replicas {
			row(fmt.Sprintf("r%d", i+1), c)
		}
		row("fleet", run.Fleet)
		_ = tw.Flush()
		for _, f := range []string{storm.FeatureChat, storm.FeatureBatch} {
			c := orZero(run.Fleet[f])
			var parts []string
			if len(c.Refused) > 0 {
				parts = append(parts, "refused: "+reasons(c.Refused))
			}
			if len(c.Failed) > 0 {
				parts = append(parts, "failed: "+reasons(c.Failed))
			}
			if len(parts) > 0 {
				fmt.Fprintf(w, "  %s %s\n", f, strings.Join(parts, "; "))
			}
		}
		fmt.Fprintf(w, "  batch documents summarised: %d of %d; chat answered in P50 %.2f s, P99 %.2f s\n",
			run.BatchDone, run.BatchDocuments, run.ChatP50, run.ChatP99)
		fmt.Fprintf(w, "  fleet-wide: at most %d batch requests in flight at once (limit %d) — %s\n",
			run.Peak[storm.FeatureBatch], l.Batch, verdict(int64(run.Peak[storm.FeatureBatch]), l.Batch))
		fmt.Fprintf(w, "              at most %d chat requests in flight at once (limit %d) — %s\n",
			run.Peak[storm.FeatureChat], l.Chat, verdict(int64(run.Peak[storm.FeatureChat]), l.Chat))
		if l.PaidTokens > 0 {
			fmt.Fprintf(w, "              %d tokens of batch on paid providers, %d requests (limit %d a minute) — %s\n",
				run.PaidTokens, run.PaidRequests, l.PaidTokens, verdict(run.PaidTokens, l.PaidTokens))
		}
		if l.BatchTokens > 0 {
			fmt.Fprintf(w, "              %d tokens of batch on any provider (limit %d a minute) — %s\n",
				run.BatchTokens, l.BatchTokens, verdict(run.BatchTokens, l.BatchTokens))
		}
		if run.WithoutRedis > 0 {
			fmt.Fprintf(w, "  note: %d admissions were decided without Redis (it answered too slowly); each replica then\n"+
				"  enforced its share of every limit on its own, and budgets were counted apart\n", run.WithoutRedis)
		}
	}
	shared, local := res.Run(ModeShared), res.Run(ModePerProcess)
	if shared == nil || local == nil {
		return
	}
	fmt.Fprintf(w, "\n== shared vs per process ==\n")
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\tlimit\tshared\tper process\tper process ÷ limit\t")
	cmp := func(what string, limit, a, b int64) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.1f×\t\n", what, limit, a, b, float64(b)/float64(max(limit, 1)))
	}
	cmp("batch in flight at once", l.Batch, int64(shared.Peak[storm.FeatureBatch]), int64(local.Peak[storm.FeatureBatch]))
	if l.PaidTokens > 0 {
		cmp("paid batch tokens", l.PaidTokens, shared.PaidTokens, local.PaidTokens)
	}
	if l.BatchTokens > 0 {
		cmp("batch tokens", l.BatchTokens, shared.BatchTokens, local.BatchTokens)
	}
	cmp("chat in flight at once", l.Chat, int64(shared.Peak[storm.FeatureChat]), int64(local.Peak[storm.FeatureChat]))
	_ = tw.Flush()
	fmt.Fprintf(w, "chat P99: %.2f s shared, %.2f s per process (chat shares the upstream's pool with every batch request the fleet admits)\n",
		shared.ChatP99, local.ChatP99)
}

func orZero(c *Counts) Counts {
	if c == nil {
		return Counts{}
	}
	return *c
}

func verdict(got, limit int64) string {
	if got <= limit {
		return "held"
	}
	return fmt.Sprintf("EXCEEDED (%.1f×)", float64(got)/float64(limit))
}

func reasons(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}
