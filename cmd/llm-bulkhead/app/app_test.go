package app_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
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
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
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
