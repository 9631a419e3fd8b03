package bulkhead_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func want(tokens int64, tenant string, wait time.Duration) bulkhead.Want {
	return bulkhead.Want{Tokens: tokens, Tenant: tenant, MaxWait: wait, Now: time.Now()}
}

// acquire is Acquire for a single compartment, returning the held slice for Release.
func acquire(t *testing.T, s *bulkhead.Scheduler, ctx context.Context, w bulkhead.Want, set ...*bulkhead.Compartment) ([]int64, error) {
	t.Helper()
	held := make([]int64, len(set))
	return held, s.Acquire(ctx, set, held, w, nil)
}

func release(s *bulkhead.Scheduler, held []int64, set ...*bulkhead.Compartment) {
	s.Release(set, held, time.Now(), time.Now())
}

func refusal(t *testing.T, err error) *bulkhead.Refusal {
	t.Helper()
	var r *bulkhead.Refusal
	if !errors.As(err, &r) {
		t.Fatalf("err = %v, want a *Refusal", err)
	}
	return r
}

func TestTwentyFirstChatIsRefused(t *testing.T) {
	// Given a chat compartment of 20 that may not queue
	s := &bulkhead.Scheduler{}
	chat := bulkhead.NewCompartment("feature/chat", bulkhead.Limits{MaxConcurrent: 20, QueueDepth: 200})
	var helds [][]int64
	for i := 0; i < 20; i++ {
		held, err := acquire(t, s, context.Background(), want(1, "t", 0), chat)
		if err != nil {
			t.Fatalf("request %d refused: %v", i+1, err)
		}
		helds = append(helds, held)
	}
	// When the 21st arrives
	_, err := acquire(t, s, context.Background(), want(1, "t", 0), chat)
	// Then it is refused as full, naming the compartment
	r := refusal(t, err)
	if r.Cause != bulkhead.CauseFull || r.Compartment != chat || !errors.Is(err, bulkhead.ErrFull) {
		t.Fatalf("refusal = %+v", r)
	}
	// And when one finishes, the next is admitted
	release(s, helds[0], chat)
	if _, err := acquire(t, s, context.Background(), want(1, "t", 0), chat); err != nil {
		t.Fatalf("after a release: %v", err)
	}
	if st := s.Stats(chat); st.InFlight != 20 || st.Admitted != 21 || st.Refused != 1 {
		t.Errorf("stats = %+v", st)
	}
}

func TestWaiterAdmittedWhenSlotFrees(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &bulkhead.Scheduler{}
		c := bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: 1, QueueDepth: 10})
		first, _ := acquire(t, s, context.Background(), want(1, "a", 0), c)
		done := make(chan error)
		queued := make(chan time.Duration, 1)
		go func() {
			held := make([]int64, 1)
			done <- s.Acquire(context.Background(), []*bulkhead.Compartment{c}, held, want(1, "b", 5*time.Second), func(d time.Duration) { queued <- d })
		}()
		synctest.Wait()
		if d := <-queued; d != 5*time.Second {
			t.Fatalf("onQueue got %s, want the max wait 5s", d)
		}
		if st := s.Stats(c); st.Queued != 1 {
			t.Fatalf("queued = %d", st.Queued)
		}
		time.Sleep(2 * time.Second)
		release(s, first, c)
		if err := <-done; err != nil {
			t.Fatalf("waiter refused: %v", err)
		}
		if st := s.Stats(c); st.InFlight != 1 || st.Queued != 0 {
			t.Errorf("stats = %+v", st)
		}
	})
}

func TestWaiterTimesOutHoldingNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &bulkhead.Scheduler{}
		c := bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: 1, QueueDepth: 10})
		_, _ = acquire(t, s, context.Background(), want(1, "a", 0), c)
		start := time.Now()
		_, err := acquire(t, s, context.Background(), want(1, "b", 300*time.Millisecond), c)
		if r := refusal(t, err); r.Cause != bulkhead.CauseTimedOut {
			t.Fatalf("cause = %s", r.Cause)
		}
		if waited := time.Since(start); waited != 300*time.Millisecond {
			t.Errorf("waited %s, want exactly max_wait 300ms", waited)
		}
		if st := s.Stats(c); st.InFlight != 1 || st.Queued != 0 || st.TimedOutInQueue != 1 {
			t.Errorf("stats = %+v", st)
		}
	})
}

func TestCancelledWaiterLeavesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &bulkhead.Scheduler{}
		c := bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: 1, QueueDepth: 10})
		first, _ := acquire(t, s, context.Background(), want(1, "a", 0), c)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error)
		go func() {
			held := make([]int64, 1)
			done <- s.Acquire(ctx, []*bulkhead.Compartment{c}, held, want(1, "b", 5*time.Second), nil)
		}()
		synctest.Wait()
		cancel()
		err := <-done
		if r := refusal(t, err); r.Cause != bulkhead.CauseCancelled || !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v", err)
		}
		if st := s.Stats(c); st.Queued != 0 || st.InFlight != 1 {
			t.Fatalf("the cancelled waiter still counts: %+v", st)
		}
		// The slot that frees later goes to nobody: the waiter is gone.
		release(s, first, c)
		if st := s.Stats(c); st.InFlight != 0 {
			t.Errorf("in flight = %d after release", st.InFlight)
		}
	})
}

func TestQueueDepthAndPredictedWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &bulkhead.Scheduler{}
		c := bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: 2, QueueDepth: 1})
		// Teach the compartment that a slot is held 4s.
		h, _ := acquire(t, s, context.Background(), want(1, "a", 0), c)
		t0 := time.Now()
		time.Sleep(4 * time.Second)
		s.Release([]*bulkhead.Compartment{c}, h, t0, time.Now())
		a, _ := acquire(t, s, context.Background(), want(1, "a", 0), c)
		b, _ := acquire(t, s, context.Background(), want(1, "a", 0), c)

		// A request that may wait 1s while the predicted wait is (0+1)×4s/2 = 2s is refused at once.
		start := time.Now()
		_, err := acquire(t, s, context.Background(), want(1, "x", time.Second), c)
		r := refusal(t, err)
		if r.Cause != bulkhead.CauseWaitTooLong || r.RetryAfter != 2*time.Second || time.Since(start) != 0 {
			t.Fatalf("refusal = %+v after %s, want predicted_wait_too_long with retry-after 2s, at once", r, time.Since(start))
		}
		// One waiter fits the queue; the next finds it full.
		go func() { _, _ = acquire(t, s, context.Background(), want(1, "y", 10*time.Second), c) }()
		synctest.Wait()
		_, err = acquire(t, s, context.Background(), want(1, "z", 10*time.Second), c)
		if r := refusal(t, err); r.Cause != bulkhead.CauseQueueFull {
			t.Fatalf("cause = %s, want queue_full", r.Cause)
		}
		release(s, a, c)
		synctest.Wait()
		release(s, b, c)
	})
}

func TestAllOrNothingAcrossCompartments(t *testing.T) {
	s := &bulkhead.Scheduler{}
	feature := bulkhead.NewCompartment("feature/chat", bulkhead.Limits{MaxConcurrent: 10, QueueDepth: 10})
	provider := bulkhead.NewCompartment("provider/qwen", bulkhead.Limits{MaxConcurrent: 1, QueueDepth: 10})
	_, _ = acquire(t, s, context.Background(), want(1, "a", 0), provider)
	_, err := acquire(t, s, context.Background(), want(1, "a", 0), feature, provider)
	if r := refusal(t, err); r.Compartment != provider {
		t.Fatalf("refused by %s, want provider/qwen", r.Compartment.Name())
	}
	if st := s.Stats(feature); st.InFlight != 0 {
		t.Errorf("feature kept a slot of a refused request: %+v", st)
	}
}

func TestInflightTokens(t *testing.T) {
	s := &bulkhead.Scheduler{}
	c := bulkhead.NewCompartment("c", bulkhead.Limits{MaxInflightTokens: 10_000, QueueDepth: 10})
	// An oversized request fits an empty compartment and holds the whole limit.
	big, err := acquire(t, s, context.Background(), want(100_000, "a", 0), c)
	if err != nil || big[0] != 10_000 {
		t.Fatalf("oversized request: held %v, err %v", big, err)
	}
	if _, err := acquire(t, s, context.Background(), want(1, "a", 0), c); err == nil {
		t.Fatal("a full token compartment admitted more")
	}
	release(s, big, c)
	small, _ := acquire(t, s, context.Background(), want(6000, "a", 0), c)
	if _, err := acquire(t, s, context.Background(), want(5000, "a", 0), c); err == nil {
		t.Fatal("6000 + 5000 > 10000 admitted")
	}
	if _, err := acquire(t, s, context.Background(), want(4000, "a", 0), c); err != nil {
		t.Fatalf("6000 + 4000 = 10000 refused: %v", err)
	}
	_ = small
}

func TestShadowNeverRefuses(t *testing.T) {
	s := &bulkhead.Scheduler{}
	c := bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: 2, Shadow: true, QueueDepth: 10})
	for i := 0; i < 5; i++ {
		if _, err := acquire(t, s, context.Background(), want(1, "a", 0), c); err != nil {
			t.Fatalf("shadow compartment refused: %v", err)
		}
	}
	if st := s.Stats(c); st.InFlight != 5 || st.ShadowRefusals != 3 {
		t.Errorf("stats = %+v, want 5 in flight and 3 shadow refusals", st)
	}
}

func TestLiveResize(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &bulkhead.Scheduler{}
		c := bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: 4, QueueDepth: 10})
		var helds [][]int64
		for i := 0; i < 4; i++ {
			h, _ := acquire(t, s, context.Background(), want(1, "a", 0), c)
			helds = append(helds, h)
		}
		// Lowered below use: nothing new gets in until use drops below the new limit.
		s.SetLimits(c, bulkhead.Limits{MaxConcurrent: 2, QueueDepth: 10})
		release(s, helds[0], c)
		release(s, helds[1], c)
		if _, err := acquire(t, s, context.Background(), want(1, "a", 0), c); err == nil {
			t.Fatal("admitted at 2 in flight with a limit of 2")
		}
		release(s, helds[2], c)
		h, err := acquire(t, s, context.Background(), want(1, "a", 0), c)
		if err != nil {
			t.Fatalf("refused at 1 in flight with a limit of 2: %v", err)
		}
		_ = h
		// Raised: waiters are let in at once.
		done := make(chan error, 2)
		for i := 0; i < 2; i++ {
			go func() { _, err := acquire(t, s, context.Background(), want(1, "w", time.Minute), c); done <- err }()
		}
		synctest.Wait()
		s.SetLimits(c, bulkhead.Limits{MaxConcurrent: 4, QueueDepth: 10})
		for i := 0; i < 2; i++ {
			if err := <-done; err != nil {
				t.Fatalf("waiter not woken by a raise: %v", err)
			}
		}
	})
}

func TestFairAcrossTenants(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// Given one slot, held, and tenant "bulk" queueing 1000 requests before tenant "one" queues 1
		s := &bulkhead.Scheduler{}
		c := bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: 1, QueueDepth: 2000})
		holder, _ := acquire(t, s, context.Background(), want(1000, "bulk", 0), c)
		order := make(chan string, 1001)
		var wg sync.WaitGroup
		start := func(tenant string) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				held := make([]int64, 1)
				if err := s.Acquire(context.Background(), []*bulkhead.Compartment{c}, held, want(1000, tenant, time.Hour), nil); err != nil {
					t.Errorf("refused: %v", err)
					return
				}
				order <- tenant
				time.Sleep(time.Second)
				release(s, held, c)
			}()
			synctest.Wait()
		}
		for i := 0; i < 1000; i++ {
			start("bulk")
		}
		start("one")
		// When the slot is passed on one request at a time
		release(s, holder, c)
		wg.Wait()
		close(order)
		// Then "one" is served within the first few grants, not after 1000
		pos := 0
		for tenant := range order {
			pos++
			if tenant == "one" {
				break
			}
		}
		// Deficit round-robin by tokens: "bulk" spends one quantum (4096 tokens = 4 requests of
		// 1000) before the turn passes to "one".
		if pos > 5 {
			t.Errorf(`tenant "one" was served at position %d of 1001; fair queueing should serve it in the first round`, pos)
		}
	})
}

func TestPoolBorrowingAndReturn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &bulkhead.Scheduler{}
		chat := bulkhead.NewCompartment("feature/chat", bulkhead.Limits{QueueDepth: 100, Priority: 10})
		batch := bulkhead.NewCompartment("feature/batch", bulkhead.Limits{QueueDepth: 100, Priority: 1})
		s.SetPools([]bulkhead.PoolSpec{{Name: "llm", Capacity: 10, Members: []bulkhead.PoolMember{
			{Compartment: chat, Guaranteed: 6, Max: 10}, {Compartment: batch, Guaranteed: 4, Max: 6},
		}}})
		// Chat borrows batch's idle capacity up to the whole pool.
		var chats [][]int64
		for i := 0; i < 10; i++ {
			h, err := acquire(t, s, context.Background(), want(1, "a", 0), chat)
			if err != nil {
				t.Fatalf("chat %d could not borrow idle capacity: %v", i+1, err)
			}
			chats = append(chats, h)
		}
		// Batch, below its guarantee, waits for borrowed capacity to come back (no preemption)...
		batchDone := make(chan error, 1)
		go func() {
			_, err := acquire(t, s, context.Background(), want(1, "b", time.Minute), batch)
			batchDone <- err
		}()
		synctest.Wait()
		// ...while chat, at its max, queues too.
		chatDone := make(chan error, 1)
		go func() {
			_, err := acquire(t, s, context.Background(), want(1, "a", time.Minute), chat)
			chatDone <- err
		}()
		synctest.Wait()
		// When one chat finishes, the freed capacity goes to batch's guarantee, not back to chat.
		release(s, chats[0], chat)
		synctest.Wait()
		select {
		case err := <-batchDone:
			if err != nil {
				t.Fatalf("batch refused: %v", err)
			}
		default:
			t.Fatal("freed capacity was not given to the member below its guarantee")
		}
		select {
		case <-chatDone:
			t.Fatal("borrowed capacity was lent again while a guaranteed owner waited")
		default:
		}
		release(s, chats[1], chat)
		if err := <-chatDone; err != nil {
			t.Fatalf("chat waiter refused: %v", err)
		}
		if p := s.PoolStats()[0]; p.InFlight != 10 {
			t.Errorf("pool in flight = %d, want 10", p.InFlight)
		}
	})
}

func TestRandomisedInvariants(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &bulkhead.Scheduler{}
		comps := []*bulkhead.Compartment{
			bulkhead.NewCompartment("a", bulkhead.Limits{MaxConcurrent: 3, QueueDepth: 50}),
			bulkhead.NewCompartment("b", bulkhead.Limits{MaxConcurrent: 5, MaxInflightTokens: 20_000, QueueDepth: 50}),
			bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: 2, QueueDepth: 50}),
			bulkhead.NewCompartment("p1", bulkhead.Limits{QueueDepth: 50, Priority: 5}),
			bulkhead.NewCompartment("p2", bulkhead.Limits{QueueDepth: 50}),
		}
		s.SetPools([]bulkhead.PoolSpec{{Name: "pool", Capacity: 4, Members: []bulkhead.PoolMember{
			{Compartment: comps[3], Guaranteed: 2, Max: 4}, {Compartment: comps[4], Guaranteed: 2, Max: 3},
		}}})
		var violations atomic.Int64
		s.SetCheckTake(func(set []*bulkhead.Compartment) {
			for _, c := range set {
				if lim := c.LimitLocked(); lim > 0 && c.InFlightLocked() > lim {
					violations.Add(1)
				}
				if in, capacity := c.PoolInFlightLocked(); in > capacity {
					violations.Add(1)
				}
			}
		})
		rng := rand.New(rand.NewPCG(1, 2))
		var granted, refused, late atomic.Int64
		var wg sync.WaitGroup
		for i := 0; i < 2000; i++ {
			// A random, canonically ordered subset of compartments.
			// Pool members are instances of one family, so a request is in at most one of them.
			var set []*bulkhead.Compartment
			for _, c := range comps[:3] {
				if rng.IntN(3) == 0 {
					set = append(set, c)
				}
			}
			if m := rng.IntN(3); m < 2 {
				set = append(set, comps[3+m])
			}
			if len(set) == 0 {
				set = comps[:1]
			}
			tokens := int64(rng.IntN(8000) + 1)
			wait := time.Duration(rng.IntN(3)) * 200 * time.Millisecond
			hold := time.Duration(rng.IntN(500)+1) * time.Millisecond
			cancelAfter := time.Duration(rng.IntN(400)) * time.Millisecond
			tenant := fmt.Sprintf("t%d", rng.IntN(4))
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), cancelAfter+time.Millisecond)
				defer cancel()
				held := make([]int64, len(set))
				w := bulkhead.Want{Tokens: tokens, Tenant: tenant, MaxWait: wait, Now: time.Now()}
				began := time.Now()
				err := s.Acquire(ctx, set, held, w, nil)
				if waited := time.Since(began); waited > wait {
					late.Add(1) // every waiter is answered by its deadline
				}
				if err != nil {
					refused.Add(1)
					return
				}
				granted.Add(1)
				t0 := time.Now()
				time.Sleep(hold)
				s.Release(set, held, t0, time.Now())
			}()
			if i%50 == 0 {
				time.Sleep(100 * time.Millisecond)
			}
		}
		wg.Wait()
		if v := violations.Load(); v > 0 {
			t.Fatalf("%d grants exceeded a limit", v)
		}
		if n := late.Load(); n > 0 {
			t.Fatalf("%d waiters were answered after their max wait", n)
		}
		if granted.Load() == 0 || refused.Load() == 0 {
			t.Fatalf("granted %d, refused %d: the test did not exercise both paths", granted.Load(), refused.Load())
		}
		for _, c := range comps {
			if st := s.Stats(c); st.InFlight != 0 || st.InFlightTokens != 0 || st.Queued != 0 {
				t.Errorf("%s not back to zero: %+v", c.Name(), st)
			}
		}
		if p := s.PoolStats()[0]; p.InFlight != 0 {
			t.Errorf("pool in flight = %d", p.InFlight)
		}
	})
}

func TestRetryAfterSeconds(t *testing.T) {
	tests := []struct {
		in   time.Duration
		want int64
	}{{0, 1}, {time.Millisecond, 1}, {time.Second, 1}, {1001 * time.Millisecond, 2}, {7 * time.Second, 7}}
	for _, tt := range tests {
		if got := bulkhead.RetryAfterSeconds(tt.in); got != tt.want {
			t.Errorf("RetryAfterSeconds(%s) = %d, want %d", tt.in, got, tt.want)
		}
	}
}

func BenchmarkAcquireRelease(b *testing.B) {
	s := &bulkhead.Scheduler{}
	set := []*bulkhead.Compartment{
		bulkhead.NewCompartment("feature/chat", bulkhead.Limits{MaxConcurrent: 1 << 30, QueueDepth: 10}),
		bulkhead.NewCompartment("provider/x", bulkhead.Limits{MaxConcurrent: 1 << 30, MaxInflightTokens: 1 << 40, QueueDepth: 10}),
	}
	held := make([]int64, len(set))
	w := bulkhead.Want{Tokens: 1000, Tenant: "t", Now: epoch}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if err := s.Acquire(ctx, set, held, w, nil); err != nil {
			b.Fatal(err)
		}
		s.Release(set, held, epoch, epoch)
	}
}

// BenchmarkChanSemaphore is the baseline: a bare channel semaphore, acquire and release.
func BenchmarkChanSemaphore(b *testing.B) {
	sem := make(chan struct{}, 1<<20)
	b.ReportAllocs()
	for b.Loop() {
		sem <- struct{}{}
		<-sem
	}
}

func BenchmarkAcquireReleaseParallel(b *testing.B) {
	s := &bulkhead.Scheduler{}
	set := []*bulkhead.Compartment{bulkhead.NewCompartment("c", bulkhead.Limits{MaxConcurrent: 1 << 30, QueueDepth: 10})}
	b.SetParallelism(32) // 64 goroutines on 2 cores
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		held := make([]int64, 1)
		w := bulkhead.Want{Tokens: 1, Tenant: "t", Now: epoch}
		for pb.Next() {
			if err := s.Acquire(context.Background(), set, held, w, nil); err != nil {
				b.Error(err)
				return
			}
			s.Release(set, held, epoch, epoch)
		}
	})
}

func TestPendingSlotsKeepRoomButCountOnlyOnceConfirmed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// Given a compartment of 2 with 1 slot held by another replica
		s := &bulkhead.Scheduler{}
		c := bulkhead.NewCompartment("feature/chat", bulkhead.Limits{MaxConcurrent: 2, MaxInflightTokens: 1000, QueueDepth: 10})
		s.SetRemote(c, 1, 100)
		// When a request takes its slot provisionally, while the shared store decides
		w := want(300, "a", 0)
		w.Pending = true
		held, err := acquire(t, s, context.Background(), w, c)
		if err != nil {
			t.Fatalf("pending acquire refused: %v", err)
		}
		// Then it keeps the room (the next request queues) but is not in flight or admitted yet
		st := s.Stats(c)
		if st.InFlight != 0 || st.InFlightTokens != 0 || st.Admitted != 0 || st.Pending != 1 {
			t.Fatalf("while pending: %+v", st)
		}
		done := make(chan error, 1)
		go func() {
			_, err := acquire(t, s, context.Background(), want(1, "b", 5*time.Second), c)
			done <- err
		}()
		synctest.Wait()
		if st := s.Stats(c); st.Queued != 1 {
			t.Fatalf("a second request was not queued behind the pending slot: %+v", st)
		}
		// And totals published by the store, which do not include the pending slot yet, leave
		// the other replica's slot counted as theirs
		s.SetRemoteTotal(c, 1, 100)
		if r, rt := s.Remote(c); r != 1 || rt != 100 {
			t.Fatalf("remote = %d/%d after totals of 1/100, want 1/100", r, rt)
		}
		// When the store refuses it, the slot goes to the waiter at once
		s.Abandon([]*bulkhead.Compartment{c}, held)
		if err := <-done; err != nil {
			t.Fatalf("waiter refused after the pending slot was abandoned: %v", err)
		}
		if st := s.Stats(c); st.InFlight != 1 || st.InFlightTokens != 1 || st.Pending != 0 || st.Admitted != 1 {
			t.Fatalf("after abandon: %+v", st)
		}
		// And a confirmed pending slot counts as in flight and admitted, and releases as usual
		s.SetRemote(c, 0, 0)
		held, err = acquire(t, s, context.Background(), w, c)
		if err != nil {
			t.Fatalf("second pending acquire: %v", err)
		}
		s.Confirm([]*bulkhead.Compartment{c}, held)
		if st := s.Stats(c); st.InFlight != 2 || st.InFlightTokens != 301 || st.Pending != 0 || st.Admitted != 2 {
			t.Fatalf("after confirm: %+v", st)
		}
		s.SetRemoteTotal(c, 2, 301)
		if r, rt := s.Remote(c); r != 0 || rt != 0 {
			t.Fatalf("remote = %d/%d after totals equal to what is held here, want 0/0", r, rt)
		}
		release(s, held, c)
		if st := s.Stats(c); st.InFlight != 1 || st.InFlightTokens != 1 {
			t.Fatalf("after release: %+v", st)
		}
	})
}

// A request waits in one compartment's queue at a time, but needs a slot in every compartment of
// its set: what each compartment's lease reports as waiting counts it wherever it waits, so
// that no lease gives back, or fails to ask for, a slot the request will take.
func TestLeaseUsageCountsAWaiterInEveryCompartmentItNeeds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &bulkhead.Scheduler{}
		feature := bulkhead.NewCompartment("feature/chat", bulkhead.Limits{MaxConcurrent: 2, QueueDepth: 10})
		tenant := bulkhead.NewCompartment("tenant/acme", bulkhead.Limits{MaxConcurrent: 5, MaxInflightTokens: 1000, QueueDepth: 10})
		set := []*bulkhead.Compartment{feature, tenant}
		usage := func(c *bulkhead.Compartment, freeze bool) [4]int64 {
			in, tok, w, wt := s.LeaseUsage(c, freeze)
			return [4]int64{in, tok, w, wt}
		}
		// Given leases of no slot of feature/chat and 2 slots of tenant/acme
		s.SetLease(feature, 0, 0, false)
		s.SetLease(tenant, 2, 600, false)
		// When a request of 28 tokens waits (in feature/chat's queue, the one short)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() {
			held := make([]int64, len(set))
			done <- s.Acquire(ctx, set, held, want(28, "acme", 5*time.Second), nil)
		}()
		synctest.Wait()
		// Then both compartments count it as waiting
		for _, c := range set {
			if u := usage(c, false); u != [4]int64{0, 0, 1, 28} {
				t.Fatalf("%s: usage (in flight, tokens, waiting, waiting tokens) %v, want [0 0 1 28]", c.Name(), u)
			}
		}
		if s.Idle(tenant) {
			t.Error("tenant/acme is idle while a request waits to take a slot there")
		}
		// And tenant/acme, frozen to what it uses, keeps the slot and tokens the waiter needs
		if u := usage(tenant, true); u != [4]int64{0, 0, 1, 28} {
			t.Fatalf("frozen tenant/acme: usage %v", u)
		}
		if st := s.Stats(tenant); st.LeaseSlots != 1 || st.LeaseTokens != 28 {
			t.Fatalf("tenant/acme frozen to %d slots and %d tokens, want 1 and 28 (the waiter's)", st.LeaseSlots, st.LeaseTokens)
		}
		// When feature/chat's lease grows while tenant/acme's is cut to nothing, the request
		// moves to tenant/acme's queue, and is still counted in both
		s.SetLease(tenant, 0, 0, false)
		s.SetLease(feature, 1, 0, false)
		if st := s.Stats(tenant); st.Queued != 1 {
			t.Fatalf("tenant/acme queues %d, want the request moved there", st.Queued)
		}
		for _, c := range set {
			if u := usage(c, false); u[2] != 1 || u[3] != 28 {
				t.Fatalf("%s after the move: usage %v, want the request waiting", c.Name(), u)
			}
		}
		// When tenant/acme's lease grows, it is admitted, and counted as waiting nowhere
		s.SetLease(tenant, 1, 600, false)
		if err := <-done; err != nil {
			t.Fatalf("refused: %v", err)
		}
		for _, c := range set {
			if u := usage(c, false); u != [4]int64{1, 28, 0, 0} {
				t.Fatalf("%s after the admission: usage %v", c.Name(), u)
			}
		}
		// And a request that gives up waiting is counted nowhere either
		_, err := acquire(t, s, context.Background(), want(10, "acme", time.Second), feature, tenant)
		if r := refusal(t, err); r.Cause != bulkhead.CauseTimedOut {
			t.Fatalf("cause = %s", r.Cause)
		}
		for _, c := range set {
			if u := usage(c, false); u[2] != 0 || u[3] != 0 {
				t.Fatalf("%s after a waiter gave up: usage %v", c.Name(), u)
			}
		}
	})
}

// A lease cut below what its compartment holds frees nothing at once; each release above it
// says so (the replica hands the slot on to the fleet), and releases within it do not.
func TestReleasesAboveALeaseSayTheyDrainedIt(t *testing.T) {
	s := &bulkhead.Scheduler{}
	c := bulkhead.NewCompartment("feature/chat", bulkhead.Limits{MaxConcurrent: 10, QueueDepth: 10})
	var drained int
	s.SetLeaseDrained(c, func() { drained++ })
	s.SetLease(c, 3, 0, false)
	var held [][]int64
	for range 3 {
		h, err := acquire(t, s, context.Background(), want(1, "a", 0), c)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, h)
	}
	// When the lease is cut to 1, two of the three requests are above it
	s.SetLease(c, 1, 0, false)
	release(s, held[0], c)
	release(s, held[1], c)
	if drained != 2 {
		t.Fatalf("the two releases above the lease said so %d times, want 2", drained)
	}
	// And the last one is within it
	release(s, held[2], c)
	if drained != 2 {
		t.Fatalf("a release within the lease said it drained it (%d in all)", drained)
	}
}
