package llmapi

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/tidwall/gjson"
)

// proseWords is realistic chat text: mostly plain words, with the things
// that force escapes in real traffic (newlines, paragraph breaks, quotes,
// tabs, Windows paths, non-ASCII text written raw and as \u escapes, emoji as
// surrogate pairs) at about one escape per 40 bytes, as in text that mixes
// prose, markdown and code.
var proseWords = append(strings.Fields(`the request budget tokens streaming gateway latency model please
	summarize document section answer question context window provider tenant because
	which would should could between through during before after without within
	function return value error result response message content system user
	assistant example following important however therefore	- * 1. 2. ## **note**
	{ } ( ) [ ] = == != && || ; :`),
	"\\n", "\\n", "\\n", "\\n\\n", "\\\"quoted\\\"", "\\t", "café", "日本語",
	"\\u00e9t\\u00e9", "C:\\\\tmp", "emoji \\ud83d\\ude00")

// denseWords is the worst case kept for comparison: an escape every 17
// bytes, many of them \u escapes and surrogate pairs.
var denseWords = []string{
	"the", "request", "budget", "tokens", "streaming", "gateway", "latency", "model",
	"please", "summarize", "document", "section", "\\n", "\\n\\n", "\\\"quoted\\\"", "\\t",
	"café", "naïve", "\\u00e9t\\u00e9", "日本語", "C:\\\\path\\\\file", "emoji \\ud83d\\ude00",
	"function(x) { return x * 2; }", "- item", "1.", "**bold**",
}

// chatBody builds a realistic chat completions request of about size bytes:
// a system prompt, alternating user and assistant turns with long contents,
// some multimodal parts, and the usual scalar fields.
func chatBody(size int, seed uint64) []byte { return chatBodyOf(size, seed, proseWords) }

func chatBodyOf(size int, seed uint64, words []string) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	var sb strings.Builder
	sb.WriteString(`{"model":"gpt-4o-2024-08-06","stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":4096,"temperature":0.7,"user":"user-1234","messages":[`)
	sb.WriteString(`{"role":"system","content":"You are a helpful assistant.\nAnswer briefly."}`)
	text := func(n int) {
		for k := 0; k < n; {
			w := words[r.IntN(len(words))]
			sb.WriteString(w)
			sb.WriteByte(' ')
			k += len(w) + 1
		}
	}
	turn := 0
	for sb.Len() < size-320 {
		role := "user"
		if turn%2 == 1 {
			role = "assistant"
		}
		if turn%7 == 4 {
			fmt.Fprintf(&sb, `,{"role":"user","content":[{"type":"text","text":"`)
			text(200)
			sb.WriteString(`"},{"type":"image_url","image_url":{"url":"https://example.com/a.png","detail":"low"}}]}`)
		} else {
			fmt.Fprintf(&sb, `,{"role":%q,"content":"`, role)
			text(min(size/3, 500+r.IntN(6000)))
			sb.WriteString(`"}`)
		}
		turn++
	}
	sb.WriteString(`],"tools":[{"type":"function","function":{"name":"lookup","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}}]}`)
	return []byte(sb.String())
}

// typedChat is what a conventional decoder would unmarshal the body into.
type typedChat struct {
	Model               string `json:"model"`
	MaxTokens           *int64 `json:"max_tokens"`
	MaxCompletionTokens *int64 `json:"max_completion_tokens"`
	N                   *int64 `json:"n"`
	Stream              bool   `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	User     string `json:"user"`
	Messages []struct {
		Role    string `json:"role"`
		Content any    `json:"content"`
	} `json:"messages"`
	Tools       []any   `json:"tools"`
	Temperature float64 `json:"temperature"`
}

func BenchmarkScanRequest(b *testing.B) {
	for _, bc := range []struct {
		name string
		body []byte
	}{
		{"1KiB", chatBody(1<<10, 1)},
		{"1MiB", chatBody(1<<20, 1)},
		{"1MiB_dense_escapes", chatBodyOf(1<<20, 1, denseWords)},
	} {
		body := bc.body
		b.Run("llmapi/"+bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			var f RequestFields
			for b.Loop() {
				if err := ScanRequest(APIOpenAIChat, body, &f); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("encoding_json/"+bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				var c typedChat
				if err := json.Unmarshal(body, &c); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("gjson/"+bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if gjsonScan(body).Model == "" {
					b.Fatal("no model")
				}
			}
		})
	}
}

// gjsonScan is the same extraction done with gjson, validation included.
func gjsonScan(body []byte) RequestFields {
	var f RequestFields
	if !gjson.ValidBytes(body) {
		return f
	}
	r := gjson.GetManyBytes(body, "model", "max_tokens", "max_completion_tokens", "n", "stream",
		"stream_options.include_usage", "user")
	f.Model = r[0].String()
	f.MaxTokens = max(r[1].Int(), r[2].Int())
	f.N = 1
	if r[3].Exists() {
		f.N = r[3].Int()
	}
	f.Stream = r[4].Bool()
	f.IncludeUsage = r[5].Bool()
	f.User = r[6].String()
	gjson.GetBytes(body, "messages").ForEach(func(_, m gjson.Result) bool {
		c := m.Get("content")
		if c.Type == gjson.String {
			f.PromptBytes += int64(len(c.Str))
			return true
		}
		c.ForEach(func(_, p gjson.Result) bool {
			switch p.Get("type").Str {
			case "text":
				f.PromptBytes += int64(len(p.Get("text").Str))
			case "image_url":
				f.Images++
			}
			return true
		})
		return true
	})
	return f
}

// chatStream builds an OpenAI chat SSE stream of n content chunks and a final
// usage chunk, as one body and as the events Envoy would deliver one by one.
func chatStream(n int) (body []byte, events [][]byte) {
	r := rand.New(rand.NewPCG(4, 5))
	for i := range n {
		w := proseWords[r.IntN(len(proseWords))]
		ev := fmt.Sprintf(`data: {"id":"chatcmpl-AbCdEf123","object":"chat.completion.chunk","created":1718000000,"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_0ba0d124f1","choices":[{"index":0,"delta":{"content":" %s"},"logprobs":null,"finish_reason":null}],"usage":null}`+"\n\n", w)
		if i == 0 {
			ev = `data: {"id":"chatcmpl-AbCdEf123","object":"chat.completion.chunk","created":1718000000,"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_0ba0d124f1","choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n"
		}
		events = append(events, []byte(ev))
	}
	events = append(events,
		[]byte(`data: {"id":"chatcmpl-AbCdEf123","object":"chat.completion.chunk","created":1718000000,"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_0ba0d124f1","choices":[],"usage":{"prompt_tokens":1017,"completion_tokens":5000,"total_tokens":6017,"prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}}}`+"\n\n"),
		[]byte("data: [DONE]\n\n"))
	for _, e := range events {
		body = append(body, e...)
	}
	return body, events
}

// anthropicStream is the Anthropic counterpart of chatStream.
func anthropicStream(n int) (body []byte, events [][]byte) {
	r := rand.New(rand.NewPCG(6, 7))
	events = append(events, []byte("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-5\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":472,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0,\"output_tokens\":2}}}\n\n"))
	for range n {
		w := proseWords[r.IntN(len(proseWords))]
		events = append(events, fmt.Appendf(nil, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" %s\"}}\n\n", w))
	}
	events = append(events,
		[]byte("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":5000}}\n\n"),
		[]byte("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"))
	for _, e := range events {
		body = append(body, e...)
	}
	return body, events
}

// padding returns the random letters and digits that OpenAI streams carry in
// an "obfuscation" member to hide the length of each chunk's text.
func padding(r *rand.Rand) string {
	const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 1+r.IntN(15))
	for i := range b {
		b[i] = alphabet[r.IntN(len(alphabet))]
	}
	return string(b)
}

// chatStreamCurrent is chatStream the way chat completions streams look now:
// a service_tier, and obfuscation padding that differs in every chunk.
func chatStreamCurrent(n int) (body []byte, events [][]byte) {
	r := rand.New(rand.NewPCG(10, 11))
	for range n {
		events = append(events, fmt.Appendf(nil, `data: {"id":"chatcmpl-C3xBvQ9nJ2kLmP4rT8sWuY6zA1dE","object":"chat.completion.chunk","created":1754303561,"model":"gpt-4.1-mini-2025-04-14","service_tier":"default","system_fingerprint":"fp_6f2eabb9a5","choices":[{"index":0,"delta":{"content":" %s"},"logprobs":null,"finish_reason":null}],"usage":null,"obfuscation":%q}`+"\n\n",
			proseWords[r.IntN(len(proseWords))], padding(r)))
	}
	events = append(events,
		[]byte(`data: {"id":"chatcmpl-C3xBvQ9nJ2kLmP4rT8sWuY6zA1dE","object":"chat.completion.chunk","created":1754303561,"model":"gpt-4.1-mini-2025-04-14","service_tier":"default","system_fingerprint":"fp_6f2eabb9a5","choices":[],"usage":{"prompt_tokens":1017,"completion_tokens":5000,"total_tokens":6017,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"obfuscation":"Xq"}`+"\n\n"),
		[]byte("data: [DONE]\n\n"))
	for _, e := range events {
		body = append(body, e...)
	}
	return body, events
}

// chatStreamLogprobs is a chat stream that asked for logprobs: every chunk
// carries an object of its own beside the text.
func chatStreamLogprobs(n int) (body []byte, events [][]byte) {
	r := rand.New(rand.NewPCG(12, 13))
	for range n {
		w := " " + proseWords[r.IntN(len(proseWords))]
		var tb []string
		for _, c := range []byte(w) {
			tb = append(tb, fmt.Sprint(c))
		}
		events = append(events, fmt.Appendf(nil, `data: {"id":"chatcmpl-C3xBvQ9nJ2kLmP4rT8sWuY6zA1dE","object":"chat.completion.chunk","created":1754303561,"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_0ba0d124f1","choices":[{"index":0,"delta":{"content":%q},"logprobs":{"content":[{"token":%q,"logprob":-%d.%04d,"bytes":[%s],"top_logprobs":[]}],"refusal":null},"finish_reason":null}],"usage":null}`+"\n\n",
			w, w, r.IntN(3), r.IntN(10000), strings.Join(tb, ",")))
	}
	events = append(events,
		[]byte(`data: {"id":"chatcmpl-C3xBvQ9nJ2kLmP4rT8sWuY6zA1dE","object":"chat.completion.chunk","created":1754303561,"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_0ba0d124f1","choices":[],"usage":{"prompt_tokens":1017,"completion_tokens":5000,"total_tokens":6017}}`+"\n\n"),
		[]byte("data: [DONE]\n\n"))
	for _, e := range events {
		body = append(body, e...)
	}
	return body, events
}

// responsesStream is a Responses API stream: output_text.delta events, each
// with its own sequence number and padding, then response.completed.
func responsesStream(n int) (body []byte, events [][]byte) {
	r := rand.New(rand.NewPCG(14, 15))
	for i := range n {
		events = append(events, fmt.Appendf(nil, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":%d,\"item_id\":\"msg_68a1f0c2b9e48190a3d5c7e9f1b2d4f60a1b2c3d4e5f6a7b\",\"output_index\":0,\"content_index\":0,\"delta\":\" %s\",\"logprobs\":[],\"obfuscation\":%q}\n\n",
			i+4, proseWords[r.IntN(len(proseWords))], padding(r)))
	}
	events = append(events, fmt.Appendf(nil, "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":%d,\"response\":{\"id\":\"resp_68a1f0c1d2e38190b4c6d8e0f2a4b6c80a1b2c3d4e5f6a7b\",\"object\":\"response\",\"created_at\":1755443393,\"status\":\"completed\",\"model\":\"gpt-4.1-2025-04-14\",\"output\":[],\"usage\":{\"input_tokens\":37,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":5000,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":5037}}}\n\n", n+4))
	for _, e := range events {
		body = append(body, e...)
	}
	return body, events
}

// chatStreamUnordered is chatStream with its members in a different order
// from one chunk to the next, which no upstream does: nothing repeats, so it
// measures the scan of a stream whose events must all be read in full.
func chatStreamUnordered(n int) (body []byte, events [][]byte) {
	r := rand.New(rand.NewPCG(16, 17))
	for i := range n {
		members := []string{
			`"id":"chatcmpl-AbCdEf123"`, `"object":"chat.completion.chunk"`, `"created":1718000000`,
			`"model":"gpt-4o-mini-2024-07-18"`, `"system_fingerprint":"fp_0ba0d124f1"`,
			fmt.Sprintf(`"choices":[{"index":0,"delta":{"content":" %s"},"logprobs":null,"finish_reason":null}]`, proseWords[r.IntN(len(proseWords))]),
			`"usage":null`,
		}
		k := i % len(members)
		members = append(members[k:], members[:k]...)
		events = append(events, []byte("data: {"+strings.Join(members, ",")+"}\n\n"))
	}
	events = append(events,
		[]byte(`data: {"choices":[],"usage":{"prompt_tokens":1017,"completion_tokens":5000,"total_tokens":6017}}`+"\n\n"),
		[]byte("data: [DONE]\n\n"))
	for _, e := range events {
		body = append(body, e...)
	}
	return body, events
}

// chatJSON builds a non-streamed chat completion of about size bytes whose
// content is long text with escapes.
func chatJSON(size int) []byte {
	r := rand.New(rand.NewPCG(8, 9))
	var sb strings.Builder
	sb.WriteString(`{"id":"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG","object":"chat.completion","created":1741570283,"model":"gpt-4o-2024-08-06","choices":[{"index":0,"message":{"role":"assistant","content":"`)
	for sb.Len() < size-600 {
		sb.WriteString(proseWords[r.IntN(len(proseWords))])
		sb.WriteByte(' ')
	}
	sb.WriteString(`","refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":1117,"completion_tokens":46000,"total_tokens":47117,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"service_tier":"default","system_fingerprint":"fp_fc9f1d7035"}`)
	return []byte(sb.String())
}

func BenchmarkUsageScanner(b *testing.B) {
	chatBody, chatEvents := chatStream(5000)
	anthBody, anthEvents := anthropicStream(5000)
	currentBody, currentEvents := chatStreamCurrent(5000)
	logprobsBody, logprobsEvents := chatStreamLogprobs(5000)
	respBody, respEvents := responsesStream(5000)
	unorderedBody, unorderedEvents := chatStreamUnordered(5000)
	jsonBody := chatJSON(1 << 20)
	gz := gzipBytes(b, chatBody, 6)
	cases := []struct {
		name     string
		api      API
		ct, enc  string
		body     []byte
		chunks   [][]byte
		wantKnow bool
	}{
		{"openai_sse/event_per_write", APIOpenAIChat, "text/event-stream", "", chatBody, chatEvents, true},
		{"openai_sse/16KiB_writes", APIOpenAIChat, "text/event-stream", "", chatBody, chunk(chatBody, 16<<10), true},
		{"anthropic_sse/event_per_write", APIAnthropicMessages, "text/event-stream", "", anthBody, anthEvents, true},
		{"openai_json_1MiB/16KiB_writes", APIOpenAIChat, "application/json", "", jsonBody, chunk(jsonBody, 16<<10), true},
		{"openai_sse_gzip/4KiB_writes", APIOpenAIChat, "text/event-stream", "gzip", chatBody, chunk(gz, 4<<10), true},
		{"openai_sse_current/event_per_write", APIOpenAIChat, "text/event-stream", "", currentBody, currentEvents, true},
		{"openai_sse_current/16KiB_writes", APIOpenAIChat, "text/event-stream", "", currentBody, chunk(currentBody, 16<<10), true},
		{"openai_sse_logprobs/event_per_write", APIOpenAIChat, "text/event-stream", "", logprobsBody, logprobsEvents, true},
		{"openai_sse_unordered/event_per_write", APIOpenAIChat, "text/event-stream", "", unorderedBody, unorderedEvents, true},
		{"responses_sse/event_per_write", APIOpenAIResponses, "text/event-stream", "", respBody, respEvents, true},
		{"anthropic_sse_chunked/16KiB_writes", APIAnthropicMessages, "text/event-stream", "", anthBody, chunk(anthBody, 16<<10), true},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(c.body)))
			b.ReportAllocs()
			var s UsageScanner
			for b.Loop() {
				s.Reset(c.api, c.ct, c.enc)
				for _, ch := range c.chunks {
					s.Write(ch)
				}
				if u := s.Finish(); u.Known != c.wantKnow {
					b.Fatalf("usage %+v", u)
				}
			}
			b.ReportMetric(float64(len(c.chunks)), "writes/op")
		})
	}
}

func chunk(b []byte, n int) [][]byte {
	var out [][]byte
	for len(b) > 0 {
		k := min(n, len(b))
		out = append(out, b[:k])
		b = b[k:]
	}
	return out
}

// naiveSSEUsage is how usage is commonly read from a stream: split lines,
// decode every data payload with encoding/json. It buffers and allocates,
// and is here only as the baseline the scanner is measured against.
func naiveSSEUsage(body []byte) (prompt, completion int64, content int) {
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		data, ok := bytes.CutPrefix(sc.Bytes(), []byte("data: "))
		if !ok {
			continue
		}
		var ev struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens     int64 `json:"prompt_tokens"`
				CompletionTokens int64 `json:"completion_tokens"`
			} `json:"usage"`
		}
		if json.Unmarshal(data, &ev) != nil {
			continue
		}
		for _, c := range ev.Choices {
			content += len(c.Delta.Content)
		}
		if ev.Usage != nil {
			prompt, completion = ev.Usage.PromptTokens, ev.Usage.CompletionTokens
		}
	}
	return prompt, completion, content
}

func BenchmarkUsageBaseline(b *testing.B) {
	body, _ := chatStream(5000)
	b.Run("bufio_encoding_json/openai_sse", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			if p, _, _ := naiveSSEUsage(body); p != 1017 {
				b.Fatal("no usage")
			}
		}
	})
}
