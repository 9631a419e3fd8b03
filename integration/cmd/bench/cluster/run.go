package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
	"github.com/llm-bulkhead/llm-bulkhead/integration/cmd/clusterdemo/fleet"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// Sides of the comparison.
const (
	SideLocal = "local"
	SideRedis = "redis"
)

// Sample is one load run of one side.
type Sample struct {
	Side string `json:"side"`
	bench.Sample
	// The Redis side only. Admitted is what the replica admitted during the whole run (warm-up
	// included); the per-stream figures below divide by it.
	Admitted float64 `json:"admitted,omitempty"`
	// AdmitCalls, SettleCalls and HeartbeatCalls are the replica's calls to Redis per admission.
	AdmitCalls     float64 `json:"admit_calls_per_stream,omitempty"`
	SettleCalls    float64 `json:"settle_calls_per_stream,omitempty"`
	HeartbeatCalls float64 `json:"heartbeat_calls_per_stream,omitempty"`
	// Scripts (EVALSHA and EVAL), RoundTrips (every command clients sent), InScripts (commands
	// the scripts ran inside Redis) and Processed (total_commands_processed) per admission, from
	// Redis's own counters.
	Scripts    float64 `json:"scripts_per_stream,omitempty"`
	RoundTrips float64 `json:"round_trips_per_stream,omitempty"`
	InScripts  float64 `json:"commands_in_scripts_per_stream,omitempty"`
	Processed  float64 `json:"commands_processed_per_stream,omitempty"`
	// RedisCPU is Redis's CPU time per admission, µs; ScriptUsec the time Redis accounts to
	// running the scripts per admission (commandstats usec), µs.
	RedisCPU   float64 `json:"redis_cpu_us_per_stream,omitempty"`
	ScriptUsec float64 `json:"redis_script_us_per_stream,omitempty"`
	// AdmitP50 and AdmitP99 are the admission script's round trip as the replica measured it
	// (its histogram, interpolated within buckets), µs.
	AdmitP50 float64 `json:"admit_round_trip_p50_us,omitempty"`
	AdmitP99 float64 `json:"admit_round_trip_p99_us,omitempty"`
	// WithoutRedis counts admissions decided without Redis (it did not answer in time).
	WithoutRedis float64 `json:"without_redis,omitempty"`
	// Commands holds, per command Redis counted (scripts' own commands included), its calls and
	// the µs Redis accounts to it, per admission.
	Commands map[string]CommandCost `json:"-"`
}

// CommandCost is one command's calls and time (µs), per admission.
type CommandCost struct {
	Calls float64 `json:"calls"`
	Usec  float64 `json:"usec"`
}

// FleetSample is one run of several replicas sharing one Redis, each under the same load.
type FleetSample struct {
	Rep         int `json:"rep"`
	Replicas    int `json:"replicas"`
	Concurrency int `json:"concurrency_per_replica"`
	// Streams and Rate add up the replicas' measured windows.
	Streams int     `json:"streams"`
	Rate    float64 `json:"streams_per_sec"`
	// P50 is the median of the replicas' p50s, P99 the largest of their p99s, µs.
	P50 float64 `json:"p50_us"`
	P99 float64 `json:"p99_us"`
	// ReplicaCores adds the replicas' CPU use in the window; RedisCores is Redis's.
	ReplicaCores float64 `json:"replica_cores"`
	RedisCores   float64 `json:"redis_cores"`
	// RedisCPU is Redis's CPU per stream in the window, µs; Ceiling the streams/s one fully busy
	// Redis core would sustain at that cost (1 s / RedisCPU).
	RedisCPU float64 `json:"redis_cpu_us_per_stream"`
	Ceiling  float64 `json:"ceiling_streams_per_sec"`
	// Scripts, RoundTrips and ScriptUsec are per admission over the whole run, as in Sample.
	Scripts    float64 `json:"scripts_per_stream"`
	RoundTrips float64 `json:"round_trips_per_stream"`
	ScriptUsec float64 `json:"redis_script_us_per_stream"`
	// ScriptCeiling is the streams/s Redis would sustain if it did nothing but run the scripts
	// (1 s / ScriptUsec): the bound without Redis's networking.
	ScriptCeiling float64 `json:"script_ceiling_streams_per_sec"`
	Errors        int     `json:"errors"`
	WithoutRedis  float64 `json:"without_redis"`
}

// Run measures and writes the report. progress receives one line per step.
func Run(ctx context.Context, cfg Config, progress io.Writer) (*Report, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return nil, err
	}
	logf := func(format string, args ...any) {
		fmt.Fprintf(progress, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
	}
	rep := newReport(cfg)

	src, err := os.ReadFile(cfg.PolicyPath)
	if err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp("", "llm-bulkhead-bench-cluster-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	bin := cfg.BulkheadBinary
	rep.BulkheadCommand = "llm-bulkhead serve (prebuilt binary " + bin + ")"
	if bin == "" {
		logf("building llm-bulkhead")
		if bin, err = bench.BuildServer(ctx, tmp); err != nil {
			return nil, err
		}
		rep.BulkheadCommand = "llm-bulkhead serve (binary from go build -tags vtprotobuf ./cmd/llm-bulkhead)"
	}
	rd, err := fleet.StartRedis(ctx)
	if err != nil {
		return nil, err
	}
	defer rd.Stop()
	if v, err := rd.Info(ctx, "server"); err == nil {
		rep.RedisVersion = v["redis_version"]
	}
	logf("redis-server %s listening on %s (pid %d)", rep.RedisVersion, rd.Addr, rd.Pid())

	localPolicy, err := fleet.WithoutCluster(cfg.PolicyPath, src)
	if err != nil {
		return nil, err
	}
	sharedPolicy, err := fleet.WithCluster(cfg.PolicyPath, src, fleet.Cluster{Addr: rd.Addr, KeyPrefix: "bench", Timeout: cfg.RedisTimeout})
	if err != nil {
		return nil, err
	}
	files := map[string]string{SideLocal: filepath.Join(tmp, "local.yaml"), SideRedis: filepath.Join(tmp, "redis.yaml")}
	for side, b := range map[string][]byte{SideLocal: localPolicy, SideRedis: sharedPolicy} {
		if err := os.WriteFile(files[side], b, 0o600); err != nil {
			return nil, err
		}
	}
	spec := func(side, id string) bench.Spec {
		env := bench.ServerEnv()
		if side == SideRedis {
			env = append(env, "LLM_BULKHEAD_CLUSTER__REPLICA_ID="+id)
		}
		return bench.Spec{Name: id, Env: env, ReadyMsg: bench.BinaryReadyMessage,
			Argv: []string{bin, "serve", "--config", files[side], "--watch=false", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}}
	}

	body, err := bench.ChatBody(bench.BodySize)
	if err != nil {
		return nil, err
	}
	req := bench.ChatRequest(body)
	filter, err := bench.FilterConfig(cfg.MessageTimeout)
	if err != nil {
		return nil, err
	}

	if len(cfg.Levels) > 0 {
		if err := compare(ctx, cfg, rep, rd, spec, req, filter, logf); err != nil {
			return rep, err
		}
	}
	if cfg.Replicas > 1 {
		if err := fleetRuns(ctx, cfg, rep, rd, spec, req, filter, logf); err != nil {
			return rep, err
		}
	}
	rep.finish()
	return rep, rep.write(cfg.Out)
}

// compare runs one local and one Redis replica at every level, Reps times, alternating which
// goes first.
func compare(ctx context.Context, cfg Config, rep *Report, rd *fleet.Redis, spec func(side, id string) bench.Spec,
	req *envoysim.Request, filter envoysim.FilterConfig, logf func(string, ...any)) error {
	type side struct {
		name string
		r    *fleet.Replica
		sim  *envoysim.Sim
	}
	var sides []*side
	defer func() {
		for _, s := range sides {
			if s.sim != nil {
				_ = s.sim.Close()
			}
		}
		var rs []*fleet.Replica
		for _, s := range sides {
			rs = append(rs, s.r)
		}
		_ = fleet.StopReplicas(rs)
	}()
	for _, name := range []string{SideLocal, SideRedis} {
		rs, err := fleet.StartReplicas(1, func(int) bench.Spec { return spec(name, name) })
		if err != nil {
			return err
		}
		s := &side{name: name, r: rs[0]}
		sides = append(sides, s)
		if s.sim, err = envoysim.New(s.r.GRPCAddr, filter); err != nil {
			return err
		}
		res, err := s.sim.RoundTrip(ctx, req, bench.SSEUpstream())
		if err != nil {
			return err
		}
		if err := bench.Check(res, true); err != nil {
			return fmt.Errorf("first request through %s: %w", name, err)
		}
		logf("%s listening on %s (pid %d)", name, s.r.GRPCAddr, s.r.Pid())
	}
	up := bench.SSEUpstream()
	for _, conc := range cfg.Levels {
		for r := range cfg.Reps {
			order := []*side{sides[r%2], sides[(r+1)%2]}
			for _, s := range order {
				l := bench.Load{Sim: s.sim, Request: req, Upstream: up, Concurrency: conc, Warmup: cfg.Warmup,
					Duration: cfg.Duration, Admitted: true, Pid: s.r.Pid()}
				var smp Sample
				var err error
				if s.name == SideRedis {
					smp, err = measureRedis(ctx, rd, []*fleet.Replica{s.r}, func() (bench.Sample, error) { return l.Run(ctx) })
				} else {
					smp.Sample, err = l.Run(ctx)
				}
				if err != nil {
					return err
				}
				if err := s.r.Alive(); err != nil {
					return err
				}
				smp.Side, smp.Server, smp.Rep = s.name, s.name, r+1
				rep.Samples = append(rep.Samples, smp)
				line := fmt.Sprintf("%-6s c=%-4d rep %d/%d: %7.0f streams/s  p50 %6.0fµs  p99 %7.0fµs  server %5.1fµs CPU/stream  errors %d",
					s.name, conc, r+1, cfg.Reps, smp.Rate, smp.P50, smp.P99, smp.ServerCPU, smp.Errors)
				if s.name == SideRedis {
					line += fmt.Sprintf("  | %.2f scripts/stream, Redis %.1fµs CPU/stream, admit round trip p50 %.0fµs p99 %.0fµs",
						smp.Scripts, smp.RedisCPU, smp.AdmitP50, smp.AdmitP99)
				}
				logf("%s", line)
			}
		}
	}
	return nil
}

// measureRedis runs load and reads, around it, Redis's counters and CPU time and the replicas'
// metrics, once every settlement has reached Redis.
func measureRedis(ctx context.Context, rd *fleet.Redis, rs []*fleet.Replica, load func() (bench.Sample, error)) (Sample, error) {
	var smp Sample
	m0, err := scrape(ctx, rs)
	if err != nil {
		return smp, err
	}
	c0, err := rd.ReadCommands(ctx)
	if err != nil {
		return smp, err
	}
	cpu0, err := rd.CPU()
	if err != nil {
		return smp, err
	}
	if smp.Sample, err = load(); err != nil {
		return smp, err
	}
	if err := settled(ctx, rs); err != nil {
		return smp, err
	}
	cpu1, err := rd.CPU()
	if err != nil {
		return smp, err
	}
	c1, err := rd.ReadCommands(ctx)
	if err != nil {
		return smp, err
	}
	m1, err := scrape(ctx, rs)
	if err != nil {
		return smp, err
	}
	d := c1.Sub(c0)
	sum := func(name string, match ...string) float64 {
		var v float64
		for i := range rs {
			v += m1[i].Sum(name, match...) - m0[i].Sum(name, match...)
		}
		return v
	}
	n := sum("llm_bulkhead_admitted_total")
	smp.Admitted = n
	smp.WithoutRedis = sum("llm_bulkhead_cluster_unavailable_admissions_total")
	per := func(x float64) float64 {
		if n <= 0 {
			return math.NaN()
		}
		return x / n
	}
	smp.AdmitCalls = per(sum("llm_bulkhead_cluster_redis_seconds_count", "op", "admit"))
	smp.SettleCalls = per(sum("llm_bulkhead_cluster_redis_seconds_count", "op", "settle"))
	smp.HeartbeatCalls = per(sum("llm_bulkhead_cluster_redis_seconds_count", "op", "heartbeat"))
	smp.Scripts = per(float64(d.Scripts()))
	smp.RoundTrips = per(float64(d.RoundTrips()))
	smp.InScripts = per(float64(d.InScripts()))
	smp.Processed = per(float64(d.Processed))
	smp.RedisCPU = per(float64((cpu1 - cpu0).Microseconds()))
	smp.ScriptUsec = per(float64(d.ScriptUsec()))
	smp.Commands = map[string]CommandCost{}
	for k, v := range d.Calls {
		if k != "info" && n > 0 {
			smp.Commands[k] = CommandCost{Calls: float64(v) / n, Usec: float64(d.Usec[k]) / n}
		}
	}
	var h fleet.Buckets
	for i := range rs {
		hi := m1[i].Histogram("llm_bulkhead_cluster_redis_seconds", "op", "admit").Sub(m0[i].Histogram("llm_bulkhead_cluster_redis_seconds", "op", "admit"))
		if h == nil {
			h = hi
			continue
		}
		for j := range h {
			if j < len(hi) {
				h[j].Count += hi[j].Count
			}
		}
	}
	smp.AdmitP50, smp.AdmitP99 = h.Quantile(0.5)*1e6, h.Quantile(0.99)*1e6
	return smp, nil
}

func scrape(ctx context.Context, rs []*fleet.Replica) ([]fleet.Metrics, error) {
	out := make([]fleet.Metrics, len(rs))
	for i, r := range rs {
		m, err := r.Metrics(ctx)
		if err != nil {
			return nil, err
		}
		out[i] = m
	}
	return out, nil
}

// settled waits until every replica has sent its settlements and holds no lease.
func settled(ctx context.Context, rs []*fleet.Replica) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		ms, err := scrape(ctx, rs)
		if err != nil {
			return err
		}
		busy := 0.0
		for _, m := range ms {
			busy += m.Sum("llm_bulkhead_cluster_settlement_queue") + m.Sum("llm_bulkhead_cluster_leases")
		}
		if busy == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("replicas still hold %v leases and queued settlements 10s after the load", busy)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// fleetRuns starts cfg.Replicas replicas sharing one Redis and loads them all at once.
func fleetRuns(ctx context.Context, cfg Config, rep *Report, rd *fleet.Redis, spec func(side, id string) bench.Spec,
	req *envoysim.Request, filter envoysim.FilterConfig, logf func(string, ...any)) error {
	rs, err := fleet.StartReplicas(cfg.Replicas, func(i int) bench.Spec { return spec(SideRedis, fmt.Sprintf("r%d", i+1)) })
	if err != nil {
		return err
	}
	defer fleet.StopReplicas(rs)
	sims := make([]*envoysim.Sim, len(rs))
	defer func() {
		for _, s := range sims {
			if s != nil {
				_ = s.Close()
			}
		}
	}()
	for i, r := range rs {
		if sims[i], err = envoysim.New(r.GRPCAddr, filter); err != nil {
			return err
		}
		res, err := sims[i].RoundTrip(ctx, req, bench.SSEUpstream())
		if err != nil {
			return err
		}
		if err := bench.Check(res, true); err != nil {
			return fmt.Errorf("first request through replica %s: %w", r.ID, err)
		}
	}
	logf("%d replicas sharing redis-server %s: %d streams each", len(rs), rd.Addr, cfg.FleetConcurrency)
	up := bench.SSEUpstream()
	for r := range cfg.FleetReps {
		fs := FleetSample{Rep: r + 1, Replicas: len(rs), Concurrency: cfg.FleetConcurrency}
		var redisCPU [2]time.Duration
		var redisOK bool
		smp, err := measureRedis(ctx, rd, rs, func() (bench.Sample, error) {
			samples := make([]bench.Sample, len(rs))
			errs := make([]error, len(rs))
			var wg sync.WaitGroup
			start := time.Now()
			for i, rp := range rs {
				l := bench.Load{Sim: sims[i], Request: req, Upstream: up, Concurrency: cfg.FleetConcurrency, Warmup: cfg.Warmup,
					Duration: cfg.Duration, Admitted: true, Pid: rp.Pid()}
				wg.Go(func() { samples[i], errs[i] = l.Run(ctx) })
			}
			// Redis's CPU time over the loads' common window.
			redisOK = bench.SleepUntil(ctx, start.Add(cfg.Warmup))
			var cpuErr error
			if redisOK {
				redisCPU[0], cpuErr = rd.CPU()
				redisOK = cpuErr == nil && bench.SleepUntil(ctx, start.Add(cfg.Warmup+cfg.Duration))
			}
			if redisOK {
				redisCPU[1], cpuErr = rd.CPU()
				redisOK = cpuErr == nil
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				return bench.Sample{}, err
			}
			var p50s []float64
			for _, s := range samples {
				fs.Streams += s.Streams
				fs.Rate += s.Rate
				fs.Errors += s.Errors
				fs.ReplicaCores += s.ServerCores
				fs.P99 = max(fs.P99, s.P99)
				p50s = append(p50s, s.P50)
			}
			fs.P50 = bench.Summarize(p50s).Median
			return bench.Sample{}, nil
		})
		if err != nil {
			return err
		}
		for _, rp := range rs {
			if err := rp.Alive(); err != nil {
				return err
			}
		}
		fs.RedisCores, fs.RedisCPU, fs.Ceiling = math.NaN(), math.NaN(), math.NaN()
		if redisOK && fs.Streams > 0 {
			d := redisCPU[1] - redisCPU[0]
			fs.RedisCores = d.Seconds() / cfg.Duration.Seconds()
			fs.RedisCPU = float64(d.Microseconds()) / float64(fs.Streams)
			if fs.RedisCPU > 0 {
				fs.Ceiling = 1e6 / fs.RedisCPU
			}
		}
		fs.Scripts, fs.RoundTrips, fs.ScriptUsec, fs.WithoutRedis = smp.Scripts, smp.RoundTrips, smp.ScriptUsec, smp.WithoutRedis
		fs.ScriptCeiling = math.NaN()
		if fs.ScriptUsec > 0 {
			fs.ScriptCeiling = 1e6 / fs.ScriptUsec
		}
		rep.Fleet = append(rep.Fleet, fs)
		logf("fleet rep %d/%d: %.0f streams/s over %d replicas, Redis %.2f cores (%.1fµs CPU/stream, ceiling %.0f streams/s per core), replicas %.2f cores, errors %d",
			r+1, cfg.FleetReps, fs.Rate, fs.Replicas, fs.RedisCores, fs.RedisCPU, fs.Ceiling, fs.ReplicaCores, fs.Errors)
	}
	return nil
}
