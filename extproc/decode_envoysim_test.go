package extproc_test

import (
	"context"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// TestEnvoysMessagesTakeTheFastDecoder: every message of a whole stream, as the simulated
// Envoy sends it (metadata context on each, forwarded namespaces, protocol configuration,
// buffered request body, streamed response, trailers), is decoded by the server's own decoder.
// Should Envoy's messages change shape, this fails instead of the server silently falling back
// to protobuf's slower decoder.
func TestEnvoysMessagesTakeTheFastDecoder(t *testing.T) {
	cfg := buffered
	cfg.ForwardingNamespaces = []string{"envoy.filters.http.jwt_authn"}
	cfg.Mode.RequestTrailer, cfg.Mode.ResponseTrailer = envoysim.HeaderSend, envoysim.HeaderSend
	s := serve(t, policyYAML, cfg)
	req := request()
	req.Metadata = map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": {Fields: map[string]*structpb.Value{
		"sub": structpb.NewStringValue("user-1"), "tenant": structpb.NewStringValue("acme")}}}
	req.Trailers = envoysim.Headers{{Key: "x-checksum", Value: "abc"}}
	up := &envoysim.StaticResponse{Status: 200, Headers: envoysim.Headers{{Key: "content-type", Value: "text/event-stream"}},
		Chunks:   []envoysim.Chunk{{Data: []byte("data: {\"choices\":[]}\n\n")}, {Data: []byte("data: [DONE]\n\n")}},
		Trailers: envoysim.Headers{{Key: "x-upstream", Value: "done"}}}
	res, err := s.sim.RoundTrip(context.Background(), req, up)
	if err != nil {
		t.Fatal(err)
	}
	sent := res.Sent()
	kinds := map[string]bool{}
	for i, m := range sent {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if !extproc.DecodesWithoutProtobuf(b) {
			t.Errorf("message %d left to protobuf's decoder: %v", i, m)
		}
		kinds[string(m.ProtoReflect().WhichOneof(m.ProtoReflect().Descriptor().Oneofs().ByName("request")).Name())] = true
	}
	for _, k := range []string{"request_headers", "request_body", "request_trailers", "response_headers", "response_body", "response_trailers"} {
		if !kinds[k] {
			t.Errorf("the stream had no %s message (sent %d messages)", k, len(sent))
		}
	}
}
