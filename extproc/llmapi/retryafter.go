package llmapi

import (
	"net/http"
	"strconv"
	"strings"
	"time"
)

// ParseRetryAfter reads the retry-after header of a provider's response: delay seconds
// (fractions allowed) or an HTTP date, taken from now. A value that is neither, or a delay
// that is not positive or longer than a day, gives 0: no wait asked for.
func ParseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if secs, err := strconv.ParseFloat(v, 64); err == nil {
		if !(secs > 0 && secs <= 86400) { // also refuses NaN
			return 0
		}
		return time.Duration(secs * float64(time.Second))
	}
	if t, err := http.ParseTime(v); err == nil {
		if d := t.Sub(now); d > 0 && d <= 24*time.Hour {
			return d
		}
	}
	return 0
}
