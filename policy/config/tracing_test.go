package config_test

import (
	"net"
	"net/url"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

func ptr[T any](v T) *T { return &v }

// TestTracingOffByDefault: without a tracing section or OTEL_* variables nothing is traced, and
// the section is left as written.
func TestTracingOffByDefault(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(limitsOne), []string{"OTEL_SERVICE_NAME=x", "OTEL_TRACES_SAMPLER=bogus"})
	if err != nil {
		t.Fatal(err)
	}
	if p.Tracing.On() || !reflect.DeepEqual(p.Tracing, config.Tracing{}) {
		t.Errorf("tracing %+v, want off and untouched (OTEL_* variables alone do not turn it on)", p.Tracing)
	}
}

// TestTracingDefaults: enabled: true alone gets the documented defaults.
func TestTracingDefaults(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(limitsOne+"tracing:\n  enabled: true\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	want := config.Tracing{Enabled: ptr(true), Exporter: "otlp-grpc", Endpoint: "http://localhost:4317",
		Sampler: "parentbased_traceidratio", SampleRatio: ptr(1.0), ServiceName: "llm-bulkhead",
		Timeout: config.Duration(10 * time.Second), IncludeTenant: ptr(true)}
	if !reflect.DeepEqual(p.Tracing, want) {
		t.Errorf("got %+v\nwant %+v", p.Tracing, want)
	}
	if !p.Tracing.Plaintext() {
		t.Error("the default endpoint is http://, so it is plaintext")
	}
	p, err = config.Load("p.yaml", []byte(limitsOne+"tracing:\n  enabled: true\n  exporter: otlp-http\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if u, _ := p.Tracing.EndpointURL(); u != "http://localhost:4318/v1/traces" {
		t.Errorf("otlp-http default endpoint %q", u)
	}
}

// TestTracingEndpoints: how each endpoint form reaches the exporter, and when TLS is used.
func TestTracingEndpoints(t *testing.T) {
	tests := []struct {
		exporter, endpoint, insecure string
		url, hostPort                string
		plaintext                    bool
	}{
		{"otlp-grpc", "collector:4317", "", "", "collector:4317", false},
		{"otlp-grpc", "collector:4317", "true", "", "collector:4317", true},
		{"otlp-grpc", "https://collector:4317", "", "https://collector:4317", "", false},
		{"otlp-grpc", "http://collector:4317", "false", "http://collector:4317", "", true},
		{"otlp-http", "https://otlp.example.com", "", "https://otlp.example.com/v1/traces", "", false},
		{"otlp-http", "http://collector:4318/", "", "http://collector:4318/v1/traces", "", true},
		{"otlp-http", "http://collector:4318/custom/traces", "", "http://collector:4318/custom/traces", "", true},
	}
	for _, tt := range tests {
		section := "tracing:\n  enabled: true\n  exporter: " + tt.exporter + "\n  endpoint: " + tt.endpoint + "\n"
		if tt.insecure != "" {
			section += "  insecure: " + tt.insecure + "\n"
		}
		p, err := config.Load("p.yaml", []byte(limitsOne+section), nil)
		if err != nil {
			t.Errorf("%s %s: %v", tt.exporter, tt.endpoint, err)
			continue
		}
		u, hp := p.Tracing.EndpointURL()
		if u != tt.url || hp != tt.hostPort || p.Tracing.Plaintext() != tt.plaintext {
			t.Errorf("%s %s insecure %q: url %q host:port %q plaintext %v, want %q %q %v", tt.exporter, tt.endpoint, tt.insecure,
				u, hp, p.Tracing.Plaintext(), tt.url, tt.hostPort, tt.plaintext)
		}
	}
}

// TestTracingFromEnv: the standard OTEL_* variables turn tracing on and fill what the file
// leaves out; what the file says wins.
func TestTracingFromEnv(t *testing.T) {
	env := []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector:4318",
		"OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
		"OTEL_TRACES_SAMPLER=traceidratio",
		"OTEL_TRACES_SAMPLER_ARG=0.25",
		"OTEL_SERVICE_NAME=gateway-bulkhead",
		"OTEL_EXPORTER_OTLP_TIMEOUT=2500",
	}
	p, err := config.Load("p.yaml", []byte(limitsOne), env)
	if err != nil {
		t.Fatal(err)
	}
	want := config.Tracing{Enabled: ptr(true), Exporter: "otlp-http", Endpoint: "http://otel-collector:4318/v1/traces",
		Sampler: "traceidratio", SampleRatio: ptr(0.25), ServiceName: "gateway-bulkhead",
		Timeout: config.Duration(2500 * time.Millisecond), IncludeTenant: ptr(true)}
	if !reflect.DeepEqual(p.Tracing, want) {
		t.Errorf("got %+v\nwant %+v", p.Tracing, want)
	}

	// The file wins key by key; the traces-specific variable wins over the generic one and is
	// taken as it is.
	file := limitsOne + "tracing:\n  service_name: from-file\n  sample_ratio: 0.5\n"
	env2 := slices.Concat(env, []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=https://traces.example.com/otlp/v1/traces", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc"})
	_, err = config.Load("p.yaml", []byte(file), env2)
	if err == nil {
		t.Fatal("grpc with a URL path loaded")
	}
	if !strings.Contains(err.Error(), "<env>: tracing.endpoint: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:") {
		t.Errorf("the endpoint's problem is not blamed on its variable:\n%v", err)
	}
	env2[len(env2)-1] = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf"
	p, err = config.Load("p.yaml", []byte(file), env2)
	if err != nil {
		t.Fatal(err)
	}
	tr := p.Tracing
	if tr.ServiceName != "from-file" || tr.Ratio() != 0.5 || tr.Endpoint != "https://traces.example.com/otlp/v1/traces" || tr.Exporter != "otlp-http" {
		t.Errorf("file over env: %+v", tr)
	}

	// Disabled by the SDK's own switches unless the file says enabled: true.
	for _, off := range []string{"OTEL_SDK_DISABLED=true", "OTEL_TRACES_EXPORTER=none"} {
		p, err = config.Load("p.yaml", []byte(limitsOne), slices.Concat(env, []string{off}))
		if err != nil || p.Tracing.On() {
			t.Errorf("%s: on %v, err %v", off, p != nil && p.Tracing.On(), err)
		}
		p, err = config.Load("p.yaml", []byte(limitsOne+"tracing: {enabled: true}\n"), slices.Concat(env, []string{off}))
		if err != nil || !p.Tracing.On() {
			t.Errorf("%s with enabled: true in the file: err %v", off, err)
		}
	}
	// OTEL_TRACES_EXPORTER=otlp alone turns it on, with the default endpoint.
	p, err = config.Load("p.yaml", []byte(limitsOne), []string{"OTEL_TRACES_EXPORTER=otlp"})
	if err != nil || !p.Tracing.On() || p.Tracing.Endpoint != "http://localhost:4317" {
		t.Errorf("OTEL_TRACES_EXPORTER=otlp: %+v %v", p, err)
	}
	// enabled: false in the file keeps it off whatever the environment says.
	p, err = config.Load("p.yaml", []byte(limitsOne+"tracing: {enabled: false}\n"), env)
	if err != nil || p.Tracing.On() {
		t.Errorf("enabled: false with OTEL_* set: %+v %v", p, err)
	}
	// LLM_BULKHEAD_TRACING__… overrides are the file's own keys.
	p, err = config.Load("p.yaml", []byte(limitsOne), slices.Concat(env, []string{"LLM_BULKHEAD_TRACING__SERVICE_NAME=override"}))
	if err != nil || p.Tracing.ServiceName != "override" {
		t.Errorf("policy override: %+v %v", p, err)
	}
}

// TestTracingProblems: every bad value is reported at once, on its line, and a value taken from
// an OTEL_* variable is blamed on the variable.
func TestTracingProblems(t *testing.T) {
	file := limitsOne + `tracing:
  enabled: true
  exporter: zipkin
  endpoint: "collector"
  sampler: always_on
  sample_ratio: 1.5
  service_name: " "
  timeout: 5m
`
	_, err := config.Load("p.yaml", []byte(file), nil)
	if err == nil {
		t.Fatal("loaded")
	}
	for _, want := range []string{
		`p.yaml:5: tracing.exporter: "zipkin" is not one of otlp-grpc, otlp-http`,
		`p.yaml:8: tracing.sample_ratio: is set but sampler always_on does not use it`,
		`p.yaml:8: tracing.sample_ratio: must be between 0 and 1, got 1.5`,
		`p.yaml:9: tracing.service_name: must not be empty`,
		`p.yaml:10: tracing.timeout: must be positive and at most 1m0s, got 5m0s`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("missing %q in:\n%v", want, err)
		}
	}

	bad := []struct{ section, want string }{
		{"tracing:\n  enabled: true\n  endpoint: collector\n", `p.yaml:5: tracing.endpoint: "collector" is not a host:port address`},
		{"tracing:\n  enabled: true\n  exporter: otlp-http\n  endpoint: collector:4318\n", `p.yaml:6: tracing.endpoint: "collector:4318" is not a URL`},
		{"tracing:\n  enabled: true\n  endpoint: ftp://collector:4317\n", `must be an http:// or https:// URL`},
		{"tracing:\n  enabled: true\n  endpoint: http://collector:99999\n", `needs a numeric port between 1 and 65535`},
		{"tracing:\n  enabled: true\n  endpoint: https://collector:4317\n  insecure: true\n", `p.yaml:6: tracing.insecure: is true but tracing.endpoint "https://collector:4317" asks for TLS`},
		{"tracing:\n  enabled: true\n  sampler: sometimes\n", `p.yaml:5: tracing.sampler: "sometimes" is not one of always_on`},
		{"tracing:\n  endpoint: collector:4317\n  sample_ratio: 0.1\n", `p.yaml:4: tracing.endpoint: is set but tracing.enabled is not true, so it would do nothing`},
	}
	for _, b := range bad {
		_, err := config.Load("p.yaml", []byte(limitsOne+b.section), nil)
		if err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("%q: got %v, want %q", b.section, err, b.want)
		}
	}

	env := []struct {
		vars []string
		want string
	}{
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT=collector", "OTEL_TRACES_SAMPLER_ARG=lots"}, `<env>: tracing.sample_ratio: OTEL_TRACES_SAMPLER_ARG: "lots" is not a number between 0 and 1`},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT=collector:4317", "OTEL_TRACES_SAMPLER=sometimes"}, `<env>: tracing.sampler: OTEL_TRACES_SAMPLER: "sometimes" is not one of`},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT=ftp://x:1"}, `<env>: tracing.endpoint: OTEL_EXPORTER_OTLP_ENDPOINT: "ftp://x:1" must be an http:// or https:// URL`},
		{[]string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://x:1", "OTEL_EXPORTER_OTLP_PROTOCOL=http/json"}, `<env>: tracing.exporter: OTEL_EXPORTER_OTLP_PROTOCOL: "http/json" is not supported`},
		{[]string{"OTEL_TRACES_EXPORTER=zipkin"}, `<env>: tracing.exporter: OTEL_TRACES_EXPORTER: "zipkin" is not supported`},
		{[]string{"OTEL_TRACES_EXPORTER=otlp", "OTEL_EXPORTER_OTLP_INSECURE=maybe"}, `<env>: tracing.insecure: OTEL_EXPORTER_OTLP_INSECURE: "maybe" is not true or false`},
		{[]string{"OTEL_TRACES_EXPORTER=otlp", "OTEL_EXPORTER_OTLP_TIMEOUT=10s"}, `<env>: tracing.timeout: OTEL_EXPORTER_OTLP_TIMEOUT: "10s" is not a positive number of milliseconds`},
		{[]string{"OTEL_TRACES_EXPORTER=otlp", "OTEL_EXPORTER_OTLP_TIMEOUT=100000"}, `<env>: tracing.timeout: OTEL_EXPORTER_OTLP_TIMEOUT: "100000" milliseconds is more than the most allowed, 60000 (1m0s)`},
		{[]string{"OTEL_TRACES_EXPORTER=otlp", "OTEL_EXPORTER_OTLP_TIMEOUT=9223372036854775807"}, `OTEL_EXPORTER_OTLP_TIMEOUT: "9223372036854775807" milliseconds is more than the most allowed`},
		{[]string{"OTEL_TRACES_EXPORTER=otlp", "OTEL_SDK_DISABLED=yes"}, `<env>: tracing.enabled: OTEL_SDK_DISABLED: "yes" is not true or false`},
	}
	for _, e := range env {
		_, err := config.Load("p.yaml", []byte(limitsOne), e.vars)
		if err == nil || !strings.Contains(err.Error(), e.want) {
			t.Errorf("%v: got %v, want %q", e.vars, err, e.want)
		}
	}
}

// FuzzTracingEnv: whatever the OTEL_* variables hold, loading either refuses with problems
// blamed on the variables, or gives tracing settings an exporter can use as they are.
func FuzzTracingEnv(f *testing.F) {
	f.Add("http://collector:4318", "http/protobuf", "traceidratio", "0.5", "false", "1000")
	f.Add("collector:4317", "grpc", "always_on", "", "true", "")
	f.Add("https://[::1]:4317/x", "grpc", "parentbased_always_off", "2", "maybe", "-1")
	f.Add("ftp://", "http/json", "", "NaN", "", "10s")
	f.Add("collector:4317", "grpc", "always_on", "", "", "100000")
	f.Fuzz(func(t *testing.T, endpoint, protocol, sampler, arg, insecure, timeout string) {
		env := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL=" + protocol,
			"OTEL_TRACES_SAMPLER=" + sampler, "OTEL_TRACES_SAMPLER_ARG=" + arg, "OTEL_EXPORTER_OTLP_INSECURE=" + insecure,
			"OTEL_EXPORTER_OTLP_TIMEOUT=" + timeout, "OTEL_TRACES_EXPORTER=otlp"}
		p, err := config.Load("p.yaml", []byte(limitsOne), env)
		if err != nil {
			for _, pr := range checkProblems(t, err) {
				if pr.File != "<env>" {
					t.Fatalf("a problem of the environment filed under the policy: %s", pr)
				}
			}
			return
		}
		tr := p.Tracing
		if !tr.On() || tr.ServiceName == "" || tr.Timeout <= 0 || tr.Ratio() < 0 || tr.Ratio() > 1 {
			t.Fatalf("accepted %+v", tr)
		}
		u, hostPort := tr.EndpointURL()
		switch {
		case u != "":
			parsed, err := url.Parse(u)
			if err != nil || (parsed.Scheme != "http" && parsed.Scheme != "https") || parsed.Hostname() == "" {
				t.Fatalf("accepted endpoint URL %q", u)
			}
			if tr.Exporter == config.TracingOTLPHTTP && parsed.Path == "" {
				t.Fatalf("an otlp-http URL without a path: %q", u)
			}
		case tr.Exporter != config.TracingOTLPGRPC:
			t.Fatalf("%s with host:port %q", tr.Exporter, hostPort)
		default:
			if _, _, err := net.SplitHostPort(hostPort); err != nil {
				t.Fatalf("accepted host:port %q", hostPort)
			}
		}
	})
}
