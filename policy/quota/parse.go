// Package quota tracks what a hosted LLM API says is left of an account's quota — the
// x-ratelimit-* headers of OpenAI, Azure OpenAI and many OpenAI-compatible servers, and
// Anthropic's anthropic-ratelimit-* headers — so that admission can keep a request that the
// provider would refuse from being sent. It is a domain package: it imports only the standard
// library, and its Tracker takes the time from its caller.
//
// Imported by: package policy (each provider's Tracker) and extproc (which parses the response's
// headers).
package quota

import (
	"errors"
	"strconv"
	"strings"
	"time"
)

// Kind is one of a provider's quotas.
type Kind uint8

const (
	// Requests counts requests.
	Requests Kind = iota
	// Tokens counts tokens (for Anthropic, the most restrictive of its token limits).
	Tokens
	// InputTokens counts prompt tokens (Anthropic).
	InputTokens
	// OutputTokens counts completion tokens (Anthropic).
	OutputTokens
	numKinds
)

// String returns the kind's name as metrics and the admin API show it.
func (k Kind) String() string {
	return [numKinds]string{"requests", "tokens", "input_tokens", "output_tokens"}[k]
}

// Window is what one response said about one quota: how much of Limit is Remaining until
// Reset, when it is full again. A field the response did not send is zero, with its bit clear
// in Has.
type Window struct {
	Limit, Remaining int64
	Reset            time.Time
	Has              Fields
}

// Fields says which of a Window's fields a response sent.
type Fields uint8

const (
	HasLimit Fields = 1 << iota
	HasRemaining
	HasReset
)

// Reading is what one response said about the account's quotas.
type Reading struct {
	Windows [numKinds]Window
}

// Empty reports whether the response said nothing about any quota.
func (r *Reading) Empty() bool {
	for i := range r.Windows {
		if r.Windows[i].Has != 0 {
			return false
		}
	}
	return true
}

// Limits on what a header may say: beyond them a value is absurd (a provider's quota is not a
// million billion tokens, nor reset in a year), and is counted as malformed rather than
// believed.
const (
	MaxAmount = 1_000_000_000_000
	MaxReset  = 31 * 24 * time.Hour
)

// Errors a header's value can have.
var (
	ErrMalformed = errors.New("malformed value")
	ErrAbsurd    = errors.New("value out of range")
)

// ParseHeader reads one response header into r when it is a rate-limit header (name in lower
// case, as Envoy sends it): known is false for any other header. now dates relative resets. A
// known header with a malformed or absurd value changes nothing in r and returns the error.
//
//	x-ratelimit-{limit,remaining,reset}-{requests,tokens}                        OpenAI, Azure, compatible servers
//	anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}   Anthropic
//
// A reset is a duration as OpenAI writes them (6m0s, 1.5s, 20ms — Go's duration syntax), a
// number of seconds, or an RFC 3339 instant (Anthropic's); an instant in the past is now.
func ParseHeader(name, value string, now time.Time, r *Reading) (known bool, err error) {
	kind, field, ok := headerName(name)
	if !ok {
		return false, nil
	}
	w := &r.Windows[kind]
	value = strings.TrimSpace(value)
	switch field {
	case HasLimit, HasRemaining:
		n, err := strconv.ParseInt(value, 10, 64)
		switch {
		case err != nil:
			return true, ErrMalformed
		case n < 0 || n > MaxAmount:
			return true, ErrAbsurd
		}
		if field == HasLimit {
			w.Limit = n
		} else {
			w.Remaining = n
		}
	case HasReset:
		at, err := parseReset(value, now)
		if err != nil {
			return true, err
		}
		w.Reset = at
	}
	w.Has |= field
	return true, nil
}

// headerName tells which quota and field a header names.
func headerName(name string) (Kind, Fields, bool) {
	if rest, ok := strings.CutPrefix(name, "x-ratelimit-"); ok {
		field, rest, ok := strings.Cut(rest, "-")
		if !ok {
			return 0, 0, false
		}
		f, ok := fieldNamed(field)
		if !ok {
			return 0, 0, false
		}
		switch rest {
		case "requests":
			return Requests, f, true
		case "tokens":
			return Tokens, f, true
		}
		return 0, 0, false
	}
	if rest, ok := strings.CutPrefix(name, "anthropic-ratelimit-"); ok {
		i := strings.LastIndexByte(rest, '-')
		if i < 0 {
			return 0, 0, false
		}
		f, ok := fieldNamed(rest[i+1:])
		if !ok {
			return 0, 0, false
		}
		switch rest[:i] {
		case "requests":
			return Requests, f, true
		case "tokens":
			return Tokens, f, true
		case "input-tokens":
			return InputTokens, f, true
		case "output-tokens":
			return OutputTokens, f, true
		}
	}
	return 0, 0, false
}

func fieldNamed(s string) (Fields, bool) {
	switch s {
	case "limit":
		return HasLimit, true
	case "remaining":
		return HasRemaining, true
	case "reset":
		return HasReset, true
	}
	return 0, false
}

// parseReset reads a reset: a duration (Go's syntax, as OpenAI writes it), a number of
// seconds, or an RFC 3339 instant.
func parseReset(v string, now time.Time) (time.Time, error) {
	if v == "" {
		return time.Time{}, ErrMalformed
	}
	var d time.Duration
	if c := v[0]; c >= '0' && c <= '9' || c == '.' {
		if at, err := time.Parse(time.RFC3339Nano, v); err == nil {
			switch {
			case at.Before(now):
				return now, nil
			case at.Sub(now) > MaxReset:
				return time.Time{}, ErrAbsurd
			}
			return at, nil
		}
		if secs, err := strconv.ParseFloat(v, 64); err == nil {
			if secs < 0 || secs > MaxReset.Seconds() {
				return time.Time{}, ErrAbsurd
			}
			d = time.Duration(secs * float64(time.Second))
		} else if d, err = time.ParseDuration(v); err != nil {
			return time.Time{}, ErrMalformed
		}
	} else {
		return time.Time{}, ErrMalformed
	}
	if d < 0 || d > MaxReset {
		return time.Time{}, ErrAbsurd
	}
	return now.Add(d), nil
}
