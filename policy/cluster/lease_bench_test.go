package cluster

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// BenchmarkLeaseReport: what one lease report costs Redis, as the compartment's hash holds 1, 10
// and 30 replicas' entries. Each replica in turn reports a steady lease of one compartment with a
// token window (a chunk wanted, an unused one given back), as at a fleet's steady load. It
// reports the script's time in Redis per report (redis-µs/report, from INFO commandstats: what
// the script and the commands it runs take) and Redis's CPU per report (redis-cpu-µs/report,
// INFO cpu: the round trip's reading and writing too).
func BenchmarkLeaseReport(b *testing.B) {
	rd := redistest.Standalone(b)
	rc := redis.NewClient(&redis.Options{Addr: rd.Addr()})
	defer rc.Close()
	ctx := context.Background()
	sc := redis.NewScript(luaLease)
	for _, n := range []int{1, 10, 30} {
		b.Run("replicas="+strconv.Itoa(n), func(b *testing.B) {
			if err := rc.FlushAll(ctx).Err(); err != nil {
				b.Fatal(err)
			}
			keys := []string{"{p|c}:ls", "{p}:le", "{p}:r", "{p|c}:w:tokens:60000"}
			seq := 0
			report := func(r int) {
				seq++
				args := []any{"r" + strconv.Itoa(r), 10000, 1, 2000, "1:" + strconv.Itoa(seq),
					100000, 4, 3, 6, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, "{p}:free", "c", "3:0", "",
					"tokens", 1_000_000_000, 1000, 1000, 4000, 0, 0}
				// An unused chunk given back every other report (it was charged in the
				// window's current slot, or one before).
				if seq%2 == 0 {
					args = append(args, 1, 0, 0, 0)
				} else {
					args = append(args, 0, 0)
				}
				if err := sc.Run(ctx, rc, keys, args...).Err(); err != nil {
					b.Fatal(err)
				}
			}
			for r := range n {
				report(r)
			}
			calls, usec, cpu := redisCost(b, rc, func(i int) { report(i % n) })
			if calls < int64(b.N) {
				b.Fatalf("%d script calls counted for %d reports", calls, b.N)
			}
			b.ReportMetric(usec/float64(b.N), "redis-µs/report")
			b.ReportMetric(cpu/float64(b.N), "redis-cpu-µs/report")
		})
	}
}

// redisCost runs op b.N times, timed, and returns what Redis spent on them: the calls of
// EVALSHA and EVAL, the µs Redis accounts to them (INFO commandstats), and its CPU µs (INFO cpu).
func redisCost(b *testing.B, rc *redis.Client, op func(i int)) (calls int64, usec, cpu float64) {
	cpu0 := redisCPU(b, rc)
	if err := rc.ConfigResetStat(context.Background()).Err(); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := range b.N {
		op(i)
	}
	b.StopTimer()
	cpu = redisCPU(b, rc) - cpu0
	calls, usec = scriptStats(b, rc)
	return calls, usec, cpu
}

// scriptStats returns the calls of EVALSHA and EVAL and the µs Redis spent in them since the
// last CONFIG RESETSTAT.
func scriptStats(b testing.TB, rc *redis.Client) (calls int64, usec float64) {
	info, err := rc.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		name, stats, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || (name != "cmdstat_evalsha" && name != "cmdstat_eval") {
			continue
		}
		for _, kv := range strings.Split(stats, ",") {
			k, v, _ := strings.Cut(kv, "=")
			switch k {
			case "calls":
				n, _ := strconv.ParseInt(v, 10, 64)
				calls += n
			case "usec":
				u, _ := strconv.ParseFloat(v, 64)
				usec += u
			}
		}
	}
	return calls, usec
}

// redisCPU returns the CPU time (µs) Redis spent since it started, user and system.
func redisCPU(b *testing.B, rc *redis.Client) float64 {
	info, err := rc.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for _, line := range strings.Split(info, "\n") {
		name, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (name == "used_cpu_sys" || name == "used_cpu_user") {
			s, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatal(fmt.Errorf("INFO cpu: %s: %w", line, err))
			}
			total += s * 1e6
		}
	}
	return total
}
