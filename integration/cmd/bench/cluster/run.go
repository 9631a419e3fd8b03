package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
	"github.com/llm-bulkhead/llm-bulkhead/integration/cmd/clusterdemo/fleet"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// SideLocal is the comparison's side without a cluster section; the others are named after
// their admission.
const SideLocal = "local"

// Num is a figure that may not have been measured (NaN): JSON null then.
type Num float64

// MarshalJSON writes NaN and infinities as null.
func (n Num) MarshalJSON() ([]byte, error) {
	if math.IsNaN(float64(n)) || math.IsInf(float64(n), 0) {
		return []byte("null"), nil
	}
	return strconv.AppendFloat(nil, float64(n), 'g', -1, 64), nil
}

// Work is what cluster mode cost Redis and the replicas over one run's measured window, per
// admission (the admissions the replicas counted in the window).
type Work struct {
	Admitted float64 `json:"admitted"`
	// ClientCommands are the commands clients sent (INFO commandstats without the commands the
	// scripts run and without this program's INFO); Scripts those of them that are EVALSHA or
	// EVAL; InScripts the commands the scripts ran inside Redis; Processed
	// total_commands_processed (both kinds).
	ClientCommands Num `json:"client_commands_per_admission"`
	Scripts        Num `json:"scripts_per_admission"`
	InScripts      Num `json:"commands_in_scripts_per_admission"`
	Processed      Num `json:"commands_processed_per_admission"`
	// RedisCPU is Redis's CPU time per admission (every node's, /proc/<pid>/stat), µs; ScriptUsec
	// the time commandstats accounts to the scripts, µs; RedisCores Redis's CPU use.
	RedisCPU   Num `json:"redis_cpu_us_per_admission"`
	ScriptUsec Num `json:"redis_script_us_per_admission"`
	RedisCores Num `json:"redis_cores"`
	// RedisCPUOverIdle is RedisCPU less what the same Redis spends in as long with no client
	// connected (its own timers; a Redis Cluster's bus between its nodes), µs per admission;
	// NaN where that was not measured (the one-replica runs).
	RedisCPUOverIdle Num `json:"redis_cpu_over_idle_us_per_admission"`
	// The replicas' own count of their calls to Redis per admission, by operation
	// (llm_bulkhead_cluster_redis_seconds_count{op}; a lease call is one pipeline of reports),
	// their lease reports and the requests that waited for a lease to grow (WindowWaits: of them,
	// those that waited for a window chunk rather than a slot).
	AdmitCalls     Num `json:"admit_calls_per_admission"`
	SettleCalls    Num `json:"settle_calls_per_admission"`
	HeartbeatCalls Num `json:"heartbeat_calls_per_admission"`
	LeaseCalls     Num `json:"lease_calls_per_admission"`
	LeaseReports   Num `json:"lease_reports_per_admission"`
	LeaseWaits     Num `json:"lease_waits_per_admission"`
	WindowWaits    Num `json:"window_waits_per_admission"`
	// ReportsPerReplica is lease reports per second per replica.
	ReportsPerReplica Num `json:"lease_reports_per_replica_second"`
	// Reasons is lease reports per second per replica, by reason (the metric's label).
	Reasons map[string]float64 `json:"lease_reports_per_replica_second_by_reason,omitempty"`
	// CallP50 and CallP99 are the round trip of the replicas' calls for admissions (op admit
	// for exact, lease for leased), from their histogram interpolated within its buckets, µs.
	CallP50 Num `json:"redis_call_p50_us"`
	CallP99 Num `json:"redis_call_p99_us"`
	// WithoutRedis counts admissions decided without Redis (it did not answer in time).
	WithoutRedis float64 `json:"without_redis"`
	// Commands holds, per command Redis counted (scripts' own commands included), its calls and
	// the µs Redis accounts to it, per admission.
	Commands map[string]CommandCost `json:"commands_per_admission,omitempty"`
}

// CommandCost is one command's calls and time (µs), per admission.
type CommandCost struct {
	Calls float64 `json:"calls"`
	Usec  float64 `json:"usec"`
}

// Sample is one load run of one side of the comparison.
type Sample struct {
	Side string       `json:"side"`
	Load bench.Sample `json:"load"`
	// Work is the cluster sides' (nil for local).
	Work *Work `json:"redis,omitempty"`
}

// FleetSample is one load run of a fleet: Replicas replicas of one admission sharing one Redis.
type FleetSample struct {
	Redis       string `json:"redis"`
	Replicas    int    `json:"replicas"`
	Admission   string `json:"admission"`
	Rep         int    `json:"rep"`
	Concurrency int    `json:"concurrency_per_replica"`
	// Streams and Rate add up the replicas' measured windows.
	Streams int     `json:"streams"`
	Rate    float64 `json:"streams_per_sec"`
	// P50 is the median of the replicas' p50s, P99 the largest of their p99s, µs.
	P50 float64 `json:"p50_us"`
	P99 float64 `json:"p99_us"`
	// ReplicaCores adds the replicas' CPU use in the window.
	ReplicaCores Num    `json:"replica_cores"`
	Errors       int    `json:"errors"`
	FirstError   string `json:"first_error,omitempty"`
	Work         Work   `json:"work"`
}

// Run measures and writes the report. progress receives one line per step.
func Run(ctx context.Context, cfg Config, progress io.Writer) (*Report, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return nil, err
	}
	b := &bencher{cfg: cfg, rep: newReport(cfg), logf: func(format string, args ...any) {
		fmt.Fprintf(progress, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
	}}
	var err error
	if b.src, err = os.ReadFile(cfg.PolicyPath); err != nil {
		return nil, err
	}
	if b.tmp, err = os.MkdirTemp("", "llm-bulkhead-bench-cluster-"); err != nil {
		return nil, err
	}
	defer os.RemoveAll(b.tmp)
	b.bin = cfg.BulkheadBinary
	b.rep.BulkheadCommand = "llm-bulkhead serve (prebuilt binary " + b.bin + ")"
	if b.bin == "" {
		b.logf("building llm-bulkhead")
		if b.bin, err = bench.BuildServer(ctx, b.tmp); err != nil {
			return nil, err
		}
		b.rep.BulkheadCommand = "llm-bulkhead serve (binary from go build -tags vtprotobuf ./cmd/llm-bulkhead)"
	}
	body, err := bench.ChatBody(bench.BodySize)
	if err != nil {
		return nil, err
	}
	b.req = bench.ChatRequest(body)
	if b.filter, err = bench.FilterConfig(cfg.MessageTimeout); err != nil {
		return nil, err
	}

	if len(cfg.Levels) > 0 {
		if err := b.compare(ctx); err != nil {
			return b.rep, err
		}
	}
	for _, kind := range cfg.Redis {
		if len(cfg.Replicas) == 0 {
			break
		}
		if err := b.fleets(ctx, kind); err != nil {
			return b.rep, err
		}
	}
	if cfg.Behaviours {
		if err := b.behaviours(ctx); err != nil {
			return b.rep, err
		}
	}
	b.rep.finish()
	return b.rep, b.rep.write(cfg.Out)
}

// bencher holds what every part of a run shares.
type bencher struct {
	cfg    Config
	rep    *Report
	logf   func(string, ...any)
	src    []byte // the policy
	tmp    string
	bin    string
	req    *envoysim.Request
	filter envoysim.FilterConfig
	files  int
}

// startRedis starts the Redis of kind (standalone or cluster) and records its version.
func (b *bencher) startRedis(ctx context.Context, kind string) (fleet.Backend, error) {
	var be fleet.Backend
	var first *fleet.Redis
	if kind == RedisCluster {
		c, err := fleet.StartCluster(ctx, 3)
		if err != nil {
			return nil, err
		}
		be, first = c, c.Nodes[0]
	} else {
		r, err := fleet.StartRedis(ctx)
		if err != nil {
			return nil, err
		}
		be, first = r, r
	}
	if v, err := first.Info(ctx, "server"); err == nil {
		b.rep.RedisVersion = v["redis_version"]
	}
	b.logf("redis (%s) %s listening on %s", kind, b.rep.RedisVersion, strings.Join(be.Addrs(), ", "))
	return be, nil
}

// policy writes the policy of a side: without a cluster section when be is nil, else with one of
// admission on be under key prefix prefix.
func (b *bencher) policy(be fleet.Backend, admission, prefix string) (string, error) {
	var src []byte
	var err error
	if be == nil {
		src, err = fleet.WithoutCluster(b.cfg.PolicyPath, b.src)
	} else {
		src, err = fleet.WithCluster(b.cfg.PolicyPath, b.src, fleet.Cluster{Addrs: be.Addrs(), Mode: be.Mode(), KeyPrefix: prefix,
			Timeout: b.cfg.RedisTimeout, Admission: admission, LeaseInterval: b.cfg.LeaseInterval, LeaseTTL: b.cfg.LeaseTTL})
	}
	if err != nil {
		return "", err
	}
	b.files++
	f := filepath.Join(b.tmp, fmt.Sprintf("policy-%d.yaml", b.files))
	return f, os.WriteFile(f, src, 0o600)
}

// spec is replica id's command line running policy file, with env overrides (NAME=value, each
// replacing the benchmark's own of that name). shared says the policy has a cluster section.
func (b *bencher) spec(file, id string, shared bool, env ...string) bench.Spec {
	e := bench.ServerEnv()
	if shared {
		env = append(env, "LLM_BULKHEAD_CLUSTER__REPLICA_ID="+id)
	}
	for _, kv := range env {
		name, _, _ := strings.Cut(kv, "=")
		e = slices.DeleteFunc(e, func(s string) bool { return strings.HasPrefix(s, name+"=") })
	}
	e = append(e, env...)
	return bench.Spec{Name: id, Env: e, ReadyMsg: bench.BinaryReadyMessage,
		Argv: []string{b.bin, "serve", "--config", file, "--watch=false", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}}
}

// connect opens a simulator to each replica and sends one request through it (the first
// admission of a leased fleet waits until its compartments' leases may grow).
func (b *bencher) connect(ctx context.Context, rs []*fleet.Replica) ([]*envoysim.Sim, error) {
	return b.open(ctx, rs, true)
}

// open opens a simulator to each replica and, with first, sends one request through it.
func (b *bencher) open(ctx context.Context, rs []*fleet.Replica, first bool) ([]*envoysim.Sim, error) {
	sims := make([]*envoysim.Sim, len(rs))
	for i, r := range rs {
		var err error
		if sims[i], err = envoysim.New(r.GRPCAddr, b.filter); err != nil {
			closeSims(sims)
			return nil, err
		}
		if !first {
			continue
		}
		res, err := sims[i].RoundTrip(ctx, b.req, bench.SSEUpstream())
		if err == nil {
			err = bench.Check(res, true)
		}
		if err != nil {
			closeSims(sims)
			return nil, fmt.Errorf("first request through replica %s: %w", r.ID, err)
		}
	}
	return sims, nil
}

func closeSims(sims []*envoysim.Sim) {
	for _, s := range sims {
		if s != nil {
			_ = s.Close()
		}
	}
}

// side is one replica of the comparison.
type side struct {
	name string
	be   fleet.Backend // nil for local
	r    *fleet.Replica
	sim  *envoysim.Sim
}

// compare runs one replica per side at every level, Reps times, rotating which side goes first.
// Each admission has a Redis of its own, so that Redis's counters are that admission's alone.
func (b *bencher) compare(ctx context.Context) (err error) {
	var sides []*side
	defer func() {
		for _, s := range sides {
			if s.sim != nil {
				_ = s.sim.Close()
			}
			if s.r != nil {
				_ = s.r.Stop()
			}
			if s.be != nil {
				s.be.Stop()
			}
		}
	}()
	for _, name := range append([]string{SideLocal}, b.cfg.Admissions...) {
		s := &side{name: name}
		sides = append(sides, s)
		if name != SideLocal {
			if s.be, err = b.startRedis(ctx, RedisStandalone); err != nil {
				return err
			}
		}
		file, err := b.policy(s.be, name, "bench")
		if err != nil {
			return err
		}
		rs, err := fleet.StartReplicas(1, func(int) bench.Spec { return b.spec(file, name, s.be != nil) })
		if err != nil {
			return err
		}
		s.r = rs[0]
		sims, err := b.connect(ctx, rs)
		if err != nil {
			return err
		}
		s.sim = sims[0]
		b.logf("%s listening on %s, admin %s (pid %d)", name, s.r.GRPCAddr, s.r.AdminAddr, s.r.Pid())
	}
	up := bench.SSEUpstream()
	for _, conc := range b.cfg.Levels {
		for r := range b.cfg.Reps {
			for k := range sides {
				s := sides[(r+k)%len(sides)]
				l := bench.Load{Sim: s.sim, Request: b.req, Upstream: up, Concurrency: conc, Warmup: b.cfg.Warmup,
					Duration: b.cfg.Duration, Admitted: true, Pid: s.r.Pid()}
				smp := Sample{Side: s.name}
				var rs []*fleet.Replica
				if s.be != nil {
					rs = []*fleet.Replica{s.r}
				}
				smp.Work, err = b.measure(ctx, s.be, s.name, rs, math.NaN(), b.cfg.Duration, func() (err error) {
					smp.Load, err = l.Run(ctx)
					return err
				})
				if err != nil {
					return err
				}
				if err := s.r.Alive(); err != nil {
					return err
				}
				smp.Load.Server, smp.Load.Rep = s.name, r+1
				b.rep.Samples = append(b.rep.Samples, smp)
				line := fmt.Sprintf("%-6s c=%-4d rep %d/%d: %7.0f streams/s  p50 %6.0fµs  p99 %7.0fµs  server %5.1fµs CPU/stream  errors %d",
					s.name, conc, r+1, b.cfg.Reps, smp.Load.Rate, smp.Load.P50, smp.Load.P99, smp.Load.ServerCPU, smp.Load.Errors)
				if w := smp.Work; w != nil {
					line += fmt.Sprintf("  | %.3f client commands, %.1f in scripts, Redis %.1fµs CPU per admission", w.ClientCommands, w.InScripts, w.RedisCPU)
				}
				b.logf("%s", line)
			}
		}
	}
	return nil
}

// reading is one instant of a run: Redis's counters and CPU time, the replicas' metrics.
type reading struct {
	at   time.Time
	cmds fleet.Commands
	cpu  time.Duration
	m    []fleet.Metrics
}

// read takes a reading: the replicas' metrics (all at once), then Redis's.
func read(ctx context.Context, be fleet.Backend, rs []*fleet.Replica) (reading, error) {
	rd := reading{at: time.Now(), m: make([]fleet.Metrics, len(rs))}
	errs := make([]error, len(rs))
	var wg sync.WaitGroup
	for i, r := range rs {
		wg.Go(func() { rd.m[i], errs[i] = r.Metrics(ctx) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return rd, err
	}
	var err error
	if rd.cmds, err = be.ReadCommands(ctx); err != nil {
		return rd, err
	}
	rd.cpu, err = be.CPU()
	return rd, err
}

// measure runs load, whose warm-up starts now and whose window follows it, and, when be is not
// nil, reads Redis and the replicas rs at the window's edges and returns their work per admission.
//
// idle is Redis's CPU a second with no client connected (NaN: not measured).
func (b *bencher) measure(ctx context.Context, be fleet.Backend, admission string, rs []*fleet.Replica, idle float64, dur time.Duration, load func() error) (*Work, error) {
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- load() }()
	if be == nil {
		return nil, <-done
	}
	var r0, r1 reading
	rerr := errors.New("the run ended before its window")
	if bench.SleepUntil(ctx, start.Add(b.cfg.Warmup)) {
		if r0, rerr = read(ctx, be, rs); rerr == nil && bench.SleepUntil(ctx, start.Add(b.cfg.Warmup+dur)) {
			r1, rerr = read(ctx, be, rs)
		}
	}
	if err := <-done; err != nil {
		return nil, err
	}
	if rerr != nil {
		return nil, rerr
	}
	w := workOf(r0, r1, admission, idle)
	return &w, nil
}

// reportReasons are the reason labels of llm_bulkhead_cluster_lease_reports_total.
var reportReasons = []string{"renew", "changed", "contended", "window", "short", "heard_short", "drained", "resend", "other", "spend"}

// workOf is the work between two readings, per admission.
func workOf(r0, r1 reading, admission string, idle float64) Work {
	d := r1.cmds.Sub(r0.cmds)
	sum := func(name string, match ...string) float64 {
		var v float64
		for i := range r1.m {
			v += r1.m[i].Sum(name, match...) - r0.m[i].Sum(name, match...)
		}
		return v
	}
	n := sum("llm_bulkhead_admitted_total")
	per := func(x float64) Num {
		if n <= 0 {
			return Num(math.NaN())
		}
		return Num(x / n)
	}
	secs := r1.at.Sub(r0.at).Seconds()
	w := Work{Admitted: n, WithoutRedis: sum("llm_bulkhead_cluster_unavailable_admissions_total"),
		ClientCommands: per(float64(d.ClientCommands())), Scripts: per(float64(d.Scripts())), InScripts: per(float64(d.InScripts())),
		Processed: per(float64(d.Processed)), RedisCPU: per(float64((r1.cpu - r0.cpu).Microseconds())), ScriptUsec: per(float64(d.ScriptUsec())),
		RedisCores:       Num((r1.cpu - r0.cpu).Seconds() / secs),
		RedisCPUOverIdle: per(float64((r1.cpu - r0.cpu).Microseconds()) - idle*secs),
		AdmitCalls:       per(sum("llm_bulkhead_cluster_redis_seconds_count", "op", "admit")),
		SettleCalls:      per(sum("llm_bulkhead_cluster_redis_seconds_count", "op", "settle")),
		HeartbeatCalls:   per(sum("llm_bulkhead_cluster_redis_seconds_count", "op", "heartbeat")),
		LeaseCalls:       per(sum("llm_bulkhead_cluster_redis_seconds_count", "op", "lease")),
		LeaseReports:     per(sum("llm_bulkhead_cluster_lease_reports_total")),
		LeaseWaits:       per(sum("llm_bulkhead_cluster_lease_waits_total")),
		WindowWaits:      per(sum("llm_bulkhead_cluster_lease_waits_total", "kind", "window")),
		Commands:         map[string]CommandCost{},
	}
	w.ReportsPerReplica = Num(sum("llm_bulkhead_cluster_lease_reports_total") / secs / float64(max(len(r1.m), 1)))
	for _, why := range reportReasons {
		if v := sum("llm_bulkhead_cluster_lease_reports_total", "reason", why); v > 0 {
			if w.Reasons == nil {
				w.Reasons = map[string]float64{}
			}
			w.Reasons[why] = v / secs / float64(max(len(r1.m), 1))
		}
	}
	for k, v := range d.Calls {
		if k != "info" && n > 0 {
			w.Commands[k] = CommandCost{Calls: float64(v) / n, Usec: float64(d.Usec[k]) / n}
		}
	}
	op := "admit"
	if admission == Leased {
		op = "lease"
	}
	var h fleet.Buckets
	for i := range r1.m {
		hi := r1.m[i].Histogram("llm_bulkhead_cluster_redis_seconds", "op", op).Sub(r0.m[i].Histogram("llm_bulkhead_cluster_redis_seconds", "op", op))
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
	w.CallP50, w.CallP99 = Num(h.Quantile(0.5)*1e6), Num(h.Quantile(0.99)*1e6)
	return w
}

// idleWindow is how long Redis's CPU is read with no client connected.
const idleWindow = 3 * time.Second

// idleCPU returns what Redis (every node of be) spends, in µs of CPU a second, with no client
// connected: its own timers, and a Redis Cluster's bus between its nodes. A Redis costs that
// whoever uses it.
func idleCPU(ctx context.Context, be fleet.Backend) (float64, error) {
	c0, err := be.CPU()
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if !bench.SleepUntil(ctx, start.Add(idleWindow)) {
		return 0, ctx.Err()
	}
	c1, err := be.CPU()
	if err != nil {
		return 0, err
	}
	return float64((c1 - c0).Microseconds()) / time.Since(start).Seconds(), nil
}

// fleets runs, on a Redis of kind, a fresh fleet of each size for each admission (the
// admissions' order rotating from one size to the next), FleetReps load runs each.
func (b *bencher) fleets(ctx context.Context, kind string) error {
	be, err := b.startRedis(ctx, kind)
	if err != nil {
		return err
	}
	defer be.Stop()
	idle, err := idleCPU(ctx, be)
	if err != nil {
		return err
	}
	b.rep.IdleRedis = append(b.rep.IdleRedis, IdleRedis{Redis: kind, CPU: Num(idle / 1000)})
	b.logf("redis (%s) with no client: %.2f ms of CPU a second", kind, idle/1000)
	for i, n := range b.cfg.Replicas {
		for k := range b.cfg.Admissions {
			adm := b.cfg.Admissions[(i+k)%len(b.cfg.Admissions)]
			if err := b.fleet(ctx, be, kind, n, adm, idle); err != nil {
				return err
			}
		}
	}
	return nil
}

// fleet starts n replicas of admission adm on be, loads them all at once FleetReps times, and
// stops them.
func (b *bencher) fleet(ctx context.Context, be fleet.Backend, kind string, n int, adm string, idle float64) error {
	file, err := b.policy(be, adm, fmt.Sprintf("fleet-%s-%d-%s", kind, n, adm))
	if err != nil {
		return err
	}
	rs, err := fleet.StartReplicas(n, func(i int) bench.Spec { return b.spec(file, fmt.Sprintf("r%d", i+1), true) })
	if err != nil {
		return err
	}
	defer fleet.StopReplicas(rs)
	sims, err := b.connect(ctx, rs)
	if err != nil {
		return err
	}
	defer closeSims(sims)
	b.logf("%d %s replicas on redis (%s): %d streams each", n, adm, kind, b.cfg.FleetConcurrency)
	up := bench.SSEUpstream()
	for r := range b.cfg.FleetReps {
		fs := FleetSample{Redis: kind, Replicas: n, Admission: adm, Rep: r + 1, Concurrency: b.cfg.FleetConcurrency}
		samples := make([]bench.Sample, len(rs))
		w, err := b.measure(ctx, be, adm, rs, idle, b.cfg.FleetDuration, func() error {
			errs := make([]error, len(rs))
			var wg sync.WaitGroup
			for i, rp := range rs {
				l := bench.Load{Sim: sims[i], Request: b.req, Upstream: up, Concurrency: b.cfg.FleetConcurrency, Warmup: b.cfg.Warmup,
					Duration: b.cfg.FleetDuration, Admitted: true, Pid: rp.Pid()}
				wg.Go(func() { samples[i], errs[i] = l.Run(ctx) })
			}
			wg.Wait()
			return errors.Join(errs...)
		})
		if err != nil {
			return err
		}
		for _, rp := range rs {
			if err := rp.Alive(); err != nil {
				return err
			}
		}
		var p50s []float64
		cores := 0.0
		for _, s := range samples {
			fs.Streams += s.Streams
			fs.Rate += s.Rate
			fs.Errors += s.Errors
			if fs.FirstError == "" {
				fs.FirstError = s.FirstError
			}
			cores += s.ServerCores
			fs.P99 = max(fs.P99, s.P99)
			p50s = append(p50s, s.P50)
		}
		fs.P50 = bench.Summarize(p50s).Median
		fs.ReplicaCores = Num(cores)
		fs.Work = *w
		b.rep.Fleet = append(b.rep.Fleet, fs)
		b.logf("  rep %d/%d: %.0f streams/s, p50 %.0fµs, %.3f client commands and %.1f in scripts per admission, Redis %.1fµs CPU per admission (%.2f cores), errors %d",
			r+1, b.cfg.FleetReps, fs.Rate, fs.P50, w.ClientCommands, w.InScripts, w.RedisCPU, w.RedisCores, fs.Errors)
		if len(w.Reasons) > 0 {
			b.logf("    lease reports per replica-second by reason: %s", reasonsOf(w.Reasons))
		}
	}
	return nil
}
