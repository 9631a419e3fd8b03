package envoysim

import (
	"context"
	"io"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/metadata"
)

// TestUpstreamFilterOpensAStreamPerAttempt: behind the router, the upstream filter runs once
// per attempt: three attempts (a 503, a connect failure, a 200) open three streams, each with
// the filter's initial metadata and the attempt's request headers — the client's x-request-id
// on every one, the router's attempt count — and the attempts that answered send their
// response headers (the connect failure's stream gets none and is reset). The downstream
// filter's stream sees one request and the last attempt's response.
func TestUpstreamFilterOpensAStreamPerAttempt(t *testing.T) {
	type seen struct {
		position string
		received []*extprocv3.ProcessingRequest
		ended    error
	}
	var mu sync.Mutex
	var streams []seen
	srv := startServer(t, func(ts *testServer, s extprocv3.ExternalProcessor_ProcessServer) error {
		var st seen
		if v := metadata.ValueFromIncomingContext(s.Context(), "x-position"); len(v) == 1 {
			st.position = v[0]
		}
		for {
			req, err := s.Recv()
			if err != nil {
				st.ended = err
				break
			}
			st.received = append(st.received, req)
			if err := s.Send(cont(req)); err != nil {
				st.ended = err
				break
			}
		}
		mu.Lock()
		streams = append(streams, st)
		mu.Unlock()
		ts.ends <- serverEnd{}
		return nil
	})
	down := newSim(t, srv.addr, FilterConfig{})
	upCfg := FilterConfig{FailureModeAllow: true, InitialMetadata: Headers{{Key: "x-position", Value: "upstream"}},
		Mode: ProcessingMode{RequestHeader: HeaderSend, ResponseHeader: HeaderSend, RequestTrailer: HeaderSkip, ResponseTrailer: HeaderSkip}}
	up := newSim(t, srv.addr, upCfg)
	attempt := 0
	provider := UpstreamFunc(func(ctx context.Context, req *UpstreamRequest) (*UpstreamResponse, error) {
		attempt++
		if b, _ := io.ReadAll(req.Body); string(b) != "the body" {
			t.Errorf("attempt %d got body %q", attempt, b)
		}
		switch attempt {
		case 1:
			return Respond(503, nil, "busy").Serve(ctx, req)
		case 2:
			return nil, &UpstreamError{Kind: ConnectFailure}
		}
		return Respond(200, H("content-type", "application/json"), `{"ok":true}`).Serve(ctx, req)
	})
	router := Retrying(UpstreamFilter(up, upCfg, provider), RetryPolicy{NumRetries: 2, RetriableStatusCodes: []int{503}, OnFailure: true,
		BackOff: time.Millisecond, IncludeAttemptCount: true})
	res, err := down.RoundTrip(context.Background(), &Request{Method: "POST", Path: "/v1/chat/completions",
		Headers: H("x-request-id", "req-1"), Body: []byte("the body")}, router)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != 200 || string(res.Body) != `{"ok":true}` || attempt != 3 {
		t.Fatalf("status %d body %q after %d attempts, want the third attempt's 200", res.Status, res.Body, attempt)
	}
	for range 4 {
		srv.nextEnd(t)
	}
	mu.Lock()
	defer mu.Unlock()
	var ups []seen
	for _, s := range streams {
		if s.position == "upstream" {
			ups = append(ups, s)
		} else if n := len(s.received); n < 2 || s.received[1].GetResponseHeaders() == nil ||
			s.received[1].GetResponseHeaders().GetHeaders().GetHeaders()[0].GetKey() != ":status" {
			t.Errorf("the downstream stream received %d messages", n)
		}
	}
	if len(ups) != 3 {
		t.Fatalf("%d upstream streams, want one per attempt (3)", len(ups))
	}
	// Streams end in any order; put them in attempt order.
	byAttempt := map[string]seen{}
	for _, s := range ups {
		h := Headers{}
		for _, kv := range s.received[0].GetRequestHeaders().GetHeaders().GetHeaders() {
			h = append(h, Header{Key: kv.GetKey(), Value: string(kv.GetRawValue())})
		}
		if h.Get("x-request-id") != "req-1" {
			t.Errorf("an attempt's stream has x-request-id %q, want the client's", h.Get("x-request-id"))
		}
		byAttempt[h.Get("x-envoy-attempt-count")] = s
	}
	for n, wantStatus := range map[string]string{"1": "503", "2": "", "3": "200"} {
		s, ok := byAttempt[n]
		if !ok {
			t.Fatalf("no stream for attempt %s", n)
		}
		var got string
		if len(s.received) > 1 {
			for _, kv := range s.received[1].GetResponseHeaders().GetHeaders().GetHeaders() {
				if kv.GetKey() == ":status" {
					got = string(kv.GetRawValue())
				}
			}
		}
		if got != wantStatus {
			t.Errorf("attempt %s's stream saw status %q, want %q", n, got, wantStatus)
		}
		if wantStatus == "" && (s.ended == nil || strings.Contains(s.ended.Error(), "EOF")) {
			t.Errorf("the failed attempt's stream ended with %v, want a reset", s.ended)
		}
	}
}

// FuzzUpstreamFilterFromClusterYAML: any input is a filter config or an error, never a panic;
// a config read from a cluster is one the simulator accepts. Seeds: the shipped
// envoy/upstream.yaml, a cluster with no upstream filters, one whose chain does not end with
// upstream_codec.
func FuzzUpstreamFilterFromClusterYAML(f *testing.F) {
	shipped, err := os.ReadFile("../../envoy/upstream.yaml")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(shipped)
	f.Add([]byte(clusterYAML("STATIC", "{pipe: {path: /run/lb.sock}}", "")))
	f.Add([]byte(strings.Replace(string(shipped), "- name: envoy.filters.http.upstream_codec", "- name: envoy.filters.http.other", 1)))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := UpstreamFilterFromClusterYAML(data)
		if err == nil {
			if verr := c.Validate(); verr != nil {
				t.Fatalf("a filter config the simulator refuses (%v) from %q", verr, data)
			}
		}
	})
}

// TestUpstreamFilterFromClusterYAML: the shipped envoy/upstream.yaml gives a headers-only,
// fail-open filter marked by its initial metadata; a cluster without upstream filters, or whose
// chain does not end with upstream_codec, is refused as Envoy refuses it.
func TestUpstreamFilterFromClusterYAML(t *testing.T) {
	shipped, err := os.ReadFile("../../envoy/upstream.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c, err := UpstreamFilterFromClusterYAML(shipped)
	if err != nil {
		t.Fatal(err)
	}
	if !c.FailureModeAllow || c.InitialMetadata.Get("x-llm-bulkhead-filter") != "upstream" || c.Mode.RequestBody != BodyNone || c.Mode.ResponseBody != BodyNone {
		t.Errorf("filter %+v: want fail-open, marked upstream, headers only", c)
	}
	for name, src := range map[string]string{
		"no upstream filters": clusterYAML("STATIC", "{pipe: {path: /run/lb.sock}}", ""),
		"codec not last":      strings.Replace(string(shipped), "- name: envoy.filters.http.upstream_codec", "- name: envoy.filters.http.other", 1),
	} {
		if _, err := UpstreamFilterFromClusterYAML([]byte(src)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}
