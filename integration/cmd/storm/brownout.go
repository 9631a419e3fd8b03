package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/storm"
)

// scenarioFlags are the command-line values the brownout and quota scenarios use.
type scenarioFlags struct {
	out        string
	fast       bool
	scale      float64
	seed       uint64
	repeat     int
	configs    string
	duration   time.Duration
	batchRetry bool
	verbose    bool
	brownout   string
	adaptive   string
	// followDelay is how late the follow-capacity-late configuration follows the capacity.
	followDelay time.Duration
	policy      string
}

// onlyApplicable reports whether none of the flags names, which do not apply to scenario, was
// given (set); the first one given is said on stderr.
func onlyApplicable(set map[string]bool, scenario string, stderr io.Writer, names ...string) bool {
	for _, name := range names {
		if set[name] {
			fmt.Fprintf(stderr, "storm: --%s does not apply to --scenario %s\n", name, scenario)
			return false
		}
	}
	return true
}

// runBrownout is the command for --scenario brownout; set holds the flags given.
func runBrownout(ctx context.Context, set map[string]bool, f scenarioFlags, stdout, stderr io.Writer) int {
	if !onlyApplicable(set, scenarioBrownout, stderr, "demo", "capacity", "batch-concurrency", "policy", "pooled-policy", "quota-policy") {
		return 2
	}
	sc := storm.BrownoutScenario()
	if f.duration != 0 {
		sc.Duration = f.duration
	}
	sc.BatchRetry = f.batchRetry
	sched, err := mock.ParseCapacitySchedule(f.brownout)
	if err != nil {
		fmt.Fprintf(stderr, "storm: --brownout: %v\n", err)
		return 2
	}
	sc.Brownout = sched
	adaptive, err := storm.ParseAdaptive(f.adaptive)
	if err != nil {
		fmt.Fprintf(stderr, "storm: --adaptive: %v\n", err)
		return 2
	}
	var policy []byte
	if f.policy != "" {
		if policy, err = os.ReadFile(f.policy); err != nil {
			fmt.Fprintf(stderr, "storm: %v\n", err)
			return 1
		}
	}
	o := storm.Options{Scenario: sc, Seed: f.seed, Repeat: f.repeat, TimeScale: brownoutScale}
	switch {
	case set["time-scale"]:
		o.TimeScale = f.scale
	case f.fast:
		o.TimeScale = fastScale
	}
	o.Configurations, err = storm.SelectConfigurations(storm.BrownoutConfigurations(f.policy, policy, adaptive, f.followDelay), configNames(f.configs, storm.BrownoutConfigurationNames))
	if err != nil {
		fmt.Fprintf(stderr, "storm: %v\n", err)
		return 2
	}
	// A setting the policy refuses is a usage error, reported before any run.
	for _, c := range o.Configurations {
		if c.ProviderLimit != "adaptive" {
			continue
		}
		if _, err := storm.DerivePolicy(c.PolicyPath, c.PolicyText, storm.Variant{ProviderLimit: c.ProviderLimit, Adaptive: c.Adaptive, TimeScale: o.TimeScale}); err != nil {
			fmt.Fprintf(stderr, "storm: --adaptive %s: %v\n", storm.FormatAdaptive(adaptive), err)
			return 2
		}
	}
	if f.verbose {
		o.Logs = stderr
	}

	total := len(o.Configurations) * max(o.Repeat, 1)
	done := 0
	fmt.Fprintf(stdout, "storm: provider brownout, %s × %s, time scale %v, upstream capacity %s, %d chat users, %d steady batch workers, adaptive settings %s\n",
		plural(len(o.Configurations), "configuration"), plural(max(o.Repeat, 1), "run"), o.TimeScale, sc.Brownout, sc.ChatUsers(), sc.BatchWorkers, storm.FormatAdaptive(adaptive))
	o.RunDone = func(r *storm.RunResult) {
		done++
		s := r.Summary
		fmt.Fprintf(stdout, "run %d/%d  %-12s chat P99 %s s (brownout %s s), batch %s/s healthy, %s/s brownout, upstream queue peak %d  (%.1f s)\n",
			done, total, r.Configuration, optSeconds(s.ChatP99), optSeconds(s.ChatBrownoutP99), optRate(s.BatchHealthyRate), optRate(s.BatchBrownoutRate),
			r.UpstreamPeakQueued, r.WallSeconds)
	}

	return runAndWrite(ctx, o, f.out, set["out"], "results/storm-brownout", stdout, stderr)
}

// configNames reads --configs (all: when it is empty).
func configNames(configs string, all []string) []string {
	if configs == "" {
		return all
	}
	names := strings.Split(configs, ",")
	for i := range names {
		names[i] = strings.TrimSpace(names[i])
	}
	return names
}

// runAndWrite runs the experiment o of the brownout or quota scenario, prints the setting
// and the table, and writes the files into out (defaultOut when --out was not given).
func runAndWrite(ctx context.Context, o storm.Options, out string, outSet bool, defaultOut string, stdout, stderr io.Writer) int {
	start := time.Now()
	rep, err := storm.Run(ctx, o)
	if err != nil {
		fmt.Fprintf(stderr, "storm: %v\n", err)
		if errors.Is(err, storm.ErrOptions) {
			return 2
		}
		return 1
	}
	fmt.Fprintf(stdout, "\n%s\n\n%s", rep.Setting(), rep.Markdown())
	if !outSet {
		out = defaultOut
	}
	if err := rep.WriteFiles(out); err != nil {
		fmt.Fprintf(stderr, "storm: %v\n", err)
		return 1
	}
	files := []string{storm.FileTable, storm.FileChart, storm.FileJSON}
	if len(o.Scenario.Brownout) > 0 {
		files = []string{storm.FileTable, storm.FileChart, storm.FileTrace, storm.FileJSON}
	}
	fmt.Fprintf(stdout, "\nWrote %s/{%s} in %.0f s.\n", strings.TrimSuffix(out, "/"), strings.Join(files, ","), time.Since(start).Seconds())
	return 0
}

func optRate(v *float64) string {
	if v == nil {
		return "—"
	}
	return fmt.Sprintf("%.1f", *v)
}
