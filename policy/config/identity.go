package config

import (
	"fmt"
	"unicode"
	"unicode/utf8"
)

// MaxIdentityBytes is the longest value a classification dimension may have (a tenant id, a
// model name…). The server writes these values into request headers (x-bulkhead-compartment),
// Envoy's dynamic metadata, logs and metric labels; Envoy refuses a request whose headers grow
// past its limit (60 KiB by default), and no tenant id or model name needs more.
const MaxIdentityBytes = 256

// IdentityError says why a value cannot be a dimension's value.
type IdentityError struct {
	// At is the offset of the offending byte (the length for a value too long).
	At int
	// Len is the value's length in bytes.
	Len int
	// Rune is the control character found, or utf8.RuneError for bytes that are not UTF-8;
	// -1 for a value too long.
	Rune rune
}

func (e *IdentityError) Error() string {
	switch e.Rune {
	case -1:
		return fmt.Sprintf("%d bytes, more than %d", e.Len, MaxIdentityBytes)
	case utf8.RuneError:
		return fmt.Sprintf("bytes that are not UTF-8 at byte %d", e.At)
	}
	return fmt.Sprintf("control character %U at byte %d", e.Rune, e.At)
}

// CheckIdentity reports whether v can be the value of a classification dimension: at most
// MaxIdentityBytes of UTF-8 without control characters (U+0000–U+001F, U+007F–U+009F: among
// them NUL, CR and LF, which no HTTP header may carry, and tab, which would make an id look
// like another). Every value classification yields satisfies it, so every header, metadata
// field, log line and metric label made from one is valid. The empty string passes (it is
// "no value"). It does not allocate when v is valid.
func CheckIdentity(v string) error {
	if len(v) > MaxIdentityBytes {
		return &IdentityError{At: MaxIdentityBytes, Len: len(v), Rune: -1}
	}
	for i := 0; i < len(v); {
		c := v[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return &IdentityError{At: i, Len: len(v), Rune: rune(c)}
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(v[i:])
		if r == utf8.RuneError && size == 1 {
			return &IdentityError{At: i, Len: len(v), Rune: utf8.RuneError}
		}
		if unicode.IsControl(r) {
			return &IdentityError{At: i, Len: len(v), Rune: r}
		}
		i += size
	}
	return nil
}
