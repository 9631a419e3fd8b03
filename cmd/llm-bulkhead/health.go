package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
)

// healthCheck asks a running server's standard gRPC health service (grpc.health.v1.Health/Check, the
// one Envoy's gRPC health check and Kubernetes' grpc probe use) and prints the status. It exits 0
// only for SERVING, so a shell script or a Kubernetes exec probe can use it as it is: 1 for any
// other status (NOT_SERVING while starting or draining, SERVICE_UNKNOWN for a service the server
// does not have) or when the server cannot be asked, 2 for bad usage.
func healthCheck(c *command, ctx context.Context, args, _ []string, stdout, stderr io.Writer, _ <-chan os.Signal) int {
	fs := c.flags()
	addr := fs.String("addr", "127.0.0.1:9002", "the server's ext_proc gRPC address, host:port or unix:///path (its --grpc-addr or server.grpc_addr)")
	var ct clientTLS
	fs.StringVar(&ct.ca, "tls-ca", "", "speak TLS, verifying the server's certificate with this CA bundle (PEM)")
	fs.StringVar(&ct.cert, "tls-client-cert", "", "client certificate (PEM) to present, for a server that requires mutual TLS; needs --tls-ca")
	fs.StringVar(&ct.key, "tls-client-key", "", "private key (PEM) of --tls-client-cert")
	fs.StringVar(&ct.serverName, "tls-server-name", "", "name to verify in the server's certificate (default: the host of --addr, localhost for a unix socket)")
	service := fs.String("service", "", `service to ask about: "" for the whole server, or envoy.service.ext_proc.v3.ExternalProcessor`)
	timeout := fs.Duration("timeout", 2*time.Second, "give up (exit 1) when there is no answer within this long")
	if code, ok := c.parse(fs, args, stdout, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "llm-bulkhead health: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if *timeout <= 0 {
		fmt.Fprintln(stderr, "llm-bulkhead health: --timeout must be positive")
		return 2
	}
	if _, _, err := config.SplitListenAddr(*addr); err != nil {
		fmt.Fprintf(stderr, "llm-bulkhead health: --addr %v\n", err)
		return 2
	}
	creds, err := ct.credentials()
	if err != nil {
		fmt.Fprintf(stderr, "llm-bulkhead health: %v\n", err)
		return 2
	}
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		fmt.Fprintf(stderr, "llm-bulkhead health: %s: %v\n", *addr, err)
		return 2
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: *service})
	if status.Code(err) == codes.NotFound {
		// The server answered: it does not know the service asked about.
		fmt.Fprintln(stdout, healthpb.HealthCheckResponse_SERVICE_UNKNOWN)
		return 1
	}
	if err != nil {
		fmt.Fprintf(stderr, "llm-bulkhead health: %s: %s\n", *addr, status.Convert(err).Message())
		return 1
	}
	fmt.Fprintln(stdout, resp.GetStatus())
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return 1
	}
	return 0
}

// clientTLS is how health reaches a server that speaks TLS.
type clientTLS struct{ ca, cert, key, serverName string }

// credentials returns TLS credentials when a CA is given, plaintext when no TLS option is.
func (c clientTLS) credentials() (credentials.TransportCredentials, error) {
	if c.ca == "" {
		if c.cert != "" || c.key != "" || c.serverName != "" {
			return nil, errors.New("--tls-client-cert, --tls-client-key and --tls-server-name need --tls-ca, the CA that signed the server's certificate")
		}
		return insecure.NewCredentials(), nil
	}
	pem, err := files.Read(c.ca, files.MaxPEM)
	if err != nil {
		return nil, fmt.Errorf("--tls-ca: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("--tls-ca: %s holds no PEM certificate", c.ca)
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool, ServerName: c.serverName}
	if (c.cert == "") != (c.key == "") {
		return nil, errors.New("--tls-client-cert and --tls-client-key go together")
	}
	if c.cert != "" {
		pair, err := files.KeyPair(c.cert, c.key)
		if err != nil {
			return nil, fmt.Errorf("client certificate %s, key %s: %w", c.cert, c.key, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return credentials.NewTLS(cfg), nil
}
