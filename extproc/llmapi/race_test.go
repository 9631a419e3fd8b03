//go:build race

package llmapi

// raceEnabled: under the race detector sync.Pool drops a quarter of what is
// put back, so counts of allocations that pooling avoids do not hold.
const raceEnabled = true
