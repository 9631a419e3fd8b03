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
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
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
		Levels           []int   `json:"concurrency"`
		Reps             int     `json:"reps"`
		WarmupSeconds    float64 `json:"warmup_seconds"`
		WindowSeconds    float64 `json:"window_seconds"`
		Replicas         int     `json:"replicas"`
		FleetConcurrency int     `json:"fleet_concurrency"`
		RedisTimeout     string  `json:"redis_timeout"`
		Policy           string  `json:"policy"`
	} `json:"config"`
	Overrides []string `json:"policy_overrides"`

	Samples []Sample      `json:"samples"`
	Levels  []Level       `json:"levels"`
	Fleet   []FleetSample `json:"fleet,omitempty"`
	Targets []Target      `json:"targets"`
}

// Level compares the sides at one concurrency. The ratio and differences are computed per
// repetition from the two runs that ran next to each other, then summarised.
type Level struct {
	Concurrency int       `json:"concurrency"`
	Local       SideStats `json:"local"`
	Redis       SideStats `json:"redis"`
	// Ratio is the Redis side's streams/s over the local side's.
	Ratio bench.Spread `json:"throughput_ratio"`
	// AddedP50, AddedP99 (µs) and AddedCPU (server CPU µs per stream): Redis side minus local.
	AddedP50 bench.Spread `json:"added_p50_us"`
	AddedP99 bench.Spread `json:"added_p99_us"`
	AddedCPU bench.Spread `json:"added_server_cpu_us_per_stream"`
	// Per stream on the Redis side (see Sample).
	AdmitCalls     bench.Spread `json:"admit_calls_per_stream"`
	SettleCalls    bench.Spread `json:"settle_calls_per_stream"`
	HeartbeatCalls bench.Spread `json:"heartbeat_calls_per_stream"`
	Scripts        bench.Spread `json:"scripts_per_stream"`
	RoundTrips     bench.Spread `json:"round_trips_per_stream"`
	InScripts      bench.Spread `json:"commands_in_scripts_per_stream"`
	Processed      bench.Spread `json:"commands_processed_per_stream"`
	RedisCPU       bench.Spread `json:"redis_cpu_us_per_stream"`
	ScriptUsec     bench.Spread `json:"redis_script_us_per_stream"`
	AdmitP50       bench.Spread `json:"admit_round_trip_p50_us"`
	AdmitP99       bench.Spread `json:"admit_round_trip_p99_us"`
	WithoutRedis   float64      `json:"without_redis"`
}

// SideStats aggregates one side's samples at one level over the repetitions.
type SideStats struct {
	Rate      bench.Spread `json:"streams_per_sec"`
	P50       bench.Spread `json:"p50_us"`
	P99       bench.Spread `json:"p99_us"`
	ServerCPU bench.Spread `json:"server_cpu_us_per_stream"`
	Errors    int          `json:"errors"`
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
	r.Config.Levels, r.Config.Reps = cfg.Levels, cfg.Reps
	r.Config.WarmupSeconds, r.Config.WindowSeconds = cfg.Warmup.Seconds(), cfg.Duration.Seconds()
	r.Config.Replicas, r.Config.FleetConcurrency = cfg.Replicas, cfg.FleetConcurrency
	r.Config.RedisTimeout, r.Config.Policy = cfg.RedisTimeout.String(), cfg.PolicyPath
	return r
}

func (r *Report) finish() {
	r.Finished = time.Now()
	r.Machine.LoadAvgEnd = harness.LoadAverage()
	r.Levels = Aggregate(r.Samples)
	r.Targets = r.judge()
}

// Aggregate groups samples by level (in the order the levels first appear) and pairs the
// sides' runs by repetition.
func Aggregate(samples []Sample) []Level {
	var levels []int
	for _, s := range samples {
		if !slices.Contains(levels, s.Concurrency) {
			levels = append(levels, s.Concurrency)
		}
	}
	var out []Level
	for _, c := range levels {
		var local, redis []Sample
		for _, s := range samples {
			switch {
			case s.Concurrency != c:
			case s.Side == SideLocal:
				local = append(local, s)
			case s.Side == SideRedis:
				redis = append(redis, s)
			}
		}
		byRep := func(a, b Sample) int { return a.Rep - b.Rep }
		slices.SortFunc(local, byRep)
		slices.SortFunc(redis, byRep)
		col := func(ss []Sample, f func(Sample) float64) []float64 {
			out := make([]float64, len(ss))
			for i, s := range ss {
				out[i] = f(s)
			}
			return out
		}
		rate := func(s Sample) float64 { return s.Rate }
		p50 := func(s Sample) float64 { return s.P50 }
		p99 := func(s Sample) float64 { return s.P99 }
		cpu := func(s Sample) float64 { return s.ServerCPU }
		side := func(ss []Sample) SideStats {
			st := SideStats{Rate: bench.Summarize(col(ss, rate)), P50: bench.Summarize(col(ss, p50)), P99: bench.Summarize(col(ss, p99)),
				ServerCPU: bench.Summarize(col(ss, cpu))}
			for _, s := range ss {
				st.Errors += s.Errors
			}
			return st
		}
		sum := func(f func(Sample) float64) bench.Spread { return bench.Summarize(col(redis, f)) }
		lv := Level{Concurrency: c, Local: side(local), Redis: side(redis),
			Ratio:          bench.Summarize(bench.Ratios(col(redis, rate), col(local, rate))),
			AddedP50:       bench.Summarize(bench.Differences(col(redis, p50), col(local, p50))),
			AddedP99:       bench.Summarize(bench.Differences(col(redis, p99), col(local, p99))),
			AddedCPU:       bench.Summarize(bench.Differences(col(redis, cpu), col(local, cpu))),
			AdmitCalls:     sum(func(s Sample) float64 { return s.AdmitCalls }),
			SettleCalls:    sum(func(s Sample) float64 { return s.SettleCalls }),
			HeartbeatCalls: sum(func(s Sample) float64 { return s.HeartbeatCalls }),
			Scripts:        sum(func(s Sample) float64 { return s.Scripts }),
			RoundTrips:     sum(func(s Sample) float64 { return s.RoundTrips }),
			InScripts:      sum(func(s Sample) float64 { return s.InScripts }),
			Processed:      sum(func(s Sample) float64 { return s.Processed }),
			RedisCPU:       sum(func(s Sample) float64 { return s.RedisCPU }),
			ScriptUsec:     sum(func(s Sample) float64 { return s.ScriptUsec }),
			AdmitP50:       sum(func(s Sample) float64 { return s.AdmitP50 }),
			AdmitP99:       sum(func(s Sample) float64 { return s.AdmitP99 }),
		}
		for _, s := range redis {
			lv.WithoutRedis += s.WithoutRedis
		}
		out = append(out, lv)
	}
	return out
}

// judge checks the round-trip targets: at most one call to Redis on the admission path and at
// most two in all per stream, at every level (the worst repetition counts).
func (r *Report) judge() []Target {
	var out []Target
	status := func(ok bool) string {
		if ok {
			return "met"
		}
		return "missed"
	}
	for _, lv := range r.Levels {
		if lv.AdmitCalls.N == 0 {
			continue
		}
		out = append(out,
			Target{Name: fmt.Sprintf("admission-path round trips per stream, %d streams", lv.Concurrency), Goal: "≤ 1",
				Measured: fmt.Sprintf("%.3f (worst rep)", lv.AdmitCalls.Max), Status: status(lv.AdmitCalls.Max <= 1)},
			Target{Name: fmt.Sprintf("Redis round trips per stream, %d streams", lv.Concurrency), Goal: "≤ 2",
				Measured: fmt.Sprintf("%.3f scripts, %.3f commands of any kind (worst rep)", lv.Scripts.Max, lv.RoundTrips.Max),
				Status:   status(lv.Scripts.Max <= 2 && lv.RoundTrips.Max <= 2)})
	}
	return out
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

// MarshalJSON writes NaN (not measured) as null.
func (s Sample) MarshalJSON() ([]byte, error) {
	type nulls struct {
		ServerCPU   *float64 `json:"server_cpu_us_per_stream"`
		LoadCPU     *float64 `json:"load_cpu_us_per_stream"`
		ServerCores *float64 `json:"server_cores"`
		AdmitCalls  *float64 `json:"admit_calls_per_stream,omitempty"`
		SettleCalls *float64 `json:"settle_calls_per_stream,omitempty"`
		Heartbeats  *float64 `json:"heartbeat_calls_per_stream,omitempty"`
		Scripts     *float64 `json:"scripts_per_stream,omitempty"`
		RoundTrips  *float64 `json:"round_trips_per_stream,omitempty"`
		InScripts   *float64 `json:"commands_in_scripts_per_stream,omitempty"`
		Processed   *float64 `json:"commands_processed_per_stream,omitempty"`
		RedisCPU    *float64 `json:"redis_cpu_us_per_stream,omitempty"`
		ScriptUsec  *float64 `json:"redis_script_us_per_stream,omitempty"`
		AdmitP50    *float64 `json:"admit_round_trip_p50_us,omitempty"`
		AdmitP99    *float64 `json:"admit_round_trip_p99_us,omitempty"`
	}
	// The embedded bench.Sample has a MarshalJSON of its own; flatten its fields by hand.
	return json.Marshal(struct {
		Side        string                 `json:"side"`
		Server      string                 `json:"server"`
		Concurrency int                    `json:"concurrency"`
		Rep         int                    `json:"rep"`
		Streams     int                    `json:"streams"`
		Rate        float64                `json:"streams_per_sec"`
		Errors      int                    `json:"errors"`
		FirstError  string                 `json:"first_error,omitempty"`
		P50         float64                `json:"p50_us"`
		P90         float64                `json:"p90_us"`
		P99         float64                `json:"p99_us"`
		Max         float64                `json:"max_us"`
		Window      float64                `json:"window_seconds"`
		Admitted    float64                `json:"admitted,omitempty"`
		Without     float64                `json:"without_redis,omitempty"`
		Commands    map[string]CommandCost `json:"redis_commands_per_stream,omitempty"`
		nulls
	}{s.Side, s.Server, s.Concurrency, s.Rep, s.Streams, s.Rate, s.Errors, s.FirstError, s.P50, s.P90, s.P99, s.Max, s.Window,
		s.Admitted, s.WithoutRedis, s.Commands,
		nulls{ServerCPU: finite(s.ServerCPU), LoadCPU: finite(s.LoadCPU), ServerCores: finite(s.ServerCores),
			AdmitCalls: finiteOpt(s, s.AdmitCalls), SettleCalls: finiteOpt(s, s.SettleCalls), Heartbeats: finiteOpt(s, s.HeartbeatCalls),
			Scripts: finiteOpt(s, s.Scripts), RoundTrips: finiteOpt(s, s.RoundTrips), InScripts: finiteOpt(s, s.InScripts),
			Processed: finiteOpt(s, s.Processed), RedisCPU: finiteOpt(s, s.RedisCPU), ScriptUsec: finiteOpt(s, s.ScriptUsec),
			AdmitP50: finiteOpt(s, s.AdmitP50), AdmitP99: finiteOpt(s, s.AdmitP99)}})
}

// MarshalJSON writes NaN (not measured) as null.
func (f FleetSample) MarshalJSON() ([]byte, error) {
	type alias FleetSample
	return json.Marshal(struct {
		alias
		RedisCores    *float64 `json:"redis_cores"`
		RedisCPU      *float64 `json:"redis_cpu_us_per_stream"`
		Ceiling       *float64 `json:"ceiling_streams_per_sec"`
		ScriptCeiling *float64 `json:"script_ceiling_streams_per_sec"`
	}{alias(f), finite(f.RedisCores), finite(f.RedisCPU), finite(f.Ceiling), finite(f.ScriptCeiling)})
}

func finite(x float64) *float64 {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return nil
	}
	return &x
}

// finiteOpt is finite for the Redis side's figures, which the local side does not have.
func finiteOpt(s Sample, x float64) *float64 {
	if s.Side != SideRedis {
		return nil
	}
	return finite(x)
}

// Markdown renders the report.
func (r *Report) Markdown() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	m := r.Machine
	w("# Cluster mode: admission through Redis against local admission\n\n")
	w("- Command: `%s`\n", r.Command)
	w("- When: %s, %s\n", r.Started.UTC().Format(time.RFC3339), r.Finished.Sub(r.Started).Round(time.Second))
	w("- Machine: %d CPUs (%s), %s/%s, %s; load average %s at the start, %s at the end\n", m.CPUs, m.CPUModel, m.GOOS, m.GOARCH, m.GoVersion, m.LoadAvgStart, m.LoadAvgEnd)
	w("- Servers: %s, separate processes; local = `%s` without a cluster section, redis = with `cluster: {backend: redis, addresses: [one redis-server %s on 127.0.0.1], timeout: %s}`\n",
		r.BulkheadCommand, r.Config.Policy, r.RedisVersion, r.Config.RedisTimeout)
	w("- Policy overrides (every stream admitted): %s\n", "`"+strings.Join(r.Overrides, "`, `")+"`")
	w("- Stream: the overhead benchmark's (a 1 KiB streamed chat request of tenant acme, %d ext_proc messages, in-process upstream); "+
		"with the example policy each admission reserves 3 token windows and takes 4 slots (feature, tier × feature, tenant, provider) in one script\n", bench.StreamMessages)
	w("- Load: closed loop, %d repetitions per level alternating which side goes first, %.1fs warm-up + %.1fs measured per run\n",
		r.Config.Reps, r.Config.WarmupSeconds, r.Config.WindowSeconds)

	if len(r.Targets) > 0 {
		w("\n## Targets\n\n| target | goal | measured | status |\n|---|---|---|---|\n")
		for _, t := range r.Targets {
			w("| %s | %s | %s | **%s** |\n", t.Name, t.Goal, t.Measured, t.Status)
		}
	}

	if len(r.Levels) > 0 {
		w("\n## Local against Redis admission (one replica each)\n\n")
		w("Medians over the repetitions, [min–max] in brackets. Latency is per stream, from the client's first byte to its last.\n\n")
		w("| streams | side | streams/s | p50 µs | p99 µs | server CPU µs/stream | errors |\n|---:|---|---:|---:|---:|---:|---:|\n")
		for _, lv := range r.Levels {
			for _, s := range []struct {
				name string
				st   SideStats
			}{{SideLocal, lv.Local}, {SideRedis, lv.Redis}} {
				w("| %d | %s | %s | %s | %s | %s | %d |\n", lv.Concurrency, s.name, spread(s.st.Rate, "%.0f"), spread(s.st.P50, "%.0f"),
					spread(s.st.P99, "%.0f"), spread(s.st.ServerCPU, "%.1f"), s.st.Errors)
			}
		}
		w("\nRedis against local, per pair of adjacent runs. The admission script's round trip is the replica's own " +
			"histogram (`llm_bulkhead_cluster_redis_seconds{op=\"admit\"}`, interpolated within its buckets).\n\n")
		w("| streams | throughput ratio | added p50 µs | added p99 µs | added server CPU µs/stream | admission round trip p50 µs | p99 µs | decided without Redis |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, lv := range r.Levels {
			w("| %d | %s | %s | %s | %s | %s | %s | %.0f |\n", lv.Concurrency, spread(lv.Ratio, "%.3f"), spread(lv.AddedP50, "%+.0f"),
				spread(lv.AddedP99, "%+.0f"), spread(lv.AddedCPU, "%+.1f"), spread(lv.AdmitP50, "%.0f"), spread(lv.AdmitP99, "%.0f"), lv.WithoutRedis)
		}
		w("\n## Redis's work per stream\n\n")
		w("Over each whole Redis-side run (warm-up included, until every settlement was sent), divided by the admissions the replica counted. " +
			"Calls are the replica's (`llm_bulkhead_cluster_redis_seconds_count` by op); scripts, client commands and commands inside Redis come from " +
			"Redis's `INFO commandstats` (client commands: everything but what the scripts run, without this program's INFO); processed is " +
			"`total_commands_processed`, which counts both. CPU is redis-server's (/proc/<pid>/stat); script time is `INFO commandstats`' usec of EVALSHA.\n\n")
		w("| streams | admission calls | settlement calls | heartbeats | scripts (Redis) | client commands | commands inside scripts | processed | Redis CPU µs | script µs |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, lv := range r.Levels {
			w("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", lv.Concurrency, spread(lv.AdmitCalls, "%.3f"), spread(lv.SettleCalls, "%.3f"),
				spread(lv.HeartbeatCalls, "%.4f"), spread(lv.Scripts, "%.3f"), spread(lv.RoundTrips, "%.3f"), spread(lv.InScripts, "%.1f"),
				spread(lv.Processed, "%.1f"), spread(lv.RedisCPU, "%.1f"), spread(lv.ScriptUsec, "%.1f"))
		}
	}

	// Where Redis's time goes: the last Redis-side run at the highest level, by command.
	var last *Sample
	for i := range r.Samples {
		if s := &r.Samples[i]; s.Side == SideRedis && (last == nil || s.Concurrency >= last.Concurrency) {
			last = s
		}
	}
	if last != nil && len(last.Commands) > 0 {
		names := make([]string, 0, len(last.Commands))
		for k := range last.Commands {
			names = append(names, k)
		}
		slices.SortFunc(names, func(a, b string) int {
			switch x, y := last.Commands[a].Usec, last.Commands[b].Usec; {
			case x > y:
				return -1
			case x < y:
				return 1
			}
			return strings.Compare(a, b)
		})
		w("\nBy command, per stream (the Redis-side run at %d streams, rep %d; a script's time includes the commands it ran, which are listed too):\n\n", last.Concurrency, last.Rep)
		w("| command | calls | µs |\n|---|---:|---:|\n")
		for _, k := range names {
			c := last.Commands[k]
			w("| %s | %.3f | %.1f |\n", k, c.Calls, c.Usec)
		}
	}

	if len(r.Fleet) > 0 {
		f0 := r.Fleet[0]
		w("\n## One Redis, %d replicas\n\n", f0.Replicas)
		w("Every replica runs the Redis side's policy (its own `replica_id`) under its own load of %d streams, all at once, from this one program. "+
			"Streams/s adds the replicas'; Redis's CPU is read over the loads' common window. Ceiling = 1 s ÷ Redis CPU per stream: what one "+
			"fully busy Redis core would admit at this cost; script ceiling = 1 s ÷ script time per stream: the same without Redis's networking.\n\n",
			f0.Concurrency)
		w("| rep | streams/s | p50 µs (median replica) | p99 µs (worst replica) | replicas' cores | Redis cores | Redis CPU µs/stream | ceiling streams/s | script µs/stream | script ceiling | scripts/stream | errors | without Redis |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, f := range r.Fleet {
			w("| %d | %.0f | %.0f | %.0f | %.2f | %s | %s | %s | %.1f | %s | %.3f | %d | %.0f |\n", f.Rep, f.Rate, f.P50, f.P99, f.ReplicaCores,
				opt(f.RedisCores, "%.2f"), opt(f.RedisCPU, "%.1f"), opt(f.Ceiling, "%.0f"), f.ScriptUsec, opt(f.ScriptCeiling, "%.0f"), f.Scripts, f.Errors, f.WithoutRedis)
		}
	}

	if len(r.Samples) > 0 {
		var errs []string
		for _, s := range r.Samples {
			if s.Errors > 0 {
				errs = append(errs, fmt.Sprintf("%s at %d streams, rep %d: %d errors, first: %s", s.Side, s.Concurrency, s.Rep, s.Errors, s.FirstError))
			}
		}
		if len(errs) > 0 {
			w("\nErrors (the numbers above are not valid for these runs):\n\n")
			for _, e := range errs {
				w("- %s\n", e)
			}
		}
		w("\nRaw runs (in the order they ran):\n\n| side | streams | rep | streams/s | p50 µs | p99 µs | server CPU µs/stream | server cores | scripts/stream | Redis CPU µs/stream | admit p50 µs | admit p99 µs |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, s := range r.Samples {
			if s.Side == SideRedis {
				w("| %s | %d | %d | %.0f | %.0f | %.0f | %.1f | %.2f | %.3f | %.1f | %.0f | %.0f |\n", s.Side, s.Concurrency, s.Rep, s.Rate, s.P50, s.P99,
					s.ServerCPU, s.ServerCores, s.Scripts, s.RedisCPU, s.AdmitP50, s.AdmitP99)
			} else {
				w("| %s | %d | %d | %.0f | %.0f | %.0f | %.1f | %.2f | | | | |\n", s.Side, s.Concurrency, s.Rep, s.Rate, s.P50, s.P99, s.ServerCPU, s.ServerCores)
			}
		}
	}
	return b.String()
}

func spread(s bench.Spread, format string) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 {
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
