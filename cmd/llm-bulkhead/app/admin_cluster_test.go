package app_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// clusterReply is GET /admin/cluster.
type clusterReply struct {
	Mode          string   `json:"mode"`
	State         string   `json:"state"`
	Share         int      `json:"share"`
	OnUnavailable string   `json:"on_unavailable"`
	ReplicaID     string   `json:"replica_id"`
	Addresses     []string `json:"addresses"`
	KeyPrefix     string   `json:"key_prefix"`
	Available     bool     `json:"available"`
	Live          int      `json:"live_replicas"`
	Leases        int      `json:"leases_held"`
	Pending       *int     `json:"settlements_queued"`
	Replicas      []struct {
		ID        string    `json:"id"`
		ExpiresAt time.Time `json:"lease_expires_at"`
		Live      bool      `json:"live"`
	} `json:"replicas"`
	Error     string `json:"error"`
	Synced    bool   `json:"synced"`
	LastError *struct {
		Op      string    `json:"op"`
		Message string    `json:"message"`
		At      time.Time `json:"at"`
	} `json:"last_error"`
	Admission  string       `json:"admission"`
	LeasesHeld []leaseReply `json:"leases"`
}

// leaseReply is one lease in GET /admin/cluster (leased admission).
type leaseReply struct {
	Compartment string `json:"compartment"`
	Slots       int64  `json:"slots"`
	Granted     int64  `json:"slots_granted"`
	Valid       bool   `json:"valid"`
}

func getCluster(t *testing.T, a *app.App) clusterReply {
	t.Helper()
	code, _, body := get(t, "http://"+a.AdminAddr()+"/admin/cluster", "")
	if code != http.StatusOK {
		t.Fatalf("GET /admin/cluster: %d %s", code, body)
	}
	var out clusterReply
	if err := json.Unmarshal(body, &out); err != nil {
		t.Fatalf("GET /admin/cluster: %v\n%s", err, body)
	}
	return out
}

// remoteHeld returns what the app's /admin/compartments says other replicas hold in the only
// compartment of clusterPolicy.
func remoteHeld(t *testing.T, a *app.App) (slots, tokens int64) {
	t.Helper()
	code, _, body := get(t, "http://"+a.AdminAddr()+"/admin/compartments", "")
	if code != http.StatusOK {
		t.Fatalf("GET /admin/compartments: %d %s", code, body)
	}
	var out struct {
		Compartments []struct {
			Name                 string `json:"name"`
			RemoteInFlight       int64  `json:"remote_in_flight"`
			RemoteInFlightTokens int64  `json:"remote_in_flight_tokens"`
		} `json:"compartments"`
	}
	if err := json.Unmarshal(body, &out); err != nil || len(out.Compartments) != 1 {
		t.Fatalf("GET /admin/compartments: %v\n%s", err, body)
	}
	return out.Compartments[0].RemoteInFlight, out.Compartments[0].RemoteInFlightTokens
}

// eventually polls cond until it holds, failing the test after 10 s (a bound for a broken build,
// not a timing assertion).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestAdminClusterOff(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte(policyWith(2)), 0o644); err != nil {
		t.Fatal(err)
	}
	a := startApp(t, path)
	got := getCluster(t, a)
	if got.Mode != "off" || got.State != "off" || got.Share != 1 || got.ReplicaID != "" || got.Replicas != nil {
		t.Errorf("GET /admin/cluster without a cluster: %+v, want mode and state off, share 1", got)
	}
	if slots, tokens := remoteHeld(t, a); slots != 0 || tokens != 0 {
		t.Errorf("without a cluster, other replicas hold %d slots and %d tokens", slots, tokens)
	}
}

// TestAdminClusterNeedsTokenWhenExposed: /admin/cluster is guarded like the other admin reads.
func TestAdminClusterNeedsTokenWhenExposed(t *testing.T) {
	_, base := startExposed(t, app.Options{Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"}, LogOutput: io.Discard})
	if code, challenge, _ := get(t, base+"/admin/cluster", ""); code != http.StatusUnauthorized || challenge == "" {
		t.Errorf("GET /admin/cluster without the token: %d, WWW-Authenticate %q", code, challenge)
	}
	if code, _, _ := get(t, base+"/admin/cluster", "s3cret"); code != http.StatusOK {
		t.Errorf("GET /admin/cluster with the token: %d", code)
	}
}

const clusterPolicy = `
features:
  default: {max_concurrent: 4}
cluster:
  backend: redis
  addresses: [%q]
  replica_id: %s
  key_prefix: admin-view
  timeout: 500ms
  lease_ttl: 2s
  heartbeat: 100ms
  on_unavailable: %s
`

// startClusterApp starts an app sharing its limits through the Redis at addr, with admission
// mode ("exact" or "leased").
func startClusterApp(t *testing.T, addr, id, onUnavailable, mode string) *app.App {
	t.Helper()
	path := filepath.Join(t.TempDir(), "policy.yaml")
	yaml := fmt.Sprintf(clusterPolicy, addr, id, onUnavailable) + "  admission: " + mode + "\n"
	if mode == "leased" {
		yaml += "  lease_interval: 50ms\n"
	}
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Shutdown(context.Background()) })
	return a
}

// admitOne admits one request of 10 tokens on a's engine.
func admitOne(t *testing.T, a *app.App) *policy.Ticket {
	t.Helper()
	e := a.Engine()
	s := e.Snapshot()
	r := policy.Request{Dims: s.Classify(noHeaders{}), Estimate: policy.Estimate{Total: 10, Prompt: 5, Output: 5}}
	tk := &policy.Ticket{}
	if d := e.Admit(context.Background(), s, &r, tk, nil); d.Verdict != policy.Admit {
		t.Fatalf("admission: %+v", d)
	}
	return tk
}

func done(tk *policy.Ticket) {
	tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 5, Completion: 5, Total: 10, Known: true}})
}

// noHeaders is a request with nothing to classify it by.
type noHeaders struct{}

func (noHeaders) Header(string) (string, bool)             { return "", false }
func (noHeaders) Path() string                             { return "/v1/chat/completions" }
func (noHeaders) BodyField(string) (string, bool)          { return "", false }
func (noHeaders) Metadata(string, []string) (string, bool) { return "", false }
func (noHeaders) Attribute(string) (string, bool)          { return "", false }

// TestAdminCluster: two replicas sharing one Redis each show the membership, what the other
// holds per compartment, and, once Redis is gone, what they enforce instead.
func TestAdminCluster(t *testing.T) {
	for _, mode := range []string{"exact", "leased"} {
		t.Run(mode, func(t *testing.T) { adminCluster(t, mode) })
	}
}

func adminCluster(t *testing.T, mode string) {
	rd := redistest.Standalone(t)
	a := startClusterApp(t, rd.Addr(), "replica-a", "local", mode)
	b := startClusterApp(t, rd.Addr(), "replica-b", "closed", mode)

	// Given both replicas registered
	var got clusterReply
	eventually(t, "replica-a to see two live replicas", func() bool {
		got = getCluster(t, a)
		live := 0
		for _, m := range got.Replicas {
			if m.Live {
				live++
			}
		}
		return got.Live == 2 && live == 2
	})
	// Then replica-a shows how its limits are shared
	if got.Mode != "standalone" || got.State != "shared" || !got.Available || got.Share != 1 || got.OnUnavailable != "local" || got.Admission != mode ||
		got.ReplicaID != "replica-a" || got.KeyPrefix != "admin-view" || len(got.Addresses) != 1 || got.Addresses[0] != rd.Addr() ||
		got.Pending == nil || got.Error != "" {
		t.Errorf("replica-a with Redis up: %+v", got)
	}
	ids := map[string]bool{}
	for _, m := range got.Replicas {
		ids[m.ID] = true
		if m.ExpiresAt.IsZero() {
			t.Errorf("replica %s has no lease expiry", m.ID)
		}
	}
	if !ids["replica-a"] || !ids["replica-b"] {
		t.Errorf("replicas registered: %+v, want replica-a and replica-b", got.Replicas)
	}

	// When replica-a holds a request, and replica-b admits (and finishes) one after it
	held := admitOne(t, a)
	done(admitOne(t, b))
	if mode == "exact" {
		// Then replica-a counts its lease and replica-b's compartments show what replica-a holds
		if n := getCluster(t, a).Leases; n != 1 {
			t.Errorf("replica-a holds %d leases, want 1", n)
		}
		eventually(t, "replica-b to show replica-a's request", func() bool {
			slots, tokens := remoteHeld(t, b)
			return slots == 1 && tokens == 10
		})
		// And once replica-a's request ends, replica-b shows its slot free
		done(held)
		eventually(t, "replica-b to show replica-a's slot free", func() bool {
			slots, tokens := remoteHeld(t, b)
			return slots == 0 && tokens == 0
		})
	} else {
		// Then replica-a shows its lease of the compartment: valid, and covering its request
		var l leaseReply
		eventually(t, "replica-a to show its lease", func() bool {
			for _, x := range getCluster(t, a).LeasesHeld {
				if x.Compartment == "feature/default" {
					l = x
					return x.Valid && x.Granted >= 1
				}
			}
			return false
		})
		if l.Slots < 1 || l.Granted > 4 {
			t.Errorf("replica-a's lease %+v, want at least the slot it uses, within the limit of 4", l)
		}
		done(held)
	}

	// When Redis is gone
	rd.Kill()
	// Then replica-a (on_unavailable local) enforces half of every limit, and says why
	eventually(t, "replica-a to enforce its share", func() bool {
		got = getCluster(t, a)
		return got.State == "local"
	})
	if got.Available || got.Share != 2 || got.Error == "" || got.Live != 2 {
		t.Errorf("replica-a with Redis gone: %+v, want unavailable, share 2 and the error", got)
	}
	if mode == "exact" {
		eventually(t, "replica-a's limits to be halved", func() bool { return limit(a) == 2 })
	}
	// And replica-b (on_unavailable closed) refuses
	eventually(t, "replica-b to refuse", func() bool {
		got = getCluster(t, b)
		return got.State == "refusing"
	})
	if got.Available || got.Share != 1 || got.OnUnavailable != "closed" {
		t.Errorf("replica-b with Redis gone: %+v, want unavailable, share 1, on_unavailable closed", got)
	}
}

// TestClusterStartWithRedisMisconfigured: a replica whose Redis refuses its password, or is not
// there, says why in its log when it starts, and that it retries (backing off); /admin/cluster
// shows the error; and with expected_replicas it enforces its part of each limit from the first
// request (4 / 2 = 2 slots), not the whole limit.
func TestClusterStartWithRedisMisconfigured(t *testing.T) {
	for _, mode := range []string{"exact", "leased"} { // the cluster admission modes
		rd := redistest.Standalone(t)
		if _, err := rd.Do("CONFIG", "SET", "requirepass", "the-right-one"); err != nil {
			t.Fatal(err)
		}
		t.Setenv("TEST_REDIS_PASSWORD", "a-wrong-one")
		cases := []struct{ name, addr, password, cause string }{
			{"wrong password", rd.Addr(), "  password_env: TEST_REDIS_PASSWORD\n", "WRONGPASS"},
			// A ping comes first, so Redis says NOAUTH (it would refuse an unauthenticated
			// client's long command, a script, without saying why).
			{"no password", rd.Addr(), "", "NOAUTH"},
			{"unreachable", redistest.ClosedAddr(t), "", "connection refused"},
		}
		for _, c := range cases {
			t.Run(mode+"/"+c.name, func(t *testing.T) {
				path := filepath.Join(t.TempDir(), "policy.yaml")
				yaml := fmt.Sprintf(clusterPolicy, c.addr, "replica-a", "local") + c.password + "  expected_replicas: 2\n  admission: " + mode + "\n"
				if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
					t.Fatal(err)
				}
				var logs syncbuf.Buffer
				a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: &logs})
				if err != nil {
					t.Fatal(err)
				}
				if err := a.Start(); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { a.Shutdown(context.Background()) })
				var said bool
				for _, line := range strings.Split(logs.String(), "\n") {
					var rec struct{ Level, Msg, Error, Hint string }
					if json.Unmarshal([]byte(line), &rec) == nil && rec.Level == "WARN" &&
						strings.Contains(rec.Msg, "Redis is not reachable yet") && strings.Contains(rec.Msg, "retrying") &&
						strings.Contains(rec.Error, c.cause) && strings.Contains(rec.Hint, "check cluster.") {
						said = true
					}
				}
				if !said {
					t.Errorf("the start's log does not say why Redis is not reachable (%s) and that it retries:\n%s", c.cause, logs.String())
				}
				got := getCluster(t, a)
				if got.State != "local" || got.LastError == nil || !strings.Contains(got.LastError.Message, c.cause) {
					t.Errorf("GET /admin/cluster: state %q, last error %+v; want local and %s", got.State, got.LastError, c.cause)
				}
				var held []*policy.Ticket
				for range 4 {
					e := a.Engine()
					s := e.Snapshot()
					r := policy.Request{Dims: s.Classify(noHeaders{}), Estimate: policy.Estimate{Total: 10, Prompt: 5, Output: 5}}
					tk := &policy.Ticket{}
					if d := e.Admit(context.Background(), s, &r, tk, nil); d.Verdict == policy.Admit {
						held = append(held, tk)
					}
				}
				if len(held) != 2 {
					t.Errorf("admitted %d of 4 requests before reaching Redis, want 2 (the limit 4 divided by expected_replicas 2)", len(held))
				}
				for _, tk := range held {
					done(tk)
				}
			})
		}
	}
}
