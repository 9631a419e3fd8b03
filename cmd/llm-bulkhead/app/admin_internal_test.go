package app

import (
	"net"
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

// FuzzAdminHost: a Host is served without the token only when its host is localhost, an IP
// address or a listed name; every name ParseAdminHosts accepts is then served with any port,
// and a name under it is not.
func FuzzAdminHost(f *testing.F) {
	for _, s := range []string{"localhost:9090", "[::1]:80", "10.0.0.1", "evil.example", "LOCALHOST.", "[fe80::1%25eth0]:1", "::1", "a:b:c", "[", "]:", ""} {
		f.Add(s, "admin.example.com")
	}
	f.Fuzz(func(t *testing.T, host, list string) {
		bare := &App{adminHosts: map[string]bool{}}
		if bare.hostAllowed(host) && host != "" {
			h := normalHost(host)
			ip, _, _ := strings.Cut(h, "%")
			if h != "localhost" && net.ParseIP(ip) == nil {
				t.Fatalf("Host %q (%q) served without a listing", host, h)
			}
		}
		names, err := ParseAdminHosts(list)
		if err != nil {
			return
		}
		a := &App{adminHosts: map[string]bool{}}
		for _, n := range names {
			a.adminHosts[normalHost(n)] = true
		}
		for _, n := range names {
			if strings.Contains(n, ":") {
				continue // an IPv6 address, served anyway
			}
			if !a.hostAllowed(n+":8443") || !a.hostAllowed(strings.ToUpper(n)) {
				t.Fatalf("listed %q not served", n)
			}
			if sub := "evil." + n; !a.adminHosts[sub] && a.hostAllowed(sub) && net.ParseIP(sub) == nil {
				t.Fatalf("%q served for the listing %q", sub, n)
			}
		}
	})
}
