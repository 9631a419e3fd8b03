package app_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// logLines returns the JSON log lines in logs whose msg is msg.
func logLines(t *testing.T, logs *syncbuf.Buffer, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(logs.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

var testBuild = app.BuildInfo{Version: "v1.2.3", Commit: "0123abcd", Modified: true, GoVersion: "go1.99.1", Tags: "vtprotobuf", OS: "linux", Arch: "amd64"}

// TestBuildInfoMetricAndStartLine: llm_bulkhead_build_info is 1 with the build's version, commit
// (-dirty for a modified tree), Go version and tags, and the start line names version and commit.
func TestBuildInfoMetricAndStartLine(t *testing.T) {
	logs := &syncbuf.Buffer{}
	a, err := app.New(app.Options{GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: logs, Build: testBuild})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	defer a.Shutdown(context.Background())

	mfs, err := a.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	at := -1
	for i, mf := range mfs {
		if mf.GetName() == "llm_bulkhead_build_info" {
			at = i
		}
	}
	if at < 0 || len(mfs[at].GetMetric()) != 1 {
		t.Fatal("llm_bulkhead_build_info is not one registered series")
	}
	found := mfs[at].GetMetric()[0]
	labels := map[string]string{}
	for _, l := range found.GetLabel() {
		labels[l.GetName()] = l.GetValue()
	}
	want := map[string]string{"version": "v1.2.3", "commit": "0123abcd-dirty", "go_version": "go1.99.1", "tags": "vtprotobuf"}
	for k, v := range want {
		if labels[k] != v {
			t.Errorf("label %s = %q, want %q", k, labels[k], v)
		}
	}
	if len(labels) != len(want) || found.GetGauge().GetValue() != 1 {
		t.Errorf("series = %v", found)
	}

	start := logLines(t, logs, "llm-bulkhead listening")
	if len(start) != 1 || start[0]["version"] != "v1.2.3" || start[0]["commit"] != "0123abcd-dirty" {
		t.Errorf("start line = %v", start)
	}
}

// TestReloadLogsEveryProblemInOrder: a reload refused for several problems logs each of them,
// in line order, each with the count, and keeps the running policy.
func TestReloadLogsEveryProblemInOrder(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte("features:\n  default: {max_concurrent: 3}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	logs := &syncbuf.Buffer{}
	a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: logs})
	if err != nil {
		t.Fatal(err)
	}
	broken := `features:
  default:
    max_concurrent: -3
    max_wait: soon
    max_concurent: 4
  batch:
    max_wait: 30s
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`
	if err := os.WriteFile(path, []byte(broken), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload("test"); err == nil {
		t.Fatal("a broken policy was applied")
	}
	got := logLines(t, logs, "policy reload refused; keeping the running policy")
	want := []string{path + ":3: features.default.max_concurrent", path + ":4: features.default.max_wait",
		path + ":5: features.default.max_concurent", path + ":7: features.batch.max_wait"}
	if len(got) != len(want) {
		t.Fatalf("%d lines, want %d: %v", len(got), len(want), got)
	}
	for i, w := range want {
		if pr, _ := got[i]["problem"].(string); !strings.HasPrefix(pr, w) || got[i]["problems"] != float64(len(want)) {
			t.Errorf("line %d = %v, want problem %s… of %d", i, got[i], w, len(want))
		}
	}
	if a.Engine().Compartments()[0].MaxConcurrent != 3 {
		t.Error("the running policy was replaced")
	}
	_ = a.Engine().Close(context.Background())
}

// TestNoLimitsWarnedAtStart: a policy that limits nothing (allowed by allow_empty) starts, with a
// warning that every request would be admitted; a policy with limits starts without it.
func TestNoLimitsWarnedAtStart(t *testing.T) {
	for body, warned := range map[string]bool{"allow_empty: true\n": true, "features: {default: {max_concurrent: 2}}\n": false} {
		path := filepath.Join(t.TempDir(), "policy.yaml")
		if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		logs := &syncbuf.Buffer{}
		a, err := app.New(app.Options{ConfigPath: path, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", Env: []string{}, LogOutput: logs})
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Start(); err != nil {
			t.Fatal(err)
		}
		a.Shutdown(context.Background())
		got := logLines(t, logs, app.NoLimitsWarning(&config.Policy{}))
		if (len(got) == 1) != warned || (warned && got[0]["level"] != "WARN") {
			t.Errorf("%q: warning lines %v, want warned = %v", body, got, warned)
		}
	}
}
