package cluster

import (
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// BenchmarkUsageFlush measures what one replica's usage flush costs Redis (every 5 s per
// replica: its three tables, by tenant, by model and by both, each added to its buckets), with
// groups tenants using one model each, in fleet tables that many replicas' flushes filled.
func BenchmarkUsageFlush(b *testing.B) {
	rd := redistest.Standalone(b)
	rc := redis.NewClient(&redis.Options{Addr: rd.Addr()})
	defer rc.Close()
	for _, groups := range []int{1, 50} {
		b.Run("groups="+strconv.Itoa(groups), func(b *testing.B) {
			clock := &usageClock{now: time.Now()}
			u, tr := usageReplica(b, options(rd.Addr(), "ub"+strconv.Itoa(groups), "a"), clock, 200)
			flush := func() {
				for g := range groups {
					served(tr, clock.Now(), "tenant"+strconv.Itoa(g), "gpt-4o", 100, 20)
				}
				if err := u.Flush(); err != nil {
					b.Fatal(err)
				}
			}
			flush()
			calls, usec, cpu := redisCost(b, rc, func(int) { flush() })
			b.ReportMetric(float64(calls)/float64(b.N), "scripts/flush")
			b.ReportMetric(usec/float64(b.N), "redis-µs/flush")
			b.ReportMetric(cpu/float64(b.N), "redis-cpu-µs/flush")
		})
	}
}
