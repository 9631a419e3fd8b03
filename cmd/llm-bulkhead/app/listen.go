package app

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// SocketMode is the file mode of the ext_proc listener's unix socket: its owner and group may
// connect (an Envoy sidecar shares the group, e.g. a pod's runAsGroup or fsGroup), no one else.
const SocketMode fs.FileMode = 0o660

// listenGRPC listens on addr: host:port, or unix:///path for a unix domain socket. A socket file
// left behind by a server that did not shut down is replaced; a file that is not a socket, or a
// socket another server still answers on, is left alone and reported.
func listenGRPC(addr string) (net.Listener, error) {
	network, address, err := config.SplitListenAddr(addr)
	if err != nil {
		return nil, err
	}
	if network == "tcp" {
		return net.Listen("tcp", address)
	}
	if err := removeStaleSocket(address); err != nil {
		return nil, err
	}
	ln, err := net.Listen("unix", address)
	if err != nil {
		return nil, err
	}
	// The listener removes the file when it is closed (on shutdown).
	if err := os.Chmod(address, SocketMode); err != nil {
		ln.Close()
		return nil, fmt.Errorf("unix socket %s: %w", address, err)
	}
	return ln, nil
}

// removeStaleSocket removes the socket file at path when no server answers on it any more.
func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a unix socket: not replacing it", path)
	}
	conn, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		conn.Close()
		return fmt.Errorf("unix socket %s: another server is listening on it", path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("unix socket %s exists and cannot be checked: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing the stale unix socket %s: %w", path, err)
	}
	return nil
}

// listenerAddr names a listener the way --grpc-addr takes it: host:port, or unix:///path.
func listenerAddr(ln net.Listener) string {
	if ln.Addr().Network() == "unix" {
		if path := ln.Addr().String(); filepath.IsAbs(path) {
			return "unix://" + path
		}
		return "unix:" + ln.Addr().String()
	}
	return ln.Addr().String()
}
