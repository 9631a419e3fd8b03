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

// statePolicy gives the chat feature $5 and 10000 tokens a day; settings is the policy's state
// file settings (a line of YAML).
func statePolicy(concurrent int, settings string) string {
	return fmt.Sprintf(`classification:
  feature: {default: chat}
  provider: {default: p}
models:
  - {match: "*", provider: p}
prices:
  - {match: default, input_per_mtok: 1, output_per_mtok: 2}
features:
  chat: {max_concurrent: %d, spend_per_day: 5.00, tokens_per_day: 10000}
providers:
  p: {}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
%s
`, concurrent, settings)
}

// chatState is a state file's content in which chat has spent $1.25, with $0.25 more in
// flight, and 9000 tokens an hour before now, and spent $4 yesterday.
func chatState(now time.Time) statefile.State {
	now = now.UTC()
	start := time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, time.UTC)
	slot := 24 * time.Hour / 60
	return statefile.State{Currency: "USD", Spend: []spend.SavedWindow{
		{Budget: "feature/chat", Period: "day", Start: start, End: start.AddDate(0, 0, 1), Settled: 1_250_000, InFlight: 250_000},
		// Yesterday's window has ended: not restored.
		{Budget: "feature/chat", Period: "day", Start: start.AddDate(0, 0, -1), End: start, Settled: 4_000_000},
	}, Windows: []statefile.Window{{Compartment: "feature/chat", Family: "feature", Key: []string{"feature"}, Values: []string{"chat"},
		Kind: statefile.KindTokensPerDay, Slot: slot, Slots: statefile.Slots{{Index: now.Add(-time.Hour).UnixNano() / int64(slot), Amount: 9000}}}},
	}
}

// checkChat fails t unless a counts what chatState holds (restored: true) or nothing.
func checkChat(t *testing.T, a *app.App, restored bool, when string) {
	t.Helper()
	wantSpent, wantTokens := spend.Micros(1_500_000), int64(9000)
	if !restored {
		wantSpent, wantTokens = 0, 0
	}
	if got := chatSpent(t, a); got != wantSpent {
		t.Fatalf("chat spent %v %s, want %v", got, when, wantSpent)
	}
	if got := tokensUsed(t, a, "tokens_per_day"); got != wantTokens {
		t.Fatalf("chat's tokens_per_day counts %d %s, want %d", got, when, wantTokens)
	}
}

// checkChatFile fails t unless the state file holds what chatState holds that counts.
func checkChatFile(t *testing.T, path string) {
	t.Helper()
	st, err := statefile.Read(path)
	if err != nil {
		t.Fatal(err)
	}
	var day int64
	for _, w := range st.Windows {
		if w.Compartment == "feature/chat" && w.Kind == statefile.KindTokensPerDay {
			for _, c := range w.Slots {
				day += c.Amount
			}
		}
	}
	if day != 9000 || len(st.Spend) != 1 || st.Spend[0].Settled+st.Spend[0].InFlight != 1_500_000 {
		t.Fatalf("state file %s: %d tokens today, spend %+v", path, day, st.Spend)
	}
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

// tokensUsed returns what feature/chat's window of kind counts in a.
func tokensUsed(t *testing.T, a *app.App, kind string) int64 {
	t.Helper()
	for _, c := range a.Engine().Compartments() {
		if c.Name != "feature/chat" {
			continue
		}
		for _, b := range c.Budgets {
			if b.Kind == kind {
				return b.Used
			}
		}
	}
	t.Fatalf("feature/chat has no %s", kind)
	return 0
}

// TestStateFileRestoredAndKeptOnReload: the state file restores chat's tokens_per_day and spend
// before serving; a reload that changes limits keeps both; one that changes the state settings
// is refused (they apply on restart), by the name the policy gives them; shutdown writes both
// again. The file may be named by state.file, by its former name spend.state_file, or by the
// --state-file flag.
func TestStateFileRestoredAndKeptOnReload(t *testing.T) {
	for _, tc := range []struct {
		name, settings, interval string
		flag                     bool
	}{
		{name: "state.file", settings: "state: {file: %s, interval: %s}", interval: "state.interval"},
		{name: "spend.state_file", settings: "spend: {state_file: %s, state_interval: %s}", interval: "spend.state_interval"},
		{name: "flag", settings: "spend: {state_interval: %[2]s}", interval: "spend.state_interval", flag: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "policy.yaml")
			state := filepath.Join(dir, "state.json")
			pol := func(concurrent int, interval string) string {
				return statePolicy(concurrent, fmt.Sprintf(tc.settings, state, interval))
			}
			if err := os.WriteFile(path, []byte(pol(4, "10s")), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := statefile.Write(state, chatState(time.Now())); err != nil {
				t.Fatal(err)
			}
			o := app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: io.Discard}
			if tc.flag {
				o.StateFile = state
			}
			a, err := app.New(o)
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
			checkChat(t, a, true, "after the start")
			if err := os.WriteFile(path, []byte(pol(8, "10s")), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := a.Reload("test"); err != nil {
				t.Fatal(err)
			}
			checkChat(t, a, true, "after a reload")
			if err := os.WriteFile(path, []byte(pol(8, "1m")), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := a.Reload("test"); err == nil || !strings.Contains(err.Error(), tc.interval) {
				t.Fatalf("reload changing %s: %v", tc.interval, err)
			}
			a.Shutdown(context.Background())
			stopped = true
			checkChatFile(t, state)
		})
	}
}

// TestStateFileRefusedWithCluster: --state-file with a cluster backend is a configuration
// error: Redis keeps every budget there.
func TestStateFileRefusedWithCluster(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	pol := statePolicy(4, "cluster: {backend: redis, addresses: [\"127.0.0.1:1\"]}")
	if err := os.WriteFile(path, []byte(pol), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{},
		LogOutput: io.Discard, StateFile: filepath.Join(dir, "state.json")})
	var ce *app.ConfigError
	if !errors.As(err, &ce) || !strings.Contains(err.Error(), "--state-file") {
		t.Fatalf("New: %v, want a ConfigError naming --state-file", err)
	}
}

// TestStateFileOnError: a state file cut short starts every budget empty by default (the file
// kept aside); with state.on_error: refuse the start fails with an error naming the file, which
// stays where it was. A missing file is a first start either way, and a running process never
// reads the file again: a reload with the file damaged keeps what every budget counts, and the
// next write replaces the damaged file.
func TestStateFileOnError(t *testing.T) {
	setup := func(t *testing.T, onError string, cut bool) (policyPath, state string) {
		dir := t.TempDir()
		policyPath, state = filepath.Join(dir, "policy.yaml"), filepath.Join(dir, "state.json")
		settings := ""
		if onError != "" {
			settings = "state: {on_error: " + onError + "}"
		}
		if err := os.WriteFile(policyPath, []byte(statePolicy(4, settings)), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := statefile.Write(state, chatState(time.Now())); err != nil {
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
			LogOutput: io.Discard, StateFile: state})
		if err == nil {
			t.Cleanup(func() { a.Shutdown(context.Background()) })
		}
		return a, err
	}

	t.Run("empty", func(t *testing.T) {
		policyPath, state := setup(t, "", true)
		a, err := open(t, policyPath, state)
		if err != nil {
			t.Fatalf("New with a truncated state file and the default on_error: %v", err)
		}
		checkChat(t, a, false, "after a start with a file that could not be used")
		if aside, _ := filepath.Glob(state + ".bad-*"); len(aside) != 1 {
			t.Fatalf("the truncated file was not kept aside: %v", aside)
		}
	})
	t.Run("refuse", func(t *testing.T) {
		policyPath, state := setup(t, "refuse", true)
		before, _ := os.ReadFile(state)
		_, err := open(t, policyPath, state)
		var se *app.StateFileError
		if !errors.As(err, &se) || se.Path != state || !strings.Contains(err.Error(), state) || !strings.Contains(err.Error(), "corrupt") {
			t.Fatalf("New: %v, want a StateFileError naming %s and why", err, state)
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
		checkChat(t, a, false, "after a first start")
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
		if err := os.WriteFile(policyPath, []byte(statePolicy(8, "state: {on_error: refuse}")), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := a.Reload("test"); err != nil {
			t.Fatalf("reload with the state file damaged: %v", err)
		}
		checkChat(t, a, true, "after the reload: a reload must not read the file")
		a.Shutdown(context.Background())
		checkChatFile(t, state)
	})
}
