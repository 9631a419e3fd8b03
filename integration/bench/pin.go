package bench

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// CPUList is a set of CPUs written as taskset and /proc write them: "1", "0,2", "0-3".
type CPUList struct {
	text string
	set  unix.CPUSet
}

// ParseCPUList reads a CPU list; the empty string is the empty list (nothing pinned).
func ParseCPUList(s string) (CPUList, error) {
	l := CPUList{text: strings.TrimSpace(s)}
	if l.text == "" {
		return l, nil
	}
	for part := range strings.SplitSeq(l.text, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, errA := strconv.Atoi(lo)
		b := a
		var errB error
		if isRange {
			b, errB = strconv.Atoi(hi)
		}
		if errA != nil || errB != nil || a < 0 || b < a || b >= 1024 {
			return CPUList{}, fmt.Errorf("%q is not a list of CPUs like 1, 0,2 or 0-3", s)
		}
		for c := a; c <= b; c++ {
			l.set.Set(c)
		}
	}
	return l, nil
}

// Empty reports whether the list pins nothing.
func (l CPUList) Empty() bool { return l.set.Count() == 0 }

// String is the list as it was written.
func (l CPUList) String() string { return l.text }

// overlaps reports whether l and o share a CPU.
func (l CPUList) overlaps(o CPUList) bool {
	for i := range l.set {
		if l.set[i]&o.set[i] != 0 {
			return true
		}
	}
	return false
}

// check returns an error when a CPU of l is not one this process may run on.
func (l CPUList) check() error {
	var allowed unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		return fmt.Errorf("reading this process's CPUs: %w", err)
	}
	for c := range 1024 {
		if l.set.IsSet(c) && !allowed.IsSet(c) {
			return fmt.Errorf("CPU %d of %q is not available here", c, l.text)
		}
	}
	return nil
}

// pinArgv returns argv run under taskset on the CPUs of l, or argv itself when l is empty.
// taskset sets the affinity before it executes the program, so every thread the program
// starts inherits it, and the process keeps taskset's pid (what /proc/<pid>/stat is read for).
func (l CPUList) pinArgv(argv []string) []string {
	if l.Empty() {
		return argv
	}
	return append([]string{"taskset", "--cpu-list", l.text}, argv...)
}

// pin moves every thread of this process to the CPUs of l and sizes GOMAXPROCS to them. The
// function it returns puts both back as they were; it may be called more than once. With l
// empty, nothing changes.
func (l CPUList) pin() (unpin func(), err error) {
	if l.Empty() {
		return func() {}, nil
	}
	var before unix.CPUSet
	if err := unix.SchedGetaffinity(0, &before); err != nil {
		return nil, fmt.Errorf("reading this process's CPUs: %w", err)
	}
	procs := runtime.GOMAXPROCS(0)
	if err := setThreads(&l.set); err != nil {
		return nil, fmt.Errorf("pinning this process to CPUs %s: %w", l.text, err)
	}
	runtime.GOMAXPROCS(l.set.Count())
	return func() {
		// Best effort: a thread that cannot be moved back only keeps the load generator's CPUs.
		_ = setThreads(&before)
		runtime.GOMAXPROCS(procs)
	}, nil
}

// setThreads sets the affinity of every thread of this process. Threads the runtime starts
// meanwhile inherit the affinity of the thread that starts them, so the threads are walked
// until a pass finds none left to move.
func setThreads(set *unix.CPUSet) error {
	for range 10 {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return fmt.Errorf("listing the threads: %w", err)
		}
		moved := 0
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			var cur unix.CPUSet
			if err := unix.SchedGetaffinity(tid, &cur); err != nil || cur == *set {
				continue // exited, or already there
			}
			if err := unix.SchedSetaffinity(tid, set); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("thread %d: %w", tid, err)
			}
			moved++
		}
		if moved == 0 {
			return nil
		}
	}
	return errors.New("threads kept appearing")
}

// checkPinning validates the CPU lists of cfg: each available here, the two disjoint, and
// taskset on PATH when the servers are pinned.
func (c Config) checkPinning() error {
	var errs []error
	for _, l := range []struct {
		flag string
		list CPUList
	}{{"server CPUs", c.ServerCPUs}, {"load-generator CPUs", c.LoadCPUs}} {
		if l.list.Empty() {
			continue
		}
		if err := l.list.check(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", l.flag, err))
		}
	}
	if c.ServerCPUs.overlaps(c.LoadCPUs) {
		errs = append(errs, fmt.Errorf("server CPUs %s and load-generator CPUs %s overlap: pinning is to keep them apart", c.ServerCPUs, c.LoadCPUs))
	}
	if !c.ServerCPUs.Empty() {
		if _, err := exec.LookPath("taskset"); err != nil {
			errs = append(errs, errors.New("pinning the servers needs taskset (util-linux) on PATH"))
		}
	}
	return errors.Join(errs...)
}
