package policy

import (
	"sync"
	"testing"
	"time"
)

// TestLogLimit: one line per second gets through, the next one says how many were held back,
// and concurrent callers let exactly one line through per interval.
func TestLogLimit(t *testing.T) {
	var l logLimit
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	if ok, n := l.allow(t0); !ok || n != 0 {
		t.Fatalf("first line: %v %d", ok, n)
	}
	for i := 1; i <= 5; i++ {
		if ok, _ := l.allow(t0.Add(time.Duration(i) * 100 * time.Millisecond)); ok {
			t.Fatalf("line %d within the second got through", i)
		}
	}
	if ok, n := l.allow(t0.Add(time.Second)); !ok || n != 5 {
		t.Fatalf("line a second later: %v, suppressed %d, want 5", ok, n)
	}

	var c logLimit
	var wg sync.WaitGroup
	var mu sync.Mutex
	passed := 0
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if ok, _ := c.allow(t0); ok {
				mu.Lock()
				passed++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if passed != 1 {
		t.Fatalf("%d of 64 concurrent lines got through, want 1", passed)
	}
	if ok, n := c.allow(t0.Add(time.Second)); !ok || n != 63 {
		t.Fatalf("after the storm: %v, suppressed %d, want 63", ok, n)
	}
}
