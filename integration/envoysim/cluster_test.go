package envoysim

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/testpki"
)

const h2Options = `
typed_extension_protocol_options:
  envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
    "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
    explicit_http_config: {http2_protocol_options: {}}
`

func clusterYAML(typ, address, extra string) string {
	return "name: c\ntype: " + typ + "\nconnect_timeout: 1s\n" + h2Options +
		"load_assignment:\n  cluster_name: c\n  endpoints:\n  - lb_endpoints:\n    - endpoint:\n        address: " + address + "\n" + extra
}

// TestClusterFromYAML: the endpoint becomes a gRPC target, the TLS context's files are read,
// and what Envoy would reject or the simulator cannot do is an error.
func TestClusterFromYAML(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "ca")
	cli := ca.Client(t, "envoy")
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	caFile, certFile, keyFile := write("ca.crt", ca.PEM), write("tls.crt", cli.PEM), write("tls.key", cli.KeyPEM)
	tlsSocket := func(ctc string) string {
		return "transport_socket:\n  name: envoy.transport_sockets.tls\n  typed_config:\n" +
			"    \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n" +
			"    sni: lb.test\n    common_tls_context:\n" + ctc
	}
	full := tlsSocket("      alpn_protocols: [h2]\n      tls_certificates:\n      - certificate_chain: {filename: " + certFile + "}\n        private_key: {filename: " + keyFile + "}\n" +
		"      validation_context:\n        trusted_ca: {filename: " + caFile + "}\n        match_typed_subject_alt_names:\n        - {san_type: DNS, matcher: {exact: lb.test}}\n")

	c, err := ClusterFromYAML([]byte(clusterYAML("STRICT_DNS", "{socket_address: {address: lb.test, port_value: 9002}}", full)))
	if err != nil {
		t.Fatal(err)
	}
	if c.Target != "lb.test:9002" || c.TLS == nil || c.TLS.SNI != "lb.test" || c.TLS.ClientCertificate == nil || c.TLS.TrustedCA == nil ||
		len(c.TLS.MatchSANs) != 1 || c.TLS.MatchSANs[0] != (SANMatcher{"DNS", "lb.test"}) {
		t.Fatalf("cluster %+v, TLS %+v", c, c.TLS)
	}
	if !c.TLS.TrustedCA.Equal(func() *x509.CertPool { p := x509.NewCertPool(); p.AddCert(ca.Cert); return p }()) {
		t.Error("trusted_ca is not the CA file")
	}
	c, err = ClusterFromYAML([]byte(clusterYAML("STATIC", "{pipe: {path: /run/lb.sock}}", "")))
	if err != nil || c.Target != "unix:///run/lb.sock" || c.TLS != nil {
		t.Fatalf("pipe: %+v %v", c, err)
	}
	// No validation context: Envoy verifies nothing, and neither does the simulator.
	c, err = ClusterFromYAML([]byte(clusterYAML("STRICT_DNS", "{socket_address: {address: lb.test, port_value: 9002}}", tlsSocket("      alpn_protocols: [h2]\n"))))
	if err != nil || c.TLS == nil || c.TLS.TrustedCA != nil {
		t.Fatalf("TLS without validation: %+v %v", c, err)
	}

	for name, src := range map[string]string{
		"HTTP/1.1 cluster":     strings.Replace(clusterYAML("STRICT_DNS", "{socket_address: {address: h, port_value: 1}}", ""), h2Options, "\n", 1),
		"pipe not STATIC":      clusterYAML("STRICT_DNS", "{pipe: {path: /run/lb.sock}}", ""),
		"missing CA file":      clusterYAML("STRICT_DNS", "{socket_address: {address: h, port_value: 1}}", tlsSocket("      validation_context: {trusted_ca: {filename: "+filepath.Join(dir, "nope")+"}}\n")),
		"ALPN without h2":      clusterYAML("STRICT_DNS", "{socket_address: {address: h, port_value: 1}}", tlsSocket("      alpn_protocols: [http/1.1]\n")),
		"SDS":                  clusterYAML("STRICT_DNS", "{socket_address: {address: h, port_value: 1}}", tlsSocket("      tls_certificate_sds_secret_configs: [{name: x}]\n")),
		"prefix SAN matcher":   clusterYAML("STRICT_DNS", "{socket_address: {address: h, port_value: 1}}", tlsSocket("      validation_context:\n        trusted_ca: {filename: "+caFile+"}\n        match_typed_subject_alt_names: [{san_type: DNS, matcher: {prefix: lb}}]\n")),
		"unknown field":        clusterYAML("STRICT_DNS", "{socket_address: {address: h, port_value: 1}}", "nonsense: 1\n"),
		"two endpoints":        clusterYAML("STRICT_DNS", "{socket_address: {address: h, port_value: 1}}", "") + "    - endpoint: {address: {socket_address: {address: h2, port_value: 1}}}\n",
		"key without its pair": clusterYAML("STRICT_DNS", "{socket_address: {address: h, port_value: 1}}", tlsSocket("      tls_certificates: [{certificate_chain: {filename: "+certFile+"}, private_key: {filename: "+caFile+"}}]\n")),
	} {
		if _, err := ClusterFromYAML([]byte(src)); err == nil {
			t.Errorf("%s: accepted\n%s", name, src)
		}
	}
}

func TestDNSMatch(t *testing.T) {
	for _, c := range []struct {
		san, name string
		want      bool
	}{
		{"lb.test", "lb.test", true},
		{"LB.test", "lb.TEST", true},
		{"*.llm.svc", "lb.llm.svc", true},
		{"*.llm.svc", "a.lb.llm.svc", false},
		{"*.llm.svc", "llm.svc", false},
		{"lb.test", "other.test", false},
	} {
		if got := dnsMatch(c.san, c.name); got != c.want {
			t.Errorf("dnsMatch(%q, %q) = %v", c.san, c.name, got)
		}
	}
}

// FuzzClusterFromYAML: any input is a cluster or an error, never a panic; a cluster always has
// a target.
func FuzzClusterFromYAML(f *testing.F) {
	f.Add([]byte(clusterYAML("STATIC", "{pipe: {path: /run/lb.sock}}", "")))
	f.Add([]byte(clusterYAML("STRICT_DNS", "{socket_address: {address: h, port_value: 1}}", "")))
	f.Add([]byte("name: c\ntransport_socket: {name: x}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ClusterFromYAML(data)
		if err == nil && c.Target == "" {
			t.Fatalf("a cluster without a target from %q", data)
		}
	})
}
