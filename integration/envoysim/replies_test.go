package envoysim

import (
	"context"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
)

func immediate(code typev3.StatusCode, body string, hdr ...string) *extprocv3.ProcessingResponse {
	ir := &extprocv3.ImmediateResponse{Status: &typev3.HttpStatus{Code: code}, Body: []byte(body), Details: "rejected by policy"}
	if len(hdr) > 0 {
		ir.Headers = &extprocv3.HeaderMutation{}
		for i := 0; i+1 < len(hdr); i += 2 {
			ir.Headers.SetHeaders = append(ir.Headers.SetHeaders, hvo(hdr[i], hdr[i+1], false))
		}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: ir}}
}

func meta(ns, k, v string) *structpb.Struct {
	inner, _ := structpb.NewStruct(map[string]any{k: v})
	return &structpb.Struct{Fields: map[string]*structpb.Value{ns: structpb.NewStructValue(inner)}}
}

func TestHeaderMutations(t *testing.T) {
	mutation := &extprocv3.HeaderMutation{
		SetHeaders: []*corev3.HeaderValueOption{
			hvo("x-llm-provider", "fallback", false),
			hvo("x-bulkhead-compartment", "chat", false),
			hvo("x-multi", "two", true),
			hvo(":path", "/v2/chat", false),
			hvo("host", "evil.example", false),
			hvo("x-envoy-upstream-rq-timeout-ms", "1", false),
			{Header: &corev3.HeaderValue{Key: "x-value-only", Value: "ignored"}},
		},
		RemoveHeaders: []string{"authorization", ":method"},
	}
	ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		if req.GetRequestHeaders() != nil {
			return withCommon(req, &extprocv3.CommonResponse{HeaderMutation: mutation, ClearRouteCache: true})
		}
		if req.GetResponseHeaders() != nil {
			return withCommon(req, &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{hvo("x-bulkhead-reason", "admitted", false)}}})
		}
		return cont(req)
	}))
	s := newSim(t, ts.addr, FilterConfig{})
	res := roundTrip(t, s, &Request{Path: "/v1/chat", Headers: H("authorization", "k", "x-multi", "one")}, Respond(200, nil, "ok"))
	ts.nextEnd(t)
	up := res.Upstream
	tests := []struct {
		name string
		ok   bool
	}{
		{"set adds a header", up.Headers.Get("x-llm-provider") == "fallback"},
		{"append keeps the old value", len(up.Headers.Values("x-multi")) == 2},
		{"remove drops a header", up.Headers.Get("authorization") == ""},
		{":path may be rewritten", up.Path == "/v2/chat"},
		{":method may not be removed", up.Method == "GET"},
		{"host may not be changed by default", up.Authority == "localhost" && up.Headers.Get("host") == ""},
		{"x-envoy-* may not be changed by default", up.Headers.Get("x-envoy-upstream-rq-timeout-ms") == ""},
		{"value without raw_value sets an empty header", func() bool { v, ok := up.Headers.Lookup("x-value-only"); return ok && v == "" }()},
		{"clear_route_cache with a mutation re-picks the route", up.RouteCacheCleared},
		{"response mutation reaches the client", res.Headers.Get("x-bulkhead-reason") == "admitted"},
		{"rejections are reported", res.HasProblem(ProblemMutationRejected)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if !tc.ok {
				t.Fatalf("upstream %+v client headers %v", up, res.Headers)
			}
		})
	}
}

// TestHeaderValueCharacters: a set_headers value is refused, failing the request, exactly when
// Envoy's HeaderUtility::headerValueIsValid refuses it: any control character but tab, and DEL;
// obs-text (bytes from 0x80, UTF-8 or not) passes.
func TestHeaderValueCharacters(t *testing.T) {
	for _, tc := range []struct {
		value string
		ok    bool
	}{
		{"acme", true}, {"a b", true}, {"a\tb", true}, {"café", true}, {"\x80\xff", true}, {"~!\"#", true}, {"", true},
		{"a\x00b", false}, {"a\rb", false}, {"a\nb", false}, {"a\r\nx-injected: 1", false},
		{"\x01", false}, {"\x08", false}, {"\x0b", false}, {"\x1f", false}, {"a\x7f", false},
	} {
		h := H(":method", "GET", ":path", "/")
		m := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{hvo("x-bulkhead-compartment", tc.value, false)}}
		_, err := applyHeaderMutation(m, &h, false, MutationRules{}, false)
		if ok := err == nil; ok != tc.ok {
			t.Errorf("value %q: accepted %v, Envoy accepts %v (err %v)", tc.value, ok, tc.ok, err)
		}
	}
}

func TestRouteCacheNeedsHeaderMutation(t *testing.T) {
	ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		return withCommon(req, &extprocv3.CommonResponse{ClearRouteCache: true})
	}))
	s := newSim(t, ts.addr, FilterConfig{})
	res := roundTrip(t, s, &Request{}, nil)
	ts.nextEnd(t)
	if res.Upstream.RouteCacheCleared {
		t.Fatal("clear_route_cache without header_mutation must be ignored")
	}
}

func TestContinueAndReplace(t *testing.T) {
	ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		if req.GetRequestHeaders() != nil {
			return withCommon(req, &extprocv3.CommonResponse{
				Status:         extprocv3.CommonResponse_CONTINUE_AND_REPLACE,
				HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{hvo(":method", "PUT", false)}},
				BodyMutation:   &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte("replaced")}},
			})
		}
		return cont(req)
	}))
	s := newSim(t, ts.addr, FilterConfig{Mode: ProcessingMode{RequestBody: BodyBuffered, RequestTrailer: HeaderSend}})
	res := roundTrip(t, s, &Request{Lockstep: true, Chunks: []Chunk{{Data: []byte("original")}}, Trailers: H("x-t", "1")}, nil)
	ts.nextEnd(t)
	if !equalKinds(res.SentKinds(), kinds(KindRequestHeaders, KindResponseHeaders)) {
		t.Fatalf("after CONTINUE_AND_REPLACE nothing more goes for the request: %v", res.SentKinds())
	}
	if string(res.Upstream.Body) != "replaced" || res.Upstream.Method != "PUT" || res.Upstream.Headers.Get("content-length") != "" {
		t.Fatalf("upstream %+v", res.Upstream)
	}
}

func TestModeOverride(t *testing.T) {
	override := func(m *extprocfilterv3.ProcessingMode) script {
		return func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
			r := cont(req)
			if req.GetRequestHeaders() != nil {
				r.ModeOverride = m
			}
			return r
		}
	}
	tests := []struct {
		name  string
		cfg   FilterConfig
		mode  *extprocfilterv3.ProcessingMode
		want  []Kind
		trace string
	}{
		{
			name: "honoured when allowed",
			cfg:  FilterConfig{AllowModeOverride: true},
			mode: &extprocfilterv3.ProcessingMode{ResponseBodyMode: extprocfilterv3.ProcessingMode_BUFFERED},
			want: kinds(KindRequestHeaders, KindResponseHeaders, KindResponseBody),
		},
		{
			name: "ignored when not allowed",
			cfg:  FilterConfig{},
			mode: &extprocfilterv3.ProcessingMode{ResponseHeaderMode: extprocfilterv3.ProcessingMode_SKIP},
			want: kinds(KindRequestHeaders, KindResponseHeaders),
		},
		{
			name: "header-only override turns configured body modes to NONE",
			cfg:  FilterConfig{AllowModeOverride: true, Mode: ProcessingMode{ResponseBody: BodyStreamed}},
			mode: &extprocfilterv3.ProcessingMode{ResponseHeaderMode: extprocfilterv3.ProcessingMode_SEND},
			want: kinds(KindRequestHeaders, KindResponseHeaders),
		},
		{
			name: "DEFAULT header modes keep the configured ones",
			cfg:  FilterConfig{AllowModeOverride: true, Mode: ProcessingMode{ResponseHeader: HeaderSkip}},
			mode: &extprocfilterv3.ProcessingMode{ResponseBodyMode: extprocfilterv3.ProcessingMode_NONE},
			want: kinds(KindRequestHeaders),
		},
		{
			name: "refused by allowed_override_modes",
			cfg:  FilterConfig{AllowModeOverride: true, AllowedOverrideModes: []ProcessingMode{{ResponseBody: BodyBuffered}}},
			mode: &extprocfilterv3.ProcessingMode{ResponseHeaderMode: extprocfilterv3.ProcessingMode_SKIP},
			want: kinds(KindRequestHeaders, KindResponseHeaders),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, scripted(override(tc.mode)))
			s := newSim(t, ts.addr, tc.cfg)
			res := roundTrip(t, s, &Request{}, &StaticResponse{Status: 200, Chunks: []Chunk{{Data: []byte("x")}}})
			ts.nextEnd(t)
			if !equalKinds(res.SentKinds(), tc.want) {
				t.Fatalf("sent %v, want %v", res.SentKinds(), tc.want)
			}
			if res.Status != 200 || string(res.Body) != "x" {
				t.Fatalf("client got %d %q", res.Status, res.Body)
			}
		})
	}
}

func TestModeOverrideOutsideHeadersIgnored(t *testing.T) {
	ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		r := cont(req)
		if req.GetRequestBody() != nil {
			r.ModeOverride = &extprocfilterv3.ProcessingMode{ResponseHeaderMode: extprocfilterv3.ProcessingMode_SKIP}
		}
		return r
	}))
	s := newSim(t, ts.addr, FilterConfig{AllowModeOverride: true, Mode: ProcessingMode{RequestBody: BodyBuffered}})
	res := roundTrip(t, s, &Request{Body: []byte("{}")}, nil)
	ts.nextEnd(t)
	if !equalKinds(res.SentKinds(), kinds(KindRequestHeaders, KindRequestBody, KindResponseHeaders)) {
		t.Fatalf("sent %v", res.SentKinds())
	}
}

func TestImmediateResponse(t *testing.T) {
	tests := []struct {
		name     string
		cfg      FilterConfig
		on       Kind
		wantEnd  func(error) bool
		wantKind StreamEnd
	}{
		{"on request headers, reset", FilterConfig{ReceivingNamespaces: []string{"llm_bulkhead"}}, KindRequestHeaders, isCanceled, StreamReset},
		{"on request headers, graceful half-close", FilterConfig{GracefulClose: true, ReceivingNamespaces: []string{"llm_bulkhead"}}, KindRequestHeaders, isEOF, StreamHalfClosed},
		{"on request body while queued", FilterConfig{Mode: ProcessingMode{RequestBody: BodyBuffered}, ReceivingNamespaces: []string{"llm_bulkhead"}}, KindRequestBody, isCanceled, StreamReset},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
				if KindOfRequest(req) == tc.on {
					r := immediate(typev3.StatusCode_TooManyRequests, `{"error":{"type":"rate_limit_exceeded"}}`, "retry-after", "3", "content-type", "application/json")
					md := meta("llm_bulkhead", "reason", "token_budget")
					md.Fields["other_ns"] = meta("x", "y", "z").Fields["x"]
					r.DynamicMetadata = md
					return r
				}
				return cont(req)
			}))
			s := newSim(t, ts.addr, tc.cfg)
			called := false
			up := UpstreamFunc(func(_ context.Context, r *UpstreamRequest) (*UpstreamResponse, error) {
				called = true
				return &UpstreamResponse{Status: 200}, nil
			})
			res := roundTrip(t, s, &Request{Method: "POST", Body: []byte(`{"model":"m"}`)}, up)
			end := ts.nextEnd(t)
			if res.Status != 429 || res.Local != LocalImmediate || res.Headers.Get("retry-after") != "3" ||
				res.Headers.Get("content-type") != "application/json" || string(res.Body) != `{"error":{"type":"rate_limit_exceeded"}}` {
				t.Fatalf("client got %d %v %q (local %v)", res.Status, res.Headers, res.Body, res.Local)
			}
			if res.LocalDetails != "rejected_by_policy" {
				t.Fatalf("details %q", res.LocalDetails)
			}
			if called || res.Upstream != nil {
				t.Fatal("upstream must not be called after an ImmediateResponse in the request phase")
			}
			if res.DynamicMetadata["llm_bulkhead"].GetFields()["reason"].GetStringValue() != "token_budget" || res.DynamicMetadata["other_ns"] != nil {
				t.Fatalf("dynamic metadata %v", res.DynamicMetadata)
			}
			if res.CloseReason != CloseImmediateResponse || res.Stream != tc.wantKind || !tc.wantEnd(end.recvErr) {
				t.Fatalf("close %v stream %v server saw %v", res.CloseReason, res.Stream, end.recvErr)
			}
		})
	}
}

func TestImmediateResponseStatusDefaults(t *testing.T) {
	ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{Body: []byte("hi")}}}
	}))
	s := newSim(t, ts.addr, FilterConfig{})
	res := roundTrip(t, s, &Request{}, nil)
	ts.nextEnd(t)
	if res.Status != 200 || res.Headers.Get("content-type") != "text/plain" {
		t.Fatalf("got %d %v", res.Status, res.Headers)
	}
}

func TestSpuriousReplies(t *testing.T) {
	wrongType := func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		if req.GetRequestHeaders() != nil {
			return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
		}
		return cont(req)
	}
	emptyOneof := func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		if req.GetRequestHeaders() != nil {
			return &extprocv3.ProcessingResponse{}
		}
		return cont(req)
	}
	disabledImmediate := func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		return immediate(typev3.StatusCode_Forbidden, "no")
	}
	tests := []struct {
		name       string
		s          script
		cfg        FilterConfig
		wantStatus int
		wantUp     bool
	}{
		{"wrong type fails closed", wrongType, FilterConfig{}, 500, false},
		{"wrong type honours status_on_error", wrongType, FilterConfig{StatusOnError: 503}, 503, false},
		{"empty oneof fails closed", emptyOneof, FilterConfig{}, 500, false},
		{"wrong type with failure_mode_allow continues", wrongType, FilterConfig{FailureModeAllow: true}, 200, true},
		{"immediate response when disabled is spurious", disabledImmediate, FilterConfig{DisableImmediateResponse: true}, 500, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, scripted(tc.s))
			s := newSim(t, ts.addr, tc.cfg)
			res := roundTrip(t, s, &Request{}, Respond(200, nil, "ok"))
			end := ts.nextEnd(t)
			if res.Status != tc.wantStatus || (res.Upstream != nil) != tc.wantUp {
				t.Fatalf("status %d upstream %v", res.Status, res.Upstream)
			}
			if !res.HasProblem(ProblemSpurious) || res.CloseReason != CloseSpurious || !isCanceled(end.recvErr) {
				t.Fatalf("problems %v close %v server saw %v", res.Problems, res.CloseReason, end.recvErr)
			}
			if len(res.Sent()) != 1 {
				t.Fatalf("nothing may be sent after a spurious reply: %v", res.SentKinds())
			}
		})
	}
}

func TestMessageTimeout(t *testing.T) {
	never := func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		if req.GetRequestHeaders() != nil {
			return nil
		}
		return cont(req)
	}
	tests := []struct {
		name       string
		cfg        FilterConfig
		wantStatus int
		wantLocal  LocalReply
	}{
		{"fails closed with 504", FilterConfig{MessageTimeout: 30 * time.Millisecond}, 504, LocalMessageTimeout},
		{"504 even with status_on_error", FilterConfig{MessageTimeout: 30 * time.Millisecond, StatusOnError: 503}, 504, LocalMessageTimeout},
		{"fail-open continues without the processor", FilterConfig{MessageTimeout: 30 * time.Millisecond, FailureModeAllow: true}, 200, NotLocal},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, scripted(never))
			s := newSim(t, ts.addr, tc.cfg)
			res := roundTrip(t, s, &Request{}, Respond(200, nil, "ok"))
			end := ts.nextEnd(t)
			if res.Status != tc.wantStatus || res.Local != tc.wantLocal {
				t.Fatalf("status %d local %v", res.Status, res.Local)
			}
			if !res.HasProblem(ProblemTimeout) || res.CloseReason != CloseMessageTimeout || !isCanceled(end.recvErr) {
				t.Fatalf("problems %v close %v server saw %v", res.Problems, res.CloseReason, end.recvErr)
			}
		})
	}
	t.Run("per-request override of message_timeout", func(t *testing.T) {
		ts := startServer(t, scripted(never))
		s := newSim(t, ts.addr, FilterConfig{MessageTimeout: time.Hour - time.Second})
		res := roundTrip(t, s, &Request{MessageTimeout: 20 * time.Millisecond}, nil)
		ts.nextEnd(t)
		if res.Status != 504 {
			t.Fatalf("status %d", res.Status)
		}
	})
}

func TestOverrideMessageTimeout(t *testing.T) {
	type step struct {
		override time.Duration
		wait     time.Duration
	}
	// The server sends override_message_timeout replies, waiting after each,
	// then answers the request headers.
	handler := func(steps []step) func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
		return func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
			var got []*extprocv3.ProcessingRequest
			for {
				req, err := srv.Recv()
				if err != nil {
					ts.ends <- serverEnd{recvErr: err, received: got}
					return nil
				}
				got = append(got, req)
				if req.GetRequestHeaders() != nil {
					for _, st := range steps {
						_ = srv.Send(&extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(st.override)})
						time.Sleep(st.wait)
					}
				}
				if err := srv.Send(cont(req)); err != nil {
					ts.ends <- serverEnd{recvErr: err, received: got}
					return nil
				}
			}
		}
	}
	tests := []struct {
		name        string
		max         time.Duration
		steps       []step
		wantStatus  int
		wantIgnored bool
	}{
		// The message timeout is 500ms: long enough that a loaded machine does not delay the
		// first override past it, while each wait after an ignored override outlasts it.
		{"one override extends the timer", 20 * time.Second, []step{{10 * time.Second, time.Second}}, 200, false},
		{"override above max_message_timeout is ignored", 5 * time.Second, []step{{10 * time.Second, time.Second}}, 504, true},
		{"override without max_message_timeout is ignored", 0, []step{{10 * time.Second, time.Second}}, 504, true},
		{"override under 1ms is ignored", 20 * time.Second, []step{{500 * time.Microsecond, time.Second}}, 504, true},
		{"a second override in the same state is ignored", 20 * time.Second,
			[]step{{750 * time.Millisecond, 50 * time.Millisecond}, {10 * time.Second, 1500 * time.Millisecond}}, 504, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, handler(tc.steps))
			s := newSim(t, ts.addr, FilterConfig{MessageTimeout: 500 * time.Millisecond, MaxMessageTimeout: tc.max})
			res := roundTrip(t, s, &Request{}, nil)
			ts.nextEnd(t)
			if res.Status != tc.wantStatus {
				t.Fatalf("status %d, want %d (problems %v)", res.Status, tc.wantStatus, res.Problems)
			}
			if res.HasProblem(ProblemOverrideIgnored) != tc.wantIgnored {
				t.Fatalf("override problem reporting: %v", res.Problems)
			}
		})
	}
}

func TestServerEndsStream(t *testing.T) {
	closeWith := func(st error) func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
		return func(ts *testServer, srv extprocv3.ExternalProcessor_ProcessServer) error {
			_, err := srv.Recv()
			ts.ends <- serverEnd{recvErr: err}
			return st
		}
	}
	tests := []struct {
		name       string
		st         error
		cfg        FilterConfig
		wantStatus int
		wantUp     bool
		wantStream StreamEnd
	}{
		{"OK means continue without the processor", nil, FilterConfig{}, 200, true, StreamServerClosed},
		{"error status fails closed", status.Error(codes.Internal, "boom"), FilterConfig{}, 500, false, StreamServerError},
		{"error status honours status_on_error", status.Error(codes.Unavailable, "busy"), FilterConfig{StatusOnError: 503}, 503, false, StreamServerError},
		{"error status with failure_mode_allow continues", status.Error(codes.Internal, "boom"), FilterConfig{FailureModeAllow: true}, 200, true, StreamServerError},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, closeWith(tc.st))
			s := newSim(t, ts.addr, tc.cfg)
			res := roundTrip(t, s, &Request{}, Respond(200, nil, "ok"))
			ts.nextEnd(t)
			if res.Status != tc.wantStatus || (res.Upstream != nil) != tc.wantUp || res.Stream != tc.wantStream {
				t.Fatalf("status %d upstream %v stream %v", res.Status, res.Upstream != nil, res.Stream)
			}
			if !equalKinds(res.SentKinds(), kinds(KindRequestHeaders)) {
				t.Fatalf("nothing may be sent after the server ended the stream: %v", res.SentKinds())
			}
		})
	}
}

func TestDynamicMetadataMergesAcrossReplies(t *testing.T) {
	// Given metadata present before the filter and a server that sets some on every reply
	ts := startServer(t, scripted(func(n int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		r := cont(req)
		switch KindOfRequest(req) {
		case KindRequestHeaders:
			r.DynamicMetadata = meta("llm_bulkhead", "decision", "admitted")
			r.DynamicMetadata.Fields["llm_bulkhead"].GetStructValue().Fields["estimate"] = structpb.NewNumberValue(471)
		case KindResponseHeaders:
			r.DynamicMetadata = meta("llm_bulkhead", "decision", "settled")
			r.DynamicMetadata.Fields["llm_bulkhead"].GetStructValue().Fields["tokens"] = structpb.NewNumberValue(42)
		}
		return r
	}))
	s := newSim(t, ts.addr, FilterConfig{ReceivingNamespaces: []string{"llm_bulkhead"}, ForwardingNamespaces: []string{"llm_bulkhead"}})
	res := roundTrip(t, s, &Request{Metadata: map[string]*structpb.Struct{"llm_bulkhead": meta("x", "route", "r1").Fields["x"].GetStructValue()}}, nil)
	end := ts.nextEnd(t)
	// Then a later reply replaces a field of the same name and adds its own; the rest stays
	got := res.DynamicMetadata["llm_bulkhead"].GetFields()
	if len(got) != 3 || got["decision"].GetStringValue() != "settled" || got["tokens"].GetNumberValue() != 42 || got["estimate"].GetNumberValue() != 471 {
		t.Fatalf("result metadata %v", res.DynamicMetadata)
	}
	// And the response headers message forwards what the filter held then: the metadata from
	// before the filter merged with the request headers reply's
	if len(end.received) < 2 {
		t.Fatalf("server received %d messages", len(end.received))
	}
	fwd := end.received[1].GetMetadataContext().GetFilterMetadata()["llm_bulkhead"].GetFields()
	if len(fwd) != 3 || fwd["route"].GetStringValue() != "r1" || fwd["decision"].GetStringValue() != "admitted" {
		t.Fatalf("forwarded metadata %v", end.received[1].GetMetadataContext())
	}
}
