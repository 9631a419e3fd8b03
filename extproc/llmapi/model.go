package llmapi

// RewriteModel makes a request body name another model: every API this
// package reads (OpenAI chat, completions, embeddings and responses,
// Anthropic messages) names it in the top-level "model" member. When body is
// a valid JSON object it returns a new body in which the value of every
// top-level "model" member (whatever its type; a duplicated key is rewritten
// in every copy, so no parser can read the old name) is the JSON string
// model, or, when there is none, with "model" added as the first member, and
// true. Every other byte stays as it was. It returns body unchanged and false
// when body is not a valid JSON object, or when every "model" member already
// holds exactly that string.
//
// It allocates only the new body and is safe for concurrent use; body itself
// is never modified.
func RewriteModel(body []byte, model string) ([]byte, bool) {
	return rewriteModel(body, model, copyBody)
}

func rewriteModel(body []byte, model string, mode editMode) ([]byte, bool) {
	i := skipWS(body, 0)
	if i >= len(body) || body[i] != '{' {
		return body, false
	}
	type span struct{ from, to int }
	var (
		sk    skipper
		kb    keyBuf
		buf   [2]span
		found = buf[:0]
	)
	it := openObject(body, i)
	for {
		key, esc, v, more := it.next()
		if !more {
			break
		}
		end, ok := sk.skip(body, v, 1)
		if !ok {
			return body, false
		}
		if k, _ := decodeKey(&kb, key, esc); string(k) == "model" {
			found = append(found, span{v, end})
		}
		it.i = end
	}
	if it.bad || skipWS(body, it.i) != len(body) {
		return body, false
	}
	quoted := AppendJSONString(make([]byte, 0, len(model)+2), model)
	if len(found) == 0 {
		member := `"model":` + string(quoted)
		if j := skipWS(body, i+1); body[j] != '}' {
			member += ","
		}
		return mode.splice(body, i+1, i+1, member), true
	}
	same := true
	grow := 0
	for _, s := range found {
		same = same && string(body[s.from:s.to]) == string(quoted)
		grow += len(quoted) - (s.to - s.from)
	}
	if same {
		return body, false
	}
	if mode == inPlace {
		// From the last to the first, so that each span's place is still where it was found.
		q := string(quoted)
		for k := len(found) - 1; k >= 0; k-- {
			body = mode.splice(body, found[k].from, found[k].to, q)
		}
		return body, true
	}
	out := make([]byte, 0, len(body)+grow)
	prev := 0
	for _, s := range found {
		out = append(out, body[prev:s.from]...)
		out = append(out, quoted...)
		prev = s.to
	}
	return append(out, body[prev:]...), true
}

// AppendJSONString appends s as a JSON string: quotes, backslashes and control characters are
// escaped, every other byte is kept as it is (JSON allows any UTF-8 in strings).
func AppendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}
