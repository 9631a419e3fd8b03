package extproc_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
)

// TestStreamsBeyondMaxStreamsAreRefused: idle streams used to pile up without bound; beyond
// server.max_streams a new stream is refused at once with RESOURCE_EXHAUSTED (Envoy then
// applies failure_mode_allow or status_on_error) and counted, and it holds nothing.
func TestStreamsBeyondMaxStreamsAreRefused(t *testing.T) {
	m, client := grpcServer(t, policyYAML+"server: {max_streams: 2}\n")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	open := func() extprocv3.ExternalProcessor_ProcessClient {
		st, err := client.Process(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// A stream the server refused at once may already be over: Send then says io.EOF and
		// Recv carries the status.
		if err := st.Send(requestHeaders(chatPath, false, extprocfilterv3.ProcessingMode_NONE)); err != nil && !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
		return st
	}
	var held []extprocv3.ExternalProcessor_ProcessClient
	for range 2 {
		st := open()
		if _, err := st.Recv(); err != nil {
			t.Fatalf("a stream within the limit: %v", err)
		}
		held = append(held, st)
	}
	if n := m.srv.ActiveStreams(); n != 2 {
		t.Fatalf("%d streams active, want 2", n)
	}
	_, err := open().Recv()
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("the stream beyond max_streams: %v, want ResourceExhausted", err)
	}
	if got := metric(t, m.reg, "llm_bulkhead_extproc_streams_refused_total", "reason", "max_streams"); got != 1 {
		t.Errorf("refused streams counted %v, want 1", got)
	}
	if m.eng.InFlight() != 2 {
		t.Errorf("in flight %d, want the 2 streams within the limit", m.eng.InFlight())
	}

	// Once a stream ends, there is room again.
	if err := held[0].CloseSend(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for m.srv.ActiveStreams() != 1 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if _, err := open().Recv(); err != nil {
		t.Errorf("a stream after one ended: %v", err)
	}
}

// TestAdmittedStreamWithoutResponseIsReleasedAfterIdleTimeout: an admitted request whose
// response never came used to hold its slot until Envoy gave up on the stream, however long.
// After server.stream_idle_timeout without a message the admission is released as a cancel;
// a message within the timeout keeps it. The stream then ends with DEADLINE_EXCEEDED; a stream
// the server cannot end (a gRPC server without EndableStreams) lets later messages pass
// through, releasing nothing twice.
func TestAdmittedStreamWithoutResponseIsReleasedAfterIdleTimeout(t *testing.T) {
	for _, endable := range []bool{true, false} {
		t.Run(map[bool]string{true: "endable", false: "not endable"}[endable], func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				m := newMemServer(t, policyYAML+"server: {stream_idle_timeout: 1m}\n", nil)
				s := m.openStream(endable)
				s.send(requestHeaders(chatPath, false, extprocfilterv3.ProcessingMode_STREAMED))
				if r := s.reply(t); r.GetRequestHeaders() == nil {
					t.Fatalf("reply %v", r)
				}
				if m.eng.InFlight() != 1 {
					t.Fatalf("in flight %d after admission", m.eng.InFlight())
				}

				// A request body chunk at 40s is activity: the timeout counts from it.
				time.Sleep(40 * time.Second)
				s.send(requestBody(`{"model":"m"}`, true))
				s.reply(t)
				time.Sleep(59 * time.Second)
				synctest.Wait()
				if m.eng.InFlight() != 1 {
					t.Fatalf("released %s after the last message, before the idle timeout", 59*time.Second)
				}

				// Checked every second (a sixtieth of the timeout): released within two.
				time.Sleep(3 * time.Second)
				synctest.Wait()
				if m.eng.InFlight() != 0 {
					t.Fatal("not released after the idle timeout")
				}
				nothingHeld(t, m.eng)
				if got := metric(t, m.reg, "llm_bulkhead_extproc_streams_idle_released_total"); got != 1 {
					t.Errorf("idle releases counted %v, want 1", got)
				}

				if endable {
					if err := s.wait(); status.Code(err) != codes.DeadlineExceeded {
						t.Errorf("the released stream ended with %v, want DEADLINE_EXCEEDED", err)
					}
					if got := metric(t, m.reg, "llm_bulkhead_extproc_streams_timed_out_total", "timeout", "idle"); got != 1 {
						t.Errorf("streams ended for silence counted %v, want 1", got)
					}
					return
				}
				// The response arrives after all: it passes through untouched.
				s.send(responseHeaders("200", false))
				r := s.reply(t)
				if r.GetResponseHeaders() == nil || r.GetResponseHeaders().GetResponse() != nil {
					t.Errorf("late response headers: reply %v, want a plain CONTINUE", r)
				}
				s.send(responseBody(`data: {"usage":{"prompt_tokens":5,"completion_tokens":5,"total_tokens":10}}`+"\n\n", true))
				if r := s.reply(t); r.GetResponseBody() == nil {
					t.Errorf("late response body: reply %v", r)
				}
				if err := s.close(); err != nil {
					t.Errorf("stream ended with %v", err)
				}
				nothingHeld(t, m.eng)
			})
		})
	}
}

// TestIdleWatchStopsWithTheStream: a stream that completes normally leaves no timer behind to
// release anything later.
func TestIdleWatchStopsWithTheStream(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemServer(t, policyYAML+"server: {stream_idle_timeout: 1m}\n", nil)
		s := m.open()
		s.send(requestHeaders(chatPath, false, extprocfilterv3.ProcessingMode_NONE))
		s.reply(t)
		s.send(responseHeaders("200", true))
		s.reply(t)
		if err := s.close(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Minute)
		synctest.Wait()
		if got := metric(t, m.reg, "llm_bulkhead_extproc_streams_idle_released_total"); got != 0 {
			t.Errorf("idle releases counted %v after a normal end, want 0", got)
		}
		nothingHeld(t, m.eng)
	})
}

const bodyBoundYAML = `
envoy: {max_message_timeout: 10s, max_request_body: 1MiB}
server: {max_buffered_body_bytes: 1536KiB}
features:
  default: {max_concurrent: 1, max_wait: 5s, tokens_per_minute: 100000000}
`

// bigBody is a chat request of about n bytes.
func bigBody(n int) string {
	const head, tail = `{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"`, `"}]}`
	return head + strings.Repeat("a", n-len(head)-len(tail)) + tail
}

// TestBufferedBodiesAreBoundedGlobally: bodies held while their requests queued for a slot used
// to be bounded only by the number of streams (16 buffered 8 MiB bodies took the process to
// 470 MB). Past server.max_buffered_body_bytes a body is refused at once with server_busy
// (503, Anthropic 529, retry-after 1) while the held one waits; once that one is decided, the
// bytes are free again.
func TestBufferedBodiesAreBoundedGlobally(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemServer(t, bodyBoundYAML, nil)
		buffered := extprocfilterv3.ProcessingMode_BUFFERED

		// A small request takes the only slot and keeps it: its response has not come.
		a := m.open()
		a.send(requestHeaders(chatPath, false, buffered))
		a.reply(t)
		a.send(requestBody(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`, true))
		if r := a.reply(t); r.GetRequestBody() == nil {
			t.Fatalf("first request: %v", r)
		}

		// A 1 MiB body queues for the slot, its bytes held.
		b := m.open()
		b.send(requestHeaders(chatPath, false, buffered))
		b.reply(t)
		b.send(requestBody(bigBody(1<<20), true))
		synctest.Wait()
		if got := metric(t, m.reg, "llm_bulkhead_extproc_buffered_body_bytes"); got != 1<<20 {
			t.Fatalf("buffered body bytes %v while the body queues, want %d", got, 1<<20)
		}

		// Another one would pass the bound: refused at once, in each API's own format.
		for _, tc := range []struct {
			path   string
			status int32
			typ    string
		}{{chatPath, 503, "server_overloaded"}, {"/v1/messages", 529, "overloaded_error"}} {
			c := m.open()
			c.send(requestHeaders(tc.path, false, buffered))
			c.reply(t)
			c.send(requestBody(bigBody(1<<20), true))
			r := c.reply(t).GetImmediateResponse()
			if r == nil {
				t.Fatalf("%s: the body past the bound was not refused", tc.path)
			}
			if r.GetStatus().GetCode() != typev3.StatusCode(tc.status) {
				t.Errorf("%s: status %v, want %d", tc.path, r.GetStatus().GetCode(), tc.status)
			}
			hs := map[string]string{}
			for _, h := range r.GetHeaders().GetSetHeaders() {
				hs[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
			}
			if hs[extproc.HeaderReason] != "server_busy" || hs[extproc.HeaderRetryAfter] != "1" {
				t.Errorf("%s: headers %v, want reason server_busy and retry-after 1", tc.path, hs)
			}
			var body map[string]any
			if err := json.Unmarshal(r.GetBody(), &body); err != nil || !strings.Contains(string(r.GetBody()), `"`+tc.typ+`"`) {
				t.Errorf("%s: body %s, want an error of type %s", tc.path, r.GetBody(), tc.typ)
			}
			c.close()
		}
		if got := metric(t, m.reg, "llm_bulkhead_extproc_bodies_refused_total"); got != 2 {
			t.Errorf("bodies refused counted %v, want 2", got)
		}

		// The first request finishes: the queued one is admitted and its bytes are given back.
		a.send(responseHeaders("200", true))
		a.reply(t)
		if r := b.reply(t); r.GetRequestBody() == nil {
			t.Fatalf("the queued request: %v", r)
		}
		if got := metric(t, m.reg, "llm_bulkhead_extproc_buffered_body_bytes"); got != 0 {
			t.Errorf("buffered body bytes %v after the decision, want 0", got)
		}

		// Now a large body is held again, and admitted when the slot frees.
		c := m.open()
		c.send(requestHeaders(chatPath, false, buffered))
		c.reply(t)
		c.send(requestBody(bigBody(1<<20), true))
		b.send(responseHeaders("200", true))
		b.reply(t)
		if r := c.reply(t); r.GetRequestBody() == nil {
			t.Fatalf("the retried request: %v", r)
		}
		c.send(responseHeaders("200", true))
		c.reply(t)
		for _, s := range []*memStream{a, b, c} {
			if err := s.close(); err != nil {
				t.Error(err)
			}
		}
		nothingHeld(t, m.eng)
		if got := metric(t, m.reg, "llm_bulkhead_extproc_buffered_body_bytes"); got != 0 {
			t.Errorf("buffered body bytes %v at the end, want 0", got)
		}
	})
}

// TestHeldBodyIsGivenBackWhenTheStreamEnds: a body whose request is abandoned while it queues
// gives its bytes back.
func TestHeldBodyIsGivenBackWhenTheStreamEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemServer(t, bodyBoundYAML, nil)
		buffered := extprocfilterv3.ProcessingMode_BUFFERED
		a := m.open()
		a.send(requestHeaders(chatPath, false, buffered))
		a.reply(t)
		a.send(requestBody(`{"model":"m"}`, true))
		a.reply(t)
		b := m.open()
		b.send(requestHeaders(chatPath, false, buffered))
		b.reply(t)
		b.send(requestBody(bigBody(1<<20), true))
		synctest.Wait()
		b.cancel()
		if err := b.wait(); err != nil {
			t.Fatal(err)
		}
		if got := metric(t, m.reg, "llm_bulkhead_extproc_buffered_body_bytes"); got != 0 {
			t.Errorf("buffered body bytes %v after the queued stream was reset, want 0", got)
		}
		a.close()
		nothingHeld(t, m.eng)
	})
}
