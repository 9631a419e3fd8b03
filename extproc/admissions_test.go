package extproc_test

import (
	"context"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// TestAdmittedStreamsCountedReleased: every admitted stream is counted when it ends, and counted
// as released too, however it ends; refused streams count in neither.
func TestAdmittedStreamsCountedReleased(t *testing.T) {
	s := serve(t, `
envoy: {max_message_timeout: 10s}
features:
  default: {max_concurrent: 5, requests_per_minute: 4}
`, buffered)
	ok := envoysim.Respond(200, nil, `{"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	sse := envoysim.UpstreamFunc(func(ctx context.Context, r *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		return &envoysim.UpstreamResponse{Status: 200, Headers: envoysim.Headers{{Key: "content-type", Value: "text/event-stream"}},
			Body: envoysim.ChunkSource(1, envoysim.Chunk{Data: []byte("data: {}\n\n")}, envoysim.Chunk{Data: []byte("data: {}\n\n")})}, nil
	})
	cancelled := request()
	cancelled.OnEvent = envoysim.CancelAfterDownstreamChunks(1)
	for _, c := range []struct {
		req *envoysim.Request
		up  envoysim.Upstream
	}{
		{request(), ok},  // normal
		{request(), sse}, // upstream reset mid-body
		{cancelled, sse}, // client gone mid-response
		{request(), envoysim.Failing(envoysim.ConnectFailure)}, // no response headers
		{request(), ok}, // refused: over the request rate
	} {
		if _, err := s.sim.RoundTrip(context.Background(), c.req, c.up); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.srv.ActiveStreams() != 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	ended := counter(t, s.reg, "llm_bulkhead_extproc_admitted_streams_ended_total")
	released := counter(t, s.reg, "llm_bulkhead_extproc_admitted_streams_released_total")
	if ended != 4 || released != 4 {
		t.Errorf("admitted streams ended %v, released %v; want 4 and 4", ended, released)
	}
}
