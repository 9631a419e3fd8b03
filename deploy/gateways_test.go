package deploy

import (
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	egv1a1 "github.com/envoyproxy/gateway/api/v1alpha1"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	awssigningv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/aws_request_signing/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	istionetworking "istio.io/api/networking/v1alpha3"
	istiosecurity "istio.io/api/security/v1beta1"
	istionetworkingv1 "istio.io/client-go/pkg/apis/networking/v1"
	istionetworkingv1alpha3 "istio.io/client-go/pkg/apis/networking/v1alpha3"
	istiosecurityv1 "istio.io/client-go/pkg/apis/security/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	gwapiv1 "sigs.k8s.io/gateway-api/apis/v1"
	gwapiv1beta1 "sigs.k8s.io/gateway-api/apis/v1beta1"
	"sigs.k8s.io/yaml"

	// The typed_config of every filter a patch inserts must resolve.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/header_mutation/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/upstream_codec/v3"
)

// The chart as the examples assume it installed: release llm-bulkhead in namespace
// llm-bulkhead.
const (
	bulkheadRelease   = "llm-bulkhead"
	bulkheadNamespace = "llm-bulkhead"
)

// object is a decoded manifest of a gateway example.
type object struct {
	manifest
	namespace string
	value     any // the official Go type, decoded strictly
}

// gatewayExample decodes every manifest of a folder strictly into its project's own Go type.
func gatewayExample(t *testing.T, dir string) []object {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s (%v)", dir, err)
	}
	var out []object
	for _, f := range files {
		for _, m := range readManifests(t, f) {
			what := fmt.Sprintf("%s %s/%s", f, m.gvk.Kind, m.name)
			v, err := decodeGatewayObject(m)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			var meta struct {
				Metadata metav1.ObjectMeta `json:"metadata"`
			}
			if err := yaml.Unmarshal(m.doc, &meta); err != nil || meta.Metadata.Namespace == "" {
				t.Fatalf("%s has no namespace: the examples name every namespace they use", what)
			}
			out = append(out, object{manifest: m, namespace: meta.Metadata.Namespace, value: v})
		}
	}
	return out
}

func decodeGatewayObject(m manifest) (any, error) {
	var v any
	switch m.gvk.GroupVersion().String() + " " + m.gvk.Kind {
	case "gateway.networking.k8s.io/v1 Gateway":
		v = new(gwapiv1.Gateway)
	case "gateway.networking.k8s.io/v1 HTTPRoute":
		v = new(gwapiv1.HTTPRoute)
	case "gateway.networking.k8s.io/v1beta1 ReferenceGrant":
		v = new(gwapiv1beta1.ReferenceGrant)
	case "gateway.envoyproxy.io/v1alpha1 EnvoyExtensionPolicy":
		v = new(egv1a1.EnvoyExtensionPolicy)
	case "gateway.envoyproxy.io/v1alpha1 EnvoyPatchPolicy":
		v = new(egv1a1.EnvoyPatchPolicy)
	case "gateway.envoyproxy.io/v1alpha1 ClientTrafficPolicy":
		v = new(egv1a1.ClientTrafficPolicy)
	case "gateway.envoyproxy.io/v1alpha1 SecurityPolicy":
		v = new(egv1a1.SecurityPolicy)
	case "gateway.envoyproxy.io/v1alpha1 Backend":
		v = new(egv1a1.Backend)
	case "networking.istio.io/v1alpha3 EnvoyFilter":
		return decodeIstio(m, new(istionetworkingv1alpha3.EnvoyFilter), new(istionetworking.EnvoyFilter))
	case "networking.istio.io/v1 DestinationRule":
		return decodeIstio(m, new(istionetworkingv1.DestinationRule), new(istionetworking.DestinationRule))
	case "networking.istio.io/v1 VirtualService":
		return decodeIstio(m, new(istionetworkingv1.VirtualService), new(istionetworking.VirtualService))
	case "security.istio.io/v1 PeerAuthentication":
		return decodeIstio(m, new(istiosecurityv1.PeerAuthentication), new(istiosecurity.PeerAuthentication))
	case "security.istio.io/v1 AuthorizationPolicy":
		return decodeIstio(m, new(istiosecurityv1.AuthorizationPolicy), new(istiosecurity.AuthorizationPolicy))
	case "security.istio.io/v1 RequestAuthentication":
		return decodeIstio(m, new(istiosecurityv1.RequestAuthentication), new(istiosecurity.RequestAuthentication))
	case "aigateway.envoyproxy.io/v1alpha1 AIGatewayRoute":
		return decodeAIGatewayRoute(m)
	case "aigateway.envoyproxy.io/v1alpha1 AIServiceBackend":
		return decodeAIServiceBackend(m)
	case "aigateway.envoyproxy.io/v1alpha1 BackendSecurityPolicy":
		return decodeBackendSecurityPolicy(m)
	default:
		return nil, fmt.Errorf("no API type known for %s", m.gvk)
	}
	if err := yaml.UnmarshalStrict(m.doc, v); err != nil {
		return nil, fmt.Errorf("does not decode strictly into %T: %w", v, err)
	}
	return v, nil
}

// decodeIstio decodes an Istio resource into client-go's type, and its spec strictly into the
// API's protobuf message: client-go's JSON decoding of a spec accepts unknown fields
// (jsonpb with AllowUnknownFields), protojson does not.
func decodeIstio(m manifest, typed any, spec proto.Message) (any, error) {
	if err := yaml.Unmarshal(m.doc, typed); err != nil {
		return nil, fmt.Errorf("does not decode into %T: %w", typed, err)
	}
	var shell struct {
		metav1.TypeMeta `json:",inline"`
		Metadata        metav1.ObjectMeta `json:"metadata"`
		Spec            json.RawMessage   `json:"spec"`
	}
	data, err := yaml.YAMLToJSON(m.doc)
	if err != nil {
		return nil, err
	}
	if err := strictJSON("the resource", data, &shell); err != nil {
		return nil, err
	}
	if err := protojson.Unmarshal(shell.Spec, spec); err != nil {
		return nil, fmt.Errorf("spec does not decode strictly into %T: %w", spec, err)
	}
	return spec, nil
}

// The examples' own reading of the server's policy and of the filter it prints.
type serverFilter struct {
	filter *extprocv3.ExternalProcessor
	// healthService is the gRPC health service name the printed cluster checks.
	healthService string
	// providers of examples/policy.yaml, and the default one.
	providers       []string
	defaultProvider string
	maxRequestBody  resource.Quantity
}

// printedFilter runs `llm-bulkhead envoy-config` for examples/policy.yaml and decodes the
// filter and cluster it prints with Envoy's protos: every example must configure the same.
func printedFilter(t *testing.T) serverFilter {
	t.Helper()
	out, err := exec.Command(llmBulkhead, "envoy-config", "--config", filepath.Join("..", "examples", "policy.yaml")).Output()
	if err != nil {
		t.Fatalf("llm-bulkhead envoy-config: %v", err)
	}
	var printed struct {
		HTTPFilters []json.RawMessage `json:"http_filters"`
		Clusters    []json.RawMessage `json:"clusters"`
	}
	js, err := yaml.YAMLToJSON(out)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(js, &printed); err != nil || len(printed.HTTPFilters) != 1 || len(printed.Clusters) != 1 {
		t.Fatalf("envoy-config printed something else than one filter and one cluster (%v):\n%s", err, out)
	}
	var sf serverFilter
	sf.filter = extProc(t, "envoy-config's filter", printed.HTTPFilters[0])
	var cluster struct {
		HealthChecks []struct {
			GRPCHealthCheck struct {
				ServiceName string `json:"service_name"`
			} `json:"grpc_health_check"`
		} `json:"health_checks"`
	}
	if err := json.Unmarshal(printed.Clusters[0], &cluster); err != nil || len(cluster.HealthChecks) != 1 {
		t.Fatalf("envoy-config's cluster has no gRPC health check: %v", err)
	}
	sf.healthService = cluster.HealthChecks[0].GRPCHealthCheck.ServiceName

	var policy struct {
		Envoy struct {
			MaxRequestBody string `json:"max_request_body"`
		} `json:"envoy"`
		Classification struct {
			Provider struct {
				Default string `json:"default"`
			} `json:"provider"`
		} `json:"classification"`
		Providers map[string]json.RawMessage `json:"providers"`
	}
	if err := yaml.Unmarshal(readRepoFile(t, "examples/policy.yaml"), &policy); err != nil {
		t.Fatal(err)
	}
	for p := range policy.Providers {
		sf.providers = append(sf.providers, p)
	}
	slices.Sort(sf.providers)
	sf.defaultProvider = policy.Classification.Provider.Default
	// The policy's sizes are binary units (8MiB); Kubernetes quantities write them 8Mi.
	q, err := resource.ParseQuantity(strings.TrimSuffix(policy.Envoy.MaxRequestBody, "B"))
	if err != nil {
		t.Fatalf("envoy.max_request_body %q: %v", policy.Envoy.MaxRequestBody, err)
	}
	sf.maxRequestBody = q
	return sf
}

// extProc decodes an HttpFilter (JSON) strictly with Envoy's protos and returns its ext_proc
// configuration.
func extProc(t *testing.T, what string, data []byte) *extprocv3.ExternalProcessor {
	t.Helper()
	var f hcmv3.HttpFilter
	if err := protojson.Unmarshal(data, &f); err != nil {
		t.Fatalf("%s does not decode strictly into Envoy's HttpFilter: %v\n%s", what, err, data)
	}
	if f.GetName() != "envoy.filters.http.ext_proc" {
		t.Fatalf("%s is filter %q, not envoy.filters.http.ext_proc", what, f.GetName())
	}
	var ep extprocv3.ExternalProcessor
	if err := f.GetTypedConfig().UnmarshalTo(&ep); err != nil {
		t.Fatalf("%s: typed_config is not an ExternalProcessor: %v", what, err)
	}
	return &ep
}

// chartService renders the chart as the examples assume it installed and returns the
// ext_proc Service's name and port, and its appProtocol.
func chartService(t *testing.T) (name string, port int32, appProtocol string) {
	t.Helper()
	r, err := renderRelease(t, bulkheadRelease, bulkheadNamespace, nil)
	if err != nil {
		t.Fatal(err)
	}
	var svc struct {
		Metadata metav1.ObjectMeta `json:"metadata"`
		Spec     struct {
			Ports []struct {
				Name        string `json:"name"`
				Port        int32  `json:"port"`
				AppProtocol string `json:"appProtocol"`
			} `json:"ports"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(r.find(t, "Service", "").doc, &svc); err != nil {
		t.Fatal(err)
	}
	for _, p := range svc.Spec.Ports {
		if p.Name == "grpc" {
			return svc.Metadata.Name, p.Port, p.AppProtocol
		}
	}
	t.Fatal("the chart's Service has no grpc port")
	return "", 0, ""
}

func ofKind[T any](objs []object) []T {
	var out []T
	for _, o := range objs {
		if v, ok := o.value.(*T); ok {
			out = append(out, *v)
		}
	}
	return out
}

func durationOf(t *testing.T, d *gwapiv1.Duration) time.Duration {
	t.Helper()
	if d == nil {
		return 0
	}
	v, err := time.ParseDuration(string(*d))
	if err != nil {
		t.Fatalf("duration %q: %v", *d, err)
	}
	return v
}

func TestEnvoyGatewayExample(t *testing.T) {
	checkEnvoyGatewayExample(t, "envoy-gateway")
}

func TestAIGatewayExample(t *testing.T) {
	objs := checkEnvoyGatewayExample(t, "ai-gateway")
	sf := printedFilter(t)
	// The AIGatewayRoute has a rule for every provider of the policy (llm-bulkhead sets
	// x-llm-provider on every request it lets through, so no rule needs to catch the rest),
	// and every rule's backends exist.
	backends := map[string]bool{}
	for _, b := range ofKind[aiServiceBackend](objs) {
		backends[b.Metadata.Name] = true
		if b.Spec.BackendRef.Kind == nil || *b.Spec.BackendRef.Kind != "Backend" || !hasObject(objs, "Backend", string(b.Spec.BackendRef.Name)) {
			t.Errorf("AIServiceBackend %s refers to %+v, which the example does not define", b.Metadata.Name, b.Spec.BackendRef)
		}
	}
	routes := ofKind[aiGatewayRoute](objs)
	if len(routes) != 1 {
		t.Fatalf("want one AIGatewayRoute, got %d", len(routes))
	}
	var routed []string
	for _, r := range routes[0].Spec.Rules {
		for _, m := range r.Matches {
			for _, h := range m.Headers {
				if h.Name == "x-llm-provider" {
					routed = append(routed, h.Value)
				}
			}
		}
		for _, b := range r.BackendRefs {
			if !backends[b.Name] {
				t.Errorf("rule refers to AIServiceBackend %s, which the example does not define", b.Name)
			}
		}
	}
	slices.Sort(routed)
	if !slices.Equal(routed, sf.providers) {
		t.Errorf("the AIGatewayRoute routes x-llm-provider %v, the policy has providers %v", routed, sf.providers)
	}
	gws := ofKind[gwapiv1.Gateway](objs)
	if len(gws) != 1 || string(routes[0].Spec.ParentRefs[0].Name) != gws[0].Name {
		t.Error("the AIGatewayRoute is not attached to the example's Gateway")
	}

	// Hosted backends are reached over TLS on 443; AI Gateway signs a Bedrock backend's calls
	// with the AWS credentials of a BackendSecurityPolicy for the region of its host, which
	// refers to a Secret instead of holding the credentials.
	hosts := map[string]string{}
	for _, b := range ofKind[egv1a1.Backend](objs) {
		if len(b.Spec.Endpoints) == 1 && b.Spec.Endpoints[0].FQDN != nil && b.Spec.Endpoints[0].FQDN.Port == 443 {
			hosts[b.Name] = b.Spec.Endpoints[0].FQDN.Hostname
			if b.Spec.TLS == nil || b.Spec.TLS.WellKnownCACertificates == nil {
				t.Errorf("Backend %s reaches %s on 443 without TLS to trusted CAs", b.Name, hosts[b.Name])
			}
		}
	}
	securedBy := map[string]backendSecurityPolicy{}
	for _, p := range ofKind[backendSecurityPolicy](objs) {
		for _, ref := range p.Spec.TargetRefs {
			if ref.Kind != "AIServiceBackend" || !backends[string(ref.Name)] {
				t.Errorf("BackendSecurityPolicy %s targets %s %s, which the example does not define", p.Metadata.Name, ref.Kind, ref.Name)
			}
			securedBy[string(ref.Name)] = p
		}
	}
	bedrock := 0
	for _, b := range ofKind[aiServiceBackend](objs) {
		if b.Spec.APISchema.Name != "AWSBedrock" {
			continue
		}
		bedrock++
		region, _ := strings.CutPrefix(strings.TrimSuffix(hosts[string(b.Spec.BackendRef.Name)], ".amazonaws.com"), "bedrock-runtime.")
		p, ok := securedBy[b.Metadata.Name]
		aws := p.Spec.AWSCredentials
		if !ok || p.Spec.Type != "AWSCredentials" || aws == nil || aws.Region != region || region == "" ||
			((aws.CredentialsFile == nil || aws.CredentialsFile.SecretRef == nil) && aws.OIDCExchangeToken == nil) {
			t.Errorf("AIServiceBackend %s (Bedrock at %q) is not signed with AWS credentials for its region from a Secret or OIDC: %+v",
				b.Metadata.Name, hosts[string(b.Spec.BackendRef.Name)], p.Spec)
		}
	}
	if bedrock == 0 {
		t.Error("no AIServiceBackend speaks AWSBedrock: the policy's bedrock provider has nowhere to go")
	}
}

func hasObject(objs []object, kind, name string) bool {
	for _, o := range objs {
		if o.gvk.Kind == kind && o.name == name {
			return true
		}
	}
	return false
}

// checkEnvoyGatewayExample checks an Envoy Gateway based example against the server's own
// filter (envoy-config) and the chart's Service.
func checkEnvoyGatewayExample(t *testing.T, dir string) []object {
	t.Helper()
	objs := gatewayExample(t, dir)
	sf := printedFilter(t)
	svcName, svcPort, appProtocol := chartService(t)
	if appProtocol != "kubernetes.io/h2c" {
		t.Errorf("the chart's gRPC port says appProtocol %q: Envoy Gateway would not speak HTTP/2 to it", appProtocol)
	}

	gateways := ofKind[gwapiv1.Gateway](objs)
	if len(gateways) != 1 {
		t.Fatalf("want one Gateway, got %d", len(gateways))
	}
	gw := gateways[0]
	targetsGateway := func(what string, refs []gwapiv1.LocalPolicyTargetReferenceWithSectionName) {
		t.Helper()
		if len(refs) != 1 || refs[0].Kind != "Gateway" || string(refs[0].Name) != gw.Name {
			t.Errorf("%s targets %+v, not Gateway %s", what, refs, gw.Name)
		}
	}

	policies := ofKind[egv1a1.EnvoyExtensionPolicy](objs)
	if len(policies) != 1 || len(policies[0].Spec.ExtProc) != 1 {
		t.Fatalf("want one EnvoyExtensionPolicy with one extProc, got %d", len(policies))
	}
	pol := policies[0]
	targetsGateway("EnvoyExtensionPolicy", pol.Spec.TargetRefs)
	ep := pol.Spec.ExtProc[0]

	// The backend: the chart's Service, allowed by a ReferenceGrant across namespaces.
	if len(ep.BackendRefs) != 1 {
		t.Fatalf("want one backendRef, got %+v", ep.BackendRefs)
	}
	ref := ep.BackendRefs[0].BackendObjectReference
	if ref.Kind == nil || *ref.Kind != "Service" || string(ref.Name) != svcName || ref.Port == nil || int32(*ref.Port) != svcPort ||
		ref.Namespace == nil || string(*ref.Namespace) != bulkheadNamespace {
		t.Errorf("backendRef %+v is not the chart's Service %s/%s:%d", ref, bulkheadNamespace, svcName, svcPort)
	}
	granted := false
	for _, g := range ofKind[gwapiv1beta1.ReferenceGrant](objs) {
		for _, from := range g.Spec.From {
			for _, to := range g.Spec.To {
				if from.Kind == "EnvoyExtensionPolicy" && string(from.Namespace) == pol.Namespace && g.Namespace == bulkheadNamespace &&
					to.Kind == "Service" && to.Name != nil && string(*to.Name) == svcName {
					granted = true
				}
			}
		}
	}
	if !granted {
		t.Error("no ReferenceGrant lets the EnvoyExtensionPolicy refer to the Service in another namespace")
	}
	hc := ep.BackendSettings.HealthCheck
	if hc == nil || hc.Active == nil || hc.Active.Type != egv1a1.ActiveHealthCheckerTypeGRPC || hc.Active.GRPC == nil ||
		hc.Active.GRPC.Service == nil || *hc.Active.GRPC.Service != sf.healthService {
		t.Errorf("the backend is not health-checked with gRPC health of %s: %+v", sf.healthService, hc)
	}

	// The filter settings: those envoy-config prints for the policy.
	f := sf.filter
	pm := ep.ProcessingMode
	bodyMode := map[extprocv3.ProcessingMode_BodySendMode]egv1a1.ExtProcBodyProcessingMode{
		extprocv3.ProcessingMode_BUFFERED: egv1a1.BufferedExtProcBodyProcessingMode,
		extprocv3.ProcessingMode_STREAMED: egv1a1.StreamedExtProcBodyProcessingMode,
	}
	if pm == nil || pm.Request == nil || pm.Response == nil || pm.Request.Body == nil || pm.Response.Body == nil {
		t.Fatalf("processingMode %+v: request and response headers and bodies must be sent", pm)
	}
	if *pm.Request.Body != bodyMode[f.ProcessingMode.RequestBodyMode] || *pm.Response.Body != bodyMode[f.ProcessingMode.ResponseBodyMode] {
		t.Errorf("body modes %s/%s, the policy needs %s/%s", *pm.Request.Body, *pm.Response.Body,
			f.ProcessingMode.RequestBodyMode, f.ProcessingMode.ResponseBodyMode)
	}
	if pm.AllowModeOverride != f.AllowModeOverride {
		t.Errorf("allowModeOverride %v, the policy's envoy.allow_mode_override is %v", pm.AllowModeOverride, f.AllowModeOverride)
	}
	if got := durationOf(t, ep.MessageTimeout); got != f.MessageTimeout.AsDuration() {
		t.Errorf("messageTimeout %s, the policy's envoy.message_timeout is %s", got, f.MessageTimeout.AsDuration())
	}
	if ep.FailOpen == nil || *ep.FailOpen != f.FailureModeAllow {
		t.Errorf("failOpen %s, the policy's envoy.failure_mode_allow is %v", ptrString(ep.FailOpen), f.FailureModeAllow)
	}
	md := ep.Metadata
	if md == nil || !slices.Equal(md.AccessibleNamespaces, f.MetadataOptions.ForwardingNamespaces.Untyped) ||
		!slices.Equal(md.WritableNamespaces, f.MetadataOptions.ReceivingNamespaces.Untyped) {
		t.Errorf("metadata %+v, the policy reads %v and writes %v", md,
			f.MetadataOptions.ForwardingNamespaces.Untyped, f.MetadataOptions.ReceivingNamespaces.Untyped)
	}

	// max_message_timeout, which EnvoyExtensionPolicy lacks, patched into the generated filter.
	var listenerPatches []egv1a1.EnvoyJSONPatchConfig
	for _, p := range ofKind[egv1a1.EnvoyPatchPolicy](objs) {
		if string(p.Spec.TargetRef.Name) != gw.Name || p.Namespace != gw.Namespace {
			t.Errorf("the EnvoyPatchPolicy %s targets %s/%s, not the Gateway", p.Name, p.Namespace, p.Spec.TargetRef.Name)
		}
		for _, jp := range p.Spec.JSONPatches {
			if jp.Type == egv1a1.EnvoyResourceType(protoTypeURL(&listenerv3.Listener{})) {
				listenerPatches = append(listenerPatches, jp)
			}
		}
	}
	if len(listenerPatches) != 1 {
		t.Fatalf("want one patch of the listener, got %d", len(listenerPatches))
	}
	patch := listenerPatches[0]
	if want := gw.Namespace + "/" + gw.Name + "/" + string(gw.Spec.Listeners[0].Name); patch.Name != want {
		t.Errorf("the patch names listener %q, Envoy Gateway names the Gateway's %q", patch.Name, want)
	}
	filterName := "envoy.filters.http.ext_proc/envoyextensionpolicy/" + pol.Namespace + "/" + pol.Name + "/extproc/0"
	if patch.Operation.JSONPath == nil || !strings.Contains(*patch.Operation.JSONPath, "'"+filterName+"'") {
		t.Errorf("the patch's jsonPath %s does not select the filter %s the policy generates", ptrString(patch.Operation.JSONPath), filterName)
	}
	if patch.Operation.Path == nil || patch.Operation.Value == nil {
		t.Fatal("the patch sets nothing")
	}
	field := strings.TrimPrefix(*patch.Operation.Path, "/")
	var patched extprocv3.ExternalProcessor
	if err := protojson.Unmarshal([]byte(`{"`+field+`":`+string(patch.Operation.Value.Raw)+`}`), &patched); err != nil {
		t.Fatalf("the patched field does not decode into the ext_proc filter: %v", err)
	}
	if !proto.Equal(patched.MaxMessageTimeout, f.MaxMessageTimeout) {
		t.Errorf("patched max_message_timeout %v, the policy's envoy.max_message_timeout is %v",
			patched.MaxMessageTimeout.AsDuration(), f.MaxMessageTimeout.AsDuration())
	}

	// The client side: bodies as large as the policy accepts, identity headers stripped.
	ctps := ofKind[egv1a1.ClientTrafficPolicy](objs)
	if len(ctps) != 1 {
		t.Fatalf("want one ClientTrafficPolicy, got %d", len(ctps))
	}
	targetsGateway("ClientTrafficPolicy", ctps[0].Spec.TargetRefs)
	if c := ctps[0].Spec.Connection; c == nil || c.BufferLimit == nil || c.BufferLimit.Cmp(sf.maxRequestBody) < 0 {
		t.Errorf("the connection buffer limit is below envoy.max_request_body (%s)", sf.maxRequestBody.String())
	}
	if h := ctps[0].Spec.Headers; h == nil || h.EarlyRequestHeaders == nil ||
		!slices.Contains(h.EarlyRequestHeaders.Remove, "x-tenant-id") || !slices.Contains(h.EarlyRequestHeaders.Remove, "x-tenant-tier") {
		t.Error("the client's x-tenant-id and x-tenant-tier are not removed before the filters run: the policy trusts x-tenant-id")
	}

	// Routes: one rule per provider on x-llm-provider, the default provider caught without it.
	for _, r := range ofKind[gwapiv1.HTTPRoute](objs) {
		var routed []string
		catchAll := false
		for _, rule := range r.Spec.Rules {
			for _, m := range rule.Matches {
				provider := ""
				for _, h := range m.Headers {
					if h.Name == "x-llm-provider" && (h.Type == nil || *h.Type == gwapiv1.HeaderMatchExact) {
						provider = h.Value
					}
				}
				if provider == "" && len(m.Headers) == 0 {
					catchAll = true
				} else {
					routed = append(routed, provider)
				}
			}
			for _, b := range rule.BackendRefs {
				if b.Kind != nil && *b.Kind == "Backend" && !hasObject(objs, "Backend", string(b.Name)) {
					t.Errorf("HTTPRoute %s refers to Backend %s, which the example does not define", r.Name, b.Name)
				}
			}
		}
		if catchAll {
			routed = append(routed, sf.defaultProvider)
		}
		slices.Sort(routed)
		if !slices.Equal(routed, sf.providers) {
			t.Errorf("HTTPRoute %s routes providers %v, the policy has %v", r.Name, routed, sf.providers)
		}
		checkHostedRules(t, objs, r)
	}
	return objs
}

// checkHostedRules: a rule to a hosted provider's Backend (an FQDN on 443) sends that name in
// Host and talks TLS to it; the bedrock rule drops the client's signature, and its cluster
// (Envoy Gateway's httproute/<namespace>/<route>/rule/<index>) is patched to sign every
// attempt with SigV4 for bedrock in the host's region.
func checkHostedRules(t *testing.T, objs []object, r gwapiv1.HTTPRoute) {
	t.Helper()
	backends := map[string]egv1a1.Backend{}
	for _, b := range ofKind[egv1a1.Backend](objs) {
		backends[b.Name] = b
	}
	for i, rule := range r.Spec.Rules {
		if len(rule.BackendRefs) != 1 || rule.BackendRefs[0].Kind == nil || *rule.BackendRefs[0].Kind != "Backend" {
			continue
		}
		b, ok := backends[string(rule.BackendRefs[0].Name)]
		if !ok || len(b.Spec.Endpoints) != 1 || b.Spec.Endpoints[0].FQDN == nil {
			continue
		}
		host := b.Spec.Endpoints[0].FQDN.Hostname
		if b.Spec.Endpoints[0].FQDN.Port != 443 || b.Spec.TLS == nil || b.Spec.TLS.WellKnownCACertificates == nil {
			t.Errorf("Backend %s: %s is not reached over TLS on 443 with trusted CAs", b.Name, host)
		}
		rewrite, removed := "", map[string]bool{}
		for _, f := range rule.Filters {
			if f.URLRewrite != nil && f.URLRewrite.Hostname != nil {
				rewrite = string(*f.URLRewrite.Hostname)
			}
			if f.RequestHeaderModifier != nil {
				for _, h := range f.RequestHeaderModifier.Remove {
					removed[strings.ToLower(h)] = true
				}
			}
		}
		if rewrite != host {
			t.Errorf("HTTPRoute %s rule %d sends Host %q to Backend %s, which is %s", r.Name, i, rewrite, b.Name, host)
		}
		region, isBedrock := strings.CutPrefix(strings.TrimSuffix(host, ".amazonaws.com"), "bedrock-runtime.")
		if !isBedrock {
			continue
		}
		if !removed["authorization"] || !removed["x-amz-security-token"] {
			t.Errorf("HTTPRoute %s rule %d keeps the client's signature headers", r.Name, i)
		}
		cluster := fmt.Sprintf("httproute/%s/%s/rule/%d", r.Namespace, r.Name, i)
		patched := map[string]json.RawMessage{}
		for _, p := range ofKind[egv1a1.EnvoyPatchPolicy](objs) {
			for _, jp := range p.Spec.JSONPatches {
				if jp.Type == egv1a1.EnvoyResourceType(protoTypeURL(&clusterv3.Cluster{})) && jp.Name == cluster &&
					jp.Operation.Op == "add" && jp.Operation.Path != nil && jp.Operation.Value != nil {
					patched[strings.TrimPrefix(*jp.Operation.Path, "/")] = jp.Operation.Value.Raw
				}
			}
		}
		js, _ := json.Marshal(patched)
		var c clusterv3.Cluster
		if err := protojson.Unmarshal(js, &c); err != nil {
			t.Errorf("the patches of cluster %s do not decode into Envoy's Cluster: %v", cluster, err)
			continue
		}
		checkBedrockSigning(t, cluster, &c, region)
	}
}

// checkBedrockSigning: cluster c signs every request on its way out (an upstream HTTP filter)
// with SigV4 for service bedrock in region, over the body, which it can buffer as large as the
// policy's envoy.max_request_body; its credentials are not written inline.
func checkBedrockSigning(t *testing.T, what string, c *clusterv3.Cluster, region string) {
	t.Helper()
	var opts upstreamhttpv3.HttpProtocolOptions
	if err := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].UnmarshalTo(&opts); err != nil {
		t.Errorf("%s: no upstream HTTP filters: %v", what, err)
		return
	}
	filters := opts.GetHttpFilters()
	if len(filters) != 2 || filters[0].GetName() != "envoy.filters.http.aws_request_signing" || filters[1].GetName() != "envoy.filters.http.upstream_codec" {
		t.Errorf("%s: upstream filters %v, want aws_request_signing then upstream_codec", what, filters)
		return
	}
	var sig awssigningv3.AwsRequestSigning
	if err := filters[0].GetTypedConfig().UnmarshalTo(&sig); err != nil {
		t.Fatal(err)
	}
	if sig.GetServiceName() != "bedrock" || sig.GetRegion() != region || sig.GetUseUnsignedPayload() || sig.GetCredentialProvider().GetInlineCredential() != nil {
		t.Errorf("%s signs with %v: want service bedrock, region %s, the body signed, no inline credentials", what, &sig, region)
	}
	if got := c.GetPerConnectionBufferLimitBytes().GetValue(); got < 8<<20 {
		t.Errorf("%s buffers %d bytes to hash a body, below the policy's 8 MiB", what, got)
	}
}

func ptrString[T any](p *T) string {
	if p == nil {
		return "unset"
	}
	return fmt.Sprint(*p)
}

func protoTypeURL(m proto.Message) string {
	return "type.googleapis.com/" + string(m.ProtoReflect().Descriptor().FullName())
}

func TestIstioExample(t *testing.T) {
	objs := gatewayExample(t, "istio")
	sf := printedFilter(t)
	svcName, svcPort, _ := chartService(t)
	fqdn := svcName + "." + bulkheadNamespace + ".svc.cluster.local"
	wantCluster := fmt.Sprintf("outbound|%d||%s", svcPort, fqdn)

	var inserted int
	signed := map[string]bool{} // Bedrock hosts whose cluster signs requests
	for _, o := range objs {
		ef, ok := o.value.(*istionetworking.EnvoyFilter)
		if !ok {
			continue
		}
		for i, cp := range ef.GetConfigPatches() {
			what := fmt.Sprintf("EnvoyFilter %s patch %d", o.name, i)
			value, err := protojson.Marshal(cp.GetPatch().GetValue())
			if err != nil {
				t.Fatal(err)
			}
			switch cp.GetApplyTo() {
			case istionetworking.EnvoyFilter_HTTP_FILTER:
				var f hcmv3.HttpFilter
				if err := protojson.Unmarshal(value, &f); err != nil {
					t.Fatalf("%s does not decode strictly into Envoy's HttpFilter: %v", what, err)
				}
				if f.GetName() != "envoy.filters.http.ext_proc" {
					continue
				}
				inserted++
				got := extProc(t, what, value)
				if c := got.GetGrpcService().GetEnvoyGrpc().GetClusterName(); c != wantCluster {
					t.Errorf("%s calls cluster %q, Istio's cluster for the chart's Service is %q", what, c, wantCluster)
				}
				if sub := cp.GetMatch().GetListener().GetFilterChain().GetFilter().GetSubFilter().GetName(); cp.GetPatch().GetOperation() != istionetworking.EnvoyFilter_Patch_INSERT_BEFORE || sub != "envoy.filters.http.router" {
					t.Errorf("%s is not inserted before the router (%s %s)", what, cp.GetPatch().GetOperation(), sub)
				}
				// Everything but the cluster is what envoy-config prints for the policy;
				// the sidecar variant forwards no identity namespace (no jwt_authn there).
				want := proto.Clone(sf.filter).(*extprocv3.ExternalProcessor)
				got.GrpcService, want.GrpcService = nil, nil
				if cp.GetMatch().GetContext() == istionetworking.EnvoyFilter_SIDECAR_INBOUND {
					want.MetadataOptions.ForwardingNamespaces = nil
				}
				if !proto.Equal(got, want) {
					t.Errorf("%s differs from the filter envoy-config prints:\n got %v\nwant %v", what, got, want)
				}
			case istionetworking.EnvoyFilter_CLUSTER:
				var c clusterv3.Cluster
				if err := protojson.Unmarshal(value, &c); err != nil {
					t.Fatalf("%s does not decode strictly into Envoy's Cluster: %v", what, err)
				}
				host := cp.GetMatch().GetCluster().GetService()
				region, ok := strings.CutPrefix(strings.TrimSuffix(host, ".amazonaws.com"), "bedrock-runtime.")
				if !ok || cp.GetMatch().GetCluster().GetPortNumber() != 443 {
					t.Errorf("%s patches cluster %s:%d, not a Bedrock endpoint", what, host, cp.GetMatch().GetCluster().GetPortNumber())
					continue
				}
				signed[host] = true
				checkBedrockSigning(t, what, &c, region)
			case istionetworking.EnvoyFilter_LISTENER:
				var l listenerv3.Listener
				if err := protojson.Unmarshal(value, &l); err != nil {
					t.Fatalf("%s does not decode strictly into Envoy's Listener: %v", what, err)
				}
				if limit := int64(l.GetPerConnectionBufferLimitBytes().GetValue()); limit < sf.maxRequestBody.Value() {
					t.Errorf("%s: per-connection buffer %d below envoy.max_request_body %d", what, limit, sf.maxRequestBody.Value())
				}
			default:
				t.Errorf("%s applies to %s, which this test does not decode", what, cp.GetApplyTo())
			}
		}
	}
	if inserted != 2 {
		t.Errorf("want the ext_proc filter inserted twice (gateway and sidecar), got %d", inserted)
	}

	// Mesh mTLS to the chart's pods.
	podLabels := chartPodLabels(t)
	for _, o := range objs {
		switch v := o.value.(type) {
		case *istionetworking.DestinationRule:
			if v.GetHost() != fqdn || v.GetTrafficPolicy().GetTls().GetMode() != istionetworking.ClientTLSSettings_ISTIO_MUTUAL {
				t.Errorf("DestinationRule %s: host %s, TLS %s; want %s with ISTIO_MUTUAL", o.name, v.GetHost(),
					v.GetTrafficPolicy().GetTls().GetMode(), fqdn)
			}
		case *istiosecurity.PeerAuthentication:
			if o.namespace != bulkheadNamespace || !selects(v.GetSelector().GetMatchLabels(), podLabels) ||
				v.GetMtls().GetMode() != istiosecurity.PeerAuthentication_MutualTLS_STRICT {
				t.Errorf("PeerAuthentication %s does not make the chart's pods STRICT mTLS", o.name)
			}
			if mode := v.GetPortLevelMtls()[uint32(svcPort)]; mode != nil && mode.GetMode() != istiosecurity.PeerAuthentication_MutualTLS_STRICT {
				t.Errorf("PeerAuthentication %s relaxes mTLS on the ext_proc port", o.name)
			}
		case *istiosecurity.AuthorizationPolicy:
			if !selects(v.GetSelector().GetMatchLabels(), podLabels) {
				t.Errorf("AuthorizationPolicy %s does not select the chart's pods", o.name)
			}
		case *istionetworking.VirtualService:
			var routed []string
			for _, h := range v.GetHttp() {
				if len(h.GetMatch()) == 0 {
					routed = append(routed, sf.defaultProvider)
				}
				for _, m := range h.GetMatch() {
					routed = append(routed, m.GetHeaders()["x-llm-provider"].GetExact())
				}
				// A hosted provider (outside the cluster) gets its own name as the authority;
				// a Bedrock one is signed by the gateway, without the client's signature.
				for _, d := range h.GetRoute() {
					host := d.GetDestination().GetHost()
					if strings.HasSuffix(host, ".svc.cluster.local") {
						continue
					}
					if h.GetRewrite().GetAuthority() != host {
						t.Errorf("VirtualService %s sends authority %q to %s", o.name, h.GetRewrite().GetAuthority(), host)
					}
					if strings.HasPrefix(host, "bedrock-runtime.") {
						removed := h.GetHeaders().GetRequest().GetRemove()
						if !signed[host] || !slices.Contains(removed, "authorization") || !slices.Contains(removed, "x-amz-security-token") {
							t.Errorf("VirtualService %s: calls to %s are not re-signed by the gateway (cluster patched: %v, removes %v)", o.name, host, signed[host], removed)
						}
					}
				}
			}
			slices.Sort(routed)
			if !slices.Equal(routed, sf.providers) {
				t.Errorf("VirtualService %s routes providers %v, the policy has %v", o.name, routed, sf.providers)
			}
		}
	}
}

func selects(selector, podLabels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if podLabels[k] != v {
			return false
		}
	}
	return true
}

func chartPodLabels(t *testing.T) map[string]string {
	t.Helper()
	r, err := renderRelease(t, bulkheadRelease, bulkheadNamespace, nil)
	if err != nil {
		t.Fatal(err)
	}
	var dep struct {
		Spec struct {
			Template struct {
				Metadata metav1.ObjectMeta `json:"metadata"`
			} `json:"template"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(r.find(t, "Deployment", "").doc, &dep); err != nil {
		t.Fatal(err)
	}
	return dep.Spec.Template.Metadata.Labels
}

// A field the projects' types do not know fails: the strict decoding is what catches a typo.
func TestGatewayExamplesRefuseUnknownFields(t *testing.T) {
	cases := map[string]string{
		"EnvoyExtensionPolicy":  "apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: EnvoyExtensionPolicy\nmetadata: {name: x, namespace: ns}\nspec:\n  extProc:\n    - messageTimout: 200ms\n",
		"EnvoyFilter spec":      "apiVersion: networking.istio.io/v1alpha3\nkind: EnvoyFilter\nmetadata: {name: x, namespace: ns}\nspec:\n  workloadSelectr: {labels: {a: b}}\n",
		"HTTPRoute":             "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: x, namespace: ns}\nspec:\n  rules: [{matchs: []}]\n",
		"AIGatewayRoute":        "apiVersion: aigateway.envoyproxy.io/v1alpha1\nkind: AIGatewayRoute\nmetadata: {name: x, namespace: ns}\nspec:\n  rules: [{backendRefs: [{name: a, weigth: 1}]}]\n",
		"BackendSecurityPolicy": "apiVersion: aigateway.envoyproxy.io/v1alpha1\nkind: BackendSecurityPolicy\nmetadata: {name: x, namespace: ns}\nspec:\n  type: AWSCredentials\n  awsCredentials: {region: us-east-1, credentialsFile: {secretRef: {name: s}, profil: p}}\n",
	}
	for name, doc := range cases {
		t.Run(name, func(t *testing.T) {
			m, err := parseManifest(name, []byte(doc))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := decodeGatewayObject(m); err == nil || !strings.Contains(err.Error(), "unknown field") {
				t.Errorf("a misspelt field is accepted: %v", err)
			}
		})
	}
	// In an ext_proc filter patched into Envoy.
	var f hcmv3.HttpFilter
	bad := `{"name":"envoy.filters.http.ext_proc","typed_config":{"@type":"type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor","message_timout":"0.2s"}}`
	if err := protojson.Unmarshal([]byte(bad), &f); err == nil {
		t.Error("a misspelt ext_proc field is accepted")
	}
}
