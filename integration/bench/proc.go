package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// userHZ is the unit of the CPU times in /proc/<pid>/stat (USER_HZ, 100 on every Linux
// architecture Go supports).
const userHZ = 100

// ParseStatusKB returns the value of a "Key:   123 kB" line of /proc/<pid>/status in bytes.
func ParseStatusKB(status []byte, key string) (int64, error) {
	sc := bufio.NewScanner(bytes.NewReader(status))
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || name != key {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			return 0, fmt.Errorf("%s: unexpected value %q", key, strings.TrimSpace(rest))
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", key, err)
		}
		return kb << 10, nil
	}
	return 0, fmt.Errorf("%s: not in status", key)
}

// ParseStatCPU returns the user plus system CPU time from the contents of /proc/<pid>/stat.
// The command name (field 2) is in parentheses and may hold spaces and parentheses itself, so
// fields are counted after its last closing parenthesis.
func ParseStatCPU(stat []byte) (time.Duration, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, errors.New("stat: no command name")
	}
	// After the name: state (field 3), ppid (4), … utime (14), stime (15).
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("stat: %d fields after the command name, want at least 13", len(f))
	}
	var ticks int64
	for _, s := range f[11:13] {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("stat: %w", err)
		}
		ticks += n
	}
	return time.Duration(ticks) * time.Second / userHZ, nil
}

// RSS returns the resident set size (VmRSS) of process pid in bytes.
func RSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	return ParseStatusKB(b, "VmRSS")
}

// PeakRSS returns the largest resident set size process pid has had (VmHWM) in bytes.
func PeakRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	return ParseStatusKB(b, "VmHWM")
}

// ProcessCPU returns the CPU time (user + system) process pid has used so far.
func ProcessCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return ParseStatCPU(b)
}

// ThreadsCPU returns the CPU time process pid's threads have used so far, to the nanosecond:
// the sum of their times on a CPU (/proc/<pid>/task/*/schedstat), where /proc/<pid>/stat counts
// in clock ticks (10 ms: over a few seconds of a process using a few milliseconds a second, as
// Redis serving leases does, that is most of the figure). A thread that has exited is no longer
// counted: use it for processes whose threads live as long as they do (redis-server). Without
// schedstat (a kernel built without it) it is ProcessCPU.
func ThreadsCPU(pid int) (time.Duration, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, err
	}
	var sum time.Duration
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, t.Name()))
		if errors.Is(err, fs.ErrNotExist) && sum == 0 {
			return ProcessCPU(pid)
		}
		if err != nil {
			return 0, err
		}
		ns, err := ParseSchedstat(b)
		if err != nil {
			return 0, err
		}
		sum += ns
	}
	return sum, nil
}

// ParseSchedstat returns the time on a CPU that a schedstat file's first field gives (ns).
func ParseSchedstat(b []byte) (time.Duration, error) {
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return 0, errors.New("schedstat: empty")
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil || ns < 0 {
		return 0, fmt.Errorf("schedstat: %q is not a count of nanoseconds", f[0])
	}
	return time.Duration(ns), nil
}

// SelfCPU returns the CPU time (user + system) this process has used so far.
func SelfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// ParseMetric returns the value of an unlabelled sample named name in the Prometheus text
// exposition format.
func ParseMetric(text []byte, name string) (float64, error) {
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, name)
		if !ok || !strings.HasPrefix(rest, " ") {
			continue
		}
		f := strings.Fields(rest)
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", name, err)
		}
		return v, nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("%s: not exposed", name)
}

// ScrapeMetric fetches url (a /metrics endpoint) and returns the unlabelled sample name.
func ScrapeMetric(ctx context.Context, url, name string) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return 0, err
	}
	return ParseMetric(b, name)
}
