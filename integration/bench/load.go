package bench

import (
	"context"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// Load is one closed-loop load: Concurrency clients each run one simulated request after
// another through Sim to Upstream, for Warmup (not measured) and then Duration (measured).
type Load struct {
	Sim         *envoysim.Sim
	Request     *envoysim.Request
	Upstream    envoysim.Upstream
	Concurrency int
	Warmup      time.Duration
	Duration    time.Duration
	// Admitted says the server is llm-bulkhead, whose admission headers Check requires.
	Admitted bool
	// Pid is the server process, whose CPU time is read at the window's edges (0: not read).
	Pid int
}

// Sample is the measurement of one Load run.
type Sample struct {
	Server      string `json:"server"`
	Concurrency int    `json:"concurrency"`
	Rep         int    `json:"rep"`
	// Streams is the number of streams that completed inside the measured window and passed
	// Check; Rate is Streams per second of the window.
	Streams int     `json:"streams"`
	Rate    float64 `json:"streams_per_sec"`
	// Errors counts round trips that failed Check during the whole run, warm-up included.
	Errors     int    `json:"errors"`
	FirstError string `json:"first_error,omitempty"`
	// P50, P90, P99 and Max are the per-stream latencies, in microseconds, of the streams
	// counted in Streams: from the client's first byte to its last, as the simulator saw them.
	P50 float64 `json:"p50_us"`
	P90 float64 `json:"p90_us"`
	P99 float64 `json:"p99_us"`
	Max float64 `json:"max_us"`
	// ServerCPU is the server process's CPU time per stream and LoadCPU the load generator's,
	// in microseconds (NaN when not read); ServerCores is the server's average CPU use.
	ServerCPU   float64 `json:"server_cpu_us_per_stream"`
	LoadCPU     float64 `json:"load_cpu_us_per_stream"`
	ServerCores float64 `json:"server_cores"`
	Window      float64 `json:"window_seconds"`
}

// Run drives the load and returns its sample. Every client stops starting requests when the
// window ends, and Run returns once they have all finished, so consecutive runs never overlap.
// The error is non-nil only when the simulator cannot run requests at all.
func (l Load) Run(ctx context.Context) (Sample, error) {
	start := time.Now()
	wStart, wEnd := start.Add(l.Warmup), start.Add(l.Warmup+l.Duration)

	type worker struct {
		lat      []time.Duration
		errors   int
		firstErr string
		fatal    error
	}
	workers := make([]worker, l.Concurrency)
	var wg sync.WaitGroup
	for i := range workers {
		w := &workers[i]
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil && time.Now().Before(wEnd) {
				res, err := l.Sim.RoundTrip(ctx, l.Request, l.Upstream)
				end := time.Now()
				if err != nil {
					w.fatal = err
					return
				}
				if err := Check(res, l.Admitted); err != nil {
					if w.errors == 0 {
						w.firstErr = err.Error()
					}
					w.errors++
					continue
				}
				if end.After(wStart) && !end.After(wEnd) {
					w.lat = append(w.lat, res.Completed.Sub(res.Started))
				}
			}
		}()
	}

	// CPU times at the window's edges.
	cpuAt := func() (server, load time.Duration, ok bool) {
		if l.Pid == 0 {
			return 0, SelfCPU(), false
		}
		s, err := ProcessCPU(l.Pid)
		return s, SelfCPU(), err == nil
	}
	var s0, s1, g0, g1 time.Duration
	okCPU := SleepUntil(ctx, wStart)
	if okCPU {
		var ok bool
		s0, g0, ok = cpuAt()
		okCPU = ok && SleepUntil(ctx, wEnd)
	}
	if okCPU {
		var ok bool
		s1, g1, ok = cpuAt()
		okCPU = ok
	}
	wg.Wait()

	smp := Sample{Concurrency: l.Concurrency, Window: l.Duration.Seconds(), ServerCPU: math.NaN(), LoadCPU: math.NaN(), ServerCores: math.NaN()}
	var lat []time.Duration
	for i := range workers {
		w := &workers[i]
		if w.fatal != nil {
			return smp, w.fatal
		}
		lat = append(lat, w.lat...)
		if w.errors > 0 && smp.FirstError == "" {
			smp.FirstError = w.firstErr
		}
		smp.Errors += w.errors
	}
	if err := ctx.Err(); err != nil {
		return smp, err
	}
	slices.Sort(lat)
	smp.Streams = len(lat)
	smp.Rate = float64(len(lat)) / l.Duration.Seconds()
	smp.P50 = micros(Percentile(lat, 0.50))
	smp.P90 = micros(Percentile(lat, 0.90))
	smp.P99 = micros(Percentile(lat, 0.99))
	smp.Max = micros(Percentile(lat, 1))
	if okCPU && smp.Streams > 0 {
		smp.ServerCPU = micros(s1-s0) / float64(smp.Streams)
		smp.LoadCPU = micros(g1-g0) / float64(smp.Streams)
		smp.ServerCores = (s1 - s0).Seconds() / l.Duration.Seconds()
	}
	return smp, nil
}

// SleepUntil waits until t or until ctx ends, reporting whether t was reached.
func SleepUntil(ctx context.Context, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}
