package envoysim

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	yaml "go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/encoding/protojson"
)

// Cluster is the ext_proc cluster: how the simulator reaches the server, as Envoy's
// envoy_grpc client does through the cluster named in grpc_service.
type Cluster struct {
	// Target is a gRPC target: host:port, or unix:///path for a pipe address.
	Target string
	// TLS is the cluster's UpstreamTlsContext; nil is plaintext HTTP/2 (h2c).
	TLS *UpstreamTLS
}

// UpstreamTLS mirrors the parts of envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
// that the simulator honours, with Envoy's semantics:
//
//   - TrustedCA nil (no validation_context) accepts any server certificate: Envoy verifies
//     nothing unless told to.
//   - With TrustedCA, the chain must lead to one of its certificates and be valid now; the
//     server's name is not checked unless MatchSANs is set (Envoy does not check SNI against
//     the certificate). Extended key usage is not enforced.
//   - With MatchSANs, one of the certificate's subject alternative names must equal one of
//     them (DNS names case-insensitively, a wildcard SAN covering one label).
//   - ClientCertificate is presented when the server asks (tls_certificates[0]).
//
// Differences: Envoy sends no SNI when sni is empty, while the simulator's gRPC client then
// sends the target's host (or "localhost" for a unix socket); servers that pick a certificate
// by SNI see that name. ALPN is always h2, which Envoy also offers for an HTTP/2 cluster.
type UpstreamTLS struct {
	SNI               string
	TrustedCA         *x509.CertPool
	MatchSANs         []SANMatcher
	ClientCertificate *tls.Certificate
}

// SANMatcher is one entry of match_typed_subject_alt_names with an exact matcher.
type SANMatcher struct {
	// Type is DNS, IP_ADDRESS, URI or EMAIL.
	Type  string
	Exact string
}

// NewCluster connects (lazily, as gRPC does) to the cluster's target, over TLS when the
// cluster says so, and returns a simulator whose filter behaves as cfg says.
func NewCluster(c Cluster, cfg FilterConfig, opts ...grpc.DialOption) (*Sim, error) {
	if c.TLS == nil {
		return New(c.Target, cfg, opts...)
	}
	return New(c.Target, cfg, append([]grpc.DialOption{grpc.WithTransportCredentials(c.TLS.credentials())}, opts...)...)
}

func (u *UpstreamTLS) credentials() credentials.TransportCredentials {
	c := &tls.Config{
		MinVersion: tls.VersionTLS12,
		ServerName: u.SNI,
		// Envoy's verification, not Go's: the name is checked only against MatchSANs.
		InsecureSkipVerify: true,
		VerifyConnection:   u.verify,
	}
	if u.ClientCertificate != nil {
		c.Certificates = []tls.Certificate{*u.ClientCertificate}
	}
	return credentials.NewTLS(c)
}

func (u *UpstreamTLS) verify(cs tls.ConnectionState) error {
	if u.TrustedCA == nil {
		return nil
	}
	if len(cs.PeerCertificates) == 0 {
		return errors.New("envoysim: the server sent no certificate")
	}
	leaf := cs.PeerCertificates[0]
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: u.TrustedCA, Intermediates: inter,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return fmt.Errorf("envoysim: CERTIFICATE_VERIFY_FAILED: %w", err)
	}
	if len(u.MatchSANs) == 0 {
		return nil
	}
	for _, m := range u.MatchSANs {
		if m.matches(leaf) {
			return nil
		}
	}
	return fmt.Errorf("envoysim: CERTIFICATE_VERIFY_FAILED: no subject alternative name of %q matches %v", leaf.Subject, u.MatchSANs)
}

func (m SANMatcher) matches(c *x509.Certificate) bool {
	switch m.Type {
	case "DNS":
		for _, n := range c.DNSNames {
			if dnsMatch(n, m.Exact) {
				return true
			}
		}
	case "IP_ADDRESS":
		want := net.ParseIP(m.Exact)
		for _, ip := range c.IPAddresses {
			if want != nil && ip.Equal(want) {
				return true
			}
		}
	case "URI":
		for _, u := range c.URIs {
			if u.String() == m.Exact {
				return true
			}
		}
	case "EMAIL":
		for _, e := range c.EmailAddresses {
			if e == m.Exact {
				return true
			}
		}
	}
	return false
}

// dnsMatch reports whether a certificate's DNS SAN san covers name: equal ignoring case, or
// a *.suffix wildcard standing for exactly one label.
func dnsMatch(san, name string) bool {
	san, name = strings.ToLower(san), strings.ToLower(name)
	if san == name {
		return true
	}
	if rest, ok := strings.CutPrefix(san, "*."); ok {
		label, tail, found := strings.Cut(name, ".")
		return found && label != "" && tail == rest
	}
	return false
}

// ClusterFromYAML reads one Envoy cluster (an entry of static_resources.clusters) as Envoy
// does, YAML → proto3 JSON with unknown fields rejected, then ClusterFromProto.
func ClusterFromYAML(data []byte) (Cluster, error) {
	c, err := parseCluster(data)
	if err != nil {
		return Cluster{}, err
	}
	return ClusterFromProto(c)
}

// parseCluster reads an Envoy cluster from YAML (or JSON) as Envoy does: YAML → proto3 JSON,
// unknown fields rejected.
func parseCluster(data []byte) (*clusterv3.Cluster, error) {
	var v any
	if err := yaml.Unmarshal(data, &v); err != nil {
		return nil, err
	}
	js, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var c clusterv3.Cluster
	if err := protojson.Unmarshal(js, &c); err != nil {
		return nil, fmt.Errorf("not a Cluster: %w", err)
	}
	return &c, nil
}

// ClusterFromProto converts the ext_proc cluster Envoy would load: one endpoint (a socket
// address or a pipe), HTTP/2 (gRPC needs it), and optionally a TLS transport socket whose
// files are read now, as Envoy reads them when it loads the configuration. It fails on what
// Envoy would reject and on what the simulator does not implement (SDS, several endpoints,
// matchers other than exact).
func ClusterFromProto(c *clusterv3.Cluster) (Cluster, error) {
	if c == nil {
		return Cluster{}, errors.New("nil Cluster")
	}
	if err := c.ValidateAll(); err != nil {
		return Cluster{}, err
	}
	if !http2Cluster(c) {
		return Cluster{}, fmt.Errorf("cluster %s: no HTTP/2 protocol options: Envoy would speak HTTP/1.1 to the gRPC server", c.GetName())
	}
	var addrs []*corev3.Address
	for _, e := range c.GetLoadAssignment().GetEndpoints() {
		for _, lb := range e.GetLbEndpoints() {
			addrs = append(addrs, lb.GetEndpoint().GetAddress())
		}
	}
	if len(addrs) != 1 {
		return Cluster{}, fmt.Errorf("cluster %s: %d endpoints; the simulator reaches exactly one", c.GetName(), len(addrs))
	}
	var out Cluster
	switch a := addrs[0]; {
	case a.GetPipe() != nil:
		if c.GetType() != clusterv3.Cluster_STATIC {
			return Cluster{}, fmt.Errorf("cluster %s: a pipe address needs type STATIC, not %s", c.GetName(), c.GetType())
		}
		out.Target = "unix://" + a.GetPipe().GetPath()
	case a.GetSocketAddress() != nil:
		sa := a.GetSocketAddress()
		out.Target = net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue())))
	default:
		return Cluster{}, fmt.Errorf("cluster %s: only socket_address and pipe endpoints are simulated", c.GetName())
	}
	ts := c.GetTransportSocket()
	if ts == nil {
		return out, nil
	}
	var up tlsv3.UpstreamTlsContext
	if ts.GetTypedConfig() == nil || ts.GetTypedConfig().UnmarshalTo(&up) != nil {
		return Cluster{}, fmt.Errorf("cluster %s: transport socket %s: only UpstreamTlsContext is simulated", c.GetName(), ts.GetName())
	}
	t, err := upstreamTLSFromProto(&up)
	if err != nil {
		return Cluster{}, fmt.Errorf("cluster %s: %w", c.GetName(), err)
	}
	out.TLS = t
	return out, nil
}

func http2Cluster(c *clusterv3.Cluster) bool {
	//lint:ignore SA1019 Envoy still honours the deprecated field.
	if c.GetHttp2ProtocolOptions() != nil {
		return true
	}
	a := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
	if a == nil {
		return false
	}
	var o httpv3.HttpProtocolOptions
	if a.UnmarshalTo(&o) != nil {
		return false
	}
	return o.GetExplicitHttpConfig().GetHttp2ProtocolOptions() != nil
}

func upstreamTLSFromProto(up *tlsv3.UpstreamTlsContext) (*UpstreamTLS, error) {
	if err := up.ValidateAll(); err != nil {
		return nil, err
	}
	ctc := up.GetCommonTlsContext()
	if len(ctc.GetTlsCertificateSdsSecretConfigs()) > 0 || ctc.GetValidationContextSdsSecretConfig() != nil ||
		ctc.GetCombinedValidationContext() != nil || ctc.GetTlsCertificateProviderInstance() != nil {
		return nil, errors.New("SDS and certificate providers are not simulated: give the files inline or by filename")
	}
	if alpn := ctc.GetAlpnProtocols(); len(alpn) > 0 && !slices.Contains(alpn, "h2") {
		return nil, fmt.Errorf("alpn_protocols %v lack h2: a gRPC server refuses the connection", alpn)
	}
	t := &UpstreamTLS{SNI: up.GetSni()}
	switch certs := ctc.GetTlsCertificates(); len(certs) {
	case 0:
	case 1:
		chain, err := dataSource(certs[0].GetCertificateChain())
		if err != nil {
			return nil, fmt.Errorf("certificate_chain: %w", err)
		}
		key, err := dataSource(certs[0].GetPrivateKey())
		if err != nil {
			return nil, fmt.Errorf("private_key: %w", err)
		}
		pair, err := tls.X509KeyPair(chain, key)
		if err != nil {
			return nil, fmt.Errorf("tls_certificates: %w", err)
		}
		t.ClientCertificate = &pair
	default:
		return nil, errors.New("several tls_certificates are not simulated")
	}
	vc := ctc.GetValidationContext()
	if vc == nil {
		return t, nil
	}
	if vc.GetTrustedCa() == nil {
		return nil, errors.New("validation_context without trusted_ca is not simulated")
	}
	ca, err := dataSource(vc.GetTrustedCa())
	if err != nil {
		return nil, fmt.Errorf("trusted_ca: %w", err)
	}
	t.TrustedCA = x509.NewCertPool()
	if !t.TrustedCA.AppendCertsFromPEM(ca) {
		return nil, errors.New("trusted_ca: no PEM certificate")
	}
	for _, m := range vc.GetMatchTypedSubjectAltNames() {
		exact := m.GetMatcher().GetExact()
		if exact == "" || m.GetMatcher().GetIgnoreCase() {
			return nil, errors.New("match_typed_subject_alt_names: only case-sensitive exact matchers are simulated")
		}
		t.MatchSANs = append(t.MatchSANs, SANMatcher{Type: m.GetSanType().String(), Exact: exact})
	}
	return t, nil
}

func dataSource(d *corev3.DataSource) ([]byte, error) {
	switch {
	case d.GetFilename() != "":
		// A regular file (through symlinks), as certificates are: not a device or a pipe.
		if fi, err := os.Stat(d.GetFilename()); err != nil {
			return nil, err
		} else if !fi.Mode().IsRegular() {
			return nil, fmt.Errorf("%s is not a regular file", d.GetFilename())
		}
		return os.ReadFile(d.GetFilename())
	case d.GetInlineBytes() != nil:
		return d.GetInlineBytes(), nil
	case d.GetInlineString() != "":
		return []byte(d.GetInlineString()), nil
	}
	return nil, errors.New("empty data source")
}
