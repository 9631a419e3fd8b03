package breaker

import (
	"fmt"
	"testing"
	"time"
)

// TestHistoryKeepsEventsWithTheirCalls: a transition carries the calls recorded just before it,
// the one that caused it last, with the caller's status and provider.
func TestHistoryKeepsEventsWithTheirCalls(t *testing.T) {
	h := newHarness(t, r4jConfig())
	for i := range 6 {
		h.b.RecordDetail(h.acquire(), Success, time.Duration(i)*time.Millisecond, h.now, Detail{Status: 200, Provider: "deepseek"})
		h.advance(time.Second)
	}
	h.b.RecordDetail(h.acquire(), Failure, 5*time.Second, h.now, Detail{Status: 503, Provider: "deepseek"})
	for range 5 { // the fifth failure brings the rate to 6/12 = 50 %
		h.b.RecordDetail(h.acquire(), Failure, 0, h.now, Detail{Status: 502, Provider: "deepseek"})
	}
	h.wantState(Open)
	h.refused(ErrOpen) // a refusal is no recorded call

	hist := h.b.History()
	if len(hist) != 1 {
		t.Fatalf("history %+v, want one transition", hist)
	}
	e := hist[0]
	if e.Kind != "transition" || e.From != Closed || e.To != Open || e.Reason != ReasonFailureRate || e.FailureRate != 50 || e.Generation != 2 {
		t.Fatalf("event %+v", e)
	}
	if !e.At.Equal(h.now) {
		t.Errorf("event at %v, want %v", e.At, h.now)
	}
	if len(e.Calls) != RecentCalls {
		t.Fatalf("%d calls, want %d", len(e.Calls), RecentCalls)
	}
	var got []string
	for _, c := range e.Calls {
		got = append(got, fmt.Sprintf("%s %d %s", c.Kind, c.Status, c.Provider))
	}
	want := []string{"success 200 deepseek", "success 200 deepseek", "slow_failure 503 deepseek",
		"failure 502 deepseek", "failure 502 deepseek", "failure 502 deepseek", "failure 502 deepseek", "failure 502 deepseek"}
	if !equalStrings(got, want) {
		t.Errorf("calls %q, want %q", got, want)
	}
	if oldest := e.Calls[0]; !oldest.At.Equal(t0.Add(4*time.Second)) || oldest.Duration != 4*time.Millisecond {
		t.Errorf("oldest call %+v, want the fifth success, at t0+4s lasting 4ms", oldest)
	}
	if h.b.Counts().WouldOpen != 0 {
		t.Error("CLOSED counted a would-open")
	}
}

// TestHistoryIsBounded: the history keeps the last HistorySize events, oldest first.
func TestHistoryIsBounded(t *testing.T) {
	h := newHarness(t, r4jConfig())
	for i := range HistorySize + 10 {
		h.advance(time.Millisecond)
		if i%2 == 0 {
			h.transition(ForcedOpen)
		} else {
			h.transition(Closed)
		}
	}
	hist := h.b.History()
	if len(hist) != HistorySize {
		t.Fatalf("%d events, want %d", len(hist), HistorySize)
	}
	for i := 1; i < len(hist); i++ {
		if hist[i].Generation != hist[i-1].Generation+1 {
			t.Fatalf("events out of order at %d: %d after %d", i, hist[i].Generation, hist[i-1].Generation)
		}
	}
	if last := hist[len(hist)-1]; last.To != Closed || last.Reason != ReasonForced || len(last.Calls) != 0 || !last.At.Equal(h.now) {
		t.Errorf("newest event %+v", last)
	}
}

// TestMetricsOnlyWouldOpen: METRICS_ONLY counts one would-open per stay, however many rates
// breach, and keeps the breach in its history.
func TestMetricsOnlyWouldOpen(t *testing.T) {
	h := newHarness(t, r4jConfig(), WithInitialState(MetricsOnly))
	for range 5 {
		h.call(Failure, 0)
	}
	for range 5 {
		h.call(Success, 5*time.Second) // the slow rate reaches 50 % too
	}
	h.wantState(MetricsOnly)
	if n := h.b.Counts().WouldOpen; n != 1 {
		t.Fatalf("would open %d, want 1 for one stay", n)
	}
	hist := h.b.History()
	if len(hist) != 2 || hist[0].Kind != "threshold_exceeded" || hist[0].Reason != ReasonFailureRate || hist[1].Reason != ReasonSlowCallRate {
		t.Fatalf("history %+v, want both breaches", hist)
	}
	if c := hist[0].Calls; len(c) != 5 || c[4].Kind != "failure" {
		t.Errorf("breach calls %+v", c)
	}
	h.transition(MetricsOnly) // a fresh stay
	for range 5 {
		h.call(Failure, 0)
	}
	if n := h.b.Counts().WouldOpen; n != 2 {
		t.Fatalf("would open %d, want 2 after a second stay", n)
	}
}
