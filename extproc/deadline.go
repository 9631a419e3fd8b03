package extproc

import (
	"strings"
	"time"
)

// The headers that say how long a request's client waits for it. Envoy sets
// x-envoy-expected-rq-timeout-ms on the requests it sends upstream (the route's timeout, or the
// caller's x-envoy-upstream-rq-timeout-ms), so a gateway behind another Envoy — a sidecar, a
// front proxy — receives it; gRPC clients send their deadline as grpc-timeout. An edge Envoy
// strips x-envoy-* headers from external clients unless told to trust them.
const (
	headerExpectedTimeout = "x-envoy-expected-rq-timeout-ms"
	headerGRPCTimeout     = "grpc-timeout"
)

// requestTimeout returns how long the request's client waits for it, from the headers above
// (the shorter when both say), and false when neither says or what they say cannot be read: a
// malformed value changes nothing.
func (p *processor) requestTimeout() (time.Duration, bool) {
	var out time.Duration
	found := false
	if v, ok := p.Header(headerExpectedTimeout); ok {
		if d, ok := parseExpectedTimeout(v); ok {
			out, found = d, true
		}
	}
	if v, ok := p.Header(headerGRPCTimeout); ok {
		if d, ok := parseGRPCTimeout(v); ok && (!found || d < out) {
			out, found = d, true
		}
	}
	return out, found
}

// maxTimeout bounds what a timeout header can say: beyond it, no queue in this server waits
// anyway, and the sums below cannot overflow.
const maxTimeout = 100 * 365 * 24 * time.Hour

// parseExpectedTimeout reads x-envoy-expected-rq-timeout-ms: whole milliseconds in decimal.
// 0 means the route has no timeout (Envoy's convention for its timeout headers): no deadline.
func parseExpectedTimeout(v string) (time.Duration, bool) {
	ms, ok := parseDigits(strings.TrimSpace(v), 18)
	if !ok || ms == 0 {
		return 0, false
	}
	if ms > int64(maxTimeout/time.Millisecond) {
		return maxTimeout, true
	}
	return time.Duration(ms) * time.Millisecond, true
}

// parseGRPCTimeout reads gRPC's grpc-timeout: at most eight digits and a unit, H (hours),
// M (minutes), S (seconds), m (milliseconds), u (microseconds) or n (nanoseconds). 0 is a
// deadline already passed.
func parseGRPCTimeout(v string) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if len(v) < 2 {
		return 0, false
	}
	n, ok := parseDigits(v[:len(v)-1], 8)
	if !ok {
		return 0, false
	}
	var unit time.Duration
	switch v[len(v)-1] {
	case 'H':
		unit = time.Hour
	case 'M':
		unit = time.Minute
	case 'S':
		unit = time.Second
	case 'm':
		unit = time.Millisecond
	case 'u':
		unit = time.Microsecond
	case 'n':
		unit = time.Nanosecond
	default:
		return 0, false
	}
	// Eight digits of hours are beyond a Duration's range: cap.
	if time.Duration(n) > maxTimeout/unit {
		return maxTimeout, true
	}
	return time.Duration(n) * unit, true
}

// parseDigits reads a non-empty run of at most max ASCII digits, nothing else (no sign, no
// spaces).
func parseDigits(s string, max int) (int64, bool) {
	if s == "" || len(s) > max {
		return 0, false
	}
	var n int64
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}
