package spend_test

import (
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// FuzzParseWindowKey: a window's key reads back as the window (its budget may hold "|"), and
// any text (a shared store's content) is read without a panic into a window whose key reads
// back the same.
func FuzzParseWindowKey(f *testing.F) {
	f.Add("tenant/acme", uint8(1), int64(1767225600), "tenant/acme|day|1767225600")
	f.Add("a|b", uint8(0), int64(-3600), "a|b|hour|-3600")
	f.Add("", uint8(2), int64(0), "|month|0")
	f.Add("x", uint8(3), int64(1), "x|week|1")
	f.Fuzz(func(t *testing.T, budget string, period uint8, start int64, key string) {
		if budget != "" {
			id := spend.WindowID{Budget: budget, Period: spend.Periods[int(period)%len(spend.Periods)], Start: start}
			if got, ok := spend.ParseWindowKey(id.Key()); !ok || got != id {
				t.Fatalf("ParseWindowKey(%q) = %+v, %v; want %+v", id.Key(), got, ok, id)
			}
		}
		id, ok := spend.ParseWindowKey(key)
		if !ok {
			return
		}
		if id.Budget == "" {
			t.Fatalf("ParseWindowKey(%q) took a window without a budget", key)
		}
		if again, ok := spend.ParseWindowKey(id.Key()); !ok || again != id {
			t.Fatalf("ParseWindowKey(%q) = %+v, whose key %q reads back as %+v, %v", key, id, id.Key(), again, ok)
		}
	})
}
