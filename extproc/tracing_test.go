package extproc_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// tracedPolicy has a chat feature of one slot (a second request queues), a batch feature whose
// token budget refuses any real request, and a compartment per tenant.
const tracedPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    default: chat
    rules: [{header: x-llm-feature}]
  tenant:
    default: anonymous
    rules: [{header: x-tenant-id, trusted: true}]
  model:
    rules: [{body: model}]
features:
  chat: {max_concurrent: 1, max_wait: 5s, tokens_per_minute: 1000000}
  batch: {max_concurrent: 5, tokens_per_minute: 10}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits: {max_concurrent: 100}}
`

var tracedFilter = envoysim.FilterConfig{MaxMessageTimeout: 10 * time.Second,
	Mode: envoysim.ProcessingMode{RequestBody: envoysim.BodyBuffered, ResponseBody: envoysim.BodyStreamed}}

// Trace and span ids of the contexts the tests send.
const (
	clientTrace  = "4bf92f3577b34da6a3ce929d0e0e4736"
	clientSpan   = "00f067aa0ba902b7"
	envoyTrace   = "0af7651916cd43dd8448eb211c80319c"
	envoySpan    = "b7ad6b7169203331"
	clientParent = "00-" + clientTrace + "-" + clientSpan + "-01"
)

type tracedServer struct {
	srv   *extproc.Server
	eng   *policy.Engine
	sim   *envoysim.Sim
	spans *tracetest.InMemoryExporter
}

// serveTraced starts a server recording spans into an in-memory exporter; dial options go to
// the simulator (e.g. one that puts a trace context in the stream's gRPC metadata).
func serveTraced(t *testing.T, tr func(*sdktrace.TracerProvider) extproc.Tracing, opts ...grpc.DialOption) *tracedServer {
	t.Helper()
	p, err := config.Load("p.yaml", []byte(tracedPolicy), nil)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	reg := prometheus.NewRegistry()
	eng, err := observe.NewEngine(p, policy.Options{Logger: log}, reg)
	if err != nil {
		t.Fatal(err)
	}
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	var tracing extproc.Tracing
	if tr != nil {
		tracing = tr(tp)
	}
	srv := extproc.NewServer(eng, extproc.Options{Logger: log, Tracing: tracing})
	reg.MustRegister(srv.Collectors()...)
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(ln) }()
	sim, err := envoysim.New(ln.Addr().String(), tracedFilter, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sim.Close()
		gs.Stop()
		srv.Close()
		_ = tp.Shutdown(context.Background())
	})
	return &tracedServer{srv: srv, eng: eng, sim: sim, spans: exp}
}

func traced(tp *sdktrace.TracerProvider) extproc.Tracing { return extproc.Tracing{Provider: tp} }

func chatRequest(headers ...envoysim.Header) *envoysim.Request {
	r := request()
	r.Headers = append(r.Headers, envoysim.Header{Key: "x-tenant-id", Value: "acme"}, envoysim.Header{Key: "x-request-id", Value: "req-1"})
	r.Headers = append(r.Headers, headers...)
	return r
}

const usageBody = `{"choices":[{"message":{"content":"hello"}}],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}`

// waitSpans waits until the stream's span has ended (the server ends it when Process returns,
// just after the client has its answer) and returns the spans named name.
func (s *tracedServer) waitSpans(t *testing.T, name string, n int) []tracetest.SpanStub {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var got []tracetest.SpanStub
		for _, sp := range s.spans.GetSpans() {
			if sp.Name == name {
				got = append(got, sp)
			}
		}
		if len(got) >= n || time.Now().After(deadline) {
			if len(got) != n {
				t.Fatalf("%d %s spans, want %d", len(got), name, n)
			}
			return got
		}
		time.Sleep(time.Millisecond)
	}
}

func attrs(kvs []attribute.KeyValue) map[string]attribute.Value {
	m := map[string]attribute.Value{}
	for _, kv := range kvs {
		m[string(kv.Key)] = kv.Value
	}
	return m
}

func event(t *testing.T, sp tracetest.SpanStub, name string) map[string]attribute.Value {
	t.Helper()
	for _, e := range sp.Events {
		if e.Name == name {
			return attrs(e.Attributes)
		}
	}
	t.Fatalf("span has no %q event: %+v", name, sp.Events)
	return nil
}

func wantAttrs(t *testing.T, got map[string]attribute.Value, want map[string]any) {
	t.Helper()
	for k, w := range want {
		v, ok := got[k]
		if !ok {
			t.Errorf("attribute %s missing", k)
			continue
		}
		if v.AsInterface() != w {
			t.Errorf("attribute %s = %v (%T), want %v (%T)", k, v.AsInterface(), v.AsInterface(), w, w)
		}
	}
}

// TestTraceAdmittedRequest: an admitted request gives one span, a child of the traceparent
// Envoy forwarded, with its classification, compartments and decision, and a settlement event
// with the upstream status, the tokens settled and the time to first token.
func TestTraceAdmittedRequest(t *testing.T) {
	s := serveTraced(t, traced)
	r, err := s.sim.RoundTrip(context.Background(), chatRequest(envoysim.Header{Key: "traceparent", Value: clientParent}),
		envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}}, usageBody))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	sp := s.waitSpans(t, extproc.SpanRequest, 1)[0]
	if sp.SpanContext.TraceID().String() != clientTrace || sp.Parent.SpanID().String() != clientSpan || !sp.Parent.IsRemote() {
		t.Errorf("trace %s parent %s, want %s %s", sp.SpanContext.TraceID(), sp.Parent.SpanID(), clientTrace, clientSpan)
	}
	a := attrs(sp.Attributes)
	wantAttrs(t, a, map[string]any{
		"llm_bulkhead.feature": "chat", "llm_bulkhead.tenant": "acme", "llm_bulkhead.tier": "none",
		"llm_bulkhead.provider": "default", "llm_bulkhead.model": "m", "llm_bulkhead.decision": "admitted",
		"llm_bulkhead.compartments": "feature/chat,tenant/acme", "llm_bulkhead.request_id": "req-1",
		"http.request.method": "POST", "url.path": "/v1/chat/completions", "http.response.status_code": int64(200),
	})
	for _, k := range []string{"llm_bulkhead.reason", "llm_bulkhead.retry_after_ms", "llm_bulkhead.queue_wait_ms"} {
		if _, ok := a[k]; ok {
			t.Errorf("an admitted request that did not queue has %s", k)
		}
	}
	wantAttrs(t, event(t, sp, "settled"), map[string]any{
		"http.response.status_code": int64(200), "llm_bulkhead.tokens.prompt": int64(7), "llm_bulkhead.tokens.completion": int64(5),
		"llm_bulkhead.tokens.total": int64(12), "llm_bulkhead.usage_reported": true,
	})
	if ttfb := event(t, sp, "settled")["llm_bulkhead.ttfb_ms"].AsFloat64(); ttfb < 0 {
		t.Errorf("ttfb %v", ttfb)
	}
	event(t, sp, "decided")
	if sp.Status.Code != codes.Unset || sp.SpanKind.String() != "server" {
		t.Errorf("status %v kind %v", sp.Status, sp.SpanKind)
	}
	if n := len(s.waitSpans(t, extproc.SpanQueue, 0)); n != 0 {
		t.Errorf("%d queue spans for a request that did not queue", n)
	}
}

// TestTraceQueuedRequest: a request that waits for a slot has a queue span under its request
// span covering the wait, and the wait as an attribute.
func TestTraceQueuedRequest(t *testing.T) {
	s := serveTraced(t, traced)
	release := make(chan struct{})
	var once sync.Once
	hold := envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		once.Do(func() {
			select {
			case <-release:
			case <-ctx.Done():
			}
		})
		return envoysim.Respond(200, nil, usageBody).Serve(ctx, req)
	})
	var wg sync.WaitGroup
	results := make([]*envoysim.Result, 2)
	wg.Add(1)
	go func() {
		defer wg.Done()
		results[0], _ = s.sim.RoundTrip(context.Background(), chatRequest(), hold)
	}()
	waitCompartment(t, s.eng, "feature/chat", func(c policy.CompartmentView) bool { return c.InFlight == 1 })
	wg.Add(1)
	go func() {
		defer wg.Done()
		results[1], _ = s.sim.RoundTrip(context.Background(), chatRequest(envoysim.Header{Key: "traceparent", Value: clientParent}), hold)
	}()
	waitCompartment(t, s.eng, "feature/chat", func(c policy.CompartmentView) bool { return c.Queued == 1 })
	close(release)
	wg.Wait()
	for i, r := range results {
		if r == nil || r.Status != 200 {
			t.Fatalf("request %d: %+v", i, r)
		}
	}
	var queuedSpan tracetest.SpanStub
	for _, sp := range s.waitSpans(t, extproc.SpanRequest, 2) {
		if sp.SpanContext.TraceID().String() == clientTrace {
			queuedSpan = sp
		}
	}
	q := s.waitSpans(t, extproc.SpanQueue, 1)[0]
	if q.Parent.SpanID() != queuedSpan.SpanContext.SpanID() {
		t.Errorf("the queue span's parent is %s, not the queued request's span %s", q.Parent.SpanID(), queuedSpan.SpanContext.SpanID())
	}
	wait := attrs(queuedSpan.Attributes)["llm_bulkhead.queue_wait_ms"].AsFloat64()
	if wait <= 0 || q.EndTime.Before(q.StartTime) {
		t.Errorf("queue wait %v ms, queue span %s → %s", wait, q.StartTime, q.EndTime)
	}
	if got := float64(q.EndTime.Sub(q.StartTime)) / float64(time.Millisecond); got != wait {
		t.Errorf("queue span lasts %v ms, the request says it waited %v ms", got, wait)
	}
	wantAttrs(t, attrs(q.Attributes), map[string]any{"llm_bulkhead.queue.outcome": "admitted"})
	wantAttrs(t, attrs(queuedSpan.Attributes), map[string]any{"llm_bulkhead.decision": "admitted", "llm_bulkhead.compartments": "feature/chat,tenant/acme"})
}

func waitCompartment(t *testing.T, eng *policy.Engine, name string, ok func(policy.CompartmentView) bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		for _, c := range eng.Compartments() {
			if c.Name == name && ok(c) {
				return
			}
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("compartment %s never got to the state waited for", name)
}

// TestTraceRefusedRequest: a refusal is recorded with its reason, compartment and retry-after,
// without a settlement, and does not mark the span as an error: it is the policy working.
func TestTraceRefusedRequest(t *testing.T) {
	s := serveTraced(t, traced)
	batch := func(traceparent string) *envoysim.Request {
		req := chatRequest(envoysim.Header{Key: "x-llm-feature", Value: "batch"}, envoysim.Header{Key: "traceparent", Value: traceparent})
		req.Body = []byte(`{"model":"m","max_tokens":1000,"messages":[{"role":"user","content":"summarise"}]}`)
		return req
	}
	// The first request spends more than the whole budget; the second finds none left.
	first := "00-" + envoyTrace + "-" + envoySpan + "-01"
	if r, err := s.sim.RoundTrip(context.Background(), batch(first), envoysim.Respond(200, nil, usageBody)); err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	r, err := s.sim.RoundTrip(context.Background(), batch(clientParent), envoysim.Respond(200, nil, usageBody))
	if err != nil || r.Status != 429 {
		t.Fatalf("%v %v", r, err)
	}
	var sp tracetest.SpanStub
	for _, x := range s.waitSpans(t, extproc.SpanRequest, 2) {
		if x.SpanContext.TraceID().String() == clientTrace {
			sp = x
		}
	}
	a := attrs(sp.Attributes)
	wantAttrs(t, a, map[string]any{"llm_bulkhead.decision": "rejected", "llm_bulkhead.reason": "token_budget",
		"llm_bulkhead.compartment": "feature/batch", "llm_bulkhead.feature": "batch", "llm_bulkhead.tenant": "acme"})
	if ra := a["llm_bulkhead.retry_after_ms"].AsInt64(); ra <= 0 {
		t.Errorf("retry_after_ms %d", ra)
	}
	if sp.Status.Code != codes.Unset {
		t.Errorf("a refusal set the span status to %v", sp.Status)
	}
	for _, e := range sp.Events {
		if e.Name == "settled" {
			t.Error("a refused request has a settlement event")
		}
	}
}

// TestTraceUpstreamFailure: a 5xx from the provider marks the request's span as an error.
func TestTraceUpstreamFailure(t *testing.T) {
	s := serveTraced(t, traced)
	r, err := s.sim.RoundTrip(context.Background(), chatRequest(), envoysim.Respond(503, nil, `{"error":{"message":"down"}}`))
	if err != nil || r.Status != 503 {
		t.Fatalf("%v %v", r, err)
	}
	sp := s.waitSpans(t, extproc.SpanRequest, 1)[0]
	if sp.Status.Code != codes.Error || !strings.Contains(sp.Status.Description, "503") {
		t.Errorf("status %+v", sp.Status)
	}
	wantAttrs(t, event(t, sp, "settled"), map[string]any{"http.response.status_code": int64(503)})
}

// withMetadata makes the simulator's streams carry md in their gRPC metadata, as Envoy's gRPC
// client does with its own span when Envoy tracing is on.
func withMetadata(kv ...string) grpc.DialOption {
	return grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		return streamer(metadata.AppendToOutgoingContext(ctx, kv...), desc, cc, method, opts...)
	})
}

// TestTraceParentSources: Envoy's own span in the stream's metadata is the parent when present;
// otherwise the request headers' W3C or B3 (single or multiple headers) context; otherwise the
// request starts a trace.
func TestTraceParentSources(t *testing.T) {
	envoyParent := "00-" + envoyTrace + "-" + envoySpan + "-01"
	tests := []struct {
		name          string
		metadata      []string
		headers       []envoysim.Header
		trace, parent string
	}{
		{"metadata wins over headers", []string{"traceparent", envoyParent}, []envoysim.Header{{Key: "traceparent", Value: clientParent}}, envoyTrace, envoySpan},
		{"b3 metadata", []string{"x-b3-traceid", envoyTrace, "x-b3-spanid", envoySpan, "x-b3-sampled", "1"}, nil, envoyTrace, envoySpan},
		{"headers without metadata", nil, []envoysim.Header{{Key: "traceparent", Value: clientParent}}, clientTrace, clientSpan},
		{"b3 single header", nil, []envoysim.Header{{Key: "b3", Value: clientTrace + "-" + clientSpan + "-1"}}, clientTrace, clientSpan},
		{"b3 multiple headers", nil, []envoysim.Header{{Key: "x-b3-traceid", Value: clientTrace}, {Key: "x-b3-spanid", Value: clientSpan}, {Key: "x-b3-sampled", Value: "1"}}, clientTrace, clientSpan},
		{"malformed metadata falls back to headers", []string{"traceparent", "00-zz-yy-01"}, []envoysim.Header{{Key: "traceparent", Value: clientParent}}, clientTrace, clientSpan},
		{"nothing: a new trace", nil, nil, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var opts []grpc.DialOption
			if tt.metadata != nil {
				opts = append(opts, withMetadata(tt.metadata...))
			}
			s := serveTraced(t, traced, opts...)
			r, err := s.sim.RoundTrip(context.Background(), chatRequest(tt.headers...), envoysim.Respond(200, nil, usageBody))
			if err != nil || r.Status != 200 {
				t.Fatalf("%v %v", r, err)
			}
			sp := s.waitSpans(t, extproc.SpanRequest, 1)[0]
			if tt.trace == "" {
				if sp.Parent.IsValid() || !sp.SpanContext.IsValid() {
					t.Errorf("parent %v, span %v: want a new root span", sp.Parent, sp.SpanContext)
				}
				return
			}
			if sp.SpanContext.TraceID().String() != tt.trace || sp.Parent.SpanID().String() != tt.parent {
				t.Errorf("trace %s parent %s, want %s %s", sp.SpanContext.TraceID(), sp.Parent.SpanID(), tt.trace, tt.parent)
			}
		})
	}
}

// TestTraceFollowsParentSampling: a request whose parent was not sampled records nothing (the
// provider's default sampler follows the parent).
func TestTraceFollowsParentSampling(t *testing.T) {
	s := serveTraced(t, traced)
	notSampled := "00-" + clientTrace + "-" + clientSpan + "-00"
	r, err := s.sim.RoundTrip(context.Background(), chatRequest(envoysim.Header{Key: "traceparent", Value: notSampled}), envoysim.Respond(200, nil, usageBody))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	// A sampled request after it is recorded: once its span is there, the first one's would be too.
	r, err = s.sim.RoundTrip(context.Background(), chatRequest(), envoysim.Respond(200, nil, usageBody))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	sp := s.waitSpans(t, extproc.SpanRequest, 1)[0]
	if sp.SpanContext.TraceID().String() == clientTrace {
		t.Error("the request whose parent was not sampled was recorded")
	}
}

// TestTraceOmitTenant: with tenants left out, no span names the tenant, and its compartment is
// shown as the family's.
func TestTraceOmitTenant(t *testing.T) {
	s := serveTraced(t, func(tp *sdktrace.TracerProvider) extproc.Tracing {
		return extproc.Tracing{Provider: tp, OmitTenant: true}
	})
	r, err := s.sim.RoundTrip(context.Background(), chatRequest(), envoysim.Respond(200, nil, usageBody))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	sp := s.waitSpans(t, extproc.SpanRequest, 1)[0]
	a := attrs(sp.Attributes)
	if _, ok := a["llm_bulkhead.tenant"]; ok {
		t.Error("the tenant is recorded")
	}
	wantAttrs(t, a, map[string]any{"llm_bulkhead.compartments": "feature/chat,tenant/*"})
	for _, kv := range sp.Attributes {
		if strings.Contains(kv.Value.String(), "acme") {
			t.Errorf("%s names the tenant: %s", kv.Key, kv.Value.String())
		}
	}
}

// TestTracingOffRecordsNothing: a server without a tracer provider records no span, even with a
// trace context on the request and a provider installed elsewhere in the process.
func TestTracingOffRecordsNothing(t *testing.T) {
	s := serveTraced(t, nil)
	r, err := s.sim.RoundTrip(context.Background(), chatRequest(envoysim.Header{Key: "traceparent", Value: clientParent}), envoysim.Respond(200, nil, usageBody))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	if n := len(s.spans.GetSpans()); n != 0 {
		t.Errorf("%d spans recorded with tracing off", n)
	}
}
