package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
)

// GoBench is one result line of `go test -bench`, or the median of several.
type GoBench struct {
	Package string `json:"package"`
	// Name is the benchmark's name without the GOMAXPROCS suffix.
	Name       string  `json:"name"`
	Iterations int64   `json:"iterations"`
	NsPerOp    float64 `json:"ns_per_op"`
	// BytesPerOp and AllocsPerOp are -1 when the benchmark did not report them.
	BytesPerOp  float64 `json:"bytes_per_op"`
	AllocsPerOp float64 `json:"allocs_per_op"`
	// MBPerSec is -1 when the benchmark set no byte count.
	MBPerSec float64 `json:"mb_per_sec"`
	// Runs is how many result lines the values are the median of.
	Runs int `json:"runs"`
}

// MicroBench selects benchmarks of one package for the report.
type MicroBench struct {
	Package string
	// Pattern is the -bench regular expression.
	Pattern string
}

const module = "github.com/llm-bulkhead/llm-bulkhead"

// MicroBenchmarks are the hot-path benchmarks the report includes: a whole ext_proc stream in
// memory and over gRPC against both servers (this package), the admission fast path, the
// bulkhead against a channel semaphore, budget reserve/settle, a breaker call, and the body and
// usage scanners.
var MicroBenchmarks = []MicroBench{
	{module + "/integration/bench", "^(BenchmarkProcessStream|BenchmarkGRPCStream)$"},
	{module + "/policy", "^BenchmarkAdmitDone$"},
	{module + "/policy/bulkhead", "^(BenchmarkAcquireRelease|BenchmarkChanSemaphore)$"},
	{module + "/policy/budget", "^BenchmarkReserveSettle$"},
	{module + "/policy/breaker", "^BenchmarkAcquireRecordClosed$"},
	{module + "/extproc/llmapi", "^(BenchmarkScanRequest|BenchmarkUsageScanner)$/^(llmapi|openai_sse|anthropic_sse|openai_json_1MiB|openai_sse_gzip)$"},
}

// RunGoBench runs `go test -tags vtprotobuf -run ^$ -bench pattern -benchmem` for each
// selection and returns the median of each benchmark over count runs, with the raw output. The
// tag is the one the measured binary is built with (BuildServer), whatever GOFLAGS says, so
// that the gRPC benchmarks marshal replies as the server does.
func RunGoBench(ctx context.Context, sel []MicroBench, benchtime string, count int) ([]GoBench, string, error) {
	var raw bytes.Buffer
	var all []GoBench
	for _, s := range sel {
		args := []string{"test", "-tags", "vtprotobuf", "-run", "^$", "-bench", s.Pattern, "-benchmem", "-benchtime", benchtime, "-count", strconv.Itoa(count), s.Package}
		cmd := exec.CommandContext(ctx, "go", args...)
		out, err := cmd.CombinedOutput()
		fmt.Fprintf(&raw, "$ go %s\n%s\n", strings.Join(args, " "), out)
		if err != nil {
			return nil, raw.String(), fmt.Errorf("go test -bench %s: %w\n%s", s.Package, err, out)
		}
		all = append(all, ParseGoBench(out)...)
	}
	return MedianGoBench(all), raw.String(), nil
}

var procsSuffix = regexp.MustCompile(`-\d+$`)

// ParseGoBench reads the result lines of `go test -bench` output, taking each benchmark's
// package from the preceding "pkg:" line.
func ParseGoBench(out []byte) []GoBench {
	var res []GoBench
	pkg := ""
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if p, ok := strings.CutPrefix(line, "pkg: "); ok {
			pkg = strings.TrimSpace(p)
			continue
		}
		if !strings.HasPrefix(line, "Benchmark") {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 4 || len(f)%2 != 0 {
			continue
		}
		iters, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		b := GoBench{Package: pkg, Name: procsSuffix.ReplaceAllString(f[0], ""), Iterations: iters,
			NsPerOp: -1, BytesPerOp: -1, AllocsPerOp: -1, MBPerSec: -1, Runs: 1}
		for i := 2; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				continue
			}
			switch f[i+1] {
			case "ns/op":
				b.NsPerOp = v
			case "B/op":
				b.BytesPerOp = v
			case "allocs/op":
				b.AllocsPerOp = v
			case "MB/s":
				b.MBPerSec = v
			}
		}
		if b.NsPerOp >= 0 {
			res = append(res, b)
		}
	}
	return res
}

// MedianGoBench merges results of the same package and name into their medians, keeping the
// order in which benchmarks first appear.
func MedianGoBench(in []GoBench) []GoBench {
	type key struct{ pkg, name string }
	var order []key
	groups := map[key][]GoBench{}
	for _, b := range in {
		k := key{b.Package, b.Name}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], b)
	}
	out := make([]GoBench, 0, len(order))
	for _, k := range order {
		g := groups[k]
		med := func(get func(GoBench) float64) float64 {
			xs := make([]float64, len(g))
			for i, b := range g {
				xs[i] = get(b)
			}
			return Summarize(xs).Median
		}
		out = append(out, GoBench{
			Package: k.pkg, Name: k.name, Runs: len(g),
			Iterations:  int64(med(func(b GoBench) float64 { return float64(b.Iterations) })),
			NsPerOp:     med(func(b GoBench) float64 { return b.NsPerOp }),
			BytesPerOp:  med(func(b GoBench) float64 { return b.BytesPerOp }),
			AllocsPerOp: med(func(b GoBench) float64 { return b.AllocsPerOp }),
			MBPerSec:    med(func(b GoBench) float64 { return b.MBPerSec }),
		})
	}
	return out
}
