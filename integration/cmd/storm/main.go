// Command storm reproduces the batch-export incident: chat users and a batch export share one
// mock LLM pool, through the Envoy simulator and llm-bulkhead, in several
// configurations (no policy, the example policy, shadow mode, the pooled policy, and a chat-only
// baseline). It prints a Markdown table and writes it, an SVG chart of the chat latency
// distributions and the raw numbers as JSON to --out.
//
//	storm [--fast | --demo] [--out DIR] [--repeat N] [--seed N] [--capacity N] [--configs a,b]
//	storm --scenario brownout [--fast] [--out DIR] [--brownout SCHEDULE] [--adaptive k=v,...] [--follow-delay D]
//	storm --scenario quota [--fast] [--out DIR] [--quota-policy FILE]
//
// --scenario brownout runs the provider brownout instead: chat users and a steady batch load on
// one provider whose capacity drops from 10 to 4 and recovers, with the provider's limit at 10
// without a brownout (the baseline), and under the brownout at 10, at 4, adaptive, and set to
// the capacity at each change (an oracle) or --follow-delay after it (an oracle as late as a
// limit learned from the provider's answers must be).
//
// --scenario quota runs the provider quota: the same load on a provider whose account quota
// (requests and tokens a window) runs out mid-run and refills at its reset, without a quota
// (the baseline) and with it under llm-bulkhead's quota mode off, shadow and enforce.
//
// --demo is a short run for newcomers that prints, once a second, what was admitted and refused
// and, after each run, what became of the batch documents and which limits decided it.
// Run it from the repository root (the default policy paths are relative to it).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/storm"
)

// Time scales of the modes: --fast runs ten times faster than real time, --demo 2.5 times, and
// the demo's shorter runs. The brownout scenario runs four times faster than real time unless
// told otherwise, so that its configurations take about two minutes together.
const (
	fastScale     = 0.1
	demoScale     = 0.4
	demoDuration  = 20 * time.Second
	brownoutScale = 0.25
	// quotaCapacity is the upstream's capacity in the quota scenario: room for both providers'
	// limits of 10, so that only the account's quota refuses.
	quotaCapacity = 20
)

// Scenarios of --scenario.
const (
	scenarioIncident = "incident"
	scenarioBrownout = "brownout"
	scenarioQuota    = "quota"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the whole command; it returns the exit status: 0 success, 1 failure, 2 bad usage.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("storm", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		out        = fs.String("out", "results/storm", "folder for table.md, chat-latency.svg and results.json (--demo writes them only when --out is given; --scenario brownout also limit-trace.svg, by default in results/storm-brownout)")
		fast       = fs.Bool("fast", false, fmt.Sprintf("scale time by %v (mockllm, think times, the policy's waits and breaker timings)", fastScale))
		demo       = fs.Bool("demo", false, fmt.Sprintf("a short run for newcomers: baseline, no policy and the example policy once each at time scale %v, printing admissions and refusals every second", demoScale))
		scale      = fs.Float64("time-scale", 0, "time scale (overrides --fast and --demo; 1 is real time)")
		seed       = fs.Uint64("seed", 1, "random seed of think times and mockllm latencies")
		repeat     = fs.Int("repeat", 3, "runs per configuration; the table shows medians with the range (--demo: 1)")
		capacity   = fs.Int("capacity", 10, "requests the mock LLM serves at once; the rest queue FIFO (0: unlimited)")
		configs    = fs.String("configs", "", "comma-separated configurations to run (default: "+strings.Join(storm.DefaultConfigurationNames, ",")+"; also "+storm.ConfigBaselinePolicy+")")
		policy     = fs.String("policy", "examples/policy.yaml", "the example policy")
		pooled     = fs.String("pooled-policy", "examples/policy-pooled.yaml", "the policy with pools")
		duration   = fs.Duration("duration", 0, "simulated length of a run (default 30s, --demo 20s, --scenario brownout 40s; under a minute)")
		batchConc  = fs.Int("batch-concurrency", 0, "documents each batch worker has in flight (default 5: all 50 at once; 1: sequential workers, at most 10 in flight)")
		batchRetry = fs.Bool("batch-retry", true, "the batch job waits each refusal's retry-after and tries again")
		verbose    = fs.Bool("v", false, "print the server's JSON logs to stderr")
		scenario   = fs.String("scenario", scenarioIncident, "incident: the batch-export storm; brownout: the provider brownout (default time scale "+fmt.Sprint(brownoutScale)+"; configurations "+strings.Join(storm.BrownoutConfigurationNames, ",")+"); quota: the provider's account quota runs out (time scale "+fmt.Sprint(brownoutScale)+"; configurations "+strings.Join(storm.QuotaConfigurationNames, ",")+")")
		brownout   = fs.String("brownout", storm.BrownoutScenario().Brownout.String(), "brownout scenario: the provider's capacity over the run, capacity@offset steps in simulated time (mockllm's -capacity-schedule)")
		adaptive   = fs.String("adaptive", storm.FormatAdaptive(storm.DefaultAdaptive), "brownout scenario: the adaptive configuration's adaptive settings, key=value pairs (keys of a limit's adaptive: in the policy; durations in simulated time)")
		follow     = fs.Duration("follow-delay", storm.DefaultFollowDelay, "brownout scenario: how late (simulated time) the "+storm.ConfigFollowLate+" configuration sets the limit to each new capacity")
		boPolicy   = fs.String("brownout-policy", "", "brownout scenario: the policy (default: the built-in one, integration/storm/brownout-policy.yaml); its providers' max_concurrent is replaced per configuration")
		qPolicy    = fs.String("quota-policy", "", "quota scenario: the policy (default: the built-in one, integration/storm/quota-policy.yaml); its providers' quota.mode is replaced per configuration")
	)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "storm: unexpected arguments %q\n", fs.Args())
		return 2
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if *fast && *demo {
		fmt.Fprintln(stderr, "storm: --fast and --demo exclude each other")
		return 2
	}
	if *scenario == scenarioBrownout {
		return runBrownout(ctx, set, scenarioFlags{
			out: *out, fast: *fast, scale: *scale, seed: *seed, repeat: *repeat, configs: *configs, duration: *duration,
			batchRetry: *batchRetry, verbose: *verbose, brownout: *brownout, adaptive: *adaptive, followDelay: *follow, policy: *boPolicy,
		}, stdout, stderr)
	}
	if *scenario == scenarioQuota {
		return runQuota(ctx, set, scenarioFlags{
			out: *out, fast: *fast, scale: *scale, seed: *seed, repeat: *repeat, configs: *configs, duration: *duration,
			batchRetry: *batchRetry, verbose: *verbose, policy: *qPolicy,
		}, stdout, stderr)
	}
	if *scenario != scenarioIncident {
		fmt.Fprintf(stderr, "storm: unknown scenario %q (known: %s, %s, %s)\n", *scenario, scenarioIncident, scenarioBrownout, scenarioQuota)
		return 2
	}
	for name, sc := range map[string]string{"brownout": scenarioBrownout, "adaptive": scenarioBrownout, "follow-delay": scenarioBrownout, "brownout-policy": scenarioBrownout, "quota-policy": scenarioQuota} {
		if set[name] {
			fmt.Fprintf(stderr, "storm: --%s applies to --scenario %s only\n", name, sc)
			return 2
		}
	}

	sc := storm.DefaultScenario()
	if *duration != 0 {
		sc.Duration = *duration
	}
	if *batchConc != 0 {
		sc.BatchWorkerConcurrency = *batchConc
	}
	sc.BatchRetry = *batchRetry
	o := storm.Options{Scenario: sc, Seed: *seed, Capacity: *capacity, Repeat: *repeat, TimeScale: 1}
	names := storm.DefaultConfigurationNames
	switch {
	case *fast:
		o.TimeScale = fastScale
	case *demo:
		o.TimeScale = demoScale
		if !set["duration"] {
			o.Scenario.Duration = demoDuration
		}
		names = []string{storm.ConfigBaseline, storm.ConfigNoPolicy, storm.ConfigPolicy}
		if !set["repeat"] {
			o.Repeat = 1
		}
	}
	if set["time-scale"] {
		o.TimeScale = *scale
	}
	if *configs != "" {
		names = strings.Split(*configs, ",")
		for i := range names {
			names[i] = strings.TrimSpace(names[i])
		}
	}
	var err error
	o.Configurations, err = storm.SelectConfigurations(storm.StandardConfigurations(*policy, *pooled), names)
	if err != nil {
		fmt.Fprintf(stderr, "storm: %v\n", err)
		return 2
	}
	if *verbose {
		o.Logs = stderr
	}

	labels := map[string]string{}
	for _, c := range o.Configurations {
		labels[c.Name] = c.Label
	}
	total := len(o.Configurations) * max(o.Repeat, 1)
	done := 0
	fmt.Fprintf(stdout, "storm: %s × %s, time scale %v, upstream capacity %d, %d chat users, %d batch documents\n",
		plural(len(o.Configurations), "configuration"), plural(max(o.Repeat, 1), "run"), o.TimeScale, o.Capacity, sc.ChatUsers(), sc.BatchWorkers*sc.BatchPerWorker)
	if *demo {
		fmt.Fprint(stdout, demoIntro(o.Scenario, o.Capacity, o.TimeScale))
		last := ""
		o.Progress = func(t storm.Tick) {
			if t.Configuration != last {
				last = t.Configuration
				fmt.Fprintf(stdout, "\n== %s ==\n", labels[t.Configuration])
			}
			fmt.Fprintln(stdout, tickLine(t))
		}
	}
	o.RunDone = func(r *storm.RunResult) {
		done++
		s := r.Summary
		line := fmt.Sprintf("run %d/%d  %-16s chat P99 %s s", done, total, r.Configuration, optSeconds(s.ChatP99))
		if s.BatchDocuments > 0 {
			line += fmt.Sprintf(", batch %d/%d done", s.BatchDone, s.BatchDocuments)
		}
		fmt.Fprintf(stdout, "%s  (%.1f s)\n", line, r.WallSeconds)
		if *demo {
			for _, l := range explainRun(r, o.Scenario) {
				fmt.Fprintf(stdout, "    %s\n", l)
			}
		}
	}

	start := time.Now()
	rep, err := storm.Run(ctx, o)
	if err != nil {
		fmt.Fprintf(stderr, "storm: %v\n", err)
		if errors.Is(err, os.ErrNotExist) {
			fmt.Fprintln(stderr, "storm: run it from the repository root, or pass --policy and --pooled-policy")
		}
		if errors.Is(err, storm.ErrOptions) {
			return 2
		}
		return 1
	}
	fmt.Fprintf(stdout, "\n%s\n\n%s", rep.Setting(), rep.Markdown())
	if !*demo || set["out"] {
		if err := rep.WriteFiles(*out); err != nil {
			fmt.Fprintf(stderr, "storm: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "\nWrote %s/{%s,%s,%s} in %.0f s.\n", strings.TrimSuffix(*out, "/"), storm.FileTable, storm.FileChart, storm.FileJSON, time.Since(start).Seconds())
	}
	return 0
}

// tickLine is one compact progress line: per feature, what was admitted (sent upstream) and
// refused during the last second, and the mock LLM's pool.
func tickLine(t storm.Tick) string {
	var parts []string
	for _, f := range t.Features {
		s := fmt.Sprintf("%-5s %3d admitted", short(f.Feature), f.Admitted)
		if n := sum(f.Refused); n > 0 {
			var rs []string
			for _, reason := range sortedKeys(f.Refused) {
				rs = append(rs, fmt.Sprintf("%s %d", reason, f.Refused[reason]))
			}
			s += fmt.Sprintf(", %d refused (%s)", n, strings.Join(rs, ", "))
		}
		if f.Errors > 0 {
			s += fmt.Sprintf(", %d failed", f.Errors)
		}
		switch {
		case f.Answered > 0 && f.Feature == storm.FeatureChat:
			s += fmt.Sprintf(", slowest answer %.2f s", f.Slowest)
		case f.Answered > 0 && f.Feature == storm.FeatureBatch:
			s += fmt.Sprintf(", %d summarised", f.Answered)
		}
		parts = append(parts, s)
	}
	return fmt.Sprintf("t=%4.1fs  %s | upstream %d busy, %d waiting", t.At.Seconds(), strings.Join(parts, " | "), t.UpstreamInFlight, t.UpstreamQueued)
}

func short(feature string) string {
	if feature == storm.FeatureBatch {
		return "batch"
	}
	return feature
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func sortedKeys(m map[string]int) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func optSeconds(v *float64) string {
	if v == nil {
		return "—"
	}
	return fmt.Sprintf("%.2f", *v)
}
