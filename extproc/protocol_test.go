package extproc_test

import (
	"testing"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

const chatPath = "/v1/chat/completions"

// TestRepeatedRequestHeadersDoesNotLeakSlots: a second request_headers on a stream whose request
// was already admitted used to run admission again into the same ticket, and the first
// admission's slot was never released. Now it ends the stream with INVALID_ARGUMENT, releases
// the one admission and counts the violation.
func TestRepeatedRequestHeadersDoesNotLeakSlots(t *testing.T) {
	m := newMemServer(t, policyYAML, nil)
	s := m.open()
	s.send(requestHeaders(chatPath, false, extprocfilterv3.ProcessingMode_NONE))
	if r := s.reply(t); r.GetRequestHeaders() == nil {
		t.Fatalf("first request_headers: reply %v", r)
	}
	if m.eng.InFlight() != 1 {
		t.Fatalf("in flight %d after admission, want 1", m.eng.InFlight())
	}
	s.send(requestHeaders(chatPath, false, extprocfilterv3.ProcessingMode_NONE))
	err := s.close()
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("stream ended with %v, want InvalidArgument", err)
	}
	nothingHeld(t, m.eng)
	if got := metric(t, m.reg, "llm_bulkhead_extproc_protocol_errors_total", "kind", "repeated_request_headers"); got != 1 {
		t.Errorf("protocol errors counted %v, want 1", got)
	}
}

// TestMessagesOutOfEnvoysOrderEndTheStream: every message Envoy never sends at that point ends
// the stream with INVALID_ARGUMENT, names what was out of order, releases what the request
// holds and is counted by kind. The offending message gets no reply.
func TestMessagesOutOfEnvoysOrderEndTheStream(t *testing.T) {
	none := extprocfilterv3.ProcessingMode_NONE
	trailers := func(request bool) *extprocv3.ProcessingRequest {
		if request {
			return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
		}
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}
	}
	for _, tc := range []struct {
		name, kind string
		msgs       []*extprocv3.ProcessingRequest
	}{
		{"request body after response headers", "request_after_response",
			[]*extprocv3.ProcessingRequest{requestHeaders(chatPath, false, none), responseHeaders("200", false), requestBody("{}", true)}},
		{"request headers after response headers", "request_after_response",
			[]*extprocv3.ProcessingRequest{requestHeaders(chatPath, false, none), responseHeaders("200", false), requestHeaders(chatPath, false, none)}},
		{"response headers twice", "repeated_response_headers",
			[]*extprocv3.ProcessingRequest{requestHeaders(chatPath, false, none), responseHeaders("200", false), responseHeaders("200", false)}},
		{"response trailers twice", "repeated_trailers",
			[]*extprocv3.ProcessingRequest{requestHeaders(chatPath, false, none), responseHeaders("200", false), trailers(false), trailers(false)}},
		{"response body after response trailers", "out_of_order",
			[]*extprocv3.ProcessingRequest{requestHeaders(chatPath, false, none), responseHeaders("200", false), trailers(false), responseBody("x", true)}},
		{"request headers after request trailers", "repeated_request_headers",
			[]*extprocv3.ProcessingRequest{requestHeaders(chatPath, false, none), trailers(true), requestHeaders(chatPath, false, none)}},
		{"empty message", "unknown_message",
			[]*extprocv3.ProcessingRequest{requestHeaders(chatPath, false, none), {}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newMemServer(t, policyYAML, nil)
			s := m.open()
			last := len(tc.msgs) - 1
			for i, req := range tc.msgs[:last] {
				s.send(req)
				if r := s.reply(t); r == nil {
					t.Fatalf("message %d got no reply", i)
				}
			}
			s.send(tc.msgs[last])
			err := s.close()
			if st, _ := status.FromError(err); st.Code() != codes.InvalidArgument || st.Message() == "" {
				t.Errorf("stream ended with %v, want InvalidArgument saying what was out of order", err)
			}
			select {
			case r := <-s.out:
				t.Errorf("the out-of-order message got a reply: %v", r)
			default:
			}
			nothingHeld(t, m.eng)
			if got := metric(t, m.reg, "llm_bulkhead_extproc_protocol_errors_total", "kind", tc.kind); got != 1 {
				t.Errorf("protocol errors of kind %s counted %v, want 1", tc.kind, got)
			}
		})
	}
}

// TestHarmlessLateMessagesContinue: messages that are in Envoy's order but arrive after the
// decision — request body chunks after a decision taken at the headers, the response of a
// refused or passthrough stream, trailers — are answered as before.
func TestHarmlessLateMessagesContinue(t *testing.T) {
	t.Run("streamed request body after a decision at headers", func(t *testing.T) {
		m := newMemServer(t, policyYAML, nil)
		s := m.open()
		s.send(requestHeaders(chatPath, false, extprocfilterv3.ProcessingMode_STREAMED))
		if r := s.reply(t); r.GetRequestHeaders() == nil {
			t.Fatalf("reply %v", r)
		}
		for _, end := range []bool{false, true} {
			s.send(requestBody(`{"model":"m"}`, end))
			if r := s.reply(t); r.GetRequestBody() == nil || r.GetRequestBody().GetResponse().GetStatus() != extprocv3.CommonResponse_CONTINUE {
				t.Fatalf("body chunk: reply %v", r)
			}
		}
		s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}})
		if r := s.reply(t); r.GetRequestTrailers() == nil {
			t.Fatalf("request trailers: reply %v", r)
		}
		s.send(responseHeaders("200", true))
		if r := s.reply(t); r.GetResponseHeaders() == nil {
			t.Fatalf("response headers: reply %v", r)
		}
		if err := s.close(); err != nil {
			t.Errorf("stream ended with %v", err)
		}
		nothingHeld(t, m.eng)
	})
	t.Run("response of a passthrough stream", func(t *testing.T) {
		m := newMemServer(t, policyYAML, nil)
		s := m.open()
		for _, req := range []*extprocv3.ProcessingRequest{responseHeaders("200", false), responseBody("data: x\n\n", false), responseBody("", true),
			{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}} {
			s.send(req)
			if r := s.reply(t); r == nil {
				t.Fatal("no reply")
			}
		}
		if err := s.close(); err != nil {
			t.Errorf("stream ended with %v", err)
		}
	})
}
