package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Profile is a CPU and allocation profile of a server process under load.
type Profile struct {
	Server      string  `json:"server"`
	Concurrency int     `json:"concurrency"`
	Seconds     float64 `json:"seconds"`
	// Load is the load that ran while profiling.
	Load Sample `json:"load"`
	// CPUFile and AllocsFile are the saved profiles (pprof format).
	CPUFile    string `json:"cpu_file"`
	AllocsFile string `json:"allocs_file"`
	// CPUTop, CPUTopCum and AllocTop are `go tool pprof -top` output: by flat CPU, by
	// cumulative CPU, and by bytes allocated during the profile.
	CPUTop    string `json:"cpu_top"`
	CPUTopCum string `json:"cpu_top_cum"`
	AllocTop  string `json:"alloc_top"`
	// TraceFile is the runtime execution trace taken over the same seconds (Config.Trace; empty:
	// none), and Exchanges what it shows of the server's time per exchange.
	TraceFile string     `json:"trace_file,omitempty"`
	Exchanges *Exchanges `json:"exchanges,omitempty"`
}

// ProfileUnderLoad runs load against p (which must serve net/http/pprof) and meanwhile takes a
// CPU profile and a delta allocation profile of seconds seconds, saved in dir as
// <name>-cpu.pprof and <name>-allocs.pprof, and with trace a runtime execution trace of the
// same seconds, <name>.trace, summarised in Exchanges.
func ProfileUnderLoad(ctx context.Context, p *Process, load Load, seconds int, trace bool, dir string) (Profile, error) {
	pr := Profile{Server: p.Name, Concurrency: load.Concurrency, Seconds: float64(seconds)}
	if p.PprofAddr == "" {
		return pr, errors.New("the profiled server serves no pprof endpoint")
	}
	// The profiles start after the warm-up and end inside the window.
	load.Duration = time.Duration(seconds)*time.Second + time.Second
	type got struct {
		name string
		err  error
	}
	fetches := 2
	results := make(chan got, 3)
	pr.CPUFile = filepath.Join(dir, p.Name+"-cpu.pprof")
	pr.AllocsFile = filepath.Join(dir, p.Name+"-allocs.pprof")
	fetch := func(file, path string) {
		if !SleepUntil(ctx, time.Now().Add(load.Warmup)) {
			results <- got{file, ctx.Err()}
			return
		}
		results <- got{file, download(ctx, fmt.Sprintf("http://%s%s?seconds=%d", p.PprofAddr, path, seconds), file)}
	}
	go fetch(pr.CPUFile, "/debug/pprof/profile")
	go fetch(pr.AllocsFile, "/debug/pprof/allocs")
	if trace {
		fetches++
		pr.TraceFile = filepath.Join(dir, p.Name+".trace")
		go fetch(pr.TraceFile, "/debug/pprof/trace")
	}
	smp, err := load.Run(ctx)
	var errs []error
	for range fetches {
		if g := <-results; g.err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", g.name, g.err))
		}
	}
	if err != nil {
		return pr, err
	}
	if len(errs) > 0 {
		return pr, errors.Join(errs...)
	}
	smp.Server = p.Name
	pr.Load = smp
	// Each `go tool pprof` takes a second or two to start: run the three at once.
	tops := []struct {
		dst  *string
		file string
		opts []string
	}{
		{&pr.CPUTop, pr.CPUFile, nil},
		{&pr.CPUTopCum, pr.CPUFile, []string{"-cum"}},
		{&pr.AllocTop, pr.AllocsFile, []string{"-sample_index=alloc_space"}},
	}
	topErrs := make([]error, len(tops))
	var wg sync.WaitGroup
	for i, t := range tops {
		wg.Go(func() { *t.dst, topErrs[i] = pprofTop(ctx, t.file, t.opts...) })
	}
	var traceErr error
	if trace {
		wg.Go(func() {
			f, err := os.Open(pr.TraceFile)
			if err != nil {
				traceErr = err
				return
			}
			defer f.Close()
			x, err := ReadExchanges(f)
			if err != nil {
				traceErr = fmt.Errorf("%s: %w", pr.TraceFile, err)
				return
			}
			pr.Exchanges = &x
		})
	}
	wg.Wait()
	return pr, errors.Join(append(topErrs, traceErr)...)
}

func download(ctx context.Context, url, file string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, b)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// pprofTop returns the 25 top entries of a profile as `go tool pprof -top` prints them.
func pprofTop(ctx context.Context, file string, opts ...string) (string, error) {
	args := append([]string{"tool", "pprof", "-top", "-nodecount=25"}, opts...)
	args = append(args, file)
	cmd := exec.CommandContext(ctx, "go", args...)
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return "", fmt.Errorf("go tool pprof %s: %w\n%s", file, err, ee.Stderr)
		}
		return "", fmt.Errorf("go tool pprof %s: %w", file, err)
	}
	return strings.TrimRight(string(out), "\n"), nil
}
