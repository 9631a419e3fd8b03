package app

import "github.com/llm-bulkhead/llm-bulkhead/policy/config"

// DefaultHeapFloor is the default of serve's --gc-heap-floor. Chosen by measurement (docs/benchmarks.md):
// it takes much of the garbage collector's work off each stream at a bounded memory cost.
const DefaultHeapFloor = config.Size(32 << 20)

// HeapFloor allocates n bytes of heap that hold no pointers and are never touched, and
// returns them; the caller keeps them reachable for as long as the floor should hold.
//
// The garbage collector starts a cycle when the heap has grown by GOGC percent of what the
// last cycle found live. Each stream leaves a few tens of KiB of garbage (most of it gRPC's),
// and the server's live heap is small, so with Go's defaults it collects every few hundred
// streams and marks the whole live heap each time, a cost per stream that grows with the
// policy's size. Counted as live, the floor spaces the cycles out (a cycle every n bytes
// allocated, at the default GOGC, instead of every live-heap's worth) without adding to the
// marking: a block without pointers is marked in one step. Its pages are never written, so
// they take address space, not memory; what the process does hold more is the garbage that
// now waits longer for a cycle, at most about n bytes. The floor counts towards GOMEMLIMIT.
//
// One case would make the floor resident: when the block starts in pages the heap has used
// before, the runtime zeroes all of it as it allocates it. So its pages are handed back to the
// system at once (on Linux); they read as zeros again, which is what the block holds.
func HeapFloor(n config.Size) []byte {
	if n <= 0 {
		return nil
	}
	b := make([]byte, n)
	release(b)
	return b
}
