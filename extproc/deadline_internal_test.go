package extproc

import (
	"strconv"
	"testing"
	"time"
)

func TestParseTimeoutHeaders(t *testing.T) {
	for _, tc := range []struct {
		v    string
		want time.Duration
		ok   bool
	}{
		{"500", 500 * time.Millisecond, true},
		{" 15000 ", 15 * time.Second, true},
		{"0", 0, false}, // the route has no timeout
		{"", 0, false},
		{"-5", 0, false},
		{"1.5", 0, false},
		{"5s", 0, false},
		{"999999999999999999", maxTimeout, true},
		{"9999999999999999999", 0, false}, // more digits than fit
	} {
		got, ok := parseExpectedTimeout(tc.v)
		if got != tc.want || ok != tc.ok {
			t.Errorf("x-envoy-expected-rq-timeout-ms %q: %s %v, want %s %v", tc.v, got, ok, tc.want, tc.ok)
		}
	}
	for _, tc := range []struct {
		v    string
		want time.Duration
		ok   bool
	}{
		{"1H", time.Hour, true},
		{"2M", 2 * time.Minute, true},
		{"3S", 3 * time.Second, true},
		{"400m", 400 * time.Millisecond, true},
		{"250u", 250 * time.Microsecond, true},
		{"99999999n", 99999999 * time.Nanosecond, true},
		{"0m", 0, true}, // a deadline already passed
		{"99999999H", maxTimeout, true},
		{"123456789S", 0, false}, // nine digits
		{"S", 0, false},
		{"10", 0, false},
		{"10s", 0, false},
		{"-1S", 0, false},
		{"", 0, false},
	} {
		got, ok := parseGRPCTimeout(tc.v)
		if got != tc.want || ok != tc.ok {
			t.Errorf("grpc-timeout %q: %s %v, want %s %v", tc.v, got, ok, tc.want, tc.ok)
		}
	}
}

// FuzzTimeoutHeaders: whatever a client sends, a timeout read is never negative nor beyond
// maxTimeout, and a value written the way Envoy or gRPC write it reads back.
func FuzzTimeoutHeaders(f *testing.F) {
	for _, s := range []string{"500", "0", "15000", "1H", "400m", "99999999n", "", "-1", "1e3", "9999999999999999999"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		for _, parse := range []func(string) (time.Duration, bool){parseExpectedTimeout, parseGRPCTimeout} {
			if d, ok := parse(v); ok && (d < 0 || d > maxTimeout) {
				t.Fatalf("%q read as %s", v, d)
			} else if !ok && d != 0 {
				t.Fatalf("%q refused but read as %s", v, d)
			}
		}
		if d, ok := parseExpectedTimeout(v); ok && d < maxTimeout {
			if back, ok := parseExpectedTimeout(strconv.FormatInt(d.Milliseconds(), 10)); !ok || back != d {
				t.Fatalf("%q: %s does not read back (%s %v)", v, d, back, ok)
			}
		}
	})
}
