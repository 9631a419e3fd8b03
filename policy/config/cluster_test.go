package config_test

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// limitsOne is a policy that limits something, so cluster sections can be tested on their own.
// A cluster section appended to it starts at line 3.
const limitsOne = "features:\n  default: {max_concurrent: 1}\n"

func defaultReplicaID(t *testing.T) string {
	t.Helper()
	host, err := os.Hostname()
	if err != nil {
		t.Skipf("no host name: %v", err)
	}
	return fmt.Sprintf("%s-%d", host, os.Getpid())
}

// TestClusterDefaults: a redis backend in each mode loads, and every key it leaves out gets the
// default the schema documents.
func TestClusterDefaults(t *testing.T) {
	tests := []struct {
		name, section string
		mode          string
		addresses     []string
		masterName    string
	}{
		{"standalone", "cluster:\n  backend: redis\n  addresses: [redis:6379]\n", "standalone", []string{"redis:6379"}, ""},
		{"sentinel", "cluster:\n  backend: redis\n  mode: sentinel\n  master_name: mymaster\n  addresses: [s1:26379, s2:26379, \"[::1]:26379\"]\n",
			"sentinel", []string{"s1:26379", "s2:26379", "[::1]:26379"}, "mymaster"},
		{"cluster", "cluster:\n  backend: redis\n  mode: cluster\n  addresses: [n1:7000, n2:7001]\n", "cluster", []string{"n1:7000", "n2:7001"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := config.Load("p.yaml", []byte(limitsOne+tt.section), nil)
			if err != nil {
				t.Fatal(err)
			}
			c := p.Cluster
			if !c.Enabled() || c.Backend != "redis" || c.Mode != tt.mode || c.MasterName != tt.masterName ||
				strings.Join(c.Addresses, ",") != strings.Join(tt.addresses, ",") {
				t.Errorf("backend %q mode %q master %q addresses %v", c.Backend, c.Mode, c.MasterName, c.Addresses)
			}
			want := config.Cluster{
				Backend: c.Backend, Addresses: c.Addresses, Mode: c.Mode, MasterName: c.MasterName,
				KeyPrefix:             "llm-bulkhead",
				ReplicaID:             defaultReplicaID(t),
				Timeout:               config.Duration(20 * time.Millisecond),
				DialTimeout:           config.Duration(time.Second),
				WriteTimeout:          config.Duration(time.Second),
				LeaseTTL:              config.Duration(10 * time.Second),
				Heartbeat:             config.Duration(2500 * time.Millisecond),
				SettleInterval:        config.Duration(2 * time.Millisecond),
				MaxPendingSettlements: 100000,
				Admission:             "leased",
				LeaseInterval:         config.Duration(200 * time.Millisecond),
				OnUnavailable:         "local",
			}
			if fmt.Sprintf("%+v", c) != fmt.Sprintf("%+v", want) {
				t.Errorf("cluster after defaults\n got %+v\nwant %+v", c, want)
			}
		})
	}
}

// TestClusterValuesWritten: values written are kept, and the heartbeat defaults to a quarter of
// the lease_ttl written, not of the default one.
func TestClusterValuesWritten(t *testing.T) {
	data := limitsOne + `cluster:
  backend: redis
  addresses: ["10.0.0.5:6380"]
  username: bulkhead
  password_env: REDIS_PASSWORD
  tls: {enabled: true, ca_file: /etc/ca.pem, cert_file: /etc/c.pem, key_file: /etc/k.pem, server_name: redis.internal}
  key_prefix: "prod:llm"
  replica_id: pod-7
  timeout: 1s
  lease_ttl: 20s
  settle_interval: 100ms
  max_pending_settlements: 1000
  on_unavailable: closed
  expected_replicas: 3
`
	// The password's variable is not set: only its name is checked when loading.
	p, err := config.Load("p.yaml", []byte(data), nil)
	if err != nil {
		t.Fatal(err)
	}
	c := p.Cluster
	if c.KeyPrefix != "prod:llm" || c.ReplicaID != "pod-7" || c.Timeout.D() != time.Second || c.LeaseTTL.D() != 20*time.Second ||
		c.Heartbeat.D() != 5*time.Second || c.SettleInterval.D() != 100*time.Millisecond || c.MaxPendingSettlements != 1000 ||
		c.OnUnavailable != "closed" || c.PasswordEnv != "REDIS_PASSWORD" || c.Username != "bulkhead" || c.ExpectedReplicas != 3 {
		t.Errorf("cluster %+v", c)
	}
	if tls := c.TLS; !tls.Enabled || tls.CAFile != "/etc/ca.pem" || tls.CertFile != "/etc/c.pem" || tls.KeyFile != "/etc/k.pem" || tls.ServerName != "redis.internal" {
		t.Errorf("tls %+v", tls)
	}
}

// TestClusterOff: without a backend, or with backend none, the section stays as written (no
// defaults), and none is normalised to empty.
func TestClusterOff(t *testing.T) {
	for _, section := range []string{"", "cluster: {}\n", "cluster: {backend: none}\n", "cluster: {backend: \"\"}\n"} {
		p, err := config.Load("p.yaml", []byte(limitsOne+section), nil)
		if err != nil {
			t.Fatalf("%q: %v", section, err)
		}
		if p.Cluster.Enabled() || fmt.Sprintf("%+v", p.Cluster) != fmt.Sprintf("%+v", config.Cluster{}) {
			t.Errorf("%q: cluster = %+v, want it zero", section, p.Cluster)
		}
	}
}

// TestClusterProblems: each mistake is reported once, at its line, naming its key path.
func TestClusterProblems(t *testing.T) {
	const redis = "cluster:\n  backend: redis\n  addresses: [redis:6379]\n"
	tests := []struct {
		name, section string
		want          string
	}{
		{"unknown backend", "cluster:\n  backend: memcached\n  addresses: [m:11211]\n",
			`p.yaml:4: cluster.backend: "memcached" is not a cluster backend: use redis, or none (or leave it out) to enforce limits per process`},
		{"addresses without backend", "cluster:\n  addresses: [redis:6379]\n",
			`p.yaml:4: cluster.addresses: is set but cluster.backend is empty (or none), so it would do nothing: set backend: redis`},
		{"timeout with backend none", "cluster:\n  backend: none\n  timeout: 5ms\n",
			`p.yaml:5: cluster.timeout: is set but cluster.backend is empty (or none), so it would do nothing`},
		{"tls without backend", "cluster:\n  tls:\n    enabled: true\n",
			`p.yaml:5: cluster.tls.enabled: is set but cluster.backend is empty (or none)`},
		{"no addresses", "cluster:\n  backend: redis\n",
			`p.yaml:3: cluster.addresses: cluster.backend redis needs at least one host:port address`},
		{"address without port", "cluster:\n  backend: redis\n  addresses:\n    - redis\n",
			`p.yaml:6: cluster.addresses[0]: "redis" is not a host:port address (write it like redis:6379 or [::1]:6379)`},
		{"address with port 0", "cluster:\n  backend: redis\n  addresses:\n    - redis:0\n",
			`p.yaml:6: cluster.addresses[0]: "redis:0" needs a numeric port between 1 and 65535`},
		{"address with port 65536", "cluster:\n  backend: redis\n  addresses:\n    - redis:65536\n",
			`p.yaml:6: cluster.addresses[0]: "redis:65536" needs a numeric port between 1 and 65535`},
		{"address with named port", "cluster:\n  backend: redis\n  addresses:\n    - redis:redis\n",
			`p.yaml:6: cluster.addresses[0]: "redis:redis" needs a numeric port between 1 and 65535`},
		{"address without host", "cluster:\n  backend: redis\n  addresses:\n    - :6379\n",
			`p.yaml:6: cluster.addresses[0]: ":6379" has no host`},
		{"address twice", "cluster:\n  backend: redis\n  mode: cluster\n  addresses:\n    - n1:7000\n    - n1:7000\n",
			`p.yaml:8: cluster.addresses[1]: "n1:7000" is already listed at cluster.addresses[0]`},
		{"unknown mode", redis + "  mode: replicated\n",
			`p.yaml:6: cluster.mode: "replicated" is not one of standalone, sentinel, cluster`},
		{"standalone with two addresses", "cluster:\n  backend: redis\n  addresses: [r1:6379, r2:6379]\n",
			`p.yaml:5: cluster.addresses: standalone mode takes exactly one address, got 2; list sentinels with mode: sentinel, cluster nodes with mode: cluster`},
		{"sentinel without master", "cluster:\n  backend: redis\n  mode: sentinel\n  addresses: [s1:26379]\n",
			`p.yaml:3: cluster.master_name: sentinel mode needs the name of the master set the sentinels watch`},
		{"master outside sentinel", redis + "  master_name: mymaster\n",
			`p.yaml:6: cluster.master_name: is only for sentinel mode, not standalone`},
		{"password instead of its variable", redis + "  password_env: \"hunter2!\"\n",
			`p.yaml:6: cluster.password_env: "hunter2!" is not an environment variable name (letters, digits and '_', not starting with a digit); write the variable's name here, never the password`},
		{"password variable read as an override", redis + "  password_env: LLM_BULKHEAD_REDIS__PASSWORD\n",
			`p.yaml:6: cluster.password_env: LLM_BULKHEAD_REDIS__PASSWORD would be read as a policy override`},
		{"cert without key", redis + "  tls: {enabled: true, cert_file: c.pem}\n",
			`p.yaml:6: cluster.tls.cert_file: is set without key_file: a client certificate needs both (or neither)`},
		{"key without cert", redis + "  tls:\n    enabled: true\n    key_file: k.pem\n",
			`p.yaml:8: cluster.tls.key_file: is set without cert_file: a client certificate needs both (or neither)`},
		{"tls settings without enabled", redis + "  tls:\n    ca_file: ca.pem\n",
			`p.yaml:7: cluster.tls.ca_file: is set but cluster.tls.enabled is false, so it would not be used: set enabled: true, or remove it`},
		{"key prefix with a brace", redis + "  key_prefix: \"a{b\"\n",
			`p.yaml:6: cluster.key_prefix: "a{b" must not contain '{', '}', whitespace or control characters`},
		{"key prefix with a space", redis + "  key_prefix: \"my app\"\n",
			`p.yaml:6: cluster.key_prefix: "my app" must not contain '{', '}', whitespace or control characters`},
		{"key prefix of whitespace", redis + "  key_prefix: \" \"\n",
			`p.yaml:6: cluster.key_prefix: " " must not contain`},
		{"replica id with a space", redis + "  replica_id: \"pod 7\"\n",
			`p.yaml:6: cluster.replica_id: "pod 7" must not contain whitespace or control characters`},
		{"replica id too long", redis + "  replica_id: " + strings.Repeat("r", 129) + "\n",
			`p.yaml:6: cluster.replica_id: is 129 bytes long, at most 128`},
		{"timeout over 1s", redis + "  timeout: 1001ms\n",
			`p.yaml:6: cluster.timeout: must be positive and at most 1s (every admission waits up to this long for Redis), got 1.001s`},
		{"negative timeout", redis + "  timeout: -1ms\n",
			`p.yaml:6: cluster.timeout: must be positive and at most 1s (every admission waits up to this long for Redis), got -1ms`},
		{"negative dial timeout", redis + "  dial_timeout: -1s\n",
			`p.yaml:6: cluster.dial_timeout: must be positive, got -1s`},
		{"negative write timeout", redis + "  write_timeout: -1s\n",
			`p.yaml:6: cluster.write_timeout: must be positive, got -1s`},
		{"short lease", redis + "  lease_ttl: 999ms\n",
			`p.yaml:6: cluster.lease_ttl: must be at least 1s, got 999ms`},
		{"long lease", redis + "  lease_ttl: 61m\n",
			`p.yaml:6: cluster.lease_ttl: must be at most 1h0m0s (a replica that dies keeps its slots taken this long, and a registration further ahead is taken for corrupt content), got 1h1m0s`},
		{"negative expected replicas", redis + "  expected_replicas: -1\n",
			`p.yaml:6: cluster.expected_replicas: must be between 1 and 1000 (or left out), got -1`},
		{"too many expected replicas", redis + "  expected_replicas: 1001\n",
			`p.yaml:6: cluster.expected_replicas: must be between 1 and 1000 (or left out), got 1001`},
		{"expected replicas not a number", redis + "  expected_replicas: three\n",
			`p.yaml:6: cluster.expected_replicas:`},
		{"negative heartbeat", redis + "  heartbeat: -1s\n",
			`p.yaml:6: cluster.heartbeat: must be positive, got -1s`},
		{"heartbeat over half the lease", redis + "  lease_ttl: 10s\n  heartbeat: 5001ms\n",
			`p.yaml:7: cluster.heartbeat: 5.001s is more than half of cluster.lease_ttl (10s): one late heartbeat would let the replica's leases expire while it is alive; use at most 5s`},
		{"heartbeat over half the default lease", redis + "  heartbeat: 6s\n",
			`p.yaml:6: cluster.heartbeat: 6s is more than half of cluster.lease_ttl (10s)`},
		{"negative settle interval", redis + "  settle_interval: -1ms\n",
			`p.yaml:6: cluster.settle_interval: must be between 0s and 100ms, got -1ms`},
		{"long settle interval", redis + "  settle_interval: 101ms\n",
			`p.yaml:6: cluster.settle_interval: must be between 0s and 100ms, got 101ms`},
		{"few pending settlements", redis + "  max_pending_settlements: 999\n",
			`p.yaml:6: cluster.max_pending_settlements: must be at least 1000, got 999`},
		{"unknown on_unavailable", redis + "  on_unavailable: open\n",
			`p.yaml:6: cluster.on_unavailable: "open" is not one of local, closed`},
		{"unknown admission", redis + "  admission: approximate\n",
			`p.yaml:6: cluster.admission: "approximate" is not one of leased, exact`},
		{"lease_interval too short", redis + "  lease_interval: 5ms\n",
			`p.yaml:6: cluster.lease_interval: must be at least 10ms, got 5ms`},
		{"lease_interval beyond a quarter of lease_ttl", redis + "  lease_ttl: 2s\n  lease_interval: 600ms\n",
			`p.yaml:7: cluster.lease_interval: 600ms is more than a quarter of cluster.lease_ttl (2s): leases would expire between two reports that renew them; use at most 500ms`},
		{"wrong type", redis + "  timeout: 20\n",
			`p.yaml:6: cluster.timeout: 20 is not a duration (write it with a unit, like 100ms or 5s)`},
		{"unknown key", redis + "  adresses: [redis:6379]\n",
			`p.yaml:6: cluster.adresses: unknown key "adresses" (did you mean "addresses"?)`},
		{"unknown tls key", redis + "  tls:\n    enabled: true\n    ca: ca.pem\n",
			`p.yaml:8: cluster.tls.ca: unknown key "ca"`},
		{"misspelt tls key", redis + "  tls: {enabled: true, cafile: ca.pem}\n",
			`p.yaml:6: cluster.tls.cafile: unknown key "cafile" (did you mean "ca_file"?)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantProblems(t, loadProblems(t, limitsOne+tt.section, nil), []string{tt.want})
		})
	}
}

// TestClusterRefusesPools: pools lend capacity inside one process, so with shared limits each
// replica would lend its own.
func TestClusterRefusesPools(t *testing.T) {
	data := `features:
  default: {max_concurrent: 5}
  chat: {max_concurrent: 20}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
pools:
  - name: shared
    max_concurrent: 25
    members:
      - {compartment: feature/chat, guaranteed: 10}
      - {compartment: feature/default, guaranteed: 5}
cluster: {backend: redis, addresses: ["redis:6379"]}
`
	wantProblems(t, loadProblems(t, data, nil), []string{
		`p.yaml:6: pools: pools are enforced per process and cannot be shared across replicas yet, so with cluster.backend redis each replica would lend and borrow its own capacity: remove pools or the cluster backend`,
	})
	// Without the backend the same pools load.
	if _, err := config.Load("p.yaml", []byte(strings.Replace(data, "backend: redis, addresses: [\"redis:6379\"]", "backend: none", 1)), nil); err != nil {
		t.Fatal(err)
	}
}

// TestClusterEveryProblemAtOnce: a section with many mistakes reports all of them in one run, in
// line order, with problems elsewhere in the file.
func TestClusterEveryProblemAtOnce(t *testing.T) {
	data := `features:
  default: {max_concurrent: -1}
cluster:
  backend: redis
  mode: sentinel
  addresses: [s1:26379, s2]
  password_env: my-password
  tls: {cert_file: c.pem}
  key_prefix: "{app}"
  replica_id: "pod 7"
  timeout: 0s
  lease_ttl: 2s
  heartbeat: 2s
  on_unavailable: fail-open
`
	wantProblems(t, loadProblems(t, data, nil), []string{
		`p.yaml:2: features.default.max_concurrent: must not be negative, got -1`,
		`p.yaml:3: cluster.master_name: sentinel mode needs the name of the master set the sentinels watch`,
		`p.yaml:6: cluster.addresses[1]: "s2" is not a host:port address`,
		`p.yaml:7: cluster.password_env: "my-password" is not an environment variable name`,
		`p.yaml:8: cluster.tls.cert_file: is set without key_file`,
		`p.yaml:8: cluster.tls.cert_file: is set but cluster.tls.enabled is false`,
		`p.yaml:9: cluster.key_prefix: "{app}" must not contain '{', '}'`,
		`p.yaml:10: cluster.replica_id: "pod 7" must not contain whitespace`,
		// 0s is unset: the default 20ms applies.
		`p.yaml:13: cluster.heartbeat: 2s is more than half of cluster.lease_ttl (2s)`,
		`p.yaml:14: cluster.on_unavailable: "fail-open" is not one of local, closed`,
	})
}

// TestClusterEnvOverrides: cluster scalars can be set from the environment like any other key,
// and a bad value is blamed on the variable. Lists (addresses) cannot be.
func TestClusterEnvOverrides(t *testing.T) {
	data := limitsOne + "cluster:\n  addresses: [redis:6379]\n"
	p, err := config.Load("p.yaml", []byte(data), []string{
		"LLM_BULKHEAD_CLUSTER__BACKEND=redis",
		"LLM_BULKHEAD_CLUSTER__REPLICA_ID=pod-7",
		"LLM_BULKHEAD_CLUSTER__TIMEOUT=50ms",
		"LLM_BULKHEAD_CLUSTER__TLS__ENABLED=true",
	})
	if err != nil {
		t.Fatal(err)
	}
	if c := p.Cluster; c.Backend != "redis" || c.ReplicaID != "pod-7" || c.Timeout.D() != 50*time.Millisecond || !c.TLS.Enabled || c.KeyPrefix != "llm-bulkhead" {
		t.Errorf("cluster %+v", c)
	}

	wantProblems(t, loadProblems(t, data, []string{
		"LLM_BULKHEAD_CLUSTER__BACKEND=redis",
		"LLM_BULKHEAD_CLUSTER__REPLICA_ID=pod 7",
	}), []string{
		`<env>: cluster.replica_id: LLM_BULKHEAD_CLUSTER__REPLICA_ID: "pod 7" must not contain whitespace or control characters`,
	})
	wantProblems(t, loadProblems(t, data, []string{"LLM_BULKHEAD_CLUSTER__ADDRESSES=[r1:6379]"}), []string{
		`<env>: cluster.addresses: LLM_BULKHEAD_CLUSTER__ADDRESSES: must be a single value, not a YAML a list`,
		`p.yaml:4: cluster.addresses: is set but cluster.backend is empty (or none)`,
	})
	// Without the backend variable, the file's addresses do nothing and are refused.
	wantProblems(t, loadProblems(t, data, []string{"LLM_BULKHEAD_CLUSTER__REPLICA_ID=pod-7"}), []string{
		`<env>: cluster.replica_id: LLM_BULKHEAD_CLUSTER__REPLICA_ID: is set but cluster.backend is empty (or none)`,
		`p.yaml:4: cluster.addresses: is set but cluster.backend is empty (or none)`,
	})
}
