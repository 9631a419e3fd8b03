package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func write(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

const broken = `features:
  default:
    max_concurent: 3
`

const clusterPolicy = `features:
  default: {max_concurrent: 5}
cluster:
  backend: redis
  mode: sentinel
  master_name: mymaster
  addresses: [s1:26379, s2:26379]
  password_env: REDIS_PASSWORD
  tls: {enabled: true}
  replica_id: pod-7
  lease_ttl: 8s
  on_unavailable: closed
`

const clusterPools = `compartments:
  - {name: feature, key: [feature], limits_from: feature}
pools:
  - name: shared
    max_concurrent: 5
    members:
      - {compartment: feature/default, guaranteed: 1}
      - {compartment: feature/default, guaranteed: 1}
`

// clusterExplained is what validate --explain says about clusterPolicy's cluster section.
const clusterExplained = `
cluster: backend redis, mode sentinel (master mymaster)
  addresses:      s1:26379, s2:26379
  connection:     password from $REDIS_PASSWORD, tls on, dial_timeout 1s, write_timeout 1s
  key prefix:     llm-bulkhead
  replica id:     pod-7
  admission:      leased: each replica admits against its lease of every compartment's limits and chunks of its token, rate and spend windows, renewed every 200ms (lease_interval); no call to Redis on a request's path unless a lease runs short
  timeout:        20ms (the longest a request waits for its lease to grow, and a report for Redis)
  on_unavailable: closed (requests refused with 503, reason cluster_unavailable)
  replicas:       expected_replicas not set (a replica that has not reached Redis yet enforces the whole limits)
  leases:         lease_ttl 8s, heartbeat 2s (a replica that stops heartbeating frees its slots after lease_ttl)
  settlements:    sent every 2ms, at most 100000 queued while Redis is unreachable
  shared:         token budgets, request rates, spend, concurrency, learned (adaptive) limits (across every replica with this key prefix)
  per replica:    breakers, learned estimates, queues
`

// fourProblems has an unknown key, a negative value and two bad max_waits (one that is not a
// duration, one Envoy would cut short).
const fourProblems = `features:
  default:
    max_concurrent: -3
    max_wait: soon
    max_concurent: 4
  batch:
    max_wait: 30s
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`

// reroutePolicy has a pool, a degrade rule and a fallback chain, for --explain.
const reroutePolicy = `envoy: {request_body_mode: BUFFERED}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: provider, key: [provider], limits_from: provider}
features:
  default: {max_concurrent: 5}
  chat: {max_concurrent: 10}
  batch:
    tokens_per_minute: 1000
    degrade: {provider: local, on: [token_budget, rate_limit]}
providers:
  default: {max_concurrent: 30, breaker: standard, fallback: backup}
  backup: {max_concurrent: 10, breaker: standard, fallback: local, models: [{match: "*", model: "*"}]}
  local: {max_concurrent: 5, models: [{match: gpt-*, model: llama-3}]}
breakers:
  standard: {}
pools:
  - name: shared
    max_concurrent: 12
    members:
      - {compartment: feature/chat, guaranteed: 8}
      - {compartment: feature/batch, guaranteed: 2, max: 6}
`

const explainedPools = `
Pools (a member always has its guaranteed share and borrows idle capacity up to its max):
  shared: capacity 12
    feature/chat   guaranteed 8  max 12
    feature/batch  guaranteed 2  max 6
`

const explainedReroutes = `
Degrade rules (a request refused for one of these reasons is re-routed instead, when the target can take it):
  batch: refused for token_budget, rate_limit → local (models: gpt-* → llama-3)

Fallbacks (while a provider's breaker is open, its requests try the next provider of the chain):
  backup (breaker standard) → local (models: gpt-* → llama-3)
  default (breaker standard) → backup (models: * → *) → local (models: gpt-* → llama-3)
  (models: the model a re-routed request is sent, first match wins; a model no entry matches is not re-routed there)
`

func TestValidate(t *testing.T) {
	tests := []struct {
		name       string
		args       []string
		wantCode   int
		wantOut    string
		wantErrOut string
	}{
		{"built-in policy", []string{"validate"}, 0, "<embedded examples/policy.yaml>: OK — 5 features, 3 tiers", ""},
		{"explain", []string{"validate", "--explain"}, 0, "tier_feature/free/chat", ""},
		{"explain cluster off", []string{"validate", "--explain"}, 0, "\ncluster: off (every limit is enforced per process)\n", ""},
		{"explain cluster", []string{"validate", "--explain", "--config", write(t, clusterPolicy)}, 0, clusterExplained, ""},
		{"cluster with pools refused", []string{"validate", "--config", write(t, clusterPolicy+clusterPools)}, 2, "",
			"policy.yaml:15: pools: pools are enforced per process and cannot be shared across replicas yet"},
		{"broken file names file, line and key", []string{"validate", "--config", write(t, broken)}, 2, "",
			`policy.yaml:3: features.default.max_concurent: unknown key "max_concurent" (did you mean "max_concurrent"?)`},
		{"missing file", []string{"validate", "--config", "/nonexistent/p.yaml"}, 2, "", "/nonexistent/p.yaml: cannot read policy file"},
		{"bad flag", []string{"validate", "--nope"}, 2, "", "flag provided but not defined"},
		{"unknown command", []string{"frobnicate"}, 2, "", `unknown command "frobnicate"`},
		{"version", []string{"version"}, 0, "llm-bulkhead ", ""},
		{"no limits at all warned about", []string{"validate", "--config", write(t, "allow_empty: true\n")}, 0, "policy.yaml: OK",
			"policy.yaml: warning: the policy sets no limit at all (no max_concurrent, max_inflight_tokens, token budget, request rate or breaker): every request would be admitted"},
		{"explain pools", []string{"validate", "--explain", "--config", write(t, reroutePolicy)}, 0, explainedPools, ""},
		{"explain degrade rules and fallbacks", []string{"validate", "--explain", "--config", write(t, reroutePolicy)}, 0, explainedReroutes, ""},
		{"envoy-config", []string{"envoy-config", "--address", "llm-bulkhead:9002"}, 0, "max_message_timeout: 10s", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			code := run(context.Background(), tt.args, nil, &out, &errOut, nil)
			if code != tt.wantCode {
				t.Fatalf("exit %d, want %d\nstdout: %s\nstderr: %s", code, tt.wantCode, out.String(), errOut.String())
			}
			if !strings.Contains(out.String(), tt.wantOut) {
				t.Errorf("stdout %q does not contain %q", out.String(), tt.wantOut)
			}
			if !strings.Contains(errOut.String(), tt.wantErrOut) {
				t.Errorf("stderr %q does not contain %q", errOut.String(), tt.wantErrOut)
			}
		})
	}
}

// TestEveryProblemListed: validate and serve report all four problems of fourProblems, counted,
// one a line, in line order, each with file, line and key path.
func TestEveryProblemListed(t *testing.T) {
	path := write(t, fourProblems)
	want := path + `: 4 problem(s):
  ` + path + `:3: features.default.max_concurrent: must not be negative, got -3
  ` + path + `:4: features.default.max_wait: "soon" is not a duration (write it like 100ms, 5s or 1m30s)
  ` + path + `:5: features.default.max_concurent: unknown key "max_concurent" (did you mean "max_concurrent"?)
  ` + path + `:7: features.batch.max_wait: 30s is not shorter than envoy.message_timeout (200ms)`
	for _, tt := range []struct {
		args   []string
		prefix string
	}{
		{[]string{"validate", path}, ""},
		{[]string{"serve", "--config", path, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, "llm-bulkhead: invalid policy, not starting: "},
	} {
		var out, errOut bytes.Buffer
		if code := run(context.Background(), tt.args, []string{}, &out, &errOut, nil); code != 2 {
			t.Fatalf("%s: exit %d, want 2", tt.args[0], code)
		}
		if !strings.HasPrefix(errOut.String(), tt.prefix+want) || strings.Count(errOut.String(), "\n") != 5 {
			t.Errorf("%s: stderr\n%s\nwant\n%s%s", tt.args[0], errOut.String(), tt.prefix, want)
		}
	}
}

func TestServeInvalidPolicyExits2(t *testing.T) {
	var errOut bytes.Buffer
	code := run(context.Background(), []string{"serve", "--config", write(t, broken), "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, nil, &bytes.Buffer{}, &errOut, nil)
	if code != 2 {
		t.Fatalf("exit %d, want 2", code)
	}
	if !strings.Contains(errOut.String(), "features.default.max_concurent") {
		t.Errorf("stderr does not name the key: %s", errOut.String())
	}
}

// TestBrokenKeysFileExits2: a keys file with a line that cannot be read stops validate and the
// start, like a broken policy, with status 2 and a message naming the file and the line.
func TestBrokenKeysFileExits2(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("# keys\n"+strings.Repeat("ab", 32)+" acme\n"+strings.Repeat("ab", 31)+" globex\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	pol := write(t, "classification: {tenant: {rules: [{api_key: true, trusted: true}]}}\ntenants: {keys_file: "+keys+
		"}\nfeatures: {default: {max_concurrent: 3}}\ncompartments: [{name: f, key: [feature], limits_from: feature}]\n")
	for _, args := range [][]string{{"validate", pol}, {"serve", "--config", pol, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}} {
		var errOut bytes.Buffer
		if code := run(context.Background(), args, []string{}, &bytes.Buffer{}, &errOut, nil); code != 2 {
			t.Fatalf("%s: exit %d, want 2; stderr:\n%s", args[0], code, errOut.String())
		}
		if want := keys + ":3: tenants.keys_file: a SHA-256 is 64 hexadecimal digits, this is 62 characters"; !strings.Contains(errOut.String(), want) {
			t.Errorf("%s: stderr\n%s\nwant it to say\n%s", args[0], errOut.String(), want)
		}
	}
}

// TestServeUnusableStateFileExits2: with state.on_error: refuse, a state file that exists but
// cannot be used stops the start with status 2 and a message naming the file; so does the
// former name of the key, spend.on_state_error, with the former name of the flag.
func TestServeUnusableStateFileExits2(t *testing.T) {
	state := write(t, `{"format":"llm-bulkhead-state","version":1,"sha2`)
	const pol = `classification: {feature: {default: chat}, provider: {default: p}}
models: [{match: "*", provider: p}]
prices: [{match: default, input_per_mtok: 1, output_per_mtok: 2}]
features: {chat: {max_concurrent: 4, spend_per_day: 5, tokens_per_day: 1000}}
providers: {p: {}}
compartments: [{name: feature, key: [feature], limits_from: feature}]
`
	for _, tc := range []struct{ flag, key string }{
		{"--state-file", "state: {on_error: refuse}"},
		{"--spend-state", "spend: {on_state_error: refuse}"},
	} {
		var errOut bytes.Buffer
		code := run(context.Background(), []string{"serve", "--config", write(t, pol+tc.key+"\n"), tc.flag, state, "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"},
			nil, &bytes.Buffer{}, &errOut, nil)
		if code != 2 {
			t.Fatalf("%s, %s: exit %d, want 2; stderr:\n%s", tc.flag, tc.key, code, errOut.String())
		}
		if !strings.Contains(errOut.String(), "not starting: state file "+state) {
			t.Errorf("%s, %s: stderr does not name the state file:\n%s", tc.flag, tc.key, errOut.String())
		}
	}
}

// TestServeStateFileFlagsDisagree: the flag and its former name naming two files is bad usage.
func TestServeStateFileFlagsDisagree(t *testing.T) {
	var errOut bytes.Buffer
	code := run(context.Background(), []string{"serve", "--state-file", "a.json", "--spend-state", "b.json", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"},
		nil, &bytes.Buffer{}, &errOut, nil)
	if code != 2 || !strings.Contains(errOut.String(), "--spend-state b.json and --state-file a.json name different files") {
		t.Fatalf("exit %d, stderr:\n%s", code, errOut.String())
	}
}

func TestServeAddressInUseExits1(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	code := run(context.Background(), []string{"--grpc-addr", ln.Addr().String(), "--admin-addr", "127.0.0.1:0"}, nil, &bytes.Buffer{}, &bytes.Buffer{}, nil)
	if code != 1 {
		t.Fatalf("exit %d, want 1", code)
	}
}

// TestServeExposedAdminExits2 (defect 8): an admin address reachable beyond this machine, from
// the flag or the policy, with no admin token and no --admin-insecure, is refused at start
// with a message naming the address and both ways out.
func TestServeExposedAdminExits2(t *testing.T) {
	for name, args := range map[string][]string{
		"flag":   {"serve", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "0.0.0.0:0"},
		"policy": {"serve", "--grpc-addr", "127.0.0.1:0", "--config", write(t, "features: {default: {max_concurrent: 5}}\nserver: {admin_addr: \":0\"}\n")},
	} {
		t.Run(name, func(t *testing.T) {
			// Only a guard: a server that wrongly starts serves until its context ends.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var errOut bytes.Buffer
			code := run(ctx, args, []string{}, &bytes.Buffer{}, &errOut, nil)
			if code != 2 {
				t.Fatalf("exit %d, want 2\n%s", code, errOut.String())
			}
			for _, want := range []string{"admin address", "is not loopback", "LLM_BULKHEAD_ADMIN_TOKEN", "--admin-insecure"} {
				if !strings.Contains(errOut.String(), want) {
					t.Errorf("stderr does not say %q: %s", want, errOut.String())
				}
			}
		})
	}
}

// TestServeAdminInsecure: --admin-insecure starts an exposed admin listener without a token,
// warns about it, and shuts down normally.
func TestServeAdminInsecure(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	logs := &syncbuf.Buffer{}
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "0.0.0.0:0", "--admin-insecure"}, []string{}, &bytes.Buffer{}, logs, nil)
	}()
	waitUntil(t, func() bool { return strings.Contains(logs.String(), "llm-bulkhead listening") })
	if !strings.Contains(logs.String(), `"level":"WARN"`) || !strings.Contains(logs.String(), "--admin-insecure") {
		t.Errorf("no warning about the unguarded admin listener:\n%s", logs.String())
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exit %d, want 0", code)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop")
	}
}

// freeAddr reserves a loopback port for a server started by run.
func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestServeLifecycle: serve logs where it listens and which policy it runs, reports SERVING on
// gRPC health and ready on /readyz, reloads on SIGHUP, and on SIGTERM drains and exits 0.
func TestServeLifecycle(t *testing.T) {
	grpcAddr, adminAddr := freeAddr(t), freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	hup := make(chan os.Signal, 1)
	logs := &syncbuf.Buffer{}
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--grpc-addr", grpcAddr, "--admin-addr", adminAddr, "--log-level", "debug"}, []string{}, &bytes.Buffer{}, logs, hup)
	}()
	waitUntil(t, func() bool { return strings.Contains(logs.String(), "llm-bulkhead listening") })
	var line map[string]any
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "llm-bulkhead listening") {
			_ = json.Unmarshal([]byte(l), &line)
		}
	}
	if line["grpc_addr"] != grpcAddr || line["admin_addr"] != adminAddr || line["policy"] != "<embedded examples/policy.yaml>" {
		t.Errorf("start log line = %v", line)
	}

	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	resp, err := health.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "envoy.service.ext_proc.v3.ExternalProcessor"})
	if err != nil || resp.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health = %v, %v", resp, err)
	}
	if code := httpStatus(t, "http://"+adminAddr+"/readyz"); code != 200 {
		t.Errorf("/readyz = %d", code)
	}
	if code := httpStatus(t, "http://"+adminAddr+"/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}

	hup <- os.Interrupt
	waitUntil(t, func() bool { return strings.Contains(logs.String(), "policy reloaded") })

	cancel() // SIGTERM
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exit %d after SIGTERM, want 0", code)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop")
	}
	if !strings.Contains(logs.String(), "draining") {
		t.Errorf("no drain in the log:\n%s", logs.String())
	}
}

func httpStatus(t *testing.T, url string) int {
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

func waitUntil(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
