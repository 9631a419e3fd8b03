package app_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
	"github.com/llm-bulkhead/llm-bulkhead/policy/statefile"
)

// spendPolicy gives the chat feature $5 a day; interval is spend.state_interval.
func spendPolicy(concurrent int, interval string) string {
	return fmt.Sprintf(`classification:
  feature: {default: chat}
  provider: {default: p}
models:
  - {match: "*", provider: p}
prices:
  - {match: default, input_per_mtok: 1, output_per_mtok: 2}
features:
  chat: {max_concurrent: %d, spend_per_day: 5.00}
providers:
  p: {}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
spend: {state_interval: %s}
`, concurrent, interval)
}

func chatSpent(t *testing.T, a *app.App) spend.Micros {
	t.Helper()
	for _, b := range a.Engine().Snapshot().Spend(time.Now()).Budgets {
		if b.Budget == "feature/chat" && b.Period == "day" {
			return b.Spent
		}
	}
	t.Fatal("no daily budget for feature/chat")
	return 0
}

// TestSpendStateRestoredAndKeptOnReload: --spend-state restores chat's spend before serving; a
// reload that changes limits keeps it; one that changes the state settings is refused (they
// apply on restart); shutdown writes the file again.
func TestSpendStateRestoredAndKeptOnReload(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	state := filepath.Join(dir, "spend.json")
	if err := os.WriteFile(path, []byte(spendPolicy(4, "10s")), 0o644); err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	start := time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, time.UTC)
	if err := statefile.Write(state, statefile.State{Currency: "USD", Spend: []spend.SavedWindow{
		{Budget: "feature/chat", Period: "day", Start: start, End: start.AddDate(0, 0, 1), Settled: 1_250_000, InFlight: 250_000},
		// Yesterday's window has ended: not restored.
		{Budget: "feature/chat", Period: "day", Start: start.AddDate(0, 0, -1), End: start, Settled: 4_000_000},
	}}); err != nil {
		t.Fatal(err)
	}
	a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{},
		LogOutput: io.Discard, SpendState: state})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			a.Shutdown(context.Background())
		}
	})
	if got := chatSpent(t, a); got != 1_500_000 {
		t.Fatalf("chat spent %v after restore, want 1.5 (settled plus in flight)", got)
	}
	if err := os.WriteFile(path, []byte(spendPolicy(8, "10s")), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload("test"); err != nil {
		t.Fatal(err)
	}
	if got := chatSpent(t, a); got != 1_500_000 {
		t.Fatalf("chat spent %v after a reload, want 1.5", got)
	}
	if err := os.WriteFile(path, []byte(spendPolicy(8, "1m")), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload("test"); err == nil || !strings.Contains(err.Error(), "spend.state_interval") {
		t.Fatalf("reload changing spend.state_interval: %v", err)
	}
	a.Shutdown(context.Background())
	stopped = true
	st, err := statefile.Read(state)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Spend) != 1 || st.Spend[0].Settled+st.Spend[0].InFlight != 1_500_000 {
		t.Fatalf("state written at shutdown: %+v", st.Spend)
	}
}

// TestSpendStateRefusedWithCluster: --spend-state with a cluster backend is a configuration
// error: Redis keeps spend there.
func TestSpendStateRefusedWithCluster(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	pol := spendPolicy(4, "10s") + "cluster: {backend: redis, addresses: [\"127.0.0.1:1\"]}\n"
	if err := os.WriteFile(path, []byte(pol), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{},
		LogOutput: io.Discard, SpendState: filepath.Join(dir, "spend.json")})
	var ce *app.ConfigError
	if !errors.As(err, &ce) || !strings.Contains(err.Error(), "--spend-state") {
		t.Fatalf("New: %v, want a ConfigError naming --spend-state", err)
	}
}

// TestSpendStateOnError: a state file cut short starts every budget empty by default (the file
// kept aside); with spend.on_state_error: refuse the start fails with an error naming the file,
// which stays where it was. A missing file is a first start either way, and a running process
// never reads the file again: a reload with the file damaged keeps the spend it has, and the
// next write replaces the damaged file.
func TestSpendStateOnError(t *testing.T) {
	now := time.Now().UTC()
	start := time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, time.UTC)
	good := statefile.State{Currency: "USD", Spend: []spend.SavedWindow{
		{Budget: "feature/chat", Period: "day", Start: start, End: start.AddDate(0, 0, 1), Settled: 1_500_000}}}
	setup := func(t *testing.T, onError string, cut bool) (policyPath, state string) {
		dir := t.TempDir()
		policyPath, state = filepath.Join(dir, "policy.yaml"), filepath.Join(dir, "spend.json")
		pol := spendPolicy(4, "10s")
		if onError != "" {
			pol += "spend: {state_interval: 10s, on_state_error: " + onError + "}\n"
			pol = strings.Replace(pol, "spend: {state_interval: 10s}\n", "", 1)
		}
		if err := os.WriteFile(policyPath, []byte(pol), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := statefile.Write(state, good); err != nil {
			t.Fatal(err)
		}
		if cut {
			b, err := os.ReadFile(state)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(state, b[:len(b)/2], 0o600); err != nil {
				t.Fatal(err)
			}
		}
		return policyPath, state
	}
	open := func(t *testing.T, policyPath, state string) (*app.App, error) {
		a, err := app.New(app.Options{ConfigPath: policyPath, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{},
			LogOutput: io.Discard, SpendState: state})
		if err == nil {
			t.Cleanup(func() { a.Shutdown(context.Background()) })
		}
		return a, err
	}

	t.Run("empty", func(t *testing.T) {
		policyPath, state := setup(t, "", true)
		a, err := open(t, policyPath, state)
		if err != nil {
			t.Fatalf("New with a truncated state file and the default on_state_error: %v", err)
		}
		if got := chatSpent(t, a); got != 0 {
			t.Fatalf("chat spent %v, want 0: the file could not be used", got)
		}
		if aside, _ := filepath.Glob(state + ".bad-*"); len(aside) != 1 {
			t.Fatalf("the truncated file was not kept aside: %v", aside)
		}
	})
	t.Run("refuse", func(t *testing.T) {
		policyPath, state := setup(t, "refuse", true)
		before, _ := os.ReadFile(state)
		_, err := open(t, policyPath, state)
		var se *app.SpendStateError
		if !errors.As(err, &se) || se.Path != state || !strings.Contains(err.Error(), state) || !strings.Contains(err.Error(), "corrupt") {
			t.Fatalf("New: %v, want a SpendStateError naming %s and why", err, state)
		}
		if after, _ := os.ReadFile(state); !bytes.Equal(after, before) {
			t.Fatal("the state file was moved or changed by a refused start")
		}
	})
	t.Run("refuse, missing file", func(t *testing.T) {
		policyPath, state := setup(t, "refuse", false)
		if err := os.Remove(state); err != nil {
			t.Fatal(err)
		}
		a, err := open(t, policyPath, state)
		if err != nil {
			t.Fatalf("a first start (no state file yet) was refused: %v", err)
		}
		if got := chatSpent(t, a); got != 0 {
			t.Fatalf("chat spent %v", got)
		}
	})
	t.Run("refuse, damaged while running", func(t *testing.T) {
		policyPath, state := setup(t, "refuse", false)
		a, err := open(t, policyPath, state)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(state, []byte("{"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(policyPath, []byte(strings.Replace(spendPolicy(8, "10s"), "spend: {state_interval: 10s}", "spend: {state_interval: 10s, on_state_error: refuse}", 1)), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := a.Reload("test"); err != nil {
			t.Fatalf("reload with the state file damaged: %v", err)
		}
		if got := chatSpent(t, a); got != 1_500_000 {
			t.Fatalf("chat spent %v after the reload, want 1.5: a reload must not read the file", got)
		}
		a.Shutdown(context.Background())
		if st, err := statefile.Read(state); err != nil || len(st.Spend) != 1 || st.Spend[0].Settled != 1_500_000 {
			t.Fatalf("state written at shutdown: %+v, %v", st, err)
		}
	})
}
