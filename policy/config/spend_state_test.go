package config_test

import (
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

const spendStateBase = `classification: {provider: {default: a}}
providers:
  a: {max_concurrent: 4}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`

// TestSpendStateDefaults: without a spend section spend stays in memory, written every 10s once
// a file is named; the environment can name the file.
func TestSpendStateDefaults(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(spendStateBase), nil)
	if err != nil {
		t.Fatal(err)
	}
	if p.Spend.StateFile != "" || p.Spend.StateInterval.D() != 10*time.Second || p.Spend.OnStateError != config.OnStateErrorEmpty ||
		p.Spend.AllowSingleOverrun {
		t.Fatalf("defaults: %+v", p.Spend)
	}
	p, err = config.Load("p.yaml", []byte(spendStateBase), []string{"LLM_BULKHEAD_SPEND__STATE_FILE=/var/lib/llm-bulkhead/spend.json",
		"LLM_BULKHEAD_SPEND__STATE_INTERVAL=30s", "LLM_BULKHEAD_SPEND__ON_STATE_ERROR=refuse", "LLM_BULKHEAD_SPEND__ALLOW_SINGLE_OVERRUN=true"})
	if err != nil {
		t.Fatal(err)
	}
	if p.Spend.StateFile != "/var/lib/llm-bulkhead/spend.json" || p.Spend.StateInterval.D() != 30*time.Second ||
		p.Spend.OnStateError != config.OnStateErrorRefuse || !p.Spend.AllowSingleOverrun {
		t.Fatalf("from the environment: %+v", p.Spend)
	}
}

// TestSpendStateRefused: an interval out of bounds, a state file with a cluster backend (where
// Redis keeps spend) and an unknown on_state_error are refused with the key named.
func TestSpendStateRefused(t *testing.T) {
	for _, tc := range []struct{ yaml, want string }{
		{"spend: {state_file: s.json, state_interval: 500ms}\n", "spend.state_interval: must be from 1s to 1h0m0s, got 500ms"},
		{"spend: {state_interval: 2h}\n", "spend.state_interval: must be from 1s to 1h0m0s, got 2h0m0s"},
		{"spend: {state_file: s.json}\ncluster: {backend: redis, addresses: [\"127.0.0.1:6379\"]}\n",
			"spend.state_file: is set but cluster.backend shares spend through Redis"},
		{"spend: {on_state_error: ignore}\n", `spend.on_state_error: "ignore" is not one of empty, refuse`},
	} {
		_, err := config.Load("p.yaml", []byte(spendStateBase+tc.yaml), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error containing %q", tc.yaml, err, tc.want)
		}
	}
}
