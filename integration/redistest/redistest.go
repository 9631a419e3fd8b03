// Package redistest starts real Redis servers for tests: a standalone server, a cluster and a
// sentinel watching a master. Every server is a redis-server child process listening on
// 127.0.0.1 on a free port, without persistence, in its own temporary directory; it is stopped
// when the test ends.
//
// The package talks to the servers itself with a minimal RESP client, so it depends on no Redis
// client library. Tests find redis-server and redis-cli on PATH: locally a missing tool skips the
// test, while LLM_BULKHEAD_REQUIRE_TOOLS=1 (set by CI, which installs them) makes it fail.
//
// Functions and methods that take or keep a testing.TB report failures with t.Fatalf, so they
// must be called from the goroutine running the test.
package redistest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

const (
	// DefaultTimeout bounds a Do call: dialling, sending the command and reading the reply.
	DefaultTimeout = 2 * time.Second

	// readyTimeout is how long a started server has to answer PING (and a cluster or sentinel
	// to reach its working state).
	readyTimeout = 10 * time.Second
	// stopTimeout is how long Stop waits for a graceful shutdown before it kills the server.
	stopTimeout = 5 * time.Second
	// startAttempts bounds the retries with new ports when a server could not bind its port
	// (another process took it between picking and binding).
	startAttempts = 3
	// tailLines is how many lines of a server's output failure messages include.
	tailLines = 30
	// requireEnv makes missing tools fail tests instead of skipping them.
	requireEnv = "LLM_BULKHEAD_REQUIRE_TOOLS"
	// masterName is the name the sentinel monitors its master under.
	masterName = "mymaster"
)

// tools are the programs the package runs.
var tools = []string{"redis-server", "redis-cli"}

// Require skips the test when redis-server or redis-cli is not on PATH, or fails it when the
// environment sets LLM_BULKHEAD_REQUIRE_TOOLS=1. Standalone, Cluster and Sentinel call it
// themselves.
func Require(t testing.TB) {
	t.Helper()
	require(t, exec.LookPath, os.Getenv(requireEnv) == "1")
}

func require(t testing.TB, lookPath func(string) (string, error), strict bool) {
	t.Helper()
	for _, name := range tools {
		if _, err := lookPath(name); err != nil {
			if strict {
				t.Fatalf("%s is required (%s=1) but not installed", name, requireEnv)
			} else {
				t.Skipf("%s not installed", name)
			}
			return
		}
	}
}

// Server is a redis-server process started by Standalone, Cluster or Sentinel. It keeps its
// address across Kill, Stop and Restart. Its methods are safe for concurrent use, except that
// those reporting failures through the test must run on the test's goroutine.
type Server struct {
	t    testing.TB
	kind string // "redis-server", "cluster node" or "sentinel", for messages
	addr string
	args []string // redis-server's arguments
	dir  string
	log  string // the file receiving the process's stdout and stderr

	mu     sync.Mutex
	proc   *process // nil when not running
	paused bool
	resume *time.Timer // resumes a Pause(d)
}

// process is one run of a Server.
type process struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once the process was reaped
	err  error         // cmd.Wait's result, valid once done is closed
}

// Standalone starts a redis-server without persistence and waits until it answers PING. The
// server is stopped when the test ends.
func Standalone(t testing.TB) *Server {
	t.Helper()
	Require(t)
	dir := t.TempDir()
	return startServer(t, "redis-server", dir, func(port int) ([]string, error) {
		return baseArgs(port, dir), nil
	})
}

// baseArgs is the command line of a server listening on port, without persistence.
func baseArgs(port int, dir string) []string {
	return []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""}
}

// startServer starts a server whose command line args returns for a free port, retrying with
// another port when the chosen one was taken meanwhile, and registers its cleanup.
func startServer(t testing.TB, kind, dir string, args func(port int) ([]string, error)) *Server {
	t.Helper()
	s := &Server{t: t, kind: kind, dir: dir, log: filepath.Join(dir, "redis.log")}
	t.Cleanup(s.cleanup)
	var err error
	for range startAttempts {
		var port int
		if port, err = freePort(); err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		s.addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		if s.args, err = args(port); err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		if err = s.start(); err == nil {
			return s
		}
		if !strings.Contains(s.tail(), "Address already in use") {
			break
		}
	}
	t.Fatalf("%v", err)
	return nil
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return s.addr }

// Do sends one command and returns its reply as text; it gives up after DefaultTimeout. An error
// reply is returned as a ReplyError. The text is:
//   - a simple or bulk string: the string itself ("OK", "PONG", a value);
//   - an integer: its decimal digits;
//   - a nil bulk string or array: "(nil)";
//   - an array: its elements one per line (an empty array is ""), where an element that is an
//     array is written "[a b c]" (recursively) and an error element "(error) message".
func (s *Server) Do(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), DefaultTimeout)
	defer cancel()
	return s.DoContext(ctx, args...)
}

// DoContext is Do with a context bounding the call instead of DefaultTimeout. When ctx ends
// first, the error wraps ctx.Err().
func (s *Server) DoContext(ctx context.Context, args ...string) (string, error) {
	v, err := command(ctx, s.addr, args...)
	if err != nil {
		return "", err
	}
	if e, ok := v.(ReplyError); ok {
		return "", e
	}
	return render(v, true), nil
}

// Kill sends SIGKILL to the server (and its process group) and waits until it has exited. It
// does nothing when the server is not running.
func (s *Server) Kill() {
	s.mu.Lock()
	p := s.detach()
	s.mu.Unlock()
	if p != nil {
		p.kill()
	}
}

// Stop shuts the server down gracefully with SIGTERM, killing it if it has not exited within a
// few seconds. It does nothing when the server is not running.
func (s *Server) Stop() {
	s.mu.Lock()
	p := s.detach()
	s.mu.Unlock()
	if p == nil {
		return
	}
	pid := p.cmd.Process.Pid
	_ = syscall.Kill(pid, syscall.SIGTERM)
	_ = syscall.Kill(-pid, syscall.SIGCONT) // a paused server handles SIGTERM only once resumed
	timer := time.NewTimer(stopTimeout)
	defer timer.Stop()
	select {
	case <-p.done:
		_ = syscall.Kill(-pid, syscall.SIGKILL) // any child left in the group
	case <-timer.C:
		p.kill()
	}
}

// Restart starts the server again with the same address and configuration, killing it first if
// it is running, and waits until it answers PING. Without persistence a standalone server comes
// back empty; a cluster node keeps its identity and slots (they live in its nodes.conf).
func (s *Server) Restart() {
	s.t.Helper()
	s.Kill()
	if err := s.start(); err != nil {
		s.t.Fatalf("restart: %v", err)
	}
}

// Pause stops the server with SIGSTOP, simulating a hung Redis: connections are still accepted
// by the kernel but nothing is answered. The server resumes after d, or with Resume; d <= 0
// pauses it until Resume.
func (s *Server) Pause(d time.Duration) {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		s.t.Fatalf("pause %s %s: not running", s.kind, s.addr)
		return
	}
	if s.resume != nil {
		s.resume.Stop()
		s.resume = nil
	}
	if err := syscall.Kill(-s.proc.cmd.Process.Pid, syscall.SIGSTOP); err != nil {
		s.t.Fatalf("pause %s %s: %v", s.kind, s.addr, err)
		return
	}
	s.paused = true
	if d > 0 {
		p := s.proc
		s.resume = time.AfterFunc(d, func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.proc == p { // not killed or restarted meanwhile
				s.resumeLocked()
			}
		})
	}
}

// Resume continues a paused server with SIGCONT. It does nothing when the server is not paused.
func (s *Server) Resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.resumeLocked()
}

func (s *Server) resumeLocked() {
	if s.resume != nil {
		s.resume.Stop()
		s.resume = nil
	}
	if s.paused && s.proc != nil {
		_ = syscall.Kill(-s.proc.cmd.Process.Pid, syscall.SIGCONT)
	}
	s.paused = false
}

// detach forgets the running process, if any, and returns it. s.mu must be held.
func (s *Server) detach() *process {
	if s.resume != nil {
		s.resume.Stop()
		s.resume = nil
	}
	s.paused = false
	p := s.proc
	s.proc = nil
	return p
}

// kill sends SIGKILL to the process group and waits until the process was reaped.
func (p *process) kill() {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
}

// cleanup kills the server when the test ends, after logging its output if the test failed.
func (s *Server) cleanup() {
	s.Kill()
	if s.t.Failed() && s.addr != "" {
		s.t.Logf("%s %s, last output lines:\n%s", s.kind, s.addr, s.tail())
	}
}

// start runs the server and waits until it answers PING; on failure the process is gone.
func (s *Server) start() error {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return err
	}
	log, err := os.OpenFile(s.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close() // the child has its own copy
	fmt.Fprintf(log, "--- redistest: starting %s %s\n", bin, quoteArgs(s.args))
	cmd := exec.Command(bin, s.args...)
	cmd.Dir = s.dir
	// An *os.File is handed to the child as is: no goroutine copies the output.
	cmd.Stdout, cmd.Stderr = log, log
	// Its own process group, so that signals reach any child it forks; and it dies with the
	// test binary even when that is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", s.kind, err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	if err := waitPing(p, s.addr); err != nil {
		p.kill()
		return fmt.Errorf("%s %s %v; last output lines:\n%s", s.kind, s.addr, err, s.tail())
	}
	s.mu.Lock()
	s.proc = p
	s.mu.Unlock()
	return nil
}

// waitPing polls addr with PING until it answers PONG, p exits, or readyTimeout passes.
func waitPing(p *process, addr string) error {
	deadline := time.Now().Add(readyTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
		v, err := command(ctx, addr, "PING")
		cancel()
		if err == nil && v == "PONG" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("did not answer PING within %s (last reply %v, %v)", readyTimeout, v, err)
		}
		select {
		case <-p.done:
			return fmt.Errorf("exited before answering PING (%v)", p.err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// tail returns the last lines of the server's output.
func (s *Server) tail() string {
	b, err := os.ReadFile(s.log)
	if err != nil {
		return fmt.Sprintf("(no output: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > tailLines {
		lines = lines[len(lines)-tailLines:]
	}
	return strings.Join(lines, "\n")
}

// quoteArgs joins a command line for a log, quoting empty arguments and those with spaces.
func quoteArgs(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = a
		if a == "" || strings.ContainsAny(a, " \t\n\"'") {
			q[i] = strconv.Quote(a)
		}
	}
	return strings.Join(q, " ")
}

// ClosedAddr returns an address on 127.0.0.1 where nothing listened a moment ago: a Redis that
// is not there, for what a client does then.
func ClosedAddr(t testing.TB) string {
	t.Helper()
	port, err := freePort()
	if err != nil {
		t.Fatalf("%v", err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitFor polls check until it returns nil or readyTimeout passes, and returns its last error.
func waitFor(check func() error) error {
	deadline := time.Now().Add(readyTimeout)
	for {
		err := check()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ClusterSet is a Redis Cluster of master nodes started by Cluster.
type ClusterSet struct {
	nodes []*Server
}

// Cluster starts n ≥ 3 cluster-enabled servers, joins them into a cluster of n masters sharing
// the hash slots (redis-cli --cluster create, no replicas) and waits until every node reports
// cluster_state:ok. The nodes are stopped when the test ends.
func Cluster(t testing.TB, n int) *ClusterSet {
	t.Helper()
	if n < 3 {
		t.Fatalf("a Redis cluster needs at least 3 masters, not %d", n)
	}
	Require(t)
	c := &ClusterSet{}
	for range n {
		dir := t.TempDir()
		c.nodes = append(c.nodes, startServer(t, "cluster node", dir, func(port int) ([]string, error) {
			// The cluster bus gets its own free port: the default, port+10000, may be taken or
			// beyond 65535.
			bus, err := freePort()
			if err != nil {
				return nil, err
			}
			return append(baseArgs(port, dir), "--cluster-enabled", "yes",
				"--cluster-config-file", filepath.Join(dir, fmt.Sprintf("nodes-%d.conf", port)),
				"--cluster-node-timeout", "2000", "--cluster-port", strconv.Itoa(bus)), nil
		}))
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	out, err := exec.CommandContext(ctx, "redis-cli", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("redis-cli %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	for _, node := range c.nodes {
		var info string
		err := waitFor(func() error {
			var err error
			if info, err = node.Do("CLUSTER", "INFO"); err != nil {
				return err
			}
			if !strings.Contains(info, "cluster_state:ok") {
				return errors.New("cluster_state is not ok")
			}
			return nil
		})
		if err != nil {
			t.Fatalf("cluster node %s not ready within %s: %v\n%s\nredis-cli output:\n%s\nlast output lines:\n%s",
				node.Addr(), readyTimeout, err, info, out, node.tail())
		}
	}
	return c
}

// Addrs returns the nodes' host:port addresses.
func (c *ClusterSet) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		addrs[i] = n.Addr()
	}
	return addrs
}

// Nodes returns the cluster's nodes, in the order of Addrs.
func (c *ClusterSet) Nodes() []*Server { return append([]*Server(nil), c.nodes...) }

// SentinelSet is a master and a Redis Sentinel monitoring it, started by Sentinel.
type SentinelSet struct {
	master   *Server
	sentinel *Server
}

// Sentinel starts a master (as Standalone does) and a redis-server --sentinel monitoring it
// under MasterName with a quorum of 1, and waits until the sentinel resolves the master's
// address. Both are stopped when the test ends.
func Sentinel(t testing.TB) *SentinelSet {
	t.Helper()
	master := Standalone(t)
	host, port, _ := net.SplitHostPort(master.Addr())
	dir := t.TempDir()
	conf := filepath.Join(dir, "sentinel.conf")
	sentinel := startServer(t, "sentinel", dir, func(p int) ([]string, error) {
		// The sentinel rewrites its configuration file, so it gets one of its own.
		text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %q\nsentinel monitor %s %s %s 1\n",
			p, dir, masterName, host, port)
		if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
			return nil, err
		}
		return []string{conf, "--sentinel"}, nil
	})
	var got string
	err := waitFor(func() error {
		var err error
		got, err = sentinel.Do("SENTINEL", "get-master-addr-by-name", masterName)
		if err == nil && got != host+"\n"+port {
			err = fmt.Errorf("master resolved as %q", got)
		}
		return err
	})
	if err != nil {
		t.Fatalf("sentinel %s does not resolve %s to %s within %s: %v\nlast output lines:\n%s",
			sentinel.Addr(), masterName, master.Addr(), readyTimeout, err, sentinel.tail())
	}
	return &SentinelSet{master: master, sentinel: sentinel}
}

// Addr is the sentinel's host:port.
func (s *SentinelSet) Addr() string { return s.sentinel.Addr() }

// MasterName is the name the sentinel monitors the master under.
func (s *SentinelSet) MasterName() string { return masterName }

// Master returns the monitored master.
func (s *SentinelSet) Master() *Server { return s.master }

// Sentinel returns the sentinel process itself, to send it commands or to kill it.
func (s *SentinelSet) Sentinel() *Server { return s.sentinel }

// ReplyError is an error reply from Redis, such as "ERR unknown command" or "MOVED 3999
// 127.0.0.1:6381".
type ReplyError string

func (e ReplyError) Error() string { return string(e) }

// command sends one command to addr over a fresh connection and returns the parsed reply:
// a string, an int64, nil, a ReplyError or a []any of those.
func command(ctx context.Context, addr string, args ...string) (any, error) {
	if len(args) == 0 {
		return nil, errors.New("redis: empty command")
	}
	v, err := roundTrip(ctx, addr, args)
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		return nil, fmt.Errorf("redis %s %s: %w", addr, args[0], err)
	}
	return v, nil
}

func roundTrip(ctx context.Context, addr string, args []string) (any, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	// Ending ctx interrupts reads and writes in progress.
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	var b bytes.Buffer
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := conn.Write(b.Bytes()); err != nil {
		return nil, err
	}
	return readReply(bufio.NewReader(conn))
}

// maxBulk bounds the bulk strings and arrays readReply accepts.
const maxBulk = 512 << 20

// readReply reads one RESP2 reply.
func readReply(r *bufio.Reader) (any, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	if len(line) < 3 || line[len(line)-2] != '\r' {
		return nil, fmt.Errorf("malformed reply line %q", line)
	}
	kind, body := line[0], line[1:len(line)-2]
	switch kind {
	case '+':
		return body, nil
	case '-':
		return ReplyError(body), nil
	case ':':
		n, err := strconv.ParseInt(body, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("malformed integer reply %q", line)
		}
		return n, nil
	case '$', '*':
		n, err := strconv.Atoi(body)
		if err != nil || n < -1 || n > maxBulk {
			return nil, fmt.Errorf("malformed length in reply %q", line)
		}
		if n == -1 {
			return nil, nil
		}
		if kind == '$' {
			buf := make([]byte, n+2)
			if _, err := io.ReadFull(r, buf); err != nil {
				return nil, err
			}
			if string(buf[n:]) != "\r\n" {
				return nil, errors.New("bulk string not terminated by CRLF")
			}
			return string(buf[:n]), nil
		}
		elems := make([]any, 0, min(n, 1024))
		for range n {
			e, err := readReply(r)
			if err != nil {
				return nil, err
			}
			elems = append(elems, e)
		}
		return elems, nil
	default:
		return nil, fmt.Errorf("unknown reply type in %q", line)
	}
}

// render writes a reply as Do documents; top tells whether v is the whole reply.
func render(v any, top bool) string {
	switch v := v.(type) {
	case nil:
		return "(nil)"
	case string:
		return v
	case int64:
		return strconv.FormatInt(v, 10)
	case ReplyError:
		return "(error) " + string(v)
	case []any:
		parts := make([]string, len(v))
		for i, e := range v {
			parts[i] = render(e, false)
		}
		if top {
			return strings.Join(parts, "\n")
		}
		return "[" + strings.Join(parts, " ") + "]"
	default:
		return fmt.Sprint(v)
	}
}
