// Package money holds amounts of money as the policy writes them and spend budgets count
// them: exact integers of millionths of the currency unit (Micros), parsed from decimals
// without passing through floating point, so that a price or budget means exactly what it
// says and no error accumulates in a sum.
//
// It is a value package: it imports only the standard library, so that the policy's
// configuration can read amounts without linking what spends them.
package money

import (
	"fmt"
	"strconv"
	"strings"
)

// Micros is an amount of money in millionths of the currency unit: 1_100_000 is 1.10.
type Micros int64

// Scale is the number of Micros in one currency unit.
const Scale = 1_000_000

// MaxAmount is the largest amount a policy may write (a trillion currency units): sums of a
// few of them cannot overflow.
const MaxAmount Micros = 1_000_000_000_000 * Scale

// ParseAmount reads an exact decimal amount in currency units: digits, optionally a point and
// at most six more digits ("1", "1.10", "0.000001", "+2.5"). Exponents, signs other than a
// leading plus, and more precision than a millionth are refused rather than rounded: a price
// or budget must mean exactly what it says.
func ParseAmount(s string) (Micros, error) {
	text := strings.TrimSpace(s)
	if strings.HasPrefix(text, "-") {
		return 0, fmt.Errorf("%q is negative; an amount is 0 or more", text)
	}
	whole, frac, _ := strings.Cut(strings.TrimPrefix(text, "+"), ".")
	if whole == "" && frac == "" || !digits(whole) || !digits(frac) {
		return 0, fmt.Errorf("%q is not an amount (write it like 1, 1.10 or 0.000001)", text)
	}
	frac = strings.TrimRight(frac, "0")
	if len(frac) > 6 {
		return 0, fmt.Errorf("%q is more precise than a millionth of the currency unit", text)
	}
	whole = strings.TrimLeft(whole, "0")
	if len(whole) > 13 {
		return 0, errTooLarge(text)
	}
	var w, f int64
	if whole != "" {
		w, _ = strconv.ParseInt(whole, 10, 64) // at most 13 digits: cannot fail
	}
	if w > int64(MaxAmount/Scale) {
		// Checked before scaling: 13 digits of whole units can overflow int64 as micros.
		return 0, errTooLarge(text)
	}
	if frac != "" {
		f, _ = strconv.ParseInt(frac+strings.Repeat("0", 6-len(frac)), 10, 64)
	}
	m := Micros(w*Scale + f)
	if m > MaxAmount {
		return 0, errTooLarge(text)
	}
	return m, nil
}

func errTooLarge(text string) error {
	return fmt.Errorf("%q is more than %s", text, MaxAmount)
}

func digits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// String writes the amount in currency units as money is written: at least two decimals, more
// only when it has them ("1.10", "12.00", "0.27", "0.000001", "-0.50").
func (m Micros) String() string {
	sign := ""
	u := uint64(m)
	if m < 0 {
		sign, u = "-", uint64(-m)
	}
	whole, frac := u/Scale, u%Scale
	f := strings.TrimRight(fmt.Sprintf("%06d", frac), "0")
	if len(f) < 2 {
		f += strings.Repeat("0", 2-len(f))
	}
	return sign + strconv.FormatUint(whole, 10) + "." + f
}

// Float returns the amount in currency units as a float, for metrics and JSON views only.
func (m Micros) Float() float64 { return float64(m) / Scale }

// UnmarshalText parses an amount with ParseAmount.
func (m *Micros) UnmarshalText(b []byte) error {
	v, err := ParseAmount(string(b))
	if err != nil {
		return err
	}
	*m = v
	return nil
}

// MarshalText writes the amount as String does.
func (m Micros) MarshalText() ([]byte, error) { return []byte(m.String()), nil }
