//go:build unix

package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
)

// runBounded is run with a guard: a command still running after 20 s fails the test (a read
// that never ends used to hold the process for good).
func runBounded(t *testing.T, ctx context.Context, args ...string) (int, string) {
	t.Helper()
	errOut := &syncbuf.Buffer{}
	done := make(chan int, 1)
	go func() { done <- run(ctx, args, []string{}, &bytes.Buffer{}, errOut, nil) }()
	select {
	case code := <-done:
		return code, errOut.String()
	case <-time.After(20 * time.Second):
		t.Fatalf("%q still running after 20s\n%s", args, errOut.String())
		return 0, ""
	}
}

func fifo(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestInputsThatAreNotFilesAreRefusedAtOnce: `--tls-cert /dev/zero` grew the process to
// 1.6 GB in 3 s, `validate --config /dev/zero` to 1.8 GB in 2 s, and a FIFO given as a file
// hung the command with no log line. Each such path is refused at once, naming it and saying
// what it is.
func TestInputsThatAreNotFilesAreRefusedAtOnce(t *testing.T) {
	key := write(t, "not read")
	for _, tc := range []struct {
		name string
		args []string
		path string
	}{
		{"validate /dev/zero", []string{"validate", "--config", "/dev/zero"}, "/dev/zero"},
		{"validate a FIFO", []string{"validate", "--config", "%fifo"}, "%fifo"},
		{"envoy-config a FIFO", []string{"envoy-config", "--config", "%fifo"}, "%fifo"},
		{"serve a FIFO policy", []string{"serve", "--config", "%fifo"}, "%fifo"},
		{"serve --tls-cert /dev/zero", []string{"serve", "--tls-cert", "/dev/zero", "--tls-key", key}, "/dev/zero"},
		{"serve --tls-cert a FIFO", []string{"serve", "--tls-cert", "%fifo", "--tls-key", key}, "%fifo"},
		{"serve --tls-key a FIFO", []string{"serve", "--tls-cert", key, "--tls-key", "%fifo"}, "%fifo"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := fifo(t)
			args := append([]string{}, tc.args...)
			for i := range args {
				args[i] = strings.ReplaceAll(args[i], "%fifo", f)
			}
			if args[0] == "serve" {
				args = append(args, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0")
			}
			path := strings.ReplaceAll(tc.path, "%fifo", f)
			code, stderr := runBounded(t, context.Background(), args...)
			if code != 2 {
				t.Errorf("exit %d, want 2\n%s", code, stderr)
			}
			if !strings.Contains(stderr, path) || !strings.Contains(stderr, "not a regular file") {
				t.Errorf("stderr does not name %s as not a regular file:\n%s", path, stderr)
			}
		})
	}
}

// TestStateFileFIFODoesNotHangTheStart: a FIFO as the state file used to hang the start with no
// log line. It is reported as unreadable, naming the file, and the server starts with every
// budget empty (and stops on SIGTERM).
func TestStateFileFIFODoesNotHangTheStart(t *testing.T) {
	f := fifo(t)
	ctx, cancel := context.WithCancel(context.Background())
	logs := &syncbuf.Buffer{}
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--state-file", f, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"},
			[]string{}, &bytes.Buffer{}, logs, nil)
	}()
	waitUntil(t, func() bool { return strings.Contains(logs.String(), "llm-bulkhead listening") })
	if l := logs.String(); !strings.Contains(l, "state not restored") || !strings.Contains(l, f) || !strings.Contains(l, "not a regular file") {
		t.Errorf("the start log does not say the state file %s is not a regular file:\n%s", f, l)
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Errorf("exit %d after SIGTERM, want 0", code)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop")
	}
}
