package llmapi

// InjectIncludeUsage makes a streamed OpenAI chat or completions request ask
// for a final usage chunk, so the response always reports what it cost. When
// api is APIOpenAIChat or APIOpenAICompletions, the body is a valid JSON
// object, "stream" is true and stream_options.include_usage is absent or null,
// it returns a new body with "stream_options":{"include_usage":true} added (or
// with "include_usage":true added inside an existing stream_options object)
// and true. Every other byte stays as it was. In any other case, including an
// explicit include_usage of false (the client's choice), it returns body
// unchanged and false. Duplicate keys resolve as in encoding/json: the last
// one is the one looked at and changed.
//
// It allocates only the new body and is safe for concurrent use; body itself
// is never modified.
func InjectIncludeUsage(api API, body []byte) ([]byte, bool) {
	return injectIncludeUsage(api, body, copyBody)
}

func injectIncludeUsage(api API, body []byte, mode editMode) ([]byte, bool) {
	if api != APIOpenAIChat && api != APIOpenAICompletions {
		return body, false
	}
	i := skipWS(body, 0)
	if i >= len(body) || body[i] != '{' {
		return body, false
	}
	var (
		sk        skipper
		kb        keyBuf
		stream    bool
		opts      = -1 // value index of the last stream_options
		optsEnd   int
		closeAt   int // index of the top-level '}'
		ok        bool
		streamSet bool
	)
	it := openObject(body, i)
	for {
		key, esc, v, more := it.next()
		if !more {
			break
		}
		k, _ := decodeKey(&kb, key, esc)
		end := v
		switch string(k) {
		case "stream":
			streamSet = true
			stream = body[v] == 't'
		case "stream_options":
			opts = v
		}
		if end, ok = sk.skip(body, v, 1); !ok {
			return body, false
		}
		if opts == v {
			optsEnd = end
		}
		it.i = end
	}
	if it.bad || skipWS(body, it.i) != len(body) {
		return body, false
	}
	closeAt = it.i - 1
	if !streamSet || !stream {
		return body, false
	}
	return injectAt(body, closeAt, opts, optsEnd, mode)
}

// InjectIncludeUsageAt is InjectIncludeUsage for a body ScanRequest read into f (and nothing
// changed since): it goes straight to the places the scan found instead of reading the body
// again. For a body the scan did not read whole it is InjectIncludeUsage.
func InjectIncludeUsageAt(api API, body []byte, f *RequestFields) ([]byte, bool) {
	return injectIncludeUsageAt(api, body, f, copyBody)
}

func injectIncludeUsageAt(api API, body []byte, f *RequestFields, mode editMode) ([]byte, bool) {
	at := &f.at
	if !at.whole || at.size != len(body) {
		return injectIncludeUsage(api, body, mode)
	}
	if api != APIOpenAIChat && api != APIOpenAICompletions || at.stream == 0 || body[at.stream-1] != 't' {
		return body, false
	}
	return injectAt(body, at.close, at.opts-1, at.optsEnd, mode)
}

// injectAt adds include_usage to a streamed request whose top-level object closes at closeAt
// and whose last stream_options value is body[opts:optsEnd] (opts < 0: none).
func injectAt(body []byte, closeAt, opts, optsEnd int, mode editMode) ([]byte, bool) {
	if opts < 0 {
		return mode.splice(body, closeAt, closeAt, `,"stream_options":{"include_usage":true}`), true
	}
	switch body[opts] {
	case 'n':
		return mode.splice(body, opts, optsEnd, `{"include_usage":true}`), true
	case '{':
	default:
		return body, false
	}
	var (
		sk skipper
		kb keyBuf
		it = openObject(body, opts)
	)
	usage, usageEnd := -1, 0
	members := 0
	for {
		key, esc, v, more := it.next()
		if !more {
			break
		}
		members++
		end, _ := sk.skip(body, v, 2)
		if k, _ := decodeKey(&kb, key, esc); string(k) == "include_usage" {
			usage, usageEnd = v, end
		}
		it.i = end
	}
	switch {
	case usage >= 0 && body[usage] == 'n':
		return mode.splice(body, usage, usageEnd, `true`), true
	case usage >= 0:
		return body, false
	case members == 0:
		return mode.splice(body, opts+1, opts+1, `"include_usage":true`), true
	}
	return mode.splice(body, opts+1, opts+1, `"include_usage":true,`), true
}
