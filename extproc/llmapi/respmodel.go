package llmapi

import "bytes"

// maxModelSniff bounds how much of a response body is searched for the model that answered:
// every API this package reads names it before the generated content (OpenAI's chat,
// completions and Responses objects and chunks, Anthropic's message and message_start).
const maxModelSniff = 8 << 10

// modelSniffer finds the model a response names: the value of its first "model" key (at any
// depth: Anthropic's message_start and the Responses API's events nest it) within the first
// maxModelSniff bytes of the decoded body.
type modelSniffer struct {
	on, done bool
	buf      []byte
	model    string
}

// write takes the next decoded bytes.
func (m *modelSniffer) write(p []byte) {
	if !m.on || m.done {
		return
	}
	if room := maxModelSniff - len(m.buf); len(p) > room {
		p = p[:room]
	}
	m.buf = append(m.buf, p...)
	if model, ok := findModel(m.buf); ok {
		m.model, m.done = model, true
		return
	}
	if len(m.buf) >= maxModelSniff {
		m.done = true
	}
}

// findModel returns the string value of the first "model" key in b. A quote preceded by a
// backslash is inside a string, so text that merely mentions "model" in generated content
// (which JSON escapes) is not taken. ok is false until a whole value has been seen.
func findModel(b []byte) (string, bool) {
	const key = `"model"`
	for from := 0; ; {
		i := bytes.Index(b[from:], []byte(key))
		if i < 0 {
			return "", false
		}
		i += from
		from = i + len(key)
		if i > 0 && b[i-1] == '\\' {
			continue
		}
		j := skipBlanks(b, from)
		if j >= len(b) {
			return "", false // the rest has not arrived yet
		}
		if b[j] != ':' {
			continue // a value "model", not a key
		}
		j = skipBlanks(b, j+1)
		if j >= len(b) {
			return "", false
		}
		if b[j] != '"' {
			continue // not a string: not a model name
		}
		end := bytes.IndexByte(b[j+1:], '"')
		if end < 0 {
			return "", false
		}
		v := b[j+1 : j+1+end]
		if bytes.IndexByte(v, '\\') >= 0 || len(v) == 0 {
			continue // escapes are no part of a model name this server prices
		}
		return string(v), true
	}
}

func skipBlanks(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// SniffModel makes the scanner look for the model the response names (see Model). Call it
// after Reset; it costs a copy of at most the body's first 8 KiB.
func (s *UsageScanner) SniffModel() { s.model.on = true }

// Model returns the model the response named, or "" when it named none in its first 8 KiB
// (or SniffModel was not called).
func (s *UsageScanner) Model() string { return s.model.model }
