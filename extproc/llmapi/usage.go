package llmapi

// The usage scanner's state machine in one file: its modes (JSON, SSE, AWS event stream), error
// detection and the tally of usage fields are driven byte by byte on the hot path, together.

import (
	"bytes"
	"errors"
	"strings"
)

// Usage is what a response reported about its token use. It is plain data,
// safe for concurrent reads.
type Usage struct {
	// PromptTokens is the input the upstream billed. For Anthropic it is
	// input_tokens + cache_read_input_tokens + cache_creation_input_tokens,
	// because all three are input the model read; for Bedrock Converse likewise
	// inputTokens + cacheReadInputTokens + cacheWriteInputTokens.
	PromptTokens int64
	// CompletionTokens is the output, reasoning included: for Gemini
	// candidatesTokenCount + thoughtsTokenCount.
	CompletionTokens int64
	// TotalTokens is the reported total, or PromptTokens+CompletionTokens when
	// the response did not report one.
	TotalTokens int64
	// CachedTokens is the part of PromptTokens served from a prompt cache.
	CachedTokens int64
	// ReasoningTokens is the part of CompletionTokens spent reasoning.
	ReasoningTokens int64
	// AudioMillis is the audio an audio transcription or translation reports it was billed
	// for by duration ({"usage":{"type":"duration","seconds":9.2}}), in milliseconds rounded
	// up; 0 when it reported none. Such a usage is complete (Known) with no tokens.
	AudioMillis int64
	// Known reports that a complete usage (input and output counts) came in a
	// well-formed document. When it is false the counts above are whatever
	// partial numbers were seen, which may be none.
	Known bool
	// PromptKnown reports that PromptTokens came from a well-formed document,
	// for example an Anthropic message_start seen before the stream ended
	// without its message_delta.
	PromptKnown bool
	// ContentBytes is the unescaped size of the generated text seen (message
	// text, refusals, reasoning text, tool call arguments), for estimating the
	// output of a response that ended without usage.
	ContentBytes int64
	// Error is the kind of the first error the body reported although its
	// status said success: an error event in a stream (an OpenAI chunk with
	// an "error" object, Anthropic's "error" event, the Responses API's
	// "error" and "response.failed" events) or a JSON body with a top-level
	// "error" object. ErrorNone when there was none. Only complete, valid
	// documents count.
	Error ErrorKind
}

// ErrorKind classifies an error a response body reported by its type or
// code string. It is a small value type and safe for concurrent use.
type ErrorKind uint8

const (
	// ErrorNone: the body reported no error.
	ErrorNone ErrorKind = iota
	// ErrorServer: the provider failed the call (overloaded_error,
	// server_error, api_error, …), or the error named no type or code this
	// package knows.
	ErrorServer
	// ErrorRateLimited: a rate limit (a type or code containing
	// "rate_limit": rate_limit_exceeded, rate_limit_error; Azure OpenAI's
	// code "429"; Google's RESOURCE_EXHAUSTED; AWS's ThrottlingException).
	ErrorRateLimited
	// ErrorClient: the request was at fault (invalid_request_error,
	// authentication_error, permission_error, not_found_error,
	// request_too_large, context_length_exceeded, …).
	ErrorClient
)

// String returns the stable name of k for logs and metrics.
func (k ErrorKind) String() string {
	switch k {
	case ErrorServer:
		return "server"
	case ErrorRateLimited:
		return "rate_limited"
	case ErrorClient:
		return "client"
	}
	return "none"
}

// Classes of an error code string, each with its bit group in has.
const (
	errUnknown = iota
	errRate
	errServer
	errClient
)

// maxErrCode is the longest error code string that is classified; a longer
// one is unknown (what the streaming parser keeps of a string is bounded).
const maxErrCode = 32

// classifyErrorCode returns the class of an error's type or code string.
func classifyErrorCode(b []byte) int {
	if len(b) > maxErrCode {
		return errUnknown
	}
	if bytes.Contains(b, []byte("rate_limit")) || bytes.Contains(b, []byte("hrottling")) {
		return errRate
	}
	switch string(b) {
	case "overloaded_error", "overloaded", "server_error", "api_error", "internal_error", "internal_server_error",
		"service_unavailable", "server_overloaded", "timeout_error",
		// Google's status names.
		"INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "UNKNOWN", "ABORTED",
		// AWS's exceptions, as ConverseStream names them (the event stream spells them
		// with a lower-case first letter).
		"internalServerException", "InternalServerException", "serviceUnavailableException", "ServiceUnavailableException",
		"modelStreamErrorException", "ModelStreamErrorException", "modelTimeoutException", "ModelTimeoutException",
		"modelNotReadyException", "ModelNotReadyException":
		return errServer
	case "invalid_request_error", "invalid_request", "authentication_error", "permission_error", "not_found_error",
		"request_too_large", "context_length_exceeded", "invalid_prompt", "invalid_api_key", "billing_error",
		"insufficient_quota", "content_filter",
		"INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED", "NOT_FOUND", "UNAUTHENTICATED", "OUT_OF_RANGE",
		"validationException", "ValidationException", "accessDeniedException", "AccessDeniedException",
		"resourceNotFoundException", "ResourceNotFoundException", "modelErrorException", "ModelErrorException":
		return errClient
	case "RESOURCE_EXHAUSTED",
		// Azure OpenAI's code for every rate or quota limit is the status itself.
		"429":
		return errRate
	}
	return errUnknown
}

// errClassBit is the has bit of error leaf slot for class c (0 for unknown).
func errClassBit(c int, slot uint8) uint32 {
	switch c {
	case errRate:
		return 1 << (errRateShift + slot)
	case errServer:
		return 1 << (errServerShift + slot)
	case errClient:
		return 1 << (errClientShift + slot)
	}
	return 0
}

// errorEvent reports whether an SSE event's type says it reports an error.
func errorEvent(api API, typ []byte) bool {
	return string(typ) == "error" || (api == APIOpenAIResponses && string(typ) == "response.failed")
}

// errorKind classifies the error of a document that reported one, from the
// classes of its error codes.
func errorKind(has uint32) ErrorKind {
	switch {
	case has&errRateBits != 0:
		return ErrorRateLimited
	case has&errServerBits != 0:
		return ErrorServer
	case has&errClientBits != 0:
		return ErrorClient
	}
	return ErrorServer
}

// Errors reported by UsageScanner.Err, checked with errors.Is. They do not
// stop a scan from returning the usage seen before them.
var (
	// ErrUnsupportedEncoding means the response used a content-encoding other
	// than identity, gzip or deflate; its body is not read.
	ErrUnsupportedEncoding = errors.New("llmapi: unsupported content-encoding")
	// ErrCorruptCompression means the compressed body could not be decoded
	// (bad data, checksum mismatch, a decoded size above 256 MiB, or a stream
	// that needs more than 64 KiB of compressed input before its next decoded
	// bytes, which no encoder writes by itself); what was decoded before the
	// problem still counts. The error also wraps the decoder's own error,
	// such as gzip.ErrChecksum, when there is one.
	ErrCorruptCompression = errors.New("llmapi: corrupt compressed response body")
)

// Framing of a response body.
const (
	modeSniff  uint8 = iota // decide from the first non-blank byte
	modeJSON                // one JSON document
	modeSSE                 // a text/event-stream of JSON documents
	modeIgnore              // not readable (unsupported encoding)
	modeArray               // a JSON array streamed one document per element (Gemini)
	modeAWS                 // AWS's binary event stream of JSON documents (Bedrock)
)

// UsageScanner extracts usage from a response body delivered in chunks split
// anywhere: inside an SSE line, inside "data:", inside a JSON string or
// number. It never buffers the body: it keeps a few kilobytes of parser state
// (among them a copy of one recent event of at most 2 KiB, against which the
// events that repeat its shape are read). A compressed body also holds a
// decoder from the standard library (its 32 KiB window and tables), up to
// 80 KiB of compressed input not yet decoded and an 8 KiB run of decoded
// output: about 55 KiB for a short response, 135 KiB at most, pooled across
// responses.
//
// The zero value is not ready; call Reset. A UsageScanner is not safe for
// concurrent use: keep one per response stream. It can be reused for another
// response after Reset.
type UsageScanner struct {
	api      API
	mode     uint8
	sse      bool
	tree     pathTree
	finished bool
	closed   bool
	inDoc    bool
	jsonSeen bool // a JSON body: some of it was read
	indented bool // sniffing: the blanks skipped so far end with a space or tab, not a line end
	err      error
	dec      *decompressor

	tally  tally
	result Usage

	events sseParser
	array  arrayParser
	aws    awsEvents
	chunk  []byte // an InvokeModelWithResponseStream chunk's decoded event; kept across Reset
	whole  docResult
	shape  eventShape
	doc    jsonStream
	// model finds the model the response names, when asked to (SniffModel).
	model modelSniffer
}

// tally merges the documents of one response.
type tally struct {
	vals        [groupSize]int64
	has         uint32
	known       bool
	promptKnown bool
	startSeen   bool // Anthropic: a valid message_start with input_tokens
	outSeen     bool // Anthropic: a valid message_delta with output_tokens
	content     int64
	err         ErrorKind // the first error reported
}

// Reset prepares the scanner for a response of api with the given
// content-type and content-encoding header values. text/event-stream is read
// as SSE and JSON types as one JSON document; anything else (or no header) is
// decided by the first non-blank byte of the body. gzip, x-gzip and deflate
// (zlib, or raw deflate) are decoded as the body arrives, 64 KiB behind it
// (see decompressor); another encoding makes the body unreadable, which Err
// reports. Like every method of UsageScanner it is not safe for
// concurrent use.
func (s *UsageScanner) Reset(api API, contentType, contentEncoding string) {
	s.Close()
	buf := s.shape.doc[:0] // a template from the last response is no use, its buffer is
	modelBuf, chunk, aws := s.model.buf[:0], s.chunk[:0], s.aws
	*s = UsageScanner{api: api, err: treesErr}
	s.shape.doc = buf
	s.model.buf, s.chunk, s.aws = modelBuf, chunk, aws
	s.aws.reset()
	mt, _, _ := strings.Cut(contentType, ";")
	mt = strings.TrimSpace(mt)
	switch {
	case strings.EqualFold(mt, "text/event-stream"):
		s.setMode(modeSSE)
	case api == APIBedrockConverseStream || api == APIBedrockInvokeStream:
		if !strings.EqualFold(mt, "application/json") {
			// The event stream (application/vnd.amazon.eventstream); an error is JSON.
			s.setMode(modeAWS)
		} else {
			s.setMode(modeJSON)
		}
	case api == APIGeminiStream && (strings.EqualFold(mt, "application/json") || hasSuffixFold(mt, "+json")):
		s.setMode(modeArray)
	case strings.EqualFold(mt, "application/json") || hasSuffixFold(mt, "+json"):
		s.setMode(modeJSON)
	}
	switch enc := strings.TrimSpace(contentEncoding); {
	case enc == "" || strings.EqualFold(enc, "identity"):
	case strings.EqualFold(enc, "gzip") || strings.EqualFold(enc, "x-gzip"):
		s.dec = getDecompressor(formatGzip)
	case strings.EqualFold(enc, "deflate"):
		s.dec = getDecompressor(formatDeflate)
	default:
		s.mode = modeIgnore
		s.err = ErrUnsupportedEncoding
	}
}

func hasSuffixFold(s, suffix string) bool {
	return len(s) >= len(suffix) && strings.EqualFold(s[len(s)-len(suffix):], suffix)
}

func (s *UsageScanner) setMode(m uint8) {
	s.mode = m
	// The documents of a stream are merged as events, whatever their framing.
	s.sse = m == modeSSE || m == modeArray || m == modeAWS
	s.tree = treeFor(s.api, s.sse)
}

// Write consumes the next chunk of the body. It does constant work per byte,
// never blocks, and does not retain chunk (a compressed body is copied into
// its bounded buffer). It does not allocate once the scanner is warm, except
// inside compress/flate, which allocates small tables for some blocks of a
// compressed body. Writes after Finish or Close are ignored. Not safe for
// concurrent use.
func (s *UsageScanner) Write(chunk []byte) {
	if s.finished || s.closed || len(chunk) == 0 {
		return
	}
	if s.dec != nil {
		if err := s.dec.write(chunk, s); err != nil {
			s.decodeFailed(err)
		}
		return
	}
	s.plain(chunk)
}

func (s *UsageScanner) decodeFailed(err error) {
	if s.err == nil {
		s.err = err
	}
	putDecompressor(s.dec)
	s.dec = nil
	s.mode = modeIgnore
}

// plain consumes decoded body bytes.
func (s *UsageScanner) plain(p []byte) {
	s.model.write(p)
	switch s.mode {
	case modeSniff:
		for len(p) > 0 && (p[0] == ' ' || p[0] == '\n' || p[0] == '\r' || p[0] == '\t') {
			s.indented = p[0] == ' ' || p[0] == '\t'
			p = p[1:]
		}
		if len(p) == 0 {
			return
		}
		if p[0] == '[' && s.api == APIGeminiStream {
			s.setMode(modeArray)
		} else if p[0] == '{' || p[0] == '[' {
			s.setMode(modeJSON)
		} else {
			s.setMode(modeSSE)
			if s.indented {
				// The line began with blanks, which belong to its field name: no field
				// the parser knows, so the line is skipped.
				s.events.state = sseSkip
			}
		}
		s.plain(p)
	case modeJSON:
		if !s.inDoc {
			s.inDoc = true
			s.jsonSeen = true
			s.doc.begin(s.tree)
		}
		s.doc.feed(p)
	case modeSSE:
		s.events.feed(p, s)
	case modeArray:
		s.array.feed(p, s)
	case modeAWS:
		s.aws.feed(p, s)
		if s.aws.err != nil && s.err == nil {
			s.err = s.aws.err
		}
	}
}

// awsEvent takes a decoded event of a Bedrock stream: ConverseStream's JSON documents, typed
// by the event's name, or InvokeModelWithResponseStream's chunks, each an Anthropic event.
func (s *UsageScanner) awsEvent(typ, payload []byte) {
	if s.api == APIBedrockInvokeStream {
		if string(typ) != "chunk" {
			return
		}
		var ok bool
		if s.chunk, ok = invokeChunk(s.chunk[:0], payload); !ok {
			return
		}
		s.document(s.chunk, nil)
		return
	}
	s.document(payload, typ)
}

// awsException takes an exception a Bedrock stream reported inside its 200.
func (s *UsageScanner) awsException(typ []byte) {
	if s.tally.err == ErrorNone {
		s.tally.err = errorKind(errClassBit(classifyErrorCode(typ), 0))
	}
}

// document reads one whole document of a stream, of the given event type.
func (s *UsageScanner) document(data, event []byte) {
	if !s.wholeEvent(data, event) {
		s.dataStart()
		s.data(data)
		s.dispatch(event)
	}
}

// dataStart, data and dispatch make the scanner the sink of its SSE parser.
func (s *UsageScanner) dataStart() {
	s.inDoc = true
	s.doc.begin(s.tree)
}

func (s *UsageScanner) data(p []byte) { s.doc.feed(p) }

func (s *UsageScanner) dispatch(event []byte) {
	s.inDoc = false
	valid := s.doc.finish()
	s.merge(valid, event, &s.doc.docResult)
}

// wholeEvent takes an event whose only data line is all of data. It reads it
// against the previous event's shape when it fits, and otherwise parses it in
// place, both several times faster than streaming it. It reports false,
// having done nothing, when the data is not valid JSON: the caller then
// streams it as usual so that partial results come out the same however the
// event was split.
func (s *UsageScanner) wholeEvent(data, event []byte) bool {
	if content, ok := s.shape.fit(data); ok {
		r := &s.shape.res
		s.inDoc = false
		s.tally.add(s.api, s.sse, true, r.typ(event), r.has, &r.vals, content)
		return true
	}
	d := &s.whole
	*d = docResult{}
	var rec *eventShape
	if s.shape.beginLearn(data) {
		rec = &s.shape
	}
	if !scanDocRec(s.tree, data, d, rec) {
		return false
	}
	if rec != nil {
		s.shape.learn(data, d)
	}
	s.inDoc = false
	s.merge(true, event, d)
	return true
}

// Finish ends the body, whether it ended normally or was cut short, and
// returns what was seen. It is idempotent: later calls return the same Usage.
// It releases the decoder of a compressed body. Not safe for concurrent use.
func (s *UsageScanner) Finish() Usage {
	if s.finished {
		return s.result
	}
	if s.dec != nil && !s.closed {
		if err := s.dec.finish(s); err != nil {
			s.decodeFailed(err)
		}
	}
	switch s.mode {
	case modeSSE:
		s.events.end(s)
	case modeArray:
		s.array.end(s)
	case modeJSON:
		if s.inDoc {
			s.inDoc = false
			valid := s.doc.finish()
			s.merge(valid, nil, &s.doc.docResult)
		}
	}
	s.finished = true
	s.result = s.tally.usage(s.api)
	s.Close()
	return s.result
}

// Close releases the decoder of a compressed body without reading further,
// for a stream that ended early. It is idempotent and may be called before or
// after Finish; Finish after Close reports what was seen before it. Not safe
// for concurrent use.
func (s *UsageScanner) Close() {
	if s.dec != nil {
		putDecompressor(s.dec)
		s.dec = nil
	}
	s.closed = true
}

// FirstToken reports whether the body read so far carried the first of the
// response's output: in a stream, a complete event with generated text
// (message text, a refusal, reasoning, tool call arguments; an event that only
// opens the message, such as a role chunk or Anthropic's message_start, does
// not count); in a JSON body, its first byte. A compressed body shows it once
// the bytes are decoded. Not safe for concurrent use.
func (s *UsageScanner) FirstToken() bool {
	return s.tally.content > 0 || s.jsonSeen
}

// Streaming reports whether the body is read as a text/event-stream. Not safe
// for concurrent use.
func (s *UsageScanner) Streaming() bool { return s.sse }

// ContentBytes returns the size of the generated text seen so far. Not safe
// for concurrent use.
func (s *UsageScanner) ContentBytes() int64 { return s.tally.content }

// Err reports why part of the body could not be read (an unsupported or
// corrupt encoding), or nil. Malformed JSON or SSE is not an error here: it
// shows as Usage.Known being false. Not safe for concurrent use.
func (s *UsageScanner) Err() error { return s.err }

// Event types that carry usage or generated text in the streaming formats.
func responsesUsageEvent(t []byte) bool {
	switch string(t) {
	case "response.completed", "response.incomplete", "response.failed":
		return true
	}
	return false
}

func responsesTextEvent(t []byte) bool {
	switch string(t) {
	case "response.output_text.delta", "response.refusal.delta",
		"response.reasoning_text.delta", "response.reasoning_summary_text.delta",
		"response.function_call_arguments.delta":
		return true
	}
	return false
}

// merge folds the document just parsed into the tally. event is the SSE event
// type; the document's own "type" member takes precedence over it, since
// proxies drop event lines more often than they rewrite JSON.
func (s *UsageScanner) merge(valid bool, event []byte, d *docResult) {
	s.tally.add(s.api, s.sse, valid, d.typ(event), d.has, &d.vals, d.content)
}

var (
	_ eventSink = (*UsageScanner)(nil)
	_ plainSink = (*UsageScanner)(nil)
	_ awsSink   = (*UsageScanner)(nil)
)

// add folds one document's findings into the tally. It is shared with the
// tests' reference implementation so that both agree on the rules and differ
// only in how documents are parsed.
func (t *tally) add(api API, sse bool, valid bool, typ []byte, has uint32, vals *[numUsageSlots]int64, content int64) {
	if valid && t.err == ErrorNone && (has&errPresentBits != 0 || (sse && errorEvent(api, typ))) {
		t.err = errorKind(has)
	}
	group := -1
	text := true
	anthropicStart, anthropicDelta := false, false
	switch {
	case !sse:
		group = 0
	case api == APIOpenAIResponses:
		if responsesUsageEvent(typ) {
			group = 1
		}
		text = responsesTextEvent(typ)
	case api.Anthropic():
		switch string(typ) {
		case "message_start":
			group, anthropicStart = 1, true
		case "message_delta":
			group, anthropicDelta = 0, true
		}
		text = string(typ) == "content_block_delta"
	default:
		group = 0
	}
	if text {
		t.content += content
	}
	if group < 0 {
		return
	}
	g := has >> (group * groupSize) & (1<<groupSize - 1)
	gv := vals[group*groupSize : (group+1)*groupSize]
	hasPrompt := g&(1<<slotPrompt) != 0
	hasCompletion := g&(1<<slotCompletion) != 0

	if api.Anthropic() && sse {
		if !valid && t.known {
			return
		}
		t.take(g, gv)
		if valid && anthropicStart && hasPrompt {
			t.startSeen, t.promptKnown = true, true
		}
		if valid && anthropicDelta && hasCompletion {
			t.outSeen = true
		}
		t.known = t.startSeen && t.outSeen
		return
	}

	// Gemini leaves out a count that is zero, as proto3's JSON does: a prompt and a total
	// make a complete usage in a whole response. A stream's chunks all carry a prompt and a
	// total, its output count only once there is output.
	hasTotal := g&(1<<slotTotal) != 0
	complete := hasPrompt && (hasCompletion || api == APIOpenAIEmbeddings || (api.gemini() && hasTotal && !sse)) ||
		g&(1<<slotMillis) != 0
	switch {
	case valid && complete:
		t.vals = [groupSize]int64{}
		t.has = 0
		t.take(g, gv)
		t.known, t.promptKnown = true, true
	case !t.known:
		t.take(g, gv)
		if valid && hasPrompt {
			t.promptKnown = true
		}
	}
}

// take copies the present slots of a group.
func (t *tally) take(g uint32, gv []int64) {
	for k := range groupSize {
		if g&(1<<k) != 0 {
			t.vals[k] = gv[k]
			t.has |= 1 << k
		}
	}
}

func (t *tally) usage(api API) Usage {
	u := Usage{
		PromptTokens:     t.vals[slotPrompt],
		CompletionTokens: t.vals[slotCompletion],
		CachedTokens:     t.vals[slotCached],
		ReasoningTokens:  t.vals[slotReasoning],
		AudioMillis:      t.vals[slotMillis],
		Known:            t.known,
		PromptKnown:      t.promptKnown || t.known,
		ContentBytes:     t.content,
		Error:            t.err,
	}
	switch {
	case api.Anthropic():
		u.PromptTokens += t.vals[slotCached] + t.vals[slotCacheCreation]
		u.TotalTokens = u.PromptTokens + u.CompletionTokens
		return u
	case api == APIBedrockConverse || api == APIBedrockConverseStream:
		// inputTokens leaves out the cache's reads and writes, which are input too.
		u.PromptTokens += t.vals[slotCached] + t.vals[slotCacheCreation]
	case api.gemini():
		// candidatesTokenCount leaves out the thinking, which is output too.
		u.CompletionTokens += u.ReasoningTokens
	}
	if t.has&(1<<slotTotal) != 0 {
		u.TotalTokens = t.vals[slotTotal]
	} else {
		u.TotalTokens = u.PromptTokens + u.CompletionTokens
	}
	return u
}
