package deploy

import (
	"context"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Every flag the chart passes to the server is one `llm-bulkhead serve` defines.
func TestChartFlagsAreTheServers(t *testing.T) {
	help, err := exec.Command(llmBulkhead, "serve", "-h").CombinedOutput()
	if err != nil {
		t.Fatalf("serve -h: %v\n%s", err, help)
	}
	defined := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z-]+)`).FindAllStringSubmatch(string(help), -1) {
		defined[m[1]] = true
	}
	for name, values := range valueSets {
		d := decodeAll(t, values)
		for _, a := range podContainer(t, d).Args[1:] {
			flag, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
			if !strings.HasPrefix(a, "--") || !defined[flag] {
				t.Errorf("%s: the chart passes %q, which `llm-bulkhead serve` does not define", name, a)
			}
		}
	}
}

// The server started as the chart starts it — the rendered policy in a directory, the chart's
// flags — answers the probes the chart configures, /readyz and /healthz on the admin port, and
// ends cleanly (status 0) on the SIGTERM Kubernetes sends. The listeners are moved to loopback
// addresses for the test.
func TestChartPodStartsAndAnswersProbes(t *testing.T) {
	d := decodeAll(t, nil)
	c := podContainer(t, d)
	config, _ := flag(c.Args, "config")
	dir := t.TempDir()
	policy := filepath.Join(dir, filepath.Base(config))
	if err := os.WriteFile(policy, []byte(d.policy.Data[filepath.Base(config)]), 0o644); err != nil {
		t.Fatal(err)
	}
	grpcAddr, adminAddr := freeAddr(t), freeAddr(t)
	var args []string
	for _, a := range c.Args {
		switch {
		case strings.HasPrefix(a, "--config="):
			a = "--config=" + policy
		case strings.HasPrefix(a, "--grpc-addr="):
			a = "--grpc-addr=" + grpcAddr
		case strings.HasPrefix(a, "--admin-addr="):
			a = "--admin-addr=" + adminAddr
		}
		args = append(args, a)
	}
	cmd := exec.Command(llmBulkhead, args...)
	cmd.Env = append(os.Environ(), "LLM_BULKHEAD_ADMIN_TOKEN=test-token-0123456789abcdef0123456789")
	var logs strings.Builder
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Kill()
		<-exited
	}()

	// As the kubelet probes and Prometheus scrapes: to the pod's IP address, which is the Host
	// they send, without a token.
	_, adminPort, err := net.SplitHostPort(adminAddr)
	if err != nil {
		t.Fatal(err)
	}
	probe := func(path string) int {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+adminAddr+path, nil)
		req.Host = "10.244.1.7:" + adminPort
		req.Header.Set("User-Agent", "kube-probe/1.34")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	deadline := time.Now().Add(30 * time.Second)
	for probe("/readyz") != http.StatusOK {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("the server exited before it was ready: %v\n%s", err, logs.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz not 200 after 30 s\n%s", logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if code := probe("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz = %d", code)
	}
	if code := probe("/metrics"); code != http.StatusOK {
		t.Errorf("/metrics = %d", code)
	}

	// SIGTERM, as the kubelet stops a pod: the server drains (nothing in flight here) and exits 0.
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		exited <- err
		if err != nil {
			t.Errorf("the server exited with %v after SIGTERM\n%s", err, logs.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the server did not exit within 30 s of SIGTERM\n%s", logs.String())
	}
}

// freeAddr returns a loopback address with a port free at the time of the call.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
