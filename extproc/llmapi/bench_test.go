package llmapi

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/buger/jsonparser"
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

// workloadBody is the request of the overhead benchmark's stream
// (integration/bench.ChatBody(1024)): the 1 KiB streamed chat request the
// server reads once per stream.
func workloadBody() []byte {
	const head = `{"model":"deepseek-chat","messages":[{"role":"system","content":"You are the support assistant of Acme Corp. Answer in at most three sentences and cite the knowledge-base article you used."},{"role":"user","content":"`
	const tail = `"}],"stream":true,"max_tokens":256,"temperature":0.2,"user":"user-4711"}`
	const text = "My order #48213 arrived with a cracked screen and the replacement I was promised last week has not shipped. "
	b := []byte(head)
	for pad := 1024 - len(head) - len(tail); pad > 0; {
		n := min(pad, len(text))
		b = append(b, text[:n]...)
		pad -= n
	}
	return append(b, tail...)
}

// workloadChunks is the overhead benchmark's streamed answer
// (integration/bench.SSEChunks), one body message each: two content chunks,
// then the usage and [DONE].
var workloadChunks = [][]byte{
	[]byte(`data: {"id":"chatcmpl-b1","object":"chat.completion.chunk","created":1767225600,"model":"deepseek-chat","choices":[{"index":0,"delta":{"role":"assistant","content":"Sorry about the screen. "},"finish_reason":null}]}` + "\n\n"),
	[]byte(`data: {"id":"chatcmpl-b1","object":"chat.completion.chunk","created":1767225600,"model":"deepseek-chat","choices":[{"index":0,"delta":{"content":"I have escalated the replacement (KB-112)."},"finish_reason":"stop"}]}` + "\n\n"),
	[]byte(`data: {"id":"chatcmpl-b1","object":"chat.completion.chunk","created":1767225600,"model":"deepseek-chat","choices":[],"usage":{"prompt_tokens":231,"completion_tokens":17,"total_tokens":248}}` + "\n\ndata: [DONE]\n\n"),
}

func BenchmarkScanRequest(b *testing.B) {
	for _, bc := range []struct {
		name string
		body []byte
	}{
		{"workload_1KiB", workloadBody()},
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
		b.Run("jsonparser/"+bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if jsonparserScan(body).Model == "" {
					b.Fatal("no model")
				}
			}
		})
	}
}

// TestLibraryScansAgree checks that the library baselines of ScanRequest
// extract what it does from the benchmark bodies, so that they are measured
// doing the same work.
func TestLibraryScansAgree(t *testing.T) {
	for _, body := range [][]byte{workloadBody(), chatBody(1<<10, 1), chatBody(64<<10, 2)} {
		var want RequestFields
		if err := ScanRequest(APIOpenAIChat, body, &want); err != nil {
			t.Fatal(err)
		}
		for name, got := range map[string]RequestFields{"gjson": gjsonScan(body), "jsonparser": jsonparserScan(body)} {
			got.HasMaxTokens, got.HasStreamOptions = want.HasMaxTokens, want.HasStreamOptions
			got.BestOf, got.Prompts, got.Choices = want.BestOf, want.Prompts, want.Choices // one of each: chat bodies
			if got != public(want) {
				t.Errorf("%s: %+v\nScanRequest: %+v", name, got, want)
			}
		}
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

// requestPaths are the fields jsonparserScan reads in one pass.
var requestPaths = [][]string{{"model"}, {"max_tokens"}, {"max_completion_tokens"}, {"n"}, {"stream"},
	{"stream_options", "include_usage"}, {"user"}}

// jsonparserScan is the same extraction done with jsonparser, which does not
// validate: encoding/json's Valid does that first, as ScanRequest must
// refuse what is not JSON.
func jsonparserScan(body []byte) RequestFields {
	var f RequestFields
	if !json.Valid(body) {
		return f
	}
	f.N = 1
	jsonparser.EachKey(body, func(i int, v []byte, _ jsonparser.ValueType, _ error) {
		switch i {
		case 0:
			f.Model, _ = jsonparser.ParseString(v)
		case 1, 2:
			n, _ := jsonparser.ParseInt(v)
			f.MaxTokens = max(f.MaxTokens, n)
		case 3:
			f.N, _ = jsonparser.ParseInt(v)
		case 4:
			f.Stream, _ = jsonparser.ParseBoolean(v)
		case 5:
			f.IncludeUsage, _ = jsonparser.ParseBoolean(v)
		case 6:
			f.User, _ = jsonparser.ParseString(v)
		}
	}, requestPaths...)
	var scratch [256]byte
	textLen := func(v []byte) int64 {
		s, _ := jsonparser.Unescape(v, scratch[:])
		return int64(len(s))
	}
	jsonparser.ArrayEach(body, func(m []byte, _ jsonparser.ValueType, _ int, _ error) {
		c, t, _, _ := jsonparser.Get(m, "content")
		if t == jsonparser.String {
			f.PromptBytes += textLen(c)
			return
		}
		jsonparser.ArrayEach(c, func(p []byte, _ jsonparser.ValueType, _ int, _ error) {
			typ, _ := jsonparser.GetUnsafeString(p, "type")
			switch typ {
			case "text":
				v, _, _, _ := jsonparser.Get(p, "text")
				f.PromptBytes += textLen(v)
			case "image_url":
				f.Images++
			}
		})
	}, "messages")
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

// typedCompletion is what a conventional decoder unmarshals a chat completion,
// or one chunk of a streamed one, into to read its usage.
type typedCompletion struct {
	Choices []struct {
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int64 `json:"prompt_tokens"`
		CompletionTokens    int64 `json:"completion_tokens"`
		TotalTokens         int64 `json:"total_tokens"`
		PromptTokensDetails struct {
			CachedTokens int64 `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
		CompletionTokensDetails struct {
			ReasoningTokens int64 `json:"reasoning_tokens"`
		} `json:"completion_tokens_details"`
	} `json:"usage"`
}

// fold adds what one decoded document reports to u.
func (c *typedCompletion) fold(u *Usage) {
	for _, ch := range c.Choices {
		u.ContentBytes += int64(len(ch.Message.Content) + len(ch.Delta.Content))
	}
	if c.Usage != nil {
		u.PromptTokens, u.CompletionTokens, u.TotalTokens = c.Usage.PromptTokens, c.Usage.CompletionTokens, c.Usage.TotalTokens
		u.CachedTokens, u.ReasoningTokens = c.Usage.PromptTokensDetails.CachedTokens, c.Usage.CompletionTokensDetails.ReasoningTokens
		u.Known, u.PromptKnown = true, true
	}
}

var gjsonUsagePaths = []string{"usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens",
	"usage.prompt_tokens_details.cached_tokens", "usage.completion_tokens_details.reasoning_tokens", "choices"}

// gjsonFold is typedCompletion.fold done with gjson, validation included.
func gjsonFold(doc []byte, u *Usage) {
	if !gjson.ValidBytes(doc) {
		return
	}
	r := gjson.GetManyBytes(doc, gjsonUsagePaths...)
	r[5].ForEach(func(_, ch gjson.Result) bool {
		u.ContentBytes += int64(len(ch.Get("message.content").Str) + len(ch.Get("delta.content").Str))
		return true
	})
	if r[0].Exists() {
		u.PromptTokens, u.CompletionTokens, u.TotalTokens = r[0].Int(), r[1].Int(), r[2].Int()
		u.CachedTokens, u.ReasoningTokens = r[3].Int(), r[4].Int()
		u.Known, u.PromptKnown = true, true
	}
}

// sseLibrary reads an OpenAI stream the way a library-based reader would:
// split it into lines and decode every data payload with decode. It is given
// the whole body, so it does none of the work of carrying a line across
// chunks that a reader of Envoy's chunks would need: the comparison favours
// it.
func sseLibrary(body []byte, decode func([]byte, *Usage)) Usage {
	var u Usage
	for len(body) > 0 {
		var line []byte
		line, body, _ = bytes.Cut(body, []byte{'\n'})
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimPrefix(data, []byte{' '})
		if string(data) == "[DONE]" {
			continue
		}
		decode(data, &u)
	}
	return u
}

func encodingJSONFold(doc []byte, u *Usage) {
	var c typedCompletion
	if json.Unmarshal(doc, &c) == nil {
		c.fold(u)
	}
}

// usageInputs are the response bodies the usage parsers are compared on: the
// overhead benchmark's stream as the server gets it (3 body messages), and a
// non-streamed answer of the same order of size, and 1 MiB of each.
func usageInputs() []struct {
	name, ct string
	body     []byte
	chunks   [][]byte
} {
	sse, _ := chatStream(4000)
	js1, js2 := chatJSON(1<<10), chatJSON(1<<20)
	return []struct {
		name, ct string
		body     []byte
		chunks   [][]byte
	}{
		{"sse_workload_3_chunks", "text/event-stream", bytes.Join(workloadChunks, nil), workloadChunks},
		{"sse_1MiB", "text/event-stream", sse, chunk(sse, 16<<10)},
		{"json_1KiB", "application/json", js1, [][]byte{js1}},
		{"json_1MiB", "application/json", js2, chunk(js2, 16<<10)},
	}
}

// BenchmarkUsageParsers sets the usage scanner against encoding/json and
// gjson on the same responses. The scanner gets the body in the pieces Envoy
// delivers; the libraries get it whole (they need each document whole).
func BenchmarkUsageParsers(b *testing.B) {
	for _, in := range usageInputs() {
		var s UsageScanner
		scan := func() Usage {
			s.Reset(APIOpenAIChat, in.ct, "")
			for _, c := range in.chunks {
				s.Write(c)
			}
			return s.Finish()
		}
		want := scan()
		if !want.Known {
			b.Fatalf("%s: no usage", in.name)
		}
		libs := map[string]func([]byte, *Usage){"encoding_json": encodingJSONFold, "gjson": gjsonFold}
		for _, name := range []string{"llmapi", "encoding_json", "gjson"} {
			run := scan
			if fold := libs[name]; fold != nil {
				run = func() Usage {
					if in.ct == "text/event-stream" {
						return sseLibrary(in.body, fold)
					}
					var u Usage
					fold(in.body, &u)
					return u
				}
			}
			b.Run(in.name+"/"+name, func(b *testing.B) {
				if got := run(); got != want {
					b.Fatalf("%+v, scanner %+v", got, want)
				}
				b.SetBytes(int64(len(in.body)))
				b.ReportAllocs()
				for b.Loop() {
					run()
				}
			})
		}
	}
}
