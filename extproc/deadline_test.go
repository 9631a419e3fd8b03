package extproc_test

import (
	"testing"
	"testing/synctest"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
)

// queuePolicy: one slot, and a request may queue for it up to 5 s; a trusted x-llm-priority
// header gives a request its own priority.
const queuePolicy = `
envoy: {max_message_timeout: 10s}
features:
  default: {max_concurrent: 1, max_wait: 5s}
classification:
  priority:
    rules: [{header: x-llm-priority, trusted: true}]
    levels: {interactive: 10, batch: 1}
`

// chatHeaders are a chat request's headers (its body not sent to the server) plus kv.
func chatHeaders(kv ...string) *extprocv3.ProcessingRequest {
	r := requestHeaders(chatPath, false, extprocfilterv3.ProcessingMode_NONE)
	h := headers(false, append([]string{":method", "POST", ":path", chatPath, "content-type", "application/json"}, kv...)...)
	r.Request.(*extprocv3.ProcessingRequest_RequestHeaders).RequestHeaders = h
	return r
}

// admitted reports whether reply lets the request continue; refused returns an immediate
// reply's reason (and fails on anything else).
func admitted(r *extprocv3.ProcessingResponse) bool { return r.GetRequestHeaders() != nil }

func refusedReason(t *testing.T, r *extprocv3.ProcessingResponse) string {
	t.Helper()
	ir := r.GetImmediateResponse()
	if ir == nil {
		t.Fatalf("not a refusal: %v", r)
	}
	for _, h := range ir.GetHeaders().GetSetHeaders() {
		if h.GetHeader().GetKey() == extproc.HeaderReason {
			return string(h.GetHeader().GetRawValue())
		}
	}
	return ""
}

// learnHold runs one request that holds the slot for hold, so that the compartment predicts
// waits from it.
func learnHold(t *testing.T, m *memServer, hold time.Duration) {
	t.Helper()
	s := m.open()
	s.send(chatHeaders())
	if !admitted(s.reply(t)) {
		t.Fatal("the first request was not admitted")
	}
	time.Sleep(hold)
	s.send(responseHeaders("200", true))
	s.reply(t)
	s.close()
}

// TestRequestDeadlineCapsItsWait: a request whose client gives it 500 ms (Envoy's
// x-envoy-expected-rq-timeout-ms, or gRPC's grpc-timeout) is refused at once when the
// predicted wait is 2 s, although max_wait would let it queue 5 s; one given 3 s queues, and is
// refused when its 3 s are over, not at 5 s; a malformed value changes nothing.
func TestRequestDeadlineCapsItsWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemServer(t, queuePolicy, nil)
		learnHold(t, m, 2*time.Second)
		holder := m.open()
		holder.send(chatHeaders())
		if !admitted(holder.reply(t)) {
			t.Fatal("the holder was not admitted")
		}

		for _, h := range [][]string{
			{"x-envoy-expected-rq-timeout-ms", "500"},
			{"grpc-timeout", "500m"},
			{"x-envoy-expected-rq-timeout-ms", "60000", "grpc-timeout", "1S"}, // the shorter counts
		} {
			s := m.open()
			start := time.Now()
			s.send(chatHeaders(h...))
			r := s.reply(t)
			if reason := refusedReason(t, r); reason != "bulkhead_full" {
				t.Errorf("%v: refused with %q, want bulkhead_full", h, reason)
			}
			if waited := time.Since(start); waited != 0 {
				t.Errorf("%v: refused after %s, want at once", h, waited)
			}
			s.close()
		}

		for _, tc := range []struct {
			hdr  []string
			wait time.Duration
		}{
			{[]string{"x-envoy-expected-rq-timeout-ms", "3000"}, 3 * time.Second},
			{[]string{"grpc-timeout", "3S"}, 3 * time.Second},
			{[]string{"x-envoy-expected-rq-timeout-ms", "0"}, 5 * time.Second}, // no timeout
			{[]string{"x-envoy-expected-rq-timeout-ms", "soon"}, 5 * time.Second},
			{[]string{"grpc-timeout", "1x"}, 5 * time.Second},
		} {
			s := m.open()
			start := time.Now()
			s.send(chatHeaders(tc.hdr...))
			r := s.reply(t)
			if reason := refusedReason(t, r); reason != "bulkhead_full" {
				t.Errorf("%v: refused with %q, want bulkhead_full", tc.hdr, reason)
			}
			if waited := time.Since(start); waited != tc.wait {
				t.Errorf("%v: refused after %s, want %s", tc.hdr, waited, tc.wait)
			}
			s.close()
		}
		holder.close()
	})
}

// TestRequestPriorityJumpsTheQueue: with the slot taken, a batch request queues first and an
// interactive one after it; when the slot frees, the interactive request gets it, and the batch
// one the next.
func TestRequestPriorityJumpsTheQueue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemServer(t, queuePolicy, nil)
		holder := m.open()
		holder.send(chatHeaders())
		if !admitted(holder.reply(t)) {
			t.Fatal("the holder was not admitted")
		}
		batch := m.open()
		batch.send(chatHeaders("x-llm-priority", "batch"))
		synctest.Wait()
		interactive := m.open()
		interactive.send(chatHeaders("x-llm-priority", " Interactive "))
		synctest.Wait()

		holder.send(responseHeaders("200", true))
		holder.reply(t)
		holder.close()
		synctest.Wait()
		if !admitted(interactive.reply(t)) {
			t.Fatal("the interactive request was not admitted when the slot freed")
		}
		for len(batch.out) > 0 {
			if r := <-batch.out; r.Response != nil {
				t.Fatalf("the batch request, queued first, got a reply before the interactive one left: %v", r)
			}
		}
		interactive.send(responseHeaders("200", true))
		interactive.reply(t)
		interactive.close()
		if !admitted(batch.reply(t)) {
			t.Fatal("the batch request was not admitted after the interactive one")
		}
		batch.close()
	})
}
