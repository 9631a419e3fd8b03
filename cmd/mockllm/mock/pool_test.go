package mock

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
)

func TestPoolServesWaitersInArrivalOrder(t *testing.T) {
	tests := []struct {
		name    string
		limit   int
		waiters int
		cancel  []int // waiters that give up before any slot frees
		want    []int // order in which the remaining waiters get a slot
	}{
		{name: "plain FIFO", limit: 2, waiters: 4, want: []int{0, 1, 2, 3}},
		{name: "cancelled waiters leave no hole", limit: 1, waiters: 4, cancel: []int{1, 2}, want: []int{0, 3}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := newPool(tt.limit)
				for range tt.limit {
					if _, err := p.acquire(context.Background()); err != nil {
						t.Fatal(err)
					}
				}
				var mu sync.Mutex
				var order []int
				cancels := make([]context.CancelFunc, tt.waiters)
				errs := make([]error, tt.waiters)
				var wg sync.WaitGroup
				for i := range tt.waiters {
					ctx, cancel := context.WithCancel(context.Background())
					cancels[i] = cancel
					wg.Go(func() {
						_, errs[i] = p.acquire(ctx)
						if errs[i] == nil {
							mu.Lock()
							order = append(order, i)
							mu.Unlock()
						}
					})
					synctest.Wait()
				}
				if st := p.stats(1); st.InFlight != tt.limit || st.Queued != tt.waiters {
					t.Fatalf("stats = %+v, want %d in flight and %d queued", st, tt.limit, tt.waiters)
				}
				for _, i := range tt.cancel {
					cancels[i]()
				}
				synctest.Wait()
				// Free one slot at a time and let exactly one waiter through.
				for range len(tt.want) {
					p.release()
					synctest.Wait()
				}
				wg.Wait()
				for _, c := range cancels {
					c()
				}
				if len(order) != len(tt.want) {
					t.Fatalf("served %v, want %v", order, tt.want)
				}
				for i := range tt.want {
					if order[i] != tt.want[i] {
						t.Fatalf("served %v, want %v", order, tt.want)
					}
				}
				for _, i := range tt.cancel {
					if !errors.Is(errs[i], context.Canceled) {
						t.Errorf("cancelled waiter %d got %v, want context.Canceled", i, errs[i])
					}
				}
				if st := p.stats(1); st.InFlight != tt.limit || st.Queued != 0 {
					t.Fatalf("final stats = %+v, want %d in flight (the served waiters) and none queued", st, tt.limit)
				}
			})
		})
	}
}

func TestPoolUnlimitedStillCounts(t *testing.T) {
	p := newPool(0)
	for range 100 {
		if _, err := p.acquire(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if st := p.stats(1); st.InFlight != 100 || st.Queued != 0 || st.Capacity != 0 {
		t.Fatalf("stats = %+v, want 100 in flight", st)
	}
	for range 100 {
		p.release()
	}
	if st := p.stats(1); st.InFlight != 0 {
		t.Fatalf("stats = %+v, want empty", st)
	}
}

// TestPoolCancelRacingHandOver pins the case where a waiter gives up at the
// same moment a slot is handed to it: the slot must pass on, never vanish.
func TestPoolCancelRacingHandOver(t *testing.T) {
	for i := range 50 {
		synctest.Test(t, func(t *testing.T) {
			p := newPool(1)
			if _, err := p.acquire(context.Background()); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			var err error
			var wg sync.WaitGroup
			wg.Go(func() { _, err = p.acquire(ctx) })
			synctest.Wait()
			// Both happen before the waiter runs again; which one it sees
			// first is up to the select.
			cancel()
			p.release()
			wg.Wait()
			want := 0
			if err == nil {
				want = 1
			}
			if st := p.stats(1); st.InFlight != want || st.Queued != 0 {
				t.Fatalf("round %d: acquire returned %v and the pool holds %+v, want %d in flight", i, err, st, want)
			}
		})
	}
}
