package app_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func policyWith(concurrent int) string {
	return fmt.Sprintf("features:\n  default: {max_concurrent: %d}\n", concurrent)
}

func startApp(t *testing.T, path string) *app.App {
	t.Helper()
	a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{},
		LogOutput: io.Discard, Watch: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Shutdown(context.Background()) })
	return a
}

func waitGen(t *testing.T, a *app.App, want uint64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for a.Engine().Snapshot().Gen() != want {
		if time.Now().After(deadline) {
			t.Fatalf("generation %d, want %d", a.Engine().Snapshot().Gen(), want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func limit(a *app.App) int64 { return a.Engine().Compartments()[0].MaxConcurrent }

func reloadErrors(t *testing.T, a *app.App) float64 {
	mfs, err := a.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "llm_bulkhead_config_reload_errors_total" {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return -1
}

// TestWatchSeesEveryKindOfWrite: in-place writes, delete and recreate, an editor's
// write-then-rename, a broken file (kept out, counted) and the good write after it.
func TestWatchSeesEveryKindOfWrite(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	write := func(p, body string) {
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(path, policyWith(1))
	a := startApp(t, path)

	write(path, policyWith(2))
	waitGen(t, a, 2)

	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	write(path, policyWith(3))
	waitGen(t, a, 3)

	tmp := filepath.Join(dir, ".policy.yaml.swp")
	write(tmp, policyWith(4))
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	waitGen(t, a, 4)
	if limit(a) != 4 {
		t.Fatalf("limit %d", limit(a))
	}

	write(path, "features: {default: {max_concurrent: -1}}\n")
	deadline := time.Now().Add(10 * time.Second)
	for reloadErrors(t, a) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("a broken file was not counted as a reload error")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if a.Engine().Snapshot().Gen() != 4 || limit(a) != 4 || !a.Ready() {
		t.Fatal("a broken file replaced the running policy")
	}
	write(path, policyWith(5))
	waitGen(t, a, 5)
}

// TestWatchSymlinkSwap: Kubernetes mounts a ConfigMap as policy.yaml → ..data/policy.yaml with
// ..data a symlink to a timestamped directory, and updates it by swapping that symlink.
func TestWatchSymlinkSwap(t *testing.T) {
	dir := t.TempDir()
	mkver := func(name string, concurrent int) {
		if err := os.Mkdir(filepath.Join(dir, name), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name, "policy.yaml"), []byte(policyWith(concurrent)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	mkver("..2026_01_01", 1)
	if err := os.Symlink("..2026_01_01", filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("..data/policy.yaml", filepath.Join(dir, "policy.yaml")); err != nil {
		t.Fatal(err)
	}
	a := startApp(t, filepath.Join(dir, "policy.yaml"))

	mkver("..2026_01_02", 7)
	if err := os.Symlink("..2026_01_02", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(dir, "..2026_01_01")); err != nil {
		t.Fatal(err)
	}
	waitGen(t, a, 2)
	if limit(a) != 7 {
		t.Fatalf("limit %d after the swap", limit(a))
	}
	// Every later update is the same swap again: the watch must outlive the first.
	mkver("..2026_01_03", 9)
	if err := os.Symlink("..2026_01_03", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(dir, "..2026_01_02")); err != nil {
		t.Fatal(err)
	}
	waitGen(t, a, 3)
	if limit(a) != 9 {
		t.Fatalf("limit %d after the second swap", limit(a))
	}
}

// TestWatchNotStarvedBySiblingWrites (defect 7): a file written every few milliseconds next to
// the policy — a log, a cache — must not keep postponing the reload of a policy that changed.
func TestWatchNotStarvedBySiblingWrites(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(path, []byte(policyWith(1)), 0o644); err != nil {
		t.Fatal(err)
	}
	a := startApp(t, path)

	stop := make(chan struct{})
	stopped := make(chan struct{})
	wrote := make(chan struct{}, 1)
	go func() {
		defer close(stopped)
		log, err := os.Create(filepath.Join(dir, "access.log"))
		if err != nil {
			t.Error(err)
			return
		}
		defer log.Close()
		// Far more often than the watcher's debounce, for the whole test.
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			if _, err := log.WriteString("GET /v1/chat/completions 200\n"); err != nil {
				t.Error(err)
				return
			}
			select {
			case wrote <- struct{}{}:
			default:
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-stopped })
	<-wrote

	if err := os.WriteFile(path, []byte(policyWith(2)), 0o644); err != nil {
		t.Fatal(err)
	}
	waitGen(t, a, 2)
	if limit(a) != 2 {
		t.Fatalf("limit %d", limit(a))
	}
}

// TestWatchSymlinkToSibling: with policy.yaml a symlink to another file in the same directory,
// editing that file is a change of the policy, though no event names policy.yaml.
func TestWatchSymlinkToSibling(t *testing.T) {
	dir := t.TempDir()
	real := filepath.Join(dir, "policy-v1.yaml")
	if err := os.WriteFile(real, []byte(policyWith(1)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("policy-v1.yaml", filepath.Join(dir, "policy.yaml")); err != nil {
		t.Fatal(err)
	}
	a := startApp(t, filepath.Join(dir, "policy.yaml"))

	if err := os.WriteFile(real, []byte(policyWith(2)), 0o644); err != nil {
		t.Fatal(err)
	}
	waitGen(t, a, 2)

	// Re-pointed at another file: that file is now the one whose edits count.
	next := filepath.Join(dir, "policy-v2.yaml")
	if err := os.WriteFile(next, []byte(policyWith(3)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("policy-v2.yaml", filepath.Join(dir, ".policy.yaml.tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, ".policy.yaml.tmp"), filepath.Join(dir, "policy.yaml")); err != nil {
		t.Fatal(err)
	}
	waitGen(t, a, 3)
	if err := os.WriteFile(next, []byte(policyWith(4)), 0o644); err != nil {
		t.Fatal(err)
	}
	waitGen(t, a, 4)
	if limit(a) != 4 {
		t.Fatalf("limit %d", limit(a))
	}
}

// TestReloadRefusesRestartOnlySettings: listener addresses cannot change on reload.
func TestReloadRefusesRestartOnlySettings(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(path, []byte(policyWith(1)), 0o644); err != nil {
		t.Fatal(err)
	}
	a, err := app.New(app.Options{ConfigPath: path, Env: []string{}, LogOutput: io.Discard, GRPCAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(policyWith(1)+"server: {admin_addr: 127.0.0.1:1}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload("test"); err == nil {
		t.Fatal("a changed admin address was accepted on reload")
	}
}

// get fetches url, with the bearer token when one is given, and returns the response's status,
// WWW-Authenticate header and body.
func get(t *testing.T, url, token string) (int, string, []byte) {
	t.Helper()
	if token != "" {
		token = "Bearer " + token
	}
	return do(t, "GET", url, http.Header{"Authorization": {token}})
}

// do sends a request without a body with the given headers (an empty value is left out; a Host
// header sets the request's host) and returns the response's status, WWW-Authenticate header
// and body.
func do(t *testing.T, method, url string, h http.Header) (int, string, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, vs := range h {
		for _, v := range vs {
			switch {
			case v == "":
			case http.CanonicalHeaderKey(k) == "Host":
				req.Host = v
			default:
				req.Header.Add(k, v)
			}
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header.Get("WWW-Authenticate"), body
}

// TestExposedAdminAddressRefusedWithoutToken (defect 8): an admin address other than loopback,
// from the flag or the policy, is refused unless the admin token is set or AdminInsecure says
// so; loopback addresses need neither.
func TestExposedAdminAddressRefusedWithoutToken(t *testing.T) {
	exposed := []string{"0.0.0.0:9090", ":9090", "[::]:9090", "192.0.2.10:9090", "admin.internal:9090", "[fe80::1%eth0]:9090"}
	loopback := []string{"127.0.0.1:0", "127.3.2.1:0", "[::1]:0", "localhost:0", "LOCALHOST:0"}
	newApp := func(policy string, o app.Options) error {
		o.ConfigPath = filepath.Join(t.TempDir(), "policy.yaml")
		if err := os.WriteFile(o.ConfigPath, []byte(policy), 0o644); err != nil {
			t.Fatal(err)
		}
		o.LogOutput = io.Discard
		_, err := app.New(o)
		return err
	}
	for _, addr := range exposed {
		for _, fromPolicy := range []bool{false, true} {
			policy, o := policyWith(1), app.Options{Env: []string{}}
			if fromPolicy {
				policy += fmt.Sprintf("server: {admin_addr: %q}\n", addr)
			} else {
				o.AdminAddr = addr
			}
			err := newApp(policy, o)
			var ee *app.ExposedAdminError
			if !errors.As(err, &ee) {
				t.Errorf("%s (from policy %v): err %v, want an ExposedAdminError", addr, fromPolicy, err)
				continue
			}
			for _, want := range []string{addr, "LLM_BULKHEAD_ADMIN_TOKEN", "--admin-insecure"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("%s: message %q does not name %q", addr, err, want)
				}
			}
			o.Env = []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"}
			if err := newApp(policy, o); err != nil {
				t.Errorf("%s with a token: %v", addr, err)
			}
			o.Env, o.AdminInsecure = []string{}, true
			if err := newApp(policy, o); err != nil {
				t.Errorf("%s with AdminInsecure: %v", addr, err)
			}
		}
	}
	// The token's variable is the one admin.token_env names.
	err := newApp(policyWith(1)+"admin: {token_env: OPS_TOKEN}\n", app.Options{AdminAddr: "0.0.0.0:9090", Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=x"}})
	if err == nil || !strings.Contains(err.Error(), "OPS_TOKEN") {
		t.Errorf("admin.token_env OPS_TOKEN unset: err %v", err)
	}
	for _, addr := range loopback {
		if err := newApp(policyWith(1), app.Options{AdminAddr: addr, Env: []string{}}); err != nil {
			t.Errorf("%s: %v", addr, err)
		}
	}
}

// startExposed starts an app whose admin listener is on every interface and returns it with a
// loopback base URL for its admin port.
func startExposed(t *testing.T, o app.Options) (*app.App, string) {
	t.Helper()
	o.ConfigPath = filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(o.ConfigPath, []byte(policyWith(1)), 0o644); err != nil {
		t.Fatal(err)
	}
	o.GRPCAddr, o.AdminAddr = "127.0.0.1:0", "0.0.0.0:0"
	a, err := app.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Shutdown(context.Background()) })
	_, port, err := net.SplitHostPort(a.AdminAddr())
	if err != nil {
		t.Fatal(err)
	}
	return a, "http://127.0.0.1:" + port
}

// TestExposedAdminReadsNeedToken: on an admin listener beyond loopback with a token set, the
// dashboard and /admin/* need the token; /metrics and the probes stay open.
func TestExposedAdminReadsNeedToken(t *testing.T) {
	_, base := startExposed(t, app.Options{Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"}, LogOutput: io.Discard})
	for _, path := range []string{"/", "/admin/config", "/admin/compartments", "/admin/decisions", "/admin/breakers"} {
		for _, token := range []string{"", "wrong"} {
			code, challenge, body := get(t, base+path, token)
			if code != http.StatusUnauthorized || challenge == "" || strings.Contains(string(body), "max_concurrent") {
				t.Errorf("GET %s with token %q: %d, WWW-Authenticate %q, body %.80s", path, token, code, challenge, body)
			}
		}
		if code, _, _ := get(t, base+path, "s3cret"); code != http.StatusOK {
			t.Errorf("GET %s with the token: %d", path, code)
		}
	}
	for _, path := range []string{"/metrics", "/healthz", "/readyz"} {
		if code, _, _ := get(t, base+path, ""); code != http.StatusOK {
			t.Errorf("GET %s without a token: %d, want it open for Prometheus and probes", path, code)
		}
	}
}

// TestAdminTokenSchemeIsCaseInsensitive: the Bearer scheme's name is case-insensitive and may
// be followed by several spaces (RFC 7235), for reads on an exposed listener and for POSTs;
// other schemes and malformed values are refused.
func TestAdminTokenSchemeIsCaseInsensitive(t *testing.T) {
	_, base := startExposed(t, app.Options{Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"}, LogOutput: io.Discard})
	for auth, want := range map[string]int{
		"Bearer s3cret": http.StatusOK, "bearer s3cret": http.StatusOK, "BEARER s3cret": http.StatusOK,
		"bEaReR s3cret": http.StatusOK, "Bearer   s3cret": http.StatusOK,
		"Basic s3cret": http.StatusUnauthorized, "Bearers3cret": http.StatusUnauthorized, "Bearer": http.StatusUnauthorized,
		"Bearer ": http.StatusUnauthorized, "bearer S3CRET": http.StatusUnauthorized, "Bearer s3cret2": http.StatusUnauthorized,
		"s3cret": http.StatusUnauthorized,
	} {
		if code, _, _ := do(t, "GET", base+"/admin/config", http.Header{"Authorization": {auth}}); code != want {
			t.Errorf("GET with Authorization %q: %d, want %d", auth, code, want)
		}
	}
	// A POST with the lower-case scheme reaches the handler, which wants a body.
	if code, _, body := do(t, "POST", base+"/admin/breakers/nope", http.Header{"Authorization": {"bearer s3cret"}}); code != http.StatusBadRequest {
		t.Errorf("POST with a lower-case scheme: %d %s", code, body)
	}
}

// TestLoopbackAdminReadsOpen: on the default loopback listener reads need no token, even with
// one set (it guards the POSTs).
func TestLoopbackAdminReadsOpen(t *testing.T) {
	a, err := app.New(app.Options{GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"}, LogOutput: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	defer a.Shutdown(context.Background())
	for _, path := range []string{"/", "/admin/config", "/admin/compartments"} {
		if code, _, _ := get(t, "http://"+a.AdminAddr()+path, ""); code != http.StatusOK {
			t.Errorf("GET %s: %d", path, code)
		}
	}
}

// TestAdminHostIsChecked: without the admin token, /admin/* and the dashboard answer only
// requests whose Host is localhost, an IP address or a name in AdminAllowedHosts — a web page
// re-resolving its own name to 127.0.0.1 (DNS rebinding) gets 403 and no data — on a loopback
// listener and on an exposed one served with AdminInsecure. The token passes whatever the Host.
// /metrics, /healthz and /readyz answer every Host: the kubelet's probes and Prometheus send the
// pod's IP, a Docker or Consul check the service's name.
func TestAdminHostIsChecked(t *testing.T) {
	var logs bytes.Buffer
	loopback, err := app.New(app.Options{GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"},
		LogOutput: &logs, AdminAllowedHosts: []string{"Bulkhead.Internal."}})
	if err != nil {
		t.Fatal(err)
	}
	if err := loopback.Start(); err != nil {
		t.Fatal(err)
	}
	defer loopback.Shutdown(context.Background())
	_, insecure := startExposed(t, app.Options{Env: []string{}, LogOutput: io.Discard, AdminInsecure: true, AdminAllowedHosts: []string{"bulkhead.internal"}})

	allowed := []string{"localhost", "localhost:9090", "LOCALHOST:9090", "localhost.:9090", "127.0.0.1:9090", "127.0.0.1",
		"[::1]:9090", "[::1]", "10.244.1.7:9090", "[fe80::1%25eth0]:9090", "bulkhead.internal:8080", "BULKHEAD.INTERNAL."}
	refused := []string{"evil.example", "evil.example:9090", "127.0.0.1.nip.io:9090", "localhost.evil.example", "bulkhead.internal.evil.example",
		"2130706433:9090", "llm-bulkhead.llm.svc:9090", "127.0.0.1:9090.evil.example", "[::1].evil.example"}
	for _, base := range []string{"http://" + loopback.AdminAddr(), insecure} {
		for _, path := range []string{"/", "/admin/compartments", "/admin/config", "/admin/spend", "/admin/breakers", "/admin/decisions", "/admin/cluster", "/admin/quotas"} {
			for _, host := range refused {
				code, _, body := do(t, "GET", base+path, http.Header{"Host": {host}})
				if code != http.StatusForbidden || strings.Contains(string(body), "compartments\"") || !strings.Contains(string(body), "--admin-allowed-hosts") {
					t.Errorf("%s GET %s, Host %s: %d %.100s", base, path, host, code, body)
				}
			}
			for _, host := range allowed {
				if code, _, body := do(t, "GET", base+path, http.Header{"Host": {host}}); code != http.StatusOK {
					t.Errorf("%s GET %s, Host %s: %d %.100s", base, path, host, code, body)
				}
			}
		}
		for _, path := range []string{"/metrics", "/healthz", "/readyz"} {
			for _, host := range append(refused, allowed...) {
				if code, _, _ := do(t, "GET", base+path, http.Header{"Host": {host}}); code != http.StatusOK {
					t.Errorf("%s GET %s, Host %s: %d, want it open for probes and Prometheus", base, path, host, code)
				}
			}
		}
	}
	// The token passes whatever the Host.
	if code, _, _ := do(t, "GET", "http://"+loopback.AdminAddr()+"/admin/config", http.Header{"Host": {"evil.example"}, "Authorization": {"Bearer s3cret"}}); code != http.StatusOK {
		t.Errorf("GET with the token and another Host: %d", code)
	}
	if code, _, _ := do(t, "GET", "http://"+loopback.AdminAddr()+"/admin/config", http.Header{"Host": {"evil.example"}, "Authorization": {"Bearer wrong"}}); code != http.StatusForbidden {
		t.Errorf("GET with a wrong token and another Host: %d", code)
	}
	// The refusals are logged, once a minute.
	if n := strings.Count(logs.String(), "admin request refused"); n != 1 || !strings.Contains(logs.String(), `"host":"evil.example"`) {
		t.Errorf("%d log lines:\n%s", n, logs.String())
	}
}

// TestExposedAdminWithTokenIgnoresHostForProbes: the Helm chart's admin listener (every
// interface, with a token): the kubelet's probes and Prometheus, which send the pod's IP or
// a service name as Host and no token, get /healthz, /readyz and /metrics; /admin/* needs the
// token whatever the Host, and with it any Host is served.
func TestExposedAdminWithTokenIgnoresHostForProbes(t *testing.T) {
	_, base := startExposed(t, app.Options{Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"}, LogOutput: io.Discard})
	for _, host := range []string{"10.244.1.7:9090", "llm-bulkhead.llm.svc.cluster.local:9090", "evil.example"} {
		for _, path := range []string{"/metrics", "/healthz", "/readyz"} {
			if code, _, _ := do(t, "GET", base+path, http.Header{"Host": {host}}); code != http.StatusOK {
				t.Errorf("GET %s, Host %s: %d", path, host, code)
			}
		}
		if code, _, _ := do(t, "GET", base+"/admin/compartments", http.Header{"Host": {host}}); code != http.StatusUnauthorized {
			t.Errorf("GET /admin/compartments without the token, Host %s: %d", host, code)
		}
		if code, _, _ := do(t, "GET", base+"/admin/compartments", http.Header{"Host": {host}, "Authorization": {"Bearer s3cret"}}); code != http.StatusOK {
			t.Errorf("GET /admin/compartments with the token, Host %s: %d", host, code)
		}
	}
}

// TestAdminInsecureWarns: AdminInsecure serves an exposed listener without a token, and says
// so in the log when it starts.
func TestAdminInsecureWarns(t *testing.T) {
	var logs bytes.Buffer
	_, base := startExposed(t, app.Options{Env: []string{}, LogOutput: &logs, AdminInsecure: true})
	if code, _, _ := get(t, base+"/admin/config", ""); code != http.StatusOK {
		t.Errorf("GET /admin/config: %d", code)
	}
	var warned bool
	for _, line := range strings.Split(logs.String(), "\n") {
		var rec struct {
			Level, Msg string
			AdminAddr  string `json:"admin_addr"`
		}
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Level == "WARN" && strings.Contains(rec.Msg, "no token") && rec.AdminAddr != "" {
			warned = true
		}
	}
	if !warned {
		t.Errorf("no warning about the unguarded admin listener:\n%s", logs.String())
	}
}

// TestAdminConfigShowsBoundAddresses (defect 12): /admin/config shows the addresses the server
// listens on — the flags' overrides, with the ports port 0 chose — not the policy's.
func TestAdminConfigShowsBoundAddresses(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte(policyWith(1)+"server: {grpc_addr: 127.0.0.1:9002, admin_addr: 127.0.0.1:9090}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := startApp(t, path)
	code, _, body := get(t, "http://"+a.AdminAddr()+"/admin/config", "")
	if code != http.StatusOK {
		t.Fatalf("GET /admin/config: %d", code)
	}
	var out struct {
		Policy struct {
			Server struct {
				GRPCAddr  string `json:"grpc_addr"`
				AdminAddr string `json:"admin_addr"`
			} `json:"server"`
		} `json:"policy"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		t.Fatal(err)
	}
	if out.Policy.Server.GRPCAddr != a.GRPCAddr() || out.Policy.Server.AdminAddr != a.AdminAddr() {
		t.Errorf("/admin/config server = %+v, want grpc_addr %s and admin_addr %s", out.Policy.Server, a.GRPCAddr(), a.AdminAddr())
	}
}
