package envoy_test

import (
	"strings"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	yaml "go.yaml.in/yaml/v3"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// generatedCluster runs envoy-config for a policy and returns its cluster, parsed and validated
// with Envoy's protos.
func generatedCluster(t *testing.T, policy string, c app.EnvoyCluster) *clusterv3.Cluster {
	t.Helper()
	p, err := config.Load("p.yaml", []byte(policy), nil)
	if err != nil {
		t.Fatal(err)
	}
	out, err := app.EnvoyConfigFor(p, c)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Clusters []any `yaml:"clusters"`
	}
	if err := yaml.Unmarshal(out, &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Clusters) != 1 {
		t.Fatalf("%d clusters", len(doc.Clusters))
	}
	cy, _ := yaml.Marshal(doc.Clusters[0])
	var cl clusterv3.Cluster
	unmarshalYAML(t, cy, &cl)
	return &cl
}

func upstreamTLS(t *testing.T, cl *clusterv3.Cluster) *tlsv3.UpstreamTlsContext {
	t.Helper()
	ts := cl.GetTransportSocket()
	if ts == nil {
		return nil
	}
	if ts.GetName() != "envoy.transport_sockets.tls" {
		t.Fatalf("transport socket %q", ts.GetName())
	}
	var up tlsv3.UpstreamTlsContext
	if err := ts.GetTypedConfig().UnmarshalTo(&up); err != nil {
		t.Fatal(err)
	}
	if err := up.ValidateAll(); err != nil {
		t.Fatalf("UpstreamTlsContext fails Envoy's validation rules: %v", err)
	}
	return &up
}

const limits = "features:\n  default: {max_concurrent: 4}\n"

// TestEnvoyConfigTLSCluster: for a listener with TLS the cluster carries an UpstreamTlsContext
// that verifies the server (CA and name), offers h2, and for mutual TLS presents Envoy's
// certificate; all of it valid for Envoy.
func TestEnvoyConfigTLSCluster(t *testing.T) {
	tlsPolicy := limits + "server: {tls_cert: /etc/llm-bulkhead/tls/tls.crt, tls_key: /etc/llm-bulkhead/tls/tls.key}\n"
	mtlsPolicy := limits + "server: {tls_cert: /etc/llm-bulkhead/tls/tls.crt, tls_key: /etc/llm-bulkhead/tls/tls.key, tls_client_ca: /etc/llm-bulkhead/tls/ca.crt}\n"

	cl := generatedCluster(t, tlsPolicy, app.EnvoyCluster{Name: "llm_bulkhead", Address: "llm-bulkhead.llm.svc:9002", CA: "/etc/envoy/ca.crt"})
	up := upstreamTLS(t, cl)
	if up == nil {
		t.Fatal("no TLS transport socket for a TLS listener")
	}
	ctc := up.GetCommonTlsContext()
	vc := ctc.GetValidationContext()
	if up.GetSni() != "llm-bulkhead.llm.svc" || vc.GetTrustedCa().GetFilename() != "/etc/envoy/ca.crt" ||
		len(ctc.GetAlpnProtocols()) != 1 || ctc.GetAlpnProtocols()[0] != "h2" || len(ctc.GetTlsCertificates()) != 0 {
		t.Errorf("TLS context %v", up)
	}
	sans := vc.GetMatchTypedSubjectAltNames()
	if len(sans) != 1 || sans[0].GetSanType() != tlsv3.SubjectAltNameMatcher_DNS || sans[0].GetMatcher().GetExact() != "llm-bulkhead.llm.svc" {
		t.Errorf("the server's name is not verified: %v", sans)
	}

	cl = generatedCluster(t, mtlsPolicy, app.EnvoyCluster{Name: "llm_bulkhead", Address: "10.0.0.7:9002", CA: "/etc/envoy/ca.crt",
		ClientCert: "/etc/envoy/tls.crt", ClientKey: "/etc/envoy/tls.key"})
	up = upstreamTLS(t, cl)
	certs := up.GetCommonTlsContext().GetTlsCertificates()
	if len(certs) != 1 || certs[0].GetCertificateChain().GetFilename() != "/etc/envoy/tls.crt" || certs[0].GetPrivateKey().GetFilename() != "/etc/envoy/tls.key" {
		t.Errorf("Envoy's client certificate: %v", certs)
	}
	sans = up.GetCommonTlsContext().GetValidationContext().GetMatchTypedSubjectAltNames()
	if up.GetSni() != "" || len(sans) != 1 || sans[0].GetSanType() != tlsv3.SubjectAltNameMatcher_IP_ADDRESS || sans[0].GetMatcher().GetExact() != "10.0.0.7" {
		t.Errorf("an IP address: sni %q, SANs %v; want no SNI and an IP SAN", up.GetSni(), sans)
	}

	// Plaintext stays plaintext.
	if up := upstreamTLS(t, generatedCluster(t, limits, app.EnvoyCluster{Name: "x", Address: "llm-bulkhead:9002"})); up != nil {
		t.Errorf("a plaintext listener got a TLS cluster: %v", up)
	}
}

// TestEnvoyConfigPipeCluster: a unix socket becomes a STATIC cluster with a pipe address, with
// TLS on top when asked.
func TestEnvoyConfigPipeCluster(t *testing.T) {
	cl := generatedCluster(t, limits+"server: {grpc_addr: \"unix:///run/llm-bulkhead/ext_proc.sock\"}\n", app.EnvoyCluster{Name: "llm_bulkhead"})
	if cl.GetType() != clusterv3.Cluster_STATIC {
		t.Errorf("type %v, want STATIC (Envoy resolves no pipe)", cl.GetType())
	}
	addr := cl.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress()
	if addr.GetPipe().GetPath() != "/run/llm-bulkhead/ext_proc.sock" || addr.GetSocketAddress() != nil {
		t.Errorf("address %v", addr)
	}
	if len(cl.GetHealthChecks()) != 1 || cl.GetHealthChecks()[0].GetGrpcHealthCheck() == nil {
		t.Error("the pipe cluster lost its gRPC health check")
	}
	cl = generatedCluster(t, limits, app.EnvoyCluster{Name: "llm_bulkhead", Address: "unix:///run/lb.sock", CA: "/ca.crt", ServerName: "llm-bulkhead.local"})
	if up := upstreamTLS(t, cl); up.GetSni() != "llm-bulkhead.local" || cl.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetPipe() == nil {
		t.Errorf("TLS over a pipe: %v", cl)
	}
}

// TestEnvoyConfigTLSRefusals: settings that would leave Envoy unable to connect, or connected
// without verifying the server, are errors that say what to add.
func TestEnvoyConfigTLSRefusals(t *testing.T) {
	mtls := limits + "server: {tls_cert: /c, tls_key: /k, tls_client_ca: /ca}\n"
	tlsOnly := limits + "server: {tls_cert: /c, tls_key: /k}\n"
	for name, c := range map[string]struct {
		policy string
		c      app.EnvoyCluster
		want   string
	}{
		"TLS without a CA":        {tlsOnly, app.EnvoyCluster{Address: "h:1"}, "--tls-ca"},
		"mTLS without a cert":     {mtls, app.EnvoyCluster{Address: "h:1", CA: "/ca"}, "--tls-client-cert"},
		"cert without key":        {tlsOnly, app.EnvoyCluster{Address: "h:1", CA: "/ca", ClientCert: "/c"}, "--tls-client-key"},
		"TLS over unix, no name":  {tlsOnly, app.EnvoyCluster{Address: "unix:///s.sock", CA: "/ca"}, "--tls-server-name"},
		"listen-on-all address":   {limits, app.EnvoyCluster{Address: "0.0.0.0:9002"}, "not a listen-on-all address"},
		"port out of range":       {limits, app.EnvoyCluster{Address: "h:99999"}, "between 1 and 65535"},
		"relative unix authority": {limits, app.EnvoyCluster{Address: "unix://run/s.sock"}, "unix:///absolute/path"},
	} {
		p, err := config.Load("p.yaml", []byte(c.policy), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := app.EnvoyConfigFor(p, c.c); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q", name, err, c.want)
		}
	}
}
