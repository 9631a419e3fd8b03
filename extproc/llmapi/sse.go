package llmapi

import "bytes"

// sseParser splits a text/event-stream into events as the WHATWG HTML
// standard describes (fields "data", "event", "id", "retry"; comments; CR,
// LF and CRLF line endings; a blank line dispatches; one leading BOM is
// skipped), streaming each event's data straight into a jsonStream instead of
// collecting it. Lines may be split across chunks anywhere, and a line of any
// length passes through in constant memory.
type sseParser struct {
	state     uint8
	cr        bool // the previous byte was CR: a following LF is the same line end
	bom       uint8
	fieldLen  uint8
	fieldOver bool
	field     [5]byte
	eventLen  uint8
	eventOver bool
	event     [48]byte
	dataLines int
	dataFed   bool // some of the event's data went to the sink piecemeal
}

const (
	sseLineStart uint8 = iota
	sseField
	sseSpace // after the colon: one optional space
	sseData
	sseEvent
	sseSkip // comments, id, retry and unknown fields
)

const utf8BOM = "\xEF\xBB\xBF"

// eventSink receives dispatched events.
type eventSink interface {
	// dataStart is called before the first data of an event.
	dataStart()
	// data receives a piece of an event's data.
	data(p []byte)
	// dispatch ends an event that had data, with its event type.
	dispatch(event []byte)
	// wholeEvent offers an event whose single data line is all in hand, with
	// its event type; false means it was not taken and must be streamed.
	wholeEvent(data, event []byte) bool
}

// feed consumes the next piece of the stream.
func (s *sseParser) feed(p []byte, sink eventSink) {
	if s.bom < uint8(len(utf8BOM)) {
		p = s.skipBOM(p, sink)
	}
	// Most streams end lines with LF alone; knowing up front that p holds no
	// CR halves the work of finding line ends.
	noCR := bytes.IndexByte(p, '\r') < 0
	i := 0
	for i < len(p) {
		if s.cr {
			s.cr = false
			if p[i] == '\n' {
				i++
				continue
			}
		}
		switch s.state {
		case sseLineStart:
			switch p[i] {
			case '\r', '\n':
				s.lineEnd(p[i])
				s.blankLine(sink)
				i++
				continue
			case ':':
				s.state = sseSkip
				i++
				continue
			}
			s.fieldLen, s.fieldOver = 0, false
			// The two fields that matter, when whole in p, skip the byte loop.
			if rest := p[i:]; len(rest) >= 6 {
				n := 0
				switch {
				case string(rest[:5]) == "data:":
					if noCR && s.dataLines == 0 {
						if k := s.wholeData(rest, sink); k > 0 {
							i += k
							continue
						}
					}
					n = 4
				case string(rest[:6]) == "event:":
					if noCR {
						if k := s.eventLine(rest); k > 0 {
							i += k
							continue
						}
					}
					n = 5
				}
				if n > 0 {
					s.fieldLen = uint8(copy(s.field[:], rest[:n]))
					s.startValue(sink)
					i += n + 1
					continue
				}
			}
			s.state = sseField
		case sseField:
			for i < len(p) {
				c := p[i]
				if c == ':' || c == '\r' || c == '\n' {
					break
				}
				if int(s.fieldLen) < len(s.field) {
					s.field[s.fieldLen] = c
					s.fieldLen++
				} else {
					s.fieldOver = true
				}
				i++
			}
			if i == len(p) {
				return
			}
			s.startValue(sink)
			if c := p[i]; c == ':' {
				i++
				continue
			}
			// A field name alone on its line has an empty value.
			s.lineEnd(p[i])
			i++
		case sseSpace:
			if p[i] == ' ' {
				i++
			}
			s.state = s.valueState()
		case sseData, sseEvent, sseSkip:
			var j int
			if noCR {
				j = bytes.IndexByte(p[i:], '\n')
			} else {
				j = indexEOL(p[i:])
			}
			if j >= 0 && s.state == sseData && s.dataLines == 1 && !s.dataFed {
				if k, ok := s.tryWhole(p, i, j, sink); ok {
					i = k
					continue
				}
			}
			seg := p[i:]
			if j >= 0 {
				seg = p[i : i+j]
			}
			switch s.state {
			case sseData:
				if len(seg) > 0 {
					sink.data(seg)
					s.dataFed = true
				}
			case sseEvent:
				if int(s.eventLen)+len(seg) <= len(s.event) {
					s.eventLen += uint8(copy(s.event[s.eventLen:], seg))
				} else {
					s.eventOver = true
				}
			}
			if j < 0 {
				return
			}
			i += j
			s.lineEnd(p[i])
			i++
		}
	}
}

// wholeData reads the usual streamed event, a single data line followed by
// the blank line that dispatches it, when rest (a line start in a chunk
// without CR) holds all of one. It returns the bytes it consumed, or 0 when
// the event does not end in rest and the byte loop must read it. It does
// what the byte loop would, without the states in between: offer the event
// whole, and stream it to the sink when that is refused.
func (s *sseParser) wholeData(rest []byte, sink eventSink) int {
	j := bytes.IndexByte(rest, '\n')
	if j < 0 || j+1 >= len(rest) || rest[j+1] != '\n' {
		return 0
	}
	data := rest[len("data:"):j]
	if len(data) > 0 && data[0] == ' ' {
		data = data[1:]
	}
	ev := s.event[:s.eventLen]
	if s.eventOver {
		ev = nil
	}
	if !sink.wholeEvent(data, ev) {
		sink.dataStart()
		if len(data) > 0 {
			sink.data(data)
		}
		sink.dispatch(ev)
	}
	s.endEvent()
	return j + 2
}

// eventLine reads a whole "event:" line at the start of rest (a line start
// in a chunk without CR) as the byte loop would, returning the bytes it
// consumed, or 0 when the line does not end in rest.
func (s *sseParser) eventLine(rest []byte) int {
	j := bytes.IndexByte(rest, '\n')
	if j < 0 {
		return 0
	}
	v := rest[len("event:"):j]
	if len(v) > 0 && v[0] == ' ' {
		v = v[1:]
	}
	s.eventLen, s.eventOver = 0, false
	if len(v) <= len(s.event) {
		s.eventLen = uint8(copy(s.event[:], v))
	} else {
		s.eventOver = true
	}
	return j + 1
}

// skipBOM drops a UTF-8 byte order mark at the very start of the stream,
// even when it arrives split across chunks.
func (s *sseParser) skipBOM(p []byte, sink eventSink) []byte {
	for len(p) > 0 && s.bom < uint8(len(utf8BOM)) {
		if p[0] != utf8BOM[s.bom] {
			// Not a BOM after all: replay what was held back.
			held := s.bom
			s.bom = uint8(len(utf8BOM))
			if held > 0 {
				s.feed([]byte(utf8BOM[:held]), sink)
			}
			return p
		}
		s.bom++
		p = p[1:]
	}
	return p
}

// indexEOL returns the index of the first CR or LF in p, or -1.
func indexEOL(p []byte) int {
	n := bytes.IndexByte(p, '\n')
	if n < 0 {
		return bytes.IndexByte(p, '\r')
	}
	if r := bytes.IndexByte(p[:n], '\r'); r >= 0 {
		return r
	}
	return n
}

// startValue acts on a complete field name.
func (s *sseParser) startValue(sink eventSink) {
	s.state = sseSpace
	name := s.field[:s.fieldLen]
	switch {
	case s.fieldOver:
		s.state = sseSkip
	case string(name) == "data":
		if s.dataLines == 0 {
			sink.dataStart()
		} else {
			sink.data([]byte{'\n'})
			s.dataFed = true
		}
		s.dataLines++
	case string(name) == "event":
		s.eventLen, s.eventOver = 0, false
	default:
		s.fieldOver = true // remembered as "skip" for valueState
	}
}

func (s *sseParser) valueState() uint8 {
	name := s.field[:s.fieldLen]
	switch {
	case s.fieldOver:
		return sseSkip
	case string(name) == "data":
		return sseData
	case string(name) == "event":
		return sseEvent
	}
	return sseSkip
}

// lineEnd ends the current line at the CR or LF c.
func (s *sseParser) lineEnd(c byte) {
	s.cr = c == '\r'
	s.state = sseLineStart
}

// blankLine dispatches the pending event, if it has data.
func (s *sseParser) blankLine(sink eventSink) {
	if s.dataLines > 0 {
		ev := s.event[:s.eventLen]
		if s.eventOver {
			ev = nil
		}
		sink.dispatch(ev)
	}
	s.endEvent()
}

func (s *sseParser) endEvent() {
	s.dataLines, s.dataFed = 0, false
	s.eventLen, s.eventOver = 0, false
}

// tryWhole handles the common case of an event that arrives whole: its first
// and only data line, p[i:i+j], is followed in p by the blank line that ends
// the event. It returns the index after that blank line when the sink took
// the event.
func (s *sseParser) tryWhole(p []byte, i, j int, sink eventSink) (int, bool) {
	k := i + j + 1
	if p[i+j] == '\r' && k < len(p) && p[k] == '\n' {
		k++
	}
	if k >= len(p) || (p[k] != '\n' && p[k] != '\r') {
		return 0, false
	}
	ev := s.event[:s.eventLen]
	if s.eventOver {
		ev = nil
	}
	if !sink.wholeEvent(p[i:i+j], ev) {
		return 0, false
	}
	s.endEvent()
	s.lineEnd(p[k])
	s.state = sseLineStart
	return k + 1, true
}

// end closes the stream. A browser drops an event that was not followed by a
// blank line; here it is dispatched, so that a proxy that trims the final
// blank line, or a stream cut right after its last data line, does not lose
// the usage it carried. Whether that data is complete JSON is up to the sink.
func (s *sseParser) end(sink eventSink) {
	if s.state == sseField {
		s.startValue(sink)
	}
	s.state = sseLineStart
	s.blankLine(sink)
}
