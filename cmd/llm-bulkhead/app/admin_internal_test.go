package app

import (
	"strings"
	"testing"
)

// FuzzBearerToken: a value is taken exactly when it is the Bearer scheme in any case, spaces and
// a token; the token is what follows the spaces, and writing it back in the canonical form
// reads the same token.
func FuzzBearerToken(f *testing.F) {
	for _, s := range []string{"Bearer t", "bearer t", "BEARER  t", "Bearer", "Bearer ", "Basic dXNlcg==", "Bearert", " Bearer t", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, h string) {
		token, ok := bearerToken(h)
		scheme, rest, spaced := strings.Cut(h, " ")
		want := spaced && strings.EqualFold(scheme, "bearer") && strings.TrimLeft(rest, " ") != ""
		if ok != want {
			t.Fatalf("%q: ok %v, want %v", h, ok, want)
		}
		if !ok {
			return
		}
		if token == "" || token[0] == ' ' || !strings.HasSuffix(h, token) {
			t.Fatalf("%q: token %q", h, token)
		}
		if again, ok := bearerToken("Bearer " + token); !ok || again != token {
			t.Fatalf("%q: token %q reads back as %q, %v", h, token, again, ok)
		}
	})
}
