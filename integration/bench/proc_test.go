package bench

import (
	"os"
	"strings"
	"testing"
	"time"
)

const statusSample = `Name:	llm-bulkhead
Umask:	0022
State:	S (sleeping)
VmPeak:	 1801234 kB
VmHWM:	   52340 kB
VmRSS:	   43900 kB
RssAnon:	   30000 kB
Threads:	9
`

func TestParseStatusKB(t *testing.T) {
	tests := []struct {
		key     string
		want    int64
		wantErr string
	}{
		{"VmRSS", 43900 << 10, ""},
		{"VmHWM", 52340 << 10, ""},
		{"VmSwap", 0, "not in status"},
		{"Threads", 0, "unexpected value"},
		{"State", 0, "unexpected value"},
	}
	for _, tt := range tests {
		t.Run(tt.key, func(t *testing.T) {
			got, err := ParseStatusKB([]byte(statusSample), tt.key)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("= %d, %v; want %d", got, err, tt.want)
			}
		})
	}
}

func TestParseStatCPU(t *testing.T) {
	tests := []struct {
		name    string
		stat    string
		want    time.Duration
		wantErr bool
	}{
		{"plain name", "4242 (llm-bulkhead) S 1 4242 4242 0 -1 4194560 1203 0 0 0 150 25 0 0 20 0 9 0 123 0",
			1750 * time.Millisecond, false},
		{"name with spaces and parentheses", "17 (a (weird) name) R 1 17 17 0 -1 0 0 0 0 0 7 3 0 0 20 0 1 0 5 0",
			100 * time.Millisecond, false},
		{"truncated", "17 (x) R 1 2 3", 0, true},
		{"no name", "garbage", 0, true},
		{"not a number", "17 (x) R 1 17 17 0 -1 0 0 0 0 0 seven 3 0", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseStatCPU([]byte(tt.stat))
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("= %v, %v; want %v (error %t)", got, err, tt.want, tt.wantErr)
			}
		})
	}
}

func TestReadOwnProcess(t *testing.T) {
	pid := os.Getpid()
	rss, err := RSS(pid)
	if err != nil || rss <= 0 {
		t.Errorf("RSS = %d, %v", rss, err)
	}
	peak, err := PeakRSS(pid)
	if err != nil || peak < rss {
		t.Errorf("PeakRSS = %d, %v; want ≥ RSS %d", peak, err, rss)
	}
	if _, err := ProcessCPU(pid); err != nil {
		t.Errorf("ProcessCPU: %v", err)
	}
	// Counted to the nanosecond: a little work shows, where clock ticks (10 ms) would not.
	before, err := ThreadsCPU(os.Getpid())
	if err != nil {
		t.Fatalf("ThreadsCPU: %v", err)
	}
	x := 0
	for i := range 3_000_000 {
		x += i % 7
	}
	if after, err := ThreadsCPU(os.Getpid()); err != nil || after <= before || x == 0 {
		t.Errorf("ThreadsCPU %v, then %v after some work (%v)", before, after, err)
	}
	if SelfCPU() <= 0 {
		t.Error("SelfCPU is not positive")
	}
}

func TestParseMetric(t *testing.T) {
	text := []byte(`# HELP go_memstats_heap_inuse_bytes Number of heap bytes that are in use.
# TYPE go_memstats_heap_inuse_bytes gauge
go_memstats_heap_inuse_bytes_total 1
go_memstats_heap_inuse_bytes{le="x"} 2
go_memstats_heap_inuse_bytes 1.2345e+07
process_resident_memory_bytes 4.5e+07
bad_metric x
`)
	tests := []struct {
		name    string
		want    float64
		wantErr bool
	}{
		{"go_memstats_heap_inuse_bytes", 12345000, false},
		{"process_resident_memory_bytes", 45000000, false},
		{"go_goroutines", 0, true},
		{"bad_metric", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseMetric(text, tt.name)
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("= %v, %v; want %v (error %t)", got, err, tt.want, tt.wantErr)
			}
		})
	}
}

func TestParseSchedstat(t *testing.T) {
	for _, tt := range []struct {
		in      string
		want    time.Duration
		wantErr bool
	}{
		{"243331592 82245134 1321\n", 243331592, false},
		{"0 0 1", 0, false},
		{"", 0, true},
		{"-5 0 1", 0, true},
		{"1.5 0 1", 0, true},
		{"99999999999999999999 0 1", 0, true},
	} {
		got, err := ParseSchedstat([]byte(tt.in))
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("ParseSchedstat(%q) = %v, %v; want %v (error %t)", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

func FuzzParseSchedstat(f *testing.F) {
	for _, s := range []string{"243331592 82245134 1321\n", "0 0 1", "", "x", "-1"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := ParseSchedstat(b)
		if err == nil && d < 0 {
			t.Fatalf("%q: negative time %v", b, d)
		}
	})
}
