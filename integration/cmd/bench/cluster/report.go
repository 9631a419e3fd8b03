package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
	"github.com/llm-bulkhead/llm-bulkhead/integration/cmd/clusterdemo/fleet"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// Targets of leased admission at steady load.
const (
	targetCommands  = 0.05 // Redis client commands per admission
	targetCPU       = 5.0  // µs of Redis CPU per admission
	targetIntervals = 3.0  // lease intervals for a lease to follow demand
)

// Report is everything one run measured.
type Report struct {
	Started         time.Time     `json:"started"`
	Finished        time.Time     `json:"finished"`
	Command         string        `json:"command"`
	Machine         bench.Machine `json:"machine"`
	RedisVersion    string        `json:"redis_version"`
	BulkheadCommand string        `json:"bulkhead_command"`
	Config          struct {
		Admissions       []string `json:"admissions"`
		Levels           []int    `json:"concurrency"`
		Reps             int      `json:"reps"`
		WarmupSeconds    float64  `json:"warmup_seconds"`
		WindowSeconds    float64  `json:"window_seconds"`
		Replicas         []int    `json:"replicas"`
		Redis            []string `json:"redis"`
		FleetConcurrency int      `json:"fleet_concurrency"`
		FleetReps        int      `json:"fleet_reps"`
		FleetWindow      float64  `json:"fleet_window_seconds"`
		RedisTimeout     string   `json:"redis_timeout"`
		LeaseInterval    string   `json:"lease_interval"`
		LeaseTTL         string   `json:"lease_ttl"`
		Policy           string   `json:"policy"`
	} `json:"config"`
	Overrides []string `json:"policy_overrides"`

	Samples   []Sample      `json:"samples"`
	Levels    []Level       `json:"levels"`
	Fleet     []FleetSample `json:"fleet,omitempty"`
	Fleets    []FleetStats  `json:"fleets,omitempty"`
	IdleRedis []IdleRedis   `json:"idle_redis,omitempty"`
	Behaviour *Behaviour    `json:"behaviour,omitempty"`
	Targets   []Target      `json:"targets"`
}

// IdleRedis is what the fleets' Redis of one kind spent with no client connected, before any
// fleet ran on it: ms of CPU a second, every node's.
type IdleRedis struct {
	Redis string `json:"redis"`
	CPU   Num    `json:"cpu_ms_per_second"`
}

// Level compares the sides at one concurrency.
type Level struct {
	Concurrency int       `json:"concurrency"`
	Local       SideStats `json:"local"`
	// Noise is the local side's own spread of p50 over the repetitions (max − min), µs: an added
	// p50 smaller than it is within the noise.
	Noise Num         `json:"local_p50_spread_us"`
	Modes []ModeLevel `json:"admissions"`
}

// ModeLevel is one admission at one concurrency. The ratio and differences are computed per
// repetition from the admission's run and the local run of that repetition, then summarised.
type ModeLevel struct {
	Admission string    `json:"admission"`
	Side      SideStats `json:"side"`
	// Ratio is the admission's streams/s over local's.
	Ratio bench.Spread `json:"throughput_ratio"`
	// AddedP50, AddedP99 (µs) and AddedCPU (server CPU µs per stream): the admission minus local.
	AddedP50 bench.Spread `json:"added_p50_us"`
	AddedP99 bench.Spread `json:"added_p99_us"`
	AddedCPU bench.Spread `json:"added_server_cpu_us_per_stream"`
	Work     WorkStats    `json:"work"`
}

// SideStats aggregates one side's samples at one level over the repetitions.
type SideStats struct {
	Rate      bench.Spread `json:"streams_per_sec"`
	P50       bench.Spread `json:"p50_us"`
	P99       bench.Spread `json:"p99_us"`
	ServerCPU bench.Spread `json:"server_cpu_us_per_stream"`
	Errors    int          `json:"errors"`
}

// WorkStats summarises Work over repetitions (see Work for each figure).
type WorkStats struct {
	ClientCommands    bench.Spread `json:"client_commands_per_admission"`
	Scripts           bench.Spread `json:"scripts_per_admission"`
	InScripts         bench.Spread `json:"commands_in_scripts_per_admission"`
	RedisCPU          bench.Spread `json:"redis_cpu_us_per_admission"`
	RedisCPUOverIdle  bench.Spread `json:"redis_cpu_over_idle_us_per_admission"`
	ScriptUsec        bench.Spread `json:"redis_script_us_per_admission"`
	RedisCores        bench.Spread `json:"redis_cores"`
	AdmitCalls        bench.Spread `json:"admit_calls_per_admission"`
	SettleCalls       bench.Spread `json:"settle_calls_per_admission"`
	HeartbeatCalls    bench.Spread `json:"heartbeat_calls_per_admission"`
	LeaseCalls        bench.Spread `json:"lease_calls_per_admission"`
	LeaseReports      bench.Spread `json:"lease_reports_per_admission"`
	LeaseWaits        bench.Spread `json:"lease_waits_per_admission"`
	WindowWaits       bench.Spread `json:"window_waits_per_admission"`
	ReportsPerReplica bench.Spread `json:"lease_reports_per_replica_second"`
	CallP50           bench.Spread `json:"redis_call_p50_us"`
	CallP99           bench.Spread `json:"redis_call_p99_us"`
	// Admitted is the admissions counted over the repetitions, WithoutRedis those of them
	// decided without Redis.
	Admitted     float64 `json:"admitted"`
	WithoutRedis float64 `json:"without_redis"`
	// Reasons is the last run's lease reports per replica-second, by reason.
	Reasons map[string]float64 `json:"lease_reports_per_replica_second_by_reason,omitempty"`
	// Commands is the last run's, by command.
	Commands map[string]CommandCost `json:"last_run_commands_per_admission,omitempty"`
}

// FleetStats aggregates a fleet's runs.
type FleetStats struct {
	Redis     string       `json:"redis"`
	Replicas  int          `json:"replicas"`
	Admission string       `json:"admission"`
	Rate      bench.Spread `json:"streams_per_sec"`
	P50       bench.Spread `json:"p50_us"`
	P99       bench.Spread `json:"p99_us"`
	Errors    int          `json:"errors"`
	Work      WorkStats    `json:"work"`
}

// Target is one goal and whether this run met it.
type Target struct {
	Name     string `json:"name"`
	Goal     string `json:"goal"`
	Measured string `json:"measured"`
	Status   string `json:"status"`
}

func newReport(cfg Config) *Report {
	r := &Report{Started: time.Now(), Command: cfg.Command, Machine: bench.CurrentMachine(), Overrides: bench.LimitOverrides}
	c := &r.Config
	c.Admissions, c.Levels, c.Reps = cfg.Admissions, cfg.Levels, cfg.Reps
	c.WarmupSeconds, c.WindowSeconds = cfg.Warmup.Seconds(), cfg.Duration.Seconds()
	c.Replicas, c.Redis, c.FleetConcurrency, c.FleetReps = cfg.Replicas, cfg.Redis, cfg.FleetConcurrency, cfg.FleetReps
	c.FleetWindow = cfg.FleetDuration.Seconds()
	c.RedisTimeout, c.LeaseInterval, c.LeaseTTL = cfg.RedisTimeout.String(), cfg.LeaseInterval.String(), cfg.LeaseTTL.String()
	c.Policy = cfg.PolicyPath
	return r
}

func (r *Report) finish() {
	r.Finished = time.Now()
	r.Machine.LoadAvgEnd = harness.LoadAverage()
	r.Levels = Aggregate(r.Samples)
	r.Fleets = AggregateFleets(r.Fleet)
	r.Targets = r.judge()
}

func col[T, U any](xs []T, f func(T) U) []U {
	out := make([]U, len(xs))
	for i, x := range xs {
		out[i] = f(x)
	}
	return out
}

// summarizeWork summarises the works of repeated runs.
func summarizeWork(ws []Work) WorkStats {
	s := func(f func(Work) Num) bench.Spread {
		return bench.Summarize(col(ws, func(w Work) float64 { return float64(f(w)) }))
	}
	st := WorkStats{
		ClientCommands:    s(func(w Work) Num { return w.ClientCommands }),
		Scripts:           s(func(w Work) Num { return w.Scripts }),
		InScripts:         s(func(w Work) Num { return w.InScripts }),
		RedisCPU:          s(func(w Work) Num { return w.RedisCPU }),
		RedisCPUOverIdle:  s(func(w Work) Num { return w.RedisCPUOverIdle }),
		ScriptUsec:        s(func(w Work) Num { return w.ScriptUsec }),
		RedisCores:        s(func(w Work) Num { return w.RedisCores }),
		AdmitCalls:        s(func(w Work) Num { return w.AdmitCalls }),
		SettleCalls:       s(func(w Work) Num { return w.SettleCalls }),
		HeartbeatCalls:    s(func(w Work) Num { return w.HeartbeatCalls }),
		LeaseCalls:        s(func(w Work) Num { return w.LeaseCalls }),
		LeaseReports:      s(func(w Work) Num { return w.LeaseReports }),
		LeaseWaits:        s(func(w Work) Num { return w.LeaseWaits }),
		WindowWaits:       s(func(w Work) Num { return w.WindowWaits }),
		ReportsPerReplica: s(func(w Work) Num { return w.ReportsPerReplica }),
		CallP50:           s(func(w Work) Num { return w.CallP50 }),
		CallP99:           s(func(w Work) Num { return w.CallP99 }),
	}
	for _, w := range ws {
		st.Admitted += w.Admitted
		st.WithoutRedis += w.WithoutRedis
	}
	if len(ws) > 0 {
		st.Commands = ws[len(ws)-1].Commands
		st.Reasons = ws[len(ws)-1].Reasons
	}
	return st
}

func sideStats(ss []Sample) SideStats {
	st := SideStats{
		Rate:      bench.Summarize(col(ss, func(s Sample) float64 { return s.Load.Rate })),
		P50:       bench.Summarize(col(ss, func(s Sample) float64 { return s.Load.P50 })),
		P99:       bench.Summarize(col(ss, func(s Sample) float64 { return s.Load.P99 })),
		ServerCPU: bench.Summarize(col(ss, func(s Sample) float64 { return s.Load.ServerCPU })),
	}
	for _, s := range ss {
		st.Errors += s.Load.Errors
	}
	return st
}

// Aggregate groups samples by level (in the order the levels first appear), and pairs each
// admission's runs with local's by repetition.
func Aggregate(samples []Sample) []Level {
	var levels []int
	var modes []string
	for _, s := range samples {
		if !slices.Contains(levels, s.Load.Concurrency) {
			levels = append(levels, s.Load.Concurrency)
		}
		if s.Side != SideLocal && !slices.Contains(modes, s.Side) {
			modes = append(modes, s.Side)
		}
	}
	of := func(c int, side string) []Sample {
		var out []Sample
		for _, s := range samples {
			if s.Load.Concurrency == c && s.Side == side {
				out = append(out, s)
			}
		}
		slices.SortFunc(out, func(a, b Sample) int { return a.Load.Rep - b.Load.Rep })
		return out
	}
	var out []Level
	for _, c := range levels {
		local := of(c, SideLocal)
		lv := Level{Concurrency: c, Local: sideStats(local), Noise: Num(math.NaN())}
		if lv.Local.P50.N > 1 {
			lv.Noise = Num(lv.Local.P50.Max - lv.Local.P50.Min)
		}
		rate := func(s Sample) float64 { return s.Load.Rate }
		p50 := func(s Sample) float64 { return s.Load.P50 }
		p99 := func(s Sample) float64 { return s.Load.P99 }
		cpu := func(s Sample) float64 { return s.Load.ServerCPU }
		for _, m := range modes {
			ss := of(c, m)
			var ws []Work
			for _, s := range ss {
				if s.Work != nil {
					ws = append(ws, *s.Work)
				}
			}
			lv.Modes = append(lv.Modes, ModeLevel{Admission: m, Side: sideStats(ss),
				Ratio:    bench.Summarize(bench.Ratios(col(ss, rate), col(local, rate))),
				AddedP50: bench.Summarize(bench.Differences(col(ss, p50), col(local, p50))),
				AddedP99: bench.Summarize(bench.Differences(col(ss, p99), col(local, p99))),
				AddedCPU: bench.Summarize(bench.Differences(col(ss, cpu), col(local, cpu))),
				Work:     summarizeWork(ws)})
		}
		out = append(out, lv)
	}
	return out
}

// AggregateFleets groups the fleet runs by Redis, size and admission, in the order they ran.
func AggregateFleets(fs []FleetSample) []FleetStats {
	var out []FleetStats
	for _, f := range fs {
		if slices.ContainsFunc(out, func(s FleetStats) bool {
			return s.Redis == f.Redis && s.Replicas == f.Replicas && s.Admission == f.Admission
		}) {
			continue
		}
		var same []FleetSample
		for _, g := range fs {
			if g.Redis == f.Redis && g.Replicas == f.Replicas && g.Admission == f.Admission {
				same = append(same, g)
			}
		}
		st := FleetStats{Redis: f.Redis, Replicas: f.Replicas, Admission: f.Admission,
			Rate: bench.Summarize(col(same, func(s FleetSample) float64 { return s.Rate })),
			P50:  bench.Summarize(col(same, func(s FleetSample) float64 { return s.P50 })),
			P99:  bench.Summarize(col(same, func(s FleetSample) float64 { return s.P99 })),
			Work: summarizeWork(col(same, func(s FleetSample) Work { return s.Work }))}
		for _, s := range same {
			st.Errors += s.Errors
		}
		out = append(out, st)
	}
	// The admissions of one Redis and size in a fixed order.
	for i := 0; i < len(out); {
		j := i + 1
		for j < len(out) && out[j].Redis == out[i].Redis && out[j].Replicas == out[i].Replicas {
			j++
		}
		slices.SortFunc(out[i:j], func(a, b FleetStats) int { return strings.Compare(a.Admission, b.Admission) })
		i = j
	}
	return out
}

func status(ok bool) string {
	if ok {
		return "met"
	}
	return "missed"
}

// dominant names the commands that weigh most in w's last run: the client commands by calls
// and every command by time.
func dominant(w WorkStats) string {
	type kv struct {
		name string
		c    CommandCost
	}
	var all []kv
	for k, c := range w.Commands {
		all = append(all, kv{k, c})
	}
	var parts []string
	slices.SortFunc(all, func(a, b kv) int { return cmpDesc(a.c.Calls, b.c.Calls, a.name, b.name) })
	for _, x := range all {
		if !fleet.InScripts(x.name) {
			parts = append(parts, fmt.Sprintf("%s %.3f calls", strings.ToUpper(x.name), x.c.Calls))
			break
		}
	}
	slices.SortFunc(all, func(a, b kv) int { return cmpDesc(a.c.Usec, b.c.Usec, a.name, b.name) })
	if len(all) > 0 {
		parts = append(parts, fmt.Sprintf("most time: %s %.1f µs", strings.ToUpper(all[0].name), all[0].c.Usec))
	}
	if w.ReportsPerReplica.N > 0 && w.ReportsPerReplica.Median > 0 {
		parts = append(parts, fmt.Sprintf("%.1f lease reports per replica-second", w.ReportsPerReplica.Median))
	}
	return strings.Join(parts, "; ")
}

func cmpDesc(x, y float64, a, b string) int {
	switch {
	case x > y:
		return -1
	case x < y:
		return 1
	}
	return strings.Compare(a, b)
}

// judge checks the targets: for exact, one round trip on the admission path and two in all per
// admission; for leased, the commands, CPU and latency targets at every level and in every fleet,
// the limit and the behaviours.
func (r *Report) judge() []Target {
	var out []Target
	missNote := func(ok bool, w WorkStats) string {
		if ok {
			return ""
		}
		return " — " + dominant(w)
	}
	work := func(where string, w WorkStats) {
		cmd := w.ClientCommands
		okC := cmd.N > 0 && cmd.Median <= targetCommands
		out = append(out, Target{Name: "leased: Redis client commands per admission, " + where, Goal: fmt.Sprintf("≤ %.2f", targetCommands),
			Measured: spread(cmd, "%.3f") + factor(cmd.Median, targetCommands) + fmt.Sprintf(" (and %s inside scripts)", spread(w.InScripts, "%.2f")) + missNote(okC, w),
			Status:   status(okC)})
		// Where Redis's own idle CPU was measured (the fleets), the target is what the replicas
		// add to it; the whole is shown beside it.
		cpu, whole := w.RedisCPU, ""
		if w.RedisCPUOverIdle.N > 0 {
			cpu, whole = w.RedisCPUOverIdle, " over Redis's own idle ("+spread(w.RedisCPU, "%.1f")+" µs in all)"
		}
		okU := cpu.N > 0 && cpu.Median <= targetCPU
		out = append(out, Target{Name: "leased: Redis CPU per admission, " + where, Goal: fmt.Sprintf("≤ %.0f µs", targetCPU),
			Measured: spread(cpu, "%.1f") + " µs" + whole + factor(cpu.Median, targetCPU) + missNote(okU, w), Status: status(okU)})
	}
	for _, lv := range r.Levels {
		for _, m := range lv.Modes {
			where := fmt.Sprintf("one replica, %d streams", lv.Concurrency)
			switch m.Admission {
			case Exact:
				out = append(out,
					Target{Name: "exact: admission-path round trips per admission, " + where, Goal: "≤ 1",
						Measured: spread(m.Work.AdmitCalls, "%.3f"), Status: status(m.Work.AdmitCalls.N > 0 && m.Work.AdmitCalls.Max <= 1)},
					Target{Name: "exact: Redis client commands per admission, " + where, Goal: "≤ 2",
						Measured: spread(m.Work.ClientCommands, "%.3f"), Status: status(m.Work.ClientCommands.N > 0 && m.Work.ClientCommands.Max <= 2)})
			case Leased:
				work(where, m.Work)
				ok := finite(lv.Noise) && m.AddedP50.N > 0 && math.Abs(m.AddedP50.Median) <= float64(lv.Noise)
				out = append(out, Target{Name: "leased: added p50 against no cluster, " + where, Goal: "within the noise (|added| ≤ local p50's own spread)",
					Measured: fmt.Sprintf("%s µs; noise %s µs", spread(m.AddedP50, "%+.0f"), opt(float64(lv.Noise), "%.0f")), Status: status(ok)})
			}
		}
	}
	for _, f := range r.Fleets {
		if f.Admission == Leased {
			work(fmt.Sprintf("%d replicas, %s Redis", f.Replicas, f.Redis), f.Work)
		}
	}
	if bh := r.Behaviour; bh != nil {
		out = append(out, Target{Name: fmt.Sprintf("leased: requests in flight at once, %s limited to %d across %d–%d replicas", chatCompartment, bh.Limit, bh.Replicas, bh.Replicas+1),
			Goal:     fmt.Sprintf("never above %d", bh.Limit),
			Measured: fmt.Sprintf("upstream at most %d; replicas' /admin/compartments sum at most %d", bh.MaxUpstream, bh.MaxAdminSum),
			Status:   status(bh.MaxUpstream <= int64(bh.Limit))})
		out = append(out, Target{Name: fmt.Sprintf("leased: skew (one replica gets %.0f%% of the clients) followed", 100*bh.Skew),
			Goal:     fmt.Sprintf("≤ %.0f lease intervals", targetIntervals),
			Measured: intervals(bh.SkewIntervals, bh.SkewFollowed), Status: status(finite(bh.SkewIntervals) && float64(bh.SkewIntervals) <= targetIntervals)})
		out = append(out, Target{Name: "leased: a joining replica's lease reaches its fair share",
			Goal:     fmt.Sprintf("≤ %.0f lease intervals (the skew's bound)", targetIntervals),
			Measured: intervals(bh.JoinIntervals, bh.JoinFollowed), Status: status(finite(bh.JoinIntervals) && float64(bh.JoinIntervals) <= targetIntervals)})
		ttl, _ := time.ParseDuration(bh.LeaseTTL)
		iv, _ := time.ParseDuration(bh.LeaseInterval)
		bound := (ttl + iv).Seconds()
		out = append(out, Target{Name: "leased: a killed replica's share granted to the others",
			Goal:     fmt.Sprintf("≤ lease_ttl + one lease interval (%.1f s)", bound),
			Measured: opt(float64(bh.KillRebalanced), "%.2f s"), Status: status(finite(bh.KillRebalanced) && float64(bh.KillRebalanced) <= bound)})
	}
	return out
}

func finite(n Num) bool { return !math.IsNaN(float64(n)) && !math.IsInf(float64(n), 0) }

func intervals(iv, secs Num) string {
	if !finite(iv) {
		return "not within the phase"
	}
	return fmt.Sprintf("%.1f (%.2f s)", iv, secs)
}

// factor says how far a missed target is: "(4.2× the target)".
func factor(x, target float64) string {
	if math.IsNaN(x) || x <= target {
		return ""
	}
	return fmt.Sprintf(" (%.1f× the target)", x/target)
}

func (r *Report) write(dir string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "report.md"), []byte(r.Markdown()), 0o644)
}

// Markdown renders the report.
func (r *Report) Markdown() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	m, c := r.Machine, r.Config
	w("# Cluster mode: exact and leased admission through Redis against local admission\n\n")
	w("- Command: `%s`\n", r.Command)
	w("- When: %s, %s\n", r.Started.UTC().Format(time.RFC3339), r.Finished.Sub(r.Started).Round(time.Second))
	w("- Machine: %d CPUs (%s), %s/%s, %s; load average %s at the start, %s at the end\n", m.CPUs, m.CPUModel, m.GOOS, m.GOARCH, m.GoVersion, m.LoadAvgStart, m.LoadAvgEnd)
	w("- Servers: %s, separate processes; local = `%s` without a cluster section, the others with `cluster: {backend: redis, admission: <side>, timeout: %s, lease_interval: %s, lease_ttl: %s}` on Redis %s on 127.0.0.1\n",
		r.BulkheadCommand, c.Policy, c.RedisTimeout, c.LeaseInterval, c.LeaseTTL, r.RedisVersion)
	w("- Policy overrides (every stream admitted): %s\n", "`"+strings.Join(r.Overrides, "`, `")+"`")
	w("- Stream: the overhead benchmark's (a 1 KiB streamed chat request of tenant acme, %d ext_proc messages, in-process upstream); "+
		"with the example policy each admission passes 4 compartments (feature, tier × feature, tenant, provider) and reserves 3 token windows\n", bench.StreamMessages)
	w("- Load: closed loop, %.1fs warm-up + %.1fs measured per run; Redis's and the replicas' counters are read at the measured window's edges\n",
		c.WarmupSeconds, c.WindowSeconds)

	if len(r.Targets) > 0 {
		w("\n## Targets\n\n| target | goal | measured | status |\n|---|---|---|---|\n")
		for _, t := range r.Targets {
			w("| %s | %s | %s | **%s** |\n", t.Name, t.Goal, t.Measured, t.Status)
		}
	}

	if len(r.Levels) > 0 {
		w("\n## One replica per side: added latency, and Redis's work per admission\n\n")
		w("%d repetitions per level, the sides rotating which goes first; each admission has a redis-server of its own. "+
			"Medians over the repetitions, [min–max] in brackets. Latency is per stream, from the client's first byte to its last.\n\n", c.Reps)
		w("| streams | side | streams/s | p50 µs | p99 µs | server CPU µs/stream | errors |\n|---:|---|---:|---:|---:|---:|---:|\n")
		for _, lv := range r.Levels {
			w("| %d | %s | %s | %s | %s | %s | %d |\n", lv.Concurrency, SideLocal, spread(lv.Local.Rate, "%.0f"), spread(lv.Local.P50, "%.0f"),
				spread(lv.Local.P99, "%.0f"), spread(lv.Local.ServerCPU, "%.1f"), lv.Local.Errors)
			for _, md := range lv.Modes {
				s := md.Side
				w("| %d | %s | %s | %s | %s | %s | %d |\n", lv.Concurrency, md.Admission, spread(s.Rate, "%.0f"), spread(s.P50, "%.0f"),
					spread(s.P99, "%.0f"), spread(s.ServerCPU, "%.1f"), s.Errors)
			}
		}
		w("\nAgainst local, per pair of runs of one repetition. Noise = local's own p50 spread over the repetitions (max − min).\n\n")
		w("| streams | admission | throughput ratio | added p50 µs | noise µs | added p99 µs | added server CPU µs/stream |\n|---:|---|---:|---:|---:|---:|---:|\n")
		for _, lv := range r.Levels {
			for _, md := range lv.Modes {
				w("| %d | %s | %s | %s | %s | %s | %s |\n", lv.Concurrency, md.Admission, spread(md.Ratio, "%.3f"), spread(md.AddedP50, "%+.0f"),
					opt(float64(lv.Noise), "%.0f"), spread(md.AddedP99, "%+.0f"), spread(md.AddedCPU, "%+.1f"))
			}
		}
		w("\n" + workLegend + "\n\n")
		b.WriteString(workHeader("| streams | admission "))
		for _, lv := range r.Levels {
			for _, md := range lv.Modes {
				w("| %d | %s %s\n", lv.Concurrency, md.Admission, workRow(md.Work))
			}
		}
		for _, lv := range r.Levels[len(r.Levels)-1:] {
			for _, md := range lv.Modes {
				commandTable(&b, fmt.Sprintf("%s, one replica at %d streams (the last repetition)", md.Admission, lv.Concurrency), md.Work.Commands)
			}
		}
	}

	if len(r.Fleets) > 0 {
		w("\n## Fleets\n\n")
		w("A fresh fleet of separate replica processes per row, each replica under its own closed-loop load of %d streams (modest: every replica, "+
			"Redis and the load generator share this machine), all at once; %d runs per fleet, %.1fs warm-up + %.1fs measured each (a multiple of the replicas' usage "+
			"flush, which a fleet started together runs all at once). Streams/s adds the replicas'; p50 is the median "+
			"replica's, p99 the worst replica's. Redis's figures add up every node's (a Redis Cluster has three masters).\n\n",
			c.FleetConcurrency, c.FleetReps, c.WarmupSeconds, c.FleetWindow)
		for _, ir := range r.IdleRedis {
			w("%s Redis with no client connected, before its fleets: %s ms of CPU a second.\n", ir.Redis, opt(float64(ir.CPU), "%.2f"))
		}
		if len(r.IdleRedis) > 0 {
			w("\n")
		}
		w("| redis | replicas | admission | streams/s | p50 µs | p99 µs | errors |\n|---|---:|---|---:|---:|---:|---:|\n")
		for _, f := range r.Fleets {
			w("| %s | %d | %s | %s | %s | %s | %d |\n", f.Redis, f.Replicas, f.Admission, spread(f.Rate, "%.0f"), spread(f.P50, "%.0f"), spread(f.P99, "%.0f"), f.Errors)
		}
		w("\n" + workLegend + "\n\n")
		b.WriteString(workHeader("| redis | replicas | admission "))
		for _, f := range r.Fleets {
			w("| %s | %d | %s %s\n", f.Redis, f.Replicas, f.Admission, workRow(f.Work))
		}
		for _, f := range r.Fleets {
			if f.Replicas == slices.Max(c.Replicas) && f.Redis == r.Fleets[len(r.Fleets)-1].Redis {
				commandTable(&b, fmt.Sprintf("%s, %d replicas on %s Redis (the last run)", f.Admission, f.Replicas, f.Redis), f.Work.Commands)
				if len(f.Work.Reasons) > 0 {
					fmt.Fprintf(&b, "\nLease reports per replica-second, by reason (the last run): %s.\n", reasonsOf(f.Work.Reasons))
				}
			}
		}
	}

	if bh := r.Behaviour; bh != nil {
		w("\n## Leased admission: skew and churn\n\n")
		w("%d replicas (one more joins), one standalone Redis, `%s` limited to %d, an upstream that holds each request %s and counts the requests it holds; "+
			"%d closed-loop clients per replica (so that the limit binds); lease_interval %s, lease_ttl %s; phases of %s. Every replica's "+
			"GET /admin/cluster and /admin/compartments read every %s. A lease has followed when it is within one slot of its max-min fair share "+
			"of the limit among what the replicas' clients ask for.\n\n",
			bh.Replicas, chatCompartment, bh.Limit, bh.Hold, bh.Clients, bh.LeaseInterval, bh.LeaseTTL, bh.Phase, pollEvery)
		w("| behaviour | what changed | fair share | lease before → after | time to follow | lease intervals |\n|---|---|---:|---:|---:|---:|\n")
		w("| skew | replica 1: %d → %d of %d clients (others %v) | %d | %d → %d | %s | %s |\n", bh.Clients, bh.SkewClients[0], bh.Clients*bh.Replicas,
			bh.SkewClients[1:], bh.SkewExpected, bh.SkewBefore, bh.SkewAfter, opt(float64(bh.SkewFollowed), "%.2f s"), opt(float64(bh.SkewIntervals), "%.1f"))
		w("| join | replica %d starts (listening after %s) with %d clients | %d | 0 → %d | %s | %s |\n", bh.Replicas+1, opt(float64(bh.JoinStart), "%.2f s"),
			bh.Clients, bh.JoinExpected, bh.JoinSlots, opt(float64(bh.JoinFollowed), "%.2f s"), opt(float64(bh.JoinIntervals), "%.1f"))
		iv, _ := time.ParseDuration(bh.LeaseInterval)
		w("| kill | replica 1 (holding %d) gets SIGKILL | %v | | %s | %s |\n", bh.KillHeld, bh.KillExpected, opt(float64(bh.KillRebalanced), "%.2f s"),
			opt(float64(bh.KillRebalanced)/iv.Seconds(), "%.1f"))
		w("\nThe skewed replica's share of the fleet's admissions: %.0f%% before, %.0f%% after (second half of each phase). "+
			"In flight at once: the upstream held at most **%d** requests, the replicas' in-flight added up to at most %d (read one replica after "+
			"the other, so a slot passed on between two reads may count twice); limit %d. Requests: %d admitted, %d refused, %d failed%s. "+
			"Lease waits (llm_bulkhead_cluster_lease_waits_total, surviving replicas): %.0f for a slot, %.0f for a window chunk.\n",
			100*float64(bh.ShareBefore), 100*float64(bh.ShareAfter), bh.MaxUpstream, bh.MaxAdminSum, bh.Limit, bh.Admitted, bh.Refused, bh.Failed,
			firstErr(bh.FirstError), bh.LeaseWaits["slot"], bh.LeaseWaits["window"])
		if cw := bh.Contended; cw != nil {
			w("\nRedis's work while the limit binds (second half of the first even phase, %.0f admissions, not polled): %s client commands and %s "+
				"inside scripts per admission, %s µs of Redis CPU per admission; %s lease reports per replica-second, %s lease waits per admission.\n",
				cw.Admitted, opt(float64(cw.ClientCommands), "%.3f"), opt(float64(cw.InScripts), "%.2f"), opt(float64(cw.RedisCPU), "%.1f"),
				opt(float64(cw.ReportsPerReplica), "%.1f"), opt(float64(cw.LeaseWaits), "%.3f"))
		}
	}

	if len(r.Samples) > 0 {
		var errs []string
		for _, s := range r.Samples {
			if s.Load.Errors > 0 {
				errs = append(errs, fmt.Sprintf("%s at %d streams, rep %d: %d errors, first: %s", s.Side, s.Load.Concurrency, s.Load.Rep, s.Load.Errors, s.Load.FirstError))
			}
		}
		for _, f := range r.Fleet {
			if f.Errors > 0 {
				errs = append(errs, fmt.Sprintf("%d %s replicas on %s Redis, rep %d: %d errors, first: %s", f.Replicas, f.Admission, f.Redis, f.Rep, f.Errors, f.FirstError))
			}
		}
		if len(errs) > 0 {
			w("\nErrors (the numbers above are not valid for these runs):\n\n")
			for _, e := range errs {
				w("- %s\n", e)
			}
		}
		w("\nRaw runs of the comparison (in the order they ran):\n\n| side | streams | rep | streams/s | p50 µs | p99 µs | server CPU µs/stream | client commands/admission | Redis CPU µs/admission |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, s := range r.Samples {
			cc, cpu := "", ""
			if s.Work != nil {
				cc, cpu = opt(float64(s.Work.ClientCommands), "%.3f"), opt(float64(s.Work.RedisCPU), "%.1f")
			}
			w("| %s | %d | %d | %.0f | %.0f | %.0f | %.1f | %s | %s |\n", s.Side, s.Load.Concurrency, s.Load.Rep, s.Load.Rate, s.Load.P50, s.Load.P99,
				s.Load.ServerCPU, cc, cpu)
		}
	}
	return b.String()
}

func firstErr(s string) string {
	if s == "" {
		return ""
	}
	return " (first: " + s + ")"
}

const workLegend = "Redis's work per admission over the measured windows, divided by the admissions the replicas counted (`llm_bulkhead_admitted_total`). " +
	"Client commands: what clients sent, from `INFO commandstats` without the commands the scripts run (and without this program's INFO); " +
	"in scripts: the commands the scripts ran inside Redis. CPU: redis-server's threads' time on a CPU (/proc/<pid>/task/*/schedstat, every node); over idle: less what the same Redis spent in as long with no client connected (fleets only). Replica calls: " +
	"`llm_bulkhead_cluster_redis_seconds_count` by op (a lease call is one pipeline of reports, one per compartment in use) and " +
	"`llm_bulkhead_cluster_lease_reports_total`; waits: `llm_bulkhead_cluster_lease_waits_total`. Call p50/p99: the round trip of op admit " +
	"(exact) or lease (leased), from the replicas' histogram."

func workHeader(lead string) string {
	return lead + "| client commands | in scripts | Redis CPU µs | over idle µs | Redis cores | admit calls | settle calls | heartbeats | lease calls | lease reports | reports/replica/s | lease waits (of them for a window) | call p50 µs | call p99 µs | without Redis |\n" +
		"|" + strings.Repeat("---|", strings.Count(lead, "|")-1) + strings.Repeat("---:|", 15) + "\n"
}

func workRow(w WorkStats) string {
	return fmt.Sprintf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s (%s) | %s | %s | %.0f |",
		spread(w.ClientCommands, "%.3f"), spread(w.InScripts, "%.2f"), spread(w.RedisCPU, "%.1f"), spread(w.RedisCPUOverIdle, "%.1f"), spread(w.RedisCores, "%.2f"),
		spread(w.AdmitCalls, "%.3f"), spread(w.SettleCalls, "%.3f"), spread(w.HeartbeatCalls, "%.4f"), spread(w.LeaseCalls, "%.4f"),
		spread(w.LeaseReports, "%.4f"), spread(w.ReportsPerReplica, "%.1f"), spread(w.LeaseWaits, "%.4f"), spread(w.WindowWaits, "%.4f"), spread(w.CallP50, "%.0f"),
		spread(w.CallP99, "%.0f"), w.WithoutRedis)
}

// commandTable writes the per-command costs of one run, most time first.
func commandTable(b *strings.Builder, title string, cmds map[string]CommandCost) {
	if len(cmds) == 0 {
		return
	}
	names := make([]string, 0, len(cmds))
	for k := range cmds {
		names = append(names, k)
	}
	slices.SortFunc(names, func(a, b string) int { return cmpDesc(cmds[a].Usec, cmds[b].Usec, a, b) })
	fmt.Fprintf(b, "\nBy command, per admission: %s. A script's time includes the commands it ran, which are listed too (in scripts: yes).\n\n", title)
	b.WriteString("| command | in scripts | calls | µs |\n|---|---|---:|---:|\n")
	for _, k := range names {
		in := ""
		if fleet.InScripts(k) {
			in = "yes"
		}
		fmt.Fprintf(b, "| %s | %s | %.4f | %.2f |\n", k, in, cmds[k].Calls, cmds[k].Usec)
	}
}

func spread(s bench.Spread, format string) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 || s.Min == s.Max {
		return fmt.Sprintf(format, s.Median)
	}
	return fmt.Sprintf(format+" ["+format+"–"+format+"]", s.Median, s.Min, s.Max)
}

func opt(v float64, format string) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "—"
	}
	return fmt.Sprintf(format, v)
}

// reasonsOf lists lease reports per replica-second by reason, most first.
func reasonsOf(m map[string]float64) string {
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, k)
	}
	slices.SortFunc(names, func(a, b string) int { return cmpDesc(m[a], m[b], a, b) })
	parts := make([]string, len(names))
	for i, k := range names {
		parts[i] = fmt.Sprintf("%s %.1f", k, m[k])
	}
	return strings.Join(parts, ", ")
}
