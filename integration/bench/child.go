package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"runtime"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/extproc"
)

// Subcommands the benchmark program runs in its own child processes.
const (
	// CmdServeNoop serves Noop over gRPC, with /metrics on an admin listener.
	CmdServeNoop = "serve-noop"
	// CmdServeBulkhead serves llm-bulkhead assembled from cmd/llm-bulkhead/app (the same code as
	// the llm-bulkhead binary).
	CmdServeBulkhead = "serve-bulkhead"
	// CmdServeReplay serves Replay (llm-bulkhead's recorded replies) like CmdServeNoop.
	CmdServeReplay = "serve-replay"
	// All serve net/http/pprof on a listener of its own when given --pprof-addr.
)

// ReadyMessage is the log message with which a child process reports its listen addresses.
const ReadyMessage = "benchmark server listening"

// BinaryReadyMessage is the log message with which the llm-bulkhead binary reports them.
const BinaryReadyMessage = "llm-bulkhead listening"

// noopMaxMessage is the gRPC message limit of the no-op server: what llm-bulkhead sets for the
// example policy (max_request_body 8 MiB plus 1 MiB), so both parse the same messages.
const noopMaxMessage = 9 << 20

// IsChild reports whether args (without the program name) start with a child subcommand.
func IsChild(args []string) bool {
	return len(args) > 0 && (args[0] == CmdServeNoop || args[0] == CmdServeBulkhead || args[0] == CmdServeReplay)
}

// RunChild runs the child subcommand in args until ctx ends (SIGTERM in the child), logging
// JSON to stderr.
func RunChild(ctx context.Context, args []string, stderr io.Writer) error {
	if !IsChild(args) {
		return fmt.Errorf("not a benchmark server subcommand: %q", args)
	}
	fs := flag.NewFlagSet(args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	grpcAddr := fs.String("grpc-addr", "127.0.0.1:0", "ext_proc gRPC listen address")
	adminAddr := fs.String("admin-addr", "127.0.0.1:0", "admin HTTP listen address (/metrics)")
	pprofAddr := fs.String("pprof-addr", "", "net/http/pprof listen address (empty: none)")
	serverCodec := fs.Bool("server-codec", false, "no-op and replay: use llm-bulkhead's gRPC codec (its decoder of Envoy's requests, generated marshalling) instead of gRPC's default")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	pprofBound := ""
	if *pprofAddr != "" {
		srv, bound, err := servePprof(*pprofAddr)
		if err != nil {
			return err
		}
		defer srv.Close()
		pprofBound = bound
	}
	opts := []grpc.ServerOption{grpc.MaxRecvMsgSize(noopMaxMessage), grpc.MaxSendMsgSize(noopMaxMessage)}
	if *serverCodec {
		opts = append(opts, extproc.ServerOption())
	}
	switch args[0] {
	case CmdServeNoop:
		return serveMinimal(ctx, Noop{}, *grpcAddr, *adminAddr, pprofBound, log, opts)
	case CmdServeReplay:
		r, err := NewReplay(ctx)
		if err != nil {
			return err
		}
		return serveMinimal(ctx, r, *grpcAddr, *adminAddr, pprofBound, log, opts)
	}
	return serveBulkhead(ctx, *grpcAddr, *adminAddr, pprofBound, stderr, log)
}

// servePprof serves net/http/pprof on addr and returns the server and its bound address.
func servePprof(addr string) (*http.Server, string, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, "", fmt.Errorf("pprof listener: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return srv, ln.Addr().String(), nil
}

// serveMinimal serves ep (the no-op or the replay server) over gRPC with health checks, and
// the Go runtime's metrics on the admin listener.
func serveMinimal(ctx context.Context, ep extprocv3.ExternalProcessorServer, grpcAddr, adminAddr, pprofAddr string, log *slog.Logger, opts []grpc.ServerOption) error {
	gl, err := net.Listen("tcp", grpcAddr)
	if err != nil {
		return err
	}
	al, err := net.Listen("tcp", adminAddr)
	if err != nil {
		gl.Close()
		return err
	}
	srv := grpc.NewServer(opts...)
	extprocv3.RegisterExternalProcessorServer(srv, ep)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	admin := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}

	errs := make(chan error, 2)
	go func() { errs <- srv.Serve(gl) }()
	go func() { errs <- admin.Serve(al) }()
	log.Info(ReadyMessage, "grpc_addr", gl.Addr().String(), "admin_addr", al.Addr().String(), "pprof_addr", pprofAddr)
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errs:
	}
	srv.Stop()
	shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = admin.Shutdown(shut)
	if errors.Is(serveErr, http.ErrServerClosed) {
		serveErr = nil
	}
	return serveErr
}

func serveBulkhead(ctx context.Context, grpcAddr, adminAddr, pprofAddr string, stderr io.Writer, log *slog.Logger) error {
	// The heap floor `llm-bulkhead serve` keeps, so that profiles show the binary's collector.
	floor := app.HeapFloor(app.DefaultHeapFloor)
	defer runtime.KeepAlive(floor)
	a, err := app.New(app.Options{GRPCAddr: grpcAddr, AdminAddr: adminAddr, LogOutput: stderr})
	if err != nil {
		return err
	}
	if err := a.Start(); err != nil {
		return err
	}
	defer func() {
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		a.Shutdown(shut)
	}()
	log.Info(ReadyMessage, "grpc_addr", a.GRPCAddr(), "admin_addr", a.AdminAddr(), "pprof_addr", pprofAddr)
	select {
	case <-ctx.Done():
		return nil
	case err := <-a.Errors():
		return err
	}
}
