package app

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"
)

// The admin listener checks the Host of requests that read /admin/* or the dashboard without
// the admin token. A loopback listener serves them without a token, so a web page the operator
// visits could otherwise read them through DNS rebinding: its own name, re-resolved to
// 127.0.0.1, reaches the listener with that name as Host, and the browser lets the page read
// the answer. A rebinding needs a name the attacker controls, so a request is served when its
// Host is an IP address (what the kubelet and Prometheus send, and what a browser sends for a
// page opened at an address), localhost, or a name the operator listed
// (--admin-allowed-hosts). A request with the token is served whatever its Host: a page cannot
// know the token. /metrics, /healthz and /readyz, open without a token anyway, are not checked.

// ParseAdminHosts reads a comma-separated list of host names for Options.AdminAllowedHosts:
// names without a port (any port is accepted), in any case, a trailing dot ignored. Empty
// entries are skipped; IP addresses are accepted (they need no listing).
func ParseAdminHosts(s string) ([]string, error) {
	var out []string
	for _, h := range strings.Split(s, ",") {
		h = strings.TrimSpace(h)
		if h == "" {
			continue
		}
		name := strings.TrimSuffix(strings.ToLower(h), ".")
		if ip := net.ParseIP(strings.TrimSuffix(strings.TrimPrefix(name, "["), "]")); ip == nil && !validHostName(name) {
			return nil, fmt.Errorf("%q is not a host name: give names like admin.example.com, without a scheme, port or path (any port is accepted)", h)
		}
		out = append(out, name)
	}
	return out, nil
}

// validHostName reports whether name is made of DNS labels: letters, digits, '-' and '_'
// between dots.
func validHostName(name string) bool {
	if name == "" || len(name) > 253 {
		return false
	}
	for _, label := range strings.Split(name, ".") {
		if label == "" || len(label) > 63 {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

// normalHost is a Host header's host: without its port (digits after a colon) and the brackets
// of an IPv6 address, lower-case, without a trailing dot. A value of another form is returned
// whole, lower-cased: it is neither an IP address nor a listed name.
func normalHost(hostport string) string {
	host, port := hostport, ""
	if strings.HasPrefix(host, "[") {
		if end := strings.IndexByte(host, ']'); end > 0 {
			host, port = host[1:end], host[end+1:]
			if port != "" && port[0] != ':' {
				return strings.ToLower(hostport)
			}
			port = strings.TrimPrefix(port, ":")
		}
	} else if i := strings.LastIndexByte(host, ':'); i >= 0 && strings.IndexByte(host, ':') == i {
		host, port = host[:i], host[i+1:] // one colon: name:port (more are an IPv6 address without brackets)
	}
	if strings.Trim(port, "0123456789") != "" {
		return strings.ToLower(hostport)
	}
	return strings.TrimSuffix(strings.ToLower(host), ".")
}

// hostAllowed reports whether a request with Host hostport may read the admin API without the
// token (see above). An empty Host (HTTP/1.0) is no browser's.
func (a *App) hostAllowed(hostport string) bool {
	if hostport == "" {
		return true
	}
	host := normalHost(hostport)
	if host == "localhost" || a.adminHosts[host] {
		return true
	}
	ip, _, _ := strings.Cut(host, "%") // an IPv6 zone (%25eth0 in a URL)
	return net.ParseIP(ip) != nil
}

// refuseHost answers a request whose Host is not one of the listener's, and logs it at most
// once a minute: a DNS rebinding attempt, or a name missing from --admin-allowed-hosts.
func (a *App) refuseHost(w http.ResponseWriter, r *http.Request) {
	if ok, _ := a.hostRefused.Allow(a.opts.Clock.Now(), time.Minute); ok {
		a.log.Warn("admin request refused: its Host is not localhost, an IP address or a name in --admin-allowed-hosts "+
			"(a DNS rebinding attempt from a web page, or a name to add); further ones this minute are not logged",
			"host", r.Host, "path", r.URL.Path, "remote_addr", r.RemoteAddr)
	}
	writeJSON(w, http.StatusForbidden, map[string]string{"error": "this request's Host is not a name of the admin listener: " +
		"without the admin token, /admin/* and the dashboard answer only for localhost, an IP address, " +
		"or a name given with --admin-allowed-hosts"})
}
