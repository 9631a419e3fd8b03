package app_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// collector is an OTLP receiver on loopback, over gRPC or HTTP, keeping what it is sent.
type collector struct {
	mu       sync.Mutex
	received []*coltracepb.ExportTraceServiceRequest
	addr     string
	coltracepb.UnimplementedTraceServiceServer
}

func (c *collector) Export(_ context.Context, r *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.received = append(c.received, r)
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func startCollector(t *testing.T, overGRPC bool) *collector {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &collector{addr: ln.Addr().String()}
	if overGRPC {
		gs := grpc.NewServer()
		coltracepb.RegisterTraceServiceServer(gs, c)
		go func() { _ = gs.Serve(ln) }()
		t.Cleanup(gs.Stop)
		return c
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if err != nil || r.URL.Path != "/v1/traces" || proto.Unmarshal(body, &req) != nil {
			http.Error(w, "bad export", http.StatusBadRequest)
			return
		}
		_, _ = c.Export(r.Context(), &req)
		w.Header().Set("content-type", "application/x-protobuf")
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		_, _ = w.Write(out)
	})}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })
	return c
}

// spans returns the spans received with their service.name.
func (c *collector) spans() (spans []*tracepb.Span, services []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range c.received {
		for _, rs := range r.ResourceSpans {
			service := ""
			for _, kv := range rs.GetResource().GetAttributes() {
				if kv.Key == "service.name" {
					service = kv.GetValue().GetStringValue()
				}
			}
			for _, ss := range rs.ScopeSpans {
				for _, sp := range ss.Spans {
					spans = append(spans, sp)
					services = append(services, service)
				}
			}
		}
	}
	return spans, services
}

// TestTracingExportsThroughOTLP: tracing configured by the standard OTEL_* variables alone
// exports each request's span to the collector, over gRPC or HTTP, child of the traceparent
// Envoy forwarded; the spans still queued are sent when the server shuts down.
func TestTracingExportsThroughOTLP(t *testing.T) {
	for _, overGRPC := range []bool{true, false} {
		name := map[bool]string{true: "grpc", false: "http"}[overGRPC]
		t.Run(name, func(t *testing.T) {
			c := startCollector(t, overGRPC)
			env := []string{"OTEL_SERVICE_NAME=bulkhead-under-test", "OTEL_EXPORTER_OTLP_ENDPOINT=http://" + c.addr}
			if !overGRPC {
				env = append(env, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf")
			}
			dir := t.TempDir()
			path := filepath.Join(dir, "policy.yaml")
			if err := os.WriteFile(path, []byte(policyWith(5)), 0o644); err != nil {
				t.Fatal(err)
			}
			a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: env, LogOutput: io.Discard})
			if err != nil {
				t.Fatal(err)
			}
			if err := a.Start(); err != nil {
				t.Fatal(err)
			}
			sim, err := envoysim.New(a.GRPCAddr(), envoysim.FilterConfig{})
			if err != nil {
				t.Fatal(err)
			}
			req := &envoysim.Request{Method: "POST", Path: "/v1/chat/completions", Headers: envoysim.Headers{
				{Key: "content-type", Value: "application/json"},
				{Key: "traceparent", Value: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}},
				Body: []byte(`{"model":"m","messages":[]}`)}
			r, err := sim.RoundTrip(context.Background(), req, envoysim.Respond(200, nil, `{"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`))
			sim.Close()
			if err != nil || r.Status != 200 {
				t.Fatalf("%v %v", r, err)
			}
			// The batch is sent every 5 s; shutting down sends it at once.
			a.Shutdown(context.Background())
			spans, services := c.spans()
			if len(spans) != 1 {
				t.Fatalf("%d spans exported, want 1", len(spans))
			}
			sp := spans[0]
			if sp.Name != "llm-bulkhead.request" || services[0] != "bulkhead-under-test" {
				t.Errorf("span %q of service %q", sp.Name, services[0])
			}
			if got := hexOf(sp.TraceId); got != "4bf92f3577b34da6a3ce929d0e0e4736" || hexOf(sp.ParentSpanId) != "00f067aa0ba902b7" {
				t.Errorf("trace %s parent %s", got, hexOf(sp.ParentSpanId))
			}
		})
	}
}

func hexOf(b []byte) string {
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(b))
	for _, x := range b {
		out = append(out, digits[x>>4], digits[x&15])
	}
	return string(out)
}

// TestTracingChangeNeedsRestart: a reload that changes the tracing section is refused, naming
// it, and the running policy stays.
func TestTracingChangeNeedsRestart(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(path, []byte(policyWith(1)), 0o644); err != nil {
		t.Fatal(err)
	}
	a, err := app.New(app.Options{ConfigPath: path, Env: []string{}, LogOutput: io.Discard, GRPCAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(policyWith(2)+"tracing: {enabled: true}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	err = a.Reload("test")
	if err == nil || !strings.Contains(err.Error(), "tracing changed: these take effect only on restart") {
		t.Fatalf("reload turning tracing on: %v", err)
	}
	if limit(a) != 1 {
		t.Error("the refused reload was applied")
	}
}

// TestBadTracingConfigRefusedAtStart: a tracing problem stops the start with the policy's
// problems, blamed on the variable that caused it.
func TestBadTracingConfigRefusedAtStart(t *testing.T) {
	_, err := app.New(app.Options{Env: []string{"OTEL_EXPORTER_OTLP_ENDPOINT=collector"}, LogOutput: io.Discard})
	var ce *app.ConfigError
	if err == nil || !errors.As(err, &ce) || !strings.Contains(err.Error(), `<env>: tracing.endpoint: OTEL_EXPORTER_OTLP_ENDPOINT: "collector" is not a host:port address`) {
		t.Fatalf("got %v", err)
	}
}

// TestExplainTracing: validate --explain says whether requests are traced, where to and which.
func TestExplainTracing(t *testing.T) {
	tests := []struct {
		env  []string
		file string
		want []string
	}{
		{nil, "", []string{"\ntracing: off\n"}},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf", "OTEL_TRACES_SAMPLER_ARG=0.1"}, "",
			[]string{"\ntracing: otlp-http to http://collector:4318/v1/traces (no tls), timeout 10s\n",
				"  sampler:        parentbased_traceidratio (as the parent trace decided; 0.1 of requests without one)\n",
				"  service name:   llm-bulkhead\n", "  tenant:         recorded\n"}},
		{nil, "tracing: {enabled: true, endpoint: collector:4317, sampler: always_on, include_tenant: false, service_name: gw}\n",
			[]string{"\ntracing: otlp-grpc to collector:4317 (tls), timeout 10s\n", "  sampler:        always_on (every request)\n",
				"  service name:   gw\n", "  tenant:         left out (tenant-keyed compartments shown as <family>/*)\n"}},
	}
	for _, tt := range tests {
		dir := t.TempDir()
		path := filepath.Join(dir, "policy.yaml")
		if err := os.WriteFile(path, []byte(policyWith(1)+tt.file), 0o644); err != nil {
			t.Fatal(err)
		}
		p, _, err := app.LoadPolicy(path, tt.env)
		if err != nil {
			t.Fatal(err)
		}
		sum, err := app.Summarize(p)
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		sum.Explain(&b)
		for _, w := range tt.want {
			if !strings.Contains(b.String(), w) {
				t.Errorf("explain lacks %q:\n%s", w, b.String())
			}
		}
	}
}
