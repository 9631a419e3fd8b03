package envoysim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

func TestStreamEndsAfterLastExpectedReply(t *testing.T) {
	tests := []struct {
		name       string
		cfg        FilterConfig
		up         Upstream
		wantReason CloseReason
		wantStream StreamEnd
		wantServer func(error) bool
	}{
		{"after response headers reply, reset", FilterConfig{}, Respond(200, nil, "ok"), CloseLastResponse, StreamReset, isCanceled},
		{"after response headers reply, graceful", FilterConfig{GracefulClose: true}, Respond(200, nil, "ok"), CloseLastResponse, StreamHalfClosed, isEOF},
		{"after request headers reply when no response processing", FilterConfig{Mode: ProcessingMode{ResponseHeader: HeaderSkip}}, Respond(200, nil, "ok"), CloseLastResponse, StreamReset, isCanceled},
		{"buffered response closes with the HTTP stream", FilterConfig{Mode: ProcessingMode{ResponseBody: BodyBuffered}}, Respond(200, nil, "ok"), CloseHTTPStreamDone, StreamReset, isCanceled},
		{"optimization disabled closes with the HTTP stream", FilterConfig{DisableStreamCloseOptimization: true}, Respond(200, nil, "ok"), CloseHTTPStreamDone, StreamReset, isCanceled},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, scripted(continueAll))
			s := newSim(t, ts.addr, tc.cfg)
			res := roundTrip(t, s, &Request{}, tc.up)
			end := ts.nextEnd(t)
			if res.CloseReason != tc.wantReason || res.Stream != tc.wantStream || !tc.wantServer(end.recvErr) {
				t.Fatalf("close %v stream %v server saw %v", res.CloseReason, res.Stream, end.recvErr)
			}
			if res.Status != 200 || string(res.Body) != "ok" {
				t.Fatalf("client got %d %q", res.Status, res.Body)
			}
		})
	}
}

func TestGracefulCloseTimesOut(t *testing.T) {
	ts := startServer(t, func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
		for {
			req, err := srv.Recv()
			if err != nil {
				// A server that ignores the half-close until it is reset.
				<-srv.Context().Done()
				ts.ends <- serverEnd{recvErr: srv.Context().Err()}
				return nil
			}
			_ = srv.Send(cont(req))
		}
	})
	s := newSim(t, ts.addr, FilterConfig{GracefulClose: true, RemoteCloseTimeout: 50 * time.Millisecond})
	res := roundTrip(t, s, &Request{}, nil)
	ts.nextEnd(t)
	if res.Stream != StreamHalfCloseTimedOut {
		t.Fatalf("stream %v", res.Stream)
	}
}

func TestClientCancel(t *testing.T) {
	sse := &StaticResponse{Status: 200, Headers: H("content-type", "text/event-stream"), Lockstep: true,
		Chunks: []Chunk{{Data: []byte("data: a\n\n")}, {Data: []byte("data: b\n\n")}, {Data: []byte("data: c\n\n")}}}
	tests := []struct {
		name       string
		cfg        FilterConfig
		hook       func(Event) Action
		wantUp     bool
		wantChunks int
	}{
		{"before the request headers reply", FilterConfig{}, CancelWhenSent(KindRequestHeaders, 1), false, 0},
		{"while the request body is queued", FilterConfig{Mode: ProcessingMode{RequestBody: BodyBuffered}}, CancelWhenSent(KindRequestBody, 1), false, 0},
		{"mid-SSE after two chunks", FilterConfig{Mode: ProcessingMode{ResponseBody: BodyStreamed}}, CancelAfterDownstreamChunks(2), true, 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, scripted(continueAll))
			s := newSim(t, ts.addr, tc.cfg)
			res := roundTrip(t, s, &Request{Body: []byte(`{"stream":true}`), OnEvent: tc.hook}, sse)
			end := ts.nextEnd(t)
			if !res.Canceled || !res.Reset || (res.Upstream != nil) != tc.wantUp || len(res.Chunks) != tc.wantChunks {
				t.Fatalf("canceled %v upstream %v chunks %d", res.Canceled, res.Upstream != nil, len(res.Chunks))
			}
			if res.CloseReason != CloseHTTPStreamDone || !isCanceled(end.recvErr) {
				t.Fatalf("close %v server saw %v", res.CloseReason, end.recvErr)
			}
		})
	}
	t.Run("context cancellation is a downstream reset", func(t *testing.T) {
		ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse { return nil }))
		s := newSim(t, ts.addr, FilterConfig{MessageTimeout: time.Hour - time.Second})
		ctx, cancel := context.WithCancel(context.Background())
		res, err := s.RoundTrip(ctx, &Request{OnEvent: func(e Event) Action {
			if e.Kind == EventSent {
				cancel()
			}
			return Proceed
		}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ts.nextEnd(t)
		if !res.Canceled || res.Upstream != nil {
			t.Fatalf("canceled %v upstream %v", res.Canceled, res.Upstream)
		}
	})
}

func TestUpstreamFailures(t *testing.T) {
	tests := []struct {
		name       string
		up         Upstream
		wantStatus int
		wantReset  bool
		wantReason CloseReason
	}{
		{"connect failure is a local 503", Failing(ConnectFailure), 503, false, CloseHTTPStreamDone},
		{"timeout is a local 504", Failing(UpstreamTimeout), 504, false, CloseHTTPStreamDone},
		{"reset mid-body resets the client", &StaticResponse{Status: 200, ResetAfter: 1, Lockstep: true, Chunks: []Chunk{{Data: []byte("a")}, {Data: []byte("b")}}}, 200, true, CloseLastResponse},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, scripted(continueAll))
			s := newSim(t, ts.addr, FilterConfig{})
			res := roundTrip(t, s, &Request{}, tc.up)
			end := ts.nextEnd(t)
			if res.Status != tc.wantStatus || res.Reset != tc.wantReset || res.UpstreamFailure == nil {
				t.Fatalf("status %d reset %v failure %v", res.Status, res.Reset, res.UpstreamFailure)
			}
			if !tc.wantReset {
				if res.Local != LocalUpstreamFailure || !equalKinds(res.SentKinds(), kinds(KindRequestHeaders)) {
					t.Fatalf("local %v sent %v: local replies are not sent to ext_proc", res.Local, res.SentKinds())
				}
			}
			if res.CloseReason != tc.wantReason || !isCanceled(end.recvErr) {
				t.Fatalf("close %v server saw %v", res.CloseReason, end.recvErr)
			}
		})
	}
}

func TestObservabilityMode(t *testing.T) {
	ts := startServer(t, func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
		var got []*extprocv3.ProcessingRequest
		for {
			req, err := srv.Recv()
			if err != nil {
				ts.ends <- serverEnd{recvErr: err, received: got}
				return nil
			}
			got = append(got, req)
			// Replies are ignored by Envoy in this mode; send a spurious one.
			_ = srv.Send(&extprocv3.ProcessingResponse{})
		}
	})
	s := newSim(t, ts.addr, FilterConfig{ObservabilityMode: true, DeferredCloseTimeout: time.Second,
		Mode: ProcessingMode{ResponseBody: BodyStreamed}})
	res := roundTrip(t, s, &Request{}, &StaticResponse{Status: 200, Chunks: []Chunk{{Data: []byte("a")}, {Data: []byte("b")}}})
	end := ts.nextEnd(t)
	if res.Status != 200 || string(res.Body) != "ab" || res.Stream != StreamDeferredReset || !isCanceled(end.recvErr) {
		t.Fatalf("status %d body %q stream %v server saw %v", res.Status, res.Body, res.Stream, end.recvErr)
	}
	if len(end.received) < 3 {
		t.Fatalf("server got %d messages", len(end.received))
	}
	for _, m := range end.received {
		if !m.GetObservabilityMode() || m.GetProtocolConfig() != nil {
			t.Fatalf("message %v: observability_mode must be set and protocol_config absent", KindOfRequest(m))
		}
	}
	if res.HasProblem(ProblemSpurious) {
		t.Fatal("replies must be ignored in observability mode")
	}
}

func TestAttributesAndMetadata(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	claims, _ := structpb.NewStruct(map[string]any{"tenant": "acme"})
	other, _ := structpb.NewStruct(map[string]any{"x": "y"})
	s := newSim(t, ts.addr, FilterConfig{
		Mode:                 ProcessingMode{RequestBody: BodyBuffered},
		ForwardingNamespaces: []string{"envoy.filters.http.jwt_authn"},
		RequestAttributes:    []string{"request.path", "source.address", "request.id"},
		ResponseAttributes:   []string{"response.code"},
	})
	res := roundTrip(t, s, &Request{
		Path: "/v1/embeddings", Body: []byte("{}"),
		Metadata:   map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": claims, "not.forwarded": other},
		Attributes: map[string]any{"source.address": "10.0.0.1:1234"},
	}, Respond(201, nil, ""))
	ts.nextEnd(t)
	sent := res.Sent()
	attrs := sent[0].GetAttributes()[attributesKey].GetFields()
	if attrs["request.path"].GetStringValue() != "/v1/embeddings" || attrs["source.address"].GetStringValue() != "10.0.0.1:1234" || attrs["request.id"].GetStringValue() == "" {
		t.Fatalf("request attributes %v", attrs)
	}
	if sent[1].GetAttributes() != nil {
		t.Fatal("request attributes are sent once per direction")
	}
	if code := sent[2].GetAttributes()[attributesKey].GetFields()["response.code"].GetNumberValue(); code != 201 {
		t.Fatalf("response.code %v", code)
	}
	for _, m := range sent {
		fm := m.GetMetadataContext().GetFilterMetadata()
		if fm["envoy.filters.http.jwt_authn"].GetFields()["tenant"].GetStringValue() != "acme" || fm["not.forwarded"] != nil {
			t.Fatalf("metadata_context %v", fm)
		}
	}
}

func TestManyConcurrentRoundTrips(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	// Under -race on two cores the in-test server can take longer than the
	// default 200 ms to answer 2000 streams at once.
	s := newSim(t, ts.addr, FilterConfig{MessageTimeout: 30 * time.Second})
	const n = 2000
	start := make(chan struct{})
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			res, err := s.RoundTrip(context.Background(), &Request{Path: fmt.Sprintf("/r/%d", i)}, Respond(200, nil, "ok"))
			switch {
			case err != nil:
				errs <- err
			case res.Status != 200 || res.Upstream == nil || res.Upstream.Path != fmt.Sprintf("/r/%d", i) || len(res.Sent()) != 2:
				errs <- fmt.Errorf("request %d: status %d sent %v", i, res.Status, res.SentKinds())
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		ts.nextEnd(t)
	}
}

func TestRawStream(t *testing.T) {
	ts := startServer(t, func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
		var got []*extprocv3.ProcessingRequest
		for {
			req, err := srv.Recv()
			if err != nil {
				ts.ends <- serverEnd{recvErr: err, received: got}
				return nil
			}
			got = append(got, req)
			if req.GetRequestHeaders() == nil && len(got) == 1 {
				ts.ends <- serverEnd{received: got}
				return errors.New("first message must be request headers")
			}
			_ = srv.Send(cont(req))
		}
	})
	s := newSim(t, ts.addr, FilterConfig{})
	tests := []struct {
		name  string
		first *extprocv3.ProcessingRequest
		end   func(r *RawStream)
		check func(t *testing.T, recvErr error, e serverEnd)
	}{
		{
			name:  "first message not request headers",
			first: &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte("x")}}},
			end:   func(r *RawStream) {},
			check: func(t *testing.T, recvErr error, e serverEnd) {
				if recvErr == nil || errors.Is(recvErr, io.EOF) {
					t.Fatalf("want a gRPC error, got %v", recvErr)
				}
			},
		},
		{
			name:  "half-close after headers",
			first: headersMsg(&dirState{isReq: true, headers: H(":path", "/")}, true),
			end:   func(r *RawStream) { _ = r.CloseSend() },
			check: func(t *testing.T, recvErr error, e serverEnd) {
				if !isEOF(e.recvErr) {
					t.Fatalf("server saw %v", e.recvErr)
				}
			},
		},
		{
			name:  "reset after headers",
			first: headersMsg(&dirState{isReq: true, headers: H(":path", "/")}, true),
			end:   func(r *RawStream) { r.Reset() },
			check: func(t *testing.T, recvErr error, e serverEnd) {
				if !isCanceled(e.recvErr) {
					t.Fatalf("server saw %v", e.recvErr)
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, err := s.OpenRaw(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer r.Reset()
			if err := r.Send(tc.first); err != nil {
				t.Fatal(err)
			}
			_, recvErr := r.Recv()
			tc.end(r)
			e := ts.nextEnd(t)
			if recvErr == nil {
				_, _ = r.Recv()
			}
			tc.check(t, recvErr, e)
		})
	}
}

func TestClosedSim(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	s, err := New(ts.addr, FilterConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.RoundTrip(context.Background(), &Request{}, nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("got %v", err)
	}
	if _, err := s.OpenRaw(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("got %v", err)
	}
}

func TestServerUnreachable(t *testing.T) {
	tests := []struct {
		name       string
		cfg        FilterConfig
		wantStatus int
	}{
		{"fails closed", FilterConfig{}, 500},
		{"fails open", FilterConfig{FailureModeAllow: true}, 200},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newSim(t, "127.0.0.1:1", tc.cfg)
			res := roundTrip(t, s, &Request{}, nil)
			if res.Status != tc.wantStatus || res.Stream != StreamOpenFailed && res.Stream != StreamServerError {
				t.Fatalf("status %d stream %v", res.Status, res.Stream)
			}
		})
	}
}
