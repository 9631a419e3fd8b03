package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/testpki"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
)

// pki writes a CA, a server certificate for llm-bulkhead.test and a client certificate into a
// directory and returns their paths.
func pki(t *testing.T) map[string]string {
	t.Helper()
	ca := testpki.NewCA(t, "ca")
	srv, cli := ca.Server(t, "llm-bulkhead.test"), ca.Client(t, "envoy")
	stranger := testpki.NewCA(t, "stranger")
	dir := t.TempDir()
	paths := map[string]string{}
	for name, b := range map[string][]byte{"ca.crt": ca.PEM, "tls.crt": srv.PEM, "tls.key": srv.KeyPEM,
		"client.crt": cli.PEM, "client.key": cli.KeyPEM, "stranger.crt": stranger.PEM} {
		paths[name] = filepath.Join(dir, name)
		if err := os.WriteFile(paths[name], b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return paths
}

// TestServeMutualTLSOnUnixSocket: serve with --tls-cert, --tls-key and --tls-client-ca on a unix
// socket; health reaches it with the same address form and its TLS flags, and fails without a
// client certificate, without TLS, or trusting another CA.
func TestServeMutualTLSOnUnixSocket(t *testing.T) {
	f := pki(t)
	sock := "unix://" + filepath.Join(testpki.ShortTempDir(t), "lb.sock")
	ctx, cancel := context.WithCancel(context.Background())
	logs := &syncbuf.Buffer{}
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--grpc-addr", sock, "--admin-addr", freeAddr(t),
			"--tls-cert", f["tls.crt"], "--tls-key", f["tls.key"], "--tls-client-ca", f["ca.crt"]}, []string{}, &bytes.Buffer{}, logs, nil)
	}()
	defer func() {
		cancel()
		if code := <-done; code != 0 {
			t.Errorf("serve exited %d:\n%s", code, logs.String())
		}
	}()
	waitUntil(t, func() bool { return strings.Contains(logs.String(), "llm-bulkhead listening") })
	if !strings.Contains(logs.String(), `"grpc_tls":"mutual_tls"`) || !strings.Contains(logs.String(), `"grpc_addr":"`+sock+`"`) {
		t.Errorf("the start line does not say how it listens:\n%s", logs.String())
	}
	tls := []string{"--tls-ca", f["ca.crt"], "--tls-server-name", "llm-bulkhead.test"}
	client := []string{"--tls-client-cert", f["client.crt"], "--tls-client-key", f["client.key"]}
	for _, tt := range []struct {
		name     string
		args     []string
		wantCode int
		wantOut  string
	}{
		{"mutual TLS", append(append([]string{"--addr", sock}, tls...), client...), 0, "SERVING\n"},
		{"no client certificate", append([]string{"--addr", sock}, tls...), 1, ""},
		{"plaintext", []string{"--addr", sock}, 1, ""},
		{"another CA", append([]string{"--addr", sock, "--tls-ca", f["stranger.crt"], "--tls-server-name", "llm-bulkhead.test"}, client...), 1, ""},
		{"the wrong name", append([]string{"--addr", sock, "--tls-ca", f["ca.crt"], "--tls-server-name", "other.test"}, client...), 1, ""},
	} {
		code, out, errOut := runCLI(t, append([]string{"health", "--timeout", "5s"}, tt.args...)...)
		if code != tt.wantCode || out != tt.wantOut {
			t.Errorf("%s: exit %d, stdout %q, stderr %q; want %d %q", tt.name, code, out, errOut, tt.wantCode, tt.wantOut)
		}
	}
}

// TestListenerUsageErrors: TLS flags that cannot work, a bad address form, and TLS files the
// policy names but that are broken exit 2 with a message naming the flag or the file.
func TestListenerUsageErrors(t *testing.T) {
	f := pki(t)
	missing := filepath.Join(t.TempDir(), "nope.crt")
	tlsPolicy := write(t, "features: {default: {max_concurrent: 5}}\nserver: {tls_cert: "+missing+", tls_key: "+f["tls.key"]+"}\n")
	mtlsPolicy := write(t, "features: {default: {max_concurrent: 5}}\nserver: {tls_cert: "+f["tls.crt"]+", tls_key: "+f["tls.key"]+", tls_client_ca: "+f["ca.crt"]+"}\n")
	for _, tt := range []struct {
		name string
		args []string
		want string
	}{
		{"serve: cert without key", []string{"serve", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--tls-cert", f["tls.crt"]}, "--tls-key"},
		{"serve: key that does not match", []string{"serve", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--tls-cert", f["tls.crt"], "--tls-key", f["client.key"]}, f["client.key"]},
		{"serve: policy names a missing file", []string{"serve", "--config", tlsPolicy, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, missing},
		{"serve: bad address", []string{"serve", "--grpc-addr", "unix://relative.sock", "--admin-addr", "127.0.0.1:0"}, "unix:///absolute/path"},
		{"validate: missing file", []string{"validate", tlsPolicy}, missing},
		{"envoy-config: mutual TLS without Envoy's certificate", []string{"envoy-config", "--config", mtlsPolicy, "--tls-ca", "/etc/envoy/ca.crt"}, "--tls-client-cert"},
		{"envoy-config: TLS without a CA", []string{"envoy-config", "--config", mtlsPolicy}, "--tls-ca"},
		{"health: client certificate without a CA", []string{"health", "--tls-client-cert", f["client.crt"], "--tls-client-key", f["client.key"]}, "need --tls-ca"},
		{"health: bad address", []string{"health", "--addr", "unix://relative.sock"}, "unix:///absolute/path"},
	} {
		code, _, errOut := runCLI(t, tt.args...)
		if code != 2 || !strings.Contains(errOut, tt.want) {
			t.Errorf("%s: exit %d, stderr %q; want 2 and %q", tt.name, code, errOut, tt.want)
		}
	}
	// The server's own policy with its files valid passes validate, and envoy-config prints a
	// cluster Envoy can use when given Envoy's side.
	if code, _, errOut := runCLI(t, "validate", mtlsPolicy); code != 0 {
		t.Errorf("validate of valid TLS files: exit %d, %s", code, errOut)
	}
	code, out, errOut := runCLI(t, "envoy-config", "--config", mtlsPolicy, "--address", "llm-bulkhead.llm.svc:9002",
		"--tls-ca", "/etc/envoy/ca.crt", "--tls-client-cert", "/etc/envoy/tls.crt", "--tls-client-key", "/etc/envoy/tls.key")
	if code != 0 || !strings.Contains(out, "UpstreamTlsContext") || !strings.Contains(out, `sni: "llm-bulkhead.llm.svc"`) {
		t.Errorf("envoy-config for mutual TLS: exit %d, %s\n%s", code, errOut, out)
	}
}
