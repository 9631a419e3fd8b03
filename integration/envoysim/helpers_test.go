package envoysim

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// script decides the reply to one message; nil means "send nothing".
type script func(n int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse

// serverEnd is how one server-side stream ended: the error of the last
// Recv (io.EOF for a half-close, codes.Canceled for a reset) and what the
// handler received.
type serverEnd struct {
	recvErr  error
	received []*extprocv3.ProcessingRequest
}

// testServer is a scripted ext_proc server on 127.0.0.1:0.
type testServer struct {
	extprocv3.UnimplementedExternalProcessorServer
	addr    string
	handler func(srv extprocv3.ExternalProcessor_ProcessServer) error
	ends    chan serverEnd
	mu      sync.Mutex
	streams int
}

func startServer(t testing.TB, handler func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error) *testServer {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ts := &testServer{addr: lis.Addr().String(), ends: make(chan serverEnd, 8192)}
	ts.handler = func(srv extprocv3.ExternalProcessor_ProcessServer) error { return handler(ts, srv) }
	gs := grpc.NewServer(grpc.MaxRecvMsgSize(MaxMessageSize), grpc.MaxSendMsgSize(MaxMessageSize))
	extprocv3.RegisterExternalProcessorServer(gs, ts)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	t.Cleanup(func() {
		gs.Stop()
		<-done
	})
	return ts
}

func (ts *testServer) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	ts.mu.Lock()
	ts.streams++
	ts.mu.Unlock()
	return ts.handler(srv)
}

func (ts *testServer) streamCount() int {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	return ts.streams
}

// nextEnd waits for the next stream to finish on the server.
func (ts *testServer) nextEnd(t testing.TB) serverEnd {
	t.Helper()
	select {
	case e := <-ts.ends:
		return e
	case <-time.After(10 * time.Second):
		t.Fatal("server stream did not end")
		return serverEnd{}
	}
}

// scripted returns a handler that answers with s until Recv fails, then
// records how the stream ended and returns OK.
func scripted(s script) func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
	return func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
		var got []*extprocv3.ProcessingRequest
		for n := 0; ; n++ {
			req, err := srv.Recv()
			if err != nil {
				ts.ends <- serverEnd{recvErr: err, received: got}
				return nil
			}
			got = append(got, req)
			if resp := s(n, req); resp != nil {
				if err := srv.Send(resp); err != nil {
					ts.ends <- serverEnd{recvErr: err, received: got}
					return nil
				}
			}
		}
	}
}

// cont builds the plain CONTINUE reply of the matching type.
func cont(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	return withCommon(req, &extprocv3.CommonResponse{})
}

func withCommon(req *extprocv3.ProcessingRequest, c *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	switch req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: c}}}
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{Response: c}}}
	case *extprocv3.ProcessingRequest_RequestBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: c}}}
	case *extprocv3.ProcessingRequest_ResponseBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{Response: c}}}
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{HeaderMutation: c.GetHeaderMutation()}}}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{HeaderMutation: c.GetHeaderMutation()}}}
	}
	return &extprocv3.ProcessingResponse{}
}

func continueAll(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	return cont(req)
}

func newSim(t testing.TB, addr string, cfg FilterConfig) *Sim {
	t.Helper()
	s, err := New(addr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func roundTrip(t testing.TB, s *Sim, req *Request, up Upstream) *Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := s.RoundTrip(ctx, req, up)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func kinds(ks ...Kind) []Kind { return ks }

func equalKinds(a, b []Kind) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func isCanceled(err error) bool { return status.Code(err) == codes.Canceled }

func isEOF(err error) bool { return errors.Is(err, io.EOF) }

func hvo(k, v string, appendIt bool) *corev3.HeaderValueOption {
	o := &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}}
	if appendIt {
		//lint:ignore SA1019 Envoy's ext_proc filter reads only this deprecated field.
		o.Append = wrapperspb.Bool(true)
	}
	return o
}
