package app

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/internal/throttle"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// newTracerProvider builds the OpenTelemetry pipeline the tracing section describes: an OTLP
// exporter behind a batching processor (spans are queued and sent in the background; when the
// queue is full, spans are dropped rather than slowing requests down). Headers for the
// collector (an API key, say) come from OTEL_EXPORTER_OTLP_HEADERS or
// OTEL_EXPORTER_OTLP_TRACES_HEADERS, which the exporter reads itself, so they never appear in
// the policy or /admin/config. Resource attributes come from OTEL_RESOURCE_ATTRIBUTES, with
// service.name and service.version set here.
func newTracerProvider(ctx context.Context, t config.Tracing, version string) (*sdktrace.TracerProvider, error) {
	exp, err := newSpanExporter(ctx, t)
	if err != nil {
		return nil, err
	}
	attrs := []attribute.KeyValue{attribute.String("service.name", t.ServiceName)}
	if version != "" {
		attrs = append(attrs, attribute.String("service.version", version))
	}
	res, err := resource.New(ctx, resource.WithFromEnv(), resource.WithTelemetrySDK(), resource.WithHost(), resource.WithAttributes(attrs...))
	if err != nil {
		// A malformed OTEL_RESOURCE_ATTRIBUTES still leaves the attributes that could be read.
		res = resource.NewSchemaless(attrs...)
	}
	return sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithResource(res),
		sdktrace.WithSampler(tracingSampler(t)),
	), nil
}

// newSpanExporter returns the OTLP exporter of the section. It does not connect: a collector
// that is not there yet costs dropped batches and a warning, never the start.
func newSpanExporter(ctx context.Context, t config.Tracing) (sdktrace.SpanExporter, error) {
	u, hostPort := t.EndpointURL()
	switch t.Exporter {
	case config.TracingOTLPGRPC:
		opts := []otlptracegrpc.Option{otlptracegrpc.WithTimeout(t.Timeout.D())}
		if u != "" {
			opts = append(opts, otlptracegrpc.WithEndpointURL(u))
		} else {
			opts = append(opts, otlptracegrpc.WithEndpoint(hostPort))
			if t.Plaintext() {
				opts = append(opts, otlptracegrpc.WithInsecure())
			}
		}
		return otlptracegrpc.New(ctx, opts...)
	case config.TracingOTLPHTTP:
		return otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(u), otlptracehttp.WithTimeout(t.Timeout.D()))
	}
	return nil, fmt.Errorf("tracing.exporter %q is not supported", t.Exporter)
}

// tracingSampler is the section's sampler, in OpenTelemetry's terms.
func tracingSampler(t config.Tracing) sdktrace.Sampler {
	switch t.Sampler {
	case config.SamplerAlwaysOn:
		return sdktrace.AlwaysSample()
	case config.SamplerAlwaysOff:
		return sdktrace.NeverSample()
	case config.SamplerTraceIDRatio:
		return sdktrace.TraceIDRatioBased(t.Ratio())
	case config.SamplerParentBasedAlwaysOn:
		return sdktrace.ParentBased(sdktrace.AlwaysSample())
	case config.SamplerParentBasedAlwaysOff:
		return sdktrace.ParentBased(sdktrace.NeverSample())
	}
	return sdktrace.ParentBased(sdktrace.TraceIDRatioBased(t.Ratio()))
}

// exportErrorInterval is the least time between two log lines about spans that could not be
// exported: a collector that is down fails every batch.
const exportErrorInterval = time.Minute

// logTracingErrors sends the OpenTelemetry SDK's errors (a collector that cannot be reached, a
// full queue) to the server's log as warnings, at most one a minute; the lines held back are
// counted in the next one.
func logTracingErrors(log *slog.Logger) {
	var gate throttle.Gate
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		if ok, suppressed := gate.Allow(time.Now(), exportErrorInterval); ok {
			log.Warn("tracing: spans could not be exported", "err", err.Error(), "suppressed", suppressed)
		}
	}))
}

// tracingPipeline is the running tracer provider, nil when tracing is off.
type tracingPipeline struct {
	tp *sdktrace.TracerProvider
}

// startTracing builds the tracing pipeline when the policy turns tracing on, and returns what
// the ext_proc service records spans with (the zero value when off).
func (a *App) startTracing(p *config.Policy) (extproc.Tracing, error) {
	t := p.Tracing
	if !t.On() {
		return extproc.Tracing{}, nil
	}
	tp, err := newTracerProvider(context.Background(), t, a.opts.Build.Version)
	if err != nil {
		return extproc.Tracing{}, fmt.Errorf("tracing: %w", err)
	}
	logTracingErrors(a.log)
	a.tracing = &tracingPipeline{tp: tp}
	endpoint, hostPort := t.EndpointURL()
	if endpoint == "" {
		endpoint = hostPort
	}
	a.log.Info("tracing on", "exporter", t.Exporter, "endpoint", endpoint, "tls", !t.Plaintext(), "sampler", t.Sampler,
		"sample_ratio", t.Ratio(), "service_name", t.ServiceName, "include_tenant", t.Tenant())
	return extproc.Tracing{Provider: tp, OmitTenant: !t.Tenant()}, nil
}

// stopTracing sends the spans still queued and stops the exporter; called once every stream
// has ended, so the last requests' spans are not lost.
func (a *App) stopTracing(ctx context.Context) {
	if a.tracing == nil {
		return
	}
	if err := a.tracing.tp.Shutdown(ctx); err != nil {
		a.log.Warn("tracing: the last spans could not be sent", "err", err.Error())
	}
}
