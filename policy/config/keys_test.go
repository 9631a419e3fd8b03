package config_test

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/apikey"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

func keyHash(key string) string { return fmt.Sprintf("%x", sha256.Sum256([]byte(key))) }

// keysPolicy is a policy with an api_key tenant rule; extra is appended to its tenants section.
func keysPolicy(extra string) string {
	return `features: {default: {max_concurrent: 10}}
classification:
  tenant:
    rules:
      - {api_key: true, trusted: true, strip_client_key: true}
      - {header: x-tenant-id, trusted: true}
tenants:
  directory:
    - {id: acme, tier: free, key_sha256: [` + keyHash("sk-acme") + `]}
` + extra + `
tiers: {free: {}}
`
}

func TestKeysFileLoads(t *testing.T) {
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys")
	if err := os.WriteFile(keys, []byte("# platform keys\n"+keyHash("sk-globex")+" globex\n"+keyHash("sk-acme")+" acme\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := config.Load("p.yaml", []byte(keysPolicy("  keys_file: "+keys+"\n  unknown_key: reject")), nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := p.Tenants.KeysFromFile().Lookup(apikey.Sum("sk-globex")); !ok || got != "globex" {
		t.Errorf("keys file: %q %v", got, ok)
	}
	if p.Tenants.UnknownKey != config.UnknownKeyReject {
		t.Errorf("unknown_key %q", p.Tenants.UnknownKey)
	}
	if got := p.StripHeaders(); strings.Join(got, ",") != "authorization,x-api-key" {
		t.Errorf("strip headers %v", got)
	}
	// The admin API shows the policy as JSON: hashes only by their prefix.
	js, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(js), keyHash("sk-acme")) || !strings.Contains(string(js), `"key_sha256":["`+keyHash("sk-acme")[:8]+`…"]`) {
		t.Errorf("policy JSON shows key hashes: %s", js)
	}
	def, err := config.Load("p.yaml", []byte(keysPolicy("")), nil)
	if err != nil {
		t.Fatal(err)
	}
	if def.Tenants.UnknownKey != config.UnknownKeyDefault || def.Tenants.KeysFromFile().Len() != 0 {
		t.Errorf("defaults: unknown_key %q, %d keys from no file", def.Tenants.UnknownKey, def.Tenants.KeysFromFile().Len())
	}
}

// TestKeysFileProblemsNameFileAndLine: a keys file line that cannot be read is a problem of the
// policy naming the keys file and the line, and never repeats the line (which may be a key).
func TestKeysFileProblemsNameFileAndLine(t *testing.T) {
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys")
	if err := os.WriteFile(keys, []byte(keyHash("sk-1")+" globex\n\nsk-live-pasted-by-mistake globex\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got := loadProblems(t, keysPolicy("  keys_file: "+keys), nil)
	wantProblems(t, got, []string{keys + ":3: tenants.keys_file: a SHA-256 is 64 hexadecimal digits"})
	if strings.Contains(strings.Join(got, "\n"), "sk-live") {
		t.Errorf("the problem repeats the line: %v", got)
	}

	if err := os.WriteFile(keys, []byte(keyHash("sk-acme")+" globex\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	wantProblems(t, loadProblems(t, keysPolicy("  keys_file: "+keys), nil), []string{
		`p.yaml:9: tenants.directory[0].key_sha256[0]: key ` + keyHash("sk-acme")[:8] + `… belongs to tenant "globex" in the keys file`})

	wantProblems(t, loadProblems(t, keysPolicy("  keys_file: "+filepath.Join(dir, "missing")), nil), []string{
		filepath.Join(dir, "missing") + ": tenants.keys_file: cannot read the keys file: no such file or directory"})
}

func TestKeyRuleProblems(t *testing.T) {
	for _, tc := range []struct {
		name, policy string
		want         []string
	}{
		{"untrusted", strings.Replace(keysPolicy(""), "api_key: true, trusted: true", "api_key: true", 1),
			[]string{"p.yaml:5: classification.tenant.rules[0].api_key: a tenant taken from a header is trusted only when the policy says so"}},
		{"strip without api_key", strings.Replace(keysPolicy(""), "{header: x-tenant-id, trusted: true}", "{header: x-tenant-id, trusted: true, strip_client_key: true}", 1),
			[]string{"p.yaml:6: classification.tenant.rules[1].strip_client_key: only api_key rules take strip_client_key"}},
		{"a key instead of its hash", strings.Replace(keysPolicy(""), keyHash("sk-acme"), "sk-acme", 1),
			[]string{"p.yaml:9: tenants.directory[0].key_sha256[0]: a SHA-256 is 64 hexadecimal digits, this is 7 characters"}},
		{"a key twice", strings.Replace(keysPolicy(""), "]}", ", "+strings.ToUpper(keyHash("sk-acme"))+"]}", 1),
			[]string{"p.yaml:9: tenants.directory[0].key_sha256[1]: key " + keyHash("sk-acme")[:8] + "… is listed already, at tenants.directory[0].key_sha256[0]"}},
		{"unknown answer", keysPolicy("  unknown_key: deny"), []string{`p.yaml:10: tenants.unknown_key: "deny" is not one of default, reject`}},
		{"keys without a rule", strings.Replace(keysPolicy("  unknown_key: reject"), "- {api_key: true, trusted: true, strip_client_key: true}", "- {metadata: {namespace: a, key: b}}", 1),
			[]string{"p.yaml:8: tenants.directory: tenants have key_sha256 but no classification.tenant rule reads API keys"}},
		{"a malformed header", strings.Replace(keysPolicy(""), "api_key: true,", "api_key: true, header: X-Key,", 1),
			[]string{`p.yaml:5: classification.tenant.rules[0].header: "X-Key" is not a lower-case header name`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantProblems(t, loadProblems(t, tc.policy, nil), tc.want)
		})
	}
	wantProblems(t, loadProblems(t, `features: {default: {max_concurrent: 10}}
classification: {feature: {rules: [{api_key: true}]}}`, nil), []string{"p.yaml:2: classification.feature.rules[0].api_key: only tenant rules can read API keys"})
}
