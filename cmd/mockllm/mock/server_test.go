package mock

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

// startServer runs a Server on 127.0.0.1 with tiny latencies.
func startServer(t *testing.T, opts Options) (*Server, string, *http.Client) {
	t.Helper()
	if opts.TimeScale == 0 {
		opts.TimeScale = 0.0001
	}
	s, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s)
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(func() {
		client.CloseIdleConnections()
		ts.Close()
	})
	return s, ts.URL, client
}

// call sends one request and reads the whole answer; readErr is the error
// reading the body (an injected disconnect shows up there).
func call(t *testing.T, client *http.Client, method, url, body string, headers map[string]string) (resp *http.Response, got []byte, readErr error) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err = client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	got, readErr = io.ReadAll(resp.Body)
	return resp, got, readErr
}

// parsedEvent is one SSE event as a client sees it.
type parsedEvent struct {
	name string
	data string
}

// parseSSE splits an SSE body into events.
func parseSSE(body []byte) []parsedEvent {
	var out []parsedEvent
	for block := range strings.SplitSeq(string(body), "\n\n") {
		if strings.TrimSpace(block) == "" {
			continue
		}
		var ev parsedEvent
		for line := range strings.SplitSeq(block, "\n") {
			if v, ok := strings.CutPrefix(line, "event: "); ok {
				ev.name = v
			}
			if v, ok := strings.CutPrefix(line, "data: "); ok {
				ev.data = v
			}
		}
		out = append(out, ev)
	}
	return out
}

// reported is what a client can read from a response.
type reported struct {
	hasUsage   bool
	prompt     int64
	completion int64
	total      int64 // total_tokens, where the API reports one
	cached     int64
	reasoning  int64
	text       string
	// done means the stream's final event arrived (always true for JSON).
	done bool
}

// wireUsage is the union of the usage fields of every API.
type wireUsage struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	TotalTokens         int64 `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	CompletionTokensDetails struct {
		ReasoningTokens int64 `json:"reasoning_tokens"`
	} `json:"completion_tokens_details"`
	InputTokens        int64 `json:"input_tokens"`
	OutputTokens       int64 `json:"output_tokens"`
	InputTokensDetails struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokensDetails struct {
		ReasoningTokens int64 `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	CacheReadInputTokens int64 `json:"cache_read_input_tokens"`
}

// wireBody is the union of the body fields the tests read.
type wireBody struct {
	Type    string     `json:"type"`
	Usage   *wireUsage `json:"usage"`
	Choices []struct {
		Text    string `json:"text"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Output []struct {
		Content []struct {
			Text string `json:"text"`
		} `json:"content"`
	} `json:"output"`
	Content []struct {
		Text string `json:"text"`
	} `json:"content"`
	Response *wireBody `json:"response"`
	Message  *wireBody `json:"message"`
	Delta    any       `json:"delta"`
}

// readJSONBody extracts usage and text from a whole JSON response.
func readJSONBody(t *testing.T, a api, body []byte) reported {
	t.Helper()
	var b wireBody
	if err := json.Unmarshal(body, &b); err != nil {
		t.Fatalf("response is not JSON: %v: %s", err, body)
	}
	r := reported{done: true}
	switch a {
	case apiChat:
		r.text = b.Choices[0].Message.Content
	case apiCompletions:
		r.text = b.Choices[0].Text
	case apiResponses:
		r.text = b.Output[0].Content[0].Text
	case apiMessages:
		r.text = b.Content[0].Text
	}
	r.absorb(a, b.Usage)
	return r
}

// absorb copies usage u (which may be nil) into r.
func (r *reported) absorb(a api, u *wireUsage) {
	if u == nil {
		return
	}
	r.hasUsage = true
	switch a {
	case apiResponses:
		r.prompt, r.completion = u.InputTokens, u.OutputTokens
		r.cached, r.reasoning = u.InputTokensDetails.CachedTokens, u.OutputTokensDetails.ReasoningTokens
	case apiMessages:
		r.prompt, r.completion, r.cached = u.InputTokens+u.CacheReadInputTokens, u.OutputTokens, u.CacheReadInputTokens
	default:
		r.prompt, r.completion = u.PromptTokens, u.CompletionTokens
		r.cached, r.reasoning = u.PromptTokensDetails.CachedTokens, u.CompletionTokensDetails.ReasoningTokens
	}
	r.total = u.TotalTokens
}

// readStream extracts usage and text from SSE events the way a usage
// scanner would.
func readStream(t *testing.T, a api, events []parsedEvent) reported {
	t.Helper()
	var r reported
	for _, ev := range events {
		if ev.data == "[DONE]" {
			r.done = true
			continue
		}
		var b wireBody
		if err := json.Unmarshal([]byte(ev.data), &b); err != nil {
			t.Fatalf("event %q is not JSON: %v", ev.data, err)
		}
		switch a {
		case apiChat, apiCompletions:
			if ev.name != "" {
				t.Fatalf("OpenAI chat events carry no event name, got %q", ev.name)
			}
			if len(b.Choices) > 0 {
				r.text += b.Choices[0].Delta.Content + b.Choices[0].Text
			}
			r.absorb(a, b.Usage)
		case apiResponses:
			if ev.name != b.Type {
				t.Fatalf("event name %q differs from its type %q", ev.name, b.Type)
			}
			switch b.Type {
			case "response.output_text.delta":
				r.text += b.Delta.(string)
			case "response.completed":
				r.done = true
				r.absorb(a, b.Response.Usage)
			}
		case apiMessages:
			if ev.name != b.Type {
				t.Fatalf("event name %q differs from its type %q", ev.name, b.Type)
			}
			switch b.Type {
			case "message_start":
				if b.Message.Usage != nil {
					r.hasUsage = true
					r.prompt = b.Message.Usage.InputTokens + b.Message.Usage.CacheReadInputTokens
					r.cached = b.Message.Usage.CacheReadInputTokens
				}
			case "content_block_delta":
				r.text += b.Delta.(map[string]any)["text"].(string)
			case "message_delta":
				if b.Usage != nil {
					r.completion = b.Usage.OutputTokens
				}
			case "message_stop":
				r.done = true
			}
		}
	}
	return r
}

// requestBody is a request to endpoint a with a 10-byte prompt (3 tokens)
// asking for 6 completion tokens.
func requestBody(a api, stream bool) (path, body string) {
	streamPart := ""
	if stream {
		streamPart = `,"stream":true`
		if a == apiChat || a == apiCompletions {
			streamPart += `,"stream_options":{"include_usage":true}`
		}
	}
	switch a {
	case apiChat:
		return "/v1/chat/completions", `{"model":"gpt-4o","messages":[{"role":"user","content":"0123456789"}],"max_tokens":6` + streamPart + `}`
	case apiCompletions:
		return "/v1/completions", `{"model":"gpt-3.5-turbo-instruct","prompt":"0123456789","max_tokens":6` + streamPart + `}`
	case apiResponses:
		return "/v1/responses", `{"model":"gpt-4o","input":"0123456789","max_output_tokens":6` + streamPart + `}`
	default:
		return "/v1/messages", `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"0123456789"}],"max_tokens":6` + streamPart + `}`
	}
}

var apiNames = map[api]string{apiChat: "chat", apiCompletions: "completions", apiResponses: "responses", apiMessages: "messages"}

func TestEndpointsReportExactUsage(t *testing.T) {
	_, base, client := startServer(t, Options{})
	type variant struct {
		name    string
		headers map[string]string
		// want* are the usage the body must report.
		wantPrompt, wantCompletion, wantCached, wantReasoning int64
		wantNoUsage                                           bool
	}
	variants := []variant{
		{name: "plain", wantPrompt: 3, wantCompletion: 6},
		{name: "completion header", headers: map[string]string{HeaderCompletionTokens: "11"}, wantPrompt: 3, wantCompletion: 11},
		{name: "zero completion", headers: map[string]string{HeaderCompletionTokens: "0"}, wantPrompt: 3, wantCompletion: 0},
		{name: "cached and reasoning", headers: map[string]string{HeaderCachedTokens: "2", HeaderReasoningTokens: "4"}, wantPrompt: 3, wantCompletion: 6, wantCached: 2, wantReasoning: 4},
		{name: "no usage", headers: map[string]string{HeaderNoUsage: "1"}, wantPrompt: 3, wantCompletion: 6, wantNoUsage: true},
	}
	for _, a := range []api{apiChat, apiCompletions, apiResponses, apiMessages} {
		for _, stream := range []bool{false, true} {
			mode := "json"
			if stream {
				mode = "sse"
			}
			for _, v := range variants {
				t.Run(apiNames[a]+"/"+mode+"/"+v.name, func(t *testing.T) {
					path, body := requestBody(a, stream)
					resp, got, err := call(t, client, http.MethodPost, base+path, body, v.headers)
					if err != nil {
						t.Fatalf("reading the body: %v", err)
					}
					if resp.StatusCode != http.StatusOK {
						t.Fatalf("status %d: %s", resp.StatusCode, got)
					}
					wantType := contentTypeJSON
					if stream {
						wantType = contentTypeSSE
					}
					if ct := resp.Header.Get("Content-Type"); ct != wantType {
						t.Fatalf("Content-Type = %q, want %q", ct, wantType)
					}
					if resp.Header.Get(HeaderRequestID) == "" {
						t.Fatal("no request id header")
					}
					hp, _ := strconv.ParseInt(resp.Header.Get(HeaderPromptTokens), 10, 64)
					hc, _ := strconv.ParseInt(resp.Header.Get(HeaderCompletionTokens), 10, 64)
					if hp != v.wantPrompt || hc != v.wantCompletion {
						t.Fatalf("headers report %d/%d tokens, want %d/%d", hp, hc, v.wantPrompt, v.wantCompletion)
					}
					var r reported
					if stream {
						r = readStream(t, a, parseSSE(got))
					} else {
						r = readJSONBody(t, a, got)
					}
					if !r.done {
						t.Fatalf("the response did not end properly:\n%s", got)
					}
					if wantLen := int((v.wantCompletion - v.wantReasoning) * BytesPerToken); len(r.text) != wantLen {
						t.Fatalf("text %q has %d bytes, want %d", r.text, len(r.text), wantLen)
					}
					if v.wantNoUsage {
						if r.hasUsage {
							t.Fatalf("usage reported despite the no-usage fault:\n%s", got)
						}
						return
					}
					if !r.hasUsage {
						t.Fatalf("no usage reported:\n%s", got)
					}
					if r.prompt != hp || r.completion != hc {
						t.Fatalf("body reports %d/%d tokens, headers %d/%d", r.prompt, r.completion, hp, hc)
					}
					if r.cached != v.wantCached {
						t.Fatalf("cached = %d, want %d", r.cached, v.wantCached)
					}
					if a != apiMessages && r.reasoning != v.wantReasoning {
						t.Fatalf("reasoning = %d, want %d", r.reasoning, v.wantReasoning)
					}
				})
			}
		}
	}
}

// TestReportedUsageInEveryFormat: the report fault's counts reach the usage object of every API,
// JSON and SSE, while the text and the token headers follow the real usage.
func TestReportedUsageInEveryFormat(t *testing.T) {
	_, base, client := startServer(t, Options{})
	odd := map[string]string{HeaderReportPrompt: "50", HeaderReportCompletion: "9000000000000000", HeaderReportTotal: "7"}
	for _, a := range []api{apiChat, apiCompletions, apiResponses, apiMessages} {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", apiNames[a], stream), func(t *testing.T) {
				path, body := requestBody(a, stream)
				resp, got, err := call(t, client, http.MethodPost, base+path, body, odd)
				if err != nil || resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d, %v: %s", resp.StatusCode, err, got)
				}
				if resp.Header.Get(HeaderPromptTokens) != "3" || resp.Header.Get(HeaderCompletionTokens) != "6" {
					t.Errorf("token headers %s/%s, want the real 3/6", resp.Header.Get(HeaderPromptTokens), resp.Header.Get(HeaderCompletionTokens))
				}
				var r reported
				if stream {
					r = readStream(t, a, parseSSE(got))
				} else {
					r = readJSONBody(t, a, got)
				}
				if len(r.text) != 6*BytesPerToken {
					t.Errorf("text of %d bytes, want the real 6 tokens", len(r.text))
				}
				wantTotal := int64(7)
				if a == apiMessages {
					wantTotal = 0 // Anthropic reports no total
				}
				if !r.hasUsage || r.prompt != 50 || r.completion != 9e15 || r.total != wantTotal {
					t.Errorf("usage %d/%d total %d, want 50/9000000000000000 total %d:\n%s", r.prompt, r.completion, r.total, wantTotal, got)
				}
			})
		}
	}
	t.Run("embeddings", func(t *testing.T) {
		_, got, err := call(t, client, http.MethodPost, base+"/v1/embeddings", `{"model":"e","input":"0123456789"}`,
			map[string]string{HeaderReportPrompt: "-4"})
		if err != nil {
			t.Fatal(err)
		}
		var out struct{ Usage wireUsage }
		if err := json.Unmarshal(got, &out); err != nil || out.Usage.PromptTokens != -4 || out.Usage.TotalTokens != -4 {
			t.Errorf("usage %+v (%v), want prompt and total -4", out.Usage, err)
		}
	})
}

func TestStreamUsageChunkOnlyWhenAsked(t *testing.T) {
	_, base, client := startServer(t, Options{})
	tests := []struct {
		name      string
		path      string
		body      string
		wantUsage bool
	}{
		{name: "chat without stream_options", path: "/v1/chat/completions", body: `{"model":"m","stream":true,"messages":[{"content":"x"}],"max_tokens":2}`},
		{name: "chat include_usage false", path: "/v1/chat/completions", body: `{"model":"m","stream":true,"stream_options":{"include_usage":false},"messages":[{"content":"x"}],"max_tokens":2}`},
		{name: "chat include_usage true", path: "/v1/chat/completions", body: `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"content":"x"}],"max_tokens":2}`, wantUsage: true},
		{name: "completions without stream_options", path: "/v1/completions", body: `{"model":"m","stream":true,"prompt":"x","max_tokens":2}`},
		{name: "completions include_usage true", path: "/v1/completions", body: `{"model":"m","stream":true,"stream_options":{"include_usage":true},"prompt":"x","max_tokens":2}`, wantUsage: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, got, err := call(t, client, http.MethodPost, base+tt.path, tt.body, nil)
			if err != nil {
				t.Fatal(err)
			}
			events := parseSSE(got)
			if n := len(events); n < 2 || events[n-1].data != "[DONE]" {
				t.Fatalf("stream does not end with [DONE]:\n%s", got)
			}
			var usageChunks int
			for i, ev := range events[:len(events)-1] {
				var m map[string]json.RawMessage
				if err := json.Unmarshal([]byte(ev.data), &m); err != nil {
					t.Fatal(err)
				}
				u, has := m["usage"]
				if has != tt.wantUsage {
					t.Fatalf("event %d has usage key = %v, want %v: %s", i, has, tt.wantUsage, ev.data)
				}
				if has && string(u) != "null" {
					usageChunks++
					if string(m["choices"]) != "[]" || i != len(events)-2 {
						t.Fatalf("usage chunk must have empty choices and come right before [DONE]: %s", ev.data)
					}
				}
			}
			if want := map[bool]int{false: 0, true: 1}[tt.wantUsage]; usageChunks != want {
				t.Fatalf("%d usage chunks, want %d", usageChunks, want)
			}
		})
	}
}

func TestInjectedErrorsUseEachAPIsFormat(t *testing.T) {
	_, base, client := startServer(t, Options{})
	tests := []struct {
		name      string
		api       api
		status    string
		wantType  string
		wantCode  string
		wantRetry string
	}{
		{name: "openai 503", api: apiChat, status: "503", wantType: "server_error"},
		{name: "openai 429", api: apiResponses, status: "429", wantType: "requests", wantCode: "rate_limit_exceeded", wantRetry: "7"},
		{name: "openai 500 on embeddings", api: apiEmbeddings, status: "500", wantType: "server_error"},
		{name: "anthropic 529", api: apiMessages, status: "529", wantType: "overloaded_error", wantRetry: "3"},
		{name: "anthropic 429", api: apiMessages, status: "429", wantType: "rate_limit_error"},
		{name: "anthropic 500", api: apiMessages, status: "500", wantType: "api_error"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path, body := requestBody(tt.api, false)
			if tt.api == apiEmbeddings {
				path, body = "/v1/embeddings", `{"model":"e","input":"abc"}`
			}
			h := map[string]string{HeaderStatus: tt.status}
			if tt.wantRetry != "" {
				h[HeaderRetryAfter] = tt.wantRetry
			}
			resp, got, err := call(t, client, http.MethodPost, base+path, body, h)
			if err != nil {
				t.Fatal(err)
			}
			if strconv.Itoa(resp.StatusCode) != tt.status {
				t.Fatalf("status %d, want %s", resp.StatusCode, tt.status)
			}
			if ct := resp.Header.Get("Content-Type"); ct != contentTypeJSON {
				t.Fatalf("Content-Type = %q", ct)
			}
			if got := resp.Header.Get("Retry-After"); got != tt.wantRetry {
				t.Fatalf("Retry-After = %q, want %q", got, tt.wantRetry)
			}
			if tt.api.anthropic() {
				var e anthropicError
				if err := json.Unmarshal(got, &e); err != nil || e.Type != "error" || e.Error.Type != tt.wantType || e.Error.Message == "" {
					t.Fatalf("anthropic error body %s (%v), want type %q", got, err, tt.wantType)
				}
				return
			}
			var e struct {
				Error map[string]*string `json:"error"`
			}
			if err := json.Unmarshal(got, &e); err != nil {
				t.Fatalf("openai error body %s: %v", got, err)
			}
			for _, k := range []string{"message", "type", "param", "code"} {
				if _, ok := e.Error[k]; !ok {
					t.Fatalf("openai error body %s lacks %q", got, k)
				}
			}
			if *e.Error["type"] != tt.wantType {
				t.Fatalf("error type %q, want %q", *e.Error["type"], tt.wantType)
			}
			if code := e.Error["code"]; (code == nil) != (tt.wantCode == "") || (code != nil && *code != tt.wantCode) {
				t.Fatalf("error code %v, want %q", code, tt.wantCode)
			}
		})
	}
}

func TestInvalidRequestsAreRejected(t *testing.T) {
	_, base, client := startServer(t, Options{MaxRequestBodyBytes: 1024})
	big := `{"model":"m","messages":[{"content":"` + strings.Repeat("x", 2000) + `"}]}`
	tests := []struct {
		name       string
		method     string
		path       string
		body       string
		headers    map[string]string
		wantStatus int
		anthropic  bool
		wantInMsg  string
	}{
		{name: "broken json", method: http.MethodPost, path: "/v1/chat/completions", body: `{"model":`, wantStatus: 400, wantInMsg: "JSON"},
		{name: "missing model anthropic", method: http.MethodPost, path: "/v1/messages", body: `{"messages":[{"content":"x"}]}`, wantStatus: 400, anthropic: true, wantInMsg: "model"},
		{name: "GET on a POST endpoint", method: http.MethodGet, path: "/v1/chat/completions", wantStatus: 405, wantInMsg: "POST"},
		{name: "too large", method: http.MethodPost, path: "/v1/messages", body: big, wantStatus: 413, anthropic: true, wantInMsg: "1024"},
		{name: "unknown path", method: http.MethodPost, path: "/v1/images/generations", body: `{}`, wantStatus: 404, wantInMsg: "Invalid URL"},
		{name: "bad fault header", method: http.MethodPost, path: "/v1/chat/completions", body: `{"model":"m","messages":[{"content":"x"}]}`, headers: map[string]string{HeaderStatus: "teapot"}, wantStatus: 400, wantInMsg: HeaderStatus},
		{name: "bad token header", method: http.MethodPost, path: "/v1/completions", body: `{"model":"m","prompt":"x"}`, headers: map[string]string{HeaderCompletionTokens: "-4"}, wantStatus: 400, wantInMsg: HeaderCompletionTokens},
		{name: "cached above prompt", method: http.MethodPost, path: "/v1/completions", body: `{"model":"m","prompt":"x"}`, headers: map[string]string{HeaderCachedTokens: "9"}, wantStatus: 400, wantInMsg: HeaderCachedTokens},
		{name: "models is GET only", method: http.MethodPost, path: "/v1/models", wantStatus: 405, wantInMsg: "GET"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, got, err := call(t, client, tt.method, base+tt.path, tt.body, tt.headers)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != tt.wantStatus {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tt.wantStatus, got)
			}
			if resp.Header.Get(HeaderRequestID) == "" || resp.Header.Get(HeaderPromptTokens) == "" {
				t.Fatalf("x-mockllm headers missing on an error: %v", resp.Header)
			}
			var msg string
			if tt.anthropic {
				var e anthropicError
				if err := json.Unmarshal(got, &e); err != nil || e.Type != "error" {
					t.Fatalf("not an anthropic error: %s", got)
				}
				msg = e.Error.Message
			} else {
				var e openAIError
				if err := json.Unmarshal(got, &e); err != nil || e.Error.Type == "" {
					t.Fatalf("not an openai error: %s", got)
				}
				msg = e.Error.Message
			}
			if !strings.Contains(msg, tt.wantInMsg) {
				t.Fatalf("message %q does not mention %q", msg, tt.wantInMsg)
			}
		})
	}
}

func TestDisconnectCutsTheResponse(t *testing.T) {
	_, base, client := startServer(t, Options{})
	tests := []struct {
		name       string
		api        api
		stream     bool
		after      string
		wantEvents int
	}{
		{name: "chat sse after 3", api: apiChat, stream: true, after: "3", wantEvents: 3},
		{name: "responses sse after 5", api: apiResponses, stream: true, after: "5", wantEvents: 5},
		{name: "messages sse after 1", api: apiMessages, stream: true, after: "1", wantEvents: 1},
		{name: "more than the stream still drops the final event", api: apiMessages, stream: true, after: "100", wantEvents: 11},
		{name: "chat json", api: apiChat, after: "1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path, body := requestBody(tt.api, tt.stream)
			resp, got, err := call(t, client, http.MethodPost, base+path, body, map[string]string{HeaderDisconnectAfter: tt.after})
			if err == nil {
				t.Fatalf("body read without error; want an abrupt close. Got:\n%s", got)
			}
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			if !tt.stream {
				if int64(len(got)) >= resp.ContentLength {
					t.Fatalf("got %d of %d bytes, want a cut body", len(got), resp.ContentLength)
				}
				return
			}
			events := parseSSE(got)
			if len(events) != tt.wantEvents {
				t.Fatalf("got %d events, want %d:\n%s", len(events), tt.wantEvents, got)
			}
			if r := readStream(t, tt.api, events); r.done {
				t.Fatal("the final event was sent despite the disconnect")
			}
		})
	}
}

func TestGzip(t *testing.T) {
	_, base, client := startServer(t, Options{Faults: []FaultRule{{Provider: "zipped", Fault: Fault{Gzip: true}}}})
	tests := []struct {
		name     string
		api      api
		stream   bool
		headers  map[string]string
		wantGzip bool
	}{
		{name: "header and accept-encoding", api: apiChat, headers: map[string]string{HeaderGzip: "1", "Accept-Encoding": "gzip"}, wantGzip: true},
		{name: "sse", api: apiMessages, stream: true, headers: map[string]string{HeaderGzip: "1", "Accept-Encoding": "br, gzip"}, wantGzip: true},
		{name: "rule by provider", api: apiResponses, stream: true, headers: map[string]string{ProviderHeader: "zipped", "Accept-Encoding": "gzip"}, wantGzip: true},
		{name: "client refuses gzip", api: apiChat, headers: map[string]string{HeaderGzip: "1", "Accept-Encoding": "identity"}},
		{name: "not asked for", api: apiChat, headers: map[string]string{"Accept-Encoding": "gzip"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path, body := requestBody(tt.api, tt.stream)
			resp, got, err := call(t, client, http.MethodPost, base+path, body, tt.headers)
			if err != nil {
				t.Fatal(err)
			}
			if isGzip := resp.Header.Get("Content-Encoding") == "gzip"; isGzip != tt.wantGzip {
				t.Fatalf("Content-Encoding %q, want gzip = %v", resp.Header.Get("Content-Encoding"), tt.wantGzip)
			}
			if tt.wantGzip {
				zr, err := gzip.NewReader(bytes.NewReader(got))
				if err != nil {
					t.Fatal(err)
				}
				if got, err = io.ReadAll(zr); err != nil {
					t.Fatalf("gunzip: %v", err)
				}
			}
			var r reported
			if tt.stream {
				r = readStream(t, tt.api, parseSSE(got))
			} else {
				r = readJSONBody(t, tt.api, got)
			}
			if !r.done || r.completion != 6 || r.prompt != 3 {
				t.Fatalf("decoded body reports %+v, want 3/6 tokens and a proper end", r)
			}
		})
	}
}

func TestEmbeddings(t *testing.T) {
	_, base, client := startServer(t, Options{EmbeddingDimensions: 5})
	tests := []struct {
		name     string
		body     string
		wantN    int
		wantDims int
		wantB64  bool
		wantTok  int64
	}{
		{name: "one string", body: `{"model":"e","input":"abcdefgh"}`, wantN: 1, wantDims: 5, wantTok: 2},
		{name: "several with dimensions", body: `{"model":"e","input":["a","b","c"],"dimensions":3}`, wantN: 3, wantDims: 3, wantTok: 1},
		{name: "base64", body: `{"model":"e","input":[[1,2,3]],"encoding_format":"base64"}`, wantN: 1, wantDims: 5, wantB64: true, wantTok: 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, got, err := call(t, client, http.MethodPost, base+"/v1/embeddings", tt.body, nil)
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("status %d, %v: %s", resp.StatusCode, err, got)
			}
			var out struct {
				Data []struct {
					Index     int             `json:"index"`
					Embedding json.RawMessage `json:"embedding"`
				} `json:"data"`
				Usage embeddingUsage `json:"usage"`
			}
			if err := json.Unmarshal(got, &out); err != nil {
				t.Fatal(err)
			}
			if len(out.Data) != tt.wantN {
				t.Fatalf("%d embeddings, want %d", len(out.Data), tt.wantN)
			}
			for i, d := range out.Data {
				if d.Index != i {
					t.Fatalf("embedding %d has index %d", i, d.Index)
				}
				var dims int
				if tt.wantB64 {
					var s string
					if err := json.Unmarshal(d.Embedding, &s); err != nil {
						t.Fatalf("base64 embedding is not a string: %s", d.Embedding)
					}
					dims = len(s) * 3 / 4 / 4
				} else {
					var v []float32
					if err := json.Unmarshal(d.Embedding, &v); err != nil {
						t.Fatal(err)
					}
					dims = len(v)
				}
				if dims != tt.wantDims {
					t.Fatalf("embedding of %d dims, want %d", dims, tt.wantDims)
				}
			}
			if out.Usage.PromptTokens != tt.wantTok || out.Usage.TotalTokens != tt.wantTok {
				t.Fatalf("usage %+v, want %d tokens", out.Usage, tt.wantTok)
			}
			if h := resp.Header.Get(HeaderPromptTokens); h != strconv.FormatInt(tt.wantTok, 10) {
				t.Fatalf("prompt header %q, want %d", h, tt.wantTok)
			}
		})
	}
}

func TestFailRateFollowsTheSeed(t *testing.T) {
	const n = 40
	statuses := func(t *testing.T) []int {
		_, base, client := startServer(t, Options{Seed: 42})
		out := make([]int, n)
		for i := range out {
			resp, _, err := call(t, client, http.MethodPost, base+"/v1/embeddings", `{"model":"e","input":"a"}`,
				map[string]string{HeaderFailRate: "0.5", HeaderStatus: "503"})
			if err != nil {
				t.Fatal(err)
			}
			out[i] = resp.StatusCode
		}
		return out
	}
	first, second := statuses(t), statuses(t)
	// Replay the draws: every request takes the fail roll first.
	replay, err := New(Options{Seed: 42})
	if err != nil {
		t.Fatal(err)
	}
	var fails int
	for i := range n {
		roll, _ := replay.draw()
		want := http.StatusOK
		if roll < 0.5 {
			want = http.StatusServiceUnavailable
			fails++
		}
		if first[i] != want || second[i] != want {
			t.Fatalf("request %d: statuses %d and %d, want %d", i, first[i], second[i], want)
		}
	}
	if fails == 0 || fails == n {
		t.Fatalf("%d of %d failed; a 0.5 rate should mix", fails, n)
	}
}

func TestFaultsChangeAtRunTime(t *testing.T) {
	s, base, client := startServer(t, Options{})
	send := func(provider string) *http.Response {
		path, body := requestBody(apiChat, false)
		resp, _, err := call(t, client, http.MethodPost, base+path, body, map[string]string{ProviderHeader: provider})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	post := func(doc string) (int, string) {
		resp, got, err := call(t, client, http.MethodPost, base+"/mockllm/faults", doc, nil)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(got)
	}
	steps := []struct {
		name     string
		do       func(t *testing.T)
		provider string
		want     int
	}{
		{name: "healthy at first", provider: "deepseek", want: 200},
		{name: "deepseek breaks through the Go method", do: func(t *testing.T) {
			if err := s.SetFaults([]FaultRule{{Provider: "deepseek", Fault: Fault{Status: 503, RetryAfter: 2}}}); err != nil {
				t.Fatal(err)
			}
		}, provider: "deepseek", want: 503},
		{name: "the fallback provider still works", provider: "openai", want: 200},
		{name: "an invalid update keeps the rules", do: func(t *testing.T) {
			if code, body := post(`{"rules":[{"provider":"deepseek","status":700}]}`); code != 400 || !strings.Contains(body, "status 700") {
				t.Fatalf("POST invalid rules: %d %s", code, body)
			}
		}, provider: "deepseek", want: 503},
		{name: "unknown keys are refused", do: func(t *testing.T) {
			if code, body := post(`{"rules":[{"provider":"deepseek","satus":500}]}`); code != 400 || !strings.Contains(body, "satus") {
				t.Fatalf("POST misspelt rules: %d %s", code, body)
			}
		}, provider: "deepseek", want: 503},
		{name: "deepseek recovers over HTTP", do: func(t *testing.T) {
			if code, body := post(`{"rules":[]}`); code != 200 || !strings.Contains(body, `"rules":[]`) {
				t.Fatalf("POST empty rules: %d %s", code, body)
			}
		}, provider: "deepseek", want: 200},
		{name: "a model glob rule over HTTP", do: func(t *testing.T) {
			if code, body := post(`{"rules":[{"model":"gpt-4*","status":429,"retry_after":5}]}`); code != 200 {
				t.Fatalf("POST glob rule: %d %s", code, body)
			}
		}, provider: "any", want: 429},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			if st.do != nil {
				st.do(t)
			}
			if got := send(st.provider).StatusCode; got != st.want {
				t.Fatalf("status %d, want %d", got, st.want)
			}
		})
	}
	stats := s.Stats()
	if stats.ByProvider["deepseek"] != 5 || stats.ByProvider["openai"] != 1 || stats.ByStatus[503] != 3 || stats.ByOutcome[OutcomeFault] != 4 {
		t.Fatalf("stats %+v do not match the steps", stats)
	}
	if rules := s.Faults(); len(rules) != 1 || rules[0].Model != "gpt-4*" {
		t.Fatalf("Faults() = %+v", rules)
	}
}

func TestRequestLog(t *testing.T) {
	s, base, client := startServer(t, Options{RequestLogSize: 3, MaxLoggedBodyBytes: 40})
	bodies := []string{
		`{"model":"a","messages":[{"content":"1"}]}`,
		`{"model":"b","messages":[{"content":"2"}]}`,
		`{"model":"c","messages":[{"content":"3"}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"d","messages":[{"content":"4"}]}`,
	}
	for i, b := range bodies {
		h := map[string]string{"Authorization": "Bearer sk-secret", ProviderHeader: fmt.Sprintf("p%d", i)}
		if _, _, err := call(t, client, http.MethodPost, base+"/v1/chat/completions", b, h); err != nil {
			t.Fatal(err)
		}
	}
	var overHTTP []RecordedRequest
	_, got, err := call(t, client, http.MethodGet, base+"/mockllm/requests", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(got, &overHTTP); err != nil {
		t.Fatalf("GET /mockllm/requests: %v: %s", err, got)
	}
	tests := []struct {
		name string
		log  []RecordedRequest
	}{
		{name: "Go accessor", log: s.Requests()},
		{name: "HTTP endpoint", log: overHTTP},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if len(tt.log) != 3 {
				t.Fatalf("%d entries, want the last 3", len(tt.log))
			}
			for i, e := range tt.log {
				if want := fmt.Sprintf("p%d", i+1); e.Provider != want {
					t.Fatalf("entry %d is from %q, want %q (oldest first)", i, e.Provider, want)
				}
				if e.Header.Get("Authorization") != "[redacted]" {
					t.Fatalf("Authorization kept as %q", e.Header.Get("Authorization"))
				}
				if e.Status != 200 || e.Outcome != OutcomeOK || e.ID == "" || e.Path != "/v1/chat/completions" {
					t.Fatalf("entry %d = %+v", i, e)
				}
			}
			streamed := tt.log[1]
			if !streamed.Stream || !streamed.BodyTruncated || len(streamed.Body) != 40 || streamed.Model != "c" {
				t.Fatalf("streamed entry = %+v, want a truncated streamed body of model c", streamed)
			}
		})
	}
	s.Reset()
	if n := len(s.Requests()); n != 0 {
		t.Fatalf("%d entries after Reset", n)
	}
	if st := s.Stats(); st.Requests != 0 || len(st.ByModel) != 0 {
		t.Fatalf("stats after Reset: %+v", st)
	}
}

func TestAdminEndpoints(t *testing.T) {
	s, base, client := startServer(t, Options{Capacity: 4, ProviderCapacity: map[string]int{"deepseek": 2}})
	if _, _, err := call(t, client, http.MethodGet, base+"/v1/models", "", nil); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name       string
		method     string
		path       string
		body       string
		wantStatus int
		check      func(t *testing.T, body []byte)
	}{
		{name: "stats", method: http.MethodGet, path: "/mockllm/stats", wantStatus: 200, check: func(t *testing.T, body []byte) {
			var st Stats
			if err := json.Unmarshal(body, &st); err != nil {
				t.Fatal(err)
			}
			if st.Requests != 1 || st.ByPath["/v1/models"] != 1 || st.Global.Capacity != 4 || st.Providers["deepseek"].Capacity != 2 {
				t.Fatalf("stats %s", body)
			}
		}},
		{name: "faults", method: http.MethodGet, path: "/mockllm/faults", wantStatus: 200, check: func(t *testing.T, body []byte) {
			if strings.TrimSpace(string(body)) != `{"rules":[]}` {
				t.Fatalf("faults %s", body)
			}
		}},
		{name: "faults trailing data", method: http.MethodPost, path: "/mockllm/faults", body: `{"rules":[]} {}`, wantStatus: 400},
		{name: "faults not JSON", method: http.MethodPost, path: "/mockllm/faults", body: `rules`, wantStatus: 400},
		{name: "healthz", method: http.MethodGet, path: "/mockllm/healthz", wantStatus: 200},
		{name: "capacity", method: http.MethodPost, path: "/mockllm/capacity", body: `{"capacity": 7}`, wantStatus: 200, check: func(t *testing.T, body []byte) {
			var g PoolStats
			if err := json.Unmarshal(body, &g); err != nil || g.Capacity != 7 || s.Stats().Global.Capacity != 7 {
				t.Fatalf("capacity answer %s (%v), stats %+v", body, err, s.Stats().Global)
			}
		}},
		{name: "capacity negative", method: http.MethodPost, path: "/mockllm/capacity", body: `{"capacity": -1}`, wantStatus: 400},
		{name: "capacity missing", method: http.MethodPost, path: "/mockllm/capacity", body: `{}`, wantStatus: 400},
		{name: "capacity unknown key", method: http.MethodPost, path: "/mockllm/capacity", body: `{"capacity": 3, "when": "now"}`, wantStatus: 400},
		{name: "capacity by GET", method: http.MethodGet, path: "/mockllm/capacity", wantStatus: 405},
		{name: "wrong method", method: http.MethodDelete, path: "/mockllm/requests", wantStatus: 405},
		{name: "unknown", method: http.MethodGet, path: "/mockllm/nothing", wantStatus: 404},
		{name: "reset", method: http.MethodPost, path: "/mockllm/reset", wantStatus: 204, check: func(t *testing.T, _ []byte) {
			if st := s.Stats(); st.Requests != 0 {
				t.Fatalf("requests after reset = %d", st.Requests)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, got, err := call(t, client, tt.method, base+tt.path, tt.body, nil)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != tt.wantStatus {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tt.wantStatus, got)
			}
			if tt.check != nil {
				tt.check(t, got)
			}
		})
	}
}

func TestModels(t *testing.T) {
	_, base, client := startServer(t, Options{})
	resp, got, err := call(t, client, http.MethodGet, base+"/v1/models", "", nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET /v1/models: %d %v", resp.StatusCode, err)
	}
	var list modelList
	if err := json.Unmarshal(got, &list); err != nil || list.Object != "list" || len(list.Data) != len(models) || list.Data[0].Object != "model" {
		t.Fatalf("model list %s (%v)", got, err)
	}
}

// waitInFlight polls until n requests are being processed. It checks a
// state, not a duration, so it cannot flake on a slow machine.
func waitInFlight(t *testing.T, s *Server, n int) {
	t.Helper()
	for s.Stats().Global.InFlight != n {
		time.Sleep(time.Millisecond)
	}
}

func TestRunShutsDownGracefully(t *testing.T) {
	tests := []struct {
		name        string
		latency     LatencyModel
		grace       time.Duration
		wantRunErr  bool
		wantReadErr bool
	}{
		{name: "requests in progress finish", latency: LatencyModel{Base: 50 * time.Millisecond}, grace: time.Minute},
		{name: "grace running out cuts them", latency: LatencyModel{Base: time.Hour}, grace: time.Millisecond, wantRunErr: true, wantReadErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := New(Options{Latency: tt.latency})
			if err != nil {
				t.Fatal(err)
			}
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ran := make(chan error, 1)
			go func() { ran <- s.Run(ctx, l, tt.grace) }()

			client := &http.Client{Transport: &http.Transport{}}
			defer client.CloseIdleConnections()
			path, body := requestBody(apiMessages, true)
			type answer struct {
				status  int
				body    []byte
				readErr error
			}
			answered := make(chan answer, 1)
			go func() {
				resp, err := client.Post("http://"+l.Addr().String()+path, contentTypeJSON, strings.NewReader(body))
				if err != nil {
					answered <- answer{readErr: err}
					return
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				answered <- answer{status: resp.StatusCode, body: b, readErr: err}
			}()
			waitInFlight(t, s, 1)
			cancel()
			runErr := <-ran
			a := <-answered
			if (runErr != nil) != tt.wantRunErr {
				t.Fatalf("Run returned %v, want error %v", runErr, tt.wantRunErr)
			}
			if (a.readErr != nil) != tt.wantReadErr {
				t.Fatalf("client got %v, want error %v", a.readErr, tt.wantReadErr)
			}
			if !tt.wantReadErr && !readStream(t, apiMessages, parseSSE(a.body)).done {
				t.Fatalf("stream cut by a graceful shutdown:\n%s", a.body)
			}
		})
	}
}

// TestStreamErrorFault: a stream-error fault answers 200 and reports the
// error in the body, in each API's format: an error event after the first
// content event, ending the stream without usage; a JSON response is the
// API's error body.
func TestStreamErrorFault(t *testing.T) {
	_, base, client := startServer(t, Options{})
	tests := []struct {
		name   string
		api    api
		stream bool
		status string
		want   []string // in order in the body
	}{
		{"openai chat overloaded", apiChat, true, "503", []string{`"delta":{"content":"`, "data: {\"error\":{", `"type":"server_error"`}},
		{"openai chat rate limit", apiChat, true, "429", []string{`"delta":{"content":"`, "data: {\"error\":{", `"code":"rate_limit_exceeded"`}},
		{"completions", apiCompletions, true, "500", []string{`"text":"`, "data: {\"error\":{"}},
		{"anthropic overloaded", apiMessages, true, "529", []string{`"text_delta"`, "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\""}},
		{"anthropic rate limit", apiMessages, true, "429", []string{`"text_delta"`, "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"rate_limit_error\""}},
		{"responses", apiResponses, true, "503", []string{`response.output_text.delta`, "event: error\ndata: {\"type\":\"error\",\"code\":\"server_error\""}},
		{"openai json", apiChat, false, "503", []string{`{"error":{`, `"type":"server_error"`}},
		{"anthropic json", apiMessages, false, "529", []string{`{"type":"error","error":{"type":"overloaded_error"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path, body := requestBody(tt.api, tt.stream)
			resp, got, err := call(t, client, http.MethodPost, base+path, body, map[string]string{HeaderStreamError: tt.status})
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d, want 200", resp.StatusCode)
			}
			rest := string(got)
			for _, w := range tt.want {
				i := strings.Index(rest, w)
				if i < 0 {
					t.Fatalf("body lacks %q after the parts before it:\n%s", w, got)
				}
				rest = rest[i+len(w):]
			}
			for _, bad := range []string{"[DONE]", "message_delta", "message_stop", "response.completed"} {
				if tt.stream && strings.Contains(string(got), bad) {
					t.Fatalf("stream with an error still sent %s:\n%s", bad, got)
				}
			}
		})
	}
}
