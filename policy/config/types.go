package config

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
)

// Amount is money in the policy's currency, written as an exact decimal ("1.00", "0.27",
// 20): at most six digits after the point, never rounded, never read through a float.
type Amount = money.Micros

// Duration is a time.Duration written in policy files as a Go duration string ("100ms", "5s",
// "1m30s"). A bare number is refused: "5" could mean seconds or nanoseconds, and a policy file
// must not be ambiguous.
type Duration time.Duration

// D returns the value as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// String formats the duration as a policy file would write it.
func (d Duration) String() string { return time.Duration(d).String() }

// UnmarshalText parses a duration string.
func (d *Duration) UnmarshalText(b []byte) error {
	s := strings.TrimSpace(string(b))
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q is not a duration (write it like 100ms, 5s or 1m30s)", s)
	}
	*d = Duration(v)
	return nil
}

// MarshalText writes the duration as a string.
func (d Duration) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// Size is a number of bytes written in policy files as a plain integer or with a unit:
// "512KiB", "8MiB", "1GiB" (powers of 1024) or "500KB", "8MB" (powers of 1000).
type Size int64

var sizeUnits = []struct {
	suffix string
	mult   int64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30},
	{"KB", 1000}, {"MB", 1000 * 1000}, {"GB", 1000 * 1000 * 1000},
	{"B", 1},
}

// UnmarshalText parses a size.
func (s *Size) UnmarshalText(b []byte) error {
	str := strings.TrimSpace(string(b))
	num, mult := str, int64(1)
	for _, u := range sizeUnits {
		if strings.HasSuffix(str, u.suffix) {
			num, mult = strings.TrimSpace(strings.TrimSuffix(str, u.suffix)), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n < 0 || n > (1<<62)/mult {
		return fmt.Errorf("%q is not a size (write it like 1048576, 512KiB or 8MiB)", str)
	}
	*s = Size(n * mult)
	return nil
}

// MarshalText writes the size with the largest exact binary unit.
func (s Size) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// String formats the size with the largest binary unit that divides it.
func (s Size) String() string {
	n := int64(s)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n != 0 && n%u.mult == 0 {
			return strconv.FormatInt(n/u.mult, 10) + u.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}
