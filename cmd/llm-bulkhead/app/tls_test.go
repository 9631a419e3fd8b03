package app_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/integration/testpki"
)

func startWith(t *testing.T, o app.Options) *app.App {
	t.Helper()
	if o.GRPCAddr == "" {
		o.GRPCAddr = "127.0.0.1:0"
	}
	o.AdminAddr, o.Env, o.LogOutput = "127.0.0.1:0", []string{}, io.Discard
	a, err := app.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Shutdown(context.Background()) })
	return a
}

// metric reads a counter or gauge from the app's registry (-1 when absent); label, when not
// empty, selects the series whose only label has that value.
func metric(t *testing.T, a *app.App, name, label string) float64 {
	t.Helper()
	mfs, err := a.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label != "" && (len(m.GetLabel()) != 1 || m.GetLabel()[0].GetValue() != label) {
				continue
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return -1
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out waiting for " + what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func clientConfig(ca *testpki.CA, client *testpki.Leaf, serverName string) *tls.Config {
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	c := &tls.Config{RootCAs: pool, ServerName: serverName, NextProtos: []string{"h2"}}
	if client != nil {
		pair, err := tls.X509KeyPair(client.PEM, client.KeyPEM)
		if err != nil {
			panic(err)
		}
		c.Certificates = []tls.Certificate{pair}
	}
	return c
}

// servedSerial opens a new TLS connection and returns the serial of the certificate served.
func servedSerial(t *testing.T, addr string, cfg *tls.Config) int64 {
	t.Helper()
	conn, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber.Int64()
}

func healthCheck(ctx context.Context, conn *grpc.ClientConn) (healthpb.HealthCheckResponse_ServingStatus, error) {
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return resp.GetStatus(), err
}

func dial(t *testing.T, target string, creds credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestTLSListenerRotatesThroughSecretSwap: the listener's certificate and client CA live in a
// directory mounted as Kubernetes mounts a Secret. A rotation (the kubelet's ..data swap) is
// served to new connections while a connection opened before goes on undisturbed; a broken
// rotation (a certificate with the wrong key) keeps the certificate in use and is counted.
func TestTLSListenerRotatesThroughSecretSwap(t *testing.T) {
	ca := testpki.NewCA(t, "llm-bulkhead CA")
	first := ca.Server(t, "llm-bulkhead.test")
	envoy := ca.Client(t, "envoy")
	secret := testpki.NewSecretDir(t, t.TempDir(), map[string][]byte{"tls.crt": first.PEM, "tls.key": first.KeyPEM, "ca.crt": ca.PEM})
	a := startWith(t, app.Options{TLS: app.TLSFiles{Cert: secret.Path("tls.crt"), Key: secret.Path("tls.key"), ClientCA: secret.Path("ca.crt")}})
	cfg := clientConfig(ca, envoy, "llm-bulkhead.test")

	if got := servedSerial(t, a.GRPCAddr(), cfg); got != first.Cert.SerialNumber.Int64() {
		t.Fatalf("served serial %d, want %d", got, first.Cert.SerialNumber.Int64())
	}
	if got := metric(t, a, "llm_bulkhead_tls_certificate_expiry_timestamp_seconds", ""); got != float64(first.Cert.NotAfter.Unix()) {
		t.Errorf("expiry gauge %v", got)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	before := dial(t, a.GRPCAddr(), credentials.NewTLS(cfg))
	watch, err := healthpb.NewHealthClient(before).Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := watch.Recv(); err != nil || st.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health watch before the rotation: %v %v", st, err)
	}

	second := ca.Server(t, "llm-bulkhead.test")
	secret.Update(map[string][]byte{"tls.crt": second.PEM, "tls.key": second.KeyPEM, "ca.crt": ca.PEM})
	waitFor(t, "the rotation", func() bool { return metric(t, a, "llm_bulkhead_tls_reloads_total", "success") == 1 })
	if got := servedSerial(t, a.GRPCAddr(), cfg); got != second.Cert.SerialNumber.Int64() {
		t.Fatalf("after the swap a new connection got serial %d, want %d", got, second.Cert.SerialNumber.Int64())
	}
	// The connection and the stream opened before the rotation are untouched.
	if st, err := healthCheck(ctx, before); err != nil || st != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("the connection opened before the rotation: %v %v", st, err)
	}
	if s := before.GetState(); s != connectivity.Ready {
		t.Fatalf("the connection opened before the rotation is %v", s)
	}

	third := ca.Server(t, "llm-bulkhead.test")
	secret.Update(map[string][]byte{"tls.crt": third.PEM, "tls.key": second.KeyPEM, "ca.crt": ca.PEM})
	waitFor(t, "the broken rotation to be counted", func() bool { return metric(t, a, "llm_bulkhead_tls_reloads_total", "error") == 1 })
	if got := servedSerial(t, a.GRPCAddr(), cfg); got != second.Cert.SerialNumber.Int64() {
		t.Fatalf("after a broken rotation a new connection got serial %d, want the one in use, %d", got, second.Cert.SerialNumber.Int64())
	}
	// Repaired: the key catches up.
	secret.Update(map[string][]byte{"tls.crt": third.PEM, "tls.key": third.KeyPEM, "ca.crt": ca.PEM})
	waitFor(t, "the repaired rotation", func() bool { return metric(t, a, "llm_bulkhead_tls_reloads_total", "success") == 2 })
	if got := servedSerial(t, a.GRPCAddr(), cfg); got != third.Cert.SerialNumber.Int64() {
		t.Fatalf("after the repair serial %d, want %d", got, third.Cert.SerialNumber.Int64())
	}
}

// TestMutualTLSRefusesClientsWithoutACertificate: with a client CA, a client without a
// certificate, or with one from another CA, gets no answer; Envoy's certificate does.
func TestMutualTLSRefusesClientsWithoutACertificate(t *testing.T) {
	dir := t.TempDir()
	ca, stranger := testpki.NewCA(t, "ca"), testpki.NewCA(t, "stranger")
	srv := ca.Server(t, "127.0.0.1")
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a := startWith(t, app.Options{TLS: app.TLSFiles{Cert: write("tls.crt", srv.PEM), Key: write("tls.key", srv.KeyPEM), ClientCA: write("ca.crt", ca.PEM)}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for name, c := range map[string]struct {
		creds credentials.TransportCredentials
		ok    bool
	}{
		"envoy's certificate":         {credentials.NewTLS(clientConfig(ca, ca.Client(t, "envoy"), "")), true},
		"no certificate":              {credentials.NewTLS(clientConfig(ca, nil, "")), false},
		"a certificate of another CA": {credentials.NewTLS(clientConfig(ca, stranger.Client(t, "envoy"), "")), false},
		"plaintext":                   {insecure.NewCredentials(), false},
	} {
		st, err := healthCheck(ctx, dial(t, a.GRPCAddr(), c.creds))
		if ok := err == nil && st == healthpb.HealthCheckResponse_SERVING; ok != c.ok {
			t.Errorf("%s: status %v, err %v; want served %v", name, st, err, c.ok)
		}
	}
}

// TestUnixSocketListener: unix:///path listens on that socket, mode 0660, replacing a stale
// socket file; a live socket or a file that is not a socket is left alone; the file is removed
// on shutdown.
func TestUnixSocketListener(t *testing.T) {
	dir := testpki.ShortTempDir(t)
	path := filepath.Join(dir, "lb.sock")
	stale, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close() // a crash: the file stays, no one listens

	a, err := app.New(app.Options{GRPCAddr: "unix://" + path, AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			a.Shutdown(context.Background())
		}
	}()
	if a.GRPCAddr() != "unix://"+path {
		t.Errorf("GRPCAddr %q", a.GRPCAddr())
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != app.SocketMode {
		t.Fatalf("socket file %v, %v; want a socket with mode %v", fi.Mode(), err, app.SocketMode)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if st, err := healthCheck(ctx, dial(t, a.GRPCAddr(), insecure.NewCredentials())); err != nil || st != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health over the socket: %v %v", st, err)
	}

	second, err := app.New(app.Options{GRPCAddr: "unix://" + path, AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if err := second.Start(); err == nil || !strings.Contains(err.Error(), "another server is listening") {
		t.Errorf("a second server on a live socket: %v", err)
	}
	second.Shutdown(context.Background())

	notSocket := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(notSocket, []byte("keep me"), 0o644); err != nil {
		t.Fatal(err)
	}
	third, err := app.New(app.Options{GRPCAddr: "unix://" + notSocket, AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if err := third.Start(); err == nil || !strings.Contains(err.Error(), "is not a unix socket") {
		t.Errorf("a regular file in the way: %v", err)
	}
	third.Shutdown(context.Background())
	if b, _ := os.ReadFile(notSocket); string(b) != "keep me" {
		t.Error("a file that is not a socket was replaced")
	}

	a.Shutdown(context.Background())
	stopped = true
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Errorf("the socket file is still there after shutdown: %v", err)
	}
}

// TestListenerErrorsStopTheStart: a malformed address or bad TLS files are a *ListenerError
// naming the problem, before anything listens.
func TestListenerErrorsStopTheStart(t *testing.T) {
	dir := t.TempDir()
	for name, c := range map[string]struct {
		o    app.Options
		want string
	}{
		"address":          {app.Options{GRPCAddr: "unix://relative.sock"}, "unix:///absolute/path"},
		"cert without key": {app.Options{TLS: app.TLSFiles{Cert: filepath.Join(dir, "tls.crt")}}, "--tls-key"},
		"missing file":     {app.Options{TLS: app.TLSFiles{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key")}}, filepath.Join(dir, "tls.crt")},
	} {
		c.o.AdminAddr, c.o.Env, c.o.LogOutput = "127.0.0.1:0", []string{}, io.Discard
		_, err := app.New(c.o)
		var le *app.ListenerError
		if !errors.As(err, &le) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want a ListenerError with %q", name, err, c.want)
		}
	}
}

// TestReloadRefusesOtherTLSFiles: which files the listener reads is fixed at start; a policy
// reload that names other files is refused (their contents rotate on their own).
func TestReloadRefusesOtherTLSFiles(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "ca")
	srv := ca.Server(t, "127.0.0.1")
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cert, key := write("tls.crt", srv.PEM), write("tls.key", srv.KeyPEM)
	other := write("other.crt", srv.PEM)
	policy := func(c string) []byte {
		return []byte(policyWith(1) + "server: {tls_cert: " + c + ", tls_key: " + key + "}\n")
	}
	path := write("policy.yaml", policy(cert))
	a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", Env: []string{}, LogOutput: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Shutdown(context.Background())
	write("policy.yaml", policy(other))
	if err := a.Reload("test"); err == nil || !strings.Contains(err.Error(), "server.tls_cert") {
		t.Fatalf("a reload naming another certificate file: %v", err)
	}
	// With the file given by the flag, the policy's key does not matter.
	b, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", Env: []string{}, LogOutput: io.Discard,
		TLS: app.TLSFiles{Cert: cert}})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Shutdown(context.Background())
	write("policy.yaml", policy(cert))
	if err := b.Reload("test"); err != nil {
		t.Fatalf("a reload with the certificate from the flag: %v", err)
	}
}
