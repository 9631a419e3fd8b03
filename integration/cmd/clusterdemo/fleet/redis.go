// Package fleet starts what a cluster-mode run needs besides the program driving it: a
// redis-server child process without persistence on a free loopback port, llm-bulkhead replicas
// sharing one policy through it, and the readings of both (Redis's command counts and CPU time,
// the replicas' metrics). The cluster demo (integration/cmd/clusterdemo) and the cluster
// benchmark (integration/cmd/bench/cluster) use it.
package fleet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
)

// ErrNoRedis is returned by StartRedis when redis-server is not on PATH.
var ErrNoRedis = errors.New("redis-server is not installed (it must be on PATH)")

// Redis is a redis-server child process listening on 127.0.0.1, without persistence, in a
// temporary directory of its own. Its methods are safe for concurrent use.
type Redis struct {
	// Addr is the server's host:port.
	Addr string

	cmd    *exec.Cmd
	dir    string
	client *redis.Client
	done   chan struct{}
	err    error // cmd.Wait's result, valid once done is closed
	out    *tail
	stop   sync.Once
}

// StartRedis starts redis-server on a free port of 127.0.0.1 and waits until it answers PING.
// The server dies with this process even if this process is killed.
func StartRedis(ctx context.Context) (*Redis, error) {
	path, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, ErrNoRedis
	}
	dir, err := os.MkdirTemp("", "llm-bulkhead-redis-")
	if err != nil {
		return nil, err
	}
	return startRetrying(ctx, path, dir, nil)
}

// startRetrying starts a server in dir, with extra's arguments for the port it gets, retrying
// with another port when the one picked was taken meanwhile. dir is removed on failure.
func startRetrying(ctx context.Context, path, dir string, extra func(port int) ([]string, error)) (*Redis, error) {
	for attempt := 0; ; attempt++ {
		r, err := startRedis(ctx, path, dir, extra)
		if err == nil {
			return r, nil
		}
		// Another process may have taken the port between picking and binding it.
		if attempt < 2 && strings.Contains(err.Error(), "Address already in use") {
			continue
		}
		_ = os.RemoveAll(dir)
		return nil, err
	}
}

func startRedis(ctx context.Context, path, dir string, extra func(port int) ([]string, error)) (*Redis, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	args := []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""}
	if extra != nil {
		more, err := extra(port)
		if err != nil {
			return nil, err
		}
		args = append(args, more...)
	}
	r := &Redis{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), dir: dir, done: make(chan struct{}), out: &tail{max: 30}}
	r.cmd = exec.Command(path, args...)
	r.cmd.Stdout, r.cmd.Stderr = r.out, r.out
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start redis-server: %w", err)
	}
	go func() {
		r.err = r.cmd.Wait()
		close(r.done)
	}()
	r.client = redis.NewClient(&redis.Options{Addr: r.Addr, DialTimeout: time.Second, ReadTimeout: 5 * time.Second,
		WriteTimeout: 5 * time.Second, PoolSize: 2, MaxRetries: -1})
	deadline := time.Now().Add(10 * time.Second)
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		err := r.client.Ping(pctx).Err()
		cancel()
		if err == nil {
			return r, nil
		}
		select {
		case <-r.done:
			_ = r.client.Close()
			return nil, fmt.Errorf("redis-server exited before answering (%v):\n%s", r.err, r.out.String())
		default:
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			r.kill()
			return nil, fmt.Errorf("redis-server did not answer PING on %s: %v\n%s", r.Addr, err, r.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Pid returns the server's process id.
func (r *Redis) Pid() int { return r.cmd.Process.Pid }

// CPU returns the CPU time the server's threads have used so far, to the nanosecond.
func (r *Redis) CPU() (time.Duration, error) { return bench.ThreadsCPU(r.Pid()) }

// Client returns a client of the server (shared; do not close it).
func (r *Redis) Client() *redis.Client { return r.client }

// Info returns the fields of the INFO sections named (every "key:value" line).
func (r *Redis) Info(ctx context.Context, sections ...string) (map[string]string, error) {
	s, err := r.client.Info(ctx, sections...).Result()
	if err != nil {
		return nil, err
	}
	return ParseInfo(s), nil
}

// ParseInfo reads the "key:value" lines of an INFO reply; section headers and blank lines are
// skipped.
func ParseInfo(s string) map[string]string {
	out := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if k, v, ok := strings.Cut(line, ":"); ok {
			out[k] = v
		}
	}
	return out
}

// Commands is a reading of Redis's command counters.
type Commands struct {
	// Calls counts calls per command (INFO commandstats), commands run inside scripts included;
	// subcommands are named "config|resetstat". Usec is the time Redis spent in them, µs (a
	// script's includes the commands it ran).
	Calls map[string]int64
	Usec  map[string]int64
	// Processed is INFO stats total_commands_processed (scripts' own commands included).
	Processed int64
}

// ReadCommands reads the command counters. The reading itself is one INFO command, counted in
// the next reading.
func (r *Redis) ReadCommands(ctx context.Context) (Commands, error) {
	in, err := r.Info(ctx, "stats", "commandstats")
	if err != nil {
		return Commands{}, err
	}
	return ParseCommands(in)
}

// ParseCommands extracts the command counters from INFO stats and commandstats fields.
func ParseCommands(info map[string]string) (Commands, error) {
	c := Commands{Calls: map[string]int64{}, Usec: map[string]int64{}}
	p, ok := info["total_commands_processed"]
	if !ok {
		return c, errors.New("INFO: no total_commands_processed")
	}
	var err error
	if c.Processed, err = strconv.ParseInt(p, 10, 64); err != nil {
		return c, fmt.Errorf("INFO total_commands_processed: %w", err)
	}
	for k, v := range info {
		name, ok := strings.CutPrefix(k, "cmdstat_")
		if !ok {
			continue
		}
		// calls=12,usec=34,usec_per_call=2.83,rejected_calls=0,failed_calls=0
		for _, f := range strings.Split(v, ",") {
			field, n, _ := strings.Cut(f, "=")
			if field != "calls" && field != "usec" {
				continue
			}
			x, err := strconv.ParseInt(n, 10, 64)
			if err != nil {
				return c, fmt.Errorf("INFO %s: %w", k, err)
			}
			if field == "calls" {
				c.Calls[name] = x
			} else {
				c.Usec[name] = x
			}
		}
	}
	return c, nil
}

// Sub returns the counts of c minus those of before.
func (c Commands) Sub(before Commands) Commands { return c.plus(before, -1) }

// Add returns the counts of c and o added up (two servers' readings).
func (c Commands) Add(o Commands) Commands { return c.plus(o, 1) }

// plus returns c + sign × o, without the commands whose count comes to 0.
func (c Commands) plus(o Commands, sign int64) Commands {
	out := Commands{Calls: map[string]int64{}, Usec: map[string]int64{}, Processed: c.Processed + sign*o.Processed}
	for _, m := range []struct{ dst, a, b map[string]int64 }{{out.Calls, c.Calls, o.Calls}, {out.Usec, c.Usec, o.Usec}} {
		for k, v := range m.a {
			m.dst[k] = v
		}
		for k, v := range m.b {
			m.dst[k] += sign * v
		}
		for k, v := range m.dst {
			if v == 0 {
				delete(m.dst, k)
			}
		}
	}
	return out
}

// scriptCommands are the commands llm-bulkhead's Lua scripts run inside Redis (every
// redis.call of policy/cluster's scripts; a test checks the list against them): counted by
// commandstats, but not sent by a client. llm-bulkhead itself sends none of them directly except
// TIME, which GET /admin/cluster asks for once a call.
var scriptCommands = map[string]bool{
	"time": true, "type": true, "get": true, "set": true, "del": true, "unlink": true, "incr": true,
	"hgetall": true, "hget": true, "hmget": true, "hkeys": true, "hlen": true, "hset": true, "hsetnx": true, "hdel": true,
	"hincrby": true, "pexpire": true, "pexpireat": true,
	"zscore": true, "zadd": true, "zrem": true, "zrangebyscore": true, "zremrangebyscore": true, "zcount": true,
	"sadd": true, "srem": true, "smembers": true, "publish": true, "hexists": true,
}

// Scripts returns the script calls (EVALSHA and EVAL: one round trip each).
func (c Commands) Scripts() int64 { return c.Calls["evalsha"] + c.Calls["eval"] }

// ScriptUsec returns the time Redis spent running scripts, µs.
func (c Commands) ScriptUsec() int64 { return c.Usec["evalsha"] + c.Usec["eval"] }

// ClientCommands returns the commands clients sent (every command that is not one the scripts
// run inside Redis), without the INFO readings themselves. Commands sent in one pipeline count
// one each, though they share a round trip.
func (c Commands) ClientCommands() int64 {
	var n int64
	for k, v := range c.Calls {
		if !scriptCommands[k] && k != "info" {
			n += v
		}
	}
	return n
}

// InScripts returns the commands run inside scripts.
func (c Commands) InScripts() int64 {
	var n int64
	for k, v := range c.Calls {
		if scriptCommands[k] {
			n += v
		}
	}
	return n
}

// FlushAll empties the server (between runs that must not share state).
func (r *Redis) FlushAll(ctx context.Context) error { return r.client.FlushAll(ctx).Err() }

// Stop shuts the server down (SIGTERM, SIGKILL after 5 s) and removes its directory.
func (r *Redis) Stop() {
	r.stop.Do(func() {
		_ = r.client.Close()
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-r.done:
		case <-time.After(5 * time.Second):
			r.kill()
		}
		_ = os.RemoveAll(r.dir)
	})
}

func (r *Redis) kill() {
	_ = r.cmd.Process.Kill()
	<-r.done
}

// tail keeps the last lines written to it.
type tail struct {
	mu    sync.Mutex
	max   int
	lines []string
	part  string
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.part + string(p)
	lines := strings.Split(s, "\n")
	t.part = lines[len(lines)-1]
	for _, l := range lines[:len(lines)-1] {
		t.lines = append(t.lines, l)
		if len(t.lines) > t.max {
			t.lines = t.lines[1:]
		}
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(append(append([]string(nil), t.lines...), t.part), "\n")
}

// InScripts reports whether command name (as commandstats names it) is one the scripts run
// inside Redis.
func InScripts(name string) bool { return scriptCommands[name] }
