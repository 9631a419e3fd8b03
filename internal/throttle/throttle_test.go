package throttle_test

import (
	"sync"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/internal/throttle"
)

// TestGate: one line per interval gets through, the next one says how many were held back,
// and concurrent callers let exactly one line through per interval.
func TestGate(t *testing.T) {
	var l throttle.Gate
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	if ok, n := l.Allow(t0, time.Second); !ok || n != 0 {
		t.Fatalf("first line: %v %d", ok, n)
	}
	for i := 1; i <= 5; i++ {
		if ok, _ := l.Allow(t0.Add(time.Duration(i)*100*time.Millisecond), time.Second); ok {
			t.Fatalf("line %d within the second got through", i)
		}
	}
	if ok, n := l.Allow(t0.Add(time.Second), time.Second); !ok || n != 5 {
		t.Fatalf("line a second later: %v, suppressed %d, want 5", ok, n)
	}
	// A clock that steps back holds lines back.
	if ok, _ := l.Allow(t0, time.Second); ok {
		t.Fatal("a line at an earlier time got through")
	}

	var c throttle.Gate
	var wg sync.WaitGroup
	var mu sync.Mutex
	passed := 0
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if ok, _ := c.Allow(t0, time.Minute); ok {
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
	if ok, n := c.Allow(t0.Add(time.Minute), time.Minute); !ok || n != 63 {
		t.Fatalf("after the storm: %v, suppressed %d, want 63", ok, n)
	}
	if ok, _ := c.Allow(t0.Add(2*time.Minute-1), time.Minute); ok {
		t.Fatal("a line before the minute was over got through")
	}
}
