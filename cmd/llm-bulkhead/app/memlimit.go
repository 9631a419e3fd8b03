package app

import (
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"

	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
)

// memoryLimit returns the process's memory limit in bytes and where it was found: GOMEMLIMIT
// (the Go runtime's limit, when the variable sets one), else the limit of the process's memory
// cgroup (a container's limit), else 0 and "none".
func memoryLimit() (int64, string) {
	if _, set := os.LookupEnv("GOMEMLIMIT"); set {
		if l := debug.SetMemoryLimit(-1); l > 0 && l < math.MaxInt64 {
			return l, "GOMEMLIMIT"
		}
	}
	if l := cgroupMemoryLimit("/proc/self/cgroup", "/sys/fs/cgroup"); l > 0 {
		return l, "cgroup"
	}
	return 0, "none"
}

// goMemoryShare is the share of a container's memory limit given to the Go runtime as its
// memory limit when GOMEMLIMIT does not set one: the rest is room for what the runtime does not
// count and for the moments it cannot collect fast enough.
const goMemoryShare = 0.9

// LimitGoMemory gives the Go runtime a memory limit of 90 % of the process's memory cgroup limit
// when GOMEMLIMIT does not set one, so that the garbage collector works harder before the
// container is killed rather than never; it returns the limit set, 0 when it set none. The
// server calls it at start; a program embedding the server decides for itself.
func LimitGoMemory() int64 {
	if _, set := os.LookupEnv("GOMEMLIMIT"); set {
		return 0
	}
	l := cgroupMemoryLimit("/proc/self/cgroup", "/sys/fs/cgroup")
	if l <= 0 {
		return 0
	}
	soft := int64(float64(l) * goMemoryShare)
	debug.SetMemoryLimit(soft)
	return soft
}

// noCgroupLimit: a cgroup v1 limit at or above this is the kernel's "unlimited"
// (9223372036854771712, the largest page-aligned int64).
const noCgroupLimit = 1 << 62

// cgroupMemoryLimit returns the memory limit of the cgroup the file self (/proc/self/cgroup)
// names, with cgroup file systems mounted at root: cgroup v2's memory.max, or v1's
// memory.limit_in_bytes. Each is looked for under the process's cgroup path, then at the root of
// the hierarchy (where a container with its own cgroup namespace sees its own). 0 when there is
// no limit or none can be read.
func cgroupMemoryLimit(self, root string) int64 {
	b, err := files.Read(self, 64<<10)
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		if len(parts) != 3 {
			continue
		}
		var dir, file string
		switch {
		case parts[0] == "0" && parts[1] == "": // cgroup v2, the unified hierarchy
			dir, file = root, "memory.max"
		case hasController(parts[1], "memory"): // cgroup v1
			dir, file = filepath.Join(root, "memory"), "memory.limit_in_bytes"
		default:
			continue
		}
		for _, path := range []string{filepath.Join(dir, parts[2], file), filepath.Join(dir, file)} {
			if l, ok := readLimit(path); ok {
				return l
			}
		}
	}
	return 0
}

func hasController(list, name string) bool {
	for c := range strings.SplitSeq(list, ",") {
		if c == name {
			return true
		}
	}
	return false
}

// readLimit reads a cgroup memory limit file: ok when it was read, the limit 0 for none.
func readLimit(path string) (int64, bool) {
	b, err := files.Read(path, files.MaxSmall)
	if err != nil {
		return 0, false
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 0, true
	}
	l, err := strconv.ParseInt(s, 10, 64)
	if err != nil || l <= 0 {
		return 0, false
	}
	if l >= noCgroupLimit {
		return 0, true
	}
	return l, true
}

// goMemoryLimit returns the Go runtime's memory limit, 0 when it has none.
func goMemoryLimit() int64 {
	if l := debug.SetMemoryLimit(-1); l < math.MaxInt64 {
		return l
	}
	return 0
}
