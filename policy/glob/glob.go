// Package glob matches the globs of a policy file — model names in the model map, the
// providers' model lists, breakers' model lists and prices — against names: `*` matches any run
// of bytes (none included), `?` exactly one character (one UTF-8 sequence; a byte that is not
// UTF-8 counts as one), and every other byte matches itself. There are no classes and no
// escapes: a model name never needs them.
//
// It imports only the standard library.
package glob

import "unicode/utf8"

// Match reports whether s matches pattern. It is linear in practice and never exponential
// (iterative, with one backtrack point), and does not allocate.
func Match(pattern, s string) bool {
	p, i := 0, 0
	star, mark := -1, 0
	for i < len(s) {
		switch {
		case p < len(pattern) && pattern[p] == '*':
			// Tried first: a `*` in the pattern is a wildcard even where s has a `*`.
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
			p = star + 1
			mark++
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
