package llmapi

import (
	"errors"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// Nothing here starts goroutines (the gzip decoder is push-driven); this
	// keeps it that way.
	goleak.VerifyTestMain(m)
}

func TestAPIFromPath(t *testing.T) {
	tests := []struct {
		path string
		want API
	}{
		{"/v1/chat/completions", APIOpenAIChat},
		{"/v1/chat/completions?api-version=1", APIOpenAIChat},
		{"/openai/v1/chat/completions", APIOpenAIChat},
		{"/v1/chat/completions/", APIOpenAIChat},
		{"/v1/completions", APIOpenAICompletions},
		{"/v1/embeddings#frag", APIOpenAIEmbeddings},
		{"/v1/responses", APIOpenAIResponses},
		{"/api/v1/messages", APIAnthropicMessages},
		{"/proxy/v1/x/v1/messages", APIAnthropicMessages},
		{"/v1/messages/count_tokens", APIUnknown},
		{"/v1/messages/batches", APIUnknown},
		{"/v1/threads/abc/messages", APIUnknown},
		{"/v1/responses/resp_123", APIUnknown},
		{"/v1/models", APIUnknown},
		{"/v2/chat/completions", APIUnknown},
		{"/chat/completions", APIUnknown},
		{"/v1/", APIUnknown},
		{"", APIUnknown},
		{"?/v1/messages", APIUnknown},
	}
	for _, tc := range tests {
		t.Run(tc.path, func(t *testing.T) {
			if got := APIFromPath(tc.path); got != tc.want {
				t.Fatalf("APIFromPath(%q) = %v, want %v", tc.path, got, tc.want)
			}
		})
	}
	if n := testing.AllocsPerRun(100, func() { APIFromPath("/openai/v1/chat/completions?x=1") }); n != 0 {
		t.Fatalf("%v allocations", n)
	}
}

// TestParsePath: each provider's endpoints, with the model its path names and the dialect of
// its errors; lookalikes of each are unknown.
func TestParsePath(t *testing.T) {
	tests := []struct {
		path string
		want Route
	}{
		{"/v1/chat/completions", Route{API: APIOpenAIChat}},
		{"/v1/messages", Route{API: APIAnthropicMessages, Dialect: DialectAnthropic}},
		{"/v1/audio/transcriptions", Route{API: APIOpenAITranscriptions}},
		{"/v1/audio/translations/", Route{API: APIOpenAITranslations}},
		{"/v1/audio/speech", Route{API: APIOpenAISpeech}},
		{"/v1/images/generations", Route{API: APIOpenAIImages}},
		{"/v1/images/edits", Route{}},
		{"/v1/audio/transcriptions/x", Route{}},
		// Azure OpenAI.
		{"/openai/deployments/prod-gpt4o/chat/completions?api-version=2024-10-21", Route{API: APIOpenAIChat, Dialect: DialectAzure, Model: "prod-gpt4o"}},
		{"/openai/deployments/instruct/completions?api-version=2024-10-21", Route{API: APIOpenAICompletions, Dialect: DialectAzure, Model: "instruct"}},
		{"/openai/deployments/emb/embeddings?api-version=2024-10-21", Route{API: APIOpenAIEmbeddings, Dialect: DialectAzure, Model: "emb"}},
		{"/openai/deployments/whisper/audio/transcriptions?api-version=2024-06-01", Route{API: APIOpenAITranscriptions, Dialect: DialectAzure, Model: "whisper"}},
		{"/openai/deployments/dall-e-3/images/generations?api-version=2024-02-01", Route{API: APIOpenAIImages, Dialect: DialectAzure, Model: "dall-e-3"}},
		{"/azure/openai/deployments/my%20dep/chat/completions", Route{API: APIOpenAIChat, Dialect: DialectAzure, Model: "my dep"}},
		{"/openai/v1/chat/completions?api-version=preview", Route{API: APIOpenAIChat, Dialect: DialectAzure}},
		{"/openai/v1/responses", Route{API: APIOpenAIResponses, Dialect: DialectAzure}},
		{"/openai/responses?api-version=2025-03-01-preview", Route{API: APIOpenAIResponses, Dialect: DialectAzure}},
		{"/openai/deployments/d/responses", Route{}},
		{"/openai/deployments//chat/completions", Route{}},
		{"/openai/deployments/d/chat/completions/x", Route{}},
		{"/openai/deployments/d", Route{}},
		// Gemini.
		{"/v1beta/models/gemini-2.5-flash:generateContent", Route{API: APIGeminiGenerate, Dialect: DialectGemini, Model: "gemini-2.5-flash"}},
		{"/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", Route{API: APIGeminiStream, Dialect: DialectGemini, Model: "gemini-2.5-flash", SSE: true}},
		{"/v1beta/models/gemini-2.5-flash:streamGenerateContent?key=k&alt=sse#f", Route{API: APIGeminiStream, Dialect: DialectGemini, Model: "gemini-2.5-flash", SSE: true}},
		{"/v1beta/models/gemini-2.5-flash:streamGenerateContent", Route{API: APIGeminiStream, Dialect: DialectGemini, Model: "gemini-2.5-flash"}},
		{"/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=json", Route{API: APIGeminiStream, Dialect: DialectGemini, Model: "gemini-2.5-flash"}},
		{"/v1beta/models/gemini-2.5-flash:countTokens", Route{API: APIGeminiCountTokens, Dialect: DialectGemini, Model: "gemini-2.5-flash"}},
		{"/v1beta/models/text-embedding-004:embedContent", Route{API: APIGeminiEmbed, Dialect: DialectGemini, Model: "text-embedding-004"}},
		{"/v1/models/gemini-2.0-flash:generateContent", Route{API: APIGeminiGenerate, Dialect: DialectGemini, Model: "gemini-2.0-flash"}},
		{"/v1beta/tunedModels/my-tuned:generateContent", Route{API: APIGeminiGenerate, Dialect: DialectGemini, Model: "my-tuned"}},
		{"/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.0-flash:streamGenerateContent?alt=sse", Route{API: APIGeminiStream, Dialect: DialectGemini, Model: "gemini-2.0-flash", SSE: true}},
		{"/gemini/v1beta/models/gemini-2.5-pro:generateContent", Route{API: APIGeminiGenerate, Dialect: DialectGemini, Model: "gemini-2.5-pro"}},
		{"/v1beta/models/gemini-2.5-flash:batchGenerateContent", Route{}},
		{"/v1beta/models/gemini-2.5-flash", Route{}},
		{"/v1beta/files/x:generateContent", Route{}},
		{"/v1beta/models/:generateContent", Route{}},
		// Bedrock.
		{"/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse", Route{API: APIBedrockConverse, Dialect: DialectBedrock, Model: "anthropic.claude-3-haiku-20240307-v1:0"}},
		{"/model/amazon.nova-lite-v1:0/converse-stream", Route{API: APIBedrockConverseStream, Dialect: DialectBedrock, Model: "amazon.nova-lite-v1:0"}},
		{"/model/us.anthropic.claude-sonnet-4-20250514-v1%3a0/invoke", Route{API: APIBedrockInvoke, Dialect: DialectBedrock, Model: "us.anthropic.claude-sonnet-4-20250514-v1:0"}},
		{"/model/anthropic.claude-3-haiku-20240307-v1:0/invoke-with-response-stream", Route{API: APIBedrockInvokeStream, Dialect: DialectBedrock, Model: "anthropic.claude-3-haiku-20240307-v1:0"}},
		{"/model/meta.llama3-8b-instruct-v1%3A0/invoke", Route{Dialect: DialectBedrock, Model: "meta.llama3-8b-instruct-v1:0"}},
		{"/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123%3Ainference-profile%2Fus.anthropic.claude-3-haiku-20240307-v1%3A0/converse", Route{API: APIBedrockConverse, Dialect: DialectBedrock, Model: "arn:aws:bedrock:us-east-1:123:inference-profile/us.anthropic.claude-3-haiku-20240307-v1:0"}},
		{"/bedrock/model/m%zz/converse", Route{API: APIBedrockConverse, Dialect: DialectBedrock, Model: "m%zz"}},
		{"/model/m/converse/x", Route{}},
		{"/model//converse", Route{}},
		{"/model/m/apply-guardrail", Route{}},
	}
	for _, tc := range tests {
		t.Run(tc.path, func(t *testing.T) {
			if got := ParsePath(tc.path); got != tc.want {
				t.Fatalf("ParsePath(%q) = %+v, want %+v", tc.path, got, tc.want)
			}
		})
	}
	paths := []string{"/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", "/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse-stream",
		"/openai/deployments/prod-gpt4o/chat/completions?api-version=2024-10-21"}
	for _, p := range paths {
		ParsePath(p)
		if n := testing.AllocsPerRun(100, func() { ParsePath(p) }); n != 0 {
			t.Errorf("%s: %v allocations", p, n)
		}
	}
}

func FuzzParsePath(f *testing.F) {
	f.Add("/model/arn%3Aaws%3Ab%2Fx/converse")
	f.Add("/v1beta/models/g:streamGenerateContent?alt=sse")
	f.Add("/openai/deployments/d/chat/completions?api-version=1")
	f.Fuzz(func(t *testing.T, path string) {
		r := ParsePath(path)
		if r.API >= numAPIs || int(r.Dialect) >= len(dialectNames) || len(r.Model) > maxPathModel {
			t.Fatalf("%q: %+v", path, r)
		}
		if r.API != APIFromPath(path) {
			t.Fatal("APIFromPath disagrees")
		}
		if r.Model != "" && r.Dialect != DialectAzure && r.Dialect != DialectGemini && r.Dialect != DialectBedrock {
			t.Fatalf("%q: a model from the path of dialect %v", path, r.Dialect)
		}
		if r.SSE && r.API != APIGeminiStream {
			t.Fatalf("%q: SSE for %v", path, r.API)
		}
	})
}

func TestAPIString(t *testing.T) {
	tests := []struct {
		api       API
		name      string
		anthropic bool
	}{
		{APIUnknown, "unknown", false},
		{APIOpenAIChat, "openai.chat", false},
		{APIOpenAICompletions, "openai.completions", false},
		{APIOpenAIEmbeddings, "openai.embeddings", false},
		{APIOpenAIResponses, "openai.responses", false},
		{APIAnthropicMessages, "anthropic.messages", true},
		{APIBedrockInvoke, "bedrock.invoke", true},
		{APIBedrockInvokeStream, "bedrock.invoke_stream", true},
		{APIBedrockConverse, "bedrock.converse", false},
		{APIGeminiStream, "gemini.stream_generate_content", false},
		{APIOpenAITranscriptions, "openai.audio.transcriptions", false},
		{API(200), "unknown", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.api.String() != tc.name || tc.api.Anthropic() != tc.anthropic {
				t.Fatalf("%d: %q %v", tc.api, tc.api.String(), tc.api.Anthropic())
			}
		})
	}
}

func TestScanRequest(t *testing.T) {
	tests := []struct {
		name string
		api  API
		body string
		want RequestFields
		err  error
	}{
		{
			name: "openai chat",
			api:  APIOpenAIChat,
			body: `{"model":"gpt-4o","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi\n\"there\""}],"max_completion_tokens":256,"n":2,"stream":true,"stream_options":{"include_usage":true},"user":"u-1"}`,
			want: RequestFields{Model: "gpt-4o", MaxTokens: 256, HasMaxTokens: true, N: 2, Stream: true, HasStreamOptions: true, IncludeUsage: true, User: "u-1", PromptBytes: 9 + 10, Choices: 2},
		},
		{
			name: "openai chat multimodal parts and tool calls",
			api:  APIOpenAIChat,
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"text","text":"What is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}},{"type":"file","file":{"file_data":"AAAA"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"q\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"},{"role":"assistant","content":[{"type":"refusal","refusal":"No."}]}]}`,
			want: RequestFields{Model: "gpt-4o", N: 1, PromptBytes: 13 + 7 + 2 + 3, Images: 1, Audio: 1, Files: 1},
		},
		{
			name: "openai completions with prompt array",
			api:  APIOpenAICompletions,
			body: `{"model":"gpt-3.5-turbo-instruct","prompt":["Say this","is a test",[1,2,3]],"max_tokens":7,"stream":false}`,
			want: RequestFields{Model: "gpt-3.5-turbo-instruct", MaxTokens: 7, HasMaxTokens: true, N: 1, PromptBytes: 8 + 9, Prompts: 3, Choices: 3},
		},
		{
			name: "openai embeddings",
			api:  APIOpenAIEmbeddings,
			body: `{"model":"text-embedding-3-small","input":["caf\u00e9","tea"],"encoding_format":"float"}`,
			want: RequestFields{Model: "text-embedding-3-small", N: 1, PromptBytes: 5 + 3},
		},
		{
			name: "openai responses",
			api:  APIOpenAIResponses,
			body: `{"model":"gpt-4.1","instructions":"Talk like a pirate.","input":[{"role":"user","content":[{"type":"input_text","text":"Describe"},{"type":"input_image","image_url":"https://x/y.png"},{"type":"input_file","file_id":"f"}]},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"sunny"}],"max_output_tokens":500,"stream":true,"user":"u"}`,
			want: RequestFields{Model: "gpt-4.1", MaxTokens: 500, HasMaxTokens: true, N: 1, Stream: true, User: "u", PromptBytes: 19 + 8 + 2 + 5, Images: 1, Files: 1},
		},
		{
			name: "openai responses with a string input",
			api:  APIOpenAIResponses,
			body: `{"model":"gpt-4.1","input":"Tell me a story."}`,
			want: RequestFields{Model: "gpt-4.1", N: 1, PromptBytes: 16},
		},
		{
			name: "anthropic messages",
			api:  APIAnthropicMessages,
			body: `{"model":"claude-sonnet-4-5","max_tokens":1024,"system":[{"type":"text","text":"You are terse.","cache_control":{"type":"ephemeral"}}],"metadata":{"user_id":"acct-9"},"user":"ignored","stream":true,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}},{"type":"document","source":{"type":"text","data":"doc"}},{"type":"text","text":"Hello"}]},{"role":"assistant","content":[{"type":"thinking","thinking":"hmm","signature":"s"},{"type":"tool_use","id":"t","name":"f","input":{"text":"not prompt text"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"result"},{"type":"image","source":{}}]}]}]}`,
			want: RequestFields{Model: "claude-sonnet-4-5", MaxTokens: 1024, HasMaxTokens: true, N: 1, Stream: true, User: "acct-9", PromptBytes: 14 + 5 + 3 + 6, Images: 2, Files: 1},
		},
		{
			name: "anthropic system string",
			api:  APIAnthropicMessages,
			body: `{"model":"claude","max_tokens":1,"system":"sys","messages":[{"role":"user","content":"hi"}]}`,
			want: RequestFields{Model: "claude", MaxTokens: 1, HasMaxTokens: true, N: 1, PromptBytes: 5},
		},
		{
			name: "unknown api prefers user, then metadata.user_id",
			api:  APIUnknown,
			body: `{"metadata":{"user_id":"m"}}`,
			want: RequestFields{N: 1, User: "m"},
		},
		{
			name: "largest output limit wins",
			api:  APIOpenAIChat,
			body: `{"max_tokens":100,"max_completion_tokens":300,"max_output_tokens":200}`,
			want: RequestFields{MaxTokens: 300, HasMaxTokens: true, N: 1},
		},
		{
			name: "zero max_tokens is present",
			api:  APIOpenAIChat,
			body: `{"max_tokens":0}`,
			want: RequestFields{HasMaxTokens: true, N: 1},
		},
		{
			name: "nulls are absent",
			api:  APIOpenAIChat,
			body: `{"model":null,"max_tokens":null,"n":null,"stream":null,"stream_options":null,"user":null,"messages":null}`,
			want: RequestFields{N: 1},
		},
		{
			name: "duplicate keys: the last wins",
			api:  APIOpenAIChat,
			body: `{"model":"a","model":"b","stream":true,"stream":false,"messages":[{"content":"xxxxxxxx"}],"messages":[{"content":"yy"}],"stream_options":{"include_usage":true},"stream_options":{}}`,
			want: RequestFields{Model: "b", N: 1, HasStreamOptions: true, PromptBytes: 2},
		},
		{
			name: "duplicate keys inside a message",
			api:  APIOpenAIChat,
			body: `{"messages":[{"content":"xxxxxxxx","content":"yy","type":"image_url","type":"text"}]}`,
			want: RequestFields{N: 1, PromptBytes: 2},
		},
		{
			name: "a wrong value replaced by a good one is no error",
			api:  APIOpenAIChat,
			body: `{"max_tokens":"9","max_tokens":9}`,
			want: RequestFields{MaxTokens: 9, HasMaxTokens: true, N: 1},
		},
		{
			name: "escaped keys and values",
			api:  APIOpenAIChat,
			body: `{"mod\u0065l":"gpt\u002d4","\u0075ser":"\u00fc","messages":[{"c\u006fntent":"\ud83d\ude00"}]}`,
			want: RequestFields{Model: "gpt-4", User: "ü", N: 1, PromptBytes: 4},
		},
		{
			name: "max_tokens string",
			api:  APIOpenAIChat,
			body: `{"model":"m","max_tokens":"9","stream":true}`,
			want: RequestFields{Model: "m", N: 1, Stream: true},
			err:  ErrFieldType,
		},
		{
			name: "max_tokens fraction",
			api:  APIOpenAIChat,
			body: `{"max_tokens":9.5}`,
			want: RequestFields{N: 1},
			err:  ErrFieldType,
		},
		{
			name: "negative max_tokens",
			api:  APIOpenAIChat,
			body: `{"max_tokens":-1,"model":"m"}`,
			want: RequestFields{Model: "m", N: 1},
			err:  ErrFieldValue,
		},
		{
			name: "max_tokens beyond int64",
			api:  APIOpenAIChat,
			body: `{"max_tokens":92233720368547758070}`,
			want: RequestFields{N: 1},
			err:  ErrFieldValue,
		},
		{
			name: "negative n",
			api:  APIOpenAIChat,
			body: `{"n":-3}`,
			want: RequestFields{N: 1},
			err:  ErrFieldValue,
		},
		{
			name: "zero n",
			api:  APIOpenAIChat,
			body: `{"n":0}`,
			want: RequestFields{N: 1},
			err:  ErrFieldValue,
		},
		{
			name: "model number",
			api:  APIOpenAIChat,
			body: `{"model":5,"user":"u"}`,
			want: RequestFields{N: 1, User: "u"},
			err:  ErrFieldType,
		},
		{
			name: "stream string",
			api:  APIOpenAIChat,
			body: `{"stream":"true"}`,
			want: RequestFields{N: 1},
			err:  ErrFieldType,
		},
		{
			name: "stream_options not an object",
			api:  APIOpenAIChat,
			body: `{"stream_options":true}`,
			want: RequestFields{N: 1},
			err:  ErrFieldType,
		},
		{
			name: "include_usage not a boolean",
			api:  APIOpenAIChat,
			body: `{"stream_options":{"include_usage":1}}`,
			want: RequestFields{N: 1, HasStreamOptions: true},
			err:  ErrFieldType,
		},
		{
			name: "messages not an array",
			api:  APIOpenAIChat,
			body: `{"messages":"hi","model":"m"}`,
			want: RequestFields{Model: "m", N: 1},
			err:  ErrFieldType,
		},
		{
			name: "odd message shapes are ignored",
			api:  APIOpenAIChat,
			body: `{"messages":[1,null,"x",{"content":5},{"content":{"text":"t"}},[{"content":"deep"}]]}`,
			want: RequestFields{N: 1, PromptBytes: 1 + 1 + 4},
		},
		{
			name: "invalid UTF-8 is counted as bytes",
			api:  APIOpenAIChat,
			body: "{\"messages\":[{\"content\":\"\xff\xfe\"}]}",
			want: RequestFields{N: 1, PromptBytes: 2},
		},
		{
			name: "nesting at the limit",
			api:  APIOpenAIChat,
			body: `{"model":"m","x":` + strings.Repeat("[", maxDepth-1) + strings.Repeat("]", maxDepth-1) + `}`,
			want: RequestFields{Model: "m", N: 1},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var got RequestFields
			err := ScanRequest(tc.api, []byte(tc.body), &got)
			want := tc.want
			// One prompt, one choice and no best_of unless the case says otherwise.
			for _, f := range []*int64{&want.BestOf, &want.Prompts, &want.Choices} {
				if *f == 0 {
					*f = 1
				}
			}
			if public(got) != want {
				t.Errorf("got  %+v\nwant %+v", got, want)
			}
			if !errors.Is(err, tc.err) || (err == nil) != (tc.err == nil) {
				t.Errorf("err = %v, want %v", err, tc.err)
			}
			ref, rerr := refScanRequest(tc.api, []byte(tc.body))
			if tc.name != "invalid UTF-8 is counted as bytes" && (ref != public(got) || (rerr == nil) != (err == nil)) {
				t.Errorf("reference: %+v (%v)", ref, rerr)
			}
		})
	}
}

// TestScanRequestChoices pins, per API, how many answers a request is billed for: every one
// of them may use the whole output limit, so the estimate, the spend worst case and the bound
// on reported usage all multiply by it.
func TestScanRequestChoices(t *testing.T) {
	tests := []struct {
		name                        string
		api                         API
		body                        string
		n, bestOf, prompts, choices int64
	}{
		{"completions one prompt", APIOpenAICompletions, `{"prompt":"a","max_tokens":25}`, 1, 1, 1, 1},
		{"completions batch of strings with n", APIOpenAICompletions, `{"prompt":["Say this is a test","Say this is another"],"max_tokens":25,"n":2}`, 2, 1, 2, 4},
		{"completions batch of token arrays", APIOpenAICompletions, `{"prompt":[[1,2],[3],[4,5,6]],"n":2}`, 2, 1, 3, 6},
		{"completions one token array", APIOpenAICompletions, `{"prompt":[1,2,3],"n":3}`, 3, 1, 1, 3},
		{"completions best_of above n", APIOpenAICompletions, `{"prompt":["a","b"],"n":2,"best_of":5}`, 2, 5, 2, 10},
		{"completions best_of below n", APIOpenAICompletions, `{"prompt":"a","n":4,"best_of":1}`, 4, 1, 1, 4},
		{"completions last prompt wins", APIOpenAICompletions, `{"prompt":["a","b","c"],"prompt":"d"}`, 1, 1, 1, 1},
		{"completions empty batch", APIOpenAICompletions, `{"prompt":[],"n":2}`, 2, 1, 1, 2},
		{"chat n", APIOpenAIChat, `{"messages":[],"n":3,"best_of":7}`, 3, 7, 1, 3},
		{"chat prompt is not a batch", APIOpenAIChat, `{"prompt":["a","b"],"n":2}`, 2, 1, 2, 2},
		{"responses", APIOpenAIResponses, `{"input":"a","n":4}`, 4, 1, 1, 1},
		{"anthropic", APIAnthropicMessages, `{"messages":[],"n":4}`, 4, 1, 1, 1},
		{"embeddings", APIOpenAIEmbeddings, `{"input":["a","b"],"n":4}`, 4, 1, 1, 1},
		{"unknown API reads like completions", APIUnknown, `{"prompt":["a","b"],"n":2,"best_of":3}`, 2, 3, 2, 6},
		{"huge factors saturate", APIOpenAICompletions, `{"prompt":["a","b"],"n":9223372036854775807,"best_of":9223372036854775807}`, 9223372036854775807, 9223372036854775807, 2, 2 * maxChoices},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var f RequestFields
			if err := ScanRequest(tc.api, []byte(tc.body), &f); err != nil {
				t.Fatal(err)
			}
			if f.N != tc.n || f.BestOf != tc.bestOf || f.Prompts != tc.prompts || f.Choices != tc.choices {
				t.Fatalf("n %d best_of %d prompts %d choices %d, want %d %d %d %d", f.N, f.BestOf, f.Prompts, f.Choices, tc.n, tc.bestOf, tc.prompts, tc.choices)
			}
		})
	}
	var f RequestFields
	if err := ScanRequest(APIOpenAICompletions, []byte(`{"prompt":["a"],"best_of":0}`), &f); !errors.Is(err, ErrFieldValue) || !strings.Contains(err.Error(), "best_of") {
		t.Fatalf("best_of 0: %v", err)
	}
}

func TestScanRequestInvalid(t *testing.T) {
	tests := map[string]string{
		"empty":              ``,
		"whitespace":         " \n\t",
		"top-level array":    `[{"model":"m"}]`,
		"top-level string":   `"model"`,
		"top-level null":     `null`,
		"truncated":          `{"model":"gpt-4o","messages":[{"role":"user","content":"hi`,
		"truncated key":      `{"mod`,
		"missing colon":      `{"model" "m"}`,
		"trailing comma":     `{"model":"m",}`,
		"trailing garbage":   `{"model":"m"} x`,
		"two documents":      `{"model":"m"}{}`,
		"bad literal":        `{"stream":tru}`,
		"bad number":         `{"max_tokens":01}`,
		"bad number 2":       `{"max_tokens":1.}`,
		"bad escape":         `{"model":"\x"}`,
		"bad unicode escape": `{"model":"\u12G4"}`,
		"raw newline":        "{\"model\":\"a\nb\"}",
		"single quotes":      `{'model':'m'}`,
		"mismatched close":   `{"messages":[}`,
		"too deep":           `{"x":` + strings.Repeat("[", maxDepth) + strings.Repeat("]", maxDepth) + `}`,
		"too deep messages":  `{"messages":[{"content":[{"content":` + strings.Repeat("[", 20000) + `}]}]}`,
		"unclosed deep":      strings.Repeat("[", 10000),
		"deep objects":       `{"messages":` + strings.Repeat(`{"content":`, 10001) + `1` + strings.Repeat("}", 10001) + `}`,
		"bom":                "\xEF\xBB\xBF{}",
	}
	for name, body := range tests {
		t.Run(name, func(t *testing.T) {
			var f RequestFields
			if err := ScanRequest(APIOpenAIChat, []byte(body), &f); !errors.Is(err, ErrInvalidJSON) {
				t.Fatalf("err = %v", err)
			}
		})
	}
}

func TestScanRequestAllocations(t *testing.T) {
	body := chatBody(1<<10, 9)
	var f RequestFields
	if err := ScanRequest(APIOpenAIChat, body, &f); err != nil {
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(100, func() {
		if err := ScanRequest(APIOpenAIChat, body, &f); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations for a %d-byte body", allocs, len(body))
	}
	// Copies stay valid after the body is reused.
	model, user := f.Model, f.User
	for i := range body {
		body[i] = 'x'
	}
	if model != "gpt-4o-2024-08-06" || user != "user-1234" {
		t.Fatalf("model %q user %q changed with the body", model, user)
	}
}

func TestField(t *testing.T) {
	body := []byte(`{"model":"gpt-4o","user":"u\"1","n":2.50,"stream":true,"off":false,"none":null,` +
		`"metadata":{"feature":"batch_summarize","tier":{"name":"pro"},"list":[1]},"metadata":{"feature":"chat"},"a.b":1,"":{"":"empty"}}`)
	tests := []struct {
		path string
		want string
		ok   bool
	}{
		{"model", "gpt-4o", true},
		{"user", `u"1`, true},
		{"n", "2.50", true},
		{"stream", "true", true},
		{"off", "false", true},
		{"none", "", false},
		{"metadata", "", false},
		{"metadata.feature", "chat", true},
		{"metadata.tier.name", "", false},
		{"metadata.list", "", false},
		{"missing", "", false},
		{"model.x", "", false},
		{"a.b", "", false},
		{"", "", false},
		{".", "empty", true}, // regression: a path of empty segments stopped after the first
	}
	for _, tc := range tests {
		t.Run(tc.path, func(t *testing.T) {
			got, ok := Field(body, tc.path)
			if got != tc.want || ok != tc.ok {
				t.Fatalf("Field(%q) = %q, %v; want %q, %v", tc.path, got, ok, tc.want, tc.ok)
			}
		})
	}
	t.Run("invalid body", func(t *testing.T) {
		if v, ok := Field([]byte(`{"model":"m"`), "model"); ok {
			t.Fatalf("got %q", v)
		}
	})
	t.Run("long escaped key", func(t *testing.T) {
		key := strings.Repeat("k", 100)
		b := []byte(`{"` + strings.Repeat(`\u006b`, 100) + `":"v"}`)
		if v, ok := Field(b, key); !ok || v != "v" {
			t.Fatalf("got %q, %v", v, ok)
		}
	})
	t.Run("repeated values do not allocate", func(t *testing.T) {
		Field(body, "metadata.feature")
		if n := testing.AllocsPerRun(100, func() { Field(body, "metadata.feature") }); n != 0 {
			t.Fatalf("%v allocations", n)
		}
	})
}

func TestInjectIncludeUsage(t *testing.T) {
	tests := []struct {
		name string
		api  API
		body string
		want string // empty: unchanged
	}{
		{"adds stream_options", APIOpenAIChat, `{"model":"m","stream":true}`, `{"model":"m","stream":true,"stream_options":{"include_usage":true}}`},
		{"keeps whitespace", APIOpenAICompletions, "{ \"stream\" : true }\n", "{ \"stream\" : true ,\"stream_options\":{\"include_usage\":true}}\n"},
		{"fills an empty stream_options", APIOpenAIChat, `{"stream":true,"stream_options":{}}`, `{"stream":true,"stream_options":{"include_usage":true}}`},
		{"adds to stream_options", APIOpenAIChat, `{"stream_options":{"continuous_usage_stats":true},"stream":true}`, `{"stream_options":{"include_usage":true,"continuous_usage_stats":true},"stream":true}`},
		{"replaces null stream_options", APIOpenAIChat, `{"stream":true,"stream_options":null}`, `{"stream":true,"stream_options":{"include_usage":true}}`},
		{"replaces null include_usage", APIOpenAIChat, `{"stream":true,"stream_options":{"include_usage":null}}`, `{"stream":true,"stream_options":{"include_usage":true}}`},
		{"changes the last of duplicates", APIOpenAIChat, `{"stream":true,"stream_options":{"include_usage":true},"stream_options":{}}`, `{"stream":true,"stream_options":{"include_usage":true},"stream_options":{"include_usage":true}}`},
		{"already there", APIOpenAIChat, `{"stream":true,"stream_options":{"include_usage":true}}`, ``},
		{"client said false", APIOpenAIChat, `{"stream":true,"stream_options":{"include_usage":false}}`, ``},
		{"not streaming", APIOpenAIChat, `{"stream":false}`, ``},
		{"stream absent", APIOpenAIChat, `{"model":"m"}`, ``},
		{"stream not a boolean", APIOpenAIChat, `{"stream":"true"}`, ``},
		{"last stream wins", APIOpenAIChat, `{"stream":true,"stream":false}`, ``},
		{"stream_options of the wrong type", APIOpenAIChat, `{"stream":true,"stream_options":1}`, ``},
		{"anthropic", APIAnthropicMessages, `{"stream":true}`, ``},
		{"responses", APIOpenAIResponses, `{"stream":true}`, ``},
		{"invalid JSON", APIOpenAIChat, `{"stream":true`, ``},
		{"trailing garbage", APIOpenAIChat, `{"stream":true}x`, ``},
		{"array", APIOpenAIChat, `[{"stream":true}]`, ``},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := []byte(tc.body)
			out, changed := InjectIncludeUsage(tc.api, in)
			if tc.want == "" {
				if changed || string(out) != tc.body {
					t.Fatalf("changed to %s", out)
				}
				return
			}
			if !changed || string(out) != tc.want {
				t.Fatalf("got %s (%v)\nwant %s", out, changed, tc.want)
			}
			if string(in) != tc.body {
				t.Fatal("input modified")
			}
		})
	}
}

// TestConcurrentUse runs the stateless functions from many goroutines at once,
// which the race detector checks together with the shared intern table.
func TestConcurrentUse(t *testing.T) {
	const workers = 8
	done := make(chan error, workers)
	for w := range workers {
		go func() {
			model := strings.Repeat("m", w+1)
			body := []byte(`{"model":"` + model + `","user":"u","metadata":{"feature":"f` + model + `"},"stream":true}`)
			for range 500 {
				var f RequestFields
				if err := ScanRequest(APIOpenAIChat, body, &f); err != nil || f.Model != model {
					done <- errors.New("ScanRequest: " + f.Model)
					return
				}
				if v, ok := Field(body, "metadata.feature"); !ok || v != "f"+model {
					done <- errors.New("Field: " + v)
					return
				}
				if _, ok := InjectIncludeUsage(APIOpenAIChat, body); !ok {
					done <- errors.New("InjectIncludeUsage")
					return
				}
			}
			done <- nil
		}()
	}
	for range workers {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}
