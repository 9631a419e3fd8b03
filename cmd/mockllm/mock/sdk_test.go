package mock

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/anthropics/anthropic-sdk-go/v2"
	anthropicoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	openaioption "github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
)

// headerTap keeps the headers of the last response a client saw, so SDK
// tests can compare the usage the SDK parsed with the x-mockllm-* headers.
type headerTap struct {
	mu     sync.Mutex
	header http.Header
}

func (h *headerTap) middleware(req *http.Request, next func(*http.Request) (*http.Response, error)) (*http.Response, error) {
	resp, err := next(req)
	if resp != nil {
		h.mu.Lock()
		h.header = resp.Header.Clone()
		h.mu.Unlock()
	}
	return resp, err
}

// tokens returns the prompt and completion tokens the last response's
// headers reported.
func (h *headerTap) tokens(t *testing.T) (prompt, completion int64) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	p, err1 := strconv.ParseInt(h.header.Get(HeaderPromptTokens), 10, 64)
	c, err2 := strconv.ParseInt(h.header.Get(HeaderCompletionTokens), 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		t.Fatalf("x-mockllm token headers: %v (%v)", err, h.header)
	}
	return p, c
}

func newOpenAIClient(t *testing.T, base string, hc *http.Client, tap *headerTap) openai.Client {
	t.Helper()
	return openai.NewClient(
		openaioption.WithBaseURL(base+"/v1/"),
		openaioption.WithAPIKey("sk-test"),
		openaioption.WithHTTPClient(hc),
		openaioption.WithMaxRetries(0),
		openaioption.WithMiddleware(tap.middleware),
	)
}

func newAnthropicClient(t *testing.T, base string, hc *http.Client, tap *headerTap) anthropic.Client {
	t.Helper()
	return anthropic.NewClient(
		anthropicoption.WithoutEnvironmentDefaults(),
		anthropicoption.WithBaseURL(base+"/"),
		anthropicoption.WithAPIKey("sk-ant-test"),
		anthropicoption.WithHTTPClient(hc),
		anthropicoption.WithMaxRetries(0),
		anthropicoption.WithMiddleware(tap.middleware),
	)
}

func TestOpenAISDK(t *testing.T) {
	s, base, hc := startServer(t, Options{})
	ctx := context.Background()
	// Each case returns the usage and text the SDK parsed.
	tests := []struct {
		name           string
		run            func(t *testing.T, c openai.Client) (prompt, completion int64, text string)
		wantCompletion int64
	}{
		{
			name: "chat json",
			run: func(t *testing.T, c openai.Client) (int64, int64, string) {
				res, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
					Model:     "gpt-4o",
					Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("be brief"), openai.UserMessage("hello there")},
					MaxTokens: openai.Int(9),
				})
				if err != nil {
					t.Fatal(err)
				}
				return res.Usage.PromptTokens, res.Usage.CompletionTokens, res.Choices[0].Message.Content
			},
			wantCompletion: 9,
		},
		{
			name: "chat streaming with include_usage",
			run: func(t *testing.T, c openai.Client) (int64, int64, string) {
				stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
					Model:               "gpt-4o-mini",
					Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage("stream me something")},
					MaxCompletionTokens: openai.Int(12),
					StreamOptions:       openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
				})
				defer stream.Close()
				var acc openai.ChatCompletionAccumulator
				for stream.Next() {
					acc.AddChunk(stream.Current())
				}
				if err := stream.Err(); err != nil {
					t.Fatal(err)
				}
				return acc.Usage.PromptTokens, acc.Usage.CompletionTokens, acc.Choices[0].Message.Content
			},
			wantCompletion: 12,
		},
		{
			name: "legacy completions streaming",
			run: func(t *testing.T, c openai.Client) (int64, int64, string) {
				stream := c.Completions.NewStreaming(ctx, openai.CompletionNewParams{
					Model:         "gpt-3.5-turbo-instruct",
					Prompt:        openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon a time")},
					MaxTokens:     openai.Int(5),
					StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
				})
				defer stream.Close()
				var text string
				var prompt, completion int64
				for stream.Next() {
					ch := stream.Current()
					if len(ch.Choices) > 0 {
						text += ch.Choices[0].Text
					}
					if ch.Usage.TotalTokens > 0 {
						prompt, completion = ch.Usage.PromptTokens, ch.Usage.CompletionTokens
					}
				}
				if err := stream.Err(); err != nil {
					t.Fatal(err)
				}
				return prompt, completion, text
			},
			wantCompletion: 5,
		},
		{
			name: "embeddings",
			run: func(t *testing.T, c openai.Client) (int64, int64, string) {
				res, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{
					Model: "text-embedding-3-small",
					Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"first input", "second"}},
				})
				if err != nil {
					t.Fatal(err)
				}
				if len(res.Data) != 2 || len(res.Data[1].Embedding) != DefaultEmbeddingDimensions {
					t.Fatalf("embeddings %+v", res.Data)
				}
				return res.Usage.PromptTokens, 0, ""
			},
		},
		{
			name: "embeddings base64",
			run: func(t *testing.T, c openai.Client) (int64, int64, string) {
				res, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{
					Model:          "text-embedding-3-small",
					Input:          openai.EmbeddingNewParamsInputUnion{OfString: openai.String("one input")},
					EncodingFormat: openai.EmbeddingNewParamsEncodingFormatBase64,
					Dimensions:     openai.Int(7),
				})
				if err != nil {
					t.Fatal(err)
				}
				if len(res.Data) != 1 || len(res.Data[0].Embedding) != 7 {
					t.Fatalf("embeddings %+v", res.Data)
				}
				return res.Usage.PromptTokens, 0, ""
			},
		},
		{
			name: "responses json",
			run: func(t *testing.T, c openai.Client) (int64, int64, string) {
				res, err := c.Responses.New(ctx, responses.ResponseNewParams{
					Model:           "gpt-4o",
					Instructions:    openai.String("answer in words"),
					Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String("what is the sky like")},
					MaxOutputTokens: openai.Int(16),
				})
				if err != nil {
					t.Fatal(err)
				}
				if res.Usage.TotalTokens != res.Usage.InputTokens+res.Usage.OutputTokens {
					t.Fatalf("usage %+v does not add up", res.Usage)
				}
				return res.Usage.InputTokens, res.Usage.OutputTokens, res.OutputText()
			},
			wantCompletion: 16,
		},
		{
			name: "responses streaming",
			run: func(t *testing.T, c openai.Client) (int64, int64, string) {
				stream := c.Responses.NewStreaming(ctx, responses.ResponseNewParams{
					Model:           "gpt-4o",
					Input:           responses.ResponseNewParamsInputUnion{OfString: openai.String("stream a response")},
					MaxOutputTokens: openai.Int(8),
				})
				defer stream.Close()
				var text, final string
				var prompt, completion int64
				for stream.Next() {
					ev := stream.Current()
					switch ev.Type {
					case "response.output_text.delta":
						text += ev.Delta
					case "response.completed":
						prompt, completion = ev.Response.Usage.InputTokens, ev.Response.Usage.OutputTokens
						final = ev.Response.OutputText()
					}
				}
				if err := stream.Err(); err != nil {
					t.Fatal(err)
				}
				if final != text {
					t.Fatalf("completed text %q differs from the deltas %q", final, text)
				}
				return prompt, completion, text
			},
			wantCompletion: 8,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tap := &headerTap{}
			prompt, completion, text := tt.run(t, newOpenAIClient(t, base, hc, tap))
			hp, hc := tap.tokens(t)
			if prompt != hp || completion != hc {
				t.Fatalf("SDK parsed %d/%d tokens, headers say %d/%d", prompt, completion, hp, hc)
			}
			if prompt == 0 || completion != tt.wantCompletion {
				t.Fatalf("SDK parsed %d/%d tokens, want a prompt and %d completion tokens", prompt, completion, tt.wantCompletion)
			}
			if int64(len(text)) != completion*BytesPerToken {
				t.Fatalf("text %q has %d bytes for %d tokens", text, len(text), completion)
			}
		})
	}
	// The streamed request must have asked for usage; the log shows it.
	var sawIncludeUsage bool
	for _, r := range s.Requests() {
		if r.Stream && r.Path == "/v1/chat/completions" {
			sawIncludeUsage = strings.Contains(r.Body, `"include_usage":true`)
		}
	}
	if !sawIncludeUsage {
		t.Fatal("the request log does not show include_usage on the streamed chat request")
	}
}

func TestOpenAISDKSeesInjectedErrors(t *testing.T) {
	_, base, hc := startServer(t, Options{})
	tests := []struct {
		name     string
		headers  map[string]string
		stream   bool
		wantCode int
		wantType string
	}{
		{name: "503", headers: map[string]string{HeaderStatus: "503"}, wantCode: 503, wantType: "server_error"},
		{name: "429 with retry-after", headers: map[string]string{HeaderStatus: "429", HeaderRetryAfter: "1"}, wantCode: 429, wantType: "requests"},
		{name: "disconnect mid-stream", headers: map[string]string{HeaderDisconnectAfter: "2"}, stream: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newOpenAIClient(t, base, hc, &headerTap{})
			var opts []openaioption.RequestOption
			for k, v := range tt.headers {
				opts = append(opts, openaioption.WithHeader(k, v))
			}
			params := openai.ChatCompletionNewParams{
				Model:    "gpt-4o",
				Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
			}
			if tt.stream {
				stream := c.Chat.Completions.NewStreaming(context.Background(), params, opts...)
				defer stream.Close()
				n := 0
				for stream.Next() {
					n++
				}
				if stream.Err() == nil || n != 2 {
					t.Fatalf("after %d chunks the stream ended with %v; want 2 chunks and an error", n, stream.Err())
				}
				return
			}
			_, err := c.Chat.Completions.New(context.Background(), params, opts...)
			var apiErr *openai.Error
			if !errors.As(err, &apiErr) {
				t.Fatalf("error %v is not an *openai.Error", err)
			}
			if apiErr.StatusCode != tt.wantCode || apiErr.Type != tt.wantType || apiErr.Message == "" {
				t.Fatalf("error = %d %q %q, want %d %q", apiErr.StatusCode, apiErr.Type, apiErr.Message, tt.wantCode, tt.wantType)
			}
		})
	}
}

func TestAnthropicSDK(t *testing.T) {
	_, base, hc := startServer(t, Options{})
	ctx := context.Background()
	params := anthropic.MessageNewParams{
		Model:     "claude-sonnet-4-5",
		MaxTokens: 10,
		System:    []anthropic.TextBlockParam{{Text: "you are terse"}},
		Messages:  []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("tell me about foxes"))},
	}
	tests := []struct {
		name    string
		headers map[string]string
		run     func(t *testing.T, c anthropic.Client, opts []anthropicoption.RequestOption) anthropic.Message
	}{
		{
			name: "messages json",
			run: func(t *testing.T, c anthropic.Client, opts []anthropicoption.RequestOption) anthropic.Message {
				msg, err := c.Messages.New(ctx, params, opts...)
				if err != nil {
					t.Fatal(err)
				}
				return *msg
			},
		},
		{
			name:    "messages json with cached prompt",
			headers: map[string]string{HeaderCachedTokens: "3"},
			run: func(t *testing.T, c anthropic.Client, opts []anthropicoption.RequestOption) anthropic.Message {
				msg, err := c.Messages.New(ctx, params, opts...)
				if err != nil {
					t.Fatal(err)
				}
				if msg.Usage.CacheReadInputTokens != 3 {
					t.Fatalf("cache_read_input_tokens = %d, want 3", msg.Usage.CacheReadInputTokens)
				}
				return *msg
			},
		},
		{
			name: "messages streaming",
			run: func(t *testing.T, c anthropic.Client, opts []anthropicoption.RequestOption) anthropic.Message {
				stream := c.Messages.NewStreaming(ctx, params, opts...)
				defer stream.Close()
				var msg anthropic.Message
				for stream.Next() {
					if err := msg.Accumulate(stream.Current()); err != nil {
						t.Fatal(err)
					}
				}
				if err := stream.Err(); err != nil {
					t.Fatal(err)
				}
				if msg.StopReason != anthropic.StopReasonEndTurn {
					t.Fatalf("stop reason %q", msg.StopReason)
				}
				return msg
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tap := &headerTap{}
			var opts []anthropicoption.RequestOption
			for k, v := range tt.headers {
				opts = append(opts, anthropicoption.WithHeader(k, v))
			}
			msg := tt.run(t, newAnthropicClient(t, base, hc, tap), opts)
			hp, hc := tap.tokens(t)
			u := msg.Usage
			if prompt := u.InputTokens + u.CacheReadInputTokens + u.CacheCreationInputTokens; prompt != hp || u.OutputTokens != hc {
				t.Fatalf("SDK parsed %d/%d tokens, headers say %d/%d", prompt, u.OutputTokens, hp, hc)
			}
			if hc != 10 {
				t.Fatalf("completion tokens %d, want max_tokens 10", hc)
			}
			if len(msg.Content) != 1 || int64(len(msg.Content[0].Text)) != hc*BytesPerToken {
				t.Fatalf("content %+v does not hold %d tokens of text", msg.Content, hc)
			}
		})
	}
}

func TestAnthropicSDKSeesInjectedErrors(t *testing.T) {
	_, base, hc := startServer(t, Options{})
	tests := []struct {
		name     string
		status   string
		wantType string
	}{
		{name: "overloaded", status: "529", wantType: "overloaded_error"},
		{name: "rate limited", status: "429", wantType: "rate_limit_error"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newAnthropicClient(t, base, hc, &headerTap{})
			_, err := c.Messages.New(context.Background(), anthropic.MessageNewParams{
				Model: "claude-haiku-4-5", MaxTokens: 5,
				Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hi"))},
			}, anthropicoption.WithHeader(HeaderStatus, tt.status))
			var apiErr *anthropic.Error
			if !errors.As(err, &apiErr) {
				t.Fatalf("error %v is not an *anthropic.Error", err)
			}
			if strconv.Itoa(apiErr.StatusCode) != tt.status || string(apiErr.Type()) != tt.wantType || apiErr.RequestID == "" {
				t.Fatalf("error = %d %q request %q, want %s %q", apiErr.StatusCode, apiErr.Type(), apiErr.RequestID, tt.status, tt.wantType)
			}
		})
	}
}
