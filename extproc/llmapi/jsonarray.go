package llmapi

// arrayParser splits a streamed JSON array, as Gemini's streamGenerateContent sends without
// alt=sse ("[{chunk},\r\n{chunk}]"), into its elements as the bytes arrive, streaming each
// element to the sink as the data of one event. It keeps a few bytes of state whatever the
// size of an element: where strings and nesting begin and end. What follows the array's end
// is ignored; a body that does not start with '[' is one element.
type arrayParser struct {
	state uint8
	depth int
	inStr bool
	esc   bool
}

const (
	arrayStart   uint8 = iota // before the '['
	arrayBetween              // before an element, a ',' or the ']'
	arrayElement              // inside an element
	arrayDone                 // after the ']'
	arrayOne                  // the body is not an array: all of it is one element
)

// feed consumes the next piece of the body.
func (a *arrayParser) feed(p []byte, sink eventSink) {
	i := 0
	for i < len(p) {
		switch a.state {
		case arrayStart:
			c := p[i]
			if isBlank(c) {
				i++
				continue
			}
			if c != '[' {
				a.state = arrayOne
				sink.dataStart()
				continue
			}
			a.state = arrayBetween
			i++
		case arrayBetween:
			c := p[i]
			if isBlank(c) || c == ',' {
				i++
				continue
			}
			if c == ']' {
				a.state = arrayDone
				i++
				continue
			}
			a.state, a.depth, a.inStr, a.esc = arrayElement, 0, false, false
			sink.dataStart()
		case arrayElement:
			j, end := a.scan(p[i:])
			if j > 0 {
				sink.data(p[i : i+j])
			}
			i += j
			if end {
				sink.dispatch(nil)
				a.state = arrayBetween
			}
		case arrayOne:
			sink.data(p[i:])
			return
		default:
			return
		}
	}
}

// scan reads element bytes from p and returns how many belong to the element and whether it
// ended: at a ',' or ']' outside strings and nested values (not consumed, and consumed by
// arrayBetween: every call moves on).
func (a *arrayParser) scan(p []byte) (int, bool) {
	for i, c := range p {
		switch {
		case a.inStr:
			switch {
			case a.esc:
				a.esc = false
			case c == '\\':
				a.esc = true
			case c == '"':
				a.inStr = false
			}
		case c == '"':
			a.inStr = true
		case c == '{' || c == '[':
			a.depth++
		case c == '}' || c == ']':
			switch {
			case a.depth > 0:
				a.depth--
			case c == ']':
				return i, true
			}
			// A '}' closing nothing makes the element invalid JSON; it is part of it.
		case c == ',' && a.depth == 0:
			return i, true
		}
	}
	return len(p), false
}

// end closes the body: an element cut short is dispatched, for what it holds.
func (a *arrayParser) end(sink eventSink) {
	if a.state == arrayElement || a.state == arrayOne {
		sink.dispatch(nil)
	}
	a.state = arrayDone
}

func isBlank(c byte) bool { return c == ' ' || c == '\n' || c == '\r' || c == '\t' }
