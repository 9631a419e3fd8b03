package integration_test

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/integration/testpki"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

const listenerPolicy = "features:\n  default: {max_concurrent: 4}\n"

// securedServer runs the server with the policy and listener options given and returns it
// with the policy it loaded.
func securedServer(t *testing.T, o app.Options) (*app.App, *config.Policy) {
	t.Helper()
	o.ConfigPath = writePolicy(t, listenerPolicy)
	if o.GRPCAddr == "" {
		o.GRPCAddr = "127.0.0.1:0"
	}
	o.AdminAddr, o.Env, o.LogOutput = "127.0.0.1:0", []string{}, io.Discard
	a, err := app.New(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Shutdown(context.Background()) })
	p, err := config.LoadFile(o.ConfigPath, nil)
	if err != nil {
		t.Fatal(err)
	}
	return a, p
}

// envoyFor is Envoy as `llm-bulkhead envoy-config` configures it for this server: the filter
// and the cluster it prints, with the cluster's TLS files read as Envoy reads them.
func envoyFor(t *testing.T, a *app.App, p *config.Policy, c app.EnvoyCluster, change func(*envoysim.Cluster)) *envoysim.Sim {
	t.Helper()
	c.Name = "llm_bulkhead"
	if c.Address == "" {
		c.Address = a.GRPCAddr()
	}
	out, err := app.EnvoyConfigFor(p, c)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Clusters []any `yaml:"clusters"`
	}
	if err := yaml.Unmarshal(out, &doc); err != nil {
		t.Fatal(err)
	}
	cy, err := yaml.Marshal(doc.Clusters[0])
	if err != nil {
		t.Fatal(err)
	}
	cluster, err := envoysim.ClusterFromYAML(cy)
	if err != nil {
		t.Fatalf("the generated cluster:\n%s\n%v", cy, err)
	}
	if change != nil {
		change(&cluster)
	}
	// The filter does not depend on how the cluster is reached.
	plain := *p
	plain.Server.TLSCert, plain.Server.TLSKey, plain.Server.TLSClientCA = "", "", ""
	filter, err := harness.FilterFromPolicy(&plain)
	if err != nil {
		t.Fatal(err)
	}
	filter.MessageTimeout = 30 * time.Second // what is decided matters here, not how fast
	sim, err := envoysim.NewCluster(cluster, filter)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sim.Close() })
	return sim
}

// chat sends one chat completion through Envoy and reports what the client got and whether the
// LLM provider was called.
func chat(t *testing.T, sim *envoysim.Sim, failureModeAllow bool) (*envoysim.Result, bool) {
	t.Helper()
	var called atomic.Bool
	up := envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		called.Store(true)
		return envoysim.Respond(200, envoysim.H("content-type", "application/json"),
			`{"id":"c1","model":"gpt-4o","usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}`).Serve(ctx, req)
	})
	cfg := sim.Config()
	cfg.FailureModeAllow = failureModeAllow
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := sim.RoundTrip(ctx, &envoysim.Request{Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.H("content-type", "application/json"), Filter: &cfg,
		Body: []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}`)}, up)
	if err != nil {
		t.Fatal(err)
	}
	return res, called.Load()
}

// served asserts that the request went through the server to the provider and back.
func served(t *testing.T, what string, res *envoysim.Result, called bool) {
	t.Helper()
	if res.Status != 200 || !called || res.Local != envoysim.NotLocal || len(res.Problems) > 0 {
		t.Fatalf("%s: status %d, provider called %v, local %v %q, problems %v", what, res.Status, called, res.Local, res.LocalDetails, res.Problems)
	}
	if received(res) == 0 {
		t.Fatalf("%s: the server answered no ext_proc message", what)
	}
}

// received counts the server's replies.
func received(res *envoysim.Result) int {
	n := 0
	for _, r := range res.Exchange {
		if r.Received != nil {
			n++
		}
	}
	return n
}

// writeFiles writes name → contents into a new directory and returns the paths.
func writeFiles(t *testing.T, files map[string][]byte) map[string]string {
	t.Helper()
	dir := t.TempDir()
	paths := map[string]string{}
	for name, b := range files {
		paths[name] = filepath.Join(dir, name)
		if err := os.WriteFile(paths[name], b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return paths
}

// TestExtProcOverTLS: Envoy configured by envoy-config (trusted CA, SNI and the name checked)
// reaches a TLS listener, and requests are judged as over plaintext.
func TestExtProcOverTLS(t *testing.T) {
	ca := testpki.NewCA(t, "llm-bulkhead CA")
	srv := ca.Server(t, "llm-bulkhead.test")
	f := writeFiles(t, map[string][]byte{"tls.crt": srv.PEM, "tls.key": srv.KeyPEM, "ca.crt": ca.PEM})
	a, p := securedServer(t, app.Options{TLS: app.TLSFiles{Cert: f["tls.crt"], Key: f["tls.key"]}})

	sim := envoyFor(t, a, p, app.EnvoyCluster{CA: f["ca.crt"], ServerName: "llm-bulkhead.test"}, nil)
	res, called := chat(t, sim, false)
	served(t, "TLS", res, called)

	// Envoy checks the name it was given: a certificate for another name is refused even from
	// the trusted CA, and the request fails as Envoy fails it.
	wrong := envoyFor(t, a, p, app.EnvoyCluster{CA: f["ca.crt"], ServerName: "other.test"}, nil)
	res, called = chat(t, wrong, false)
	if res.Status != 500 || called || res.Local != envoysim.LocalProcessingError || !strings.HasPrefix(res.LocalDetails, "ext_proc_error_gRPC_error_14") {
		t.Errorf("a server certificate for another name: status %d, provider called %v, %v %q", res.Status, called, res.Local, res.LocalDetails)
	}
}

// TestExtProcOverMutualTLS: with a client CA, Envoy with its certificate is served; Envoy
// without one is refused at the handshake. What the user then sees is Envoy's: with
// failure_mode_allow false the request fails with 500 (status_on_error) and never reaches the
// provider; with failure_mode_allow true it goes through unguarded.
func TestExtProcOverMutualTLS(t *testing.T) {
	ca := testpki.NewCA(t, "llm-bulkhead CA")
	srv := ca.Server(t, "llm-bulkhead.test")
	envoy := ca.Client(t, "envoy")
	f := writeFiles(t, map[string][]byte{"tls.crt": srv.PEM, "tls.key": srv.KeyPEM, "ca.crt": ca.PEM,
		"envoy.crt": envoy.PEM, "envoy.key": envoy.KeyPEM})
	a, p := securedServer(t, app.Options{TLS: app.TLSFiles{Cert: f["tls.crt"], Key: f["tls.key"], ClientCA: f["ca.crt"]}})
	// envoy-config reads the policy; this one has its TLS files from the flags, so say so.
	p.Server.TLSCert, p.Server.TLSKey, p.Server.TLSClientCA = f["tls.crt"], f["tls.key"], f["ca.crt"]

	cluster := app.EnvoyCluster{CA: f["ca.crt"], ClientCert: f["envoy.crt"], ClientKey: f["envoy.key"], ServerName: "llm-bulkhead.test"}
	res, called := chat(t, envoyFor(t, a, p, cluster, nil), false)
	served(t, "mutual TLS", res, called)

	anonymous := envoyFor(t, a, p, cluster, func(c *envoysim.Cluster) { c.TLS.ClientCertificate = nil })
	res, called = chat(t, anonymous, false)
	if res.Status != 500 || called || res.Local != envoysim.LocalProcessingError ||
		!strings.HasPrefix(res.LocalDetails, "ext_proc_error_gRPC_error_14") || res.Stream != envoysim.StreamOpenFailed {
		t.Errorf("Envoy without a client certificate, failure_mode_allow false: status %d, provider called %v, %v %q, stream %v",
			res.Status, called, res.Local, res.LocalDetails, res.Stream)
	}
	res, called = chat(t, anonymous, true)
	if res.Status != 200 || !called || received(res) != 0 || res.Stream != envoysim.StreamOpenFailed {
		t.Errorf("Envoy without a client certificate, failure_mode_allow true: status %d, provider called %v, %d replies, stream %v; want the request through unjudged",
			res.Status, called, received(res), res.Stream)
	}
}

// TestExtProcCertificateRotation: the server's certificate is rotated through a Secret's
// ..data swap. An Envoy that requires the new name cannot connect before and can after; an
// Envoy connected before the swap keeps working.
func TestExtProcCertificateRotation(t *testing.T) {
	ca := testpki.NewCA(t, "llm-bulkhead CA")
	v1 := ca.Server(t, "llm-bulkhead.test")
	secret := testpki.NewSecretDir(t, t.TempDir(), map[string][]byte{"tls.crt": v1.PEM, "tls.key": v1.KeyPEM})
	f := writeFiles(t, map[string][]byte{"ca.crt": ca.PEM})
	a, p := securedServer(t, app.Options{TLS: app.TLSFiles{Cert: secret.Path("tls.crt"), Key: secret.Path("tls.key")}})
	p.Server.TLSCert, p.Server.TLSKey = secret.Path("tls.crt"), secret.Path("tls.key")

	old := envoyFor(t, a, p, app.EnvoyCluster{CA: f["ca.crt"], ServerName: "llm-bulkhead.test"}, nil)
	res, called := chat(t, old, false)
	served(t, "before the rotation", res, called)
	early := envoyFor(t, a, p, app.EnvoyCluster{CA: f["ca.crt"], ServerName: "v2.llm-bulkhead.test"}, nil)
	if res, _ := chat(t, early, false); res.Status != 500 {
		t.Fatalf("the new name was accepted before the rotation: %d", res.Status)
	}

	v2 := ca.Server(t, "v2.llm-bulkhead.test", "llm-bulkhead.test")
	secret.Update(map[string][]byte{"tls.crt": v2.PEM, "tls.key": v2.KeyPEM})
	deadline := time.Now().Add(10 * time.Second)
	for {
		res, called = chat(t, envoyFor(t, a, p, app.EnvoyCluster{CA: f["ca.crt"], ServerName: "v2.llm-bulkhead.test"}, nil), false)
		if res.Status == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a new connection still gets the old certificate: %d %q", res.Status, res.LocalDetails)
		}
		time.Sleep(50 * time.Millisecond)
	}
	served(t, "a new connection after the rotation", res, called)
	res, called = chat(t, old, false)
	served(t, "the connection from before the rotation", res, called)
}

// TestExtProcOverUnixSocket: a sidecar Envoy reaches the server through a pipe address.
func TestExtProcOverUnixSocket(t *testing.T) {
	sock := filepath.Join(testpki.ShortTempDir(t), "ext_proc.sock")
	a, p := securedServer(t, app.Options{GRPCAddr: "unix://" + sock})
	res, called := chat(t, envoyFor(t, a, p, app.EnvoyCluster{}, nil), false)
	served(t, "unix socket", res, called)
}
