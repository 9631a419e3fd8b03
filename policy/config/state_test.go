package config_test

import (
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

const stateBase = `classification: {provider: {default: a}}
providers:
  a: {max_concurrent: 4}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`

// TestStateDefaults: without a state section budgets stay in memory, written every 10s once a
// file is named; the environment can name the file.
func TestStateDefaults(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(stateBase), nil)
	if err != nil {
		t.Fatal(err)
	}
	if p.State.File != "" || p.State.Interval.D() != 10*time.Second || p.State.OnError != config.OnStateErrorEmpty ||
		p.Spend.AllowSingleOverrun {
		t.Fatalf("defaults: %+v, %+v", p.State, p.Spend)
	}
	p, err = config.Load("p.yaml", []byte(stateBase), []string{"LLM_BULKHEAD_STATE__FILE=/var/lib/llm-bulkhead/state.json",
		"LLM_BULKHEAD_STATE__INTERVAL=30s", "LLM_BULKHEAD_STATE__ON_ERROR=refuse", "LLM_BULKHEAD_SPEND__ALLOW_SINGLE_OVERRUN=true"})
	if err != nil {
		t.Fatal(err)
	}
	if p.State.File != "/var/lib/llm-bulkhead/state.json" || p.State.Interval.D() != 30*time.Second ||
		p.State.OnError != config.OnStateErrorRefuse || !p.Spend.AllowSingleOverrun {
		t.Fatalf("from the environment: %+v, %+v", p.State, p.Spend)
	}
}

// TestStateFormerNames: the keys the state file had under spend, when it kept spend only, still
// set it, from the file or the environment, and may repeat what the state section says.
func TestStateFormerNames(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		env  []string
	}{
		{yaml: "spend: {state_file: /var/lib/s.json, state_interval: 30s, on_state_error: refuse}\n"},
		{env: []string{"LLM_BULKHEAD_SPEND__STATE_FILE=/var/lib/s.json", "LLM_BULKHEAD_SPEND__STATE_INTERVAL=30s",
			"LLM_BULKHEAD_SPEND__ON_STATE_ERROR=refuse"}},
		{yaml: "spend: {state_file: /var/lib/s.json, state_interval: 30s, on_state_error: refuse}\n" +
			"state: {file: /var/lib/s.json, interval: 30s, on_error: refuse}\n"},
	} {
		p, err := config.Load("p.yaml", []byte(stateBase+tc.yaml), tc.env)
		if err != nil {
			t.Fatalf("%q %v: %v", tc.yaml, tc.env, err)
		}
		if p.State.File != "/var/lib/s.json" || p.State.Interval.D() != 30*time.Second || p.State.OnError != config.OnStateErrorRefuse {
			t.Fatalf("%q %v: state %+v", tc.yaml, tc.env, p.State)
		}
	}
}

// TestStateRefused: an interval out of bounds, a state file with a cluster backend (where Redis
// keeps every budget), an unknown on_error, and a former name that says otherwise than the new
// one are refused with the key named.
func TestStateRefused(t *testing.T) {
	for _, tc := range []struct{ yaml, want string }{
		{"state: {file: s.json, interval: 500ms}\n", "state.interval: must be from 1s to 1h0m0s, got 500ms"},
		{"state: {interval: 2h}\n", "state.interval: must be from 1s to 1h0m0s, got 2h0m0s"},
		{"spend: {state_interval: 2h}\n", "spend.state_interval: must be from 1s to 1h0m0s, got 2h0m0s"},
		{"state: {file: s.json}\ncluster: {backend: redis, addresses: [\"127.0.0.1:6379\"]}\n",
			"state.file: is set but cluster.backend shares every budget through Redis"},
		{"spend: {state_file: s.json}\ncluster: {backend: redis, addresses: [\"127.0.0.1:6379\"]}\n",
			"spend.state_file: is set but cluster.backend shares every budget through Redis"},
		{"state: {on_error: ignore}\n", `state.on_error: "ignore" is not one of empty, refuse`},
		{"spend: {on_state_error: ignore}\n", `spend.on_state_error: "ignore" is not one of empty, refuse`},
		{"spend: {state_file: a.json}\nstate: {file: b.json}\n", `spend.state_file: is "a.json" but state.file is "b.json": set state.file only`},
		{"spend: {state_interval: 5s}\nstate: {interval: 6s}\n", "spend.state_interval: is 5s but state.interval is 6s"},
		{"spend: {on_state_error: empty}\nstate: {on_error: refuse}\n", `spend.on_state_error: is "empty" but state.on_error is "refuse"`},
	} {
		_, err := config.Load("p.yaml", []byte(stateBase+tc.yaml), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error containing %q", tc.yaml, err, tc.want)
		}
	}
}
