package llmapi

import (
	"encoding/binary"
	"math/bits"
	"unicode/utf8"
)

// This file holds the in-place scanner for complete JSON documents used by
// ScanRequest, Field and InjectIncludeUsage. It validates exactly what
// encoding/json's Valid accepts (including its nesting limit and its
// tolerance of invalid UTF-8 inside strings) so that "valid" means the same
// thing here as in the rest of the Go ecosystem, but it never builds values:
// strings are measured, not copied.

// maxDepth matches encoding/json's nesting limit, so documents it accepts are
// accepted here and deeper ones are rejected the same way.
const maxDepth = 10000

const (
	swarLSB = 0x0101010101010101
	swarMSB = 0x8080808080808080
)

// strSpecial returns the index of the first byte of b that ends a run of plain
// string bytes: '"', '\\' or a control character; len(b) when there is none.
// It tests eight bytes per step with the classic has-zero-byte trick, whose
// lowest flagged byte is always a true match (borrows only run upwards).
func strSpecial(b []byte) int {
	i := 0
	for ; i+16 <= len(b); i += 16 {
		x := binary.LittleEndian.Uint64(b[i:])
		y := binary.LittleEndian.Uint64(b[i+8:])
		mx := specialMask(x)
		my := specialMask(y)
		if mx|my != 0 {
			if mx != 0 {
				return i + bits.TrailingZeros64(mx)>>3
			}
			return i + 8 + bits.TrailingZeros64(my)>>3
		}
	}
	if i+8 <= len(b) {
		if m := specialMask(binary.LittleEndian.Uint64(b[i:])); m != 0 {
			return i + bits.TrailingZeros64(m)>>3
		}
		i += 8
	}
	for ; i < len(b); i++ {
		if c := b[i]; c == '"' || c == '\\' || c < 0x20 {
			return i
		}
	}
	return len(b)
}

// specialMask flags, in the top bit of each byte, the bytes of x that are '"',
// '\\' or below 0x20. Bytes above the lowest flagged one may be flagged
// falsely; only the lowest flag is used.
func specialMask(x uint64) uint64 {
	q := x ^ (swarLSB * '"')
	s := x ^ (swarLSB * '\\')
	return (((q - swarLSB) &^ q) | ((s - swarLSB) &^ s) | ((x - swarLSB*0x20) &^ x)) & swarMSB
}

// skipWS returns the index of the first non-whitespace byte at or after i.
func skipWS(b []byte, i int) int {
	for i < len(b) {
		c := b[i]
		if c > ' ' || (c != ' ' && c != '\n' && c != '\r' && c != '\t') {
			return i
		}
		i++
	}
	return i
}

// hexDigit maps a byte to its value as a hex digit, or to 0xff.
var hexDigit = func() (t [256]byte) {
	for i := range t {
		t[i] = 0xff
	}
	for c := '0'; c <= '9'; c++ {
		t[c] = byte(c - '0')
	}
	for c := 'a'; c <= 'f'; c++ {
		t[c] = byte(c - 'a' + 10)
		t[c-'a'+'A'] = byte(c - 'a' + 10)
	}
	return t
}()

func hexVal(c byte) rune {
	if v := hexDigit[c]; v != 0xff {
		return rune(v)
	}
	return -1
}

// hex4 decodes the four hex digits at b[i:i+4].
func hex4(b []byte, i int) (rune, bool) {
	if i+4 > len(b) {
		return 0, false
	}
	d0, d1, d2, d3 := hexDigit[b[i]], hexDigit[b[i+1]], hexDigit[b[i+2]], hexDigit[b[i+3]]
	if (d0|d1|d2|d3)&0xf0 != 0 {
		return 0, false
	}
	return rune(d0)<<12 | rune(d1)<<8 | rune(d2)<<4 | rune(d3), true
}

func isHighSurrogate(r rune) bool { return r >= 0xD800 && r < 0xDC00 }
func isLowSurrogate(r rune) bool  { return r >= 0xDC00 && r < 0xE000 }

// escapeByte maps the character after a backslash to the byte it stands for,
// or to 0 when JSON does not allow that escape (\u is handled separately).
var escapeByte = [256]byte{'"': '"', '\\': '\\', '/': '/', 'b': '\b', 'f': '\f', 'n': '\n', 'r': '\r', 't': '\t'}

// runeLen is utf8.RuneLen for the code points a \u escape can produce, with
// lone surrogates counted as the U+FFFD that encoding/json substitutes.
func runeLen(r rune) int {
	switch {
	case r < 0x80:
		return 1
	case r < 0x800:
		return 2
	default:
		return 3
	}
}

// plainByte marks the bytes that may appear unescaped inside a string.
var plainByte = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// scanString validates the string whose opening quote is at b[i-1]. It returns
// the index just past the closing quote, the length in bytes the string has
// once unescaped (the way encoding/json unescapes it, except that invalid
// UTF-8 is counted as the raw bytes it is), and whether it held escapes.
//
// The search for the next special byte is inlined here rather than calling
// strSpecial, because escape-heavy text (code, JSON in JSON) would otherwise
// pay a call and a fresh start per escape.
func scanString(b []byte, i int) (end int, n int64, esc bool, ok bool) {
	start := i
	var adj int64 // unescaped length minus raw length of the escapes so far
	for {
		// Find the next special byte, taking it from the word just tested
		// rather than loading it again.
		var c byte
		for {
			if i+8 <= len(b) {
				x := binary.LittleEndian.Uint64(b[i:])
				if m := specialMask(x); m != 0 {
					t := bits.TrailingZeros64(m)
					i += t >> 3
					c = byte(x >> (t &^ 7))
					break
				}
				i += 8
				continue
			}
			for i < len(b) && plainByte[b[i]] {
				i++
			}
			if i >= len(b) {
				return i, 0, esc, false
			}
			c = b[i]
			break
		}
		if c == '"' {
			return i + 1, int64(i-start) + adj, esc, true
		}
		if c != '\\' || i+1 >= len(b) {
			return i, 0, esc, false
		}
		esc = true
		if e := b[i+1]; e != 'u' {
			if escapeByte[e] == 0 {
				return i, 0, esc, false
			}
			adj--
			i += 2
			continue
		}
		r, ok := hex4(b, i+2)
		if !ok {
			return i, 0, esc, false
		}
		i += 6
		switch {
		case isHighSurrogate(r):
			// A pair decodes to 4 bytes; a lone half to U+FFFD's 3. The second
			// half, if malformed, is rejected on the next turn of the loop.
			if i+6 <= len(b) && b[i] == '\\' && b[i+1] == 'u' {
				if r2, ok := hex4(b, i+2); ok && isLowSurrogate(r2) {
					i += 6
					adj += 4 - 12
					continue
				}
			}
			adj += 3 - 6
		case isLowSurrogate(r):
			adj += 3 - 6
		default:
			adj += int64(runeLen(r)) - 6
		}
	}
}

// unescape appends the decoded form of raw, the validated bytes between a
// string's quotes, to dst. Invalid UTF-8 is copied through unchanged; lone
// surrogates become U+FFFD as in encoding/json.
func unescape(dst, raw []byte) []byte {
	for i := 0; i < len(raw); {
		k := i
		for k < len(raw) && raw[k] != '\\' {
			k++
		}
		dst = append(dst, raw[i:k]...)
		if k >= len(raw) {
			break
		}
		e := raw[k+1]
		if e != 'u' {
			dst = append(dst, escapeByte[e])
			i = k + 2
			continue
		}
		r, _ := hex4(raw, k+2)
		i = k + 6
		if isHighSurrogate(r) {
			if i+6 <= len(raw) && raw[i] == '\\' && raw[i+1] == 'u' {
				if r2, ok := hex4(raw, i+2); ok && isLowSurrogate(r2) {
					r = 0x10000 + (r-0xD800)<<10 + (r2 - 0xDC00)
					i += 6
				}
			}
		}
		if isHighSurrogate(r) || isLowSurrogate(r) {
			r = utf8.RuneError
		}
		dst = utf8.AppendRune(dst, r)
	}
	return dst
}

// number describes a validated JSON number token.
type number struct {
	end      int  // index after the token
	integer  bool // no fraction or exponent
	negative bool
	val      uint64 // magnitude when integer and it fits
	overflow bool   // magnitude does not fit in int64
}

// scanNumber validates the number starting at b[i].
func scanNumber(b []byte, i int) (number, bool) {
	var n number
	n.integer = true
	if i < len(b) && b[i] == '-' {
		n.negative = true
		i++
	}
	if i >= len(b) {
		return n, false
	}
	switch c := b[i]; {
	case c == '0':
		i++
	case c >= '1' && c <= '9':
		s := i
		var v uint64
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			v = v*10 + uint64(b[i]-'0')
			i++
		}
		// Up to 18 digits cannot overflow; longer runs are checked again the
		// slow way, which only absurd inputs reach.
		if i-s > 18 {
			v = 0
			for _, d := range b[s:i] {
				if v > (1<<63-1-uint64(d-'0'))/10 {
					n.overflow = true
					break
				}
				v = v*10 + uint64(d-'0')
			}
		}
		n.val = v
	default:
		return n, false
	}
	if i < len(b) && b[i] == '.' {
		n.integer = false
		i++
		s := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == s {
			return n, false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		n.integer = false
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		s := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == s {
			return n, false
		}
	}
	n.end = i
	return n, true
}

// scanLiteral validates true, false or null at b[i].
func scanLiteral(b []byte, i int) (int, bool) {
	var lit string
	switch b[i] {
	case 't':
		lit = "true"
	case 'f':
		lit = "false"
	case 'n':
		lit = "null"
	default:
		return i, false
	}
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return i, false
	}
	return i + len(lit), true
}

// skipper validates and skips whole values without recursion. Nesting below
// 64 levels is tracked in a register-sized bit set; deeper documents spill into
// a slice allocated on first use, so ordinary bodies cost no allocation while
// pathological ones are still handled in constant stack space.
type skipper struct {
	deep []uint64
}

// skip validates the value starting at or after b[i] (leading whitespace
// allowed), nested inside depth containers already, and returns the index
// just past it. Scalars, by far the most common values skipped, take a short
// path.
func (s *skipper) skip(b []byte, i, depth int) (int, bool) {
	i = skipWS(b, i)
	if i >= len(b) {
		return i, false
	}
	switch c := b[i]; c {
	case '"':
		end, _, _, ok := scanString(b, i+1)
		return end, ok
	case '{', '[':
		return s.skipContainer(b, i, depth)
	case 't', 'f', 'n':
		return scanLiteral(b, i)
	}
	return skipNumber(b, i)
}

// isObj reports whether level k (0-based, counted from the skipped value) is
// an object.
func (s *skipper) isObj(top uint64, k int) bool {
	if k < 64 {
		return top>>k&1 == 1
	}
	return s.deep[(k-64)>>6]>>(k&63)&1 == 1
}

// setLevel records the kind of level k.
func (s *skipper) setLevel(top *uint64, k int, obj bool) {
	var bit uint64
	if obj {
		bit = 1
	}
	if k < 64 {
		*top = *top&^(1<<k) | bit<<k
		return
	}
	w := (k - 64) >> 6
	if w >= len(s.deep) {
		s.deep = append(s.deep, make([]uint64, w+1-len(s.deep))...)
	}
	s.deep[w] = s.deep[w]&^(1<<(k&63)) | bit<<(k&63)
}

// skipContainer skips the object or array at b[i].
func (s *skipper) skipContainer(b []byte, i, depth int) (int, bool) {
	var top uint64 // bit k set: level k is an object
	n := 0         // containers open
	var ok bool
	for {
		// A value is due at i.
		i = skipWS(b, i)
		if i >= len(b) {
			return i, false
		}
		switch c := b[i]; c {
		case '{', '[':
			if depth+n+1 > maxDepth {
				return i, false
			}
			s.setLevel(&top, n, c == '{')
			n++
			i = skipWS(b, i+1)
			if i < len(b) && (b[i] == '}' && c == '{' || b[i] == ']' && c == '[') {
				n--
				i++
				break
			}
			if c == '{' {
				if i, ok = skipKey(b, i); !ok {
					return i, false
				}
			}
			continue
		case '"':
			if i, _, _, ok = scanString(b, i+1); !ok {
				return i, false
			}
		case 't', 'f', 'n':
			if i, ok = scanLiteral(b, i); !ok {
				return i, false
			}
		default:
			if i, ok = skipNumber(b, i); !ok {
				return i, false
			}
		}
		// A value ended at i; close containers until another value is due.
		for {
			if n == 0 {
				return i, true
			}
			i = skipWS(b, i)
			if i >= len(b) {
				return i, false
			}
			obj := s.isObj(top, n-1)
			c := b[i]
			if c == ',' {
				i++
				if obj {
					if i, ok = skipKey(b, i); !ok {
						return i, false
					}
				}
				break
			}
			if (obj && c == '}') || (!obj && c == ']') {
				n--
				i++
				continue
			}
			return i, false
		}
	}
}

// skipKey validates `"key" :` at or after b[i] and returns the index after the
// colon.
func skipKey(b []byte, i int) (int, bool) {
	i = skipWS(b, i)
	if i >= len(b) || b[i] != '"' {
		return i, false
	}
	i, _, _, ok := scanString(b, i+1)
	if !ok {
		return i, false
	}
	i = skipWS(b, i)
	if i >= len(b) || b[i] != ':' {
		return i, false
	}
	return i + 1, true
}

// objIter walks the members of one object in place. After next returns a
// member, the caller consumes the value starting at val and stores the index
// after it in it.i before calling next again.
type objIter struct {
	b     []byte
	i     int
	begun bool
	bad   bool
}

// openObject starts iterating the object whose '{' is at b[i].
func openObject(b []byte, i int) objIter {
	return objIter{b: b, i: i + 1}
}

// next returns the raw key (between the quotes), whether it holds escapes,
// and the index of its value. ok is false at the end of the object, after
// which it.i is just past the '}' unless it.bad reports a syntax error.
func (it *objIter) next() (key []byte, esc bool, val int, ok bool) {
	b := it.b
	i := it.i
	if i < len(b) && b[i] <= ' ' {
		i = skipWS(b, i)
	}
	if i >= len(b) {
		it.bad = true
		return nil, false, i, false
	}
	if it.begun {
		switch b[i] {
		case ',':
			i = skipWS(b, i+1)
		case '}':
			it.i = i + 1
			return nil, false, i, false
		default:
			it.bad = true
			return nil, false, i, false
		}
	} else {
		it.begun = true
		if b[i] == '}' {
			it.i = i + 1
			return nil, false, i, false
		}
	}
	if i >= len(b) || b[i] != '"' {
		it.bad = true
		return nil, false, i, false
	}
	end, _, esc, good := scanString(b, i+1)
	if !good {
		it.bad = true
		return nil, false, end, false
	}
	key = b[i+1 : end-1]
	i = skipWS(b, end)
	if i >= len(b) || b[i] != ':' {
		it.bad = true
		return nil, false, i, false
	}
	i = skipWS(b, i+1)
	if i >= len(b) {
		it.bad = true
		return nil, false, i, false
	}
	return key, esc, i, true
}

// keyBuf holds an unescaped key. Keys this package looks for are short, so a
// longer key cannot match and is reported as such without allocating.
type keyBuf [64]byte

// decodeKey returns key with escapes resolved when esc is set. Keys whose
// decoded form would not fit in buf come back empty-handed (ok=false): no key
// this package matches is that long.
func decodeKey(buf *keyBuf, key []byte, esc bool) ([]byte, bool) {
	if !esc {
		return key, true
	}
	return decodeEscapedKey(buf, key)
}

func decodeEscapedKey(buf *keyBuf, key []byte) ([]byte, bool) {
	if len(key) > 6*len(buf) {
		return nil, false
	}
	// Escapes only shrink a key (at most from 6 bytes to 3), so a raw key up to
	// six times the buffer may still fit; decode into a local slice first.
	var tmp [6 * len(keyBuf{})]byte
	out := unescape(tmp[:0], key)
	if len(out) > len(buf) {
		return nil, false
	}
	return buf[:copy(buf[:], out)], true
}

// skipNumber validates the number at b[i] and returns the index after it. It
// is scanNumber without the value, for the many numbers nobody reads.
func skipNumber(b []byte, i int) (int, bool) {
	if i < len(b) && b[i] == '-' {
		i++
	}
	if i >= len(b) {
		return i, false
	}
	switch c := b[i]; {
	case c == '0':
		i++
	case c >= '1' && c <= '9':
		i++
		for i < len(b) && b[i]-'0' <= 9 {
			i++
		}
	default:
		return i, false
	}
	if i < len(b) && b[i] == '.' {
		i++
		s := i
		for i < len(b) && b[i]-'0' <= 9 {
			i++
		}
		if i == s {
			return i, false
		}
	}
	if i < len(b) && b[i]|0x20 == 'e' {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		s := i
		for i < len(b) && b[i]-'0' <= 9 {
			i++
		}
		if i == s {
			return i, false
		}
	}
	return i, true
}
