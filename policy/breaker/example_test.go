package breaker_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
)

// The two steps of a call: Acquire when the request is admitted, Record when the response
// headers arrive (or Release if the request never reaches the provider).
func Example() {
	cfg := breaker.Defaults()
	cfg.WindowSize = 10
	cfg.MinimumCalls = 5
	cfg.SlowCallDuration = 2 * time.Second // time to first byte
	cfg.WaitInOpen = 30 * time.Second

	start := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	b, err := breaker.New("openai", cfg, start, breaker.WithListener(func(e breaker.Event) {
		fmt.Printf("%s: %s -> %s (%s, failure rate %.0f%%)\n", e.Name, e.From, e.To, e.Reason, e.FailureRate)
	}))
	if err != nil {
		fmt.Println(err)
		return
	}

	now := start
	for range 5 {
		p, err := b.Acquire(now)
		if err != nil {
			break
		}
		// ... the request goes upstream; a 503 comes back after 300ms ...
		b.Record(p, breaker.Failure, 300*time.Millisecond, now)
		now = now.Add(time.Second)
	}

	if _, err := b.Acquire(now); errors.Is(err, breaker.ErrOpen) {
		fmt.Printf("refused: %v, retry after %v\n", err, b.RemainingOpen(now))
	}
	// Output:
	// openai: CLOSED -> OPEN (failure_rate, failure rate 100%)
	// refused: circuit breaker is open, retry after 29s
}

// Validate reports every problem at once, keyed by the policy-file names.
func ExampleConfig_Validate() {
	cfg := breaker.Defaults()
	cfg.WindowSize = 20
	cfg.MinimumCalls = 50
	cfg.FailureRateThreshold = 0
	fmt.Println(cfg.Validate())
	// Output:
	// minimum_calls: is 50 but the COUNT_BASED sliding_window_size is 20: the window never holds more than 20 calls, so the rates would never be evaluated and the breaker could never open (lower minimum_calls or enlarge the window)
	// failure_rate_threshold: is 0; must be greater than 0 and at most 100 (percent): at 0 the breaker would open on its first evaluation even without failures, and above 100 the failure rate could never reach it
}
