package main

import (
	"bytes"
	"context"
	"net"
	"runtime"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
)

// runCLI runs the command line and returns its exit status, stdout and stderr.
func runCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, []string{}, &out, &errOut, nil)
	return code, out.String(), errOut.String()
}

// TestVersion: version, --version and -version print the stamped version first, then commit,
// Go version, build tags and platform.
func TestVersion(t *testing.T) {
	defer func(v string) { version = v }(version)
	version = "v9.8.7-1-gabcdef0"
	for _, args := range [][]string{{"version"}, {"--version"}, {"-version"}} {
		code, out, errOut := runCLI(t, args...)
		if code != 0 || errOut != "" {
			t.Fatalf("%v: exit %d, stderr %q", args, code, errOut)
		}
		if !strings.HasPrefix(out, "llm-bulkhead v9.8.7-1-gabcdef0\n") {
			t.Errorf("%v: first line of %q is not the version", args, out)
		}
		for _, want := range []string{"\n  commit:     ", "\n  go version: " + runtime.Version() + "\n", "\n  platform:   " + runtime.GOOS + "/" + runtime.GOARCH + "\n"} {
			if !strings.Contains(out, want) {
				t.Errorf("%v: %q lacks %q", args, out, want)
			}
		}
		// The build tag that switches the fast reply marshalling on is named when it is there.
		if tagged := strings.Contains(out, "build tags: vtprotobuf"); tagged != extproc.FastMarshal() {
			t.Errorf("%v: build tags line says vtprotobuf = %v, but the binary's fast marshalling is %v:\n%s", args, tagged, extproc.FastMarshal(), out)
		}
	}
	if code, _, errOut := runCLI(t, "version", "extra"); code != 2 || !strings.Contains(errOut, "unexpected arguments") {
		t.Errorf("version extra: exit %d, %q", code, errOut)
	}
}

// TestHelp: -h, --help, -help and help list every command with its line; each command's -h and
// help <command> print its synopsis, what it does and its flags on stdout and exit 0; a bad flag
// prints the problem and the usage on stderr and exits 2.
func TestHelp(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"--help"}, {"-help"}, {"help"}} {
		code, out, errOut := runCLI(t, args...)
		if code != 0 || errOut != "" {
			t.Fatalf("%v: exit %d, stderr %q", args, code, errOut)
		}
		for _, c := range commands {
			if want := "\n  " + c.name + strings.Repeat(" ", 14-len(c.name)) + c.summary + "\n"; !strings.Contains(out, want) {
				t.Errorf("%v: %q lacks %q", args, out, want)
			}
		}
	}
	withFlags := map[string][]string{
		"serve":        {"-config", "-grpc-addr", "-tls-cert", "-tls-key", "-tls-client-ca", "-admin-addr", "-admin-insecure", "-admin-allowed-hosts", "-log-level", "-watch", "-state-file", "-spend-state", "-gc-heap-floor"},
		"validate":     {"-config", "-explain"},
		"envoy-config": {"-config", "-cluster", "-address", "-tls-ca", "-tls-client-cert", "-tls-client-key", "-tls-server-name"},
		"health":       {"-addr", "-service", "-timeout", "-tls-ca", "-tls-client-cert", "-tls-client-key", "-tls-server-name"},
		"version":      nil,
		"help":         nil,
	}
	if len(withFlags) != len(commands) {
		t.Fatalf("%d commands, %d checked", len(commands), len(withFlags))
	}
	for _, c := range commands {
		for _, args := range [][]string{{c.name, "-h"}, {c.name, "--help"}, {"help", c.name}} {
			code, out, errOut := runCLI(t, args...)
			if code != 0 || errOut != "" {
				t.Fatalf("%v: exit %d, stderr %q", args, code, errOut)
			}
			head := "Usage: llm-bulkhead " + c.name
			if !strings.HasPrefix(out, head) || !strings.Contains(out, "\n\n"+upperFirst(c.summary)+".\n") || strings.Contains(out, "Usage of") {
				t.Errorf("%v:\n%s", args, out)
			}
			for _, f := range withFlags[c.name] {
				if !strings.Contains(out, "\nFlags:\n") || !strings.Contains(out, "  "+f+" ") && !strings.Contains(out, "  "+f+"\n") {
					t.Errorf("%v: flag %s not described:\n%s", args, f, out)
				}
			}
		}
	}
	code, out, errOut := runCLI(t, "serve", "--admin-allowed-hosts", "admin.example.com,https://admin.example.com/")
	if code != 2 || out != "" || !strings.Contains(errOut, `"https://admin.example.com/" is not a host name`) {
		t.Errorf("serve --admin-allowed-hosts with a URL: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "health", "--nope")
	if code != 2 || out != "" || !strings.HasPrefix(errOut, "llm-bulkhead health: flag provided but not defined: -nope\n\nUsage: llm-bulkhead health") {
		t.Errorf("health --nope: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if code, _, errOut := runCLI(t, "help", "frobnicate"); code != 2 || !strings.Contains(errOut, `unknown command "frobnicate"`) {
		t.Errorf("help frobnicate: exit %d, %q", code, errOut)
	}
}

// TestHealth: health asks a real server's gRPC health service and exits 0 only for SERVING.
func TestHealth(t *testing.T) {
	grpcAddr, adminAddr := freeAddr(t), freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	logs := &syncbuf.Buffer{}
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--grpc-addr", grpcAddr, "--admin-addr", adminAddr}, []string{}, &bytes.Buffer{}, logs, nil)
	}()
	defer func() {
		cancel()
		<-done
	}()
	waitUntil(t, func() bool { return strings.Contains(logs.String(), "llm-bulkhead listening") })

	// A second server, whose status the test sets, and an address nothing answers on.
	notServing := health.NewServer()
	notServing.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, notServing)
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	closed := freeAddr(t)

	tests := []struct {
		name     string
		args     []string
		wantCode int
		wantOut  string
		wantErr  string
	}{
		{"the server", []string{"--addr", grpcAddr}, 0, "SERVING\n", ""},
		{"the ext_proc service", []string{"--addr", grpcAddr, "--service", "envoy.service.ext_proc.v3.ExternalProcessor"}, 0, "SERVING\n", ""},
		{"a service it does not have", []string{"--addr", grpcAddr, "--service", "nope"}, 1, "SERVICE_UNKNOWN\n", ""},
		{"not serving", []string{"--addr", ln.Addr().String()}, 1, "NOT_SERVING\n", ""},
		{"nobody there", []string{"--addr", closed, "--timeout", "5s"}, 1, "", "llm-bulkhead health: " + closed + ": "},
		{"bad timeout", []string{"--addr", grpcAddr, "--timeout", "0s"}, 2, "", "--timeout must be positive"},
		{"arguments", []string{"--addr", grpcAddr, "x"}, 2, "", "unexpected arguments"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, out, errOut := runCLI(t, append([]string{"health"}, tt.args...)...)
			if code != tt.wantCode || out != tt.wantOut || !strings.Contains(errOut, tt.wantErr) || (tt.wantErr == "" && errOut != "") {
				t.Errorf("exit %d, stdout %q, stderr %q; want %d, %q, %q", code, out, errOut, tt.wantCode, tt.wantOut, tt.wantErr)
			}
		})
	}
}

// TestHealthTimeout: a server that accepts the connection but never answers costs --timeout,
// then exit 1.
func TestHealthTimeout(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	code, out, errOut := runCLI(t, "health", "--addr", ln.Addr().String(), "--timeout", "200ms")
	ln.Close()
	for c := range accepted {
		c.Close()
	}
	if code != 1 || out != "" || !strings.Contains(errOut, "llm-bulkhead health: "+ln.Addr().String()+": ") {
		t.Errorf("exit %d, stdout %q, stderr %q", code, out, errOut)
	}
}
