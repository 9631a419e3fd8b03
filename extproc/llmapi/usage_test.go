package llmapi

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"
)

// sampleUsage is what each recorded body in testdata reports.
var sampleUsage = map[string]Usage{
	"openai_chat.sse":        {PromptTokens: 1017, CompletionTokens: 12, TotalTokens: 1029, CachedTokens: 896, Known: true, PromptKnown: true, ContentBytes: 35},
	"openai_chat.json":       {PromptTokens: 1117, CompletionTokens: 46, TotalTokens: 1163, Known: true, PromptKnown: true, ContentBytes: 94},
	"openai_completions.sse": {PromptTokens: 5, CompletionTokens: 7, TotalTokens: 12, Known: true, PromptKnown: true, ContentBytes: 15},
	"openai_embeddings.json": {PromptTokens: 8, TotalTokens: 8, Known: true, PromptKnown: true},
	"responses.sse":          {PromptTokens: 37, CompletionTokens: 11, TotalTokens: 48, Known: true, PromptKnown: true, ContentBytes: 10},
	"responses.json":         {PromptTokens: 328, CompletionTokens: 52, TotalTokens: 380, CachedTokens: 128, ReasoningTokens: 16, Known: true, PromptKnown: true, ContentBytes: 53},
	"anthropic.sse":          {PromptTokens: 2620, CompletionTokens: 15, TotalTokens: 2635, CachedTokens: 2048, Known: true, PromptKnown: true, ContentBytes: 15},
	"anthropic.json":         {PromptTokens: 3119, CompletionTokens: 503, TotalTokens: 3622, CachedTokens: 1024, Known: true, PromptKnown: true, ContentBytes: 35},
}

func TestUsageSamples(t *testing.T) {
	for _, s := range sampleFiles {
		body := readSample(t, s.file)
		want := sampleUsage[s.file]
		t.Run(s.name, func(t *testing.T) {
			for _, ct := range []string{s.contentType, ""} {
				got, err := scanChunks(s.api, ct, "", body)
				if got != want || err != nil {
					t.Errorf("content-type %q: got %+v (%v), want %+v", ct, got, err, want)
				}
			}
			if ref, ok := refUsage(s.api, s.contentType, body); !ok || ref != want {
				t.Errorf("reference disagrees with the expectation: %+v", ref)
			}
		})
	}
}

// TestUsageEverySplitPoint cuts each sample in two at every byte, and in
// three at a stride, plain and gzip-compressed.
func TestUsageEverySplitPoint(t *testing.T) {
	for _, s := range sampleFiles {
		body := readSample(t, s.file)
		want := sampleUsage[s.file]
		t.Run(s.name, func(t *testing.T) {
			for i := range len(body) + 1 {
				if got, _ := scanChunks(s.api, s.contentType, "", body[:i], body[i:]); got != want {
					t.Fatalf("split at %d: got %+v, want %+v", i, got, want)
				}
			}
			stride := max(7, len(body)/50)
			for i := 0; i < len(body); i += stride {
				for j := i; j < len(body); j += stride + 6 {
					if got, _ := scanChunks(s.api, s.contentType, "", body[:i], body[i:j], body[j:]); got != want {
						t.Fatalf("split at %d and %d: got %+v, want %+v", i, j, got, want)
					}
				}
			}
			if strings.HasSuffix(s.file, ".sse") {
				for _, eol := range []string{"\r\n", "\r"} {
					alt := bytes.ReplaceAll(body, []byte("\n"), []byte(eol))
					for i := range len(alt) + 1 {
						if got, _ := scanChunks(s.api, s.contentType, "", alt[:i], alt[i:]); got != want {
							t.Fatalf("%q line ends, split at %d: got %+v, want %+v", eol, i, got, want)
						}
					}
				}
			}
			gz := gzipBytes(t, body, 6)
			for i := range len(gz) + 1 {
				got, err := scanChunks(s.api, s.contentType, "gzip", gz[:i], gz[i:])
				if got != want || err != nil {
					t.Fatalf("gzip split at %d: got %+v (%v), want %+v", i, got, err, want)
				}
			}
		})
	}
}

func TestUsageCases(t *testing.T) {
	chatUsage := `{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}`
	tests := []struct {
		name string
		api  API
		ct   string
		body string
		want Usage
	}{
		{
			name: "chat json without usage",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"choices":[{"message":{"content":"abc"}}]}`,
			want: Usage{ContentBytes: 3},
		},
		{
			name: "usage null",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"choices":[{"message":{"content":"abc"}}],"usage":null}`,
			want: Usage{ContentBytes: 3},
		},
		{
			name: "usage without completion is partial",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":10}}`,
			want: Usage{PromptTokens: 10, TotalTokens: 10, PromptKnown: true},
		},
		{
			name: "negative count ignored",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":10,"completion_tokens":-5}}`,
			want: Usage{PromptTokens: 10, TotalTokens: 10, PromptKnown: true},
		},
		{
			name: "absurd count ignored",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":1000000000001,"completion_tokens":5}}`,
			want: Usage{CompletionTokens: 5, TotalTokens: 5},
		},
		{
			name: "largest believable count",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":1000000000000,"completion_tokens":5}}`,
			want: Usage{PromptTokens: 1e12, CompletionTokens: 5, TotalTokens: 1e12 + 5, Known: true, PromptKnown: true},
		},
		{
			name: "huge digit string ignored",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":99999999999999999999999999999999,"completion_tokens":5}}`,
			want: Usage{CompletionTokens: 5, TotalTokens: 5},
		},
		{
			name: "fractional and exponent counts ignored",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":1.5,"completion_tokens":1e3}}`,
			want: Usage{},
		},
		{
			name: "string counts ignored",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":"10","completion_tokens":5}}`,
			want: Usage{CompletionTokens: 5, TotalTokens: 5},
		},
		{
			name: "invalid json keeps partial numbers",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":10,"completion_tokens":20},"x":tru}`,
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30},
		},
		{
			name: "truncated json keeps partial numbers and text",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"choices":[{"message":{"content":"abcdef`,
			want: Usage{ContentBytes: 6},
		},
		{
			name: "trailing garbage makes the document invalid",
			api:  APIOpenAIChat, ct: "application/json",
			body: chatUsage + `x`,
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30},
		},
		{
			name: "control character in a string is invalid",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":10,"completion_tokens":20},"x":"a` + "\x01" + `"}`,
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30},
		},
		{
			name: "duplicate usage: the last wins whole",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3},"usage":{"prompt_tokens":5,"completion_tokens":6}}`,
			want: Usage{PromptTokens: 5, CompletionTokens: 6, TotalTokens: 11, Known: true, PromptKnown: true},
		},
		{
			name: "duplicate content: the last wins",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"choices":[{"message":{"content":"abcdef","content":"ab"}},{"text":"xyz"}]}`,
			want: Usage{ContentBytes: 5},
		},
		{
			name: "escaped member names",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"\u0075sage":{"prompt_tokens":1,"completion\u005ftokens":2}}`,
			want: Usage{PromptTokens: 1, CompletionTokens: 2, TotalTokens: 3, Known: true, PromptKnown: true},
		},
		{
			name: "tool call arguments and refusals count as content",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"choices":[{"message":{"content":null,"refusal":"no","tool_calls":[{"function":{"name":"f","arguments":"{\"a\":1}"}}]}}]}`,
			want: Usage{ContentBytes: 2 + 7},
		},
		{
			name: "sse: usage on the last content chunk",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n" +
				"data: {\"choices\":[{\"delta\":{\"content\":\"!\"}}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n" +
				"data: [DONE]\n\n",
			want: Usage{PromptTokens: 3, CompletionTokens: 2, TotalTokens: 5, Known: true, PromptKnown: true, ContentBytes: 3},
		},
		{
			name: "sse: cumulative usage, the last complete one wins",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: "data: " + `{"usage":{"prompt_tokens":3,"completion_tokens":1}}` + "\n\n" +
				"data: " + `{"usage":{"prompt_tokens":3,"completion_tokens":9}}` + "\n\n" +
				"data: " + `{"usage":{"prompt_tokens":3}}` + "\n\n",
			want: Usage{PromptTokens: 3, CompletionTokens: 9, TotalTokens: 12, Known: true, PromptKnown: true},
		},
		{
			name: "sse: data without a space, CRLF, comments and ids",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: ": keep-alive\r\nid: 1\r\nretry: 10\r\ndata:" + chatUsage + "\r\n\r\n",
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30, Known: true, PromptKnown: true},
		},
		{
			name: "sse: CR line endings",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: "data: " + chatUsage + "\r\r",
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30, Known: true, PromptKnown: true},
		},
		{
			name: "sse: multi-line data is joined",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: "data: {\"usage\":\ndata: {\"prompt_tokens\":10,\ndata:\"completion_tokens\":20}}\n\n",
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30, Known: true, PromptKnown: true},
		},
		{
			name: "sse: a byte order mark is skipped",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: utf8BOM + "data: " + chatUsage + "\n\n",
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30, Known: true, PromptKnown: true},
		},
		{
			name: "sse: the last event without a blank line still counts",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: "data: " + chatUsage,
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30, Known: true, PromptKnown: true},
		},
		{
			name: "sse: lines without data are ignored",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: chatUsage + "\n\n" + "dat: " + chatUsage + "\n\n",
			want: Usage{},
		},
		{
			name: "sse: ending mid-event keeps partial numbers",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: "data: {\"choices\":[{\"delta\":{\"content\":\"hello\"}}]}\n\ndata: {\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":20,",
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30, ContentBytes: 5},
		},
		{
			name: "sse: an invalid event does not undo a complete usage",
			api:  APIOpenAIChat, ct: "text/event-stream",
			body: "data: " + chatUsage + "\n\ndata: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1},x\n\n",
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30, Known: true, PromptKnown: true},
		},
		{
			name: "sniffed sse",
			api:  APIOpenAIChat, ct: "",
			body: "\n\ndata: " + chatUsage + "\n\n",
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30, Known: true, PromptKnown: true},
		},
		{
			name: "sniffed json",
			api:  APIOpenAIChat, ct: "text/plain",
			body: "  " + chatUsage,
			want: Usage{PromptTokens: 10, CompletionTokens: 20, TotalTokens: 30, Known: true, PromptKnown: true},
		},
		{
			name: "error body",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}`,
			want: Usage{Error: ErrorRateLimited},
		},
		{
			name: "empty body",
			api:  APIOpenAIChat, ct: "application/json",
			body: ``,
			want: Usage{},
		},
		{
			name: "responses: usage in an unexpected event is ignored",
			api:  APIOpenAIResponses, ct: "text/event-stream",
			body: "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"abc\",\"response\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":6}},\"usage\":{\"input_tokens\":5,\"output_tokens\":6}}\n\n",
			want: Usage{ContentBytes: 3},
		},
		{
			name: "responses: incomplete response reports usage",
			api:  APIOpenAIResponses, ct: "text/event-stream",
			body: "event: response.incomplete\ndata: {\"type\":\"response.incomplete\",\"response\":{\"status\":\"incomplete\",\"usage\":{\"input_tokens\":5,\"output_tokens\":6,\"total_tokens\":11}}}\n\n",
			want: Usage{PromptTokens: 5, CompletionTokens: 6, TotalTokens: 11, Known: true, PromptKnown: true},
		},
		{
			name: "responses: event lines take one optional space and at most 48 bytes",
			api:  APIOpenAIResponses, ct: "text/event-stream",
			body: "event:response.output_text.delta\ndata:{\"delta\":\"ab\"}\n\n" +
				"event:  response.output_text.delta\ndata: {\"delta\":\"cd\"}\n\n" +
				"event: response.output_text.delta.and.more.and.more.and.more\ndata: {\"delta\":\"ef\"}\n\n" +
				"event: response.refusal.delta\nevent:\ndata: {\"delta\":\"gh\"}\n\n" +
				"event: response.refusal.delta\nevent: response.refusal.delta\ndata:  {\"delta\":\"ij\"}\n\n" +
				"event: response.refusal.delta\ndata: {\"delta\":\"kl\"}\n\n" +
				"data: {\"delta\":\"mn\"}\n\n" +
				"event: response.completed\ndata: {\"response\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n",
			want: Usage{PromptTokens: 5, CompletionTokens: 1, TotalTokens: 6, Known: true, PromptKnown: true, ContentBytes: 6},
		},
		{
			name: "responses: the event line names the type when the data does not",
			api:  APIOpenAIResponses, ct: "text/event-stream",
			body: "event: response.failed\ndata: {\"response\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":0}}}\n\n",
			want: Usage{PromptTokens: 5, TotalTokens: 5, Known: true, PromptKnown: true, Error: ErrorServer},
		},
		{
			name: "responses: other deltas are not text",
			api:  APIOpenAIResponses, ct: "text/event-stream",
			body: "data: {\"type\":\"response.audio.delta\",\"delta\":\"AAAA\"}\n\ndata: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{}\"}\n\n",
			want: Usage{ContentBytes: 2},
		},
		{
			name: "anthropic: stream ended before message_delta",
			api:  APIAnthropicMessages, ct: "text/event-stream",
			body: "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":40,\"cache_read_input_tokens\":10,\"output_tokens\":1}}}\n\n" +
				"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hel\"}}\n\n",
			want: Usage{PromptTokens: 50, CompletionTokens: 1, TotalTokens: 51, CachedTokens: 10, PromptKnown: true, ContentBytes: 3},
		},
		{
			name: "anthropic: message_delta output is cumulative, the last wins",
			api:  APIAnthropicMessages, ct: "text/event-stream",
			body: "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":40,\"output_tokens\":1}}}\n\n" +
				"data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":7}}\n\n" +
				"data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9,\"input_tokens\":41}}\n\n",
			want: Usage{PromptTokens: 41, CompletionTokens: 9, TotalTokens: 50, Known: true, PromptKnown: true},
		},
		{
			name: "anthropic: message_delta without message_start",
			api:  APIAnthropicMessages, ct: "text/event-stream",
			body: "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":7}}\n\n",
			want: Usage{CompletionTokens: 7, TotalTokens: 7},
		},
		{
			name: "anthropic: usage in an unexpected event is ignored",
			api:  APIAnthropicMessages, ct: "text/event-stream",
			body: "event: ping\ndata: {\"type\":\"ping\",\"usage\":{\"output_tokens\":7},\"message\":{\"usage\":{\"input_tokens\":3}}}\n\n",
			want: Usage{},
		},
		{
			name: "anthropic: thinking and tool input deltas are content",
			api:  APIAnthropicMessages, ct: "text/event-stream",
			body: "data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hmm\"}}\n\n" +
				"data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\"\"}}\n\n",
			want: Usage{ContentBytes: 3 + 4},
		},
		{
			name: "anthropic: error event mid-stream",
			api:  APIAnthropicMessages, ct: "text/event-stream",
			body: "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
			want: Usage{Error: ErrorServer},
		},
		{
			name: "embeddings: prompt alone is complete",
			api:  APIOpenAIEmbeddings, ct: "application/json",
			body: `{"data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}`,
			want: Usage{PromptTokens: 8, TotalTokens: 8, Known: true, PromptKnown: true},
		},
		{
			name: "surrogate pairs and lone surrogates in content",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"choices":[{"text":"\ud83d\ude00\ud83d\u0041\ude00\ud83d"}]}`,
			want: Usage{ContentBytes: 4 + 3 + 1 + 3 + 3},
		},
		{
			name: "invalid UTF-8 counts as bytes",
			api:  APIOpenAIChat, ct: "application/json",
			body: "{\"choices\":[{\"text\":\"\xff\xfe\"}]}",
			want: Usage{ContentBytes: 2},
		},
		{
			name: "deep nesting is bounded",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":1,"completion_tokens":2},"x":` + strings.Repeat("[", 20000) + strings.Repeat("]", 20000) + `}`,
			want: Usage{PromptTokens: 1, CompletionTokens: 2, TotalTokens: 3},
		},
		{
			name: "nesting at the limit is fine",
			api:  APIOpenAIChat, ct: "application/json",
			body: `{"usage":{"prompt_tokens":1,"completion_tokens":2},"x":` + strings.Repeat("[", maxDepth-1) + strings.Repeat("]", maxDepth-1) + `}`,
			want: Usage{PromptTokens: 1, CompletionTokens: 2, TotalTokens: 3, Known: true, PromptKnown: true},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(tc.body)
			got, err := scanChunks(tc.api, tc.ct, "", body)
			if got != tc.want || err != nil {
				t.Fatalf("got  %+v (%v)\nwant %+v", got, err, tc.want)
			}
			if got, _ := scanChunks(tc.api, tc.ct, "", splitBytes(body)...); got != tc.want {
				t.Fatalf("byte by byte: got %+v", got)
			}
			if ref, ok := refUsage(tc.api, tc.ct, body); ok && utf8.Valid(body) && ref != tc.want {
				t.Fatalf("reference: %+v", ref)
			}
		})
	}
}

// TestUsageLongLine streams a 10 MiB SSE line and a 10 MiB string through
// the scanner without it growing: the usage after them is still found.
func TestUsageLongLine(t *testing.T) {
	long := bytes.Repeat([]byte("abcdefgh"), 10<<20/8)
	tests := []struct {
		name  string
		parts [][]byte
		want  Usage
	}{
		{
			name:  "long content string",
			parts: [][]byte{[]byte(`data: {"choices":[{"delta":{"content":"`), long, []byte("\"}}]}\n\ndata: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n")},
			want:  Usage{PromptTokens: 1, CompletionTokens: 2, TotalTokens: 3, Known: true, PromptKnown: true, ContentBytes: int64(len(long))},
		},
		{
			name:  "long line that is not JSON",
			parts: [][]byte{[]byte("data: "), long, []byte("\n\ndata: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n")},
			want:  Usage{PromptTokens: 1, CompletionTokens: 2, TotalTokens: 3, Known: true, PromptKnown: true},
		},
		{
			name:  "long comment line",
			parts: [][]byte{[]byte(":"), long, []byte("\ndata: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n")},
			want:  Usage{PromptTokens: 1, CompletionTokens: 2, TotalTokens: 3, Known: true, PromptKnown: true},
		},
		{
			name:  "long field name",
			parts: [][]byte{long, []byte(": x\ndata: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n")},
			want:  Usage{PromptTokens: 1, CompletionTokens: 2, TotalTokens: 3, Known: true, PromptKnown: true},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var s UsageScanner
			var got Usage
			allocs := testing.AllocsPerRun(1, func() {
				s.Reset(APIOpenAIChat, "text/event-stream", "")
				for _, p := range tc.parts {
					for len(p) > 0 {
						n := min(len(p), 16<<10)
						s.Write(p[:n])
						p = p[n:]
					}
				}
				got = s.Finish()
			})
			if got != tc.want {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
			if allocs != 0 {
				t.Fatalf("%v allocations while streaming", allocs)
			}
		})
	}
}

func TestUsageEncodings(t *testing.T) {
	body := readSample(t, "anthropic.sse")
	want := sampleUsage["anthropic.sse"]
	var zl, raw bytes.Buffer
	zw := zlib.NewWriter(&zl)
	zw.Write(body)
	zw.Close()
	fw, _ := flate.NewWriter(&raw, 5)
	fw.Write(body)
	fw.Close()
	gz := gzipBytes(t, body, 9)
	corrupt := bytes.Clone(gz)
	corrupt[len(corrupt)-6] ^= 0xff // the CRC
	tests := []struct {
		name, encoding string
		body           []byte
		want           Usage
		err            error
	}{
		{name: "gzip", encoding: "gzip", body: gz, want: want},
		{name: "x-gzip upper case", encoding: " X-GZIP ", body: gz, want: want},
		{name: "gzip stored", encoding: "gzip", body: gzipBytes(t, body, 0), want: want},
		{name: "gzip huffman only", encoding: "gzip", body: gzipBytes(t, body, -2), want: want},
		{name: "two gzip members", encoding: "gzip", body: append(gzipBytes(t, body[:100], 6), gzipBytes(t, body[100:], 1)...), want: want},
		{name: "deflate as zlib", encoding: "deflate", body: zl.Bytes(), want: want},
		{name: "deflate as raw deflate", encoding: "deflate", body: raw.Bytes(), want: want},
		{name: "identity", encoding: "identity", body: body, want: want},
		{name: "bad checksum after the usage", encoding: "gzip", body: corrupt, want: want, err: ErrCorruptCompression},
		{name: "truncated gzip keeps what it decoded", encoding: "gzip", body: gz[:len(gz)-30], want: Usage{PromptTokens: 2620, CompletionTokens: 2, TotalTokens: 2622, CachedTokens: 2048, PromptKnown: true, ContentBytes: 15}, err: ErrCorruptCompression},
		{name: "not gzip", encoding: "gzip", body: body, want: Usage{}, err: ErrCorruptCompression},
		{name: "brotli is not read", encoding: "br", body: body, want: Usage{}, err: ErrUnsupportedEncoding},
		{name: "empty gzip body", encoding: "gzip", body: nil, want: Usage{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, chunks := range [][][]byte{{tc.body}, splitRandom(tc.body, 5), splitBytes(tc.body)} {
				got, err := scanChunks(APIAnthropicMessages, "text/event-stream", tc.encoding, chunks...)
				if got != tc.want || !errors.Is(err, tc.err) || (tc.err == nil) != (err == nil) {
					t.Fatalf("%d chunks: got %+v (%v), want %+v (%v)", len(chunks), got, err, tc.want, tc.err)
				}
			}
		})
	}
}

func TestUsageScannerLifecycle(t *testing.T) {
	body := readSample(t, "openai_chat.sse")
	want := sampleUsage["openai_chat.sse"]
	gz := gzipBytes(t, body, 6)

	t.Run("finish is idempotent and later writes are ignored", func(t *testing.T) {
		var s UsageScanner
		s.Reset(APIOpenAIChat, "text/event-stream", "")
		s.Write(body)
		if got := s.Finish(); got != want {
			t.Fatalf("got %+v", got)
		}
		s.Write([]byte("data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n"))
		if got := s.Finish(); got != want {
			t.Fatalf("second Finish: %+v", got)
		}
		s.Close()
		s.Close()
	})
	t.Run("close before finish releases the decoder", func(t *testing.T) {
		var s UsageScanner
		s.Reset(APIOpenAIChat, "text/event-stream", "gzip")
		s.Write(gz[:len(gz)/2])
		s.Close()
		if s.dec != nil {
			t.Fatal("decoder kept after Close")
		}
		s.Write(gz[len(gz)/2:])
		got := s.Finish()
		if got.Known {
			t.Fatalf("usage after Close: %+v", got)
		}
	})
	t.Run("reset reuses the scanner", func(t *testing.T) {
		var s UsageScanner
		for range 3 {
			s.Reset(APIOpenAIChat, "text/event-stream", "gzip")
			s.Write(gz[:10])
			s.Reset(APIOpenAIChat, "text/event-stream", "gzip")
			s.Write(gz)
			if got := s.Finish(); got != want {
				t.Fatalf("got %+v", got)
			}
		}
	})
	t.Run("steady state allocates only in the decoders", func(t *testing.T) {
		if raceEnabled {
			t.Skip("the decoders are pooled, and sync.Pool drops some of them under the race detector")
		}
		// The scanner itself allocates nothing per compressed response once
		// its decoder is pooled. The standard library's decoders do:
		// compress/gzip copies a header's name and extra field,
		// compress/zlib allocates its Adler-32 state, and compress/flate
		// allocates the overflow tables of every dynamic block whose codes
		// are longer than 9 bits (15 small allocations for a 1.3 MB stream,
		// 27 for 6.5 MB), which bodies this short do not have.
		headerless := func(data []byte) []byte {
			var b bytes.Buffer
			w := gzip.NewWriter(&b)
			w.Write(data)
			w.Close()
			return b.Bytes()
		}
		var zl bytes.Buffer
		zw := zlib.NewWriter(&zl)
		zw.Write(body)
		zw.Close()
		for _, tc := range []struct {
			name, encoding string
			body           []byte
			allocs         float64
		}{
			{"gzip", "gzip", headerless(body), 0},
			{"gzip with a name and an extra field", "gzip", gz, 2},
			{"zlib", "deflate", zl.Bytes(), 1},
			{"raw deflate", "deflate", rawDeflate(body, 6), 0},
		} {
			var s UsageScanner
			allocs := testing.AllocsPerRun(20, func() {
				s.Reset(APIOpenAIChat, "text/event-stream", tc.encoding)
				s.Write(tc.body)
				if u := s.Finish(); u != want {
					t.Fatalf("%s: usage %+v", tc.name, u)
				}
			})
			if allocs > tc.allocs {
				t.Fatalf("%s: %v allocations per response, want at most %v", tc.name, allocs, tc.allocs)
			}
		}
	})
}

func TestUsageEscapedEventTypes(t *testing.T) {
	body := "data: {\"type\":\"message\\u005fstart\",\"message\":{\"usage\":{\"input_tokens\":5}}}\n\n" +
		"data: {\"t\\u0079pe\":\"message_delta\",\"usage\":{\"\\u006futput_tokens\":4}}\n\n"
	want := Usage{PromptTokens: 5, CompletionTokens: 4, TotalTokens: 9, Known: true, PromptKnown: true}
	for _, chunks := range [][][]byte{{[]byte(body)}, splitBytes([]byte(body))} {
		if got, _ := scanChunks(APIAnthropicMessages, "text/event-stream", "", chunks...); got != want {
			t.Fatalf("%d chunks: got %+v", len(chunks), got)
		}
	}
}

// TestUsageLongEventTypesDoNotAllocate pins that event types longer than
// Go's 32-byte conversion buffer are compared without being copied to a
// string on the heap once per event.
func TestUsageLongEventTypesDoNotAllocate(t *testing.T) {
	ev := []byte("event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{}\"}\n\n")
	var s UsageScanner
	s.Reset(APIOpenAIResponses, "text/event-stream", "")
	if n := testing.AllocsPerRun(100, func() { s.Write(ev) }); n != 0 {
		t.Fatalf("%v allocations per event", n)
	}
	if u := s.Finish(); u.ContentBytes != 2*101 {
		t.Fatalf("content %d", u.ContentBytes)
	}
}
