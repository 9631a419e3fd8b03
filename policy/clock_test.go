package policy_test

import (
	"context"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// The request path reads the clock once per message and hands the reading down
// (Request.Now, Ticket.Remaining's now, Outcome.At); these tests check that the engine uses
// the reading it is given and reads its own clock only for what happened later.

// TestGrantedAtIsArrivalUnlessQueued: a request admitted at once is admitted when it arrived
// (the time its caller read), so its time to first token counts from there; a queued one is
// admitted when its wait ended, not when it arrived.
func TestGrantedAtIsArrivalUnlessQueued(t *testing.T) {
	e, clk := engine(t, `
envoy: {max_message_timeout: 10s}
features:
  default: {max_concurrent: 1, max_wait: 5s}
`)
	s := e.Snapshot()
	arrived := clk.Now()
	clk.Advance(time.Second) // the clock moved on after the caller read it
	first := &policy.Ticket{}
	r := policy.Request{Dims: s.Classify(input{}), Estimate: policy.Estimate{Total: 10}, Now: arrived}
	if d := e.Admit(context.Background(), s, &r, first, nil); d.Verdict != policy.Admit {
		t.Fatalf("first: %+v", d)
	}
	if got := first.GrantedAt(); !got.Equal(arrived) {
		t.Errorf("admitted without waiting: granted at %s, want its arrival %s", got, arrived)
	}

	queued := make(chan struct{})
	done := make(chan *policy.Ticket)
	second := policy.Request{Dims: s.Classify(input{}), Estimate: policy.Estimate{Total: 10}, Now: clk.Now()}
	go func() {
		tk := &policy.Ticket{}
		if d := e.Admit(context.Background(), s, &second, tk, func(time.Duration) { close(queued) }); d.Verdict != policy.Admit {
			t.Errorf("second: %+v", d)
		}
		done <- tk
	}()
	<-queued
	clk.Advance(2 * time.Second)
	first.Done(policy.Outcome{Status: 200})
	tk := <-done
	if want := second.Now.Add(2 * time.Second); !tk.GrantedAt().Equal(want) {
		t.Errorf("admitted after a 2s wait: granted at %s, want %s (when the wait ended)", tk.GrantedAt(), want)
	}
	tk.Done(policy.Outcome{Status: 200})
}

// TestRemainingUsesTheCallersTime: the tokens left and the time until the budget is full
// again are read at the time given.
func TestRemainingUsesTheCallersTime(t *testing.T) {
	e, clk := engine(t, seedPolicy)
	batch := input{headers: map[string]string{"x-llm-feature": "batch_summarize", "x-tenant-id": "acme"}}
	d, tk := admit(t, e, batch, 5000)
	if d.Verdict != policy.Admit {
		t.Fatalf("refused: %+v", d)
	}
	defer tk.Done(policy.Outcome{Status: 200})
	start := clk.Now()
	left, reset, ok := tk.Remaining(start)
	if !ok || left != 45000 || reset != time.Minute {
		t.Fatalf("Remaining at admission = %d, %s, %v; want 45000 left, full again in 1m", left, reset, ok)
	}
	if _, reset, _ := tk.Remaining(start.Add(20 * time.Second)); reset != 40*time.Second {
		t.Errorf("Remaining 20s later: full again in %s, want 40s", reset)
	}
}

// TestDoneAtTimesTheHold: a ticket settled with Outcome.At held its slot until then, whatever
// the clock says when Done runs; the hold time is what a refusal's Retry-After predicts from.
func TestDoneAtTimesTheHold(t *testing.T) {
	e, clk := engine(t, `
envoy: {max_message_timeout: 10s}
features:
  default: {max_concurrent: 1}
`)
	_, tk := admit(t, e, input{}, 10)
	tk.Done(policy.Outcome{Status: 200, At: clk.Now().Add(7 * time.Second)})
	_, holder := admit(t, e, input{}, 10)
	defer holder.Done(policy.Outcome{Status: 200})
	d, _ := admit(t, e, input{}, 10)
	if d.Reason != policy.ReasonBulkheadFull || d.RetryAfter != 7*time.Second {
		t.Errorf("refusal while the slot is held: %s, retry after %s; want bulkhead_full after 7s (the hold Done was told)", d.Reason, d.RetryAfter)
	}
}
