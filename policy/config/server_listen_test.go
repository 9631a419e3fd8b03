package config_test

import (
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

func TestSplitListenAddr(t *testing.T) {
	for _, c := range []struct{ in, network, address, err string }{
		{"127.0.0.1:9002", "tcp", "127.0.0.1:9002", ""},
		{":9002", "tcp", ":9002", ""},
		{"[::1]:9002", "tcp", "[::1]:9002", ""},
		{"unix:///run/llm-bulkhead.sock", "unix", "/run/llm-bulkhead.sock", ""},
		{"unix:run/lb.sock", "unix", "run/lb.sock", ""},
		{"unix://run/lb.sock", "", "", "unix:///absolute/path"},
		{"unix:", "", "", "needs a file name"},
		{"unix:///run/", "", "", "needs a file name"},
		{"localhost", "", "", "missing port"},
		{"http://h:1", "", "", "want host:port"},
	} {
		network, address, err := config.SplitListenAddr(c.in)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%q: %v, want an error with %q", c.in, err, c.err)
			}
			continue
		}
		if err != nil || network != c.network || address != c.address {
			t.Errorf("%q: %s %s %v", c.in, network, address, err)
		}
	}
}

// TestServerListenerKeys: the TLS keys go together, and a bad address is a problem of its key.
func TestServerListenerKeys(t *testing.T) {
	for body, want := range map[string]string{
		"server: {tls_key: k.pem}":                      "server.tls_key",
		"server: {tls_cert: c.pem}":                     "server.tls_cert",
		"server: {tls_client_ca: ca.pem}":               "server.tls_client_ca",
		"server: {grpc_addr: \"unix://relative.sock\"}": "server.grpc_addr",
	} {
		_, err := config.Load("p.yaml", []byte("features: {default: {max_concurrent: 1}}\n"+body+"\n"), nil)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want a problem at %s", body, err, want)
		}
	}
	if _, err := config.Load("p.yaml", []byte("features: {default: {max_concurrent: 1}}\nserver: {tls_cert: c.pem, tls_key: k.pem, tls_client_ca: ca.pem, grpc_addr: \"unix:///run/lb.sock\"}\n"), nil); err != nil {
		t.Errorf("a complete TLS listener on a socket: %v", err)
	}
}

// FuzzSplitListenAddr: any string is an address or an error; a unix address always has a
// file name, a tcp one a port separator.
func FuzzSplitListenAddr(f *testing.F) {
	for _, s := range []string{"127.0.0.1:9002", "unix:///run/x.sock", "unix:x", "unix://", ":0", "[::1]:1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		network, address, err := config.SplitListenAddr(s)
		if err != nil {
			return
		}
		switch network {
		case "unix":
			if address == "" || strings.HasSuffix(address, "/") {
				t.Fatalf("%q: unix address %q", s, address)
			}
		case "tcp":
			if !strings.Contains(address, ":") {
				t.Fatalf("%q: tcp address %q", s, address)
			}
		default:
			t.Fatalf("%q: network %q", s, network)
		}
	})
}
