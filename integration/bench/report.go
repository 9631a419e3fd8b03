package bench

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// Report is everything one run measured. It is built by Run and then read-only.
type Report struct {
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	Command  string    `json:"command"`
	Machine  Machine   `json:"machine"`
	Config   struct {
		Concurrency    []int   `json:"concurrency"`
		Reps           int     `json:"reps"`
		WarmupSeconds  float64 `json:"warmup_seconds"`
		WindowSeconds  float64 `json:"window_seconds"`
		Held           int     `json:"held"`
		ProfileSeconds int     `json:"profile_seconds"`
		// ServerCPUs and LoadCPUs are the CPU lists the servers and the load generator were
		// pinned to ("" when not pinned).
		ServerCPUs string `json:"server_cpus,omitempty"`
		LoadCPUs   string `json:"load_cpus,omitempty"`
		// SameCodec: the no-op and replay servers used llm-bulkhead's gRPC codec.
		SameCodec bool `json:"same_codec,omitempty"`
		// ReflectiveMarshalling: this program was built without -tags vtprotobuf, so the
		// servers it runs in-process (serve-bulkhead for the profiles, the --same-codec codec)
		// marshal replies by reflection, unlike the llm-bulkhead binary.
		ReflectiveMarshalling bool `json:"reflective_marshalling,omitempty"`
	} `json:"config"`
	// Overrides are the policy changes (environment overrides of the example policy).
	Overrides       []string `json:"policy_overrides"`
	Filter          string   `json:"filter"`
	BulkheadCommand string   `json:"bulkhead_command"`
	BaselineCommand string   `json:"baseline_command,omitempty"`

	Samples      []Sample     `json:"samples"`
	Levels       []Level      `json:"levels"`
	AfterLoadRSS []NamedBytes `json:"after_load_rss,omitempty"`
	Memory       []Memory     `json:"memory"`
	Profiles     []Profile    `json:"profiles,omitempty"`
	Micro        []GoBench    `json:"micro"`
	Targets      []Target     `json:"targets"`
}

// NamedBytes is a size attributed to one server.
type NamedBytes struct {
	Server string `json:"server"`
	Bytes  int64  `json:"bytes"`
}

// SideStats aggregates one server's samples at one level over the repetitions.
type SideStats struct {
	Rate      Spread `json:"streams_per_sec"`
	P50       Spread `json:"p50_us"`
	P99       Spread `json:"p99_us"`
	ServerCPU Spread `json:"server_cpu_us_per_stream"`
	Errors    int    `json:"errors"`
}

// Level compares the servers at one concurrency. Ratio, AddedP50, AddedP99 and AddedCPU are
// computed per repetition from the two runs that ran next to each other, then summarised.
type Level struct {
	Concurrency int       `json:"concurrency"`
	Noop        SideStats `json:"noop"`
	Bulkhead    SideStats `json:"llm_bulkhead"`
	// Ratio is llm-bulkhead's streams/s over the no-op server's.
	Ratio Spread `json:"throughput_ratio"`
	// AddedP50 and AddedP99 are llm-bulkhead's latency percentiles minus the no-op server's, µs.
	AddedP50 Spread `json:"added_p50_us"`
	AddedP99 Spread `json:"added_p99_us"`
	// AddedCPU is llm-bulkhead's server CPU per stream minus the no-op server's, µs.
	AddedCPU Spread `json:"added_cpu_us_per_stream"`

	// With the replay server (Config.Replay): its stats, and the difference split in two.
	// RepliesRatio is the replay server's streams/s over the no-op's: what llm-bulkhead's
	// replies cost the proxy side. WorkRatio is llm-bulkhead's over the replay server's: what
	// the server's own work costs. Ratio ≈ RepliesRatio × WorkRatio.
	Replay       *SideStats `json:"replay,omitempty"`
	RepliesRatio Spread     `json:"replies_ratio"`
	WorkRatio    Spread     `json:"work_ratio"`
	// WorkAddedP50 and WorkAddedCPU are llm-bulkhead's p50 and server CPU per stream minus the
	// replay server's.
	WorkAddedP50 Spread `json:"work_added_p50_us"`
	WorkAddedCPU Spread `json:"work_added_cpu_us_per_stream"`

	// With a baseline binary (Config.BaselineBinary): its stats, its own added CPU per stream
	// over the no-op, and llm-bulkhead's against it (ChangeCPU: llm-bulkhead's server CPU per
	// stream minus the baseline's; ChangeRatio: streams/s over the baseline's), each paired
	// within a repetition.
	Baseline         *SideStats `json:"baseline,omitempty"`
	BaselineAddedCPU Spread     `json:"baseline_added_cpu_us_per_stream"`
	ChangeCPU        Spread     `json:"change_cpu_us_per_stream"`
	ChangeRatio      Spread     `json:"change_throughput_ratio"`
}

// Target is one of the project's performance targets and whether this run met it.
type Target struct {
	Name     string `json:"name"`
	Goal     string `json:"goal"`
	Measured string `json:"measured"`
	// Status is "held", "failed" or "not measured".
	Status string `json:"status"`
}

// Target statuses.
const (
	Held        = "held"
	Failed      = "failed"
	NotMeasured = "not measured"
)

// Target thresholds: the project's performance targets (docs/benchmarks.md).
const (
	TargetRatio       = 0.9
	TargetAddedP50    = 25.0 // µs
	TargetHeldStreams = 10000
	TargetHeldRSS     = 300 << 20
	TargetScanMBps    = 1000.0
)

// reflectiveWarning says what a report of a program built without -tags vtprotobuf is worth.
const reflectiveWarning = "this program was built without `-tags vtprotobuf`: the servers it runs in-process " +
	"(the profiles' `serve-bulkhead`, the `--same-codec` codec) marshal replies by reflection, unlike the llm-bulkhead " +
	"binary. Run it as `make bench` does (GOFLAGS=-tags=vtprotobuf)"

func newReport(cfg Config) *Report {
	r := &Report{Started: time.Now(), Command: cfg.Command, Machine: CurrentMachine(), Overrides: LimitOverrides}
	r.Config.Concurrency = cfg.Concurrency
	r.Config.Reps = cfg.Reps
	r.Config.ServerCPUs, r.Config.LoadCPUs = cfg.ServerCPUs.String(), cfg.LoadCPUs.String()
	r.Config.SameCodec = cfg.SameCodec
	r.Config.ReflectiveMarshalling = !extproc.FastMarshal()
	r.Config.WarmupSeconds = cfg.Warmup.Seconds()
	r.Config.WindowSeconds = cfg.Duration.Seconds()
	r.Config.Held = cfg.Held
	r.Config.ProfileSeconds = cfg.ProfileSeconds
	return r
}

// finish aggregates the samples and judges the targets.
func (r *Report) finish() {
	r.Finished = time.Now()
	r.Machine.LoadAvgEnd = harness.LoadAverage()
	r.Levels = Aggregate(r.Samples)
	r.Targets = r.judge()
}

// Aggregate groups samples by concurrency and pairs each repetition's two runs.
func Aggregate(samples []Sample) []Level {
	var concs []int
	for _, s := range samples {
		if !slices.Contains(concs, s.Concurrency) {
			concs = append(concs, s.Concurrency)
		}
	}
	slices.Sort(concs)
	var out []Level
	for _, c := range concs {
		lv := Level{Concurrency: c}
		var noop, bh, replay, base []Sample
		for _, s := range samples {
			if s.Concurrency != c {
				continue
			}
			switch s.Server {
			case SideNoop:
				noop = append(noop, s)
			case SideBulkhead:
				bh = append(bh, s)
			case SideReplay:
				replay = append(replay, s)
			case SideBaseline:
				base = append(base, s)
			}
		}
		for _, ss := range [][]Sample{noop, bh, replay, base} {
			slices.SortFunc(ss, func(a, b Sample) int { return a.Rep - b.Rep })
		}
		get := func(ss []Sample, f func(Sample) float64) []float64 {
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
			st := SideStats{Rate: Summarize(get(ss, rate)), P50: Summarize(get(ss, p50)), P99: Summarize(get(ss, p99)), ServerCPU: Summarize(get(ss, cpu))}
			for _, s := range ss {
				st.Errors += s.Errors
			}
			return st
		}
		// ratio and diff pair the runs of a and b repetition by repetition.
		ratio := func(a, b []Sample) Spread { return Summarize(Ratios(get(a, rate), get(b, rate))) }
		diff := func(a, b []Sample, f func(Sample) float64) Spread {
			return Summarize(Differences(get(a, f), get(b, f)))
		}
		lv.Noop, lv.Bulkhead = side(noop), side(bh)
		lv.Ratio, lv.AddedCPU = ratio(bh, noop), diff(bh, noop, cpu)
		lv.AddedP50, lv.AddedP99 = diff(bh, noop, p50), diff(bh, noop, p99)
		if len(replay) > 0 {
			st := side(replay)
			lv.Replay = &st
			lv.RepliesRatio, lv.WorkRatio = ratio(replay, noop), ratio(bh, replay)
			lv.WorkAddedP50, lv.WorkAddedCPU = diff(bh, replay, p50), diff(bh, replay, cpu)
		}
		if len(base) > 0 {
			st := side(base)
			lv.Baseline = &st
			lv.BaselineAddedCPU, lv.ChangeCPU = diff(base, noop, cpu), diff(bh, base, cpu)
			lv.ChangeRatio = ratio(bh, base)
		}
		out = append(out, lv)
	}
	return out
}

func (r *Report) judge() []Target {
	var ts []Target

	ratio := Target{Name: "Throughput", Goal: fmt.Sprintf("llm-bulkhead streams/s ≥ %.1f × no-op at every level", TargetRatio), Status: NotMeasured, Measured: "—"}
	if len(r.Levels) > 0 {
		ratio.Status = Held
		var parts []string
		for _, lv := range r.Levels {
			parts = append(parts, fmt.Sprintf("%d streams: %.3f", lv.Concurrency, lv.Ratio.Median))
			if lv.Ratio.N == 0 || lv.Ratio.Median < TargetRatio || lv.Noop.Errors+lv.Bulkhead.Errors > 0 {
				ratio.Status = Failed
			}
		}
		ratio.Measured = strings.Join(parts, ", ") + " (median of paired ratios)"
	}
	ts = append(ts, ratio)

	lat := Target{Name: "Added latency", Goal: fmt.Sprintf("p50 per stream ≤ %.0f µs over no-op (at the lowest concurrency, where latency is service time)", TargetAddedP50), Status: NotMeasured, Measured: "—"}
	if len(r.Levels) > 0 {
		lv := r.Levels[0]
		lat.Measured = fmt.Sprintf("%+.1f µs at %d stream(s) (no-op p50 %.1f µs, llm-bulkhead p50 %.1f µs)", lv.AddedP50.Median, lv.Concurrency, lv.Noop.P50.Median, lv.Bulkhead.P50.Median)
		lat.Status = Held
		if lv.AddedP50.N == 0 || lv.AddedP50.Median > TargetAddedP50 {
			lat.Status = Failed
		}
	}
	ts = append(ts, lat)

	mem := Target{Name: "Memory", Goal: fmt.Sprintf("%d held streams under %s RSS", TargetHeldStreams, mib(TargetHeldRSS)), Status: NotMeasured, Measured: "—"}
	var held []float64
	var n int64
	var perStream []float64
	for _, m := range r.Memory {
		if m.Server == SideBulkhead {
			held = append(held, float64(m.HeldRSS))
			perStream = append(perStream, m.RSSPerStream)
			n = m.Held
		}
	}
	if len(held) > 0 {
		h := Summarize(held)
		if n >= TargetHeldStreams {
			mem.Measured = fmt.Sprintf("%s RSS with %d held (max of %d: %s)", mib(h.Median), n, h.N, mib(h.Max))
			mem.Status = Held
			if h.Max >= TargetHeldRSS {
				mem.Status = Failed
			}
		} else {
			var idle []float64
			for _, m := range r.Memory {
				if m.Server == SideBulkhead {
					idle = append(idle, float64(m.IdleRSS))
				}
			}
			est := Summarize(idle).Median + Summarize(perStream).Median*TargetHeldStreams
			mem.Measured = fmt.Sprintf("only %d held: %s RSS; extrapolated to %d: %s", n, mib(h.Median), TargetHeldStreams, mib(est))
		}
	}
	ts = append(ts, mem)

	alloc := Target{Name: "Allocation-free admission", Goal: "BenchmarkAdmitDone: 0 allocs/op", Status: NotMeasured, Measured: "—"}
	if b, ok := r.micro("/policy", "BenchmarkAdmitDone"); ok {
		alloc.Measured = fmt.Sprintf("%.0f allocs/op, %.0f B/op, %.0f ns/op", b.AllocsPerOp, b.BytesPerOp, b.NsPerOp)
		alloc.Status = Held
		if b.AllocsPerOp != 0 {
			alloc.Status = Failed
		}
	}
	ts = append(ts, alloc)

	for _, sc := range []struct{ name, goal, pkg, bench string }{
		{"Body scan", "field extraction ≥ 1 GB/s on a 1 MiB chat body", "/extproc/llmapi", "BenchmarkScanRequest/llmapi/1MiB"},
		{"SSE usage scan", "≥ 1 GB/s (16 KiB writes)", "/extproc/llmapi", "BenchmarkUsageScanner/openai_sse/16KiB_writes"},
	} {
		t := Target{Name: sc.name, Goal: sc.goal, Status: NotMeasured, Measured: "—"}
		if b, ok := r.micro(sc.pkg, sc.bench); ok && b.MBPerSec > 0 {
			t.Measured = fmt.Sprintf("%.0f MB/s (%s)", b.MBPerSec, strings.TrimPrefix(sc.bench, "Benchmark"))
			t.Status = Held
			if b.MBPerSec < TargetScanMBps {
				t.Status = Failed
			}
		}
		ts = append(ts, t)
	}
	return ts
}

func (r *Report) micro(pkgSuffix, name string) (GoBench, bool) {
	for _, b := range r.Micro {
		if strings.HasSuffix(b.Package, pkgSuffix) && b.Name == name {
			return b, true
		}
	}
	return GoBench{}, false
}

func (r *Report) write(dir string) error {
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), append(js, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "report.md"), []byte(r.Markdown()), 0o644)
}

// MarshalJSON writes NaN (a value that was not measured) as null, which JSON can carry.
func (s Spread) MarshalJSON() ([]byte, error) {
	type plain struct {
		Median *float64 `json:"median"`
		Min    *float64 `json:"min"`
		Max    *float64 `json:"max"`
		N      int      `json:"n"`
	}
	return json.Marshal(plain{finite(s.Median), finite(s.Min), finite(s.Max), s.N})
}

// MarshalJSON writes NaN CPU figures (not read) as null.
func (s Sample) MarshalJSON() ([]byte, error) {
	type alias Sample
	type withNulls struct {
		alias
		ServerCPU   *float64 `json:"server_cpu_us_per_stream"`
		LoadCPU     *float64 `json:"load_cpu_us_per_stream"`
		ServerCores *float64 `json:"server_cores"`
	}
	return json.Marshal(withNulls{alias(s), finite(s.ServerCPU), finite(s.LoadCPU), finite(s.ServerCores)})
}

// MarshalJSON writes NaN heap figures (not scraped) as null.
func (m Memory) MarshalJSON() ([]byte, error) {
	type alias Memory
	type withNulls struct {
		alias
		IdleHeap      *float64 `json:"idle_heap_inuse_bytes"`
		HeldHeap      *float64 `json:"held_heap_inuse_bytes"`
		AfterHeap     *float64 `json:"after_heap_inuse_bytes"`
		HeapPerStream *float64 `json:"heap_per_stream_bytes"`
	}
	return json.Marshal(withNulls{alias(m), finite(m.IdleHeap), finite(m.HeldHeap), finite(m.AfterHeap), finite(m.HeapPerStream)})
}

func finite(x float64) *float64 {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return nil
	}
	return &x
}

// pinning says where the servers and the load generator ran.
func pinning(server, load string) string {
	where := func(l string) string {
		if l == "" {
			return "any CPU"
		}
		return "CPUs " + l
	}
	if server == "" && load == "" {
		return "not pinned: the servers and the load generator share every CPU"
	}
	return fmt.Sprintf("the servers pinned to %s, the load generator to %s (the micro-benchmarks run on every CPU)", where(server), where(load))
}

// Markdown renders the report.
func (r *Report) Markdown() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	m := r.Machine
	w("# llm-bulkhead against a no-op ext_proc server\n\n")
	w("- Command: `%s`\n", r.Command)
	w("- When: %s, %s\n", r.Started.UTC().Format(time.RFC3339), r.Finished.Sub(r.Started).Round(time.Second))
	w("- Machine: %d CPUs (%s), %s/%s, %s; load average %s at the start, %s at the end\n", m.CPUs, m.CPUModel, m.GOOS, m.GOARCH, m.GoVersion, m.LoadAvgStart, m.LoadAvgEnd)
	w("- Servers: separate processes; no-op = this program's `%s`, replay = its `%s`, llm-bulkhead = %s\n", CmdServeNoop, CmdServeReplay, r.BulkheadCommand)
	if r.BaselineCommand != "" {
		w("- Baseline: %s\n", r.BaselineCommand)
	}
	if r.Config.SameCodec {
		w("- Codec: the no-op and replay servers use llm-bulkhead's gRPC codec (`--same-codec`: its decoder of Envoy's requests, generated marshalling), so the difference is llm-bulkhead's work alone\n")
	} else {
		w("- Codec: the no-op and replay servers use gRPC's default codec, as a Go ext_proc server does unless it brings its own; llm-bulkhead uses its own (its decoder of Envoy's requests, generated marshalling)\n")
	}
	if r.Config.ReflectiveMarshalling {
		w("- **Warning**: %s\n", reflectiveWarning)
	}
	w("- CPUs: %s\n", pinning(r.Config.ServerCPUs, r.Config.LoadCPUs))
	w("- Policy: `examples/policy.yaml` with %s\n", "`"+strings.Join(r.Overrides, "`, `")+"`")
	w("- Filter (from `llm-bulkhead envoy-config`): %s\n", r.Filter)
	w("- Stream: POST /v1/chat/completions, tenant acme, feature chat, %d-byte buffered body with `\"stream\":true`; "+
		"in-process upstream answers 200 text/event-stream in %d SSE chunks (the last with usage): %d ext_proc messages per stream\n",
		BodySize, len(SSEChunks), StreamMessages)
	if len(r.Config.Concurrency) > 0 {
		w("- Load: closed loop, %d repetitions per level rotating which server goes first, %.1fs warm-up + %.1fs measured per run\n",
			r.Config.Reps, r.Config.WarmupSeconds, r.Config.WindowSeconds)
	}

	w("\n## Targets\n\n| target | goal | measured | status |\n|---|---|---|---|\n")
	for _, t := range r.Targets {
		w("| %s | %s | %s | **%s** |\n", t.Name, t.Goal, t.Measured, t.Status)
	}

	if len(r.Levels) > 0 {
		w("\n## Throughput and latency\n\n")
		w("Medians over the repetitions, [min–max] in brackets. Latency is per stream, from the client's first byte to its last. ")
		w("Ratio, added latency and added CPU are computed per repetition from the two adjacent runs, then summarised.\n\n")
		w("| streams | server | streams/s | p50 µs | p99 µs | server CPU µs/stream | errors |\n|---:|---|---:|---:|---:|---:|---:|\n")
		for _, lv := range r.Levels {
			type row struct {
				name string
				st   SideStats
			}
			rows := []row{{SideNoop, lv.Noop}}
			if lv.Replay != nil {
				rows = append(rows, row{SideReplay, *lv.Replay})
			}
			if lv.Baseline != nil {
				rows = append(rows, row{SideBaseline, *lv.Baseline})
			}
			for _, s := range append(rows, row{SideBulkhead, lv.Bulkhead}) {
				w("| %d | %s | %s | %s | %s | %s | %d |\n", lv.Concurrency, s.name, spread(s.st.Rate, "%.0f"), spread(s.st.P50, "%.0f"),
					spread(s.st.P99, "%.0f"), spread(s.st.ServerCPU, "%.1f"), s.st.Errors)
			}
		}
		w("\n| streams | throughput ratio | added p50 µs | added p99 µs | added server CPU µs/stream |\n|---:|---:|---:|---:|---:|\n")
		for _, lv := range r.Levels {
			w("| %d | %s | %s | %s | %s |\n", lv.Concurrency, spread(lv.Ratio, "%.3f"), spread(lv.AddedP50, "%+.1f"), spread(lv.AddedP99, "%+.0f"), spread(lv.AddedCPU, "%+.1f"))
		}
		if len(r.Levels) > 0 && r.Levels[0].Replay != nil {
			w("\nThe difference split in two by the replay server (`%s`: llm-bulkhead's recorded replies, pre-encoded, no policy work). "+
				"Replies = replay against no-op: what llm-bulkhead's replies cost the proxy side (here the simulator, on the same cores). "+
				"Work = llm-bulkhead against replay: what classifying, admitting, building replies and settling cost the server.\n\n", CmdServeReplay)
			w("| streams | replies ratio | work ratio | work added p50 µs | work added server CPU µs/stream |\n|---:|---:|---:|---:|---:|\n")
			for _, lv := range r.Levels {
				w("| %d | %s | %s | %s | %s |\n", lv.Concurrency, spread(lv.RepliesRatio, "%.3f"), spread(lv.WorkRatio, "%.3f"),
					spread(lv.WorkAddedP50, "%+.1f"), spread(lv.WorkAddedCPU, "%+.1f"))
			}
		}
		if r.Levels[0].Baseline != nil {
			w("\nllm-bulkhead against the baseline (%s), loaded in the same rotation: each added CPU is against the no-op of the same repetition, "+
				"the change is llm-bulkhead minus the baseline in the same repetition (negative: the change saves CPU).\n\n", r.BaselineCommand)
			w("| streams | baseline added server CPU µs/stream | llm-bulkhead added server CPU µs/stream | change µs/stream | throughput llm-bulkhead / baseline |\n|---:|---:|---:|---:|---:|\n")
			for _, lv := range r.Levels {
				w("| %d | %s | %s | %s | %s |\n", lv.Concurrency, spread(lv.BaselineAddedCPU, "%+.1f"), spread(lv.AddedCPU, "%+.1f"),
					spread(lv.ChangeCPU, "%+.1f"), spread(lv.ChangeRatio, "%.3f"))
			}
		}
		var errs []string
		for _, s := range r.Samples {
			if s.Errors > 0 {
				errs = append(errs, fmt.Sprintf("%s at %d streams, rep %d: %d errors, first: %s", s.Server, s.Concurrency, s.Rep, s.Errors, s.FirstError))
			}
		}
		if len(errs) > 0 {
			w("\nErrors (the numbers above are not valid for these runs):\n\n")
			for _, e := range errs {
				w("- %s\n", e)
			}
		}
		w("\nRaw runs (in the order they ran):\n\n| server | streams | rep | streams/s | p50 µs | p90 µs | p99 µs | max µs | server CPU µs/stream | server cores | load-generator CPU µs/stream |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, s := range r.Samples {
			w("| %s | %d | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.1f | %.2f | %.1f |\n", s.Server, s.Concurrency, s.Rep, s.Rate, s.P50, s.P90, s.P99, s.Max, s.ServerCPU, s.ServerCores, s.LoadCPU)
		}
	}

	if len(r.Memory) > 0 {
		w("\n## Memory with held streams\n\n")
		w("Each measurement in a fresh process: RSS from /proc/<pid>/status (VmRSS, max of 3 samples), heap = `go_memstats_heap_inuse_bytes` from the server's /metrics. ")
		w("Idle is after a warm-up; held is with every stream admitted and waiting for its upstream; per stream = (held − idle) / held.\n\n")
		w("| server | held | fresh RSS | idle RSS | held RSS | RSS/stream | idle heap | held heap | heap/stream | after release RSS | peak RSS | open time |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, m := range r.Memory {
			w("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.1fs |\n", m.Server, m.Held, mib(float64(m.FreshRSS)), mib(float64(m.IdleRSS)),
				mib(float64(m.HeldRSS)), kib(m.RSSPerStream), mib(m.IdleHeap), mib(m.HeldHeap), kib(m.HeapPerStream),
				mib(float64(m.AfterRSS)), mib(float64(m.PeakRSS)), m.OpenSeconds)
		}
	}
	if len(r.AfterLoadRSS) > 0 {
		w("\nRSS after the load runs:")
		for _, nb := range r.AfterLoadRSS {
			w(" %s %s;", nb.Server, mib(float64(nb.Bytes)))
		}
		w("\n")
	}

	if len(r.Micro) > 0 {
		w("\n## Micro-benchmarks\n\n`go test -bench`, median of the runs. `BenchmarkProcessStream` is one whole stream (%d messages) through the server's `Process` over an in-memory stream, no gRPC; `BenchmarkGRPCStream` the same over a bufconn gRPC connection.\n\n", StreamMessages)
		w("| package | benchmark | ns/op | B/op | allocs/op | MB/s | runs |\n|---|---|---:|---:|---:|---:|---:|\n")
		for _, mb := range r.Micro {
			w("| %s | %s | %.1f | %s | %s | %s | %d |\n", strings.TrimPrefix(mb.Package, module+"/"), mb.Name, mb.NsPerOp, opt(mb.BytesPerOp, "%.0f"), opt(mb.AllocsPerOp, "%.0f"), opt(mb.MBPerSec, "%.1f"), mb.Runs)
		}
	}

	for _, p := range r.Profiles {
		w("\n## Profile of %s at %d streams\n\n", p.Server, p.Concurrency)
		cmd, what := childCommand(p.Server)
		w("%.0f s CPU and allocation profiles (`%s`, `%s`) of this program's `%s` (%s, with net/http/pprof) while it served %.0f streams/s (%.1f µs server CPU per stream, %d errors).\n\n",
			p.Seconds, filepath.Base(p.CPUFile), filepath.Base(p.AllocsFile), cmd, what, p.Load.Rate, p.Load.ServerCPU, p.Load.Errors)
		if p.Server == SideBulkhead {
			w("By flat CPU:\n\n```\n%s\n```\n\n", p.CPUTop)
		}
		w("By cumulative CPU:\n\n```\n%s\n```\n\nBy bytes allocated:\n\n```\n%s\n```\n", p.CPUTopCum, p.AllocTop)
		if x := p.Exchanges; x != nil {
			w("\nExchanges (a message in, its reply written) in the execution trace `%s` of the same seconds: %d, %.1f µs of wall time each. After the message arrived (p50, µs): the stream's goroutine runs at %.1f, is back receiving at %.1f, the reply is written at %.1f (mean %.1f). The rest of each exchange, %.1f µs at the p50, is the proxy's side and the kernel's.\n",
				filepath.Base(p.TraceFile), x.Count, x.WallPerExchange, x.Woken, x.Handled, x.Written, x.Mean, x.WallPerExchange-x.Written)
		}
	}
	return b.String()
}

// childCommand names the subcommand that served side and what it runs.
func childCommand(side string) (cmd, what string) {
	switch side {
	case SideNoop:
		return CmdServeNoop, "Noop"
	case SideReplay:
		return CmdServeReplay, "Replay"
	}
	return CmdServeBulkhead, "cmd/llm-bulkhead/app"
}

func spread(s Spread, format string) string {
	if s.N == 0 {
		return "—"
	}
	if s.N == 1 {
		return fmt.Sprintf(format, s.Median)
	}
	return fmt.Sprintf(format+" ["+format+"–"+format+"]", s.Median, s.Min, s.Max)
}

func opt(v float64, format string) string {
	if v < 0 {
		return "—"
	}
	return fmt.Sprintf(format, v)
}

func mib(b float64) string {
	if math.IsNaN(b) {
		return "—"
	}
	return fmt.Sprintf("%.1f MiB", b/(1<<20))
}

func kib(b float64) string {
	if math.IsNaN(b) || math.IsInf(b, 0) {
		return "—"
	}
	return fmt.Sprintf("%.1f KiB", b/(1<<10))
}
