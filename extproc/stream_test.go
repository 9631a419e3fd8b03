package extproc_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// memServer is a Server over a real engine, driven in memory without gRPC: tests call Process
// with a memStream and play Envoy's side message by message.
type memServer struct {
	t   testing.TB
	srv *extproc.Server
	eng *policy.Engine
	reg *prometheus.Registry
}

func newMemServer(t testing.TB, yaml string, clock policy.Clock) *memServer {
	t.Helper()
	p, err := config.Load("p.yaml", []byte(yaml), nil)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	reg := prometheus.NewRegistry()
	eng, err := observe.NewEngine(p, policy.Options{Logger: log, Clock: clock}, reg)
	if err != nil {
		t.Fatal(err)
	}
	srv := extproc.NewServer(eng, extproc.Options{Logger: log})
	reg.MustRegister(srv.Collectors()...)
	t.Cleanup(srv.Close)
	return &memServer{t: t, srv: srv, eng: eng, reg: reg}
}

// grpcServer serves a Server for policy yaml over an in-memory gRPC connection as the server
// runs (its codec, which counts buffered bodies as they arrive, streams it can end), and returns
// a client of it. opts are the client's.
func grpcServer(t *testing.T, yaml string, opts ...grpc.DialOption) (*memServer, extprocv3.ExternalProcessorClient) {
	t.Helper()
	return grpcServerWith(t, yaml, nil, opts...)
}

// grpcServerWith is grpcServer with more options for the gRPC server.
func grpcServerWith(t *testing.T, yaml string, serverOpts []grpc.ServerOption, opts ...grpc.DialOption) (*memServer, extprocv3.ExternalProcessorClient) {
	t.Helper()
	m := newMemServer(t, yaml, nil)
	gs := grpc.NewServer(append([]grpc.ServerOption{grpc.MaxRecvMsgSize(4 << 20), m.srv.ServerOption(), extproc.EndableStreams()}, serverOpts...)...)
	extprocv3.RegisterExternalProcessorServer(gs, m.srv)
	ln := bufconn.Listen(1 << 20)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient("passthrough:///bufconn", append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return ln.DialContext(ctx) }),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(4<<20), grpc.MaxCallSendMsgSize(4<<20))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return m, extprocv3.NewExternalProcessorClient(conn)
}

// memStream is one ext_proc stream in memory. Envoy's side sends with send, reads replies from
// out, and ends the stream with close (half-close: Recv returns io.EOF) or cancel (reset: Recv
// returns CANCELED).
type memStream struct {
	grpc.ServerStream
	ctx    context.Context
	cancel context.CancelFunc
	in     chan *extprocv3.ProcessingRequest
	out    chan *extprocv3.ProcessingResponse
	done   chan error // Process's result
}

// open starts Process on a new stream, reset when the test ends if it is still open. Like a
// stream of a gRPC server with EndableStreams, the server can end it.
func (m *memServer) open() *memStream {
	return m.openStream(true)
}

// openStream is open; endable false gives a stream the server cannot end (a gRPC server
// without EndableStreams).
func (m *memServer) openStream(endable bool) *memStream {
	ctx, cancel := context.WithCancel(context.Background())
	m.t.Cleanup(cancel)
	if endable {
		ctx = extproc.Endable(ctx)
	}
	s := &memStream{ctx: ctx, cancel: cancel, in: make(chan *extprocv3.ProcessingRequest),
		out: make(chan *extprocv3.ProcessingResponse, 64), done: make(chan error, 1)}
	go func() { s.done <- m.srv.Process(s) }()
	return s
}

func (s *memStream) Context() context.Context     { return s.ctx }
func (s *memStream) SetHeader(metadata.MD) error  { return nil }
func (s *memStream) SendHeader(metadata.MD) error { return nil }
func (s *memStream) SetTrailer(metadata.MD)       {}

func (s *memStream) Recv() (*extprocv3.ProcessingRequest, error) {
	select {
	case req, ok := <-s.in:
		if !ok {
			return nil, io.EOF
		}
		return req, nil
	case <-s.ctx.Done():
		return nil, status.FromContextError(s.ctx.Err()).Err()
	}
}

// Send hands the test a copy of resp, as gRPC marshals it: the server may build its next reply
// in the same memory once Send returns.
func (s *memStream) Send(resp *extprocv3.ProcessingResponse) error {
	select {
	case s.out <- proto.Clone(resp).(*extprocv3.ProcessingResponse):
		return nil
	case <-s.ctx.Done():
		return status.FromContextError(s.ctx.Err()).Err()
	}
}

// send hands req to the server; it reports false when Process has already returned.
func (s *memStream) send(req *extprocv3.ProcessingRequest) bool {
	select {
	case s.in <- req:
		return true
	case err := <-s.done:
		s.done <- err
		return false
	}
}

// reply returns the next reply that is not a message-timeout override, or nil when Process
// returned without one.
func (s *memStream) reply(t testing.TB) *extprocv3.ProcessingResponse {
	t.Helper()
	for {
		select {
		case r := <-s.out:
			if r.OverrideMessageTimeout != nil && r.Response == nil {
				continue
			}
			return r
		case err := <-s.done:
			s.done <- err
			select {
			case r := <-s.out:
				if r.OverrideMessageTimeout == nil || r.Response != nil {
					return r
				}
			default:
			}
			return nil
		}
	}
}

// close half-closes the stream and returns Process's result.
func (s *memStream) close() error {
	close(s.in)
	err := <-s.done
	s.cancel()
	return err
}

// wait returns Process's result once it has returned on its own.
func (s *memStream) wait() error {
	err := <-s.done
	s.cancel()
	return err
}

// Messages as Envoy sends them.

func headers(end bool, kv ...string) *extprocv3.HttpHeaders {
	h := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Headers = append(h.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return &extprocv3.HttpHeaders{Headers: h, EndOfStream: end}
}

func requestHeaders(path string, end bool, reqMode extprocfilterv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: headers(end,
			":method", "POST", ":path", path, "content-type", "application/json")},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: reqMode, ResponseBodyMode: extprocfilterv3.ProcessingMode_STREAMED},
	}
}

func requestBody(body string, end bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: end}}}
}

func responseHeaders(status string, end bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: headers(end, ":status", status, "content-type", "application/json")}}
}

func responseBody(body string, end bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: end}}}
}

// metric returns the value of a counter or gauge, the one with the given label pairs when the
// metric has labels; 0 when it has no such series yet.
func metric(t testing.TB, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue next
				}
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

// nothingHeld fails the test if the engine or any compartment still counts a request in flight.
func nothingHeld(t testing.TB, eng *policy.Engine) {
	t.Helper()
	if n := eng.InFlight(); n != 0 {
		t.Errorf("engine in flight %d after the stream ended, want 0", n)
	}
	for _, c := range eng.Compartments() {
		if c.InFlight != 0 {
			t.Errorf("compartment %s in flight %d after the stream ended, want 0", c.Name, c.InFlight)
		}
	}
}
