package llmapi

// The usage scanner of streamed responses: SSE framing, event dispatch per API and the bounded
// buffers they share run byte by byte on the hot path, kept together.

import "unicode/utf8"

// jsonStream is a push parser for one JSON document delivered in pieces split
// at arbitrary bytes. It validates the document as strictly as encoding/json
// does, never buffers it, and records only what its pathTree asks for: usage
// numbers into slots, the unescaped length of generated text, and the
// document's "type". Memory is fixed: a bit per nesting level up to
// encoding/json's limit and a little state per interesting level.
//
// Duplicate keys behave like decoding into a map: when a key repeats, what
// its earlier value contributed (slots, text length, type) is forgotten.
type jsonStream struct {
	tree  pathTree
	state uint8
	depth int

	// valNode is the path node of the value about to start.
	valNode uint8

	// Current string.
	isKey    bool
	strKind  uint8
	errSlot  uint8 // strErr: the leaf's index
	strLen   int64
	pendHigh rune // a high surrogate waiting for its pair
	hexN     uint8
	hexVal   rune

	// Current number.
	numState uint8
	numSlot  int8 // -1 when the number is not a usage count
	numVal   uint64
	numBad   bool // negative, fractional, exponent or too large
	// A number of seconds (nodeMillis): its decimals read so far into numVal (at most 3) and
	// whether a later one was not zero, which rounds the milliseconds up.
	numMillis bool
	numFrac   uint8
	numRound  bool

	// Current literal.
	lit    string
	litPos uint8

	// Member name capture for interesting objects.
	keyLen  uint8
	keyOver bool
	keyBuf  [32]byte

	docResult

	lv      [maxTrack]level
	objBits [(maxDepth + 63) / 64]uint64
}

// docResult is what one document yielded.
type docResult struct {
	has      uint32
	vals     [numUsageSlots]int64
	content  int64
	typeSet  bool
	typeOver bool
	typeLen  uint8
	typeBuf  [48]byte
}

// typ returns the document's "type", or fallback when it had none that fits.
func (d *docResult) typ(fallback []byte) []byte {
	if d.typeSet && !d.typeOver {
		return d.typeBuf[:d.typeLen]
	}
	return fallback
}

// level is the per-container state kept for the first maxTrack levels.
type level struct {
	node    uint8
	kid     int8 // member being read, -1 when not an interesting one
	sum     int64
	contrib [maxKids]int64
}

// Parser states.
const (
	stValue      uint8 = iota // a value is due
	stValueOrEnd              // just after '['
	stKeyOrEnd                // just after '{'
	stKey                     // after ',' in an object
	stColon                   // after a member name
	stAfter                   // after a value inside a container
	stString
	stEscape
	stHex
	stNumber
	stLiteral
	stDone // the top-level value is complete
	stDead // the document is invalid; the rest is ignored
)

// String kinds.
const (
	strSkip uint8 = iota
	strKey
	strText
	strType
	strErr // an error code, collected in keyBuf
)

// Number states.
const (
	numMinus uint8 = iota
	numZero
	numInt
	numFracStart
	numFrac
	numExpStart
	numExpSign
	numExp
)

// maxCount is the largest usage count believed; anything above is treated as
// garbage rather than allowed to wreck a budget.
const maxCount = 1_000_000_000_000

// begin prepares for a new document.
func (s *jsonStream) begin(tree pathTree) {
	s.tree = tree
	s.state = stValue
	s.depth = 0
	s.valNode = 1
	s.pendHigh = 0
	s.has = 0
	s.content = 0
	s.typeSet, s.typeOver, s.typeLen = false, false, 0
}

// finish ends the document and reports whether it was complete and valid.
// When it was not, content holds the generated text seen up to the problem.
func (s *jsonStream) finish() bool {
	if s.state == stNumber && s.depth == 0 {
		switch s.numState {
		case numZero, numInt, numFrac, numExp:
			s.endNumber()
		}
	}
	if s.state == stDone {
		return true
	}
	var partial int64
	for d := 0; d < s.depth && d < maxTrack; d++ {
		l := &s.lv[d]
		if l.node == 0 {
			continue
		}
		partial += l.sum
		for _, c := range l.contrib {
			partial += c
		}
	}
	if s.state == stString || s.state == stEscape || s.state == stHex {
		if s.strKind == strText {
			partial += s.strLen
		}
	}
	s.content = partial
	s.state = stDead
	return false
}

func (s *jsonStream) fail() { s.state = stDead }

// feed consumes the next piece of the document.
func (s *jsonStream) feed(p []byte) {
	i := 0
	for i < len(p) {
		switch s.state {
		case stString:
			if s.strKind == strText || s.strKind == strSkip {
				i = s.textRun(p, i)
				if s.state == stDead {
					return
				}
				continue
			}
			if s.pendHigh != 0 && p[i] != '\\' {
				s.flushHigh()
			}
			j := strSpecial(p[i:])
			if j > 0 {
				s.strBytes(p[i : i+j])
				i += j
				if i == len(p) {
					return
				}
			}
			c := p[i]
			i++
			switch c {
			case '"':
				s.endString()
			case '\\':
				s.state = stEscape
			default:
				s.fail()
				return
			}

		case stEscape:
			c := p[i]
			i++
			if c == 'u' {
				s.state, s.hexN, s.hexVal = stHex, 0, 0
				continue
			}
			e := escapeByte[c]
			if e == 0 {
				s.fail()
				return
			}
			if s.pendHigh != 0 {
				s.flushHigh()
			}
			s.strByte(e)
			s.state = stString

		case stHex:
			v := hexVal(p[i])
			i++
			if v < 0 {
				s.fail()
				return
			}
			s.hexVal = s.hexVal<<4 | v
			if s.hexN++; s.hexN == 4 {
				s.escapedRune(s.hexVal)
				s.state = stString
			}

		case stNumber:
			i = s.numberBytes(p, i)

		case stLiteral:
			if p[i] != s.lit[s.litPos] {
				s.fail()
				return
			}
			i++
			if s.litPos++; int(s.litPos) == len(s.lit) {
				s.endValue(0)
			}

		case stDead:
			return

		default:
			c := p[i]
			if c <= ' ' && (c == ' ' || c == '\n' || c == '\r' || c == '\t') {
				i++
				continue
			}
			if !s.structural(c) {
				s.fail()
				return
			}
			if s.state != stNumber {
				i++
			}
		}
	}
}

// structural handles a non-whitespace byte outside strings, numbers and
// literals. For the first byte of a number it only sets the state up; the
// byte itself is then read by the number state.
func (s *jsonStream) structural(c byte) bool {
	switch s.state {
	case stValue:
		return s.beginValue(c)
	case stValueOrEnd:
		if c == ']' {
			return s.close(false)
		}
		return s.beginValue(c)
	case stKeyOrEnd:
		if c == '}' {
			return s.close(true)
		}
		return s.beginKey(c)
	case stKey:
		return s.beginKey(c)
	case stColon:
		if c != ':' {
			return false
		}
		s.state = stValue
		return true
	case stAfter:
		obj := s.isObject()
		switch {
		case c == ',' && obj:
			s.state = stKey
			return true
		case c == ',':
			s.state = stValue
			s.valNode = s.elemNode()
			return true
		case c == '}' && obj:
			return s.close(true)
		case c == ']' && !obj:
			return s.close(false)
		}
	}
	// stDone: only whitespace may follow the document.
	return false
}

func (s *jsonStream) isObject() bool {
	d := s.depth - 1
	return s.objBits[d>>6]>>(d&63)&1 == 1
}

// curLevel returns the state of the innermost container when it is tracked
// and interesting.
func (s *jsonStream) curLevel() *level {
	if d := s.depth - 1; d >= 0 && d < maxTrack && s.lv[d].node != 0 {
		return &s.lv[d]
	}
	return nil
}

func (s *jsonStream) elemNode() uint8 {
	if l := s.curLevel(); l != nil {
		return s.tree[l.node].elem
	}
	return 0
}

func (s *jsonStream) beginKey(c byte) bool {
	if c != '"' {
		return false
	}
	s.isKey = true
	s.strKind = strSkip
	if s.curLevel() != nil {
		s.strKind = strKey
		s.keyLen, s.keyOver = 0, false
	}
	s.state = stString
	return true
}

func (s *jsonStream) beginValue(c byte) bool {
	node := &s.tree[s.valNode]
	switch c {
	case '{', '[':
		obj := c == '{'
		d := s.depth
		if d >= maxDepth {
			return false
		}
		if obj {
			s.objBits[d>>6] |= 1 << (d & 63)
		} else {
			s.objBits[d>>6] &^= 1 << (d & 63)
		}
		s.depth++
		if obj && node.mark && node.kind == nodeObject {
			s.has |= 1 << (errPresentShift + node.slot)
		}
		if d < maxTrack {
			l := &s.lv[d]
			*l = level{kid: -1}
			if (obj && node.kind == nodeObject) || (!obj && node.kind == nodeArray) {
				l.node = s.valNode
			}
		}
		if obj {
			s.state = stKeyOrEnd
		} else {
			s.state = stValueOrEnd
			s.valNode = s.elemNode()
		}
	case '"':
		s.isKey = false
		s.strLen = 0
		switch node.kind {
		case nodeText:
			s.strKind = strText
		case nodeType:
			s.strKind = strType
			s.typeLen, s.typeOver = 0, false
		case nodeErr:
			s.strKind = strErr
			s.errSlot = node.slot
			s.keyLen, s.keyOver = 0, false
		default:
			s.strKind = strSkip
		}
		s.state = stString
	case 't':
		s.lit, s.litPos, s.state = "true", 1, stLiteral
	case 'f':
		s.lit, s.litPos, s.state = "false", 1, stLiteral
	case 'n':
		s.lit, s.litPos, s.state = "null", 1, stLiteral
	default:
		if c != '-' && (c < '0' || c > '9') {
			return false
		}
		// The byte is left for the number state to read.
		s.state = stNumber
		s.numState = numStart
		s.numVal, s.numBad = 0, false
		s.numSlot = -1
		s.numMillis, s.numFrac, s.numRound = false, 0, false
		switch node.kind {
		case nodeNumber:
			s.numSlot = int8(node.slot)
		case nodeMillis:
			s.numSlot, s.numMillis = int8(node.slot), true
		}
	}
	return true
}

// close ends the innermost container, which must be an object when obj.
func (s *jsonStream) close(obj bool) bool {
	if s.depth == 0 || s.isObject() != obj {
		return false
	}
	var total int64
	if l := s.curLevel(); l != nil {
		total = l.sum
		for _, c := range l.contrib {
			total += c
		}
	}
	s.depth--
	s.endValue(total)
	return true
}

// endValue records that a value ended, handing its generated-text length to
// the container it belongs to. An object keeps one contribution per member so
// that a repeated key replaces rather than adds.
func (s *jsonStream) endValue(v int64) {
	if s.depth == 0 {
		s.content = v
		s.state = stDone
		return
	}
	s.state = stAfter
	if l := s.curLevel(); l != nil {
		if !s.isObject() {
			l.sum += v
		} else if l.kid >= 0 {
			l.contrib[l.kid] = v
		}
	}
}

func (s *jsonStream) endString() {
	if s.pendHigh != 0 {
		s.flushHigh()
	}
	if s.isKey {
		s.endKey()
		s.state = stColon
		return
	}
	switch s.strKind {
	case strText:
		s.endValue(s.strLen)
		return
	case strType:
		s.typeSet = true
	case strErr:
		if !s.keyOver {
			s.has |= errClassBit(classifyErrorCode(s.keyBuf[:s.keyLen]), s.errSlot)
		}
	}
	s.endValue(0)
}

// endKey resolves a member name of an interesting object to the node its
// value will have, and forgets what an earlier member of that name recorded.
func (s *jsonStream) endKey() {
	s.valNode = 0
	l := s.curLevel()
	if l == nil {
		return
	}
	l.kid = -1
	if s.keyOver {
		return
	}
	node := &s.tree[l.node]
	k := node.lookup(s.keyBuf[:s.keyLen])
	if k < 0 {
		return
	}
	l.kid = int8(k)
	l.contrib[k] = 0
	child := node.kids[k]
	s.has &^= s.tree[child].clear
	if s.tree[child].kind == nodeType {
		s.typeSet, s.typeLen, s.typeOver = false, 0, false
	}
	s.valNode = child
}

// strBytes takes a run of plain string bytes.
func (s *jsonStream) strBytes(b []byte) {
	switch s.strKind {
	case strText:
		s.strLen += int64(len(b))
	case strKey, strErr:
		if int(s.keyLen)+len(b) > len(s.keyBuf) {
			s.keyOver = true
			return
		}
		s.keyLen += uint8(copy(s.keyBuf[s.keyLen:], b))
	case strType:
		if int(s.typeLen)+len(b) > len(s.typeBuf) {
			s.typeOver = true
			return
		}
		s.typeLen += uint8(copy(s.typeBuf[s.typeLen:], b))
	}
}

func (s *jsonStream) strByte(c byte) {
	var one [1]byte
	one[0] = c
	s.strBytes(one[:])
}

// escapedRune takes the code point of a \u escape, pairing surrogates the way
// encoding/json does: a valid pair is one rune, anything else U+FFFD.
func (s *jsonStream) escapedRune(r rune) {
	if s.pendHigh != 0 {
		high := s.pendHigh
		s.pendHigh = 0
		if isLowSurrogate(r) {
			s.strRune(0x10000 + (high-0xD800)<<10 + (r - 0xDC00))
			return
		}
		s.strRune(utf8.RuneError)
	}
	switch {
	case isHighSurrogate(r):
		s.pendHigh = r
	case isLowSurrogate(r):
		s.strRune(utf8.RuneError)
	default:
		s.strRune(r)
	}
}

// flushHigh settles a high surrogate that turned out not to be paired.
func (s *jsonStream) flushHigh() {
	s.pendHigh = 0
	s.strRune(utf8.RuneError)
}

func (s *jsonStream) strRune(r rune) {
	if s.strKind == strText {
		s.strLen += int64(utf8.RuneLen(r))
		return
	}
	if s.strKind == strSkip {
		return
	}
	var buf [utf8.UTFMax]byte
	s.strBytes(buf[:utf8.EncodeRune(buf[:], r)])
}

// numStart: a number whose first byte ('-' or a digit) is still to be read.
const numStart = numExp + 1

// numberBytes reads number bytes from p[i:] and returns where it stopped. The
// byte that ends a number is left for the next state.
func (s *jsonStream) numberBytes(p []byte, i int) int {
	for ; i < len(p); i++ {
		c := p[i]
		digit := c >= '0' && c <= '9'
		switch s.numState {
		case numStart:
			switch {
			case c == '-':
				s.numBad = true
				s.numState = numMinus
			case c == '0':
				s.numState = numZero
			default:
				s.numState = numInt
				s.numVal = uint64(c - '0')
			}
			continue
		case numMinus:
			switch {
			case c == '0':
				s.numState = numZero
				continue
			case digit:
				s.numState = numInt
				continue
			}
			s.fail()
			return len(p)
		case numInt:
			if digit {
				if s.numVal <= maxCount {
					s.numVal = s.numVal*10 + uint64(c-'0')
				}
				continue
			}
			fallthrough
		case numZero:
			switch c {
			case '.':
				s.numBad = s.numBad || !s.numMillis
				s.numState = numFracStart
				continue
			case 'e', 'E':
				s.numBad = true
				s.numState = numExpStart
				continue
			}
			s.endNumber()
			return i
		case numFracStart:
			if !digit {
				s.fail()
				return len(p)
			}
			s.numState = numFrac
			s.fracDigit(c)
		case numFrac:
			switch {
			case digit:
				s.fracDigit(c)
			case c == 'e' || c == 'E':
				s.numBad = true
				s.numState = numExpStart
			default:
				s.endNumber()
				return i
			}
		case numExpStart:
			switch {
			case c == '+' || c == '-':
				s.numState = numExpSign
			case digit:
				s.numState = numExp
			default:
				s.fail()
				return len(p)
			}
		case numExpSign:
			if !digit {
				s.fail()
				return len(p)
			}
			s.numState = numExp
		case numExp:
			if !digit {
				s.endNumber()
				return i
			}
		}
	}
	return i
}

func (s *jsonStream) endNumber() {
	switch {
	case s.numSlot < 0 || s.numBad:
	case s.numMillis:
		if ms, ok := scaleMillis(s.numVal, int(s.numFrac), s.numRound); ok {
			s.vals[s.numSlot] = ms
			s.has |= 1 << s.numSlot
		}
	case s.numVal <= maxCount:
		s.vals[s.numSlot] = int64(s.numVal)
		s.has |= 1 << s.numSlot
	}
	s.endValue(0)
}

// fracDigit reads a decimal of a number of seconds, as millisOf does: the first three into
// the milliseconds, any later one that is not zero rounding them up.
func (s *jsonStream) fracDigit(c byte) {
	switch {
	case !s.numMillis:
	case s.numFrac < 3:
		if s.numVal <= maxCount {
			s.numVal = s.numVal*10 + uint64(c-'0')
		}
		s.numFrac++
	case c != '0':
		s.numRound = true
	}
}

// textRun reads string bytes from p[i:] for a string whose text is only
// measured (generated text, or a value nobody needs), resolving escapes that
// lie wholly in p on the spot. It is what keeps long content strings at
// memory speed; escapes split across chunks go through the escape states.
func (s *jsonStream) textRun(p []byte, i int) int {
	n := s.strLen
	for {
		j := strSpecial(p[i:])
		if j > 0 {
			if s.pendHigh != 0 {
				s.pendHigh = 0
				n += 3
			}
			n += int64(j)
			i += j
		}
		if i == len(p) {
			s.strLen = n
			return i
		}
		switch p[i] {
		case '"':
			if s.pendHigh != 0 {
				s.pendHigh = 0
				n += 3
			}
			s.strLen = n
			s.endString()
			return i + 1
		case '\\':
		default:
			s.fail()
			return len(p)
		}
		if i+1 == len(p) || (p[i+1] == 'u' && i+6 > len(p)) {
			// The escape continues in the next chunk.
			s.strLen = n
			s.state = stEscape
			return i + 1
		}
		e := p[i+1]
		if e != 'u' {
			if escapeByte[e] == 0 {
				s.fail()
				return len(p)
			}
			if s.pendHigh != 0 {
				s.pendHigh = 0
				n += 3
			}
			n++
			i += 2
			continue
		}
		r, ok := hex4(p, i+2)
		if !ok {
			s.fail()
			return len(p)
		}
		i += 6
		if s.pendHigh != 0 {
			s.pendHigh = 0
			if isLowSurrogate(r) {
				n += 4
				continue
			}
			n += 3
		}
		switch {
		case isHighSurrogate(r):
			s.pendHigh = r
		case isLowSurrogate(r):
			n += 3
		default:
			n += int64(runeLen(r))
		}
	}
}
