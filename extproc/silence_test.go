package extproc_test

import (
	"testing"
	"testing/synctest"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ended reports whether Process has returned on s, and with what.
func ended(s *memStream) (bool, error) {
	select {
	case err := <-s.done:
		s.done <- err
		return true, err
	default:
		return false, nil
	}
}

// TestSilentStreamsAreEnded: streams that never sent a message used to be held forever —
// 20 000 of them over 5 connections kept streams_active at 20 000, so every real request was
// refused with RESOURCE_EXHAUSTED. A stream silent for server.first_message_timeout after it
// opened is ended with DEADLINE_EXCEEDED (Envoy sends a stream's first message as it opens it),
// counted, and its place is free again.
func TestSilentStreamsAreEnded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemServer(t, policyYAML+"server: {max_streams: 3, first_message_timeout: 6s}\n", nil)
		var silent []*memStream
		for range 3 {
			silent = append(silent, m.open())
		}
		synctest.Wait()
		if n := m.srv.ActiveStreams(); n != 3 {
			t.Fatalf("%d streams active, want 3", n)
		}
		time.Sleep(5900 * time.Millisecond)
		synctest.Wait()
		for i, s := range silent {
			if done, err := ended(s); done {
				t.Fatalf("silent stream %d ended before first_message_timeout: %v", i, err)
			}
		}

		// Checked every 100ms (a sixtieth of the timeout): ended within two checks.
		time.Sleep(300 * time.Millisecond)
		synctest.Wait()
		for i, s := range silent {
			done, err := ended(s)
			if !done || status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("silent stream %d: ended %v with %v, want DEADLINE_EXCEEDED", i, done, err)
			}
		}
		if n := m.srv.ActiveStreams(); n != 0 {
			t.Errorf("%d streams active after the silent ones were ended, want 0", n)
		}
		if got := metric(t, m.reg, "llm_bulkhead_extproc_streams_timed_out_total", "timeout", "first_message"); got != 3 {
			t.Errorf("streams ended for a missing first message counted %v, want 3", got)
		}

		// A real request is served again.
		s := m.open()
		s.send(requestHeaders(chatPath, true, extprocfilterv3.ProcessingMode_NONE))
		if r := s.reply(t); r.GetRequestHeaders() == nil {
			t.Fatalf("a real request after the silent streams ended: reply %v", r)
		}
		s.send(responseHeaders("200", true))
		s.reply(t)
		if err := s.close(); err != nil {
			t.Fatal(err)
		}
		nothingHeld(t, m.eng)
	})
}

// TestStreamWaitingForItsBodyIsEndedWhenSilent: a stream that sent only request_headers (its
// buffered body never came) outlived server.stream_idle_timeout (2s set, still open at 6s).
// It is ended with DEADLINE_EXCEEDED — not OK, which Envoy would take as "continue without the
// processor" and let the undecided request through — and holds nothing.
func TestStreamWaitingForItsBodyIsEndedWhenSilent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemServer(t, policyYAML+"server: {stream_idle_timeout: 2s}\n", nil)
		s := m.open()
		s.send(requestHeaders(chatPath, false, extprocfilterv3.ProcessingMode_BUFFERED))
		if r := s.reply(t); r.GetRequestHeaders() == nil {
			t.Fatalf("request headers: reply %v", r)
		}
		time.Sleep(1900 * time.Millisecond)
		synctest.Wait()
		if done, err := ended(s); done {
			t.Fatalf("ended before stream_idle_timeout: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
		synctest.Wait()
		done, err := ended(s)
		if !done || status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("after stream_idle_timeout: ended %v with %v, want DEADLINE_EXCEEDED", done, err)
		}
		if got := metric(t, m.reg, "llm_bulkhead_extproc_streams_timed_out_total", "timeout", "idle"); got != 1 {
			t.Errorf("streams ended for silence counted %v, want 1", got)
		}
		if n := m.srv.ActiveStreams(); n != 0 {
			t.Errorf("%d streams active, want 0", n)
		}
		nothingHeld(t, m.eng)
	})
}

// TestQueueingIsNotSilence: the time a request waits in a queue for a slot is the server's,
// not Envoy's silence: a request queued longer than stream_idle_timeout is admitted when the
// slot frees, and its stream is not ended.
func TestQueueingIsNotSilence(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const yaml = `
envoy: {max_message_timeout: 10s}
server: {stream_idle_timeout: 1s, first_message_timeout: 1s}
features:
  default: {max_concurrent: 1, max_wait: 5s}
`
		m := newMemServer(t, yaml, nil)
		a := m.open()
		a.send(requestHeaders(chatPath, true, extprocfilterv3.ProcessingMode_NONE))
		if r := a.reply(t); r.GetRequestHeaders() == nil {
			t.Fatalf("first request: reply %v", r)
		}
		b := m.open()
		b.send(requestHeaders(chatPath, true, extprocfilterv3.ProcessingMode_NONE))
		// a keeps its slot for 3s, its response streaming a chunk every 500ms so that it is not
		// silent itself; b waits in the queue all that time.
		a.send(responseHeaders("200", false))
		a.reply(t)
		for range 6 {
			time.Sleep(500 * time.Millisecond)
			a.send(responseBody("data: {}\n\n", false))
			a.reply(t)
		}
		synctest.Wait()
		if done, err := ended(b); done {
			t.Fatalf("the queued stream was ended while it waited: %v", err)
		}
		a.send(responseBody("", true))
		a.reply(t)
		if r := b.reply(t); r.GetRequestHeaders() == nil || r.GetRequestHeaders().GetResponse().GetHeaderMutation() == nil {
			t.Fatalf("the queued request after the slot freed: reply %v, want its admission", r)
		}
		b.send(responseHeaders("200", true))
		b.reply(t)
		for _, s := range []*memStream{a, b} {
			if err := s.close(); err != nil {
				t.Error(err)
			}
		}
		nothingHeld(t, m.eng)
	})
}
