package app

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"sort"
	"strconv"
	"text/template"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// EnvoyCluster says how Envoy reaches this server. File paths are as Envoy sees them (its
// container or machine), not this server's.
type EnvoyCluster struct {
	// Name is the Envoy cluster's name.
	Name string
	// Address is host:port or unix:///path; empty takes the policy's server.grpc_addr. Use the
	// name Envoy resolves, e.g. llm-bulkhead:9002 in docker-compose.
	Address string
	// CA is the PEM bundle Envoy verifies the server's certificate with. Required when the
	// server speaks TLS: without it Envoy would accept any certificate.
	CA string
	// ClientCert and ClientKey are Envoy's certificate and key for mutual TLS. Required when the
	// policy sets server.tls_client_ca; both or neither.
	ClientCert, ClientKey string
	// ServerName is the SNI Envoy sends and the DNS name it requires in the server's certificate.
	// Empty: the address's host (an IP address is then matched as an IP SAN, without SNI).
	ServerName string
}

// tls reports whether Envoy must speak TLS to the server.
func (c EnvoyCluster) tls(p *config.Policy) bool {
	return p.Server.TLSCert != "" || c.CA != "" || c.ClientCert != "" || c.ClientKey != "" || c.ServerName != ""
}

// EnvoyConfig is EnvoyConfigFor with a plaintext cluster named cluster at address.
func EnvoyConfig(p *config.Policy, cluster, address string) ([]byte, error) {
	return EnvoyConfigFor(p, EnvoyCluster{Name: cluster, Address: address})
}

// EnvoyConfigFor prints the Envoy ext_proc HTTP filter and the cluster that reach this server,
// matching policy p: the body modes its rules and estimates need, message_timeout and
// max_message_timeout consistent with its longest max_wait, allow_mode_override, the metadata
// namespaces it reads and writes, and the attributes it reads. The cluster speaks TLS (an
// UpstreamTlsContext transport socket) when the policy's listener does or c names TLS files,
// and reaches a unix socket through a pipe address. With envoy.upstream_filter it prints the
// upstream (per-attempt) filter chain for the provider clusters too.
func EnvoyConfigFor(p *config.Policy, c EnvoyCluster) ([]byte, error) {
	address := c.Address
	if address == "" {
		address = p.Server.GRPCAddr
	}
	network, where, err := config.SplitListenAddr(address)
	if err != nil {
		return nil, fmt.Errorf("address %w", err)
	}
	var host, port string
	if network == "tcp" {
		host, port, _ = net.SplitHostPort(where)
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return nil, fmt.Errorf("address %q: the port must be a number between 1 and 65535", address)
		}
		if host == "" || host == "0.0.0.0" || host == "::" {
			return nil, fmt.Errorf("address %q: give the host Envoy connects to (--address), not a listen-on-all address", address)
		}
	}
	tlsData, err := c.tlsData(p, network, host)
	if err != nil {
		return nil, err
	}
	var forwarding, attributes []string
	cl := p.Classification
	for _, d := range []config.Dimension{cl.Feature, cl.Tenant, cl.Tier, cl.Provider, cl.Model} {
		for _, r := range d.Rules {
			if r.Metadata != nil && !slices.Contains(forwarding, r.Metadata.Namespace) {
				forwarding = append(forwarding, r.Metadata.Namespace)
			}
			if r.Attribute != "" && !slices.Contains(attributes, r.Attribute) {
				attributes = append(attributes, r.Attribute)
			}
		}
	}
	sort.Strings(forwarding)
	sort.Strings(attributes)
	data := map[string]any{
		"Cluster":           c.Name,
		"Host":              host,
		"Port":              port,
		"Pipe":              map[bool]string{true: where}[network == "unix"],
		"TLS":               tlsData,
		"FailureModeAllow":  p.Envoy.FailureModeAllow,
		"AllowModeOverride": p.Envoy.AllowModeOverride,
		"MessageTimeout":    protoDuration(p.Envoy.MessageTimeout.D()),
		"MaxMessageTimeout": protoDuration(p.Envoy.MaxMessageTimeout.D()),
		"HasMaxMessage":     p.Envoy.MaxMessageTimeout > 0,
		"RequestBodyMode":   p.Envoy.RequestBodyMode,
		"ResponseBodyMode":  p.Envoy.ResponseBodyMode,
		"Namespace":         p.Envoy.MetadataNamespace,
		"Forwarding":        forwarding,
		"Attributes":        attributes,
		"BufferLimit":       int64(p.Envoy.MaxRequestBody),
		"StreamsPerConn":    p.Server.MaxStreamsPerConnection,
		"UpstreamFilter":    p.Envoy.UpstreamFilter,
		"PositionKey":       extproc.FilterPositionKey,
		"PositionUpstream":  extproc.FilterPositionUpstream,
	}
	var b bytes.Buffer
	if err := envoyTemplate.Execute(&b, data); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// protoDuration writes a duration as protobuf JSON/YAML expects ("0.200s").
func protoDuration(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + "s"
}

var envoyTemplate = template.Must(template.New("envoy").Funcs(template.FuncMap{"json": jsonString}).Parse(
	// The ext_proc filter's start, in both positions.
	`{{define "extproc"}}- name: envoy.filters.http.ext_proc
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
    grpc_service:
      envoy_grpc:
        cluster_name: {{.Cluster}}{{end}}` +
		`# Envoy configuration for llm-bulkhead, generated by "llm-bulkhead envoy-config" from the policy.
# Put the filter before the router in your HTTP connection manager's http_filters, and add the
# cluster to your clusters. Routes to LLM upstreams need a request body buffer of at least
# {{.BufferLimit}} bytes (the route's request_body_buffer_limit or the listener's
# per_connection_buffer_limit_bytes), or Envoy answers 413 before the server sees the body.
http_filters:
{{template "extproc" .}}
    # A broken or unreachable llm-bulkhead {{if .FailureModeAllow}}lets requests through unguarded{{else}}fails requests with 500{{end}}.
    failure_mode_allow: {{.FailureModeAllow}}
    # Lets the server skip request bodies it does not need and response bodies it need not read.
    allow_mode_override: {{.AllowModeOverride}}
    message_timeout: {{.MessageTimeout}}
{{- if .HasMaxMessage}}
    # The server extends the per-message timeout while a request waits in a queue (max_wait).
    max_message_timeout: {{.MaxMessageTimeout}}
{{- end}}
    processing_mode:
      request_header_mode: SEND
      response_header_mode: SEND
      request_body_mode: {{.RequestBodyMode}}
      response_body_mode: {{.ResponseBodyMode}}
      request_trailer_mode: SKIP
      response_trailer_mode: SKIP
    metadata_options:
{{- if .Forwarding}}
      # Trusted identity (e.g. jwt_authn claims) the policy reads from dynamic metadata.
      forwarding_namespaces:
        untyped:
{{- range .Forwarding}}
        - {{.}}
{{- end}}
{{- end}}
      # Classification and settled usage, for access logs and other filters.
      receiving_namespaces:
        untyped:
        - {{.Namespace}}
{{- if .Attributes}}
    request_attributes:
{{- range .Attributes}}
    - {{.}}
{{- end}}
{{- end}}
{{- if .UpstreamFilter}}
# envoy.upstream_filter: llm-bulkhead is the upstream (per-attempt) ext_proc filter too. Put these
# in the http_filters of each provider cluster's typed_extension_protocol_options
# envoy.extensions.upstreams.http.v3.HttpProtocolOptions (upstream_codec last): every attempt of
# the router's retries then counts in the breaker and the provider's quota. The filter only
# reads headers, never blocks or changes an attempt, and fails open.
upstream_http_filters:
{{template "extproc" .}}
      initial_metadata:
      - {key: {{.PositionKey}}, value: {{.PositionUpstream}}}
    failure_mode_allow: true
    message_timeout: {{.MessageTimeout}}
    processing_mode:
      request_header_mode: SEND
      response_header_mode: SEND
      request_body_mode: NONE
      response_body_mode: NONE
      request_trailer_mode: SKIP
      response_trailer_mode: SKIP
- name: envoy.filters.http.upstream_codec
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec
{{- end}}
clusters:
- name: {{.Cluster}}
{{- if .Pipe}}
  # A unix socket: Envoy and the server share the socket's directory (a sidecar's emptyDir).
  type: STATIC
{{- else}}
  type: STRICT_DNS
{{- end}}
  connect_timeout: 1s
  typed_extension_protocol_options:
    envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
      "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
      explicit_http_config:
        http2_protocol_options:
          # The server's server.max_streams_per_connection: Envoy opens another connection
          # when one holds this many streams, instead of queueing streams on a full one.
          max_concurrent_streams: {{.StreamsPerConn}}
  load_assignment:
    cluster_name: {{.Cluster}}
    endpoints:
    - lb_endpoints:
      - endpoint:
          address:
{{- if .Pipe}}
            pipe:
              path: {{json .Pipe}}
{{- else}}
            socket_address:
              address: {{.Host}}
              port_value: {{.Port}}
{{- end}}
  health_checks:
  - timeout: 1s
    interval: 5s
    unhealthy_threshold: 2
    healthy_threshold: 1
    grpc_health_check:
      service_name: envoy.service.ext_proc.v3.ExternalProcessor
{{- with .TLS}}
  # The server speaks TLS{{if .ClientCert}} and requires Envoy's client certificate{{end}}.
  # Envoy reads these files when it loads this configuration; to rotate them without a
  # restart, serve them through SDS.
  transport_socket:
    name: envoy.transport_sockets.tls
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
{{- if .SNI}}
      sni: {{json .SNI}}
{{- end}}
      common_tls_context:
        alpn_protocols: [h2]
        tls_params:
          tls_minimum_protocol_version: TLSv1_2
{{- if .ClientCert}}
        tls_certificates:
        - certificate_chain:
            filename: {{json .ClientCert}}
          private_key:
            filename: {{json .ClientKey}}
{{- end}}
        validation_context:
          trusted_ca:
            filename: {{json .CA}}
          # Envoy checks the name only when told to; without this, any certificate of the CA passes.
          match_typed_subject_alt_names:
          - san_type: {{.SANType}}
            matcher:
              exact: {{json .SAN}}
{{- end}}
`))

// envoyTLS is the cluster's UpstreamTlsContext as the template writes it.
type envoyTLS struct {
	SNI, CA, ClientCert, ClientKey string
	SANType, SAN                   string
}

// tlsData checks the TLS settings against the policy and fills in the name to verify: nil for
// a plaintext cluster.
func (c EnvoyCluster) tlsData(p *config.Policy, network, host string) (*envoyTLS, error) {
	if !c.tls(p) {
		return nil, nil
	}
	if c.CA == "" {
		return nil, errors.New("the server speaks TLS: give --tls-ca, the CA file with which Envoy verifies the server's certificate (without it Envoy accepts any certificate)")
	}
	if (c.ClientCert == "") != (c.ClientKey == "") {
		return nil, errors.New("--tls-client-cert and --tls-client-key go together: Envoy's client certificate needs both")
	}
	if p.Server.TLSClientCA != "" && c.ClientCert == "" {
		return nil, errors.New("the policy requires client certificates (server.tls_client_ca): give --tls-client-cert and --tls-client-key, Envoy's certificate and key")
	}
	t := &envoyTLS{CA: c.CA, ClientCert: c.ClientCert, ClientKey: c.ClientKey, SNI: c.ServerName, SANType: "DNS", SAN: c.ServerName}
	if t.SAN == "" {
		switch {
		case network == "unix":
			return nil, errors.New("TLS over a unix socket: give --tls-server-name, the DNS name in the server's certificate")
		case net.ParseIP(host) != nil:
			// An IP address is no SNI; Envoy matches it against the certificate's IP SANs.
			t.SANType, t.SAN = "IP_ADDRESS", host
		default:
			t.SNI, t.SAN = host, host
		}
	}
	return t, nil
}

// jsonString writes s as a JSON string, which YAML reads back unchanged whatever it holds.
func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}
