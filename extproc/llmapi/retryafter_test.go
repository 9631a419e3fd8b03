package llmapi

import (
	"testing"
	"time"
)

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	tests := []struct {
		in   string
		want time.Duration
	}{
		{"7", 7 * time.Second},
		{" 1.5 ", 1500 * time.Millisecond},
		{"0", 0},
		{"-3", 0},
		{"86401", 0},
		{"Fri, 02 Jan 2026 03:04:35 GMT", 30 * time.Second},
		{"Fri, 02 Jan 2026 03:00:00 GMT", 0}, // in the past
		{"soon", 0},
		{"", 0},
	}
	for _, tt := range tests {
		if got := ParseRetryAfter(tt.in, now); got != tt.want {
			t.Errorf("ParseRetryAfter(%q) = %s, want %s", tt.in, got, tt.want)
		}
	}
}

// FuzzParseRetryAfter: any header value gives a delay between 0 and a day.
func FuzzParseRetryAfter(f *testing.F) {
	for _, s := range []string{"7", "1e9", "NaN", "Inf", "Fri, 02 Jan 2026 03:04:35 GMT", "0x10"} {
		f.Add(s)
	}
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	f.Fuzz(func(t *testing.T, s string) {
		if d := ParseRetryAfter(s, now); d < 0 || d > 24*time.Hour {
			t.Fatalf("ParseRetryAfter(%q) = %s", s, d)
		}
	})
}
