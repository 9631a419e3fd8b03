package app_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"golang.org/x/net/http2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
)

// TestDeadEnvoyConnectionIsDetected: the gRPC server used to run with gRPC's defaults — no ping
// for two hours and no bound on streams per connection — so the streams of a vanished Envoy held
// their requests' slots until TCP gave up. Now it pings a silent connection after
// server.keepalive_time, closes it when the ping is not answered within
// server.keepalive_timeout, and announces server.max_streams_per_connection as the
// connection's stream limit. The test plays an Envoy that connects and then stops answering.
func TestDeadEnvoyConnectionIsDetected(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	policy := "server: {max_streams: 7, max_streams_per_connection: 3, keepalive_time: 1s, keepalive_timeout: 1s}\nfeatures:\n  default: {max_concurrent: 1}\n"
	if err := os.WriteFile(path, []byte(policy), 0o644); err != nil {
		t.Fatal(err)
	}
	a := startApp(t, path)

	conn, err := net.Dial("tcp", a.GRPCAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(conn, conn)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	// Generous: the server should close the connection about 2s after it went quiet.
	if err := conn.SetReadDeadline(time.Now().Add(20 * time.Second)); err != nil {
		t.Fatal(err)
	}
	var maxStreams uint32
	var pinged bool
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatal("the server kept a connection whose peer never answered its ping")
			}
			break // closed by the server
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if f.IsAck() {
				continue
			}
			if v, ok := f.Value(http2.SettingMaxConcurrentStreams); ok {
				maxStreams = v
			}
			if err := fr.WriteSettingsAck(); err != nil {
				t.Fatal(err)
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				pinged = true // and never answered, as a dead peer would
			}
		}
	}
	if maxStreams != 3 {
		t.Errorf("the connection's stream limit is %d, want server.max_streams_per_connection (3)", maxStreams)
	}
	if !pinged {
		t.Error("the server closed the connection without pinging it first")
	}
}

// TestStreamLimitsReload: the gRPC server's settings apply only on restart, so a reload that
// changes them is refused with a message saying so; the idle timeout and the body bound, read
// per stream, reload.
func TestStreamLimitsReload(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	write := func(server string) {
		body := "server: {" + server + "}\nfeatures:\n  default: {max_concurrent: 1}\n"
		if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("max_streams: 100")
	a := startApp(t, path)

	write("max_streams: 200, max_streams_per_connection: 50, keepalive_time: 2s")
	err := a.Reload("test")
	if err == nil || !strings.Contains(err.Error(), "server.max_streams, server.max_streams_per_connection, server.keepalive_time changed: these take effect only on restart") {
		t.Errorf("reload changing gRPC settings: %v", err)
	}
	write("max_streams: 100, first_message_timeout: 5s, stream_idle_timeout: 20m, max_buffered_body_bytes: 64MiB")
	if err := a.Reload("test"); err != nil {
		t.Errorf("reload changing per-stream limits: %v", err)
	}
}

// TestSilentStreamsAreEndedOverGRPC: a gRPC stream's Recv returns only when its client sends or
// its context ends, so a silent stream used to stay open however long it said nothing. Over a
// real connection, streams that never send are ended with DEADLINE_EXCEEDED after
// server.first_message_timeout, and one that sent only request_headers after
// server.stream_idle_timeout; the server holds no stream after.
func TestSilentStreamsAreEndedOverGRPC(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	policy := "server: {first_message_timeout: 1s, stream_idle_timeout: 1s}\nenvoy: {request_body_mode: BUFFERED}\nfeatures:\n  default: {max_concurrent: 1}\n"
	if err := os.WriteFile(path, []byte(policy), 0o644); err != nil {
		t.Fatal(err)
	}
	a := startApp(t, path)
	conn, err := grpc.NewClient(a.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	var streams []extprocv3.ExternalProcessor_ProcessClient
	for range 20 {
		st, err := client.Process(ctx)
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, st)
	}
	headersOnly, err := client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	req := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{
			Headers: []*corev3.HeaderValue{{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte("/v1/chat/completions")}}}}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: extprocfilterv3.ProcessingMode_BUFFERED},
	}
	if err := headersOnly.Send(req); err != nil {
		t.Fatal(err)
	}
	if r, err := headersOnly.Recv(); err != nil || r.GetRequestHeaders() == nil {
		t.Fatalf("request headers: %v, %v", r, err)
	}
	streams = append(streams, headersOnly)
	for i, st := range streams {
		// Recv returns once the server ends the stream (or the 30s guard gives up).
		if _, err := st.Recv(); status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("stream %d: %v, want DEADLINE_EXCEEDED", i, err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for a.ExtProc().ActiveStreams() != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := a.ExtProc().ActiveStreams(); n != 0 {
		t.Errorf("%d streams still open", n)
	}
}

// TestBufferedBodyBoundFromTheMemoryLimit: with the Helm chart's 512 MiB memory limit the server
// kept the 256 MiB default bound on buffered bodies, and 40 concurrent 8 MiB bodies took it to
// the limit. The default now follows the limit the server finds (a quarter of it), and the start
// line says what it chose and why.
func TestBufferedBodyBoundFromTheMemoryLimit(t *testing.T) {
	logs := &strings.Builder{}
	a, err := app.New(app.Options{GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: logs, MemoryLimit: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	a.Shutdown(context.Background())
	if got := a.ExtProc().Settings().MaxBufferedBodyBytes; got != 128<<20 {
		t.Errorf("max_buffered_body_bytes %d with a 512 MiB limit, want 128 MiB", got)
	}
	if !strings.Contains(logs.String(), `"max_buffered_body_bytes":134217728,"memory_limit":536870912,"memory_limit_from":"option"`) {
		t.Errorf("the start line does not say the bound and the limit:\n%s", logs.String())
	}
}
