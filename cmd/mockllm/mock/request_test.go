package mock

import (
	"net/http"
	"strings"
	"testing"
)

func TestParseRequest(t *testing.T) {
	tests := []struct {
		name    string
		api     api
		body    string
		want    parsedRequest
		wantErr string
	}{
		{
			name: "chat string content rounds the summed bytes up",
			api:  apiChat,
			// "hello" + "world!" = 11 bytes → ceil(11/4) = 3.
			body: `{"model":"gpt-4o","messages":[{"role":"system","content":"hello"},{"role":"user","content":"world!"}]}`,
			want: parsedRequest{Model: "gpt-4o", PromptTokens: 3},
		},
		{
			name: "chat content parts count only text",
			api:  apiChat,
			body: `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"abcd"},{"type":"image_url","image_url":{"url":"http://x/abcdefgh"}},{"type":"text","text":"efgh"}]}]}`,
			want: parsedRequest{Model: "m", PromptTokens: 2},
		},
		{
			name: "chat null content and multibyte text count bytes",
			api:  apiChat,
			body: `{"model":"m","messages":[{"role":"assistant","content":null},{"role":"user","content":"héllo"}]}`,
			want: parsedRequest{Model: "m", PromptTokens: 2},
		},
		{
			name: "chat max_completion_tokens wins over max_tokens",
			api:  apiChat,
			body: `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":9,"max_completion_tokens":7}`,
			want: parsedRequest{Model: "m", PromptTokens: 1, MaxTokens: 7},
		},
		{
			name: "chat stream with include_usage",
			api:  apiChat,
			body: `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"x"}]}`,
			want: parsedRequest{Model: "m", PromptTokens: 1, Stream: true, IncludeUsage: true},
		},
		{
			name: "chat null max_tokens is absent",
			api:  apiChat,
			body: `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":null}`,
			want: parsedRequest{Model: "m", PromptTokens: 1},
		},
		{
			name: "completions string array",
			api:  apiCompletions,
			body: `{"model":"m","prompt":["abc","defgh"],"max_tokens":4}`,
			want: parsedRequest{Model: "m", PromptTokens: 2, MaxTokens: 4},
		},
		{
			name: "completions token ids count one each",
			api:  apiCompletions,
			body: `{"model":"m","prompt":[1,2,3,4,5]}`,
			want: parsedRequest{Model: "m", PromptTokens: 5},
		},
		{
			name: "embeddings string",
			api:  apiEmbeddings,
			body: `{"model":"e","input":"abcdefghi","stream":true}`,
			want: parsedRequest{Model: "e", PromptTokens: 3, Inputs: []string{"abcdefghi"}},
		},
		{
			name: "embeddings token arrays and options",
			api:  apiEmbeddings,
			body: `{"model":"e","input":[[1,2],[3]],"dimensions":8,"encoding_format":"base64"}`,
			want: parsedRequest{Model: "e", PromptTokens: 3, Inputs: []string{"[1,2]", "[3]"}, Dimensions: 8, Base64: true},
		},
		{
			name: "embeddings mixed strings and token arrays",
			api:  apiEmbeddings,
			body: `{"model":"e","input":["abcd",[7,8]]}`,
			want: parsedRequest{Model: "e", PromptTokens: 3, Inputs: []string{"abcd", "[7,8]"}},
		},
		{
			name: "responses instructions and string input",
			api:  apiResponses,
			body: `{"model":"m","instructions":"abcd","input":"efgh","max_output_tokens":10,"stream":true}`,
			want: parsedRequest{Model: "m", PromptTokens: 2, MaxTokens: 10, Stream: true},
		},
		{
			name: "responses item array with parts",
			api:  apiResponses,
			body: `{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"abcdefgh"}]},{"role":"user","content":"ij"}]}`,
			want: parsedRequest{Model: "m", PromptTokens: 3},
		},
		{
			name: "responses without input",
			api:  apiResponses,
			body: `{"model":"m","previous_response_id":"resp_1"}`,
			want: parsedRequest{Model: "m"},
		},
		{
			name: "messages with system blocks",
			api:  apiMessages,
			body: `{"model":"claude","max_tokens":100,"system":[{"type":"text","text":"abcd"}],"messages":[{"role":"user","content":[{"type":"text","text":"efgh"}]}]}`,
			want: parsedRequest{Model: "claude", PromptTokens: 2, MaxTokens: 100},
		},
		{
			name: "messages with string system",
			api:  apiMessages,
			body: `{"model":"claude","system":"abc","messages":[{"role":"user","content":"de"}]}`,
			want: parsedRequest{Model: "claude", PromptTokens: 2},
		},
		{name: "empty body", api: apiChat, body: ``, wantErr: "JSON object"},
		{name: "array body", api: apiChat, body: `[1]`, wantErr: "JSON object"},
		{name: "broken JSON", api: apiChat, body: `{"model":`, wantErr: "not valid JSON"},
		{name: "missing model", api: apiChat, body: `{"messages":[{"role":"user","content":"x"}]}`, wantErr: "model"},
		{name: "missing messages", api: apiChat, body: `{"model":"m"}`, wantErr: "messages is required"},
		{name: "empty messages", api: apiMessages, body: `{"model":"m","messages":[]}`, wantErr: "must not be empty"},
		{name: "messages not an array", api: apiChat, body: `{"model":"m","messages":"hi"}`, wantErr: "array"},
		{name: "content a number", api: apiChat, body: `{"model":"m","messages":[{"content":5}]}`, wantErr: "content"},
		{name: "stream not a bool", api: apiChat, body: `{"model":"m","stream":"yes","messages":[{"content":"x"}]}`, wantErr: "not valid JSON"},
		{name: "max_tokens zero", api: apiChat, body: `{"model":"m","max_tokens":0,"messages":[{"content":"x"}]}`, wantErr: "max_tokens 0"},
		{name: "max_tokens too large", api: apiMessages, body: `{"model":"m","max_tokens":999999999,"messages":[{"content":"x"}]}`, wantErr: "max_tokens"},
		{name: "max_output_tokens negative", api: apiResponses, body: `{"model":"m","max_output_tokens":-1}`, wantErr: "max_output_tokens"},
		{name: "prompt missing", api: apiCompletions, body: `{"model":"m"}`, wantErr: "prompt is required"},
		{name: "prompt an object", api: apiCompletions, body: `{"model":"m","prompt":{}}`, wantErr: "prompt must be"},
		{name: "input empty array", api: apiEmbeddings, body: `{"model":"m","input":[]}`, wantErr: "must not be empty"},
		{name: "negative token id", api: apiEmbeddings, body: `{"model":"m","input":[1,-2]}`, wantErr: "must not be negative"},
		{name: "fractional token id", api: apiEmbeddings, body: `{"model":"m","input":[1.5]}`, wantErr: "integer token ids"},
		{name: "input item a bool", api: apiEmbeddings, body: `{"model":"m","input":["a",true]}`, wantErr: "input[1]"},
		{name: "bad encoding format", api: apiEmbeddings, body: `{"model":"m","input":"a","encoding_format":"hex"}`, wantErr: "encoding_format"},
		{name: "bad dimensions", api: apiEmbeddings, body: `{"model":"m","input":"a","dimensions":0}`, wantErr: "dimensions"},
		{name: "instructions a number", api: apiResponses, body: `{"model":"m","instructions":3}`, wantErr: "instructions"},
		{name: "responses input a number", api: apiResponses, body: `{"model":"m","input":3}`, wantErr: "input must be"},
		{name: "system a number", api: apiMessages, body: `{"model":"m","system":3,"messages":[{"content":"x"}]}`, wantErr: "system"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseRequest(route{api: tt.api}, []byte(tt.body))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parseRequest error = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("parseRequest: %v", err)
			}
			if got.Model != tt.want.Model || got.PromptTokens != tt.want.PromptTokens || got.MaxTokens != tt.want.MaxTokens ||
				got.Stream != tt.want.Stream || got.IncludeUsage != tt.want.IncludeUsage ||
				got.Dimensions != tt.want.Dimensions || got.Base64 != tt.want.Base64 ||
				strings.Join(got.Inputs, "|") != strings.Join(tt.want.Inputs, "|") {
				t.Fatalf("parseRequest = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestComputeUsage(t *testing.T) {
	n := func(v int64) *int64 { return &v }
	tests := []struct {
		name    string
		api     api
		parsed  parsedRequest
		over    tokenOverrides
		want    usage
		wantErr bool
	}{
		{name: "default completion", api: apiChat, parsed: parsedRequest{PromptTokens: 10}, want: usage{Prompt: 10, Completion: 256}},
		{name: "body limit", api: apiMessages, parsed: parsedRequest{PromptTokens: 10, MaxTokens: 50}, want: usage{Prompt: 10, Completion: 50}},
		{name: "header beats body", api: apiChat, parsed: parsedRequest{PromptTokens: 10, MaxTokens: 50}, over: tokenOverrides{Completion: n(0)}, want: usage{Prompt: 10}},
		{name: "embeddings generate nothing", api: apiEmbeddings, parsed: parsedRequest{PromptTokens: 4}, over: tokenOverrides{Completion: n(9)}, want: usage{Prompt: 4}},
		{name: "cached and reasoning", api: apiResponses, parsed: parsedRequest{PromptTokens: 10, MaxTokens: 20}, over: tokenOverrides{Cached: n(4), Reasoning: n(5)}, want: usage{Prompt: 10, Completion: 20, Cached: 4, Reasoning: 5}},
		{name: "cached above prompt", api: apiChat, parsed: parsedRequest{PromptTokens: 3}, over: tokenOverrides{Cached: n(4)}, wantErr: true},
		{name: "reasoning above completion", api: apiChat, parsed: parsedRequest{PromptTokens: 3, MaxTokens: 2}, over: tokenOverrides{Reasoning: n(3)}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := computeUsage(tt.api, tt.parsed, tt.over, DefaultCompletionTokens)
			if (err != nil) != tt.wantErr {
				t.Fatalf("computeUsage error = %v, want error %v", err, tt.wantErr)
			}
			if !tt.wantErr && got != tt.want {
				t.Fatalf("computeUsage = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestParseTokenHeaders(t *testing.T) {
	tests := []struct {
		name    string
		headers map[string]string
		want    [3]int64 // completion, cached, reasoning; -1 for absent
		wantErr bool
	}{
		{name: "none", want: [3]int64{-1, -1, -1}},
		{name: "all", headers: map[string]string{HeaderCompletionTokens: "12", HeaderCachedTokens: " 3 ", HeaderReasoningTokens: "0"}, want: [3]int64{12, 3, 0}},
		{name: "not a number", headers: map[string]string{HeaderCompletionTokens: "many"}, wantErr: true},
		{name: "negative", headers: map[string]string{HeaderCachedTokens: "-1"}, wantErr: true},
		{name: "too large", headers: map[string]string{HeaderCompletionTokens: "99999999"}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			for k, v := range tt.headers {
				h.Set(k, v)
			}
			got, err := parseTokenHeaders(h)
			if (err != nil) != tt.wantErr {
				t.Fatalf("parseTokenHeaders error = %v, want error %v", err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			val := func(p *int64) int64 {
				if p == nil {
					return -1
				}
				return *p
			}
			if g := [3]int64{val(got.Completion), val(got.Cached), val(got.Reasoning)}; g != tt.want {
				t.Fatalf("parseTokenHeaders = %v, want %v", g, tt.want)
			}
		})
	}
}

func TestGeneratedTextHasOneTokenPerFourBytes(t *testing.T) {
	tests := []struct {
		name      string
		visible   int64
		per       int
		wantCount int64
	}{
		{name: "none", visible: 0, per: 1, wantCount: 0},
		{name: "one per chunk", visible: 7, per: 1, wantCount: 7},
		{name: "uneven chunks", visible: 7, per: 3, wantCount: 3},
		{name: "exact chunks", visible: 9, per: 3, wantCount: 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := chunkCount(tt.visible, tt.per)
			if n != tt.wantCount {
				t.Fatalf("chunkCount(%d, %d) = %d, want %d", tt.visible, tt.per, n, tt.wantCount)
			}
			var joined strings.Builder
			for i := range n {
				joined.WriteString(chunkText(i, tt.visible, tt.per))
			}
			whole := generatedText(0, tt.visible)
			if joined.String() != whole {
				t.Fatalf("chunks join to %q, want %q", joined.String(), whole)
			}
			if int64(len(whole)) != tt.visible*BytesPerToken {
				t.Fatalf("text of %d tokens has %d bytes, want %d", tt.visible, len(whole), tt.visible*BytesPerToken)
			}
		})
	}
}

func FuzzParseRequest(f *testing.F) {
	seeds := []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m","messages":[{"content":[{"type":"text","text":"x"}]}],"max_tokens":3}`,
		`{"model":"m","prompt":[[1,2],[3]]}`,
		`{"model":"m","input":["a",[1]],"dimensions":3,"encoding_format":"base64"}`,
		`{"model":"m","instructions":"x","input":[{"content":"y"}],"max_output_tokens":2}`,
		`{"model":"m","system":[{"text":"s"}],"messages":[{"content":"x"}]}`,
		`{"model":"m","messages":[{"content":5}]}`,
		`{"contents":[{"parts":[{"text":"x"},{"inlineData":{}}]}],"system_instruction":{"parts":[{"text":"s"}]},"generationConfig":{"maxOutputTokens":4,"candidateCount":2}}`,
		`{"generateContentRequest":{"contents":[{"parts":[{"text":"x"}]}]}}`,
		`{"content":{"parts":[{"text":"x"}]},"outputDimensionality":3}`,
		`{"messages":[{"role":"user","content":[{"text":"x"},{"image":{}}]}],"system":[{"text":"s"}],"inferenceConfig":{"maxTokens":5}}`,
		`{"anthropic_version":"bedrock-2023-05-31","max_tokens":3,"messages":[{"content":"x"}]}`,
		`[]`, ``, `{"model":`,
	}
	for _, s := range seeds {
		for a := apiChat; a <= apiInvokeStream; a++ {
			f.Add(uint8(a), []byte(s))
		}
	}
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		a := api(which % uint8(apiInvokeStream+1))
		rt := route{api: a}
		if a > apiMessages {
			rt.model = "anthropic.claude-m" // the path names the model
		}
		p, err := parseRequest(rt, body)
		if err != nil {
			return
		}
		if p.Model == "" {
			t.Fatal("accepted a request without a model")
		}
		if p.PromptTokens < 0 || p.PromptTokens > int64(len(body)) {
			t.Fatalf("prompt tokens %d out of range for a %d-byte body", p.PromptTokens, len(body))
		}
		if p.MaxTokens < 0 || p.MaxTokens > maxCompletionTokens {
			t.Fatalf("max tokens %d out of range", p.MaxTokens)
		}
		if (a == apiEmbeddings || a == apiGeminiEmbed) && len(p.Inputs) == 0 {
			t.Fatal("accepted embeddings without inputs")
		}
		if p.Stream != (a.pathStreams() || (p.Stream && !a.noOutput() && !a.gemini() && a != apiConverse && a != apiInvoke)) {
			t.Fatalf("%v streams %v", a, p.Stream)
		}
		u, err := computeUsage(a, p, tokenOverrides{}, DefaultCompletionTokens)
		if err != nil {
			t.Fatalf("computeUsage without overrides: %v", err)
		}
		if a.noOutput() && u.Completion != 0 {
			t.Fatalf("%v generated %d tokens", a, u.Completion)
		}
		if u.visible() < 0 {
			t.Fatalf("negative visible tokens: %+v", u)
		}
	})
}
