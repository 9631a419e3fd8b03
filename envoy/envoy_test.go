package envoy_test

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	awssigningv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/aws_request_signing/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/header_mutation/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/jwt_authn/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/upstream_codec/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	yaml "go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/envoy"
	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// validator is implemented by every generated Envoy message (protoc-gen-validate).
type validator interface{ ValidateAll() error }

// unmarshalYAML reads YAML into an Envoy proto the way Envoy does: YAML → JSON → proto3 JSON,
// rejecting unknown fields, then runs the proto's validation rules.
func unmarshalYAML(t *testing.T, data []byte, m proto.Message) {
	t.Helper()
	var v any
	if err := yaml.Unmarshal(data, &v); err != nil {
		t.Fatalf("YAML: %v", err)
	}
	js, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := (protojson.UnmarshalOptions{}).Unmarshal(js, m); err != nil {
		t.Fatalf("not a valid %s: %v", m.ProtoReflect().Descriptor().FullName(), err)
	}
	if err := m.(validator).ValidateAll(); err != nil {
		t.Fatalf("%s fails Envoy's validation rules: %v", m.ProtoReflect().Descriptor().FullName(), err)
	}
}

func bootstrapFilters(t *testing.T) (*hcmv3.HttpConnectionManager, *bootstrapv3.Bootstrap) {
	t.Helper()
	var b bootstrapv3.Bootstrap
	unmarshalYAML(t, envoy.Bootstrap, &b)
	l := b.GetStaticResources().GetListeners()
	if len(l) != 1 {
		t.Fatalf("%d listeners", len(l))
	}
	var hcm hcmv3.HttpConnectionManager
	if err := l[0].GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(&hcm); err != nil {
		t.Fatal(err)
	}
	return &hcm, &b
}

func extProcOf(t *testing.T, hcm *hcmv3.HttpConnectionManager) *extprocfilterv3.ExternalProcessor {
	t.Helper()
	for _, f := range hcm.GetHttpFilters() {
		if f.GetName() == "envoy.filters.http.ext_proc" {
			var ep extprocfilterv3.ExternalProcessor
			if err := f.GetTypedConfig().UnmarshalTo(&ep); err != nil {
				t.Fatal(err)
			}
			return &ep
		}
	}
	t.Fatal("no ext_proc filter")
	return nil
}

func TestBootstrapIsValidEnvoyConfig(t *testing.T) {
	hcm, b := bootstrapFilters(t)
	filters := hcm.GetHttpFilters()
	if last := filters[len(filters)-1].GetName(); last != "envoy.filters.http.router" {
		t.Errorf("the router must be the last filter, got %s", last)
	}
	clusters := map[string]*clusterv3.Cluster{}
	for _, c := range b.GetStaticResources().GetClusters() {
		clusters[c.GetName()] = c
	}
	for _, name := range []string{"llm_bulkhead", "deepseek", "qwen", "local", "gemini", "bedrock"} {
		if clusters[name] == nil {
			t.Errorf("cluster %s missing", name)
		}
	}
	// Every provider of the policy has a route keyed by x-llm-provider (or the default route).
	p, err := config.Load("policy.yaml", examples.DefaultPolicy, nil)
	if err != nil {
		t.Fatal(err)
	}
	routed := map[string]bool{}
	for _, r := range hcm.GetRouteConfig().GetVirtualHosts()[0].GetRoutes() {
		hs := r.GetMatch().GetHeaders()
		if len(hs) == 0 {
			routed[p.Classification.Provider.Default] = true
			continue
		}
		if hs[0].GetName() == "x-llm-provider" {
			routed[hs[0].GetStringMatch().GetExact()] = true
		}
	}
	for _, name := range p.ProviderNames() {
		if !routed[name] {
			t.Errorf("provider %s has no route", name)
		}
	}
	if got := b.GetStaticResources().GetListeners()[0].GetPerConnectionBufferLimitBytes().GetValue(); int64(got) < int64(p.Envoy.MaxRequestBody) {
		t.Errorf("listener buffer limit %d is below the policy's max_request_body %d: Envoy would answer 413", got, p.Envoy.MaxRequestBody)
	}
}

// TestProviderRoutesRetry: the provider routes retry resets, connect failures, 503 and 429
// a few times, backing off and honouring a short retry-after, and every provider cluster bounds
// retries with a retry budget.
func TestProviderRoutesRetry(t *testing.T) {
	hcm, b := bootstrapFilters(t)
	vh := hcm.GetRouteConfig().GetVirtualHosts()[0]
	rp := vh.GetRetryPolicy()
	if rp == nil {
		t.Fatal("the virtual host has no retry_policy")
	}
	on := map[string]bool{}
	for _, c := range strings.Split(rp.GetRetryOn(), ",") {
		on[c] = true
	}
	for _, want := range []string{"reset", "connect-failure", "retriable-status-codes"} {
		if !on[want] {
			t.Errorf("retry_on %q lacks %s", rp.GetRetryOn(), want)
		}
	}
	if codes := rp.GetRetriableStatusCodes(); !slices.Contains(codes, 503) || !slices.Contains(codes, 429) {
		t.Errorf("retriable_status_codes %v, want 503 and 429", codes)
	}
	if n := rp.GetNumRetries().GetValue(); n < 1 || n > 3 {
		t.Errorf("num_retries %d, want a few (1-3)", n)
	}
	if rp.GetRetryBackOff().GetBaseInterval() == nil {
		t.Error("no retry_back_off")
	}
	rl := rp.GetRateLimitedRetryBackOff()
	if hs := rl.GetResetHeaders(); len(hs) == 0 || !strings.EqualFold(hs[0].GetName(), "retry-after") || hs[0].GetFormat() != routev3.RetryPolicy_SECONDS {
		t.Errorf("rate_limited_retry_back_off %v does not honour retry-after in seconds", rl)
	}
	if rp.GetPerTryTimeout() != nil {
		t.Error("a per_try_timeout would cut long streamed answers")
	}
	for _, r := range vh.GetRoutes() {
		if r.GetRoute().GetRetryPolicy() != nil {
			t.Errorf("route %v replaces the virtual host's retry_policy", r.GetMatch())
		}
	}
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() == "llm_bulkhead" {
			continue
		}
		th := c.GetCircuitBreakers().GetThresholds()
		if len(th) == 0 || th[0].GetRetryBudget().GetBudgetPercent().GetValue() <= 0 {
			t.Errorf("provider cluster %s has no retry budget", c.GetName())
		}
	}
}

// TestHostedProviderClusters: a route to a hosted provider (gemini, bedrock) names the
// provider's host in Host, and its cluster reaches that host on 443 over TLS with that SNI and
// the certificate checked against trusted CAs and that name. Bedrock calls are signed on the
// way out with SigV4 for service bedrock in the host's region, over the body, with credentials
// from Envoy's environment (none in the file), and the client's own signature is dropped.
func TestHostedProviderClusters(t *testing.T) {
	hcm, b := bootstrapFilters(t)
	clusters := map[string]*clusterv3.Cluster{}
	for _, c := range b.GetStaticResources().GetClusters() {
		clusters[c.GetName()] = c
	}
	hosts := map[string]string{}
	var bedrockRoute *routev3.Route
	for _, r := range hcm.GetRouteConfig().GetVirtualHosts()[0].GetRoutes() {
		for _, h := range r.GetRequestHeadersToAdd() {
			if name := strings.ToLower(h.GetHeader().GetKey()); name == "authorization" || name == "x-goog-api-key" || strings.HasPrefix(name, "x-amz-") {
				t.Errorf("route to %s sets %s: credentials do not belong in the file", r.GetRoute().GetCluster(), name)
			}
		}
		if host := r.GetRoute().GetHostRewriteLiteral(); host != "" {
			hosts[r.GetRoute().GetCluster()] = host
		}
		if r.GetRoute().GetCluster() == "bedrock" {
			bedrockRoute = r
		}
	}
	for _, name := range []string{"gemini", "bedrock"} {
		host, c := hosts[name], clusters[name]
		if host == "" || c == nil {
			t.Errorf("%s: no route rewriting Host to the provider's, or no cluster", name)
			continue
		}
		eps := c.GetLoadAssignment().GetEndpoints()
		if len(eps) != 1 || len(eps[0].GetLbEndpoints()) != 1 {
			t.Fatalf("%s: want one endpoint, got %v", name, eps)
		}
		addr := eps[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress()
		if addr.GetAddress() != host || addr.GetPortValue() != 443 {
			t.Errorf("%s: endpoint %s:%d, the route sends Host %s", name, addr.GetAddress(), addr.GetPortValue(), host)
		}
		var tls tlsv3.UpstreamTlsContext
		if err := c.GetTransportSocket().GetTypedConfig().UnmarshalTo(&tls); err != nil {
			t.Errorf("%s: no upstream TLS: %v", name, err)
			continue
		}
		v := tls.GetCommonTlsContext().GetValidationContext()
		sans := v.GetMatchTypedSubjectAltNames()
		if tls.GetSni() != host || v.GetTrustedCa().GetFilename() == "" || len(sans) != 1 ||
			sans[0].GetSanType() != tlsv3.SubjectAltNameMatcher_DNS || sans[0].GetMatcher().GetExact() != host {
			t.Errorf("%s: TLS with SNI %q, CA %v, names %v; want SNI and a certificate for %s checked against trusted CAs",
				name, tls.GetSni(), v.GetTrustedCa(), sans, host)
		}
	}

	var opts upstreamhttpv3.HttpProtocolOptions
	if err := clusters["bedrock"].GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].UnmarshalTo(&opts); err != nil {
		t.Fatalf("bedrock: no HTTP protocol options: %v", err)
	}
	filters := opts.GetHttpFilters()
	if len(filters) != 2 || filters[0].GetName() != "envoy.filters.http.aws_request_signing" || filters[1].GetName() != "envoy.filters.http.upstream_codec" {
		t.Fatalf("bedrock's upstream filters %v, want aws_request_signing then upstream_codec", filters)
	}
	var sig awssigningv3.AwsRequestSigning
	if err := filters[0].GetTypedConfig().UnmarshalTo(&sig); err != nil {
		t.Fatal(err)
	}
	region := strings.TrimSuffix(strings.TrimPrefix(hosts["bedrock"], "bedrock-runtime."), ".amazonaws.com")
	if sig.GetServiceName() != "bedrock" || sig.GetRegion() != region || sig.GetUseUnsignedPayload() || sig.GetHostRewrite() != "" {
		t.Errorf("signing %v: want service bedrock, region %s (the host's), the body signed, the route's Host", &sig, region)
	}
	if sig.GetCredentialProvider().GetInlineCredential() != nil {
		t.Error("bedrock's AWS credentials are written in the file")
	}
	removed := map[string]bool{}
	for _, h := range bedrockRoute.GetRequestHeadersToRemove() {
		removed[strings.ToLower(h)] = true
	}
	if !removed["authorization"] || !removed["x-amz-security-token"] {
		t.Errorf("the bedrock route keeps the client's signature headers (removes %v)", bedrockRoute.GetRequestHeadersToRemove())
	}
	if got := clusters["bedrock"].GetPerConnectionBufferLimitBytes().GetValue(); got < b.GetStaticResources().GetListeners()[0].GetPerConnectionBufferLimitBytes().GetValue() {
		t.Errorf("bedrock buffers %d bytes to sign a body, less than the listener takes", got)
	}
}

// exampleEnvoyConfig is what `llm-bulkhead envoy-config` prints for the example policy with the
// overrides env (LLM_BULKHEAD_… settings).
func exampleEnvoyConfig(t *testing.T, env []string) []byte {
	t.Helper()
	p, err := config.Load("policy.yaml", examples.DefaultPolicy, env)
	if err != nil {
		t.Fatal(err)
	}
	out, err := app.EnvoyConfig(p, "llm_bulkhead", "llm-bulkhead:9002")
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestShippedFilterMatchesPolicy: the filter in envoy.yaml is the one `llm-bulkhead
// envoy-config` prints for the example policy.
func TestShippedFilterMatchesPolicy(t *testing.T) {
	hcm, _ := bootstrapFilters(t)
	shipped := extProcOf(t, hcm)

	out := exampleEnvoyConfig(t, nil)
	var generated struct {
		HTTPFilters []any `yaml:"http_filters"`
		Clusters    []any `yaml:"clusters"`
	}
	if err := yaml.Unmarshal(out, &generated); err != nil {
		t.Fatal(err)
	}
	wrapped, _ := yaml.Marshal(map[string]any{"stat_prefix": "x", "route_config": map[string]any{}, "http_filters": generated.HTTPFilters})
	var ghcm hcmv3.HttpConnectionManager
	unmarshalYAML(t, wrapped, &ghcm)
	if gen := extProcOf(t, &ghcm); !proto.Equal(gen, shipped) {
		t.Errorf("envoy/envoy.yaml's ext_proc filter differs from `llm-bulkhead envoy-config`:\nshipped:   %v\ngenerated: %v", shipped, gen)
	}
	for _, c := range generated.Clusters {
		cy, _ := yaml.Marshal(c)
		var cl clusterv3.Cluster
		unmarshalYAML(t, cy, &cl)
	}
}

func TestIdentityChainIsValid(t *testing.T) {
	var chain struct {
		HTTPFilters []any `yaml:"http_filters"`
	}
	if err := yaml.Unmarshal(envoy.Identity, &chain); err != nil {
		t.Fatal(err)
	}
	wrapped, _ := yaml.Marshal(map[string]any{"stat_prefix": "x", "route_config": map[string]any{}, "http_filters": chain.HTTPFilters})
	var hcm hcmv3.HttpConnectionManager
	unmarshalYAML(t, wrapped, &hcm)
	ep := extProcOf(t, &hcm)
	ns := ep.GetMetadataOptions().GetForwardingNamespaces().GetUntyped()
	if len(ns) != 1 || ns[0] != "envoy.filters.http.jwt_authn" {
		t.Errorf("ext_proc forwards %v, want the jwt_authn namespace", ns)
	}
	names := []string{}
	for _, f := range hcm.GetHttpFilters() {
		names = append(names, f.GetName())
	}
	want := []string{"envoy.filters.http.jwt_authn", "envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc", "envoy.filters.http.router"}
	if len(names) != len(want) {
		t.Fatalf("filters %v", names)
	}
	for i := range want {
		if names[i] != want[i] {
			t.Fatalf("filter order %v, want %v (identity must be settled before ext_proc runs)", names, want)
		}
	}
}

// TestRateLimitSnippetIsValid: the shared token budget is checked on the request path and
// charged with settled tokens when the stream is done, on the same descriptor.
func TestRateLimitSnippetIsValid(t *testing.T) {
	var vh routev3.VirtualHost
	unmarshalYAML(t, envoy.RateLimit, &vh)
	var rl ratelimitv3.RateLimitPerRoute
	if err := vh.GetTypedPerFilterConfig()["envoy.filters.http.ratelimit"].UnmarshalTo(&rl); err != nil {
		t.Fatal(err)
	}
	if err := rl.ValidateAll(); err != nil {
		t.Fatal(err)
	}
	key := func(r *routev3.RateLimit) string {
		if a := r.GetActions(); len(a) == 1 {
			return a[0].GetRequestHeaders().GetDescriptorKey()
		}
		return ""
	}
	var check, charge *routev3.RateLimit
	for _, r := range rl.GetRateLimits() {
		if key(r) != "tenant_tokens" {
			continue
		}
		if r.GetApplyOnStreamDone() {
			charge = r
		} else {
			check = r
		}
	}
	if charge == nil || charge.GetHitsAddend().GetFormat() != "%DYNAMIC_METADATA(llm_bulkhead:total_tokens)%" {
		t.Errorf("no stream-done action charging settled tokens to tenant_tokens: %v", charge)
	}
	if check == nil {
		t.Fatal("no request-path action checks tenant_tokens: the shared budget would never refuse")
	}
	if n := check.GetHitsAddend().GetNumber(); n == nil || n.GetValue() > 1 {
		t.Errorf("the request-path check costs %v hits, want at most 1", n)
	}
	if key(check) != key(charge) || check.GetActions()[0].GetRequestHeaders().GetHeaderName() != charge.GetActions()[0].GetRequestHeaders().GetHeaderName() {
		t.Error("the check and the charge must produce the same descriptor")
	}
}

// TestUpstreamFilterClusterIsValid: upstream.yaml is a provider cluster of envoy.yaml with
// llm-bulkhead as its upstream ext_proc filter, before upstream_codec (which must be last),
// sending only headers, marked by the gRPC metadata the server tells the position by, and
// failing open: an attempt must never fail because the server could not be reached.
func TestUpstreamFilterClusterIsValid(t *testing.T) {
	var c clusterv3.Cluster
	unmarshalYAML(t, envoy.Upstream, &c)
	_, b := bootstrapFilters(t)
	var shipped *clusterv3.Cluster
	for _, bc := range b.GetStaticResources().GetClusters() {
		if bc.GetName() == c.GetName() {
			shipped = bc
		}
	}
	if shipped == nil || c.GetName() == "llm_bulkhead" {
		t.Fatalf("upstream.yaml's cluster %q is not a provider cluster of envoy.yaml", c.GetName())
	}
	if !proto.Equal(shipped.GetLoadAssignment(), c.GetLoadAssignment()) || !proto.Equal(shipped.GetCircuitBreakers(), c.GetCircuitBreakers()) {
		t.Errorf("upstream.yaml's %s differs from envoy.yaml's beyond its upstream filters", c.GetName())
	}
	var opts upstreamhttpv3.HttpProtocolOptions
	if err := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].UnmarshalTo(&opts); err != nil {
		t.Fatalf("no HTTP protocol options: %v", err)
	}
	filters := opts.GetHttpFilters()
	if len(filters) != 2 || filters[0].GetName() != "envoy.filters.http.ext_proc" || filters[1].GetName() != "envoy.filters.http.upstream_codec" {
		t.Fatalf("upstream filters %v, want ext_proc then upstream_codec", filters)
	}
	var ep extprocfilterv3.ExternalProcessor
	if err := filters[0].GetTypedConfig().UnmarshalTo(&ep); err != nil {
		t.Fatal(err)
	}
	if err := ep.ValidateAll(); err != nil {
		t.Fatal(err)
	}
	if !ep.GetFailureModeAllow() {
		t.Error("the upstream filter must fail open (failure_mode_allow: true)")
	}
	if got := ep.GetGrpcService().GetEnvoyGrpc().GetClusterName(); got != "llm_bulkhead" {
		t.Errorf("the upstream filter calls cluster %q, want llm_bulkhead", got)
	}
	marked := false
	for _, h := range ep.GetGrpcService().GetInitialMetadata() {
		marked = marked || (h.GetKey() == extproc.FilterPositionKey && h.GetValue() == extproc.FilterPositionUpstream)
	}
	if !marked {
		t.Errorf("initial_metadata %v lacks %s: %s", ep.GetGrpcService().GetInitialMetadata(), extproc.FilterPositionKey, extproc.FilterPositionUpstream)
	}
	m := ep.GetProcessingMode()
	if m.GetRequestHeaderMode() != extprocfilterv3.ProcessingMode_SEND || m.GetResponseHeaderMode() != extprocfilterv3.ProcessingMode_SEND ||
		m.GetRequestBodyMode() != extprocfilterv3.ProcessingMode_NONE || m.GetResponseBodyMode() != extprocfilterv3.ProcessingMode_NONE ||
		m.GetRequestTrailerMode() != extprocfilterv3.ProcessingMode_SKIP || m.GetResponseTrailerMode() != extprocfilterv3.ProcessingMode_SKIP {
		t.Errorf("processing_mode %v, want headers only", m)
	}
}

// TestShippedUpstreamFilterMatchesPolicy: upstream.yaml's upstream filter chain is the one
// `llm-bulkhead envoy-config` prints for the example policy with envoy.upstream_filter on, and
// nothing is printed for it with the option off.
func TestShippedUpstreamFilterMatchesPolicy(t *testing.T) {
	var c clusterv3.Cluster
	unmarshalYAML(t, envoy.Upstream, &c)
	var shipped upstreamhttpv3.HttpProtocolOptions
	if err := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].UnmarshalTo(&shipped); err != nil {
		t.Fatal(err)
	}
	for _, on := range []bool{false, true} {
		var env []string
		if on {
			env = []string{"LLM_BULKHEAD_ENVOY__UPSTREAM_FILTER=true"}
		}
		out := exampleEnvoyConfig(t, env)
		var generated struct {
			Upstream []any `yaml:"upstream_http_filters"`
		}
		if err := yaml.Unmarshal(out, &generated); err != nil {
			t.Fatal(err)
		}
		if !on {
			if generated.Upstream != nil {
				t.Errorf("upstream filters printed with envoy.upstream_filter off:\n%s", out)
			}
			continue
		}
		wrapped, _ := yaml.Marshal(map[string]any{"http_filters": generated.Upstream, "explicit_http_config": map[string]any{"http_protocol_options": map[string]any{}}})
		var gen upstreamhttpv3.HttpProtocolOptions
		unmarshalYAML(t, wrapped, &gen)
		if len(gen.GetHttpFilters()) != len(shipped.GetHttpFilters()) {
			t.Fatalf("generated %d upstream filters, upstream.yaml has %d", len(gen.GetHttpFilters()), len(shipped.GetHttpFilters()))
		}
		for i, f := range gen.GetHttpFilters() {
			if !proto.Equal(f, shipped.GetHttpFilters()[i]) {
				t.Errorf("upstream filter %d differs from envoy/upstream.yaml's:\nshipped:   %v\ngenerated: %v", i, shipped.GetHttpFilters()[i], f)
			}
		}
	}
}
