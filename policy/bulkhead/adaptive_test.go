package bulkhead_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
)

// TestAdaptiveLimit: a limit set at run time replaces the configured one for admission,
// queueing and the predicted wait; lowering it revokes nothing, raising it admits waiters in
// priority order, and configuration changes leave it in force.
func TestAdaptiveLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &bulkhead.Scheduler{}
		l := bulkhead.Limits{MaxConcurrent: 10, QueueDepth: 10}
		c := bulkhead.NewCompartment("provider/openai", l)
		s.SetAdaptiveLimit(c, 2)
		if st := s.Stats(c); st.Limits.MaxConcurrent != 2 || !st.Adaptive {
			t.Fatalf("stats %+v, want the adaptive limit 2 in force", st)
		}
		// Teach it that a slot is held 4s.
		h, _ := acquire(t, s, context.Background(), want(1, "a", 0), c)
		t0 := time.Now()
		time.Sleep(4 * time.Second)
		s.Release([]*bulkhead.Compartment{c}, h, t0, time.Now())
		a, _ := acquire(t, s, context.Background(), want(1, "a", 0), c)
		b, _ := acquire(t, s, context.Background(), want(1, "a", 0), c)
		if c.Saturations() == 0 {
			t.Error("taking the last slot did not count as a saturation")
		}
		// The predicted wait divides by the limit in force: (0+1)×4s/2 = 2s.
		_, err := acquire(t, s, context.Background(), want(1, "x", time.Second), c)
		if r := refusal(t, err); r.Cause != bulkhead.CauseWaitTooLong || r.RetryAfter != 2*time.Second {
			t.Fatalf("refusal %+v, want predicted_wait_too_long after 2s", r)
		}
		// Two waiters, the later one of higher priority.
		order := make(chan string, 2)
		wait := func(name string, prio int64) {
			go func() {
				w := want(1, name, time.Minute)
				w.Priority = prio
				held := make([]int64, 1)
				if err := s.Acquire(context.Background(), []*bulkhead.Compartment{c}, held, w, nil); err != nil {
					t.Errorf("%s refused: %v", name, err)
					return
				}
				order <- name
			}()
			synctest.Wait()
		}
		wait("low", 0)
		wait("high", 5)
		// A configuration change leaves the learned limit in force.
		s.SetLimits(c, bulkhead.Limits{MaxConcurrent: 10, QueueDepth: 20})
		synctest.Wait()
		if st := s.Stats(c); st.Limits.MaxConcurrent != 2 || st.InFlight != 2 || st.Queued != 2 {
			t.Fatalf("after SetLimits: %+v, want limit 2 with 2 in flight and 2 waiting", st)
		}
		// Raised by one: the higher priority goes first.
		s.SetAdaptiveLimit(c, 3)
		synctest.Wait()
		if got := <-order; got != "high" {
			t.Errorf("%s admitted first on a raise, want high", got)
		}
		// Lowered below use: the four in flight keep their slots; nothing new comes in.
		s.SetAdaptiveLimit(c, 1)
		release(s, a, c)
		synctest.Wait()
		if st := s.Stats(c); st.InFlight != 2 || st.Queued != 1 {
			t.Fatalf("after lowering to 1 and one release: %+v, want 2 in flight, 1 waiting", st)
		}
		release(s, b, c)
		// Back to the configured limit: the waiter gets in.
		s.SetAdaptiveLimit(c, 0)
		synctest.Wait()
		if got := <-order; got != "low" {
			t.Errorf("got %s", got)
		}
		if st := s.Stats(c); st.Limits.MaxConcurrent != 10 || st.Adaptive {
			t.Errorf("stats %+v, want the configured 10 back", st)
		}
	})
}

// TestAdaptiveLimitIsPerReplica: slots other replicas hold (cluster mode) count against a fixed
// limit but not against an adaptive one, which each replica learns for itself.
func TestAdaptiveLimitIsPerReplica(t *testing.T) {
	s := &bulkhead.Scheduler{}
	c := bulkhead.NewCompartment("provider/openai", bulkhead.Limits{MaxConcurrent: 4, QueueDepth: 10})
	s.SetRemote(c, 4, 0)
	if _, err := acquire(t, s, context.Background(), want(1, "a", 0), c); err == nil {
		t.Fatal("admitted with the fixed limit taken by other replicas")
	}
	s.SetAdaptiveLimit(c, 2)
	for i := range 2 {
		if _, err := acquire(t, s, context.Background(), want(1, "a", 0), c); err != nil {
			t.Fatalf("request %d refused under the adaptive limit 2: %v", i+1, err)
		}
	}
	if _, err := acquire(t, s, context.Background(), want(1, "a", 0), c); err == nil {
		t.Fatal("admitted beyond the adaptive limit")
	}
}
