package extproc

import (
	"context"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/contrib/propagators/b3"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// Tracing makes the server record an OpenTelemetry span for every request it judges. The zero
// value records nothing, and then the request path neither allocates nor reads a clock for it.
type Tracing struct {
	// Provider makes the spans; nil turns tracing off.
	Provider trace.TracerProvider
	// OmitTenant leaves the tenant out of spans: no llm_bulkhead.tenant attribute, and
	// tenant-keyed compartment names show "<family>/*".
	OmitTenant bool
}

// Span names and the instrumentation scope.
const (
	// SpanRequest covers one request from its headers to the end of its ext_proc stream: the
	// decision, the time upstream and the settlement.
	SpanRequest = "llm-bulkhead.request"
	// SpanQueue covers the time a request waited in a compartment's queue for a slot.
	SpanQueue = "llm-bulkhead.queue"
	// tracerScope is the instrumentation scope spans are recorded under.
	tracerScope = "github.com/llm-bulkhead/llm-bulkhead/extproc"
)

// tracer is a server's tracing, nil when off.
type tracer struct {
	t          trace.Tracer
	prop       propagation.TextMapPropagator
	omitTenant bool
}

func newTracer(t Tracing) *tracer {
	if t.Provider == nil {
		return nil
	}
	return &tracer{
		t: t.Provider.Tracer(tracerScope),
		// W3C trace context and B3 (single b3 header or x-b3-* headers) are read; Zipkin-style
		// Envoy tracers send B3, OpenTelemetry-style ones traceparent.
		prop:       propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, b3.New()),
		omitTenant: t.OmitTenant,
	}
}

// requestTrace is a traced request's spans. Only the stream's goroutine touches it.
type requestTrace struct {
	span trace.Span
	ctx  context.Context
	// queue is open while the request waits for a slot.
	queue    trace.Span
	queuedAt time.Time
	// decided: the decision is recorded; classified: it came from admission, so the request's
	// dimensions are known (a body refused as too large or invalid never got them).
	decided, classified bool
	queueWait           time.Duration
}

// headerCarrier reads the trace context from the request headers Envoy forwarded.
type headerCarrier struct{ p *processor }

func (c headerCarrier) Get(key string) string {
	v, _ := c.p.Header(key)
	// Header aliases the message's bytes; the span keeps what it parses (tracestate) beyond the
	// request, so it gets its own copy.
	return strings.Clone(v)
}
func (headerCarrier) Set(string, string) {}
func (c headerCarrier) Keys() []string {
	keys := make([]string, len(c.p.headers))
	for i, h := range c.p.headers {
		keys[i] = h.Key
	}
	return keys
}

// metadataCarrier reads the trace context from the ext_proc stream's gRPC metadata, where
// Envoy puts the span of its own call to the server when Envoy tracing is on.
type metadataCarrier metadata.MD

func (c metadataCarrier) Get(key string) string {
	if v := metadata.MD(c).Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}
func (metadataCarrier) Set(string, string) {}
func (c metadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// parentContext is the trace the request belongs to. Envoy's own ext_proc span (in the
// stream's gRPC metadata) is the closest parent, so it wins; without it (Envoy tracing off),
// the trace context the request's headers carry; else none, and the request starts a trace.
func (t *tracer) parentContext(p *processor) context.Context {
	if md, ok := metadata.FromIncomingContext(p.ctx); ok {
		if ctx := t.prop.Extract(context.Background(), metadataCarrier(md)); trace.SpanContextFromContext(ctx).IsValid() {
			return ctx
		}
	}
	return t.prop.Extract(context.Background(), headerCarrier{p})
}

// traceStart opens the request's span when its headers arrive.
func (p *processor) traceStart() {
	t := p.srv.tracer
	if t == nil {
		return
	}
	ctx, span := t.t.Start(t.parentContext(p), SpanRequest, trace.WithSpanKind(trace.SpanKindServer))
	if !span.IsRecording() {
		// Not sampled: nothing to record, and nothing to pay for on the rest of the stream.
		return
	}
	p.trace = &requestTrace{span: span, ctx: ctx}
	method, _ := p.Header(":method")
	span.SetAttributes(attribute.String("http.request.method", clipAttr(method)), attribute.String("url.path", clipAttr(p.req.path)))
}

// traceQueued opens the queue span when admission makes the request wait for a slot.
func (p *processor) traceQueued() {
	rt := p.trace
	if rt == nil || rt.queue != nil || rt.decided {
		return
	}
	rt.queuedAt = time.Now()
	_, rt.queue = p.srv.tracer.t.Start(rt.ctx, SpanQueue, trace.WithTimestamp(rt.queuedAt))
}

// traceDecided records when the request was decided, closing its queue span; classified says
// the decision came from admission (the request's dimensions are known). Only the first call
// counts: a refusal after admission reaches it twice.
func (p *processor) traceDecided(d *policy.Decision, classified bool) {
	rt := p.trace
	if rt == nil || rt.decided {
		return
	}
	rt.decided, rt.classified = true, classified
	now := time.Now()
	if rt.queue != nil {
		rt.queueWait = now.Sub(rt.queuedAt)
		outcome := "admitted"
		switch {
		case d.Reason == policy.ReasonCancelled:
			outcome = "cancelled"
		case d.Verdict != policy.Admit:
			outcome = "refused"
		}
		rt.queue.SetAttributes(attribute.String("llm_bulkhead.queue.outcome", outcome),
			attribute.Float64("llm_bulkhead.queue_wait_ms", ms(rt.queueWait)))
		rt.queue.End(trace.WithTimestamp(now))
	}
	rt.span.AddEvent("decided", trace.WithTimestamp(now), trace.WithAttributes(attribute.String("llm_bulkhead.decision", decisionName(d))))
}

// traceSettled records the settlement of an admitted request as an event.
func (p *processor) traceSettled() {
	rt := p.trace
	if rt == nil {
		return
	}
	o, st := p.res.outcome, p.res.settled
	attrs := []attribute.KeyValue{
		attribute.Int("http.response.status_code", o.Status),
		attribute.Int64("llm_bulkhead.tokens.prompt", st.Prompt),
		attribute.Int64("llm_bulkhead.tokens.completion", st.Completion),
		attribute.Int64("llm_bulkhead.tokens.total", st.Total),
		attribute.Bool("llm_bulkhead.usage_reported", o.Usage.Known),
		attribute.Float64("llm_bulkhead.ttfb_ms", ms(o.TTFB)),
		attribute.Float64("llm_bulkhead.upstream_ms", ms(o.Duration)),
	}
	if o.Cancelled {
		attrs = append(attrs, attribute.Bool("llm_bulkhead.cancelled", true))
	}
	if st.Estimated {
		attrs = append(attrs, attribute.Bool("llm_bulkhead.tokens.estimated", true))
	}
	if st.Clamped {
		attrs = append(attrs, attribute.Bool("llm_bulkhead.tokens.clamped", true))
	}
	if o.StreamError != policy.StreamErrorNone {
		attrs = append(attrs, attribute.String("llm_bulkhead.stream_error", streamErrorNames[o.StreamError]))
	}
	rt.span.AddEvent("settled", trace.WithAttributes(attrs...))
}

// traceEnd ends the request's span when its stream is done, with what was decided. A refusal
// is the policy working, not a failure of the server, so it leaves the span's status unset;
// an error status is kept for upstream failures (a 5xx, or an error inside a 2xx stream).
func (p *processor) traceEnd() {
	rt := p.trace
	if rt == nil {
		return
	}
	p.trace = nil
	if rt.queue != nil && !rt.decided {
		rt.queue.End()
	}
	d := p.dec.decision
	span := rt.span
	attrs := make([]attribute.KeyValue, 0, 20)
	if p.req.id != "" {
		// Read at the end: a refusal gives a request that came without one an id.
		attrs = append(attrs, attribute.String("llm_bulkhead.request_id", clipAttr(p.req.id)))
	}
	if rt.classified {
		s := p.snap
		attrs = append(attrs,
			attribute.String("llm_bulkhead.feature", s.FeatureName(d.Dims.Feature)),
			attribute.String("llm_bulkhead.tier", s.TierName(d.Dims.Tier)),
			attribute.String("llm_bulkhead.provider", s.ProviderName(d.Dims.Provider)),
			attribute.String("llm_bulkhead.model", clipAttr(d.Dims.Model)),
			attribute.Int64("llm_bulkhead.estimated_tokens", p.dec.estimate.Total))
		if !p.srv.tracer.omitTenant {
			attrs = append(attrs, attribute.String("llm_bulkhead.tenant", clipAttr(d.Dims.Tenant)))
		}
		if d.OriginalModel != "" {
			attrs = append(attrs, attribute.String("llm_bulkhead.original_model", clipAttr(d.OriginalModel)))
		}
	}
	if rt.decided {
		attrs = append(attrs, attribute.String("llm_bulkhead.decision", decisionName(&d)))
		if d.Reason != "" {
			attrs = append(attrs, attribute.String("llm_bulkhead.reason", string(d.Reason)))
		}
		if d.Compartment != "" {
			attrs = append(attrs, attribute.String("llm_bulkhead.compartment", p.traceName(d.Compartment, d.Dims.Tenant)))
		}
		if p.dec.compartments != "" {
			attrs = append(attrs, attribute.String("llm_bulkhead.compartments", p.traceName(p.dec.compartments, d.Dims.Tenant)))
		}
		if d.Verdict != policy.Admit && d.Reason != policy.ReasonCancelled {
			attrs = append(attrs, attribute.Int64("llm_bulkhead.retry_after_ms", d.RetryAfter.Milliseconds()))
		}
		if rt.queue != nil {
			attrs = append(attrs, attribute.Float64("llm_bulkhead.queue_wait_ms", ms(rt.queueWait)))
		}
	}
	if p.idle.released.Load() {
		attrs = append(attrs, attribute.Bool("llm_bulkhead.released_idle", true))
	}
	if d.Verdict == policy.Admit && p.res.started {
		o := p.res.outcome
		attrs = append(attrs, attribute.Int("http.response.status_code", o.Status))
		switch {
		case o.Status >= 500:
			span.SetStatus(codes.Error, "the provider answered "+strconv.Itoa(o.Status))
		case o.StreamError == policy.StreamErrorServer:
			span.SetStatus(codes.Error, "the provider reported a server error inside the response")
		}
	}
	span.SetAttributes(attrs...)
	span.End()
}

// traceName is a compartment name (or a comma-separated list of them) as spans show it: with
// tenants left out, a part naming the request's tenant becomes "*" (tenant/acme → tenant/*),
// as in metrics.
func (p *processor) traceName(names, tenant string) string {
	if !p.srv.tracer.omitTenant || tenant == "" || !strings.Contains(names, tenant) {
		return names
	}
	list := strings.Split(names, ",")
	for i, n := range list {
		parts := strings.Split(n, "/")
		for j := 1; j < len(parts); j++ {
			if parts[j] == tenant {
				parts[j] = "*"
			}
		}
		list[i] = strings.Join(parts, "/")
	}
	return strings.Join(list, ",")
}

// decisionName is the decision as the dynamic metadata names it, plus "cancelled" for a
// request whose client left while it was queued.
func decisionName(d *policy.Decision) string {
	switch {
	case d.Reason == policy.ReasonCancelled:
		return "cancelled"
	case d.Verdict != policy.Admit:
		return "rejected"
	case d.Rerouted:
		return "rerouted"
	}
	return "admitted"
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// maxAttributeBytes bounds the attributes a client's request can make long (the path, the
// model, the request id): a span is no place for a megabyte of model name.
const maxAttributeBytes = 256

// clipAttr returns s cut to maxAttributeBytes on a character boundary, in memory of its own:
// values read from a message alias its bytes, and a span outlives the request in the export
// queue.
func clipAttr(s string) string {
	if len(s) > maxAttributeBytes {
		n := maxAttributeBytes
		for n > 0 && !utf8.RuneStart(s[n]) {
			n--
		}
		s = s[:n]
	}
	return strings.Clone(s)
}
