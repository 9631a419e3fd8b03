package llmapi

import "math/bits"

// A streamed response repeats one event thousands of times with little
// changing between copies: a chat completions chunk differs from the one
// before only in the few bytes of its delta text, an Anthropic
// content_block_delta likewise, and a Responses API delta also in its
// sequence_number. Reading each copy from scratch spends most of the time on
// keys and values that are the same as last time.
//
// eventShape keeps the last event data that the scanner parsed in full, the
// template, and reads the next one against it: bytes the template has are
// compared as a block (assembly-accelerated), and only values known to vary,
// the holes, are scanned. An event that does not fit is parsed in full and
// becomes the new template, so a stream that moves on to another kind of
// event (from content deltas to the final usage, say) relearns at once.
//
// Why a fit gives exactly what a full parse would:
//
//   - Validity. The template is valid JSON. Each hole is one whole value in
//     it, and the event must have a valid value of the kind the hole allows
//     in the same place (a string for text, anything with optional leading
//     whitespace otherwise), with every other byte equal. Values are
//     self-delimiting tokens (a number, the one exception, is followed in the
//     template by a byte that ends any number, and that byte must follow it
//     in the event too), so the event tokenizes as the template does with
//     one value swapped for another, and JSON's grammar allows any value
//     where it allows one; nesting depth is passed on for the skipper's limit.
//   - Results. Member names, event types and usage numbers are never holes,
//     so which object member each value belongs to, which duplicate key wins,
//     the usage slots and the type all come out as they did for the
//     template. A hole is either a value nobody reads, which yields nothing
//     whatever it holds, or a string at a text path, which yields its
//     unescaped length when the template's copy of it counted (a later
//     duplicate key can discard it) and nothing otherwise. So the event's
//     content is the template's, less its holes' text, plus the event's.
//
// Which values may vary is learned: the template starts with no holes, and
// when an event differs from it inside a value that could be a hole, that
// value becomes one and reading goes on from there. Everything else that
// differs (a name, a type, a usage count, the structure) sends the event to
// the full parser. The candidates are the text strings and the values of
// members no path names in objects some path goes through: that is where
// the per-event fields of every format sit (ids, counters, logprobs,
// obfuscation padding), and a difference anywhere inside such a value makes
// all of it a hole.
type eventShape struct {
	doc   []byte    // the template; its buffer is kept across Reset
	ready bool      // doc and the fields below describe a template
	res   docResult // what the template yielded
	base  int64     // res.content less the text of counted text holes
	holes uint32    // bit k: toks[k] is a hole
	ntoks int
	toks  [maxShapeToks]shapeTok
}

// shapeTok is a value of the template that may become a hole.
type shapeTok struct {
	start, end int32 // its bytes in the template
	depth      int32 // containers around it, for the nesting limit
	text       bool  // a string at a text path; otherwise a value nobody reads
	counted    bool  // text that reached the template's content
	n          int32 // text: its unescaped length
}

// Limits of a template. Streamed events are a few hundred bytes; a larger
// one is parsed in full every time rather than held in memory.
const (
	maxShapeLen  = 2048
	maxShapeToks = 32
)

// fit reads b against the template. When b fits it returns the content b
// yields and true; its other results are sh.res. It reads b once, from the
// front, whatever it learns on the way.
func (sh *eventShape) fit(b []byte) (int64, bool) {
	if !sh.ready {
		return 0, false
	}
	t := sh.doc
	content := sh.base
	pos, tpos := 0, 0 // where b and the template are read
	holes := sh.holes // those not reached yet
	var sk skipper
	for {
		k, end := -1, len(t)
		if holes != 0 {
			k = bits.TrailingZeros32(holes)
			end = int(sh.toks[k].start)
		}
		if seg := t[tpos:end]; len(b)-pos >= len(seg) && string(b[pos:pos+len(seg)]) == string(seg) {
			pos += len(seg)
			if k < 0 {
				return content, pos == len(b)
			}
			holes &^= 1 << k
		} else {
			// A difference is allowed inside a value that may vary; that value
			// becomes a hole from here on. What precedes it was equal.
			if k = sh.widen(tpos, tpos+mismatch(b[pos:], seg)); k < 0 {
				return 0, false
			}
			if tok := &sh.toks[k]; tok.text && tok.counted {
				sh.base -= int64(tok.n)
				content -= int64(tok.n)
			}
			pos += int(sh.toks[k].start) - tpos
		}
		tok := &sh.toks[k]
		if pos >= len(b) {
			return 0, false
		}
		var ok bool
		if tok.text {
			var n int64
			if b[pos] != '"' {
				return 0, false
			}
			if pos, n, _, ok = scanString(b, pos+1); !ok {
				return 0, false
			}
			if tok.counted {
				content += n
			}
		} else if pos, ok = skipScalarOr(&sk, b, pos, int(tok.depth)); !ok {
			return 0, false
		}
		tpos = int(tok.end)
	}
}

// mismatch returns the index of the first byte where a and b differ, or the
// length of the shorter one.
func mismatch(a, b []byte) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// widen makes a hole of the value of the template, starting at or after
// from, that holds offset x or ends just before it (a longer number first
// differs at the byte after the template's), and returns its index; -1 when
// there is none that is not a hole already.
func (sh *eventShape) widen(from, x int) int {
	for k := range sh.ntoks {
		tok := &sh.toks[k]
		if int(tok.start) > x {
			break
		}
		if int(tok.start) >= from && x <= int(tok.end) && sh.holes&(1<<k) == 0 {
			sh.holes |= 1 << k
			return k
		}
	}
	return -1
}

// beginLearn starts recording the values of a document about to be parsed
// in full, or reports false when it is too large to become a template, in
// which case the current template stays.
func (sh *eventShape) beginLearn(b []byte) bool {
	if len(b) > maxShapeLen {
		return false
	}
	sh.ready = false
	sh.ntoks = 0
	return true
}

// value records a value the full parse met at b[start:end], nested inside
// depth containers; text is set for a string at a text path, with its
// unescaped length n.
func (sh *eventShape) value(start, end, depth int, text bool, n int64) {
	if sh.ntoks == maxShapeToks {
		return
	}
	sh.toks[sh.ntoks] = shapeTok{
		start: int32(start), end: int32(end), depth: int32(depth),
		text: text, counted: text, n: int32(n),
	}
	sh.ntoks++
}

// tokSpan is the run of recorded values under one member of an object.
type tokSpan struct {
	lo, hi uint8
	set    bool
}

// member notes that the value of an interesting member has been read, its
// values being those recorded from lo on. When the member's name repeats,
// the values under its earlier occurrence no longer count, as in the parse
// itself.
func (sh *eventShape) member(sp *tokSpan, lo int) {
	if sp.set {
		for k := sp.lo; k < sp.hi; k++ {
			sh.toks[k].counted = false
		}
	}
	*sp = tokSpan{lo: uint8(lo), hi: uint8(sh.ntoks), set: true}
}

// learn makes b, just parsed in full into d with recording on, the template.
func (sh *eventShape) learn(b []byte, d *docResult) {
	sh.doc = append(sh.doc[:0], b...)
	sh.res = *d
	sh.base = d.content
	sh.holes = 0
	sh.ready = true
}
