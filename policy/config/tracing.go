package config

import (
	"net"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Tracing exports an OpenTelemetry span for every request the server judges, joined to the
// trace Envoy (or the client) started: what the request was classified as, the compartments it
// passed, how long it queued, what was decided and why, and how it was settled. Off unless
// enabled here or by the standard OTEL_* environment variables; a key set in the file wins over
// its OTEL_* variable, which wins over the default (docs/tracing.md). Takes effect on restart.
type Tracing struct {
	// Enabled turns tracing on. Default true when OTEL_EXPORTER_OTLP_ENDPOINT,
	// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_TRACES_EXPORTER=otlp is set (and neither
	// OTEL_SDK_DISABLED=true nor OTEL_TRACES_EXPORTER=none), else false.
	Enabled *bool `koanf:"enabled" json:"enabled,omitempty"`
	// Exporter is the OTLP transport: otlp-grpc or otlp-http. Default from
	// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL (grpc, http/protobuf),
	// else otlp-grpc.
	Exporter string `koanf:"exporter" json:"exporter,omitempty"`
	// Endpoint is where spans are sent. otlp-grpc: host:port, or an http:// or https:// URL whose
	// scheme also says whether to use TLS. otlp-http: an http:// or https:// URL; "/v1/traces"
	// is added when it has no path. Default from OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
	// OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4317 (otlp-grpc) or
	// http://localhost:4318/v1/traces (otlp-http).
	Endpoint string `koanf:"endpoint" json:"endpoint,omitempty"`
	// Insecure sends spans without TLS to a host:port endpoint (a URL's scheme decides for
	// itself). Default from OTEL_EXPORTER_OTLP_TRACES_INSECURE or OTEL_EXPORTER_OTLP_INSECURE,
	// else false.
	Insecure *bool `koanf:"insecure" json:"insecure,omitempty"`
	// Sampler decides which requests are traced, in OpenTelemetry's words: always_on,
	// always_off, traceidratio, parentbased_always_on, parentbased_always_off or
	// parentbased_traceidratio (follow the sampling decision of the trace Envoy or the client
	// started; sample_ratio of the requests that arrive without one). Default from
	// OTEL_TRACES_SAMPLER, else parentbased_traceidratio.
	Sampler string `koanf:"sampler" json:"sampler,omitempty"`
	// SampleRatio is the share of requests traced by the ratio samplers, from 0 to 1. Default
	// from OTEL_TRACES_SAMPLER_ARG, else 1.
	SampleRatio *float64 `koanf:"sample_ratio" json:"sample_ratio,omitempty"`
	// ServiceName is the service.name of the spans. Default from OTEL_SERVICE_NAME, else
	// llm-bulkhead.
	ServiceName string `koanf:"service_name" json:"service_name,omitempty"`
	// Timeout bounds one export of a batch of spans. Default from
	// OTEL_EXPORTER_OTLP_TRACES_TIMEOUT or OTEL_EXPORTER_OTLP_TIMEOUT (milliseconds), else 10s.
	Timeout Duration `koanf:"timeout" json:"timeout,omitempty"`
	// IncludeTenant records the tenant (the llm_bulkhead.tenant attribute, and the tenant's part
	// of tenant-keyed compartment names). Set false where tenant ids must not leave for the
	// tracing backend: the tenant is then left out and compartment names show <family>/*, as
	// metrics do. Default true.
	IncludeTenant *bool `koanf:"include_tenant" json:"include_tenant,omitempty"`
}

// Tracing exporters and samplers, and the section's defaults.
const (
	TracingOTLPGRPC = "otlp-grpc"
	TracingOTLPHTTP = "otlp-http"

	SamplerAlwaysOn                = "always_on"
	SamplerAlwaysOff               = "always_off"
	SamplerTraceIDRatio            = "traceidratio"
	SamplerParentBasedAlwaysOn     = "parentbased_always_on"
	SamplerParentBasedAlwaysOff    = "parentbased_always_off"
	SamplerParentBasedTraceIDRatio = "parentbased_traceidratio"

	DefaultTracingServiceName  = "llm-bulkhead"
	DefaultTracingGRPCEndpoint = "http://localhost:4317"
	DefaultTracingHTTPEndpoint = "http://localhost:4318/v1/traces"
	DefaultTracingTimeout      = 10 * time.Second
	// TracingHTTPPath is the path OTLP/HTTP receivers take traces on.
	TracingHTTPPath = "/v1/traces"
)

var (
	tracingExporters = []string{TracingOTLPGRPC, TracingOTLPHTTP}
	tracingSamplers  = []string{SamplerAlwaysOn, SamplerAlwaysOff, SamplerTraceIDRatio, SamplerParentBasedAlwaysOn,
		SamplerParentBasedAlwaysOff, SamplerParentBasedTraceIDRatio}
)

// maxTracingTimeout bounds tracing.timeout: an export that takes longer is lost anyway, and
// shutdown waits for it.
const maxTracingTimeout = time.Minute

// On reports whether tracing is enabled (after defaults).
func (t *Tracing) On() bool { return t.Enabled != nil && *t.Enabled }

// Tenant reports whether spans may carry the tenant (after defaults).
func (t *Tracing) Tenant() bool { return t.IncludeTenant == nil || *t.IncludeTenant }

// Ratio is the sample ratio (after defaults).
func (t *Tracing) Ratio() float64 {
	if t.SampleRatio == nil {
		return 1
	}
	return *t.SampleRatio
}

// UsesRatio reports whether the sampler reads sample_ratio.
func (t *Tracing) UsesRatio() bool {
	return t.Sampler == SamplerTraceIDRatio || t.Sampler == SamplerParentBasedTraceIDRatio
}

// EndpointURL returns the endpoint as the exporter takes it: a URL (with the OTLP/HTTP path
// for otlp-http), or for a host:port endpoint of otlp-grpc, "" and the host:port.
func (t *Tracing) EndpointURL() (rawURL, hostPort string) {
	if !strings.Contains(t.Endpoint, "://") {
		return "", t.Endpoint
	}
	if t.Exporter == TracingOTLPHTTP {
		if u, err := url.Parse(t.Endpoint); err == nil && (u.Path == "" || u.Path == "/") {
			u.Path = TracingHTTPPath
			return u.String(), ""
		}
	}
	return t.Endpoint, ""
}

// Plaintext reports whether spans are sent without TLS: an http:// endpoint, or insecure for a
// host:port one.
func (t *Tracing) Plaintext() bool {
	if u, _ := t.EndpointURL(); u != "" {
		return strings.HasPrefix(strings.ToLower(u), "http://")
	}
	return t.Insecure != nil && *t.Insecure
}

// The OpenTelemetry environment variables the tracing section reads
// (https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/).
const (
	envOTelDisabled       = "OTEL_SDK_DISABLED"
	envOTelTracesExporter = "OTEL_TRACES_EXPORTER"
	envOTelEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envOTelTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envOTelProtocol       = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envOTelTracesProtocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	envOTelInsecure       = "OTEL_EXPORTER_OTLP_INSECURE"
	envOTelTracesInsecure = "OTEL_EXPORTER_OTLP_TRACES_INSECURE"
	envOTelTimeout        = "OTEL_EXPORTER_OTLP_TIMEOUT"
	envOTelTracesTimeout  = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
	envOTelSampler        = "OTEL_TRACES_SAMPLER"
	envOTelSamplerArg     = "OTEL_TRACES_SAMPLER_ARG"
	envOTelServiceName    = "OTEL_SERVICE_NAME"
)

// fromEnv fills the keys the file (and LLM_BULKHEAD_TRACING__… overrides) left unset from the
// standard OTEL_* variables in env. A value taken from a variable is blamed on it when
// validation finds it wrong; a variable that cannot be read at all is reported here.
func (t *Tracing) fromEnv(ps *problems, env []string) {
	get := func(names ...string) (value, name string) {
		for _, n := range names {
			if v := strings.TrimSpace(lookupEnvVar(env, n)); v != "" {
				return v, n
			}
		}
		return "", ""
	}
	from := func(path, name string) {
		if ps.env == nil {
			ps.env = map[string]string{}
		}
		ps.env[path] = name
	}
	exporter, exporterVar := get(envOTelTracesExporter)
	disabled, disabledVar := get(envOTelDisabled)
	endpoint, endpointVar := get(envOTelTracesEndpoint, envOTelEndpoint)
	if exporter != "" && exporter != "otlp" && exporter != "none" {
		ps.addEnv("tracing.exporter", exporterVar, "%q is not supported: llm-bulkhead exports spans with otlp (or none)", exporter)
	}
	if t.Enabled == nil {
		off := strings.EqualFold(disabled, "true") || exporter == "none"
		on := endpoint != "" || exporter == "otlp"
		if disabled != "" && !strings.EqualFold(disabled, "true") && !strings.EqualFold(disabled, "false") {
			ps.addEnv("tracing.enabled", disabledVar, "%q is not true or false", disabled)
		}
		if on && !off {
			t.Enabled = ptr(true)
		}
	}
	if !t.On() {
		// Variables meant for other programs in the same environment must not make a policy
		// that does not trace invalid.
		return
	}
	if t.Exporter == "" {
		if v, name := get(envOTelTracesProtocol, envOTelProtocol); v != "" {
			switch v {
			case "grpc":
				t.Exporter = TracingOTLPGRPC
			case "http/protobuf":
				t.Exporter = TracingOTLPHTTP
			default:
				ps.addEnv("tracing.exporter", name, "%q is not supported: use grpc or http/protobuf", v)
			}
		}
	}
	if t.Endpoint == "" && endpoint != "" {
		t.Endpoint = endpoint
		if endpointVar == envOTelEndpoint && t.Exporter == TracingOTLPHTTP {
			// The generic variable is a base URL: OTLP/HTTP traces go to its /v1/traces.
			if u, err := url.Parse(endpoint); err == nil && u.Scheme != "" {
				u.Path = strings.TrimSuffix(u.Path, "/") + TracingHTTPPath
				t.Endpoint = u.String()
			}
		}
		from("tracing.endpoint", endpointVar)
	}
	if t.Insecure == nil {
		if v, name := get(envOTelTracesInsecure, envOTelInsecure); v != "" {
			b, err := strconv.ParseBool(v)
			if err != nil {
				ps.addEnv("tracing.insecure", name, "%q is not true or false", v)
			} else {
				t.Insecure = ptr(b)
			}
		}
	}
	if t.Sampler == "" {
		if v, name := get(envOTelSampler); v != "" {
			t.Sampler = v
			from("tracing.sampler", name)
		}
	}
	if t.SampleRatio == nil {
		if v, name := get(envOTelSamplerArg); v != "" {
			r, err := strconv.ParseFloat(v, 64)
			if err != nil {
				ps.addEnv("tracing.sample_ratio", name, "%q is not a number between 0 and 1", v)
			} else {
				t.SampleRatio = ptr(r)
				from("tracing.sample_ratio", name)
			}
		}
	}
	if t.ServiceName == "" {
		if v, name := get(envOTelServiceName); v != "" {
			t.ServiceName = v
			from("tracing.service_name", name)
		}
	}
	if t.Timeout == 0 {
		if v, name := get(envOTelTracesTimeout, envOTelTimeout); v != "" {
			ms, err := strconv.ParseInt(v, 10, 64)
			switch {
			case err != nil || ms <= 0:
				ps.addEnv("tracing.timeout", name, "%q is not a positive number of milliseconds", v)
			case ms > maxTracingTimeout.Milliseconds():
				// Checked here, before the conversion to a Duration can overflow.
				ps.addEnv("tracing.timeout", name, "%q milliseconds is more than the most allowed, %d (%s)", v,
					maxTracingTimeout.Milliseconds(), maxTracingTimeout)
			default:
				t.Timeout = Duration(time.Duration(ms) * time.Millisecond)
				from("tracing.timeout", name)
			}
		}
	}
}

// lookupEnvVar returns the value of name in env ("KEY=value" form), or "".
func lookupEnvVar(env []string, name string) string {
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == name {
			return v
		}
	}
	return ""
}

// applyDefaults fills the section's defaults, only when tracing is on: with it off every key
// stays as written, so validation can refuse the ones that would do nothing.
func (t *Tracing) applyDefaults() {
	if !t.On() {
		return
	}
	t.Exporter = orString(t.Exporter, TracingOTLPGRPC)
	if t.Endpoint == "" {
		t.Endpoint = DefaultTracingGRPCEndpoint
		if t.Exporter == TracingOTLPHTTP {
			t.Endpoint = DefaultTracingHTTPEndpoint
		}
	}
	t.Sampler = orString(t.Sampler, SamplerParentBasedTraceIDRatio)
	if t.SampleRatio == nil && t.UsesRatio() {
		t.SampleRatio = ptr(1.0)
	}
	t.ServiceName = orString(t.ServiceName, DefaultTracingServiceName)
	orDuration(&t.Timeout, DefaultTracingTimeout)
	if t.IncludeTenant == nil {
		t.IncludeTenant = ptr(true)
	}
}

// tracing checks the tracing section. With tracing off every other key it sets would do
// nothing, so each is refused; with it on, every value is checked (defaults are filled).
func (v *validator) tracing() {
	t := v.p.Tracing
	if !t.On() {
		for _, key := range setKeys(reflect.ValueOf(t), "tracing") {
			if key != "tracing.enabled" {
				v.add(key, "is set but tracing.enabled is not true, so it would do nothing: set enabled: true (or an OTLP endpoint in %s), or remove it", envOTelEndpoint)
			}
		}
		return
	}
	exporterOK := slices.Contains(tracingExporters, t.Exporter)
	if !exporterOK {
		v.add("tracing.exporter", "%q is not one of %s", t.Exporter, strings.Join(tracingExporters, ", "))
	}
	if msg := tracingEndpointProblem(t.Endpoint, t.Exporter); msg != "" && exporterOK {
		v.add("tracing.endpoint", "%q %s", t.Endpoint, msg)
	} else if msg == "" && t.Insecure != nil && *t.Insecure && strings.HasPrefix(strings.ToLower(t.Endpoint), "https://") {
		v.add("tracing.insecure", "is true but tracing.endpoint %q asks for TLS: use an http:// endpoint to send without TLS, or remove insecure", t.Endpoint)
	}
	if !slices.Contains(tracingSamplers, t.Sampler) {
		v.add("tracing.sampler", "%q is not one of %s", t.Sampler, strings.Join(tracingSamplers, ", "))
	} else if t.SampleRatio != nil && !t.UsesRatio() {
		v.add("tracing.sample_ratio", "is set but sampler %s does not use it: use traceidratio or parentbased_traceidratio, or remove it", t.Sampler)
	}
	if r := t.SampleRatio; r != nil && !(*r >= 0 && *r <= 1) {
		v.add("tracing.sample_ratio", "must be between 0 and 1, got %g", *r)
	}
	if strings.TrimSpace(t.ServiceName) == "" {
		v.add("tracing.service_name", "must not be empty")
	}
	if t.Timeout <= 0 || t.Timeout.D() > maxTracingTimeout {
		v.add("tracing.timeout", "must be positive and at most %s, got %s", maxTracingTimeout, t.Timeout)
	}
}

// tracingEndpointProblem says what keeps endpoint from being an endpoint of exporter, or "".
func tracingEndpointProblem(endpoint, exporter string) string {
	if !strings.Contains(endpoint, "://") {
		if exporter == TracingOTLPHTTP {
			return "is not a URL: otlp-http needs one like http://collector:4318 (or https://…)"
		}
		if msg := hostPortProblem(endpoint); msg != "" {
			return msg + "; otlp-grpc takes host:port (like collector:4317) or an http:// or https:// URL"
		}
		return ""
	}
	u, err := url.Parse(endpoint)
	if err != nil {
		return "is not a valid URL"
	}
	if s := strings.ToLower(u.Scheme); s != "http" && s != "https" {
		return "must be an http:// or https:// URL"
	}
	if u.Host == "" || u.Hostname() == "" {
		return "has no host"
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return "needs a numeric port between 1 and 65535"
		}
	}
	if _, _, err := net.SplitHostPort(u.Host); err != nil && u.Port() != "" {
		return "has an invalid host:port"
	}
	if exporter == TracingOTLPGRPC && u.Path != "" && u.Path != "/" {
		return "has a path, which gRPC cannot use: give only scheme, host and port"
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return "must not have a query or fragment"
	}
	return ""
}
