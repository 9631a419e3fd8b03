package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// rejector answers every request with 429 unless the path is /ok.
type rejector struct {
	extprocv3.UnimplementedExternalProcessorServer
}

// upstreamStreams counts the streams that came marked as the upstream (per-attempt) filter's.
var upstreamStreams atomic.Int64

func (rejector) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	if v := metadata.ValueFromIncomingContext(srv.Context(), "x-llm-bulkhead-filter"); len(v) == 1 && v[0] == "upstream" {
		upstreamStreams.Add(1)
	}
	for {
		req, err := srv.Recv()
		if err != nil {
			return nil
		}
		var resp *extprocv3.ProcessingResponse
		switch {
		case req.GetRequestHeaders() != nil:
			path := ""
			for _, h := range req.GetRequestHeaders().GetHeaders().GetHeaders() {
				if h.GetKey() == ":path" {
					path = string(h.GetRawValue())
				}
			}
			if path != "/ok" {
				resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
					Status: &typev3.HttpStatus{Code: typev3.StatusCode_TooManyRequests}, Body: []byte("slow down")}}}
			} else {
				resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}
			}
		case req.GetResponseHeaders() != nil:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
		case req.GetRequestBody() != nil:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
		default:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
		}
		if err := srv.Send(resp); err != nil {
			return nil
		}
	}
}

func startExtProc(t *testing.T) string {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, rejector{})
	done := make(chan struct{})
	go func() { defer close(done); _ = gs.Serve(lis) }()
	t.Cleanup(func() { gs.Stop(); <-done })
	return lis.Addr().String()
}

func TestRun(t *testing.T) {
	extproc := startExtProc(t)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "upstream says hi")
	}))
	defer upstream.Close()
	cfgFile := filepath.Join(t.TempDir(), "filter.yaml")
	if err := os.WriteFile(cfgFile, []byte("grpc_service: {envoy_grpc: {cluster_name: x}}\nprocessing_mode: {request_body_mode: BUFFERED}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(extproc)
	clusterFile := filepath.Join(t.TempDir(), "envoy-config.yaml")
	cluster := "clusters:\n- name: llm_bulkhead\n  type: STATIC\n  connect_timeout: 1s\n" +
		"  http2_protocol_options: {}\n" +
		"  load_assignment:\n    cluster_name: llm_bulkhead\n    endpoints:\n    - lb_endpoints:\n" +
		"      - endpoint: {address: {socket_address: {address: " + host + ", port_value: " + port + "}}}\n"
	if err := os.WriteFile(clusterFile, []byte(cluster), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		args []string
		// attemptStreams is how many streams of the upstream filter the two requests open.
		attemptStreams int64
	}{
		{"mode flags", []string{"-request-body-mode", "buffered", "-response-body-mode", "STREAMED"}, 0},
		{"filter config file", []string{"-filter-config", cfgFile}, 0},
		// The cluster, not -extproc (which points nowhere here), says where the server is.
		{"cluster config file", []string{"-filter-config", cfgFile, "-extproc", "127.0.0.1:1", "-cluster-config", clusterFile}, 0},
		// The refused request never reaches the router; the admitted one is one attempt.
		{"upstream filter", []string{"-retries", "2", "-upstream-filter-config", "../../../../envoy/upstream.yaml"}, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			pr, pw := io.Pipe()
			errc := make(chan error, 1)
			args := append([]string{"-extproc", extproc, "-upstream", upstream.URL, "-listen", "127.0.0.1:0"}, tc.args...)
			go func() { errc <- run(ctx, args, pw); _ = pw.Close() }()
			line, err := bufio.NewReader(pr).ReadString('\n')
			if err != nil {
				cancel()
				t.Fatalf("no listening line: %v (run: %v)", err, <-errc)
			}
			go func() { _, _ = io.Copy(io.Discard, pr) }()
			base := strings.Fields(line)[3]
			before := upstreamStreams.Load()
			for path, want := range map[string]string{"/ok": "200 upstream says hi", "/v1/chat/completions": "429 slow down"} {
				resp, err := http.Post(base+path, "application/json", strings.NewReader("{}"))
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				if got := fmt.Sprintf("%d %s", resp.StatusCode, body); got != want {
					t.Fatalf("%s: got %q, want %q", path, got, want)
				}
			}
			if n := upstreamStreams.Load() - before; n != tc.attemptStreams {
				t.Errorf("%d streams of the upstream filter, want %d", n, tc.attemptStreams)
			}
			http.DefaultClient.CloseIdleConnections()
			cancel()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestRunRejectsBadFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
	}{
		{"bad body mode", []string{"-request-body-mode", "SOMETIMES"}},
		{"bad routes", []string{"-route-header", "x-p", "-routes", "nonsense"}},
		{"missing config file", []string{"-filter-config", "/nonexistent/filter.yaml"}},
		{"missing cluster file", []string{"-cluster-config", "/nonexistent/cluster.yaml"}},
		{"missing upstream filter file", []string{"-upstream-filter-config", "/nonexistent/upstream.yaml"}},
		{"cluster without upstream filters", []string{"-upstream-filter-config", "../../../../envoy/envoy.yaml"}},
		{"unknown flag", []string{"-nope"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := run(context.Background(), append([]string{"-listen", "127.0.0.1:0"}, tc.args...), io.Discard); err == nil {
				t.Fatal("want an error")
			}
		})
	}
}
