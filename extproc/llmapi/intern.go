package llmapi

import (
	"hash/maphash"
	"sync/atomic"
	"unsafe"
)

// The intern table turns the short strings this package hands out (model
// names, user ids, classification values) into shared copies, so that the
// steady state of a gateway, which sees the same few values over and over,
// allocates nothing for them. It is a fixed-size, lossy, lock-free cache: a
// slot holds the last string hashed to it, a miss costs the copy that would
// have been made anyway, and memory is bounded by internSlots*internMaxLen.
const (
	internSlots  = 1024
	internMaxLen = 96
)

var (
	internSeed  = maphash.MakeSeed()
	internTable [internSlots]atomic.Pointer[string]
)

// intern returns string(b), shared when it is short enough to be cached. It is
// safe for concurrent use.
func intern(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	if len(b) > internMaxLen {
		return string(b)
	}
	slot := &internTable[maphash.Bytes(internSeed, b)&(internSlots-1)]
	if p := slot.Load(); p != nil && *p == string(b) {
		return *p
	}
	s := string(b)
	slot.Store(&s)
	return s
}

// internRaw interns the unescaped form of a string's raw bytes.
func internRaw(raw []byte, esc bool) string {
	if !esc {
		return intern(raw)
	}
	var buf [internMaxLen]byte
	return intern(unescape(buf[:0], raw))
}

// stringBytes returns s's bytes without copying them; they must not be written.
func stringBytes(s string) []byte { return unsafe.Slice(unsafe.StringData(s), len(s)) }
