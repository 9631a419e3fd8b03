package envoysim

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

func TestStreamOpenedLazily(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	tests := []struct {
		name       string
		mode       ProcessingMode
		wantStream bool
		wantKinds  []Kind
	}{
		{name: "all skipped opens no stream", mode: ProcessingMode{RequestHeader: HeaderSkip, ResponseHeader: HeaderSkip}},
		{name: "defaults send both header messages", wantStream: true, wantKinds: kinds(KindRequestHeaders, KindResponseHeaders)},
		{name: "response headers only open on the response", mode: ProcessingMode{RequestHeader: HeaderSkip}, wantStream: true, wantKinds: kinds(KindResponseHeaders)},
		{name: "trailer SEND without trailers sends nothing extra", mode: ProcessingMode{RequestTrailer: HeaderSend, ResponseTrailer: HeaderSend}, wantStream: true, wantKinds: kinds(KindRequestHeaders, KindResponseHeaders)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := ts.streamCount()
			s := newSim(t, ts.addr, FilterConfig{Mode: tc.mode})
			res := roundTrip(t, s, &Request{Path: "/v1/models"}, Respond(200, H("content-type", "application/json"), `{"data":[]}`))
			if res.Status != 200 || string(res.Body) != `{"data":[]}` {
				t.Fatalf("client got %d %q", res.Status, res.Body)
			}
			if res.Upstream == nil || res.Upstream.Path != "/v1/models" {
				t.Fatalf("upstream not called correctly: %+v", res.Upstream)
			}
			if got := ts.streamCount() - before; (got == 1) != tc.wantStream {
				t.Fatalf("server saw %d streams, want stream=%v", got, tc.wantStream)
			}
			if !tc.wantStream {
				if res.Stream != StreamNotOpened || len(res.Exchange) != 0 {
					t.Fatalf("stream %v exchange %d", res.Stream, len(res.Exchange))
				}
				return
			}
			ts.nextEnd(t)
			if !equalKinds(res.SentKinds(), tc.wantKinds) {
				t.Fatalf("sent %v, want %v", res.SentKinds(), tc.wantKinds)
			}
		})
	}
}

func TestHeadersMessageShape(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	s := newSim(t, ts.addr, FilterConfig{})
	res := roundTrip(t, s, &Request{
		Method: "GET", Path: "/v1/models?x=1", Authority: "api.example",
		Headers: H("Authorization", "Bearer k", "X-Tenant-Id", "acme"),
	}, Respond(204, H("X-Upstream", "yes"), ""))
	ts.nextEnd(t)
	sent := res.Sent()
	if len(sent) != 2 {
		t.Fatalf("sent %d messages", len(sent))
	}
	t.Run("protocol_config on the first message only", func(t *testing.T) {
		if sent[0].GetProtocolConfig() == nil || sent[1].GetProtocolConfig() != nil {
			t.Fatalf("protocol_config: first %v second %v", sent[0].GetProtocolConfig(), sent[1].GetProtocolConfig())
		}
	})
	t.Run("request pseudo-headers, lower-case keys, raw_value", func(t *testing.T) {
		rh := sent[0].GetRequestHeaders()
		if !rh.GetEndOfStream() {
			t.Fatal("GET headers must carry end_of_stream")
		}
		got := map[string]string{}
		for _, h := range rh.GetHeaders().GetHeaders() {
			if h.GetKey() != strings.ToLower(h.GetKey()) {
				t.Fatalf("key %q not lower-case", h.GetKey())
			}
			if h.GetValue() != "" {
				t.Fatalf("value must be empty, raw_value used: %q", h.GetKey())
			}
			got[h.GetKey()] = string(h.GetRawValue())
		}
		for k, v := range map[string]string{":method": "GET", ":path": "/v1/models?x=1", ":authority": "api.example", ":scheme": "http", "authorization": "Bearer k", "x-tenant-id": "acme"} {
			if got[k] != v {
				t.Fatalf("%s = %q, want %q", k, got[k], v)
			}
		}
		if got["x-request-id"] == "" {
			t.Fatal("x-request-id not added")
		}
	})
	t.Run("response carries :status and end_of_stream for no body", func(t *testing.T) {
		rh := sent[1].GetResponseHeaders()
		if HeadersFromProto(rh.GetHeaders()).Get(":status") != "204" || !rh.GetEndOfStream() {
			t.Fatalf("response headers %v", rh)
		}
	})
	t.Run("metadata_context always present", func(t *testing.T) {
		for _, m := range sent {
			if m.GetMetadataContext() == nil {
				t.Fatal("metadata_context missing")
			}
		}
	})
}

func TestMessageOrderWithBodiesAndTrailers(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	s := newSim(t, ts.addr, FilterConfig{Mode: ProcessingMode{
		RequestBody: BodyBuffered, ResponseBody: BodyStreamed, RequestTrailer: HeaderSend, ResponseTrailer: HeaderSend,
	}})
	up := &StaticResponse{Status: 200, Chunks: []Chunk{{Data: []byte("a")}, {Data: []byte("b")}}, Trailers: H("grpc-status", "0"), Lockstep: true}
	res := roundTrip(t, s, &Request{Path: "/v1/chat/completions", Chunks: []Chunk{{Data: []byte("{}")}}, Trailers: H("x-checksum", "1")}, up)
	ts.nextEnd(t)
	want := kinds(KindRequestHeaders, KindRequestBody, KindRequestTrailers, KindResponseHeaders, KindResponseBody, KindResponseBody, KindResponseTrailers)
	if !equalKinds(res.SentKinds(), want) {
		t.Fatalf("sent %v\nwant %v", res.SentKinds(), want)
	}
	sent := res.Sent()
	if sent[1].GetRequestBody().GetEndOfStream() {
		t.Fatal("buffered body followed by trailers must have end_of_stream=false")
	}
	for _, m := range sent[4:6] {
		if m.GetResponseBody().GetEndOfStream() {
			t.Fatal("no streamed chunk may carry end_of_stream when trailers end the stream")
		}
	}
	if res.Trailers.Get("grpc-status") != "0" || res.Upstream.Trailers.Get("x-checksum") != "1" {
		t.Fatalf("trailers lost: client %v upstream %v", res.Trailers, res.Upstream.Trailers)
	}
	if res.CloseReason != CloseLastResponse {
		t.Fatalf("close reason %v, want last_response after response trailers reply", res.CloseReason)
	}
}

func TestBodyModes(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	big := bytes.Repeat([]byte("x"), 100)
	tests := []struct {
		name      string
		cfg       FilterConfig
		req       *Request
		up        Upstream
		wantKinds []Kind
		check     func(t *testing.T, res *Result)
	}{
		{
			name: "buffered request body is one message with end_of_stream",
			cfg:  FilterConfig{Mode: ProcessingMode{RequestBody: BodyBuffered}},
			req:  &Request{Chunks: []Chunk{{Data: []byte(`{"model":`)}, {Data: []byte(`"m"}`)}}},
			up:   Respond(200, nil, "ok"), wantKinds: kinds(KindRequestHeaders, KindRequestBody, KindResponseHeaders),
			check: func(t *testing.T, res *Result) {
				b := res.Sent()[1].GetRequestBody()
				if string(b.GetBody()) != `{"model":"m"}` || !b.GetEndOfStream() {
					t.Fatalf("body message %q eos=%v", b.GetBody(), b.GetEndOfStream())
				}
				if string(res.Upstream.Body) != `{"model":"m"}` || !res.Upstream.Complete {
					t.Fatalf("upstream got %q", res.Upstream.Body)
				}
			},
		},
		{
			name: "buffered request over the limit is a local 413 and the body never reaches the server",
			cfg:  FilterConfig{Mode: ProcessingMode{RequestBody: BodyBuffered}, BufferLimit: 50},
			req:  &Request{Chunks: []Chunk{{Data: big[:40]}, {Data: big[40:]}}},
			up:   Respond(200, nil, "ok"), wantKinds: kinds(KindRequestHeaders),
			check: func(t *testing.T, res *Result) {
				if res.Status != 413 || res.Local != LocalPayloadTooLarge || res.Upstream != nil {
					t.Fatalf("status %d local %v upstream %v", res.Status, res.Local, res.Upstream)
				}
				if res.Stream != StreamReset || res.CloseReason != CloseHTTPStreamDone {
					t.Fatalf("stream %v reason %v", res.Stream, res.CloseReason)
				}
			},
		},
		{
			name: "buffered response over the limit is a local 500",
			cfg:  FilterConfig{Mode: ProcessingMode{ResponseBody: BodyBuffered}, BufferLimit: 50},
			up:   &StaticResponse{Status: 200, Chunks: []Chunk{{Data: big[:40]}, {Data: big[40:]}}},
			req:  &Request{}, wantKinds: kinds(KindRequestHeaders, KindResponseHeaders),
			check: func(t *testing.T, res *Result) {
				if res.Status != 500 || res.Local != LocalResponseTooLarge {
					t.Fatalf("status %d local %v", res.Status, res.Local)
				}
			},
		},
		{
			name: "streamed request sends one message per chunk in lockstep",
			cfg:  FilterConfig{Mode: ProcessingMode{RequestBody: BodyStreamed}},
			req:  &Request{Lockstep: true, Chunks: []Chunk{{Data: []byte("a")}, {Data: []byte("b")}, {Data: []byte("c")}}},
			up:   Respond(200, nil, ""), wantKinds: kinds(KindRequestHeaders, KindRequestBody, KindRequestBody, KindRequestBody, KindResponseHeaders),
			check: func(t *testing.T, res *Result) {
				s := res.Sent()
				for i, want := range []string{"a", "b", "c"} {
					b := s[1+i].GetRequestBody()
					if string(b.GetBody()) != want || b.GetEndOfStream() != (i == 2) {
						t.Fatalf("chunk %d = %q eos=%v", i, b.GetBody(), b.GetEndOfStream())
					}
				}
				if string(res.Upstream.Body) != "abc" {
					t.Fatalf("upstream got %q", res.Upstream.Body)
				}
			},
		},
		{
			name: "streamed body of unknown length ends with an empty end_of_stream chunk",
			cfg:  FilterConfig{Mode: ProcessingMode{RequestBody: BodyStreamed}},
			req:  &Request{Lockstep: true, BodySource: ReaderSource(strings.NewReader("hello"), 0)},
			up:   Respond(200, nil, ""), wantKinds: kinds(KindRequestHeaders, KindRequestBody, KindRequestBody, KindResponseHeaders),
			check: func(t *testing.T, res *Result) {
				last := res.Sent()[2].GetRequestBody()
				if len(last.GetBody()) != 0 || !last.GetEndOfStream() {
					t.Fatalf("last chunk %q eos=%v", last.GetBody(), last.GetEndOfStream())
				}
			},
		},
		{
			name: "streamed body that arrived before the headers reply goes as one message",
			cfg:  FilterConfig{Mode: ProcessingMode{RequestBody: BodyStreamed}},
			req:  &Request{Chunks: []Chunk{{Data: []byte("a")}, {Data: []byte("b")}}},
			up:   Respond(200, nil, ""),
			check: func(t *testing.T, res *Result) {
				var bodies []string
				for _, m := range res.Sent() {
					if m.GetRequestBody() != nil {
						bodies = append(bodies, string(m.GetRequestBody().GetBody()))
					}
				}
				if strings.Join(bodies, "") != "ab" {
					t.Fatalf("bodies %q", bodies)
				}
			},
		},
		{
			name: "buffered partial sends up to the limit and lets the rest through",
			cfg:  FilterConfig{Mode: ProcessingMode{RequestBody: BodyBufferedPartial}, BufferLimit: 10},
			req:  &Request{Lockstep: true, Chunks: []Chunk{{Data: []byte("0123456")}, {Data: []byte("789abc")}, {Data: []byte("def")}}},
			up:   Respond(200, nil, ""), wantKinds: kinds(KindRequestHeaders, KindRequestBody, KindResponseHeaders),
			check: func(t *testing.T, res *Result) {
				b := res.Sent()[1].GetRequestBody()
				if string(b.GetBody()) != "0123456789abc" || b.GetEndOfStream() {
					t.Fatalf("partial message %q eos=%v", b.GetBody(), b.GetEndOfStream())
				}
				if string(res.Upstream.Body) != "0123456789abcdef" {
					t.Fatalf("upstream got %q", res.Upstream.Body)
				}
			},
		},
		{
			name: "buffered partial under the limit behaves like buffered",
			cfg:  FilterConfig{Mode: ProcessingMode{RequestBody: BodyBufferedPartial}},
			req:  &Request{Body: []byte("small")},
			up:   Respond(200, nil, ""), wantKinds: kinds(KindRequestHeaders, KindRequestBody, KindResponseHeaders),
			check: func(t *testing.T, res *Result) {
				b := res.Sent()[1].GetRequestBody()
				if string(b.GetBody()) != "small" || !b.GetEndOfStream() {
					t.Fatalf("message %q eos=%v", b.GetBody(), b.GetEndOfStream())
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newSim(t, ts.addr, tc.cfg)
			res := roundTrip(t, s, tc.req, tc.up)
			ts.nextEnd(t)
			if tc.wantKinds != nil && !equalKinds(res.SentKinds(), tc.wantKinds) {
				t.Fatalf("sent %v\nwant %v", res.SentKinds(), tc.wantKinds)
			}
			tc.check(t, res)
		})
	}
}

// A streamed response chunk reaches the client only after the processor
// answered for it, even when several chunks are pipelined to the processor.
func TestStreamedChunkForwardedOnlyAfterReply(t *testing.T) {
	release := make(chan struct{})
	ts := startServer(t, scripted(func(n int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		if n == 2 {
			<-release
		}
		return cont(req)
	}))
	s := newSim(t, ts.addr, FilterConfig{Mode: ProcessingMode{ResponseBody: BodyStreamed}})
	gate := make(chan struct{})
	var log []string
	bodiesSent := 0
	req := &Request{OnEvent: func(e Event) Action {
		switch {
		case e.Kind == EventReceived && e.Message == KindResponseHeaders:
			close(gate)
		case e.Kind == EventSent && e.Message == KindResponseBody:
			log = append(log, "sent")
			bodiesSent++
			if bodiesSent == 2 {
				close(release)
			}
		case e.Kind == EventReceived && e.Message == KindResponseBody:
			log = append(log, "reply")
		case e.Kind == EventDownstreamData:
			log = append(log, "client")
		}
		return Proceed
	}}
	up := &StaticResponse{Status: 200, Chunks: []Chunk{{Data: []byte("data: 1\n\n"), Wait: gate}, {Data: []byte("data: 2\n\n")}}}
	res := roundTrip(t, s, req, up)
	ts.nextEnd(t)
	want := "sent,sent,reply,client,reply,client"
	if got := strings.Join(log, ","); got != want {
		t.Fatalf("order %s, want %s", got, want)
	}
	if string(res.Body) != "data: 1\n\ndata: 2\n\n" || len(res.Chunks) != 2 {
		t.Fatalf("client got %q in %d chunks", res.Body, len(res.Chunks))
	}
	if res.CloseReason != CloseLastResponse {
		t.Fatalf("close reason %v, want last_response after the last streamed chunk", res.CloseReason)
	}
}

func TestLargeBodies(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	// Copying megabytes under -race can exceed the 200 ms default.
	s := newSim(t, ts.addr, FilterConfig{Mode: ProcessingMode{RequestBody: BodyBuffered, ResponseBody: BodyBuffered}, BufferLimit: 2 << 20, MessageTimeout: 30 * time.Second})
	body := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	res := roundTrip(t, s, &Request{Body: body}, &StaticResponse{Status: 200, Chunks: []Chunk{{Data: body[:1<<19]}, {Data: body[1<<19:]}}})
	end := ts.nextEnd(t)
	if res.Status != 200 || res.Upstream == nil || !bytes.Equal(res.Body, body) || !bytes.Equal(res.Upstream.Body, body) {
		t.Fatalf("status %d (%v), client %d bytes", res.Status, res.Problems, len(res.Body))
	}
	var got int
	for _, m := range end.received {
		got += len(m.GetRequestBody().GetBody()) + len(m.GetResponseBody().GetBody())
	}
	if got != 2*len(body) {
		t.Fatalf("server received %d body bytes, want %d", got, 2*len(body))
	}
}

func TestRequestValidation(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	s := newSim(t, ts.addr, FilterConfig{})
	tests := []struct {
		name string
		req  *Request
	}{
		{"nil request", nil},
		{"two bodies", &Request{Body: []byte("a"), Chunks: []Chunk{{Data: []byte("b")}}}},
		{"relative path", &Request{Path: "v1"}},
		{"bad per-request filter", &Request{Filter: &FilterConfig{StatusOnError: 42}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := s.RoundTrip(context.Background(), tc.req, nil); err == nil {
				t.Fatal("want an error")
			}
		})
	}
}
