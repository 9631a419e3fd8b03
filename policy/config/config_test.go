package config_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// TestInvalidFixtures loads every file in testdata/invalid: each names the problem it must
// produce in its "# want:" lines (file:line: key path: message, or a prefix of it).
func TestInvalidFixtures(t *testing.T) {
	files, err := filepath.Glob("testdata/invalid/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no fixtures: %v", err)
	}
	for _, path := range files {
		name := filepath.Base(path)
		t.Run(strings.TrimSuffix(name, ".yaml"), func(t *testing.T) {
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			var wants []string
			for _, line := range strings.Split(string(data), "\n") {
				if w, ok := strings.CutPrefix(line, "# want: "); ok {
					wants = append(wants, w)
				}
			}
			if len(wants) == 0 {
				t.Fatal("fixture has no # want: line")
			}
			_, err = config.Load(name, data, nil)
			var problems config.Errors
			if !errors.As(err, &problems) {
				t.Fatalf("Load() error = %v, want config.Errors", err)
			}
			for _, want := range wants {
				found := false
				for _, p := range problems {
					if strings.HasPrefix(p.String(), want) {
						found = true
					}
				}
				if !found {
					t.Errorf("missing problem\n want: %s\n got:\n%s", want, problems.Error())
				}
			}
		})
	}
}

func TestValidFixtures(t *testing.T) {
	files, _ := filepath.Glob("testdata/valid/*.yaml")
	for _, path := range files {
		t.Run(filepath.Base(path), func(t *testing.T) {
			if _, err := config.LoadFile(path, nil); err != nil {
				t.Fatalf("LoadFile() = %v", err)
			}
		})
	}
}

func TestExamplePolicyIsValid(t *testing.T) {
	p, err := config.Load("policy.yaml", examples.DefaultPolicy, nil)
	if err != nil {
		t.Fatalf("examples/policy.yaml does not load:\n%v", err)
	}
	chat := p.Resolve(p.Features["chat"].Limits)
	if chat.MaxConcurrent != 20 || chat.MaxWait != 5*time.Second {
		t.Errorf("chat = %d / %s, want 20 / 5s (the example policy's numbers)", chat.MaxConcurrent, chat.MaxWait)
	}
	batch := p.Resolve(p.Features["batch_summarize"].Limits)
	if batch.MaxConcurrent != 5 || batch.MaxWait != 100*time.Millisecond {
		t.Errorf("batch_summarize = %d / %s, want 5 / 100ms", batch.MaxConcurrent, batch.MaxWait)
	}
}

func TestEveryProblemAtOnce(t *testing.T) {
	// Given a file with three unrelated mistakes
	data := []byte(`
features:
  default:
    max_concurrent: -1
    mode: sometimes
server:
  log_level: loud
`)
	// When it is loaded
	_, err := config.Load("p.yaml", data, nil)
	// Then all three are reported, each at its line
	var problems config.Errors
	if !errors.As(err, &problems) || len(problems) != 3 {
		t.Fatalf("got %v, want 3 problems", err)
	}
	for _, p := range problems {
		if p.Line == 0 {
			t.Errorf("problem without a line: %s", p)
		}
	}
}

func TestEnvOverrides(t *testing.T) {
	base := []byte(`
features:
  default: {max_concurrent: 5, max_wait: 50ms}
  chat: {max_concurrent: 20, max_wait: 100ms}
`)
	tests := []struct {
		name    string
		env     []string
		check   func(*testing.T, *config.Policy)
		wantErr string
	}{
		{
			name: "nested scalar",
			env:  []string{"LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURRENT=30"},
			check: func(t *testing.T, p *config.Policy) {
				if got := *p.Features["chat"].MaxConcurrent; got != 30 {
					t.Errorf("chat max_concurrent = %d, want 30", got)
				}
			},
		},
		{
			name: "case insensitive and typed",
			env:  []string{"LLM_BULKHEAD_SERVER__LOG_LEVEL=debug", "LLM_BULKHEAD_ENVOY__FAILURE_MODE_ALLOW=true", "LLM_BULKHEAD_FEATURES__DEFAULT__MAX_WAIT=150ms"},
			check: func(t *testing.T, p *config.Policy) {
				if p.Server.LogLevel != "debug" || !p.Envoy.FailureModeAllow || p.Features["default"].MaxWait.D() != 150*time.Millisecond {
					t.Errorf("got log_level %q failure_mode_allow %v max_wait %s", p.Server.LogLevel, p.Envoy.FailureModeAllow, p.Features["default"].MaxWait)
				}
			},
		},
		{
			name: "not an override without a double underscore",
			env:  []string{"LLM_BULKHEAD_ADMIN_TOKEN=secret"},
			check: func(t *testing.T, p *config.Policy) {
				if p.Admin.TokenEnv != config.DefaultTokenEnv {
					t.Errorf("token_env = %q", p.Admin.TokenEnv)
				}
			},
		},
		{
			name:    "unknown key names the variable",
			env:     []string{"LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURENT=3"},
			wantErr: `<env>: features.chat.max_concurent: LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURENT: unknown key "max_concurent"`,
		},
		{
			name:    "wrong type names the variable",
			env:     []string{"LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURRENT=many"},
			wantErr: `<env>: features.chat.max_concurrent: LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURRENT: expected an integer or adaptive, got the string "many"`,
		},
		{
			name:    "invalid value after override",
			env:     []string{"LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURRENT=-2"},
			wantErr: `<env>: features.chat.max_concurrent: LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURRENT: must not be negative, got -2`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := config.Load("p.yaml", base, tt.env)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Load() error = %v\nwant it to contain %s", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, p)
		})
	}
}

func TestTemplateInheritance(t *testing.T) {
	data := []byte(`
templates:
  base: {max_wait: 1s, priority: 1, tokens_per_minute: 1000}
  interactive: {template: base, max_wait: 3s, priority: 10}
features:
  default: {template: base, max_concurrent: 2}
  chat: {template: interactive, max_concurrent: 20, tokens_per_minute: 5000}
envoy: {max_message_timeout: 10s}
`)
	p, err := config.Load("p.yaml", data, nil)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		feature  string
		wantWait time.Duration
		wantPrio int64
		wantTPM  int64
		wantConc int64
	}{
		{"default", time.Second, 1, 1000, 2},
		{"chat", 3 * time.Second, 10, 5000, 20},
	}
	for _, tt := range tests {
		t.Run(tt.feature, func(t *testing.T) {
			r := p.Resolve(p.Features[tt.feature].Limits)
			if r.MaxWait != tt.wantWait || r.Priority != tt.wantPrio || r.TokensPerMinute != tt.wantTPM || r.MaxConcurrent != tt.wantConc {
				t.Errorf("resolved %+v", r)
			}
		})
	}
}

func TestScaleNeverBelowOne(t *testing.T) {
	r := config.Resolved{MaxConcurrent: 5, TokensPerMinute: 20000, QueueDepth: 50}
	got := r.Scale(0.10)
	if got.MaxConcurrent != 1 || got.TokensPerMinute != 2000 || got.QueueDepth != 5 {
		t.Errorf("Scale(0.10) = %+v, want max_concurrent 1 (never below 1), tpm 2000, queue 5", got)
	}
	if unlimited := (config.Resolved{}).Scale(0.5); unlimited.MaxConcurrent != 0 {
		t.Errorf("an unset limit must stay unset, got %d", unlimited.MaxConcurrent)
	}
}

func TestSizeAndDuration(t *testing.T) {
	sizes := []struct {
		in   string
		want int64
	}{{"1024", 1024}, {"512KiB", 512 << 10}, {"8MiB", 8 << 20}, {"1GiB", 1 << 30}, {"2MB", 2_000_000}, {" 3 KiB ", 3 << 10}}
	for _, tt := range sizes {
		var s config.Size
		if err := s.UnmarshalText([]byte(tt.in)); err != nil || int64(s) != tt.want {
			t.Errorf("Size(%q) = %d, %v; want %d", tt.in, s, err, tt.want)
		}
	}
	for _, bad := range []string{"", "MiB", "-1", "1.5MiB", "8 megs", "99999999999999GiB"} {
		var s config.Size
		if err := s.UnmarshalText([]byte(bad)); err == nil {
			t.Errorf("Size(%q) accepted as %d", bad, s)
		}
	}
	if got := config.Size(8 << 20).String(); got != "8MiB" {
		t.Errorf("String() = %q", got)
	}
	var d config.Duration
	if err := d.UnmarshalText([]byte("1m30s")); err != nil || d.D() != 90*time.Second {
		t.Errorf("Duration = %s, %v", d, err)
	}
}

func TestStatusMatches(t *testing.T) {
	tests := []struct {
		pattern string
		status  int
		want    bool
	}{{"5xx", 503, true}, {"5xx", 429, false}, {"429", 429, true}, {"4xx", 404, true}, {"503", 502, false}}
	for _, tt := range tests {
		if got := config.StatusMatches(tt.pattern, tt.status); got != tt.want {
			t.Errorf("StatusMatches(%q, %d) = %v", tt.pattern, tt.status, got)
		}
	}
}

func TestMissingFile(t *testing.T) {
	_, err := config.LoadFile(filepath.Join(t.TempDir(), "nope.yaml"), nil)
	if err == nil || !strings.Contains(err.Error(), "nope.yaml: cannot read policy file") {
		t.Fatalf("err = %v", err)
	}
}
