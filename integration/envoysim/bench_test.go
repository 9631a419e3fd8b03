package envoysim

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// BenchmarkRoundTrip measures simulated requests per second against a no-op
// ext_proc server (default mode: request and response headers), so load
// tests know how much headroom the simulator leaves.
func BenchmarkRoundTrip(b *testing.B) {
	ts := startServer(b, func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
		for {
			req, err := srv.Recv()
			if err != nil {
				return nil
			}
			if err := srv.Send(cont(req)); err != nil {
				return nil
			}
		}
	})
	s := newSim(b, ts.addr, FilterConfig{MessageTimeout: 30 * time.Second})
	up := Respond(200, nil, "ok")
	for _, conc := range []int{1, 64, 512} {
		b.Run(fmt.Sprintf("concurrency=%d", conc), func(b *testing.B) {
			var next atomic.Int64
			var failed atomic.Int64
			var wg sync.WaitGroup
			b.ResetTimer()
			start := time.Now()
			for w := 0; w < conc; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for next.Add(1) <= int64(b.N) {
						res, err := s.RoundTrip(context.Background(), &Request{Path: "/v1/chat/completions"}, up)
						if err != nil || res.Status != 200 {
							failed.Add(1)
						}
					}
				}()
			}
			wg.Wait()
			elapsed := time.Since(start)
			b.StopTimer()
			if failed.Load() > 0 {
				b.Fatalf("%d round trips failed", failed.Load())
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "req/s")
		})
	}
}
