package bench

import (
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// Memory is the memory of one server process, idle and with Streams streams held open.
// Sizes are bytes; Heap* is the server's go_memstats_heap_inuse_bytes (NaN when unavailable).
type Memory struct {
	Server string `json:"server"`
	// Streams is how many streams were to be held; Held how many reached the upstream and were
	// held at the measurement.
	Streams int   `json:"streams"`
	Held    int64 `json:"held"`
	// FreshRSS is measured right after start, IdleRSS after a short warm-up, HeldRSS with the
	// streams held, AfterRSS once they were all released and finished; PeakRSS is the largest
	// of VmHWM and those.
	FreshRSS int64 `json:"fresh_rss_bytes"`
	IdleRSS  int64 `json:"idle_rss_bytes"`
	HeldRSS  int64 `json:"held_rss_bytes"`
	AfterRSS int64 `json:"after_rss_bytes"`
	PeakRSS  int64 `json:"peak_rss_bytes"`
	// IdleHeap, HeldHeap and AfterHeap are taken at the same moments as the RSS values.
	IdleHeap  float64 `json:"idle_heap_inuse_bytes"`
	HeldHeap  float64 `json:"held_heap_inuse_bytes"`
	AfterHeap float64 `json:"after_heap_inuse_bytes"`
	// RSSPerStream and HeapPerStream are (held − idle) / Held.
	RSSPerStream  float64 `json:"rss_per_stream_bytes"`
	HeapPerStream float64 `json:"heap_per_stream_bytes"`
	// OpenSeconds is how long it took until every stream was held.
	OpenSeconds float64 `json:"open_seconds"`
	Errors      int     `json:"errors"`
	FirstError  string  `json:"first_error,omitempty"`
}

// Hold measures p's memory: idle after warm-up round trips, then with n streams admitted and
// held open by a HeldUpstream (the upstream waits until every one has arrived), then after
// releasing them. Before each measurement it waits settle for the server to finish what it was
// doing. The error is non-nil when the measurement could not be made; streams that failed are
// counted in the result.
func Hold(ctx context.Context, p *Process, sim *envoysim.Sim, req *envoysim.Request, n int, admitted bool, settle, timeout time.Duration) (Memory, error) {
	m := Memory{Server: p.Name, Streams: n, IdleHeap: math.NaN(), HeldHeap: math.NaN(), AfterHeap: math.NaN()}
	var err error
	if m.FreshRSS, err = RSS(p.Pid()); err != nil {
		return m, err
	}
	// Warm up: page in the code paths, let the runtime size its pools.
	warm := Load{Sim: sim, Request: req, Upstream: SSEUpstream(), Concurrency: 8, Duration: settle, Admitted: admitted}
	smp, err := warm.Run(ctx)
	if err != nil {
		return m, err
	}
	if smp.Errors > 0 {
		return m, fmt.Errorf("warm-up against %s: %d errors, first: %s", p.Name, smp.Errors, smp.FirstError)
	}
	if !SleepUntil(ctx, time.Now().Add(settle)) {
		return m, ctx.Err()
	}
	m.IdleRSS, m.IdleHeap, err = measureMemory(ctx, p, settle)
	if err != nil {
		return m, err
	}

	up := NewHeldUpstream(SSEUpstream())
	defer up.Release()
	var finished atomic.Int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	rctx, cancel := context.WithCancel(ctx)
	defer func() {
		cancel()
		wg.Wait()
	}()
	start := time.Now()
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := sim.RoundTrip(rctx, req, up)
			if err == nil {
				err = Check(res, admitted)
			}
			if err != nil && rctx.Err() == nil {
				mu.Lock()
				if m.Errors == 0 {
					m.FirstError = err.Error()
				}
				m.Errors++
				mu.Unlock()
			}
			finished.Add(1)
		}()
	}
	deadline := time.Now().Add(timeout)
	for up.Arrived() < int64(n) {
		if finished.Load() > 0 {
			mu.Lock()
			e := m.FirstError
			mu.Unlock()
			return m, fmt.Errorf("%s: a stream ended before it was held (%d held): %s", p.Name, up.Arrived(), e)
		}
		if time.Now().After(deadline) {
			return m, fmt.Errorf("%s: only %d of %d streams held after %s", p.Name, up.Arrived(), n, timeout)
		}
		if err := p.Alive(); err != nil {
			return m, err
		}
		if !SleepUntil(ctx, time.Now().Add(50*time.Millisecond)) {
			return m, ctx.Err()
		}
	}
	m.OpenSeconds = time.Since(start).Seconds()
	m.Held = up.Arrived()
	// Let the server finish answering the request bodies and the runtime settle.
	if !SleepUntil(ctx, time.Now().Add(settle)) {
		return m, ctx.Err()
	}
	if m.HeldRSS, m.HeldHeap, err = measureMemory(ctx, p, settle); err != nil {
		return m, err
	}
	up.Release()
	wg.Wait()
	if !SleepUntil(ctx, time.Now().Add(settle)) {
		return m, ctx.Err()
	}
	if m.AfterRSS, m.AfterHeap, err = measureMemory(ctx, p, settle); err != nil {
		return m, err
	}
	if m.PeakRSS, err = PeakRSS(p.Pid()); err != nil {
		return m, err
	}
	// The kernel updates VmHWM lazily; it can trail a VmRSS read a moment earlier.
	m.PeakRSS = max(m.PeakRSS, m.IdleRSS, m.HeldRSS, m.AfterRSS)
	m.RSSPerStream = float64(m.HeldRSS-m.IdleRSS) / float64(m.Held)
	m.HeapPerStream = (m.HeldHeap - m.IdleHeap) / float64(m.Held)
	return m, nil
}

// measureMemory samples RSS three times, settle/5 apart, and keeps the largest, with the heap
// in use from the server's metrics.
func measureMemory(ctx context.Context, p *Process, settle time.Duration) (int64, float64, error) {
	var rss int64
	for i := range 3 {
		if i > 0 && !SleepUntil(ctx, time.Now().Add(settle/5)) {
			return 0, 0, ctx.Err()
		}
		r, err := RSS(p.Pid())
		if err != nil {
			return 0, 0, err
		}
		rss = max(rss, r)
	}
	heap, err := p.HeapInuse(ctx)
	if err != nil {
		return rss, math.NaN(), nil
	}
	return rss, heap, nil
}
