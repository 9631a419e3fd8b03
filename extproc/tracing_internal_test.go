package extproc

import (
	"context"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// TestTracingOffAllocatesNothing: with tracing off, every tracing hook on the request path is a
// nil check: no allocation, no span.
func TestTracingOffAllocatesNothing(t *testing.T) {
	p := &processor{srv: &Server{}}
	d := policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonBulkheadFull, RetryAfter: time.Second}
	allocs := testing.AllocsPerRun(100, func() {
		p.traceStart()
		p.traceQueued()
		p.traceDecided(&d, true)
		p.traceSettled()
		p.traceEnd()
	})
	if allocs != 0 {
		t.Errorf("tracing hooks allocate %v times per request with tracing off", allocs)
	}
	if p.trace != nil {
		t.Error("a span was started with tracing off")
	}
}

// TestTracingUnsampledHoldsNothing: a request the sampler drops keeps no span, so the rest of
// its stream pays nothing for tracing.
func TestTracingUnsampledHoldsNothing(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.NeverSample()))
	defer func() { _ = tp.Shutdown(t.Context()) }()
	p := &processor{srv: &Server{tracer: newTracer(Tracing{Provider: tp})}, ctx: t.Context()}
	p.traceStart()
	if p.trace != nil {
		t.Fatal("an unsampled request keeps a span")
	}
	allocs := testing.AllocsPerRun(100, func() {
		p.traceQueued()
		p.traceDecided(&policy.Decision{Verdict: policy.Admit}, true)
		p.traceSettled()
		p.traceEnd()
	})
	if allocs != 0 {
		t.Errorf("an unsampled request's hooks allocate %v times", allocs)
	}
	if n := len(exp.GetSpans()); n != 0 {
		t.Errorf("%d spans exported", n)
	}
}

// TestTraceNameOmitsTenant: with tenants left out, the parts of compartment names that are the
// request's tenant become "*", and nothing else changes.
func TestTraceNameOmitsTenant(t *testing.T) {
	p := &processor{srv: &Server{tracer: &tracer{omitTenant: true}}}
	tests := []struct{ names, tenant, want string }{
		{"feature/chat,tenant/acme,tier_feature/pro/chat", "acme", "feature/chat,tenant/*,tier_feature/pro/chat"},
		{"tenant_model/acme/gpt", "acme", "tenant_model/*/gpt"},
		{"feature/acmex", "acme", "feature/acmex"},
		{"tenant/_overflow", "acme", "tenant/_overflow"},
		{"feature/chat", "", "feature/chat"},
	}
	for _, tt := range tests {
		if got := p.traceName(tt.names, tt.tenant); got != tt.want {
			t.Errorf("traceName(%q, %q) = %q, want %q", tt.names, tt.tenant, got, tt.want)
		}
	}
	p.srv.tracer.omitTenant = false
	if got := p.traceName("tenant/acme", "acme"); got != "tenant/acme" {
		t.Errorf("with tenants recorded: %q", got)
	}
}

// FuzzTraceContext: whatever trace headers a request and its stream's metadata carry, reading
// the parent never fails, and a parent it finds has real ids.
func FuzzTraceContext(f *testing.F) {
	f.Add("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "congo=t61rcWkgMzE", "", "", "")
	f.Add("", "", "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1", "", "")
	f.Add("", "", "", "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
	f.Add("00-zz-yy-01", "=,=", "0-0-d", "x", "00f067aa0ba902b7")
	f.Add("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", "", "", "", "")
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(f.Context()) }()
	tr := newTracer(Tracing{Provider: tp})
	f.Fuzz(func(t *testing.T, traceparent, tracestate, b3single, b3trace, b3span string) {
		headers := []*corev3.HeaderValue{
			{Key: "traceparent", RawValue: []byte(traceparent)}, {Key: "tracestate", RawValue: []byte(tracestate)},
			{Key: "b3", RawValue: []byte(b3single)}, {Key: "x-b3-traceid", RawValue: []byte(b3trace)}, {Key: "x-b3-spanid", RawValue: []byte(b3span)},
		}
		md := metadata.MD{}
		for _, h := range headers {
			if utf8.Valid(h.RawValue) {
				md.Append(h.Key, string(h.RawValue))
			}
		}
		for _, ctx := range []context.Context{context.Background(), metadata.NewIncomingContext(context.Background(), md)} {
			p := &processor{srv: &Server{tracer: tr}, ctx: ctx, headers: headers}
			sc := trace.SpanContextFromContext(tr.parentContext(p))
			if sc.IsValid() && (!sc.TraceID().IsValid() || !sc.SpanID().IsValid() || !sc.IsRemote()) {
				t.Fatalf("parent %+v", sc)
			}
			p.traceStart()
			// The provider's default sampler follows the parent, and samples every new trace.
			if want := !sc.IsValid() || sc.IsSampled(); (p.trace != nil) != want {
				t.Fatalf("recording %v, want %v for parent %+v", p.trace != nil, want, sc)
			}
			if p.trace == nil {
				continue
			}
			if sc.IsValid() && p.trace.span.SpanContext().TraceID() != sc.TraceID() {
				t.Fatalf("span in trace %s, parent in %s", p.trace.span.SpanContext().TraceID(), sc.TraceID())
			}
			p.traceEnd()
		}
	})
}

// TestClipAttr: long attribute values are cut on a character boundary; short ones are kept.
func TestClipAttr(t *testing.T) {
	if got := clipAttr("gpt-4o"); got != "gpt-4o" {
		t.Errorf("clipAttr kept %q", got)
	}
	long := strings.Repeat("é", maxAttributeBytes) // 2 bytes each
	got := clipAttr(long)
	if len(got) > maxAttributeBytes || len(got) < maxAttributeBytes-1 || !utf8.ValidString(got) {
		t.Errorf("clipAttr gave %d bytes, valid %v", len(got), utf8.ValidString(got))
	}
}
