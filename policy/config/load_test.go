package config_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// loadProblems loads data and returns its problems as strings, failing when it loads.
func loadProblems(t *testing.T, data string, env []string) []string {
	t.Helper()
	_, err := config.Load("p.yaml", []byte(data), env)
	var problems config.Errors
	if !errors.As(err, &problems) {
		t.Fatalf("Load() error = %v, want config.Errors", err)
	}
	out := make([]string, len(problems))
	for i, p := range problems {
		out[i] = p.String()
	}
	return out
}

// wantProblems checks that got has exactly one problem per want, in order, each starting with
// its want.
func wantProblems(t *testing.T, got, want []string) {
	t.Helper()
	ok := len(got) == len(want)
	for i := 0; ok && i < len(want); i++ {
		ok = strings.HasPrefix(got[i], want[i])
	}
	if !ok {
		t.Errorf("got %d problem(s):\n  %s\nwant %d, in this order, starting with:\n  %s",
			len(got), strings.Join(got, "\n  "), len(want), strings.Join(want, "\n  "))
	}
}

// TestEveryKindOfProblemInOneRun: an unknown key, a value of the wrong type, a negative limit and
// two waits Envoy would cut short are all reported by one load, ordered by line. Decoding
// problems used to end the run before validation, so this file reported only the unknown key.
func TestEveryKindOfProblemInOneRun(t *testing.T) {
	data := `envoy:
  message_timeout: 200ms
features:
  default:
    max_concurrent: 2
    max_wait: 1s
  embedding:
    max_concurrent: lots
  chat:
    max_concurent: 20
    max_concurrent: 20
  batch:
    max_concurrent: -1
    max_wait: 2s
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`
	wantProblems(t, loadProblems(t, data, nil), []string{
		`p.yaml:6: features.default.max_wait: 1s is not shorter than envoy.message_timeout (200ms)`,
		`p.yaml:8: features.embedding.max_concurrent: expected an integer or adaptive, got the string "lots"`,
		`p.yaml:10: features.chat.max_concurent: unknown key "max_concurent" (did you mean "max_concurrent"?)`,
		`p.yaml:13: features.batch.max_concurrent: must not be negative, got -1`,
		`p.yaml:14: features.batch.max_wait: 2s is not shorter than envoy.message_timeout (200ms)`,
	})
}

// TestEveryProblemCounted: an unknown key, a negative value and two bad max_waits (one that is not
// a duration, one Envoy would cut short) are four problems in line order, though three of them sit
// in one feature whose max_wait could not be decoded: a check of one value alone (the negative
// max_concurrent) does not read the failed max_wait, so it is not silenced with it.
func TestEveryProblemCounted(t *testing.T) {
	data := `features:
  default: {max_concurrent: 2}
  chat:
    max_concurrent: -3
    max_wait: soon
    max_concurent: 4
  batch:
    max_wait: 30s
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`
	wantProblems(t, loadProblems(t, data, nil), []string{
		`p.yaml:4: features.chat.max_concurrent: must not be negative, got -3`,
		`p.yaml:5: features.chat.max_wait: "soon" is not a duration`,
		`p.yaml:6: features.chat.max_concurent: unknown key "max_concurent" (did you mean "max_concurrent"?)`,
		`p.yaml:8: features.batch.max_wait: 30s is not shorter than envoy.message_timeout (200ms)`,
	})
}

// TestOneValueChecksBesideAFailedSibling: beside a key that could not be decoded, each check of
// one value against fixed bounds still reports, in every kind of entry that has such checks; the
// checks that read the entry's keys together stay silenced (see TestAFailedValueSilencesOnlyItsEntry).
func TestOneValueChecksBesideAFailedSibling(t *testing.T) {
	data := `server:
  drain_grace: soon
  log_level: loud
  max_streams: -1
envoy: {message_timeout: -1s, max_request_body: 512, request_body_mode: lots, max_message_timeout: x}
features:
  default: {max_concurrent: 1, queue_depth: -1, mode: sometimes, max_debt: 11, ratio: 2, max_wait: -1s, tokens_per_minute: x}
compartments:
  - {name: feature, key: [feature], limits_from: feature, max_instances: -1, idle_ttl: -1s, mode: x, where: 5}
pools:
  - name: Shared
    max_concurrent: 0
    members:
      - {compartment: feature/default, guaranteed: -1, max: lots}
      - {compartment: feature/default}
models:
  - {match: gpt-*, bytes_per_token: -1, context_tokens: -1, provider: 5}
estimation: {image_tokens: -1, learn_weight: x}
`
	wantProblems(t, loadProblems(t, data, nil), []string{
		`p.yaml:2: server.drain_grace: "soon" is not a duration`,
		`p.yaml:3: server.log_level: "loud" is not one of debug, info, warn, error`,
		`p.yaml:4: server.max_streams: must be between 1 and 1000000, got -1`,
		`p.yaml:5: envoy.message_timeout: must be positive`,
		`p.yaml:5: envoy.max_request_body: must be at least 1KiB, got 512 bytes`,
		`p.yaml:5: envoy.request_body_mode: "lots" is not one of NONE, BUFFERED, STREAMED, BUFFERED_PARTIAL`,
		`p.yaml:5: envoy.max_message_timeout: "x" is not a duration`,
		`p.yaml:7: features.default.queue_depth: must not be negative, got -1`,
		`p.yaml:7: features.default.mode: "sometimes" is not one of enforce, shadow`,
		`p.yaml:7: features.default.max_debt: must be in [0, 10]`,
		`p.yaml:7: features.default.ratio: must be in (0, 1], got 2`,
		`p.yaml:7: features.default.max_wait: must not be negative`,
		`p.yaml:7: features.default.tokens_per_minute: expected an integer, got the string "x"`,
		`p.yaml:9: compartments[0].max_instances: must be at least 1`,
		`p.yaml:9: compartments[0].idle_ttl: must not be negative`,
		`p.yaml:9: compartments[0].mode: "x" is not one of enforce, shadow`,
		`p.yaml:9: compartments[0].where: expected a mapping, got 5`,
		`p.yaml:11: pools[0].name: pool name "Shared" must be lower-case`,
		`p.yaml:12: pools[0].max_concurrent: a pool needs a capacity of at least 1`,
		`p.yaml:14: pools[0].members[0].guaranteed: must not be negative`,
		`p.yaml:14: pools[0].members[0].max: expected an integer, got the string "lots"`,
		`p.yaml:15: pools[0].members[1].compartment: feature/default is already a member of pool Shared`,
		`p.yaml:17: models[0].bytes_per_token: must not be negative`,
		`p.yaml:17: models[0].context_tokens: must not be negative`,
		`p.yaml:17: models[0].provider: expected a string, got 5`,
		`p.yaml:18: estimation.image_tokens: must not be negative`,
		`p.yaml:18: estimation.learn_weight: expected a number, got the string "x"`,
	})
}

// TestOverrideProblemsComeFirst: problems of environment overrides come before the file's,
// whatever the file is called (they used to be ordered by comparing "<env>" with the file name,
// so an absolute path put them last and a relative one first).
func TestOverrideProblemsComeFirst(t *testing.T) {
	data := `features:
  default: {max_concurrent: 1, max_concurent: 2}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`
	for _, name := range []string{"/etc/llm-bulkhead/policy.yaml", "policy.yaml", "0.yaml"} {
		_, err := config.Load(name, []byte(data), []string{"LLM_BULKHEAD_SERVER__LOG_LEVEL=loud"})
		var problems config.Errors
		if !errors.As(err, &problems) || len(problems) != 2 {
			t.Fatalf("%s: got %v, want 2 problems", name, err)
		}
		if problems[0].File != "<env>" || problems[1].File != name || problems[1].Line != 2 {
			t.Errorf("%s: problems in the wrong order:\n%s", name, problems.Error())
		}
	}
}

// TestAFailedValueSilencesOnlyItsEntry pins the rule for values that could not be decoded: the
// field stays zero, and validation problems about the entry holding it (the mapping or list item
// whose keys are checked together) are dropped, since they would describe that zero rather than
// the file. Problems in every other entry are still reported, and so are checks of one value
// alone in the same entry (TestOneValueChecksBesideAFailedSibling).
func TestAFailedValueSilencesOnlyItsEntry(t *testing.T) {
	const rest = `
features:
  default: {max_concurrent: 1}
  batch: {max_concurrent: -1}
`
	const family = `
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`
	negative := `features.batch.max_concurrent: must not be negative, got -1`
	tests := []struct {
		name string
		data string
		want []string
	}{
		{
			// Zero would be "a pool needs a capacity of at least 1".
			name: "pool capacity",
			data: `
pools:
  - name: shared
    max_concurrent: lots
    members:
      - {compartment: feature/default, guaranteed: 1}
      - {compartment: feature/batch, guaranteed: 1}` + family + rest,
			want: []string{
				`p.yaml:4: pools[0].max_concurrent: expected an integer, got the string "lots"`,
				`p.yaml:13: ` + negative,
			},
		},
		{
			// Nil limits would be "needs limits_from (…) or limits".
			name: "family limits",
			data: `
compartments:
  - {name: all, key: [feature], limits: 5}
  - {name: feature, key: [feature], limits_from: feature}` + rest,
			want: []string{
				`p.yaml:3: compartments[0].limits: expected a mapping, got 5`,
				`p.yaml:7: ` + negative,
			},
		},
		{
			// An empty header would be "a rule needs exactly one source".
			name: "rule source",
			data: `
classification:
  feature:
    rules:
      - header: 5
      - header: X-Feature` + family + rest,
			want: []string{
				`p.yaml:5: classification.feature.rules[0].header: expected a string, got 5`,
				`p.yaml:6: classification.feature.rules[1].header: "X-Feature" is not a lower-case header name`,
				`p.yaml:12: ` + negative,
			},
		},
		{
			// The default window of 100 would make minimum_calls 200 "over the window": a
			// sibling key, silenced with the whole breaker.
			name: "breaker sibling",
			data: `
providers:
  default: {breaker: std}
breakers:
  std: {sliding_window_size: lots, minimum_calls: 200}` + family + rest,
			want: []string{
				`p.yaml:5: breakers.std.sliding_window_size: expected an integer, got the string "lots"`,
				`p.yaml:11: ` + negative,
			},
		},
		{
			// A feature that is not a mapping still exists: the rule naming it is not told it
			// is unknown.
			name: "whole feature",
			data: `
classification:
  feature:
    rules:
      - {path_prefix: /v1/chat, value: chat}
features:
  chat: 5
  default: {max_concurrent: 1}
  batch: {max_concurrent: -1}` + family,
			want: []string{
				`p.yaml:7: features.chat: expected a mapping, got 5`,
				`p.yaml:9: ` + negative,
			},
		},
		{
			// A tenant id written as a number is an error once, not also "a tenant needs an
			// id"; the tenant after it is checked as usual.
			name: "list item",
			data: `
tenants:
  directory:
    - {id: 42, tier: free}
    - {id: acme, tier: gold}
tiers: {free: {max_concurrent: 1}}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant}
  - {name: feature, key: [feature], limits_from: feature}` + rest,
			want: []string{
				`p.yaml:4: tenants.directory[0].id: expected a string, got 42`,
				`p.yaml:5: tenants.directory[1].tier: tier "gold" is not in tiers (free)`,
				`p.yaml:12: ` + negative,
			},
		},
		{
			// The boundary of the rule: another entry that reads the hole sees its default,
			// and its message names the value it used.
			name: "other entries see the default",
			data: `
envoy: {message_timeout: 5}
features:
  default: {max_concurrent: 1, max_wait: 1s}` + family,
			want: []string{
				`p.yaml:2: envoy.message_timeout: 5 is not a duration`,
				`p.yaml:4: features.default.max_wait: 1s is not shorter than envoy.message_timeout (200ms)`,
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantProblems(t, loadProblems(t, tt.data, nil), tt.want)
		})
	}
}

// TestUnknownKeysInLineOrder: unknown keys come out as they are written, including several on
// one line, not in the order of their names.
func TestUnknownKeysInLineOrder(t *testing.T) {
	data := `zzz: 1
server: {log_levl: info}
features:
  default: {max_concurrent: 1, zeta: 1, alpha: 2}
aaa: 2
`
	wantProblems(t, loadProblems(t, data, nil), []string{
		`p.yaml:1: zzz: unknown key "zzz"`,
		`p.yaml:2: server.log_levl: unknown key "log_levl" (did you mean "log_level"?)`,
		`p.yaml:4: features.default.zeta: unknown key "zeta"`,
		`p.yaml:4: features.default.alpha: unknown key "alpha"`,
		`p.yaml:5: aaa: unknown key "aaa"`,
	})
}

// TestOverrideProblemsNameTheVariable: whatever an override breaks is blamed on the variable,
// even a key the file does not have or a list the override turned into a mapping, and file and
// override problems come out of one run.
func TestOverrideProblemsNameTheVariable(t *testing.T) {
	data := `features:
  default: {max_concurrent: 1, max_concurent: 2}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`
	got := loadProblems(t, data, []string{
		"LLM_BULKHEAD_FEATURS__CHAT__MAX_CONCURRENT=3",
		"LLM_BULKHEAD_COMPARTMENTS__0__NAME=x",
		"LLM_BULKHEAD_FEATURES__DEFAULT__MAX_WAIT=5",
		"LLM_BULKHEAD_SERVER__LOG_LEVEL={a: 1}",
		"LLM_BULKHEAD_SERVER____LOG_LEVEL=debug",
	})
	wantProblems(t, got, []string{
		`<env>: compartments: LLM_BULKHEAD_COMPARTMENTS__0__NAME: expected a list, got a mapping`,
		`<env>: features.default.max_wait: LLM_BULKHEAD_FEATURES__DEFAULT__MAX_WAIT: 5 is not a duration`,
		`<env>: featurs: LLM_BULKHEAD_FEATURS__CHAT__MAX_CONCURRENT: unknown key "featurs" (did you mean "features"?)`,
		`<env>: server..log_level: LLM_BULKHEAD_SERVER____LOG_LEVEL: has an empty level between double underscores`,
		`<env>: server.log_level: LLM_BULKHEAD_SERVER__LOG_LEVEL: must be a single value, not a YAML a mapping`,
		`p.yaml:2: features.default.max_concurent: unknown key "max_concurent" (did you mean "max_concurrent"?)`,
	})
}

// TestYAMLAsYAMLv3ReadsIt: the file is parsed once and walked by the loader itself, so anchors,
// aliases, merge keys and tags must mean what they mean to yaml.v3, and what yaml.v3 refuses
// is refused, without ending the run.
func TestYAMLAsYAMLv3ReadsIt(t *testing.T) {
	t.Run("anchors and merge keys", func(t *testing.T) {
		data := `templates:
  base: &base {max_wait: 100ms, priority: 1}
features:
  default:
    <<: *base
    max_concurrent: 3
  chat: {<<: [{priority: 5, mode: shadow}, *base], priority: 7, max_concurrent: *n}
  batch: {max_concurrent: &n 4}
compartments:
  - &fam {name: feature, key: [feature], limits_from: feature}
tenants:
  directory:
    - {id: 2024-01-01, tier: free}
tiers: {free: {}}
`
		_, err := config.Load("p.yaml", []byte(data), nil)
		if err == nil || !strings.Contains(err.Error(), `unknown anchor 'n'`) {
			t.Fatalf("an alias before its anchor: err = %v", err)
		}
		data = strings.Replace(data, "*n}\n  batch: {max_concurrent: &n 4}", "4}\n  batch: {max_concurrent: 4}", 1)
		p, err := config.Load("p.yaml", []byte(data), nil)
		if err != nil {
			t.Fatal(err)
		}
		def, chat := p.Features["default"], p.Features["chat"]
		if *def.Priority != 1 || def.MaxWait.D() != 100*time.Millisecond || *def.MaxConcurrent != 3 {
			t.Errorf("default = %+v, want base's priority and max_wait", def.Limits)
		}
		// Keys written win over merged ones, earlier merges over later ones.
		if *chat.Priority != 7 || *chat.Mode != "shadow" || chat.MaxWait.D() != 100*time.Millisecond {
			t.Errorf("chat = %+v", chat.Limits)
		}
		// An unquoted date is the text written, not a time.
		if id := p.Tenants.Directory[0].ID; id != "2024-01-01" {
			t.Errorf("tenant id = %q", id)
		}
	})
	t.Run("refused but the run goes on", func(t *testing.T) {
		data := `features:
  default:
    max_concurrent: 1
    max_concurrent: 2
  chat: {max_concurrent: !!int many, <<: 5}
  batch: {max_concurrent: -1, ? [a]: b}
  !!binary 0: {max_concurrent: 1}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`
		wantProblems(t, loadProblems(t, data, nil), []string{
			`p.yaml:4: invalid YAML: mapping key "max_concurrent" already defined at line 3`,
			"p.yaml:5: invalid YAML: cannot decode !!str `many` as a !!int",
			`p.yaml:5: invalid YAML: map merge requires map or sequence of maps as the value`,
			`p.yaml:6: features.batch.max_concurrent: must not be negative, got -1`,
			`p.yaml:6: invalid YAML: a key must be a name, not a list`,
			`p.yaml:7: invalid YAML: !!binary value contains invalid base64 data`,
		})
	})
	t.Run("excessive aliasing", func(t *testing.T) {
		data := "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
		prev := "a"
		for _, name := range []string{"b", "c", "d", "e", "f", "g", "h"} {
			data += name + ": &" + name + " [" + strings.Repeat("*"+prev+", ", 9) + "*" + prev + "]\n"
			prev = name
		}
		wantProblems(t, loadProblems(t, data, nil), []string{`p.yaml: invalid YAML: document contains excessive aliasing`})
		// Empty mappings merged into each other make no values, but still cost a walk each.
		data = "a: &a {}\n"
		prev = "a"
		for i := range 12 {
			name := fmt.Sprintf("m%d", i)
			data += name + ": &" + name + " {<<: [" + strings.Repeat("*"+prev+", ", 9) + "*" + prev + "]}\n"
			prev = name
		}
		wantProblems(t, loadProblems(t, data, nil), []string{`p.yaml: invalid YAML: document contains excessive aliasing`})
	})
}

// TestNumbersAreStrict: an integer key takes whole numbers only, a number key finite ones; the
// loader does not round 1.5 to 1 or accept NaN as a ratio.
func TestNumbersAreStrict(t *testing.T) {
	data := `features:
  default: {max_concurrent: 1e3, tokens_per_minute: 2.0}
  a: {max_concurrent: 1.5}
  b: {ratio: .nan}
  c: {tokens_per_day: 99999999999999999999}
  d: {max_wait: 1.5}
  e: {max_debt: true}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`
	wantProblems(t, loadProblems(t, data, nil), []string{
		`p.yaml:3: features.a.max_concurrent: expected an integer or adaptive, got 1.5`,
		`p.yaml:4: features.b.ratio: expected a finite number, got NaN`,
		`p.yaml:5: features.c.tokens_per_day: 1e+20 is out of range for an integer`,
		`p.yaml:6: features.d.max_wait: 1.5 is not a duration (write it with a unit, like 100ms or 5s)`,
		`p.yaml:7: features.e.max_debt: expected a number, got true`,
	})
	p, err := config.Load("p.yaml", []byte(strings.SplitAfter(data, "\n")[0]+strings.SplitAfter(data, "\n")[1]+
		"compartments:\n  - {name: feature, key: [feature], limits_from: feature}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if l := p.Features["default"]; *l.MaxConcurrent != 1000 || *l.TokensPerMinute != 2 {
		t.Errorf("default = %d / %d, want 1000 / 2", *l.MaxConcurrent, *l.TokensPerMinute)
	}
}

// TestProviderDefaultIsDefault: without classification.provider.default, requests no rule
// places go to the provider named "default" (not, say, the first provider in name order), so a
// policy whose providers do not include it is refused, and says which provider it looked for.
func TestProviderDefaultIsDefault(t *testing.T) {
	const providers = "features: {default: {max_concurrent: 1}}\nproviders:\n  alpha: {}\n"
	wantProblems(t, loadProblems(t, providers, nil), []string{
		`p.yaml: classification.provider.default: provider "default" is not in providers (alpha)`,
	})
	p, err := config.Load("p.yaml", []byte(providers+"  default: {}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Classification.Provider.Default; got != "default" {
		t.Errorf("classification.provider.default = %q, want default", got)
	}
}
