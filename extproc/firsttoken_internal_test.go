package extproc

import (
	"context"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// stepClock is a clock the test moves by hand.
type stepClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *stepClock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// respond runs one stream through response headers and the given SSE body chunks, moving the
// clock by step before each message and again between each reply and the scan after it, and
// returns the outcome the request was settled with.
func respond(t *testing.T, step time.Duration, chunks ...string) policy.Outcome {
	t.Helper()
	clk := &stepClock{now: time.Unix(1_700_000_000, 0)}
	eng, srv := internalServer(t, "features: {default: {max_concurrent: 1}}\n", clk)
	pr := newProcessor(srv, quietStream{ctx: context.Background()})
	send := func(req *extprocv3.ProcessingRequest) {
		clk.advance(step)
		resp := pr.handle(req)
		clk.advance(step) // the scan runs after the reply went out, later
		pr.afterSend(resp)
	}
	send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: headersMsg(true, ":method", "POST", ":path", "/v1/chat/completions")}})
	send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: headersMsg(false, ":status", "200", "content-type", "text/event-stream")}})
	for i, c := range chunks {
		send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: []byte(c), EndOfStream: i == len(chunks)-1}}})
	}
	pr.finish()
	if eng.InFlight() != 0 {
		t.Fatal("the request is still in flight")
	}
	return pr.res.outcome
}

// TestFirstTokenIsTimedAtArrival: the first token is the first chunk with generated content (a
// role chunk is not), timed when its chunk arrived, not when it was scanned after the reply.
func TestFirstTokenIsTimedAtArrival(t *testing.T) {
	const s = time.Second
	// Admitted at 1s (after the request headers' message); response headers at 3s; chunks at
	// 5s (role), 7s (content, scanned at 8s), 9s (the end).
	o := respond(t, s,
		"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n")
	if o.Headers != 2*s || o.TTFB != 6*s || o.Duration != 8*s {
		t.Errorf("headers %v, first token %v, total %v; want 2s, 6s, 8s", o.Headers, o.TTFB, o.Duration)
	}
	if o.StreamError != policy.StreamErrorNone {
		t.Errorf("stream error %v", o.StreamError)
	}

	// No content at all: the wait for a token lasted the whole response.
	o = respond(t, s, "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n", "data: [DONE]\n\n")
	if o.TTFB != o.Duration || o.Headers != 2*s {
		t.Errorf("without content: headers %v, first token %v, total %v; want the first token at the total", o.Headers, o.TTFB, o.Duration)
	}
}

// TestStreamErrorReachesTheOutcome: an error event inside a 200 stream is settled as such.
func TestStreamErrorReachesTheOutcome(t *testing.T) {
	o := respond(t, time.Millisecond,
		"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
		"data: {\"error\":{\"message\":\"Overloaded\",\"type\":\"server_error\",\"code\":null}}\n\n")
	if o.Status != 200 || o.StreamError != policy.StreamErrorServer {
		t.Errorf("status %d, stream error %v; want 200 and a server error", o.Status, o.StreamError)
	}
	o = respond(t, time.Millisecond, "data: {\"error\":{\"type\":\"requests\",\"code\":\"rate_limit_exceeded\"}}\n\n")
	if o.StreamError != policy.StreamErrorRateLimited {
		t.Errorf("stream error %v, want rate limited", o.StreamError)
	}
}

// TestStreamErrorInMetadata: the access log can tell a 200 whose body reported an error.
func TestStreamErrorInMetadata(t *testing.T) {
	for _, tt := range []struct {
		body, want string
	}{
		{"data: {\"error\":{\"type\":\"server_error\"}}\n\n", "server"},
		{"data: {\"error\":{\"code\":\"rate_limit_exceeded\"}}\n\n", "rate_limited"},
		{"data: {\"error\":{\"type\":\"invalid_request_error\"}}\n\n", "client"},
		{"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n", ""},
	} {
		_, srv := internalServer(t, "features: {default: {max_concurrent: 1}}\n", nil)
		pr := newProcessor(srv, quietStream{ctx: context.Background()})
		pr.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
			RequestHeaders: headersMsg(true, ":method", "POST", ":path", "/v1/chat/completions")}})
		pr.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
			ResponseHeaders: headersMsg(false, ":status", "200", "content-type", "text/event-stream")}})
		resp := pr.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: []byte(tt.body), EndOfStream: true}}})
		wire, err := proto.Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		var back extprocv3.ProcessingResponse
		if err := proto.Unmarshal(wire, &back); err != nil {
			t.Fatal(err)
		}
		got := back.GetDynamicMetadata().GetFields()["llm_bulkhead"].GetStructValue().GetFields()["stream_error"].GetStringValue()
		if got != tt.want {
			t.Errorf("%q: stream_error %q, want %q", tt.body, got, tt.want)
		}
		pr.finish()
		srv.Close()
	}
}
