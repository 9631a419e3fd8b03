package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// TestMain fails the run if a test leaves a goroutine behind (each server has one reaping it).
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is a testing.TB that records Fatalf and Skipf, ending the calling goroutine like the
// real ones, and passes everything else to the real test.
type recorder struct {
	testing.TB
	fatal, skip string
}

func (r *recorder) Helper() {}

func (r *recorder) Fatalf(format string, args ...any) {
	r.fatal = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func (r *recorder) Skipf(format string, args ...any) {
	r.skip = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// record runs f with a recorder on a goroutine of its own, as Fatalf and Skipf end it.
func record(t *testing.T, f func(testing.TB)) *recorder {
	r := &recorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
	return r
}

func do(t *testing.T, s *Server, args ...string) string {
	t.Helper()
	got, err := s.Do(args...)
	if err != nil {
		t.Fatalf("%s: %v", strings.Join(args, " "), err)
	}
	return got
}

func expect(t *testing.T, s *Server, want string, args ...string) {
	t.Helper()
	if got := do(t, s, args...); got != want {
		t.Errorf("%s = %q, want %q", strings.Join(args, " "), got, want)
	}
}

func TestRequire(t *testing.T) {
	Require(t) // redis-server and redis-cli are installed here, or the test is skipped

	missing := func(name string) func(string) (string, error) {
		return func(n string) (string, error) {
			if n == name {
				return "", errors.New("not found")
			}
			return "/usr/bin/" + n, nil
		}
	}
	r := record(t, func(tb testing.TB) { require(tb, missing("redis-cli"), false) })
	if r.skip != "redis-cli not installed" || r.fatal != "" {
		t.Errorf("without the tool: skip %q, fatal %q", r.skip, r.fatal)
	}
	r = record(t, func(tb testing.TB) { require(tb, missing("redis-server"), true) })
	if r.fatal != "redis-server is required (LLM_BULKHEAD_REQUIRE_TOOLS=1) but not installed" || r.skip != "" {
		t.Errorf("without the tool, required: skip %q, fatal %q", r.skip, r.fatal)
	}
	r = record(t, func(tb testing.TB) { require(tb, missing("none"), true) })
	if r.skip != "" || r.fatal != "" {
		t.Errorf("with the tools: skip %q, fatal %q", r.skip, r.fatal)
	}
}

// TestStandalone checks commands and how Do renders every kind of reply.
func TestStandalone(t *testing.T) {
	t.Parallel()
	s := Standalone(t)
	if host, _, err := net.SplitHostPort(s.Addr()); err != nil || host != "127.0.0.1" {
		t.Fatalf("Addr() = %q", s.Addr())
	}
	expect(t, s, "PONG", "PING")
	expect(t, s, "OK", "SET", "k", "v")
	expect(t, s, "v", "GET", "k")
	expect(t, s, "a\r\nb", "ECHO", "a\r\nb")
	expect(t, s, "", "ECHO", "")
	expect(t, s, "(nil)", "GET", "missing")
	expect(t, s, "2", "HSET", "h", "f1", "v1", "f2", "v2")
	expect(t, s, "f1\nv1\nf2\nv2", "HGETALL", "h")
	expect(t, s, "2", "DBSIZE")
	keys := strings.Split(do(t, s, "KEYS", "*"), "\n")
	slices.Sort(keys)
	if !slices.Equal(keys, []string{"h", "k"}) {
		t.Errorf("KEYS * = %q", keys)
	}
	expect(t, s, "", "KEYS", "nothing*")
	expect(t, s, "-3", "INCRBY", "n", "-3")
	expect(t, s, "1\n[a [] [(nil)]]\n(nil)\n(error) ERR boom\nok",
		"EVAL", "return {1, {'a', {}, {false}}, false, redis.error_reply('boom'), redis.status_reply('ok')}", "0")
	if info := do(t, s, "CONFIG", "GET", "save"); info != "save\n" {
		t.Errorf("CONFIG GET save = %q, want persistence off", info)
	}

	_, err := s.Do("NOSUCHCOMMAND")
	var re ReplyError
	if !errors.As(err, &re) || !strings.HasPrefix(string(re), "ERR unknown command") {
		t.Errorf("unknown command: %v", err)
	}
	if _, err := s.Do(); err == nil {
		t.Error("an empty command did not fail")
	}
}

// TestKillRestartStop: a killed or stopped server comes back on the same address, empty.
func TestKillRestartStop(t *testing.T) {
	t.Parallel()
	s := Standalone(t)
	addr := s.Addr()
	expect(t, s, "OK", "SET", "k", "v")
	s.Kill()
	if _, err := s.Do("PING"); err == nil {
		t.Fatal("a killed server answered")
	}
	s.Kill() // no-op
	s.Restart()
	if s.Addr() != addr {
		t.Errorf("restarted on %s, not %s", s.Addr(), addr)
	}
	expect(t, s, "(nil)", "GET", "k")
	expect(t, s, "0", "DBSIZE")

	expect(t, s, "OK", "SET", "k", "v")
	s.Restart() // of a running server
	expect(t, s, "0", "DBSIZE")

	s.Stop()
	if _, err := s.Do("PING"); err == nil {
		t.Fatal("a stopped server answered")
	}
	s.Stop() // no-op
	s.Restart()
	expect(t, s, "PONG", "PING")
}

// TestPauseResume: a paused server accepts connections but answers nothing until resumed.
func TestPauseResume(t *testing.T) {
	t.Parallel()
	s := Standalone(t)
	s.Pause(0)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if got, err := s.DoContext(ctx, "PING"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("PING to a paused server: %q, %v", got, err)
	}
	s.Resume()
	expect(t, s, "PONG", "PING")
	s.Resume() // no-op

	// Paused for a while: a command waits for the end of the pause.
	start := time.Now()
	s.Pause(300 * time.Millisecond)
	expect(t, s, "PONG", "PING")
	if d := time.Since(start); d < 250*time.Millisecond {
		t.Errorf("answered after %s of a 300ms pause", d)
	}

	// A paused server can be stopped, killed and restarted.
	s.Pause(time.Minute)
	s.Stop()
	s.Restart()
	s.Pause(0)
	s.Kill()
	s.Restart()
	expect(t, s, "PONG", "PING")
	s.Pause(time.Minute) // cleanup kills it paused, and stops the timer
}

// TestCleanup: the server is gone once its test has ended.
func TestCleanup(t *testing.T) {
	t.Parallel()
	Require(t)
	var s *Server
	t.Run("server", func(t *testing.T) { s = Standalone(t) })
	if _, err := s.Do("PING"); err == nil {
		t.Error("the server outlived its test")
	}
}

// TestStartFailure: a server that does not start fails the test with the end of its output.
func TestStartFailure(t *testing.T) {
	t.Parallel()
	Require(t)
	dir := t.TempDir()
	r := record(t, func(tb testing.TB) {
		startServer(tb, "redis-server", dir, func(port int) ([]string, error) {
			return append(baseArgs(port, dir), "--no-such-directive", "x"), nil
		})
	})
	if !strings.Contains(r.fatal, "exited before answering PING") || !strings.Contains(r.fatal, "no-such-directive") {
		t.Errorf("failure message:\n%s", r.fatal)
	}

	r = record(t, func(tb testing.TB) { Cluster(tb, 2) })
	if !strings.Contains(r.fatal, "at least 3") {
		t.Errorf("Cluster(t, 2): %q", r.fatal)
	}
}

// TestCluster: every node serves its share of the slots and redirects the others.
func TestCluster(t *testing.T) {
	t.Parallel()
	c := Cluster(t, 3)
	nodes := c.Nodes()
	if len(nodes) != 3 || len(c.Addrs()) != 3 {
		t.Fatalf("%d nodes, %d addresses", len(nodes), len(c.Addrs()))
	}
	owners := 0
	for i, n := range nodes {
		if n.Addr() != c.Addrs()[i] {
			t.Errorf("node %d at %s, Addrs says %s", i, n.Addr(), c.Addrs()[i])
		}
		info := do(t, n, "CLUSTER", "INFO")
		for _, want := range []string{"cluster_state:ok", "cluster_known_nodes:3", "cluster_size:3"} {
			if !strings.Contains(info, want) {
				t.Errorf("node %s: CLUSTER INFO lacks %s:\n%s", n.Addr(), want, info)
			}
		}
		got, err := n.Do("SET", "foo", "bar")
		var re ReplyError
		switch {
		case err == nil && got == "OK":
			owners++
		case errors.As(err, &re) && strings.HasPrefix(string(re), "MOVED "):
		default:
			t.Errorf("node %s: SET foo = %q, %v", n.Addr(), got, err)
		}
	}
	if owners != 1 {
		t.Errorf("%d nodes own foo's slot", owners)
	}
	slots := strings.Split(do(t, nodes[0], "CLUSTER", "SLOTS"), "\n")
	if len(slots) != 3 || !strings.HasPrefix(slots[0], "[") {
		t.Errorf("CLUSTER SLOTS:\n%s", strings.Join(slots, "\n"))
	}

	// A restarted node keeps its identity (from its nodes.conf).
	id := do(t, nodes[1], "CLUSTER", "MYID")
	nodes[1].Restart()
	expect(t, nodes[1], id, "CLUSTER", "MYID")
}

// TestSentinel: the sentinel resolves the master's address.
func TestSentinel(t *testing.T) {
	t.Parallel()
	s := Sentinel(t)
	if s.Addr() != s.Sentinel().Addr() || s.Addr() == s.Master().Addr() {
		t.Errorf("sentinel at %s (%s), master at %s", s.Addr(), s.Sentinel().Addr(), s.Master().Addr())
	}
	host, port, _ := net.SplitHostPort(s.Master().Addr())
	expect(t, s.Sentinel(), host+"\n"+port, "SENTINEL", "get-master-addr-by-name", s.MasterName())
	expect(t, s.Sentinel(), "PONG", "PING")
	expect(t, s.Master(), "OK", "SET", "k", "v")
	expect(t, s.Master(), "v", "GET", "k")
}
