package policy_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

func keyHex(key string) string { return fmt.Sprintf("%x", sha256.Sum256([]byte(key))) }

// keysPolicy takes the tenant from the request's API key (acme's in the directory, globex's in
// keysFile), else from x-tenant-id; acme may run one request at a time.
func keysPolicy(keysFile, unknownKey string) string {
	return `
classification:
  tenant:
    rules:
      - {api_key: true, trusted: true}
      - {api_key: true, header: x-portkey-key, trusted: true}
      - {header: x-tenant-id, trusted: true}
  tier:
    rules: [{tenant_directory: true}]
tenants:
  keys_file: ` + keysFile + `
  unknown_key: ` + unknownKey + `
  directory:
    - {id: acme, tier: enterprise, key_sha256: [` + keyHex("sk-acme-1") + `, ` + keyHex("sk-acme-2") + `], limits: {max_concurrent: 1}}
    - {id: globex, tier: pro}
features:
  default: {}
tiers:
  enterprise: {max_concurrent: 30}
  pro: {max_concurrent: 15}
  free: {max_concurrent: 5}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant}
`
}

func keysEngine(t *testing.T, unknownKey string) (*policy.Engine, *prometheus.Registry) {
	t.Helper()
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte(keyHex("sk-globex")+" globex\n"+keyHex("sk-initech")+" initech\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := config.Load("p.yaml", []byte(keysPolicy(keys, unknownKey)), nil)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	e, err := observe.NewEngine(p, policy.Options{Clock: newClock(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, reg)
	if err != nil {
		t.Fatal(err)
	}
	return e, reg
}

// TestAPIKeyGivesItsTenant: a known key gives its tenant (from the directory or the keys file)
// and so its tier and limits, whatever x-tenant-id claims; Bearer in any case, Anthropic's
// x-api-key and a header of the policy's choice are read. An unknown or missing key gives
// nothing with unknown_key: default, so the next rules and the default decide.
func TestAPIKeyGivesItsTenant(t *testing.T) {
	e, _ := keysEngine(t, "default")
	s := e.Snapshot()
	for _, tc := range []struct {
		name    string
		headers map[string]string
		tenant  string
		tier    string
	}{
		{"bearer, a directory key", map[string]string{"authorization": "Bearer sk-acme-1"}, "acme", "enterprise"},
		{"another key of the tenant", map[string]string{"authorization": "bearer  sk-acme-2 "}, "acme", "enterprise"},
		{"a forged x-tenant-id", map[string]string{"authorization": "Bearer sk-acme-1", "x-tenant-id": "globex"}, "acme", "enterprise"},
		{"a keys file key", map[string]string{"authorization": "Bearer sk-globex", "x-tenant-id": "acme"}, "globex", "pro"},
		{"a keys file tenant not in the directory", map[string]string{"authorization": "Bearer sk-initech"}, "initech", "free"},
		{"anthropic's x-api-key", map[string]string{"x-api-key": "sk-acme-2", "x-tenant-id": "globex"}, "acme", "enterprise"},
		{"authorization in another scheme, x-api-key read", map[string]string{"authorization": "Basic c2stYWNtZS0x", "x-api-key": "sk-globex"}, "globex", "pro"},
		{"the rule's own header, raw", map[string]string{"x-portkey-key": "sk-acme-1"}, "acme", "enterprise"},
		{"the rule's own header, bearer", map[string]string{"x-portkey-key": "Bearer sk-globex"}, "globex", "pro"},
		{"an unknown key: the next rule", map[string]string{"authorization": "Bearer sk-acme-3", "x-tenant-id": "globex"}, "globex", "pro"},
		{"an unknown key: the default", map[string]string{"authorization": "Bearer sk-acme-3"}, "anonymous", "free"},
		{"no key: the default", nil, "anonymous", "free"},
		{"a key's hash is not a key", map[string]string{"authorization": "Bearer " + keyHex("sk-acme-1")}, "anonymous", "free"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := s.Classify(input{headers: tc.headers})
			if n := s.Names(d); n.Tenant != tc.tenant || n.Tier != tc.tier {
				t.Errorf("tenant %q tier %q, want %q %q", n.Tenant, n.Tier, tc.tenant, tc.tier)
			}
		})
	}
	// acme's own limit (one at a time) applies to its keys.
	acme := input{headers: map[string]string{"authorization": "Bearer sk-acme-1"}}
	var held policy.Ticket
	r := policy.Request{Dims: s.Classify(acme)}
	if d := e.Admit(context.Background(), s, &r, &held, nil); d.Verdict != policy.Admit {
		t.Fatalf("first acme request refused: %+v", d)
	}
	r2 := policy.Request{Dims: s.Classify(input{headers: map[string]string{"x-api-key": "sk-acme-2", "x-tenant-id": "globex"}})}
	if d := e.Admit(context.Background(), s, &r2, &policy.Ticket{}, nil); d.Verdict != policy.Reject || d.Compartment != "tenant/acme" {
		t.Errorf("second acme request, by its other key and a forged x-tenant-id: %+v, want refused by tenant/acme", d)
	}
	held.Done(policy.Outcome{Status: 200})

	var in policy.Input = acme
	if n := testing.AllocsPerRun(100, func() { _ = s.Classify(in) }); n != 0 {
		t.Errorf("classifying by API key allocates %v times", n)
	}
}

// TestUnknownKeyRejected: with unknown_key: reject, a request whose key is unknown or missing
// is refused (unknown_key) before anything is charged, and counted by reason; a known key is
// admitted.
func TestUnknownKeyRejected(t *testing.T) {
	e, reg := keysEngine(t, "reject")
	s := e.Snapshot()
	for _, h := range []map[string]string{
		{"authorization": "Bearer sk-unknown", "x-tenant-id": "acme"},
		{"x-tenant-id": "acme"},
		{"authorization": "Bearer "},
	} {
		r := policy.Request{Dims: s.Classify(input{headers: h})}
		d := e.Admit(context.Background(), s, &r, &policy.Ticket{}, nil)
		if d.Verdict != policy.Reject || d.Reason != policy.ReasonUnknownKey || !errors.Is(d.Err(), policy.ErrUnknownKey) {
			t.Errorf("%v: %+v, want refused for unknown_key", h, d)
		}
		if strings.Contains(d.Message(), "sk-") {
			t.Errorf("message names the key: %s", d.Message())
		}
	}
	if got := metricValue(t, reg, "llm_bulkhead_rejected_total", map[string]string{"reason": "unknown_key"}); got != 3 {
		t.Errorf("rejected_total{reason=unknown_key} = %v, want 3", got)
	}
	for _, c := range e.Compartments() {
		if c.InFlight != 0 {
			t.Errorf("compartment %s holds %d", c.Name, c.InFlight)
		}
	}
	for _, h := range []map[string]string{
		{"authorization": "Bearer sk-globex"},
		// The first api_key rule finds nothing; the second, reading its own header, does.
		{"authorization": "Bearer sk-unknown", "x-portkey-key": "sk-globex"},
	} {
		r := policy.Request{Dims: s.Classify(input{headers: h})}
		var tk policy.Ticket
		if d := e.Admit(context.Background(), s, &r, &tk, nil); d.Verdict != policy.Admit || tk.JoinCompartments() != "tenant/globex" {
			t.Errorf("%v: %+v in %q", h, d, tk.JoinCompartments())
		}
		tk.Done(policy.Outcome{Status: 200})
	}
}

// BenchmarkClassify classifies a request whose tenant comes from a trusted header, then from
// an API key (among 2 directory keys, then among 100 000 keys of a keys file): the key's cost is
// one SHA-256 of the key and a binary search. Neither allocates.
func BenchmarkClassify(b *testing.B) {
	var file strings.Builder
	for i := range 100_000 {
		fmt.Fprintf(&file, "%s tenant-%d\n", keyHex(fmt.Sprintf("sk-bench-%d", i)), i/10)
	}
	keys := filepath.Join(b.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte(file.String()), 0o600); err != nil {
		b.Fatal(err)
	}
	p, err := config.Load("p.yaml", []byte(keysPolicy(keys, "default")), nil)
	if err != nil {
		b.Fatal(err)
	}
	e, err := policy.NewEngine(p, policy.Options{Clock: newClock(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	s := e.Snapshot()
	for _, bc := range []struct {
		name   string
		in     input
		tenant string
	}{
		{"header", input{headers: map[string]string{"x-tenant-id": "globex"}}, "globex"},
		{"api_key_directory", input{headers: map[string]string{"authorization": "Bearer sk-acme-1"}}, "acme"},
		{"api_key_file_100k", input{headers: map[string]string{"authorization": "Bearer sk-bench-77777"}}, "tenant-7777"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var in policy.Input = bc.in
			if got := s.Classify(in).Tenant; got != bc.tenant {
				b.Fatalf("tenant %q, want %q", got, bc.tenant)
			}
			b.ReportAllocs()
			for b.Loop() {
				_ = s.Classify(in)
			}
		})
	}
}
