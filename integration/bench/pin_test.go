package bench

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestParseCPUList(t *testing.T) {
	good := map[string][]int{"": nil, "1": {1}, "0,2": {0, 2}, " 0-3 ": {0, 1, 2, 3}, "1,3-4": {1, 3, 4}}
	for in, want := range good {
		l, err := ParseCPUList(in)
		if err != nil {
			t.Errorf("%q: %v", in, err)
			continue
		}
		if l.set.Count() != len(want) || l.Empty() != (len(want) == 0) {
			t.Errorf("%q: %d CPUs, want %v", in, l.set.Count(), want)
		}
		for _, c := range want {
			if !l.set.IsSet(c) {
				t.Errorf("%q: CPU %d missing", in, c)
			}
		}
	}
	for _, in := range []string{"a", "3-1", "-1", "1-", "1,,2", "2000", "0-2000"} {
		if _, err := ParseCPUList(in); err == nil {
			t.Errorf("%q accepted", in)
		}
	}
}

func TestPinningIsChecked(t *testing.T) {
	one, _ := ParseCPUList("0")
	overlapping, _ := ParseCPUList("0-1")
	absent, _ := ParseCPUList("1023")
	cases := []struct {
		server, load CPUList
		want         string
	}{
		{one, overlapping, "overlap"},
		{absent, CPUList{}, "CPU 1023 of \"1023\" is not available here"},
		{CPUList{}, absent, "load-generator CPUs: CPU 1023"},
	}
	for _, c := range cases {
		cfg := Config{ServerCPUs: c.server, LoadCPUs: c.load}
		if err := cfg.checkPinning(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("server %q load %q: got %v, want %q", c.server, c.load, err, c.want)
		}
	}
	if err := (Config{ServerCPUs: one}).checkPinning(); err != nil {
		t.Errorf("CPU 0 alone: %v", err)
	}
}

// allowedList returns the Cpus_allowed_list of a /proc status file.
func allowedList(t *testing.T, status string) string {
	t.Helper()
	b, err := os.ReadFile(status)
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no Cpus_allowed_list in %s", status)
	return ""
}

// lastCPU is the highest CPU this process may run on, and the list of all of them.
func lastCPU(t *testing.T) (last int, all string) {
	t.Helper()
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		t.Fatal(err)
	}
	for c := range 1024 {
		if set.IsSet(c) {
			last = c
		}
	}
	return last, allowedList(t, "/proc/self/status")
}

func TestPinnedServerRunsOnlyOnItsCPUs(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	last, _ := lastCPU(t)
	l, err := ParseCPUList(fmt.Sprint(last))
	if err != nil {
		t.Fatal(err)
	}
	// Given a no-op server started pinned to one CPU
	p, err := StartProcess(Spec{Name: "pinned", Argv: l.pinArgv([]string{self, CmdServeNoop}), Env: ServerEnv(), ReadyMsg: ReadyMessage}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	// Then every thread of the process it started (the pid whose CPU time is read) may run
	// only there
	pid := p.cmd.Process.Pid
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	if len(tasks) < 2 {
		t.Fatalf("%d threads: not a Go server", len(tasks))
	}
	for _, task := range tasks {
		if got := allowedList(t, fmt.Sprintf("/proc/%d/task/%s/status", pid, task.Name())); got != fmt.Sprint(last) {
			t.Errorf("thread %s may run on %s, want %d", task.Name(), got, last)
		}
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err != nil || !strings.Contains(string(b), CmdServeNoop) {
		t.Errorf("pid %d runs %q (%v), not the server", pid, b, err)
	}
}

func TestPinMovesEveryThreadAndUnpinRestores(t *testing.T) {
	last, all := lastCPU(t)
	l, err := ParseCPUList(fmt.Sprint(last))
	if err != nil {
		t.Fatal(err)
	}
	procs := runtime.GOMAXPROCS(0)
	threads := func() map[string]string {
		got := map[string]string{}
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			t.Fatal(err)
		}
		for _, task := range tasks {
			if b, err := os.ReadFile("/proc/self/task/" + task.Name() + "/status"); err == nil && strings.Contains(string(b), "Cpus_allowed_list") {
				got[task.Name()] = allowedList(t, "/proc/self/task/"+task.Name()+"/status")
			}
		}
		return got
	}
	unpin, err := l.pin()
	if err != nil {
		t.Fatal(err)
	}
	for tid, cpus := range threads() {
		if cpus != fmt.Sprint(last) {
			t.Errorf("pinned: thread %s may run on %s", tid, cpus)
		}
	}
	if runtime.GOMAXPROCS(0) != 1 {
		t.Errorf("pinned to one CPU with GOMAXPROCS %d", runtime.GOMAXPROCS(0))
	}
	unpin()
	for tid, cpus := range threads() {
		if cpus != all {
			t.Errorf("unpinned: thread %s may run on %s, want %s", tid, cpus, all)
		}
	}
	if runtime.GOMAXPROCS(0) != procs {
		t.Errorf("GOMAXPROCS %d after unpin, want %d", runtime.GOMAXPROCS(0), procs)
	}
}
