package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// healthCheck asks a running server's standard gRPC health service (grpc.health.v1.Health/Check, the
// one Envoy's gRPC health check and Kubernetes' grpc probe use) and prints the status. It exits 0
// only for SERVING, so a shell script or a Kubernetes exec probe can use it as it is: 1 for any
// other status (NOT_SERVING while starting or draining, SERVICE_UNKNOWN for a service the server
// does not have) or when the server cannot be asked, 2 for bad usage.
func healthCheck(c *command, ctx context.Context, args, _ []string, stdout, stderr io.Writer, _ <-chan os.Signal) int {
	fs := c.flags()
	addr := fs.String("addr", "127.0.0.1:9002", "the server's ext_proc gRPC address (its --grpc-addr or server.grpc_addr)")
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
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
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
