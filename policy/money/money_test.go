package money_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
)

func TestParseAmount(t *testing.T) {
	tests := []struct {
		in      string
		want    money.Micros
		wantErr string
	}{
		{"1", 1_000_000, ""},
		{"1.10", 1_100_000, ""},
		{"1.1", 1_100_000, ""},
		{"0.27", 270_000, ""},
		{"0.000001", 1, ""},
		{"0.0000010", 1, ""},
		{".5", 500_000, ""},
		{"5.", 5_000_000, ""},
		{"+2.5", 2_500_000, ""},
		{"007.00", 7_000_000, ""},
		{" 3 ", 3_000_000, ""},
		{"0", 0, ""},
		{"1000000000000", money.MaxAmount, ""},
		{"1000000000000.000001", 0, "more than"},
		{"99999999999999", 0, "more than"},
		{"0.0000001", 0, "more precise"},
		{"-1", 0, "negative"},
		{"1e3", 0, "not an amount"},
		{"1,5", 0, "not an amount"},
		{"", 0, "not an amount"},
		{".", 0, "not an amount"},
		{"$1", 0, "not an amount"},
		{"1.2.3", 0, "not an amount"},
		{"NaN", 0, "not an amount"},
	}
	for _, tt := range tests {
		got, err := money.ParseAmount(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("ParseAmount(%q) = %v, %v; want error containing %q", tt.in, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ParseAmount(%q) = %d, %v; want %d", tt.in, got, err, tt.want)
		}
	}
}

func TestMicrosString(t *testing.T) {
	for _, tt := range []struct {
		m    money.Micros
		want string
	}{{0, "0.00"}, {1, "0.000001"}, {1_100_000, "1.10"}, {12_000_000, "12.00"}, {-500_000, "-0.50"}, {270_000, "0.27"}, {1_230_400, "1.2304"}} {
		if got := tt.m.String(); got != tt.want {
			t.Errorf("%d.String() = %q, want %q", int64(tt.m), got, tt.want)
		}
		if tt.m >= 0 {
			back, err := money.ParseAmount(tt.m.String())
			if err != nil || back != tt.m {
				t.Errorf("ParseAmount(%q) = %d, %v; want %d", tt.m.String(), back, err, tt.m)
			}
		}
	}
}

// FuzzParseAmount checks that every accepted amount is in range, prints back to text that
// parses to the same amount, and equals the decimal it was written as.
func FuzzParseAmount(f *testing.F) {
	// "9700000000000" overflowed int64 when scaled to micros, and came out negative.
	for _, s := range []string{"1", "1.10", "0.000001", "+2.5", "-1", "1e3", ".", "1000000000000", "0.0000001", " 7 ", "9700000000000"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		m, err := money.ParseAmount(s)
		if err != nil {
			return
		}
		if m < 0 || m > money.MaxAmount {
			t.Fatalf("ParseAmount(%q) = %d: out of range", s, m)
		}
		back, err := money.ParseAmount(m.String())
		if err != nil || back != m {
			t.Fatalf("ParseAmount(%q) = %d, but its String %q parses to %d, %v", s, m, m.String(), back, err)
		}
		// The value is the decimal written: compare with an independent reading of the digits.
		text := strings.TrimPrefix(strings.TrimSpace(s), "+")
		whole, frac, _ := strings.Cut(text, ".")
		frac = (frac + "000000")[:6]
		if strings.TrimRight(text[len(whole):], "0.") == "" {
			frac = "000000"
		}
		w, _ := strconv.ParseInt("0"+strings.TrimLeft(whole, "0"), 10, 64)
		fr, _ := strconv.ParseInt(frac, 10, 64)
		if want := money.Micros(w*1_000_000 + fr); want != m {
			t.Fatalf("ParseAmount(%q) = %d, want %d", s, m, want)
		}
	})
}
