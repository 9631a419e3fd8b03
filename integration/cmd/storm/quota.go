package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/llm-bulkhead/llm-bulkhead/integration/storm"
)

// runQuota is the command for --scenario quota; set holds the flags given.
func runQuota(ctx context.Context, set map[string]bool, f scenarioFlags, stdout, stderr io.Writer) int {
	if !onlyApplicable(set, scenarioQuota, stderr, "demo", "capacity", "batch-concurrency", "policy", "pooled-policy", "brownout", "adaptive", "follow-delay", "brownout-policy") {
		return 2
	}
	sc := storm.QuotaScenario()
	if f.duration != 0 {
		sc.Duration = f.duration
	}
	sc.BatchRetry = f.batchRetry
	var policy []byte
	if f.policy != "" {
		var err error
		if policy, err = os.ReadFile(f.policy); err != nil {
			fmt.Fprintf(stderr, "storm: %v\n", err)
			return 1
		}
	}
	o := storm.Options{Scenario: sc, Seed: f.seed, Repeat: f.repeat, TimeScale: brownoutScale, Capacity: quotaCapacity}
	switch {
	case set["time-scale"]:
		o.TimeScale = f.scale
	case f.fast:
		o.TimeScale = fastScale
	}
	var err error
	o.Configurations, err = storm.SelectConfigurations(storm.QuotaConfigurations(f.policy, policy), configNames(f.configs, storm.QuotaConfigurationNames))
	if err != nil {
		fmt.Fprintf(stderr, "storm: %v\n", err)
		return 2
	}
	if f.verbose {
		o.Logs = stderr
	}

	total := len(o.Configurations) * max(o.Repeat, 1)
	done := 0
	fmt.Fprintf(stdout, "storm: provider quota, %s × %s, time scale %v, upstream capacity %d, %s's account quota %s, %d chat users, %d steady batch workers\n",
		plural(len(o.Configurations), "configuration"), plural(max(o.Repeat, 1), "run"), o.TimeScale, o.Capacity, sc.QuotaProvider, sc.QuotaString(), sc.ChatUsers(), sc.BatchWorkers)
	o.RunDone = func(r *storm.RunResult) {
		done++
		s := r.Summary
		fmt.Fprintf(stdout, "run %d/%d  %-13s chat P99 %s s, batch %s/s, provider 429s %d (%d to clients), re-routed %d, short %d  (%.1f s)\n",
			done, total, r.Configuration, optSeconds(s.ChatP99), optRate(s.BatchRate), s.ProviderQuotaRefused, s.Provider429sToClients,
			s.QuotaRerouted, s.QuotaShort, r.WallSeconds)
	}

	return runAndWrite(ctx, o, f.out, set["out"], "results/storm-quota", stdout, stderr)
}
