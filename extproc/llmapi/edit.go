package llmapi

// editMode says where an edit of a request body is made.
type editMode bool

const (
	// copyBody: in a new array; the body is the caller's and stays as it was.
	copyBody editMode = false
	// inPlace: in the body's own array when its spare capacity holds what the edit adds (the
	// body is then changed), else in a new one.
	inPlace editMode = true
)

// splice returns b with b[from:to] replaced by s, made where mode says.
func (mode editMode) splice(b []byte, from, to int, s string) []byte {
	n := len(b) - (to - from) + len(s)
	if mode == inPlace && n <= cap(b) {
		out := b[:n]
		copy(out[from+len(s):], b[to:]) // copy moves overlapping bytes correctly
		copy(out[from:], s)
		return out
	}
	out := make([]byte, 0, n)
	out = append(out, b[:from]...)
	out = append(out, s...)
	return append(out, b[to:]...)
}

// EditBody makes the changes the server sends upstream in a request body that f is ScanRequest's
// reading of: every top-level "model" set to model when model is not empty (RewriteModel), then,
// when includeUsage, stream_options.include_usage asked for on a streamed OpenAI request
// (InjectIncludeUsage). It reports whether anything changed.
//
// body must be the caller's own and not be read again as it was: the edits are made in its
// array when its spare capacity (beyond len) holds what they add, so that a large buffered body
// is not copied once more for them (each edit moves the bytes after it within the array); only
// without that room is a new body allocated. Safe for concurrent use on different bodies.
func EditBody(api API, body []byte, f *RequestFields, model string, includeUsage bool) ([]byte, bool) {
	changed := false
	if model != "" {
		body, changed = rewriteModel(body, model, inPlace)
	}
	if !includeUsage {
		return body, changed
	}
	var injected bool
	if changed {
		body, injected = injectIncludeUsage(api, body, inPlace)
	} else {
		// The body is the one ScanRequest read: go straight to the places it found.
		body, injected = injectIncludeUsageAt(api, body, f, inPlace)
	}
	return body, changed || injected
}
