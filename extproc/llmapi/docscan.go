package llmapi

import (
	"encoding/binary"
	"math/bits"
)

// scanDoc reads a complete JSON document in place, recording what tree asks
// for into d, and reports whether the document is valid. It is the fast path
// of the response scan for events that arrive whole; jsonStream is the
// general path. On valid documents the two must agree exactly (duplicate keys
// as in a map, the same number and type rules), which the chunk-split fuzz
// test checks; on invalid ones only jsonStream's partial results count, so
// scanDoc's d is then meaningless.
func scanDoc(tree pathTree, b []byte, d *docResult) bool {
	return scanDocRec(tree, b, d, nil)
}

// scanDocRec is scanDoc that also records, when rec is not nil, the values
// an eventShape may let vary.
func scanDocRec(tree pathTree, b []byte, d *docResult, rec *eventShape) bool {
	ds := docScan{tree: tree, b: b, d: d, rec: rec}
	i := skipWS(b, 0)
	if i >= len(b) {
		return false
	}
	end, c, ok := ds.value(1, i, 0)
	if !ok || skipWS(b, end) != len(b) {
		return false
	}
	d.content = c
	return true
}

type docScan struct {
	tree pathTree
	b    []byte
	d    *docResult
	skip skipper
	kb   keyBuf // scratch for escaped member names, shared to avoid zeroing it per object
	rec  *eventShape
}

// value reads the value at b[i] (not whitespace) for node n, inside depth
// containers, and returns the index after it and its generated-text length.
// Recursion follows the tree, which is at most maxTrack deep; everything
// below is skipped without recursion.
func (ds *docScan) value(n uint8, i, depth int) (int, int64, bool) {
	b := ds.b
	node := &ds.tree[n]
	switch c := b[i]; {
	case c == '{' && node.kind == nodeObject:
		if node.mark {
			ds.d.has |= 1 << (errPresentShift + node.slot)
		}
		return ds.object(node, i, depth)
	case c == '[' && node.kind == nodeArray:
		return ds.array(node, i, depth)
	case c == '"' && node.kind == nodeText:
		end, l, _, ok := scanString(b, i+1)
		if ds.rec != nil && ok {
			ds.rec.value(i, end, depth, true, l)
		}
		return end, l, ok
	case c == '"' && node.kind == nodeType:
		end, _, esc, ok := scanString(b, i+1)
		if !ok {
			return end, 0, false
		}
		ds.setType(b[i+1:end-1], esc)
		return end, 0, true
	case c == '"' && node.kind == nodeErr:
		end, _, esc, ok := scanString(b, i+1)
		if !ok {
			return end, 0, false
		}
		ds.d.has |= errClassBit(errCodeClass(b[i+1:end-1], esc), node.slot)
		return end, 0, true
	case node.kind == nodeNumber && (c == '-' || (c >= '0' && c <= '9')):
		num, ok := scanNumber(b, i)
		if !ok {
			return i, 0, false
		}
		if num.integer && !num.negative && !num.overflow && num.val <= maxCount {
			ds.d.vals[node.slot] = int64(num.val)
			ds.d.has |= 1 << node.slot
		}
		return num.end, 0, true
	case node.kind == nodeMillis && (c == '-' || (c >= '0' && c <= '9')):
		num, ok := scanNumber(b, i)
		if !ok {
			return i, 0, false
		}
		if ms, ok := millisOf(b[i:num.end]); ok {
			ds.d.vals[node.slot] = ms
			ds.d.has |= 1 << node.slot
		}
		return num.end, 0, true
	}
	end, ok := ds.skip.skip(b, i, depth)
	return end, 0, ok
}

func (ds *docScan) object(node *pathNode, i, depth int) (int, int64, bool) {
	if depth+1 > maxDepth {
		return i, 0, false
	}
	var (
		contrib [maxKids]int64
		spans   [maxKids]tokSpan // for rec
		ok      bool
		esc     bool
	)
	b := ds.b
	// The member loop is written out here, with the short-string check
	// inlined, because it runs once per member of every interesting object
	// and calls dominate its cost.
	i++
	if byteAt(b, i) <= ' ' {
		i = skipWS(b, i)
	}
	if byteAt(b, i) == '}' {
		return i + 1, 0, true
	}
	for {
		if byteAt(b, i) != '"' {
			return i, 0, false
		}
		ks := i + 1
		esc = false
		if e := plainEnd(b, ks); e > 0 {
			i = e
		} else if i, _, esc, ok = scanString(b, ks); !ok {
			return i, 0, false
		}
		key := b[ks : i-1]
		if byteAt(b, i) != ':' {
			if i = skipWS(b, i); byteAt(b, i) != ':' {
				return i, 0, false
			}
		}
		i++
		if byteAt(b, i) <= ' ' {
			if i = skipWS(b, i); i >= len(b) {
				return i, 0, false
			}
		}
		k := -1
		if !esc {
			k = node.lookup(key)
		} else if dk, ok := decodeKey(&ds.kb, key, esc); ok {
			k = node.lookup(dk)
		}
		if k < 0 {
			v := i
			switch c := b[i]; {
			case c == '"':
				if e := plainEnd(b, i+1); e > 0 {
					i, ok = e, true
				} else {
					i, _, _, ok = scanString(b, i+1)
				}
			case c == 'n':
				if ok = i+4 <= len(b) && string(b[i:i+4]) == "null"; ok {
					i += 4
				}
			case c >= '0' && c <= '9' || c == '-':
				i, ok = skipNumber(b, i)
			default:
				i, ok = skipScalarOr(&ds.skip, b, i, depth+1)
			}
			if ds.rec != nil && ok {
				ds.rec.value(v, i, depth+1, false, 0)
			}
		} else {
			child := node.kids[k]
			ds.d.has &^= ds.tree[child].clear
			if ds.tree[child].kind == nodeType {
				ds.d.typeSet, ds.d.typeLen, ds.d.typeOver = false, 0, false
			}
			var c int64
			lo := 0
			if ds.rec != nil {
				lo = ds.rec.ntoks
			}
			i, c, ok = ds.value(child, i, depth+1)
			contrib[k] = c
			if ds.rec != nil {
				ds.rec.member(&spans[k], lo)
			}
		}
		if !ok {
			return i, 0, false
		}
		if byteAt(b, i) <= ' ' {
			i = skipWS(b, i)
		}
		switch byteAt(b, i) {
		case ',':
			i++
			if byteAt(b, i) <= ' ' {
				i = skipWS(b, i)
			}
			continue
		case '}':
			var total int64
			for _, c := range contrib {
				total += c
			}
			return i + 1, total, true
		}
		return i, 0, false
	}
}

func (ds *docScan) array(node *pathNode, i, depth int) (int, int64, bool) {
	if depth+1 > maxDepth {
		return i, 0, false
	}
	b := ds.b
	var sum int64
	i = skipWS(b, i+1)
	if i < len(b) && b[i] == ']' {
		return i + 1, 0, true
	}
	for {
		if i >= len(b) {
			return i, 0, false
		}
		end, c, ok := ds.value(node.elem, i, depth+1)
		if !ok {
			return end, 0, false
		}
		sum += c
		i = skipWS(b, end)
		if i >= len(b) {
			return i, 0, false
		}
		switch b[i] {
		case ',':
			i = skipWS(b, i+1)
			continue
		case ']':
			return i + 1, sum, true
		}
		return i, 0, false
	}
}

// setType records the document type the way jsonStream does: unescaped, and
// marked as not fitting when longer than its buffer.
func (ds *docScan) setType(raw []byte, esc bool) {
	d := ds.d
	d.typeSet = true
	if !esc {
		if len(raw) > len(d.typeBuf) {
			d.typeOver = true
			return
		}
		d.typeLen = uint8(copy(d.typeBuf[:], raw))
		return
	}
	var buf [6 * len(docResult{}.typeBuf)]byte
	if len(raw) > len(buf) {
		d.typeOver = true
		return
	}
	out := unescape(buf[:0], raw)
	if len(out) > len(d.typeBuf) {
		d.typeOver = true
		return
	}
	d.typeLen = uint8(copy(d.typeBuf[:], out))
}

// errCodeClass classifies an error code string as jsonStream does: unescaped,
// and unknown when longer than maxErrCode.
func errCodeClass(raw []byte, esc bool) int {
	if !esc {
		return classifyErrorCode(raw)
	}
	var buf [6 * maxErrCode]byte
	if len(raw) > len(buf) {
		return errUnknown
	}
	return classifyErrorCode(unescape(buf[:0], raw))
}

// skipScalarOr skips the value at b[i], handling the scalars that make up
// most of what is skipped here before falling back to the skipper.
func skipScalarOr(sk *skipper, b []byte, i, depth int) (int, bool) {
	switch c := b[i]; {
	case c == '"':
		end, _, _, ok := scanString(b, i+1)
		return end, ok
	case c == '-' || (c >= '0' && c <= '9'):
		return skipNumber(b, i)
	case c == 'n' || c == 't' || c == 'f':
		return scanLiteral(b, i)
	}
	return sk.skip(b, i, depth)
}

// byteAt returns b[i], or 0 (which no JSON token starts with) past the end.
func byteAt(b []byte, i int) byte {
	if uint(i) < uint(len(b)) {
		return b[i]
	}
	return 0
}

// plainEnd returns the index after the closing quote of a plain (escape-free)
// string starting at b[i] whose quote is among its first sixteen bytes, the
// usual key or short value, or 0 when the string needs the general scanner.
// Each word's special-byte mask is computed once.
func plainEnd(b []byte, i int) int {
	x, m := quoteWord(b, i)
	if m == 0 {
		if x, m = quoteWord(b, i+8); m == 0 {
			return 0
		}
		i += 8
	}
	if t := bits.TrailingZeros64(m); byte(x>>(t&^7)) == '"' {
		return i + t>>3 + 1
	}
	return 0
}

// quoteWord loads the eight bytes at b[i] and their special-byte mask, or
// returns a zero mask when fewer than eight bytes remain. It is small enough
// to be inlined into the member loop.
func quoteWord(b []byte, i int) (uint64, uint64) {
	if i+8 > len(b) {
		return 0, 0
	}
	x := binary.LittleEndian.Uint64(b[i:])
	return x, specialMask(x)
}

// millisOf reads a valid JSON number of seconds as milliseconds, rounded up: "9.2" is 9200,
// "0.0005" is 1. A negative number, one with an exponent, or one above maxCount milliseconds
// is not read (false). The streaming parser reads numbers the same way (jsonStream.fracDigit).
func millisOf(b []byte) (int64, bool) {
	var v uint64
	i := 0
	for ; i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
		if v <= maxCount {
			v = v*10 + uint64(b[i]-'0')
		}
	}
	frac, round := 0, false
	if i < len(b) && b[i] == '.' {
		for i++; i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
			switch {
			case frac < 3:
				if v <= maxCount {
					v = v*10 + uint64(b[i]-'0')
				}
				frac++
			case b[i] != '0':
				round = true
			}
		}
	}
	if i != len(b) || len(b) == 0 {
		return 0, false // a sign or an exponent
	}
	return scaleMillis(v, frac, round)
}

// scaleMillis turns the digits of a number of seconds read with frac (at most 3) of its
// decimals into milliseconds, rounded up when round says a later decimal was not zero.
func scaleMillis(v uint64, frac int, round bool) (int64, bool) {
	if v > maxCount {
		return 0, false
	}
	for ; frac < 3; frac++ {
		v *= 10
	}
	if round {
		v++
	}
	if v > maxCount {
		return 0, false
	}
	return int64(v), true
}
