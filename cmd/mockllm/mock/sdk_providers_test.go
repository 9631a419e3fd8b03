package mock

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/bedrockruntime"
	"github.com/aws/aws-sdk-go-v2/service/bedrockruntime/types"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/azure"
	openaioption "github.com/openai/openai-go/v3/option"
	"google.golang.org/genai"
)

// withHeaders is a transport adding fixed request headers, for the SDKs that have no
// per-request header option.
type withHeaders struct {
	next http.RoundTripper
	h    map[string]string
}

func (t withHeaders) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	for k, v := range t.h {
		r.Header.Set(k, v)
	}
	return t.next.RoundTrip(r)
}

// TestAzureOpenAISDK: openai-go configured for Azure calls deployment paths with an
// api-version, and parses mockllm's answers (JSON, streamed usage) and its Azure error shape.
func TestAzureOpenAISDK(t *testing.T) {
	s, base, hc := startServer(t, Options{})
	ctx := context.Background()
	var tap headerTap
	c := openai.NewClient(azure.WithEndpoint(base, "2024-10-21"), azure.WithAPIKey("azure-key"), azure.WithUnsafeAllowHTTP(),
		openaioption.WithHTTPClient(hc), openaioption.WithMaxRetries(0), openaioption.WithMiddleware(tap.middleware))
	params := openai.ChatCompletionNewParams{Model: "my-gpt-4o", MaxTokens: openai.Int(7),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("what is a bulkhead?")}}

	res, err := c.Chat.Completions.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	prompt, completion := tap.tokens(t)
	if res.Usage.PromptTokens != prompt || res.Usage.CompletionTokens != 7 || completion != 7 || res.Model != "my-gpt-4o" {
		t.Errorf("usage %+v model %q, headers %d/%d", res.Usage, res.Model, prompt, completion)
	}
	reqs := s.Requests()
	if got := reqs[len(reqs)-1]; got.Path != "/openai/deployments/my-gpt-4o/chat/completions" || got.Header.Get("Api-Key") != "[redacted]" {
		t.Errorf("request %s headers %v", got.Path, got.Header)
	}

	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := c.Chat.Completions.NewStreaming(ctx, params)
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if acc.Usage.PromptTokens != prompt || acc.Usage.CompletionTokens != 7 || len(acc.Choices) != 1 || len(acc.Choices[0].Message.Content) != 7*BytesPerToken {
		t.Errorf("streamed usage %+v, choices %+v", acc.Usage, acc.Choices)
	}

	_, err = c.Chat.Completions.New(ctx, params, openaioption.WithHeader(HeaderStatus, "429"), openaioption.WithHeader(HeaderRetryAfter, "4"))
	var e *openai.Error
	if !errors.As(err, &e) || e.StatusCode != 429 || e.Code != "429" || !strings.Contains(e.Message, "Rate limit") {
		t.Fatalf("err %v", err)
	}
	if e.Response.Header.Get("retry-after") != "4" {
		t.Errorf("headers %v", e.Response.Header)
	}
}

func newGeminiClient(t *testing.T, base string, hc *http.Client) *genai.Client {
	t.Helper()
	c, err := genai.NewClient(context.Background(), &genai.ClientConfig{APIKey: "gemini-key", Backend: genai.BackendGeminiAPI, HTTPClient: hc,
		HTTPOptions: genai.HTTPOptions{BaseURL: base, APIVersion: "v1beta"}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// geminiConfig asks for max output tokens and sends mockllm's headers.
func geminiConfig(maxTokens int32, headers map[string]string) *genai.GenerateContentConfig {
	h := http.Header{}
	for k, v := range headers {
		h.Set(k, v)
	}
	return &genai.GenerateContentConfig{MaxOutputTokens: maxTokens, HTTPOptions: &genai.HTTPOptions{Headers: h}}
}

// TestGeminiSDK: google.golang.org/genai reads generateContent, the SSE stream, countTokens,
// thinking and cached counts, and Google's error shape, in a response and inside a stream.
func TestGeminiSDK(t *testing.T) {
	s, base, hc := startServer(t, Options{})
	ctx := context.Background()
	c := newGeminiClient(t, base, hc)
	prompt := genai.Text("Why do ships have bulkheads? Answer briefly.")
	wantPrompt := int32((len("Why do ships have bulkheads? Answer briefly.") + 3) / 4)

	res, err := c.Models.GenerateContent(ctx, "gemini-2.5-flash", prompt,
		geminiConfig(9, map[string]string{HeaderReasoningTokens: "3", HeaderCachedTokens: "2"}))
	if err != nil {
		t.Fatal(err)
	}
	u := res.UsageMetadata
	if u == nil || u.PromptTokenCount != wantPrompt || u.CandidatesTokenCount != 6 || u.ThoughtsTokenCount != 3 ||
		u.CachedContentTokenCount != 2 || u.TotalTokenCount != wantPrompt+9 || len(res.Text()) != 6*BytesPerToken {
		t.Errorf("usage %+v text %q", u, res.Text())
	}
	reqs := s.Requests()
	if got := reqs[len(reqs)-1]; got.Path != "/v1beta/models/gemini-2.5-flash:generateContent" || got.Model != "gemini-2.5-flash" {
		t.Errorf("request %s model %q", got.Path, got.Model)
	}

	var text strings.Builder
	var last *genai.GenerateContentResponseUsageMetadata
	for chunk, err := range c.Models.GenerateContentStream(ctx, "gemini-2.5-flash", prompt, geminiConfig(5, nil)) {
		if err != nil {
			t.Fatal(err)
		}
		text.WriteString(chunk.Text())
		last = chunk.UsageMetadata
	}
	if last == nil || last.PromptTokenCount != wantPrompt || last.CandidatesTokenCount != 5 || last.TotalTokenCount != wantPrompt+5 || text.Len() != 5*BytesPerToken {
		t.Errorf("streamed usage %+v text %q", last, text.String())
	}
	if got := s.Requests(); !got[len(got)-1].Stream {
		t.Error("streamGenerateContent not recorded as a stream")
	}

	count, err := c.Models.CountTokens(ctx, "gemini-2.5-flash", prompt, nil)
	if err != nil || count.TotalTokens != wantPrompt {
		t.Errorf("countTokens %+v %v", count, err)
	}

	_, err = c.Models.GenerateContent(ctx, "gemini-2.5-flash", prompt, geminiConfig(5, map[string]string{HeaderStatus: "429"}))
	var apiErr genai.APIError
	if !errors.As(err, &apiErr) || apiErr.Code != 429 || apiErr.Status != "RESOURCE_EXHAUSTED" || !strings.Contains(apiErr.Message, "Rate limit") {
		t.Errorf("err %#v", err)
	}

	var streamErr error
	chunks := 0
	for _, err := range c.Models.GenerateContentStream(ctx, "gemini-2.5-flash", prompt, geminiConfig(5, map[string]string{HeaderStreamError: "503"})) {
		if err != nil {
			streamErr = err
			break
		}
		chunks++
	}
	if !errors.As(streamErr, &apiErr) || apiErr.Code != 503 || apiErr.Status != "UNAVAILABLE" || chunks != 1 {
		t.Errorf("after %d chunks: %#v", chunks, streamErr)
	}
}

func newBedrockClient(base string, hc *http.Client, headers map[string]string) *bedrockruntime.Client {
	return bedrockruntime.New(bedrockruntime.Options{
		Region: "us-east-1", BaseEndpoint: aws.String(base), RetryMaxAttempts: 1, AuthSchemePreference: []string{"sigv4"},
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: "AKIDMOCKLLM", SecretAccessKey: "secret"}, nil
		}),
		HTTPClient: &http.Client{Transport: withHeaders{next: hc.Transport, h: headers}},
	})
}

const bedrockClaude = "anthropic.claude-3-5-haiku-20241022-v1:0"

// TestBedrockSDK: aws-sdk-go-v2's bedrockruntime reads Converse, ConverseStream's binary event
// stream, InvokeModel and InvokeModelWithResponseStream of an Anthropic model, and AWS's
// exceptions, as an error response and inside an event stream.
func TestBedrockSDK(t *testing.T) {
	s, base, hc := startServer(t, Options{})
	ctx := context.Background()
	question := "Why do ships have bulkheads?"
	wantPrompt := int32((len(question) + 3) / 4)
	converse := func() *bedrockruntime.ConverseInput {
		return &bedrockruntime.ConverseInput{ModelId: aws.String(bedrockClaude), InferenceConfig: &types.InferenceConfiguration{MaxTokens: aws.Int32(8)},
			Messages: []types.Message{{Role: types.ConversationRoleUser, Content: []types.ContentBlock{&types.ContentBlockMemberText{Value: question}}}}}
	}

	c := newBedrockClient(base, hc, map[string]string{HeaderCachedTokens: "2"})
	out, err := c.Converse(ctx, converse())
	if err != nil {
		t.Fatal(err)
	}
	msg, _ := out.Output.(*types.ConverseOutputMemberMessage)
	u := out.Usage
	if msg == nil || u == nil || *u.InputTokens != wantPrompt-2 || *u.CacheReadInputTokens != 2 || *u.OutputTokens != 8 || *u.TotalTokens != wantPrompt+8 {
		t.Fatalf("output %+v usage %+v", out.Output, u)
	}
	if text := msg.Value.Content[0].(*types.ContentBlockMemberText).Value; len(text) != 8*BytesPerToken {
		t.Errorf("text %q", text)
	}
	reqs := s.Requests()
	if got := reqs[len(reqs)-1]; got.Model != bedrockClaude || !strings.HasPrefix(got.Path, "/model/anthropic.claude") {
		t.Errorf("request %s model %q", got.Path, got.Model)
	}

	stream, err := newBedrockClient(base, hc, nil).ConverseStream(ctx, streamInput(converse()))
	if err != nil {
		t.Fatal(err)
	}
	var text strings.Builder
	var usage *types.TokenUsage
	for ev := range stream.GetStream().Events() {
		switch v := ev.(type) {
		case *types.ConverseStreamOutputMemberContentBlockDelta:
			text.WriteString(v.Value.Delta.(*types.ContentBlockDeltaMemberText).Value)
		case *types.ConverseStreamOutputMemberMetadata:
			usage = v.Value.Usage
		}
	}
	if err := stream.GetStream().Err(); err != nil {
		t.Fatal(err)
	}
	if usage == nil || *usage.InputTokens != wantPrompt || *usage.OutputTokens != 8 || text.Len() != 8*BytesPerToken {
		t.Errorf("streamed usage %+v text %q", usage, text.String())
	}

	body := `{"anthropic_version":"bedrock-2023-05-31","max_tokens":6,"messages":[{"role":"user","content":"` + question + `"}]}`
	inv, err := newBedrockClient(base, hc, nil).InvokeModel(ctx, &bedrockruntime.InvokeModelInput{ModelId: aws.String(bedrockClaude),
		ContentType: aws.String("application/json"), Body: []byte(body)})
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		Usage struct {
			InputTokens  int32 `json:"input_tokens"`
			OutputTokens int32 `json:"output_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(inv.Body, &m); err != nil || m.Usage.InputTokens != wantPrompt || m.Usage.OutputTokens != 6 {
		t.Errorf("invoke %s: %v", inv.Body, err)
	}

	is, err := newBedrockClient(base, hc, nil).InvokeModelWithResponseStream(ctx, &bedrockruntime.InvokeModelWithResponseStreamInput{
		ModelId: aws.String(bedrockClaude), ContentType: aws.String("application/json"), Body: []byte(body)})
	if err != nil {
		t.Fatal(err)
	}
	var types_ []string
	var output, metricsOut int32
	for ev := range is.GetStream().Events() {
		chunk, ok := ev.(*types.ResponseStreamMemberChunk)
		if !ok {
			t.Fatalf("event %T", ev)
		}
		var e struct {
			Type  string `json:"type"`
			Usage struct {
				OutputTokens int32 `json:"output_tokens"`
			} `json:"usage"`
			Metrics struct {
				OutputTokenCount int32 `json:"outputTokenCount"`
			} `json:"amazon-bedrock-invocationMetrics"`
		}
		if err := json.Unmarshal(chunk.Value.Bytes, &e); err != nil {
			t.Fatalf("chunk %s: %v", chunk.Value.Bytes, err)
		}
		types_ = append(types_, e.Type)
		if e.Type == "message_delta" {
			output = e.Usage.OutputTokens
		}
		if e.Type == "message_stop" {
			metricsOut = e.Metrics.OutputTokenCount
		}
	}
	if err := is.GetStream().Err(); err != nil {
		t.Fatal(err)
	}
	if output != 6 || metricsOut != 6 || types_[0] != "message_start" || types_[len(types_)-1] != "message_stop" {
		t.Errorf("events %v, output %d, metrics %d", types_, output, metricsOut)
	}

	_, err = newBedrockClient(base, hc, map[string]string{HeaderStatus: "429"}).Converse(ctx, converse())
	var throttled *types.ThrottlingException
	if !errors.As(err, &throttled) || !strings.Contains(throttled.ErrorMessage(), "Rate limit") {
		t.Errorf("err %v", err)
	}

	stream, err = newBedrockClient(base, hc, map[string]string{HeaderStreamError: "503"}).ConverseStream(ctx, streamInput(converse()))
	if err != nil {
		t.Fatal(err)
	}
	for range stream.GetStream().Events() {
	}
	var unavailable *types.ServiceUnavailableException
	if err := stream.GetStream().Err(); !errors.As(err, &unavailable) {
		t.Errorf("stream err %v", err)
	}

	_, err = newBedrockClient(base, hc, nil).InvokeModel(ctx, &bedrockruntime.InvokeModelInput{ModelId: aws.String("amazon.titan-text-express-v1"),
		ContentType: aws.String("application/json"), Body: []byte(`{"inputText":"hi"}`)})
	var invalid *types.ValidationException
	if !errors.As(err, &invalid) {
		t.Errorf("InvokeModel of a model other than Anthropic's: %v", err)
	}
}

// streamInput is the ConverseStream call of the same conversation.
func streamInput(in *bedrockruntime.ConverseInput) *bedrockruntime.ConverseStreamInput {
	return &bedrockruntime.ConverseStreamInput{ModelId: in.ModelId, Messages: in.Messages, InferenceConfig: in.InferenceConfig}
}
