package config

import (
	"errors"
	"fmt"
	"net"
	"strings"
)

// unixScheme prefixes a unix domain socket address, as in gRPC target names:
// unix:///run/llm-bulkhead.sock (absolute) or unix:relative/path.
const unixScheme = "unix:"

// SplitListenAddr tells how to listen on a server address: ("unix", path) for
// unix:///absolute/path or unix:relative/path, ("tcp", host:port) for host:port.
func SplitListenAddr(addr string) (network, address string, err error) {
	if rest, ok := strings.CutPrefix(addr, unixScheme); ok {
		path := rest
		if after, ok := strings.CutPrefix(rest, "//"); ok {
			// unix://authority/path: gRPC allows no authority, so the path must be absolute.
			if !strings.HasPrefix(after, "/") {
				return "", "", fmt.Errorf("%q: a unix socket address is unix:///absolute/path or unix:relative/path", addr)
			}
			path = after
		}
		if path == "" || strings.HasSuffix(path, "/") {
			return "", "", fmt.Errorf("%q: the unix socket needs a file name", addr)
		}
		return "unix", path, nil
	}
	if strings.Contains(addr, "://") {
		return "", "", fmt.Errorf("%q: want host:port or unix:///path", addr)
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		msg := err.Error()
		if ae, ok := errors.AsType[*net.AddrError](err); ok {
			msg = ae.Err
		}
		return "", "", fmt.Errorf("%q: want host:port or unix:///path: %s", addr, msg)
	}
	return "tcp", addr, nil
}

// serverListener checks the ext_proc listener's address and TLS files: a certificate needs its
// key, and a client CA needs a certificate (mutual TLS is TLS first). The files themselves are
// read when the server starts, after the command-line flags are applied.
func (v *validator) serverListener() {
	s := v.p.Server
	if _, _, err := SplitListenAddr(s.GRPCAddr); err != nil {
		v.own("server.grpc_addr", "%v", err)
	}
	if s.TLSCert == "" && s.TLSKey != "" {
		v.add("server.tls_key", "is set without tls_cert: the listener's certificate needs both (or neither)")
	}
	if s.TLSCert != "" && s.TLSKey == "" {
		v.add("server.tls_cert", "is set without tls_key: the listener's certificate needs both (or neither)")
	}
	if s.TLSClientCA != "" && s.TLSCert == "" {
		v.add("server.tls_client_ca", "is set without tls_cert and tls_key: mutual TLS needs the listener's own certificate")
	}
}
