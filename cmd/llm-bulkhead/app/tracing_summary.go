package app

import (
	"fmt"
	"io"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// explainTracing prints the tracing section: whether requests' spans are exported, where to
// and which requests.
func explainTracing(w io.Writer, t config.Tracing) {
	if !t.On() {
		fmt.Fprintln(w, "\ntracing: off")
		return
	}
	endpoint, hostPort := t.EndpointURL()
	if endpoint == "" {
		endpoint = hostPort
	}
	tls := "tls"
	if t.Plaintext() {
		tls = "no tls"
	}
	fmt.Fprintf(w, "\ntracing: %s to %s (%s), timeout %s\n", t.Exporter, endpoint, tls, t.Timeout)
	line := func(key, format string, args ...any) {
		fmt.Fprintf(w, "  %-15s %s\n", key+":", fmt.Sprintf(format, args...))
	}
	sampled := ""
	switch t.Sampler {
	case config.SamplerAlwaysOn:
		sampled = "every request"
	case config.SamplerAlwaysOff:
		sampled = "no request"
	case config.SamplerTraceIDRatio:
		sampled = fmt.Sprintf("%g of requests, whatever their parent decided", t.Ratio())
	case config.SamplerParentBasedAlwaysOn:
		sampled = "as the parent trace decided; every request without one"
	case config.SamplerParentBasedAlwaysOff:
		sampled = "as the parent trace decided; no request without one"
	case config.SamplerParentBasedTraceIDRatio:
		sampled = fmt.Sprintf("as the parent trace decided; %g of requests without one", t.Ratio())
	}
	line("sampler", "%s (%s)", t.Sampler, sampled)
	line("service name", "%s", t.ServiceName)
	tenant := "recorded"
	if !t.Tenant() {
		tenant = "left out (tenant-keyed compartments shown as <family>/*)"
	}
	line("tenant", "%s", tenant)
	line("spans", "one llm-bulkhead.request per request (child of Envoy's traceparent or B3 context), llm-bulkhead.queue while it waits for a slot")
}
