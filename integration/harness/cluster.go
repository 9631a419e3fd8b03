package harness

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// Replicas are llm-bulkhead servers in processes of their own, for tests of cluster mode
// (replicas sharing their limits through Redis), where a replica must be killed with SIGKILL or
// stopped with SIGTERM like a real one. A replica is the test binary itself, started again with
// ReplicaEnv set: the binary must call ServeReplicaIfAsked before anything else (from an init
// function), which then runs the server as `llm-bulkhead serve` does and exits.

// ReplicaEnv names the environment variable that makes ServeReplicaIfAsked serve the policy
// file it holds.
const ReplicaEnv = "LLM_BULKHEAD_HARNESS_REPLICA_POLICY"

// replicaReadyMsg is the log message carrying the listening addresses.
const replicaReadyMsg = "llm-bulkhead listening"

// ServeReplicaIfAsked returns at once unless the process was started by StartReplica; then it
// serves the policy until SIGTERM or SIGINT (draining as the server does), and exits: 0 after a
// graceful stop, 2 for a policy the server refuses, 1 when it cannot run.
func ServeReplicaIfAsked() {
	path, ok := os.LookupEnv(ReplicaEnv)
	if !ok {
		return
	}
	os.Exit(serveReplica(path))
}

func serveReplica(path string) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0",
		Env: os.Environ(), LogOutput: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "llm-bulkhead:", err)
		return 2
	}
	if err := a.Run(ctx, nil); err != nil {
		fmt.Fprintln(os.Stderr, "llm-bulkhead:", err)
		return 1
	}
	return 0
}

// ReplicaOptions configure StartReplica.
type ReplicaOptions struct {
	// Name labels the replica in messages.
	Name string
	// PolicyPath is the policy file the replica serves.
	PolicyPath string
	// Env is added to the test process's environment (LLM_BULKHEAD_ overrides, such as
	// LLM_BULKHEAD_CLUSTER__REPLICA_ID).
	Env []string
	// Filter adjusts the simulator's filter settings after they were derived from the policy.
	Filter func(*envoysim.FilterConfig)
	// StartTimeout bounds the wait for the replica to listen (default 30 s).
	StartTimeout time.Duration
}

// Replica is a running llm-bulkhead process and an Envoy simulator connected to it. Its methods
// are safe for concurrent use.
type Replica struct {
	Name      string
	GRPCAddr  string
	AdminAddr string
	// Sim sends requests to this replica as Envoy would.
	Sim    *envoysim.Sim
	Filter envoysim.FilterConfig

	cmd  *exec.Cmd
	done chan struct{} // closed once the process was reaped
	err  error         // cmd.Wait's result, valid once done is closed

	mu    sync.Mutex
	tail  []string
	races int
}

// replicaTailLines is how many log lines of a replica are kept for failure messages.
const replicaTailLines = 40

// StartReplica starts the test binary as a replica serving o.PolicyPath on loopback ports chosen
// by the kernel, and returns once it listens. The process dies with the test binary.
func StartReplica(o ReplicaOptions) (*Replica, error) {
	if o.StartTimeout <= 0 {
		o.StartTimeout = 30 * time.Second
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	env := append(os.Environ(), ReplicaEnv+"="+o.PolicyPath, raceOptions())
	env = append(env, o.Env...)
	p, _, err := app.LoadPolicy(o.PolicyPath, env)
	if err != nil {
		return nil, err
	}
	filter, err := FilterFromPolicy(p)
	if err != nil {
		return nil, err
	}
	if o.Filter != nil {
		o.Filter(&filter)
	}
	// -test.run matches nothing, should the binary ever get as far as running tests.
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = env
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start replica %s: %w", o.Name, err)
	}
	r := &Replica{Name: o.Name, Filter: filter, cmd: cmd, done: make(chan struct{})}
	ready := make(chan [2]string, 1)
	go r.read(stderr, ready)
	timer := time.NewTimer(o.StartTimeout)
	defer timer.Stop()
	select {
	case addrs := <-ready:
		r.GRPCAddr, r.AdminAddr = addrs[0], addrs[1]
	case <-r.done:
		return nil, fmt.Errorf("replica %s exited before listening (%v):\n%s", o.Name, r.err, r.Tail())
	case <-timer.C:
		r.Kill()
		return nil, fmt.Errorf("replica %s did not listen within %s:\n%s", o.Name, o.StartTimeout, r.Tail())
	}
	if r.Sim, err = envoysim.New(r.GRPCAddr, filter); err != nil {
		r.Kill()
		return nil, err
	}
	return r, nil
}

// raceOptions is the replica's GORACE: the test's own, and no sleep at exit. A binary built
// with -race sleeps a second at exit so that other goroutines may still report races; a
// replica a test stops should exit at once (its races are reported before it stops).
func raceOptions() string {
	opts := strings.TrimSpace(os.Getenv("GORACE") + " atexit_sleep_ms=0")
	return "GORACE=" + opts
}

// read keeps the replica's last log lines, reports its addresses once it listens, and reaps it
// after its output ended (os/exec requires every read from the pipe before Wait).
func (r *Replica) read(stderr io.Reader, ready chan<- [2]string) {
	sc := bufio.NewScanner(stderr)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	sent := false
	for sc.Scan() {
		line := sc.Text()
		r.keep(line)
		if sent {
			continue
		}
		var l struct {
			Msg       string `json:"msg"`
			GRPCAddr  string `json:"grpc_addr"`
			AdminAddr string `json:"admin_addr"`
		}
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == replicaReadyMsg && l.GRPCAddr != "" && l.AdminAddr != "" {
			ready <- [2]string{l.GRPCAddr, l.AdminAddr}
			sent = true
		}
	}
	_, _ = io.Copy(io.Discard, stderr)
	r.err = r.cmd.Wait()
	close(r.done)
}

func (r *Replica) keep(line string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if strings.Contains(line, "WARNING: DATA RACE") {
		r.races++
	}
	if len(r.tail) == replicaTailLines {
		copy(r.tail, r.tail[1:])
		r.tail = r.tail[:replicaTailLines-1]
	}
	r.tail = append(r.tail, line)
}

// Tail returns the replica's last log lines.
func (r *Replica) Tail() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.tail, "\n")
}

// Races returns how many data races the replica reported (when built with -race).
func (r *Replica) Races() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.races
}

// Pid returns the process id.
func (r *Replica) Pid() int { return r.cmd.Process.Pid }

// Exited reports whether the process has exited.
func (r *Replica) Exited() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// Kill sends SIGKILL (a crash: nothing is given back) and waits until the process is gone.
func (r *Replica) Kill() {
	_ = r.cmd.Process.Signal(syscall.SIGKILL)
	<-r.done
}

// Stop sends SIGTERM, so the replica drains and gives its shared slots back as on a rolling
// restart, and waits up to timeout for it to exit, killing it after that. It returns an error
// unless the replica exited by itself with status 0.
func (r *Replica) Stop(timeout time.Duration) error {
	select {
	case <-r.done:
		return r.exitErr()
	default:
	}
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-r.done:
		return r.exitErr()
	case <-timer.C:
		r.Kill()
		return fmt.Errorf("replica %s did not exit within %s of SIGTERM; killed:\n%s", r.Name, timeout, r.Tail())
	}
}

func (r *Replica) exitErr() error {
	if r.err == nil {
		return nil
	}
	return fmt.Errorf("replica %s: %w\n%s", r.Name, r.err, r.Tail())
}

// Close closes the simulator (its round trips must have returned) and stops the replica if it
// still runs, as Stop does with a 20 s bound.
func (r *Replica) Close() error {
	if r.Sim != nil {
		_ = r.Sim.Close()
	}
	if r.Exited() {
		return nil
	}
	return r.Stop(20 * time.Second)
}

// Do runs one request through the replica's simulator to up.
func (r *Replica) Do(ctx context.Context, req *envoysim.Request, up envoysim.Upstream) (*envoysim.Result, error) {
	return r.Sim.RoundTrip(ctx, req, up)
}

// AdminURL is the replica's admin base URL.
func (r *Replica) AdminURL() string { return "http://" + r.AdminAddr }

// replicaClient bounds admin calls: a replica that stopped answering fails the call rather
// than the test's own timeout.
var replicaClient = &http.Client{Timeout: 10 * time.Second}

// Get fetches an admin path and decodes its JSON into v.
func (r *Replica) Get(path string, v any) error {
	resp, err := replicaClient.Get(r.AdminURL() + path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s on %s: %s", path, r.Name, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// Metrics scrapes the replica's /metrics.
func (r *Replica) Metrics() (Samples, error) {
	resp, err := replicaClient.Get(r.AdminURL() + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /metrics on %s: %s", r.Name, resp.Status)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		return nil, err
	}
	return ParseSamples(string(b))
}

// Sample is one series of the Prometheus text format.
type Sample struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// Samples are the series of one scrape.
type Samples []Sample

// Value returns the sum of the series named name whose labels include every name/value pair of
// labels, and whether there was any.
func (ss Samples) Value(name string, labels ...string) (float64, bool) {
	sum, found := 0.0, false
next:
	for _, s := range ss {
		if s.Name != name {
			continue
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if v, ok := s.Labels[labels[i]]; !ok || v != labels[i+1] {
				continue next
			}
		}
		sum += s.Value
		found = true
	}
	return sum, found
}

// ParseSamples reads the Prometheus text exposition format (comments skipped, timestamps
// ignored).
func ParseSamples(text string) (Samples, error) {
	var out Samples
	for n, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		s, err := parseSample(line)
		if err != nil {
			return nil, fmt.Errorf("metrics line %d %q: %w", n+1, line, err)
		}
		out = append(out, s)
	}
	return out, nil
}

func parseSample(line string) (Sample, error) {
	s := Sample{Labels: map[string]string{}}
	i := strings.IndexAny(line, "{ ")
	if i <= 0 {
		return s, errors.New("no value")
	}
	s.Name, line = line[:i], line[i:]
	if line[0] == '{' {
		line = line[1:]
		for {
			line = strings.TrimLeft(line, " ,")
			if line == "" {
				return s, errors.New("unterminated labels")
			}
			if line[0] == '}' {
				line = line[1:]
				break
			}
			eq := strings.Index(line, "=\"")
			if eq <= 0 {
				return s, errors.New("malformed label")
			}
			name := line[:eq]
			line = line[eq+2:]
			var v strings.Builder
			closed := false
			for j := 0; j < len(line); j++ {
				c := line[j]
				if c == '\\' && j+1 < len(line) {
					j++
					switch line[j] {
					case 'n':
						v.WriteByte('\n')
					default:
						v.WriteByte(line[j])
					}
					continue
				}
				if c == '"' {
					line, closed = line[j+1:], true
					break
				}
				v.WriteByte(c)
			}
			if !closed {
				return s, errors.New("unterminated label value")
			}
			s.Labels[name] = v.String()
		}
	}
	f := strings.Fields(line)
	if len(f) == 0 {
		return s, errors.New("no value")
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return s, err
	}
	s.Value = v
	return s, nil
}
