package app_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
)

func keyLine(key, tenant string) string {
	return fmt.Sprintf("%x %s\n", sha256.Sum256([]byte(key)), tenant)
}

// secretDir lays out a keys file as Kubernetes mounts a Secret: keys → ..data/keys, ..data a
// symlink to a timestamped directory; publish swaps ..data to a new version.
type secretDir struct {
	t   *testing.T
	dir string
	n   int
}

func (s *secretDir) publish(content string) {
	s.t.Helper()
	s.n++
	ver := fmt.Sprintf("..2026_12_07_%02d", s.n)
	if err := os.Mkdir(filepath.Join(s.dir, ver), 0o755); err != nil {
		s.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.dir, ver, "keys"), []byte(content), 0o600); err != nil {
		s.t.Fatal(err)
	}
	tmp := filepath.Join(s.dir, "..data_tmp")
	if err := os.Symlink(ver, tmp); err != nil {
		s.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(s.dir, "..data")); err != nil {
		s.t.Fatal(err)
	}
	if s.n == 1 {
		if err := os.Symlink("..data/keys", filepath.Join(s.dir, "keys")); err != nil {
			s.t.Fatal(err)
		}
	}
}

// TestKeysFileReloadUnderLoad: while requests with two keys run without pause, the keys file
// (a Secret's symlink swap) gains the second key: from one request to the next, the server
// goes from not knowing it (default tenant) to knowing it, and never back; the first key never
// loses its tenant. A later version with a malformed line is refused — logged with the file
// and the line, counted — and the keys before it stay.
func TestKeysFileReloadUnderLoad(t *testing.T) {
	secrets := &secretDir{t: t, dir: t.TempDir()}
	secrets.publish(keyLine("sk-one", "acme"))
	policy := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(policy, []byte(`
classification:
  tenant:
    rules: [{api_key: true, trusted: true}]
tenants:
  keys_file: `+filepath.Join(secrets.dir, "keys")+`
compartments:
  - {name: tenant, key: [tenant], limits: {max_concurrent: 1000}}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	logs := &syncbuf.Buffer{}
	a, err := app.New(app.Options{ConfigPath: policy, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: logs, Watch: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	defer a.Shutdown(context.Background())
	// Envoy's message timer is wall-clock time; this test is about which tenant each request
	// gets, and under -race on a loaded machine a reply can take longer than 200 ms.
	sim, err := envoysim.New(a.GRPCAddr(), envoysim.FilterConfig{MessageTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	tenantOf := func(key string) string {
		req := &envoysim.Request{Method: "POST", Path: "/v1/chat/completions", Headers: envoysim.Headers{
			{Key: "content-type", Value: "application/json"}, {Key: "authorization", Value: "Bearer " + key}},
			Body: []byte(`{"model":"m","messages":[]}`)}
		r, err := sim.RoundTrip(context.Background(), req, envoysim.Respond(200, nil, `{}`))
		if err != nil || r.Status != 200 || r.Upstream == nil {
			t.Errorf("%v %v", r, err)
			return ""
		}
		for _, h := range r.Upstream.Headers {
			if h.Key == "x-bulkhead-compartment" {
				return strings.TrimPrefix(h.Value, "tenant/")
			}
		}
		return ""
	}

	var stop atomic.Bool
	var learned atomic.Int32
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			knew := false
			for !stop.Load() {
				if got := tenantOf("sk-one"); got != "acme" {
					t.Errorf("sk-one gave %q during the reload", got)
					return
				}
				switch got := tenantOf("sk-two"); {
				case got == "globex" && !knew:
					knew = true
					learned.Add(1)
				case got == "anonymous" && knew:
					t.Error("sk-two was known, then not known again")
					return
				case got != "globex" && got != "anonymous":
					t.Errorf("sk-two gave %q", got)
					return
				}
			}
		})
	}
	time.Sleep(100 * time.Millisecond) // let the requests run before the change
	secrets.publish(keyLine("sk-one", "acme") + keyLine("sk-two", "globex"))
	waitGen(t, a, 2)
	if !strings.Contains(logs.String(), `"why":"keys file changed"`) || !strings.Contains(logs.String(), `"keys_from_file":2`) {
		t.Errorf("the reload is not logged with its keys:\n%s", logs.String())
	}
	deadline := time.Now().Add(10 * time.Second)
	for learned.Load() < 3 && time.Now().Before(deadline) && !t.Failed() {
		time.Sleep(10 * time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	if learned.Load() != 3 {
		t.Fatalf("%d of 3 clients saw the new key", learned.Load())
	}

	secrets.publish(keyLine("sk-one", "acme") + "sk-three initech\n" + keyLine("sk-two", "globex"))
	deadline = time.Now().Add(10 * time.Second)
	for reloadErrors(t, a) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("a keys file with a malformed line was not counted as a reload error")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if a.Engine().Snapshot().Gen() != 2 || tenantOf("sk-two") != "globex" || tenantOf("sk-one") != "acme" {
		t.Error("a broken keys file replaced the running keys")
	}
	if want := filepath.Join(secrets.dir, "keys") + `:2: tenants.keys_file: a SHA-256 is 64 hexadecimal digits`; !strings.Contains(logs.String(), want) {
		t.Errorf("no log line names the file and the line (%s):\n%s", want, logs.String())
	}
	if strings.Contains(logs.String(), "sk-") {
		t.Errorf("the logs hold a key:\n%s", logs.String())
	}
}

// TestKeysFileChangeNeedsRestart: which keys file is watched is set at start; a reload that
// names another is refused.
func TestKeysFileChangeNeedsRestart(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"a", "b"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(keyLine("k", "acme")), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	policy := filepath.Join(dir, "policy.yaml")
	write := func(keys string) {
		body := "classification: {tenant: {rules: [{api_key: true, trusted: true}]}}\ntenants: {keys_file: " + filepath.Join(dir, keys) +
			"}\nfeatures: {default: {max_concurrent: 3}}\ncompartments: [{name: f, key: [feature], limits_from: feature}]\n"
		if err := os.WriteFile(policy, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a")
	a, err := app.New(app.Options{ConfigPath: policy, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: &syncbuf.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	write("b")
	if err := a.Reload("test"); err == nil || !strings.Contains(err.Error(), "tenants.keys_file changed: these take effect only on restart") {
		t.Errorf("reload: %v", err)
	}
	a.Shutdown(context.Background())
}

// TestExplainAPIKeys: validate --explain names the api_key rule, how many keys it has where,
// what an unknown key gets and whether the client's key is removed.
func TestExplainAPIKeys(t *testing.T) {
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys")
	if err := os.WriteFile(keys, []byte(keyLine("k1", "acme")+keyLine("k2", "globex")), 0o600); err != nil {
		t.Fatal(err)
	}
	policy := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(policy, []byte(fmt.Sprintf(`classification: {tenant: {rules: [{api_key: true, trusted: true, strip_client_key: true}, {header: x-tenant-id, trusted: true}]}}
tenants:
  keys_file: %s
  unknown_key: reject
  directory: [{id: acme, tier: free, key_sha256: [%x]}]
tiers: {free: {max_concurrent: 3}}
compartments: [{name: t, key: [tenant], limits_from: tenant}]
`, keys, sha256.Sum256([]byte("k3")))), 0o644); err != nil {
		t.Fatal(err)
	}
	p, _, err := app.LoadPolicy(policy, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := app.Summarize(p)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	s.Explain(&b)
	want := "tenant:   API key in authorization (Bearer) or x-api-key (trusted) [keys: 1 in the directory, 2 in " + keys +
		"; unknown or missing key: reject; the client's key is removed before the upstream] → header x-tenant-id (trusted) → default \"anonymous\""
	if !strings.Contains(b.String(), want) {
		t.Errorf("explain lacks\n%s\n%s", want, b.String())
	}
}
