package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// Config is what one benchmark run measures and how long it takes.
type Config struct {
	// Out is the directory for report.md, report.json, the profiles and the raw Go benchmark
	// output.
	Out string
	// Concurrency lists the load levels (concurrent streams).
	Concurrency []int
	// Reps is how many times each server runs at each level; the servers alternate.
	Reps int
	// Warmup and Duration are each run's unmeasured and measured parts.
	Warmup, Duration time.Duration
	// MessageTimeout is the simulator's message_timeout during the loads.
	MessageTimeout time.Duration
	// Held is the number of streams held open for the memory measurement (0: skip it);
	// HeldReps how many times each server is measured, each in a fresh process.
	Held     int
	HeldReps int
	// HeldTimeout bounds the time to open all held streams; Settle is how long the server is
	// left alone before each memory measurement (and the warm-up before the idle one).
	HeldTimeout time.Duration
	Settle      time.Duration
	// ProfileSeconds is the length of the CPU profiles of both servers (0: no profile), taken
	// at ProfileConcurrency, each server in a fresh process of this program (CmdServeBulkhead,
	// CmdServeNoop) serving net/http/pprof.
	ProfileSeconds     int
	ProfileConcurrency int
	// Trace also takes a runtime execution trace of each profiled server (and of the replay
	// server, with Replay) over the profile's seconds and splits its exchanges
	// (Profile.Exchanges).
	Trace bool
	// Micro runs MicroBenchmarks with `go test`, MicroBenchtime and MicroCount times.
	Micro          bool
	MicroBenchtime string
	MicroCount     int
	// BulkheadBinary is a prebuilt llm-bulkhead binary; empty builds one with `go build`.
	BulkheadBinary string
	// BaselineBinary, when set, is a second llm-bulkhead binary (an earlier build, say) loaded
	// in the same rotation as the others, so that a change is measured against it run by run
	// instead of across two runs of this program on a machine whose speed drifts.
	BaselineBinary string
	// SameCodec gives the no-op and replay servers llm-bulkhead's gRPC codec (its decoder of
	// Envoy's requests and generated marshalling), so that the difference shows llm-bulkhead's
	// work alone, without what its codec saves over gRPC's default one.
	SameCodec bool
	// BulkheadInProcess runs llm-bulkhead for the load and memory measurements from Self
	// (CmdServeBulkhead, the same app package) instead of the binary, skipping the build.
	BulkheadInProcess bool
	// Replay adds the Replay server to the load runs: llm-bulkhead's replies without its work,
	// which splits the difference between the no-op and llm-bulkhead into what the replies cost
	// the proxy and what the server's own work costs.
	Replay bool
	// ServerCPUs, when not empty, pins every server process to these CPUs (with taskset), and
	// LoadCPUs this program, which generates the load. Kept apart, the servers' CPU per stream
	// no longer includes the time they lose to the load generator on the same cores.
	ServerCPUs, LoadCPUs CPUList
	// Self is the command line prefix that runs this program, for its child subcommands.
	Self []string
	// Command is the command line recorded in the report.
	Command string
}

// Side names used in samples and tables.
const (
	SideNoop     = "no-op"
	SideBulkhead = "llm-bulkhead"
	SideReplay   = "replay"
	SideBaseline = "baseline"
)

// startTimeout bounds a server's start.
const startTimeout = time.Minute

// Run measures and writes the report. progress receives one line per step.
func Run(ctx context.Context, cfg Config, progress io.Writer) (*Report, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return nil, err
	}
	unpin, err := cfg.LoadCPUs.pin()
	if err != nil {
		return nil, err
	}
	defer unpin()
	rep := newReport(cfg)
	logf := func(format string, args ...any) {
		fmt.Fprintf(progress, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
	}
	if rep.Config.ReflectiveMarshalling {
		logf("warning: %s", reflectiveWarning)
	}

	body, err := ChatBody(BodySize)
	if err != nil {
		return nil, err
	}
	req := ChatRequest(body)
	filter, err := FilterConfig(cfg.MessageTimeout)
	if err != nil {
		return nil, fmt.Errorf("filter from the example policy: %w", err)
	}
	rep.Filter = describeFilter(filter)

	bulkheadArgv := []string{}
	if cfg.BulkheadInProcess {
		bulkheadArgv = append(append(bulkheadArgv, cfg.Self...), CmdServeBulkhead)
		rep.BulkheadCommand = "this program's " + CmdServeBulkhead + " (cmd/llm-bulkhead/app in-process)"
	} else {
		bin := cfg.BulkheadBinary
		rep.BulkheadCommand = "llm-bulkhead serve (prebuilt binary " + bin + untagged(bin, logf) + ")"
		if bin == "" {
			tmp, err := os.MkdirTemp("", "llm-bulkhead-bench-")
			if err != nil {
				return nil, err
			}
			defer os.RemoveAll(tmp)
			logf("building llm-bulkhead")
			if bin, err = BuildServer(ctx, tmp); err != nil {
				return nil, err
			}
			rep.BulkheadCommand = "llm-bulkhead serve (binary from go build -tags vtprotobuf ./cmd/llm-bulkhead)"
		}
		bulkheadArgv = []string{bin, "serve", "--watch=false"}
	}
	// minimal is the command line of the no-op or replay server.
	minimal := func(cmd string, extra ...string) []string {
		argv := append(append(append([]string{}, cfg.Self...), cmd), extra...)
		if cfg.SameCodec {
			argv = append(argv, "--server-codec")
		}
		return cfg.ServerCPUs.pinArgv(argv)
	}
	specs := map[string]Spec{
		SideNoop:   {Name: SideNoop, Argv: minimal(CmdServeNoop), Env: ServerEnv(), ReadyMsg: ReadyMessage},
		SideReplay: {Name: SideReplay, Argv: minimal(CmdServeReplay), Env: ServerEnv(), ReadyMsg: ReadyMessage},
		SideBulkhead: {Name: SideBulkhead, Argv: cfg.ServerCPUs.pinArgv(append(bulkheadArgv, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0")),
			Env: ServerEnv(), ReadyMsg: readyFor(cfg.BulkheadInProcess)},
	}
	if cfg.BaselineBinary != "" {
		specs[SideBaseline] = Spec{Name: SideBaseline, Env: ServerEnv(), ReadyMsg: BinaryReadyMessage,
			Argv: cfg.ServerCPUs.pinArgv([]string{cfg.BaselineBinary, "serve", "--watch=false", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"})}
		rep.BaselineCommand = "llm-bulkhead serve (prebuilt binary " + cfg.BaselineBinary + untagged(cfg.BaselineBinary, logf) + ")"
	}

	if len(cfg.Concurrency) > 0 {
		if err := runLoads(ctx, cfg, rep, specs, req, filter, logf); err != nil {
			return rep, err
		}
	}
	if cfg.Held > 0 {
		if err := runMemory(ctx, cfg, rep, specs, req, filter, logf); err != nil {
			return rep, err
		}
	}
	if cfg.ProfileSeconds > 0 {
		sides := []string{SideBulkhead, SideNoop}
		if cfg.Trace && cfg.Replay {
			// The replay server sends llm-bulkhead's replies: its trace shows what they cost the
			// proxy's side of each exchange without llm-bulkhead's work.
			sides = append(sides, SideReplay)
		}
		for _, side := range sides {
			logf("profiling %s at %d streams for %ds", side, cfg.ProfileConcurrency, cfg.ProfileSeconds)
			argv := cfg.ServerCPUs.pinArgv(append(append([]string{}, cfg.Self...), CmdServeBulkhead, "--pprof-addr", "127.0.0.1:0"))
			switch side {
			case SideNoop:
				argv = minimal(CmdServeNoop, "--pprof-addr", "127.0.0.1:0")
			case SideReplay:
				argv = minimal(CmdServeReplay, "--pprof-addr", "127.0.0.1:0")
			}
			spec := Spec{Name: side, Env: ServerEnv(), ReadyMsg: ReadyMessage, Argv: argv}
			pr, err := profile(ctx, cfg, spec, req, filter)
			if err != nil {
				return rep, fmt.Errorf("profile of %s: %w", side, err)
			}
			rep.Profiles = append(rep.Profiles, pr)
		}
	}
	if cfg.Micro {
		// The micro-benchmarks measure code, not the pair of processes: they get every CPU.
		unpin()
		logf("running the Go micro-benchmarks (benchtime %s, count %d)", cfg.MicroBenchtime, cfg.MicroCount)
		micro, raw, err := RunGoBench(ctx, MicroBenchmarks, cfg.MicroBenchtime, cfg.MicroCount)
		if werr := os.WriteFile(filepath.Join(cfg.Out, "gobench.txt"), []byte(raw), 0o644); werr != nil && err == nil {
			err = werr
		}
		if err != nil {
			return rep, err
		}
		rep.Micro = micro
	}
	rep.finish()
	if err := rep.write(cfg.Out); err != nil {
		return rep, err
	}
	return rep, nil
}

func readyFor(inProcess bool) string {
	if inProcess {
		return ReadyMessage
	}
	return BinaryReadyMessage
}

func (c Config) validate() error {
	var errs []error
	if c.Out == "" {
		errs = append(errs, errors.New("an output directory is required"))
	}
	for _, n := range c.Concurrency {
		if n < 1 {
			errs = append(errs, fmt.Errorf("concurrency %d: must be at least 1", n))
		}
	}
	if len(c.Concurrency) > 0 && (c.Reps < 1 || c.Duration <= 0 || c.Warmup < 0) {
		errs = append(errs, errors.New("load runs need reps ≥ 1, a positive duration and a non-negative warm-up"))
	}
	if c.MessageTimeout <= 0 {
		errs = append(errs, errors.New("message timeout must be positive"))
	}
	if c.Held < 0 || (c.Held > 0 && (c.HeldReps < 1 || c.HeldTimeout <= 0 || c.Settle <= 0)) {
		errs = append(errs, errors.New("held streams need held ≥ 0, held reps ≥ 1, a positive timeout and a positive settle time"))
	}
	if c.ProfileSeconds < 0 || (c.ProfileSeconds > 0 && c.ProfileConcurrency < 1) {
		errs = append(errs, errors.New("the profile needs seconds ≥ 0 and a concurrency ≥ 1"))
	}
	if c.Trace && c.ProfileSeconds == 0 {
		errs = append(errs, errors.New("the execution trace is taken during the profile: give it seconds"))
	}
	if c.Micro && (c.MicroCount < 1 || c.MicroBenchtime == "") {
		errs = append(errs, errors.New("micro-benchmarks need a count ≥ 1 and a benchtime"))
	}
	if err := c.checkPinning(); err != nil {
		errs = append(errs, err)
	}
	if c.BaselineBinary != "" && len(c.Concurrency) == 0 {
		errs = append(errs, errors.New("a baseline binary is only loaded in the load runs: give at least one concurrency level"))
	}
	if len(c.Self) == 0 {
		errs = append(errs, errors.New("the program's own command line (Self) is required for the no-op server"))
	}
	return errors.Join(errs...)
}

// runLoads starts the servers once and runs every level Reps times, rotating which server
// goes first.
func runLoads(ctx context.Context, cfg Config, rep *Report, specs map[string]Spec, req *envoysim.Request, filter envoysim.FilterConfig, logf func(string, ...any)) error {
	type side struct {
		name string
		proc *Process
		sim  *envoysim.Sim
	}
	var sides []*side
	defer func() {
		for _, s := range sides {
			if s.sim != nil {
				_ = s.sim.Close()
			}
			_ = s.proc.Stop()
		}
	}()
	names := []string{SideNoop}
	if cfg.Replay {
		names = append(names, SideReplay)
	}
	if cfg.BaselineBinary != "" {
		names = append(names, SideBaseline)
	}
	names = append(names, SideBulkhead)
	for _, name := range names {
		p, err := StartProcess(specs[name], startTimeout)
		if err != nil {
			return err
		}
		s := &side{name: name, proc: p}
		sides = append(sides, s)
		if s.sim, err = envoysim.New(p.GRPCAddr, filter); err != nil {
			return err
		}
		res, err := s.sim.RoundTrip(ctx, req, SSEUpstream())
		if err != nil {
			return err
		}
		if err := Check(res, admits(name)); err != nil {
			return fmt.Errorf("first request through %s: %w", name, err)
		}
		logf("%s listening on %s (pid %d)", name, p.GRPCAddr, p.Pid())
	}
	up := SSEUpstream()
	for _, conc := range cfg.Concurrency {
		for r := range cfg.Reps {
			// Each repetition starts with another server, so none always runs on a machine the
			// others just warmed or loaded.
			order := make([]*side, len(sides))
			for i := range sides {
				order[i] = sides[(i+r)%len(sides)]
			}
			for _, s := range order {
				l := Load{Sim: s.sim, Request: req, Upstream: up, Concurrency: conc, Warmup: cfg.Warmup,
					Duration: cfg.Duration, Admitted: admits(s.name), Pid: s.proc.Pid()}
				smp, err := l.Run(ctx)
				if err != nil {
					return err
				}
				if err := s.proc.Alive(); err != nil {
					return err
				}
				smp.Server, smp.Rep = s.name, r+1
				rep.Samples = append(rep.Samples, smp)
				logf("%-12s c=%-4d rep %d/%d: %8.0f streams/s  p50 %7.0fµs  p99 %8.0fµs  server %5.1fµs CPU/stream  errors %d",
					s.name, conc, r+1, cfg.Reps, smp.Rate, smp.P50, smp.P99, smp.ServerCPU, smp.Errors)
			}
		}
	}
	for _, s := range sides {
		if rss, err := RSS(s.proc.Pid()); err == nil {
			rep.AfterLoadRSS = append(rep.AfterLoadRSS, NamedBytes{Server: s.name, Bytes: rss})
		}
	}
	return nil
}

// admits reports whether side's replies carry llm-bulkhead's admission (the replay server
// sends llm-bulkhead's recorded replies).
func admits(side string) bool { return side != SideNoop }

// runMemory measures each server HeldReps times, each time in a fresh process.
func runMemory(ctx context.Context, cfg Config, rep *Report, specs map[string]Spec, req *envoysim.Request, filter envoysim.FilterConfig, logf func(string, ...any)) error {
	for r := range cfg.HeldReps {
		for _, name := range []string{SideBulkhead, SideNoop} {
			logf("%s: holding %d streams (rep %d/%d)", name, cfg.Held, r+1, cfg.HeldReps)
			m, err := holdOnce(ctx, cfg, specs[name], req, filter)
			if err != nil {
				return fmt.Errorf("held streams, %s: %w", name, err)
			}
			rep.Memory = append(rep.Memory, m)
			logf("%-12s idle %s RSS / %s heap, %d held %s RSS / %s heap: %s RSS per stream",
				name, mib(float64(m.IdleRSS)), mib(m.IdleHeap), m.Held, mib(float64(m.HeldRSS)), mib(m.HeldHeap), kib(m.RSSPerStream))
		}
	}
	return nil
}

func holdOnce(ctx context.Context, cfg Config, spec Spec, req *envoysim.Request, filter envoysim.FilterConfig) (Memory, error) {
	p, err := StartProcess(spec, startTimeout)
	if err != nil {
		return Memory{}, err
	}
	sim, err := envoysim.New(p.GRPCAddr, filter)
	if err != nil {
		_ = p.Stop()
		return Memory{}, err
	}
	m, err := Hold(ctx, p, sim, req, cfg.Held, admits(spec.Name), cfg.Settle, cfg.HeldTimeout)
	_ = sim.Close()
	if serr := p.Stop(); err == nil {
		err = serr
	}
	return m, err
}

func profile(ctx context.Context, cfg Config, spec Spec, req *envoysim.Request, filter envoysim.FilterConfig) (Profile, error) {
	p, err := StartProcess(spec, startTimeout)
	if err != nil {
		return Profile{}, err
	}
	defer func() { _ = p.Stop() }()
	sim, err := envoysim.New(p.GRPCAddr, filter)
	if err != nil {
		return Profile{}, err
	}
	defer sim.Close()
	l := Load{Sim: sim, Request: req, Upstream: SSEUpstream(), Concurrency: cfg.ProfileConcurrency,
		Warmup: cfg.Warmup, Admitted: admits(spec.Name), Pid: p.Pid()}
	return ProfileUnderLoad(ctx, p, l, cfg.ProfileSeconds, cfg.Trace, cfg.Out)
}

// Machine describes where the benchmark ran.
type Machine struct {
	GOOS      string `json:"goos"`
	GOARCH    string `json:"goarch"`
	CPUs      int    `json:"cpus"`
	CPUModel  string `json:"cpu_model"`
	GoVersion string `json:"go_version"`
	// LoadAvgStart and LoadAvgEnd are /proc/loadavg's 1, 5 and 15 minute averages.
	LoadAvgStart string `json:"loadavg_start"`
	LoadAvgEnd   string `json:"loadavg_end"`
}

// CurrentMachine describes this machine now; the caller sets LoadAvgEnd when the run ends.
func CurrentMachine() Machine {
	m := Machine{GOOS: runtime.GOOS, GOARCH: runtime.GOARCH, CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), LoadAvgStart: harness.LoadAverage()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	return m
}

func describeFilter(f envoysim.FilterConfig) string {
	return fmt.Sprintf("request body %s, response body %s, message_timeout %s, max_message_timeout %s, allow_mode_override %t, buffer limit %s",
		f.Mode.RequestBody, f.Mode.ResponseBody, f.MessageTimeout, f.MaxMessageTimeout, f.AllowModeOverride, mib(float64(f.BufferLimit)))
}
