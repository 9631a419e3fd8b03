package integration_test

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/service/bedrockruntime"
	"github.com/aws/aws-sdk-go-v2/service/bedrockruntime/types"
	"github.com/aws/smithy-go/middleware"
	smithyhttp "github.com/aws/smithy-go/transport/http"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/azure"
	"github.com/openai/openai-go/v3/option"
	"google.golang.org/genai"
)

// countingTransport counts the HTTP requests a client sends (each retry is one more) and
// keeps the URL of the last.
type countingTransport struct {
	n    atomic.Int32
	url  atomic.Pointer[string]
	next http.RoundTripper
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	u := r.URL.String()
	c.url.Store(&u)
	return c.next.RoundTrip(r)
}

func newCountingClient() (*http.Client, *countingTransport) {
	ct := &countingTransport{next: &http.Transport{}}
	return &http.Client{Transport: ct}, ct
}

// TestAzureOpenAISDKRefusal: openai-go configured for Azure OpenAI (deployment paths,
// api-version, api-key) gets a refusal as an *openai.Error with Azure's code "429" and our
// message, keeps its retries when x-should-retry says the wait is too long, and retries a
// short wait as it does for OpenAI.
func TestAzureOpenAISDKRefusal(t *testing.T) {
	_, url := startRefusalStack(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Azure's plaintext loopback calls bypass a client's transport: a middleware, which runs
	// after Azure's rewrite of the path, sees what is sent.
	var calls countingTransport
	c := openai.NewClient(azure.WithEndpoint(url, "2024-10-21"), azure.WithAPIKey("azure-key"), azure.WithUnsafeAllowHTTP(),
		option.WithHeader("x-llm-feature", "budget"), option.WithMiddleware(func(r *http.Request, next option.MiddlewareNext) (*http.Response, error) {
			calls.n.Add(1)
			u := r.URL.String()
			calls.url.Store(&u)
			return next(r)
		}))
	_, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "prod-gpt-4o", MaxTokens: openai.Int(50),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello there")}})
	var e *openai.Error
	if !errors.As(err, &e) {
		t.Fatalf("err %v", err)
	}
	if e.StatusCode != 429 || e.Code != "429" || !strings.Contains(e.Message, "budget") {
		t.Errorf("status %d code %q message %q", e.StatusCode, e.Code, e.Message)
	}
	if got := *calls.url.Load(); got != url+"/openai/deployments/prod-gpt-4o/chat/completions?api-version=2024-10-21" {
		t.Errorf("the SDK called %s", got)
	}
	if inner, ok := e.JSON.ExtraFields["innererror"]; !ok || !strings.Contains(inner.Raw(), `"token_budget"`) {
		t.Errorf("innererror %v in %s", inner, e.RawJSON())
	}
	h := e.Response.Header
	if retry, _ := strconv.Atoi(h.Get("retry-after")); retry <= 10 || h.Get("x-should-retry") != "false" || h.Get("x-ratelimit-limit-tokens") != "10" {
		t.Errorf("headers %v", h)
	}
	if n := calls.n.Load(); n != 1 {
		t.Errorf("%d attempts, want 1: x-should-retry false stops the default retries", n)
	}
}

// TestGeminiSDKRefusal: google.golang.org/genai gets a refusal as a genai.APIError with
// Google's code, status and our message, and the wait in a RetryInfo detail; a streamed call
// gets it from its iterator.
func TestGeminiSDKRefusal(t *testing.T) {
	_, url := startRefusalStack(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hc, calls := newCountingClient()
	c, err := genai.NewClient(ctx, &genai.ClientConfig{APIKey: "gemini-key", Backend: genai.BackendGeminiAPI, HTTPClient: hc,
		HTTPOptions: genai.HTTPOptions{BaseURL: url, APIVersion: "v1beta", Headers: http.Header{"X-Llm-Feature": {"budget"}}}})
	if err != nil {
		t.Fatal(err)
	}
	check := func(t *testing.T, err error) {
		t.Helper()
		var e genai.APIError
		if !errors.As(err, &e) {
			t.Fatalf("err %#v", err)
		}
		if e.Code != 429 || e.Status != "RESOURCE_EXHAUSTED" || !strings.Contains(e.Message, "budget") {
			t.Errorf("code %d status %q message %q", e.Code, e.Status, e.Message)
		}
		var reason, delay string
		for _, d := range e.Details {
			switch d["@type"] {
			case "type.googleapis.com/google.rpc.ErrorInfo":
				reason, _ = d["reason"].(string)
			case "type.googleapis.com/google.rpc.RetryInfo":
				delay, _ = d["retryDelay"].(string)
			}
		}
		wait, perr := time.ParseDuration(delay)
		if reason != "token_budget" || perr != nil || wait <= 10*time.Second {
			t.Errorf("details %v", e.Details)
		}
	}
	_, err = c.Models.GenerateContent(ctx, "gemini-2.5-flash", genai.Text("hello there"), &genai.GenerateContentConfig{MaxOutputTokens: 50})
	check(t, err)
	for _, err := range c.Models.GenerateContentStream(ctx, "gemini-2.5-flash", genai.Text("hello there"), nil) {
		check(t, err)
		break
	}
	if n := calls.n.Load(); n != 2 {
		t.Errorf("%d requests for two calls", n)
	}
}

// TestBedrockSDKRefusal: aws-sdk-go-v2's bedrockruntime raises a refusal as the exception
// x-amzn-errortype names, with our message, the HTTP status and the request id, for Converse,
// ConverseStream and InvokeModel alike; ThrottlingException is one its retryer retries.
func TestBedrockSDKRefusal(t *testing.T) {
	s, url := startRefusalStack(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := func(feature string) *bedrockruntime.Client {
		return bedrockruntime.New(bedrockruntime.Options{
			Region: "us-east-1", BaseEndpoint: aws.String(url), RetryMaxAttempts: 1, AuthSchemePreference: []string{"sigv4"},
			Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
				return aws.Credentials{AccessKeyID: "AKIDTEST", SecretAccessKey: "secret"}, nil
			}),
			APIOptions: []func(*middleware.Stack) error{smithyhttp.AddHeaderValue("x-llm-feature", feature)},
		})
	}
	const model = "anthropic.claude-3-5-haiku-20241022-v1:0"
	msgs := []types.Message{{Role: types.ConversationRoleUser, Content: []types.ContentBlock{&types.ContentBlockMemberText{Value: "hello there"}}}}
	limit := &types.InferenceConfiguration{MaxTokens: aws.Int32(50)}

	calls := map[string]func(c *bedrockruntime.Client) error{
		"converse": func(c *bedrockruntime.Client) error {
			_, err := c.Converse(ctx, &bedrockruntime.ConverseInput{ModelId: aws.String(model), Messages: msgs, InferenceConfig: limit})
			return err
		},
		"converse-stream": func(c *bedrockruntime.Client) error {
			_, err := c.ConverseStream(ctx, &bedrockruntime.ConverseStreamInput{ModelId: aws.String(model), Messages: msgs, InferenceConfig: limit})
			return err
		},
		"invoke": func(c *bedrockruntime.Client) error {
			_, err := c.InvokeModel(ctx, &bedrockruntime.InvokeModelInput{ModelId: aws.String(model), ContentType: aws.String("application/json"),
				Body: []byte(`{"anthropic_version":"bedrock-2023-05-31","max_tokens":50,"messages":[{"role":"user","content":"hello there"}]}`)})
			return err
		},
	}
	for name, call := range calls {
		t.Run(name, func(t *testing.T) {
			err := call(client("budget"))
			var throttled *types.ThrottlingException
			if !errors.As(err, &throttled) || !strings.Contains(throttled.ErrorMessage(), "budget") || throttled.ErrorCode() != "ThrottlingException" {
				t.Fatalf("err %v", err)
			}
			var re *awshttp.ResponseError
			if !errors.As(err, &re) || re.HTTPStatusCode() != 429 || re.ServiceRequestID() == "" {
				t.Errorf("response error %v", re)
			}
			if retry.IsErrorThrottles(retry.DefaultThrottles).IsErrorThrottle(err) != aws.TrueTernary {
				t.Error("the SDK's retryer does not see a throttle")
			}
		})
	}

	g := newGate()
	hold(s, g, "full")
	defer func() { g.release <- struct{}{} }()
	err := calls["converse"](client("full"))
	var unavailable *types.ServiceUnavailableException
	var re *awshttp.ResponseError
	if !errors.As(err, &unavailable) || !errors.As(err, &re) || re.HTTPStatusCode() != 503 {
		t.Errorf("a full bulkhead: %v", err)
	}
}
