package app_test

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// TestDeadEnvoyConnectionIsDetected: the gRPC server used to run with gRPC's defaults — no ping
// for two hours and no bound on streams per connection — so the streams of a vanished Envoy held
// their requests' slots until TCP gave up. Now it pings a silent connection after
// server.keepalive_time, closes it when the ping is not answered within
// server.keepalive_timeout, and announces server.max_streams as the connection's stream limit.
// The test plays an Envoy that connects and then stops answering.
func TestDeadEnvoyConnectionIsDetected(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	policy := "server: {max_streams: 7, keepalive_time: 1s, keepalive_timeout: 1s}\nfeatures:\n  default: {max_concurrent: 1}\n"
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
	if maxStreams != 7 {
		t.Errorf("the connection's stream limit is %d, want server.max_streams (7)", maxStreams)
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

	write("max_streams: 200, keepalive_time: 2s")
	err := a.Reload("test")
	if err == nil || !strings.Contains(err.Error(), "server.max_streams, server.keepalive_time changed: these take effect only on restart") {
		t.Errorf("reload changing gRPC settings: %v", err)
	}
	write("max_streams: 100, stream_idle_timeout: 20m, max_buffered_body_bytes: 64MiB")
	if err := a.Reload("test"); err != nil {
		t.Errorf("reload changing per-stream limits: %v", err)
	}
}
