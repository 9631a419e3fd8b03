//go:build unix

package stall

import (
	"syscall"
	"testing"
	"time"
)

// cpu returns the CPU time the process has used.
func cpu(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkMeterCPU measures what a running meter costs: the process's CPU time over b.N
// ticks of the real ticker, per tick and as a share of one core. BenchmarkIdleCPU is the same
// wait without the meter, for comparison.
func BenchmarkMeterCPU(b *testing.B) { benchCPU(b, true) }

func BenchmarkIdleCPU(b *testing.B) { benchCPU(b, false) }

func benchCPU(b *testing.B, meter bool) {
	m := New()
	before := cpu(b)
	if meter {
		m.Start()
	}
	time.Sleep(time.Duration(b.N) * Tick)
	m.Stop()
	used := cpu(b) - before
	b.ReportMetric(float64(used)/float64(b.N), "cpu-ns/tick")
	b.ReportMetric(100*used.Seconds()/(time.Duration(b.N)*Tick).Seconds(), "%core")
}
