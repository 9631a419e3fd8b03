package main

import (
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
)

// heapGoal is the heap size at which the garbage collector starts its next cycle.
func heapGoal() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/goal:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// rss is this process's resident memory.
func rss(t *testing.T) int64 {
	t.Helper()
	n, err := bench.RSS(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestHeapFloorSpacesCollectionsOutWithoutTakingMemory runs in a fresh process of its own, as
// serve allocates the floor at the start of one: memory the heap has used before is zeroed
// when it is allocated again, which would make the floor resident.
func TestHeapFloorSpacesCollectionsOutWithoutTakingMemory(t *testing.T) {
	if os.Getenv("LLM_BULKHEAD_TEST_HEAP_FLOOR") != "1" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHeapFloorSpacesCollectionsOutWithoutTakingMemory$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), "LLM_BULKHEAD_TEST_HEAP_FLOOR=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS") {
			t.Fatalf("in a fresh process: %v\n%s", err, out)
		}
		return
	}
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	const floor = 256 << 20
	runtime.GC()
	before, rssBefore := heapGoal(), rss(t)
	// Given the floor
	b := app.HeapFloor(floor)
	runtime.GC()
	// Then a collection starts only once the heap has grown by about the floor more
	if got := heapGoal(); got < before+floor {
		t.Errorf("heap goal %d MiB with the floor, %d MiB without: the floor is not counted", got>>20, before>>20)
	}
	// And the floor itself is not resident
	if grew := rss(t) - rssBefore; grew > floor/8 {
		t.Errorf("resident memory grew by %d MiB for a %d MiB floor", grew>>20, floor>>20)
	}
	runtime.KeepAlive(b)
	if app.HeapFloor(0) != nil {
		t.Error("a floor of 0 allocated")
	}
}
