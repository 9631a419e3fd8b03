package llmapi

import (
	"bytes"
	"encoding/json"
	"io"
	"math/big"
	"strconv"
	"strings"
)

// The reference implementations below answer the same questions as the
// package, the slow and obvious way: encoding/json decodes the whole document
// into maps, and the answer is read from there. The fuzz tests hold the fast
// scanners to them.

func decodeAny(b []byte) (any, bool) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, false
	}
	if _, err := d.Token(); err == nil {
		return nil, false
	}
	return v, json.Valid(b)
}

// refScanRequest is ScanRequest over a decoded document.
func refScanRequest(api API, body []byte) (RequestFields, error) {
	f := RequestFields{N: 1, BestOf: 1, Prompts: 1, Choices: 1}
	body = canonicalNames(body)
	v, ok := decodeAny(body)
	m, isObj := v.(map[string]any)
	if !ok || !isObj {
		return f, ErrInvalidJSON
	}
	var problems [numFields]uint8
	str := func(id fieldID, v any, present bool) string {
		switch v := v.(type) {
		case string:
			return v
		case nil:
		default:
			problems[id] = problemType
		}
		_ = present
		return ""
	}
	integer := func(id fieldID, v any, minimum int64) (int64, bool) {
		switch v := v.(type) {
		case json.Number:
			s := string(v)
			if strings.ContainsAny(s, ".eE") {
				problems[id] = problemType
				return 0, false
			}
			n, err := strconv.ParseInt(s, 10, 64)
			if err != nil || n < minimum {
				problems[id] = problemValue
				return 0, false
			}
			return n, true
		case nil:
		default:
			problems[id] = problemType
		}
		return 0, false
	}
	boolean := func(id fieldID, v any) bool {
		switch v := v.(type) {
		case bool:
			return v
		case nil:
		default:
			problems[id] = problemType
		}
		return false
	}
	model, _ := m["model"]
	f.Model = str(fModel, model, true)
	var maxTok int64
	for _, k := range []struct {
		id   fieldID
		name string
	}{{fMaxTokens, "max_tokens"}, {fMaxCompletionTokens, "max_completion_tokens"}, {fMaxOutputTokens, "max_output_tokens"}} {
		if v, ok := m[k.name]; ok {
			if n, ok := integer(k.id, v, 0); ok {
				f.HasMaxTokens = true
				maxTok = max(maxTok, n)
			}
		}
	}
	f.MaxTokens = maxTok
	if v, ok := m["n"]; ok {
		if n, ok := integer(fN, v, 1); ok {
			f.N = n
		}
	}
	if v, ok := m["best_of"]; ok {
		if n, ok := integer(fBestOf, v, 1); ok {
			f.BestOf = n
		}
	}
	if a, ok := m["prompt"].([]any); ok && len(a) > 1 {
		if _, num := a[0].(json.Number); !num {
			f.Prompts = int64(len(a))
		}
	}
	if v, ok := m["stream"]; ok {
		f.Stream = boolean(fStream, v)
	}
	if v, ok := m["stream_options"]; ok {
		switch so := v.(type) {
		case map[string]any:
			f.HasStreamOptions = true
			if iu, ok := so["include_usage"]; ok {
				f.IncludeUsage = boolean(fIncludeUsage, iu)
			}
		case nil:
		default:
			problems[fStreamOptions] = problemType
		}
	}
	var user, metaUser string
	var hasUser bool
	if v, ok := m["user"]; ok {
		user = str(fUser, v, true)
		_, hasUser = v.(string)
	}
	if md, ok := m["metadata"].(map[string]any); ok {
		if v, ok := md["user_id"]; ok {
			metaUser = str(fMetadataUserID, v, true)
		}
	}
	switch {
	case api.Anthropic():
		f.User = metaUser
	case api != APIUnknown || hasUser:
		f.User = user
	default:
		f.User = metaUser
	}
	gemini, converse := api.gemini(), api == APIBedrockConverse || api == APIBedrockConverseStream
	intMembers := func(id fieldID, v any, members ...struct {
		name    string
		id      fieldID
		minimum int64
	}) (vals []int64, has []bool) {
		vals, has = make([]int64, len(members)), make([]bool, len(members))
		switch o := v.(type) {
		case map[string]any:
			for k, mem := range members {
				if x, ok := o[mem.name]; ok {
					vals[k], has[k] = integer(mem.id, x, mem.minimum)
				}
			}
		case nil:
		default:
			problems[id] = problemType
		}
		return vals, has
	}
	type member = struct {
		name    string
		id      fieldID
		minimum int64
	}
	switch {
	case gemini:
		f.MaxTokens, f.HasMaxTokens, f.N = 0, false, 1
		if v, ok := m["generationConfig"]; ok {
			vals, has := intMembers(fGenerationConfig, v, member{"maxOutputTokens", fGeminiMaxOutput, 0},
				member{"candidateCount", fCandidateCount, 1})
			f.MaxTokens, f.HasMaxTokens = vals[0], has[0]
			if has[1] {
				f.N = vals[1]
			}
		}
	case converse:
		f.MaxTokens, f.HasMaxTokens = 0, false
		if v, ok := m["inferenceConfig"]; ok {
			vals, has := intMembers(fInferenceConfig, v, member{"maxTokens", fInferenceMaxTokens, 0})
			f.MaxTokens, f.HasMaxTokens = vals[0], has[0]
		}
	}
	if api.Streams() {
		f.Stream = true
	}
	f.Choices = choices(api, f.N, f.BestOf, f.Prompts)
	var c content
	if gemini {
		if v, ok := m["contents"]; ok {
			switch v.(type) {
			case []any:
				c.add(refTexts(v, 1))
			case nil:
			default:
				problems[fContents] = problemType
			}
		}
		for _, src := range []struct {
			id   fieldID
			name string
		}{{fSystemInstruction, "systemInstruction"}, {fContent, "content"}} {
			if v, ok := m[src.name]; ok {
				switch v.(type) {
				case map[string]any:
					c.add(refTexts(v, 1))
				case nil:
				default:
					problems[src.id] = problemType
				}
			}
		}
	}
	for _, src := range []struct {
		id      fieldID
		name    string
		strings bool
	}{{fMessages, "messages", false}, {fSystem, "system", true}, {fPrompt, "prompt", true}, {fInput, "input", true}, {fInstructions, "instructions", true}} {
		v, ok := m[src.name]
		if !ok {
			continue
		}
		switch v.(type) {
		case []any:
			c.add(refTexts(v, 1))
		case string:
			if src.strings {
				c.add(refTexts(v, 1))
			} else {
				problems[src.id] = problemType
			}
		case nil:
		default:
			problems[src.id] = problemType
		}
	}
	f.PromptBytes, f.Images, f.Audio, f.Files = c.bytes, c.images, c.audio, c.files
	s := requestScan{problems: problems}
	return f, s.err()
}

// aliases are the snake_case spellings of Gemini's member names, which its API reads as the
// camelCase ones; the scan takes whichever comes last, as for a repeated name.
// Each applies at the top of the body ("^"), inside a generationConfig, or anywhere ("").
var aliases = map[string]struct{ name, parent string }{
	"system_instruction": {"systemInstruction", "^"}, "generation_config": {"generationConfig", "^"},
	"max_output_tokens": {"maxOutputTokens", "generationConfig"}, "candidate_count": {"candidateCount", "generationConfig"},
	"inline_data": {"inlineData", ""}, "mime_type": {"mimeType", ""}, "file_data": {"fileData", ""}}

// canonicalNames rewrites a valid JSON document with every member name in aliases renamed, so
// that a decoded map has one entry for both spellings: the later one. Invalid JSON comes back
// as it is.
func canonicalNames(b []byte) []byte {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var out bytes.Buffer
	// key: a member name is due; name: the last member name; parent: the name whose value the
	// container is ("^" for the top).
	type frame struct {
		obj, key     bool
		name, parent string
	}
	var stack []frame
	first := true
	for {
		tok, err := d.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			return b
		}
		top := len(stack) - 1
		if delim, ok := tok.(json.Delim); ok && (delim == '}' || delim == ']') {
			out.WriteByte(byte(delim))
			stack = stack[:top]
			if top > 0 && stack[top-1].obj {
				stack[top-1].key = true
			}
			first = false
			continue
		}
		if !first && top >= 0 {
			if stack[top].obj && stack[top].key {
				if out.Bytes()[out.Len()-1] != '{' {
					out.WriteByte(',')
				}
			} else if stack[top].obj {
				out.WriteByte(':')
			} else if out.Bytes()[out.Len()-1] != '[' {
				out.WriteByte(',')
			}
		}
		first = false
		isKey := top >= 0 && stack[top].obj && stack[top].key
		switch t := tok.(type) {
		case json.Delim:
			out.WriteByte(byte(t))
			parent := "^"
			if top >= 0 {
				parent = ""
				if stack[top].obj {
					stack[top].key = false
					parent = stack[top].name
				}
			}
			stack = append(stack, frame{obj: t == '{', key: t == '{', parent: parent})
			continue
		case string:
			if isKey {
				if a, ok := aliases[t]; ok && (a.parent == "" || a.parent == stack[top].parent) {
					t = a.name
				}
				stack[top].name = t
			}
			q, _ := json.Marshal(t)
			out.Write(q)
		case json.Number:
			out.WriteString(string(t))
		case bool:
			out.WriteString(strconv.FormatBool(t))
		case nil:
			out.WriteString("null")
		}
		if top >= 0 && stack[top].obj {
			stack[top].key = !isKey
		}
	}
	return out.Bytes()
}

func refTexts(v any, level int) content {
	var c content
	switch v := v.(type) {
	case string:
		c.bytes = int64(len(v))
	case map[string]any:
		if level <= maxContentLevel {
			c = refPart(v, level)
		}
	case []any:
		if level <= maxContentLevel {
			for _, e := range v {
				c.add(refTexts(e, level))
			}
		}
	}
	return c
}

func refPart(m map[string]any, level int) content {
	var c content
	for _, k := range []string{"text", "refusal", "thinking", "arguments"} {
		if s, ok := m[k].(string); ok {
			c.bytes += int64(len(s))
		}
	}
	for _, k := range []string{"content", "output", "tool_calls", "function", "parts", "toolResult"} {
		if v, ok := m[k]; ok {
			c.add(refTexts(v, level+1))
		}
	}
	media := mediaNone
	if t, ok := m["type"].(string); ok {
		media = mediaOf([]byte(t))
	}
	if media == mediaNone {
		for _, k := range mediaKeys {
			if strings.Contains(k, "_") {
				continue // renamed by canonicalNames
			}
			v, ok := m[k]
			if !ok {
				continue
			}
			mk := mediaFile
			switch k {
			case "image":
				mk = mediaImage
			case "audio":
				mk = mediaAudio
			case "inlineData":
				if o, ok := v.(map[string]any); ok {
					if ms, ok := o["mimeType"].(string); ok {
						mk = mimeMedia([]byte(ms), false)
					}
				}
			}
			media = max(media, mk)
		}
	}
	{
		switch media {
		case mediaImage:
			c.images++
		case mediaAudio:
			c.audio++
		case mediaFile:
			c.files++
		}
	}
	return c
}

// refField is Field over a decoded document.
func refField(body []byte, path string) (string, bool) {
	v, ok := decodeAny(body)
	if !ok || path == "" {
		return "", false
	}
	for _, seg := range strings.Split(path, ".") {
		m, ok := v.(map[string]any)
		if !ok {
			return "", false
		}
		if v, ok = m[seg]; !ok {
			return "", false
		}
	}
	switch v := v.(type) {
	case string:
		return v, true
	case json.Number:
		return string(v), true
	case bool:
		return strconv.FormatBool(v), true
	}
	return "", false
}

// refWantsInjection decides whether InjectIncludeUsage should change body.
func refWantsInjection(api API, body []byte) bool {
	if api != APIOpenAIChat && api != APIOpenAICompletions {
		return false
	}
	v, ok := decodeAny(body)
	m, isObj := v.(map[string]any)
	if !ok || !isObj || m["stream"] != true {
		return false
	}
	switch so := m["stream_options"].(type) {
	case nil:
		return true
	case map[string]any:
		iu, present := so["include_usage"]
		return !present || iu == nil
	}
	return false
}

// refUsage is UsageScanner over documents decoded whole. comparable is false
// when the body holds a malformed document that mentions a string: what the
// scanner makes of the partial numbers in it has no reference.
func refUsage(api API, contentType string, body []byte) (u Usage, comparable bool) {
	var t tally
	mode := modeSniff
	mt, _, _ := strings.Cut(contentType, ";")
	switch strings.ToLower(strings.TrimSpace(mt)) {
	case "text/event-stream":
		mode = modeSSE
	case "application/json":
		mode = modeJSON
	}
	if mode == modeSniff {
		trimmed := bytes.TrimLeft(body, " \t\r\n")
		if len(trimmed) == 0 {
			return t.usage(api), true
		}
		mode = modeSSE
		if trimmed[0] == '{' || trimmed[0] == '[' {
			mode = modeJSON
		}
	}
	sse := mode == modeSSE
	tree := treeFor(api, sse)
	comparable = true
	doc := func(data []byte, event string) {
		v, ok := decodeAny(data)
		if !ok {
			if bytes.IndexByte(data, '"') >= 0 {
				comparable = false
			}
			t.add(api, sse, false, []byte(event), 0, &[numUsageSlots]int64{}, 0)
			return
		}
		var r refDoc
		r.walk(tree, 1, v)
		typ := event
		if r.typeSet && len(r.typ) <= len(jsonStream{}.typeBuf) {
			typ = r.typ
		}
		t.add(api, sse, true, []byte(typ), r.has, &r.vals, r.content)
	}
	if !sse {
		if len(bytes.TrimSpace(body)) > 0 {
			doc(body, "")
		}
		return t.usage(api), comparable
	}
	body = bytes.TrimPrefix(body, []byte(utf8BOM))
	var data [][]byte
	var event string
	dispatch := func() {
		if len(data) > 0 {
			doc(bytes.Join(data, []byte("\n")), event)
		}
		data, event = nil, ""
	}
	for len(body) > 0 {
		var line []byte
		if end := indexEOL(body); end < 0 {
			line, body = body, nil
		} else {
			line = body[:end]
			term := body[end]
			body = body[end+1:]
			if term == '\r' && len(body) > 0 && body[0] == '\n' {
				body = body[1:]
			}
		}
		if len(line) == 0 {
			dispatch()
			continue
		}
		if line[0] == ':' {
			continue
		}
		name, value, _ := bytes.Cut(line, []byte(":"))
		value = bytes.TrimPrefix(value, []byte(" "))
		switch string(name) {
		case "data":
			data = append(data, value)
		case "event":
			event = string(value)
			if len(event) > len(sseParser{}.event) {
				event = ""
			}
		}
	}
	dispatch()
	return t.usage(api), comparable
}

type refDoc struct {
	has     uint32
	vals    [numUsageSlots]int64
	content int64
	typ     string
	typeSet bool
}

func (r *refDoc) walk(tree pathTree, n uint8, v any) {
	node := &tree[n]
	switch node.kind {
	case nodeObject:
		m, ok := v.(map[string]any)
		if !ok {
			return
		}
		if node.mark {
			r.has |= 1 << (errPresentShift + node.slot)
		}
		for k, name := range node.keys {
			if c, ok := m[name]; ok {
				r.walk(tree, node.kids[k], c)
			}
		}
	case nodeArray:
		a, ok := v.([]any)
		if !ok {
			return
		}
		for _, e := range a {
			r.walk(tree, node.elem, e)
		}
	case nodeNumber:
		num, ok := v.(json.Number)
		if !ok {
			return
		}
		x, err := strconv.ParseUint(string(num), 10, 64)
		if err != nil || x > maxCount {
			return
		}
		r.vals[node.slot] = int64(x)
		r.has |= 1 << node.slot
	case nodeMillis:
		num, ok := v.(json.Number)
		if !ok || strings.ContainsAny(string(num), "-eE") {
			return
		}
		// Seconds to milliseconds, rounded up, in exact arithmetic.
		sec, ok := new(big.Rat).SetString(string(num))
		if !ok {
			return
		}
		ms := new(big.Rat).Mul(sec, big.NewRat(1000, 1))
		q, rem := new(big.Int).QuoRem(ms.Num(), ms.Denom(), new(big.Int))
		if rem.Sign() > 0 {
			q.Add(q, big.NewInt(1))
		}
		if !q.IsInt64() || q.Int64() > maxCount {
			return
		}
		r.vals[node.slot] = q.Int64()
		r.has |= 1 << node.slot
	case nodeText:
		if s, ok := v.(string); ok {
			r.content += int64(len(s))
		}
	case nodeType:
		if s, ok := v.(string); ok {
			r.typ, r.typeSet = s, true
		}
	case nodeErr:
		if s, ok := v.(string); ok {
			r.has |= errClassBit(classifyErrorCode([]byte(s)), node.slot)
		}
	}
}
