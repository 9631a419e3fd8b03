// Package glob matches the globs of a policy file — model names in the model map, the
// providers' model lists, breakers' model lists and prices — against names: `*` matches any run
// of bytes (none included), `?` exactly one character (one UTF-8 sequence; a byte that is not
// UTF-8 counts as one), and every other byte matches itself. There are no classes and no
// escapes: a model name never needs them.
//
// It imports only the standard library.
package glob

import (
	"strings"
	"unicode/utf8"
)

// Match reports whether s matches pattern. It is linear in practice and never exponential
// (iterative, with one backtrack point), and does not allocate.
func Match(pattern, s string) bool {
	p, i := 0, 0
	star, mark := -1, 0
	for i < len(s) {
		switch {
		case p < len(pattern) && pattern[p] == '*':
			// Tried first: a `*` in the pattern is a wildcard even where s has a `*`.
			if p == len(pattern)-1 {
				return true // a trailing star takes the rest
			}
			star, mark = p, i
			p++
		case p < len(pattern) && pattern[p] == '?':
			_, size := utf8.DecodeRuneInString(s[i:])
			p++
			i += size
		case p < len(pattern) && pattern[p] == s[i]:
			p++
			i++
		case star >= 0:
			// The star takes one more byte, and then every byte up to the next one that can
			// start what follows it, when that is a literal: a name that does not contain it
			// costs one IndexByte, not a comparison at every position (`*anthropic.claude-*`
			// against each model falling through to a catch-all).
			p = star + 1
			mark++
			if p < len(pattern) && pattern[p] != '*' && pattern[p] != '?' {
				j := strings.IndexByte(s[mark:], pattern[p])
				if j < 0 {
					return false
				}
				mark += j
			}
			i = mark
		default:
			return false
		}
	}
	for p < len(pattern) && pattern[p] == '*' {
		p++
	}
	return p == len(pattern)
}
