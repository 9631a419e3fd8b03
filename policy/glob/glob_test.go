package glob_test

import (
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/llm-bulkhead/llm-bulkhead/policy/glob"
)

func TestGlob(t *testing.T) {
	for _, tt := range []struct {
		pattern, s string
		want       bool
	}{
		{"*", "", true}, {"*", "anything", true}, {"a*b", "ab", true}, {"a*b", "axxb", true},
		{"a*b", "axxbc", false}, {"a?c", "abc", true}, {"a?c", "ac", false}, {"a?c", "aéc", true},
		{"*-mini", "gpt-4o-mini", true}, {"*-mini", "gpt-4o-mini-2", false}, {"a*b*c", "aXbYbZc", true},
		{"exact", "exact", true}, {"exact", "exactly", false}, {"", "", true}, {"", "x", false},
		// A `*` in the name is matched by a `*` of the pattern as a wildcard: a prices entry *
		// prices the models glob *-mini read as a name.
		{"*", "*-mini", true}, {"*-*", "*-mini", true}, {"a*", "a*b", true},
		{"?", "é", true}, {"??", "é", false}, {"?", "\xff", true},
		// A literal after a star is looked for ahead: found late, found only as a prefix of
		// what follows, not found at all.
		{"*anthropic.claude-*", "us.anthropic.claude-3-5-haiku", true}, {"*anthropic.claude-*", "local-llama-3.1-8b", false},
		{"*ab", "aab", true}, {"*ab", "aaa", false}, {"*a?", "xxaé", true}, {"*a", "", false}, {"x*ba*", "xbbbab", true},
	} {
		if got := glob.Match(tt.pattern, tt.s); got != tt.want {
			t.Errorf("Match(%q, %q) = %v, want %v", tt.pattern, tt.s, got, tt.want)
		}
	}
}

func TestMatchDoesNotAllocate(t *testing.T) {
	if n := testing.AllocsPerRun(100, func() { glob.Match("deepseek-*-?b", "deepseek-r1-7b") }); n != 0 {
		t.Fatalf("Match allocated %v times", n)
	}
}

// BenchmarkMatchLeadingStar: globs starting with a star, as the example policy's Bedrock
// models, against a name they do not match and one they do.
func BenchmarkMatchLeadingStar(b *testing.B) {
	for _, s := range []string{"local-llama-3.1-8b-instruct-q4", "us.anthropic.claude-3-5-haiku-20241022-v1:0"} {
		b.Run(s, func(b *testing.B) {
			for b.Loop() {
				glob.Match("*anthropic.claude-*", s)
				glob.Match("*amazon.nova-*", s)
			}
		})
	}
}

// FuzzGlob compares the glob with a regular-expression reference.
func FuzzGlob(f *testing.F) {
	f.Add("deepseek-*", "deepseek-chat")
	f.Add("qwen-?-*", "qwen-2-72b")
	f.Add("*a*b*", "xaxxbx")
	f.Add("", "")
	f.Add("*", "*x")
	f.Fuzz(func(t *testing.T, pattern, s string) {
		if !utf8.ValidString(pattern) || !utf8.ValidString(s) {
			return // the reference (a regular expression) only speaks UTF-8
		}
		var re strings.Builder
		re.WriteString("^")
		for _, c := range pattern {
			switch c {
			case '*':
				re.WriteString("(?s:.*)")
			case '?':
				re.WriteString("(?s:.)")
			default:
				re.WriteString(regexp.QuoteMeta(string(c)))
			}
		}
		re.WriteString("$")
		want := regexp.MustCompile(re.String()).MatchString(s)
		if got := glob.Match(pattern, s); got != want {
			t.Fatalf("Match(%q, %q) = %v, want %v", pattern, s, got, want)
		}
	})
}
