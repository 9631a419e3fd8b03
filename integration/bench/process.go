package bench

import (
	"bufio"
	"context"
	"debug/buildinfo"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Spec describes a server process to start.
type Spec struct {
	// Name labels the server in the report ("no-op", "llm-bulkhead").
	Name string
	// Argv is the command line; the server must listen on addresses it logs.
	Argv []string
	// Env is the process environment.
	Env []string
	// ReadyMsg is the "msg" of the JSON log line carrying grpc_addr and admin_addr (and
	// pprof_addr when served) once the server listens.
	ReadyMsg string
}

// Process is a running server process. Its methods are safe for concurrent use.
type Process struct {
	Name      string
	GRPCAddr  string
	AdminAddr string
	PprofAddr string

	cmd  *exec.Cmd
	done chan struct{}
	err  error // cmd.Wait's result, valid once done is closed

	mu   sync.Mutex
	tail []string
}

// tailLines is how many log lines of a server are kept for error messages.
const tailLines = 20

// StartProcess starts s and waits until it logs its addresses, it exits, or timeout passes.
func StartProcess(s Spec, timeout time.Duration) (*Process, error) {
	if len(s.Argv) == 0 {
		return nil, errors.New("empty command line")
	}
	cmd := exec.Command(s.Argv[0], s.Argv[1:]...)
	cmd.Env = s.Env
	// The server dies with the benchmark even if the benchmark is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = nil
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", s.Name, err)
	}
	p := &Process{Name: s.Name, cmd: cmd, done: make(chan struct{})}
	ready := make(chan readyLine, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		sent := false
		for sc.Scan() {
			line := sc.Text()
			p.keep(line)
			if sent {
				continue
			}
			var r readyLine
			if json.Unmarshal([]byte(line), &r) == nil && r.Msg == s.ReadyMsg && r.GRPCAddr != "" {
				ready <- r
				sent = true
			}
		}
		// Wait only after every read from the pipe, as os/exec requires.
		p.err = cmd.Wait()
		close(p.done)
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case r := <-ready:
		p.GRPCAddr, p.AdminAddr, p.PprofAddr = r.GRPCAddr, r.AdminAddr, r.PprofAddr
		return p, nil
	case <-p.done:
		return nil, fmt.Errorf("%s exited before listening (%v):\n%s", s.Name, p.err, p.Tail())
	case <-timer.C:
		_ = p.Stop()
		return nil, fmt.Errorf("%s did not report its addresses within %s:\n%s", s.Name, timeout, p.Tail())
	}
}

type readyLine struct {
	Msg       string `json:"msg"`
	GRPCAddr  string `json:"grpc_addr"`
	AdminAddr string `json:"admin_addr"`
	PprofAddr string `json:"pprof_addr"`
}

func (p *Process) keep(line string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.tail) == tailLines {
		copy(p.tail, p.tail[1:])
		p.tail = p.tail[:tailLines-1]
	}
	p.tail = append(p.tail, line)
}

// Tail returns the server's last log lines.
func (p *Process) Tail() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.tail, "\n")
}

// Pid returns the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Alive returns an error when the process has exited.
func (p *Process) Alive() error {
	select {
	case <-p.done:
		return fmt.Errorf("%s exited (%v):\n%s", p.Name, p.err, p.Tail())
	default:
		return nil
	}
}

// HeapInuse scrapes the server's go_memstats_heap_inuse_bytes from its admin /metrics.
func (p *Process) HeapInuse(ctx context.Context) (float64, error) {
	return ScrapeMetric(ctx, "http://"+p.AdminAddr+"/metrics", "go_memstats_heap_inuse_bytes")
}

// Stop asks the server to drain and exit (SIGTERM) and kills it if it has not exited within
// 20 s. It returns the exit error, if any, other than the SIGTERM's.
func (p *Process) Stop() error {
	select {
	case <-p.done:
		return p.exitErr()
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	timer := time.NewTimer(20 * time.Second)
	defer timer.Stop()
	select {
	case <-p.done:
	case <-timer.C:
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s did not exit within 20s of SIGTERM; killed", p.Name)
	}
	return p.exitErr()
}

// Kill ends the server with SIGKILL, as a crash would (nothing drained, nothing given back),
// and waits until it has exited.
func (p *Process) Kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

func (p *Process) exitErr() error {
	if p.err == nil {
		return nil
	}
	var ee *exec.ExitError
	if errors.As(p.err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGTERM {
			return nil
		}
	}
	return fmt.Errorf("%s: %w\n%s", p.Name, p.err, p.Tail())
}

// BuiltWithVT reports whether the Go binary at path was built with -tags vtprotobuf (from its
// build information, as `go version -m` prints it).
func BuiltWithVT(path string) (bool, error) {
	info, err := buildinfo.ReadFile(path)
	if err != nil {
		return false, err
	}
	for _, s := range info.Settings {
		if s.Key == "-tags" && slices.Contains(strings.Split(s.Value, ","), "vtprotobuf") {
			return true, nil
		}
	}
	return false, nil
}

// untagged returns what the report says of a prebuilt binary built without -tags vtprotobuf,
// after logging a warning, or "" for one built with it: its replies are marshalled by
// reflection, so it is not the binary `make build` makes, and a before/after against one that
// is measures the build, not the change.
func untagged(path string, logf func(string, ...any)) string {
	ok, err := BuiltWithVT(path)
	switch {
	case err != nil:
		logf("warning: cannot read the build information of %s: %v", path, err)
		return "; build tags unknown"
	case !ok:
		logf("warning: %s was built without -tags vtprotobuf: its replies are marshalled by reflection, unlike `make build`'s", path)
		return "; **built without -tags vtprotobuf**"
	}
	return ""
}

// BuildServer builds the llm-bulkhead binary into dir as `make build` does (`go build -tags
// vtprotobuf`) and returns its path. It must run inside the module (the repository), as
// `make bench` does.
func BuildServer(ctx context.Context, dir string) (string, error) {
	out := filepath.Join(dir, "llm-bulkhead")
	cmd := exec.CommandContext(ctx, "go", "build", "-tags", "vtprotobuf", "-o", out, "github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead")
	cmd.Env = os.Environ()
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build llm-bulkhead: %w\n%s", err, b)
	}
	return out, nil
}
