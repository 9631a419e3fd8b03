package llmapi

import (
	"testing"
	"unicode/utf8"
)

// streamErrorCases are error reports inside a successful response, in every
// form the scanner reads, and lookalikes that are not errors.
var streamErrorCases = []struct {
	name string
	api  API
	ct   string
	body string
	want ErrorKind
}{
	{
		name: "openai chunk with an error object after content",
		api:  APIOpenAIChat, ct: "text/event-stream",
		body: "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n" +
			"data: {\"error\":{\"message\":\"The server had an error while processing your request.\",\"type\":\"server_error\",\"param\":null,\"code\":null}}\n\n",
		want: ErrorServer,
	},
	{
		name: "openai rate limit chunk: the code says it",
		api:  APIOpenAIChat, ct: "text/event-stream",
		body: "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n" +
			"data: {\"error\":{\"message\":\"Rate limit reached\",\"type\":\"requests\",\"param\":null,\"code\":\"rate_limit_exceeded\"}}\n\n",
		want: ErrorRateLimited,
	},
	{
		name: "openai-compatible error with a numeric code and no type is a server error",
		api:  APIOpenAIChat, ct: "text/event-stream",
		body: "data: {\"error\":{\"object\":\"error\",\"message\":\"boom\",\"code\":500}}\n\n",
		want: ErrorServer,
	},
	{
		name: "azure rate limit chunk: its code is the status, \"429\"",
		api:  APIOpenAIChat, ct: "text/event-stream",
		body: "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n" +
			"data: {\"error\":{\"code\":\"429\",\"message\":\"Requests to the ChatCompletions_Create Operation have exceeded the token rate limit.\"}}\n\n",
		want: ErrorRateLimited,
	},
	{
		name: "azure service unavailable chunk",
		api:  APIOpenAIChat, ct: "text/event-stream",
		body: "data: {\"error\":{\"code\":\"ServiceUnavailable\",\"message\":\"The service is temporarily unable to process your request.\"}}\n\n",
		want: ErrorServer,
	},
	{
		name: "openai invalid request inside a stream is the client's",
		api:  APIOpenAICompletions, ct: "text/event-stream",
		body: "data: {\"error\":{\"message\":\"bad\",\"type\":\"invalid_request_error\",\"code\":\"context_length_exceeded\"}}\n\n",
		want: ErrorClient,
	},
	{
		name: "anthropic overloaded event",
		api:  APIAnthropicMessages, ct: "text/event-stream",
		body: "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n" +
			"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n" +
			"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
		want: ErrorServer,
	},
	{
		name: "anthropic rate limit event",
		api:  APIAnthropicMessages, ct: "text/event-stream",
		body: "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"rate_limit_error\",\"message\":\"slow down\"}}\n\n",
		want: ErrorRateLimited,
	},
	{
		name: "anthropic error event known by its event line only",
		api:  APIAnthropicMessages, ct: "text/event-stream",
		body: "event: error\ndata: {\"message\":\"gone\"}\n\n",
		want: ErrorServer,
	},
	{
		name: "anthropic escaped error type",
		api:  APIAnthropicMessages, ct: "text/event-stream",
		body: "data: {\"type\":\"error\",\"error\":{\"type\":\"rate\\u005flimit_error\"}}\n\n",
		want: ErrorRateLimited,
	},
	{
		name: "responses error event",
		api:  APIOpenAIResponses, ct: "text/event-stream",
		body: "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n" +
			"event: error\ndata: {\"type\":\"error\",\"code\":\"rate_limit_exceeded\",\"message\":\"x\",\"param\":null,\"sequence_number\":3}\n\n",
		want: ErrorRateLimited,
	},
	{
		name: "responses failed",
		api:  APIOpenAIResponses, ct: "text/event-stream",
		body: "data: {\"type\":\"response.failed\",\"response\":{\"status\":\"failed\",\"error\":{\"code\":\"server_error\",\"message\":\"x\"},\"usage\":null}}\n\n",
		want: ErrorServer,
	},
	{
		name: "responses completed with error null is no error",
		api:  APIOpenAIResponses, ct: "text/event-stream",
		body: "data: {\"type\":\"response.completed\",\"response\":{\"error\":null,\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}}\n\n",
		want: ErrorNone,
	},
	{
		name: "200 json body with a top-level error object",
		api:  APIOpenAIChat, ct: "application/json",
		body: `{"error":{"message":"Overloaded","type":"server_overloaded","code":null}}`,
		want: ErrorServer,
	},
	{
		name: "200 anthropic json error body",
		api:  APIAnthropicMessages, ct: "application/json",
		body: `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`,
		want: ErrorServer,
	},
	{
		name: "responses json failed response",
		api:  APIOpenAIResponses, ct: "application/json",
		body: `{"status":"failed","error":{"code":"rate_limit_exceeded","message":"x"},"output":[]}`,
		want: ErrorRateLimited,
	},
	{
		name: "error null in a json body is no error",
		api:  APIOpenAIChat, ct: "application/json",
		body: `{"choices":[{"message":{"content":"ok"}}],"error":null}`,
		want: ErrorNone,
	},
	{
		name: "a repeated error key: the last one counts",
		api:  APIOpenAIChat, ct: "application/json",
		body: `{"error":{"type":"server_error"},"error":null}`,
		want: ErrorNone,
	},
	{
		name: "the first error reported counts",
		api:  APIOpenAIChat, ct: "text/event-stream",
		body: "data: {\"error\":{\"code\":\"rate_limit_exceeded\"}}\n\ndata: {\"error\":{\"type\":\"server_error\"}}\n\n",
		want: ErrorRateLimited,
	},
	{
		name: "an error event cut short does not count",
		api:  APIOpenAIChat, ct: "text/event-stream",
		body: "data: {\"error\":{\"type\":\"server_error\"",
		want: ErrorNone,
	},
	{
		name: "an error string in generated text is content",
		api:  APIOpenAIChat, ct: "text/event-stream",
		body: "data: {\"choices\":[{\"delta\":{\"content\":\"{\\\"error\\\":{}}\"}}]}\n\n",
		want: ErrorNone,
	},
}

// TestUsageStreamErrors: each error form is found however the body is cut,
// and the reference (documents decoded whole) agrees.
func TestUsageStreamErrors(t *testing.T) {
	for _, tc := range streamErrorCases {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(tc.body)
			whole, _ := scanChunks(tc.api, tc.ct, "", body)
			if whole.Error != tc.want {
				t.Fatalf("error %v, want %v (%+v)", whole.Error, tc.want, whole)
			}
			for i := range len(body) + 1 {
				if got, _ := scanChunks(tc.api, tc.ct, "", body[:i], body[i:]); got != whole {
					t.Fatalf("split at %d: %+v, whole: %+v", i, got, whole)
				}
			}
			if got, _ := scanChunks(tc.api, tc.ct, "", splitBytes(body)...); got != whole {
				t.Fatalf("byte by byte: %+v, whole: %+v", got, whole)
			}
			if got, _ := scanChunks(tc.api, "", "", body); got != whole {
				t.Fatalf("sniffed: %+v, whole: %+v", got, whole)
			}
			gz := gzipBytes(t, body, 6)
			if got, err := scanChunks(tc.api, tc.ct, "gzip", splitRandom(gz, 9)...); got != whole || err != nil {
				t.Fatalf("gzip: %+v (%v), whole: %+v", got, err, whole)
			}
			if ref, ok := refUsage(tc.api, tc.ct, body); ok && utf8.Valid(body) && ref != whole {
				t.Fatalf("reference: %+v\nscanner:   %+v", ref, whole)
			}
		})
	}
}

// TestUsageStreamErrorsRepeatedShape: error chunks that repeat one shape go
// through the template path and still report the error; a template learned
// from content chunks does not hide an error chunk.
func TestUsageStreamErrorsRepeatedShape(t *testing.T) {
	content := "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"ab\"}}]}\n\n"
	errEv := "data: {\"id\":\"c1\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"m1\"}}\n\n"
	var s UsageScanner
	s.Reset(APIOpenAIChat, "text/event-stream", "")
	for range 5 {
		s.Write([]byte(content))
	}
	if s.Finish().Error != ErrorNone {
		t.Fatal("content chunks reported an error")
	}
	s.Reset(APIOpenAIChat, "text/event-stream", "")
	for range 5 {
		s.Write([]byte(content))
	}
	s.Write([]byte(errEv))
	s.Write([]byte(errEv))
	if u := s.Finish(); u.Error != ErrorServer || u.ContentBytes != 10 {
		t.Fatalf("%+v", u)
	}
}

// TestUsageStreamErrorsDoNotAllocate: reading error events costs no
// allocation, escaped codes included.
func TestUsageStreamErrorsDoNotAllocate(t *testing.T) {
	evs := [][]byte{
		[]byte("event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"),
		[]byte("data: {\"type\":\"error\",\"error\":{\"type\":\"rate\\u005flimit_error\",\"message\":\"x\"}}\n\n"),
	}
	var s UsageScanner
	s.Reset(APIAnthropicMessages, "text/event-stream", "")
	for _, ev := range evs {
		if n := testing.AllocsPerRun(100, func() { s.Write(ev) }); n != 0 {
			t.Fatalf("%v allocations per event", n)
		}
	}
	if u := s.Finish(); u.Error != ErrorServer {
		t.Fatalf("%+v", u)
	}
}

// TestFirstToken: a stream shows its first token with the first event that
// carries generated text, not with events that only open the message; a JSON
// body with its first byte.
func TestFirstToken(t *testing.T) {
	tests := []struct {
		name   string
		api    API
		ct     string
		chunks []string
		first  int // index of the chunk after which FirstToken turns true; -1 never
	}{
		{"openai role chunk, then content", APIOpenAIChat, "text/event-stream", []string{
			"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
			"data: {\"choices\":[{\"delta\":{\"con",
			"tent\":\"Hi\"}}]}\n\n",
			"data: [DONE]\n\n",
		}, 2},
		{"anthropic message_start and ping do not count", APIAnthropicMessages, "text/event-stream", []string{
			"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3}}}\n\n",
			"event: ping\ndata: {\"type\": \"ping\"}\n\n",
			"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"x\"}}\n\n",
		}, 2},
		{"responses created, then a delta", APIOpenAIResponses, "text/event-stream", []string{
			"data: {\"type\":\"response.created\",\"response\":{}}\n\n",
			"data: {\"type\":\"response.output_text.delta\",\"delta\":\"x\"}\n\n",
		}, 1},
		{"an error stream has no token", APIAnthropicMessages, "text/event-stream", []string{
			"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\"}}\n\n",
		}, -1},
		{"json: the first byte", APIOpenAIChat, "application/json", []string{"{\"choices\"", ":[]}"}, 0},
		{"sniffed json after blank lines", APIOpenAIChat, "", []string{"\n\n", "{}"}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var s UsageScanner
			s.Reset(tt.api, tt.ct, "")
			for i, c := range tt.chunks {
				s.Write([]byte(c))
				want := tt.first >= 0 && i >= tt.first
				if got := s.FirstToken(); got != want {
					t.Fatalf("after chunk %d: FirstToken %v, want %v", i, got, want)
				}
			}
		})
	}
}

// TestSniffedStreamWithIndentedFirstLine: without a content type, blanks before the first
// line of a stream belong to that line's field name, which is no field the parser knows, as
// in an SSE parser reading the body whole; blank lines before it change nothing.
func TestSniffedStreamWithIndentedFirstLine(t *testing.T) {
	second := "data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n"
	tests := []struct {
		body string
		want Usage
	}{
		{" \t data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n" + second,
			Usage{PromptTokens: 3, CompletionTokens: 4, TotalTokens: 7, Known: true, PromptKnown: true}},
		{"\n\r\n \n" + second, Usage{PromptTokens: 3, CompletionTokens: 4, TotalTokens: 7, Known: true, PromptKnown: true}},
		{"\n\n  data: {\"error\":{\"type\":\"server_error\"}}\n\n", Usage{}},
	}
	for _, tt := range tests {
		body := []byte(tt.body)
		for i := range len(body) + 1 {
			if got, _ := scanChunks(APIOpenAIChat, "", "", body[:i], body[i:]); got != tt.want {
				t.Fatalf("%q split at %d: %+v, want %+v", tt.body, i, got, tt.want)
			}
		}
		if ref, _ := refUsage(APIOpenAIChat, "", body); ref != tt.want {
			t.Fatalf("%q: reference %+v", tt.body, ref)
		}
	}
}
