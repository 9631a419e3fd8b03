package extproc

import (
	"context"
	"io"
	"log/slog"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// quietStream is a stream whose replies go nowhere; the test calls the processor directly.
type quietStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s quietStream) Context() context.Context                    { return s.ctx }
func (s quietStream) Send(*extprocv3.ProcessingResponse) error    { return nil }
func (s quietStream) Recv() (*extprocv3.ProcessingRequest, error) { return nil, io.EOF }

func headersMsg(end bool, kv ...string) *extprocv3.HttpHeaders {
	h := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Headers = append(h.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return &extprocv3.HttpHeaders{Headers: h, EndOfStream: end}
}

// internalServer returns a quiet engine and server for the policy file policyYAML, with clock
// as the engine's clock (nil: the real one); the server closes when the test ends.
func internalServer(tb testing.TB, policyYAML string, clock policy.Clock) (*policy.Engine, *Server) {
	tb.Helper()
	p, err := config.Load("p.yaml", []byte(policyYAML), nil)
	if err != nil {
		tb.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	eng, err := policy.NewEngine(p, policy.Options{Logger: log, Clock: clock})
	if err != nil {
		tb.Fatal(err)
	}
	srv := NewServer(eng, Options{Logger: log})
	tb.Cleanup(srv.Close)
	return eng, srv
}

// TestPanicWhileReadingUsageStillReleases is the regression test for a panic in the usage
// scanner at settlement: it came before the ticket was settled, was swallowed, and left the
// request's slots held for good.
func TestPanicWhileReadingUsageStillReleases(t *testing.T) {
	eng, srv := internalServer(t, "features: {default: {max_concurrent: 1}}\n", nil)
	pr := newProcessor(srv, quietStream{ctx: context.Background()})
	pr.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: headersMsg(true, ":method", "GET", ":path", "/v1/models")}})
	if eng.InFlight() != 1 {
		t.Fatalf("not admitted: in flight %d", eng.InFlight())
	}
	pr.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: headersMsg(false, ":status", "200", "content-type", "text/event-stream")}})
	if !pr.res.reading {
		t.Fatal("the response is not being read")
	}
	// The scanner breaks: reading the last chunk panics.
	pr.res.scanner, pr.res.pending = nil, []byte("data: {}\n\n")
	pr.ended(endReset)
	pr.finish()
	if n := eng.InFlight(); n != 0 {
		t.Fatalf("a panic while reading usage left %d request(s) in flight", n)
	}
	if c := eng.Compartments()[0]; c.InFlight != 0 {
		t.Fatalf("compartment %s still holds %d", c.Name, c.InFlight)
	}
}
