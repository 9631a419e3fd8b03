package mock

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// Request headers that override token accounting for one request.
const (
	// HeaderCompletionTokens sets the completion tokens generated and reported,
	// whatever the body asks for. The response carries the same header name
	// with the number actually reported.
	HeaderCompletionTokens = "x-mockllm-completion-tokens"
	// HeaderCachedTokens sets how many of the prompt tokens are reported as
	// cached (OpenAI cached_tokens, Anthropic cache_read_input_tokens).
	HeaderCachedTokens = "x-mockllm-cached-tokens"
	// HeaderReasoningTokens sets how many of the completion tokens are
	// reported as reasoning tokens; they are not part of the visible text.
	HeaderReasoningTokens = "x-mockllm-reasoning-tokens"
)

// Response headers present on every API response.
const (
	HeaderPromptTokens = "x-mockllm-prompt-tokens"
	HeaderRequestID    = "x-mockllm-request-id"
)

// HeaderQueueWait is the response header giving, in simulated seconds with
// millisecond precision ("0.250"), how long the request waited in the fake
// provider's queue for a capacity slot. Every response of a request that got
// a slot carries it (0.000 when there was no wait); an injected failure, which
// never queues, and an invalid request do not.
const HeaderQueueWait = "x-mockllm-queue-wait"

// api names one of the endpoints the fake provider serves.
type api int

const (
	apiChat api = iota
	apiCompletions
	apiEmbeddings
	apiResponses
	apiMessages
	apiGeminiGenerate    // models/{model}:generateContent
	apiGeminiStream      // models/{model}:streamGenerateContent
	apiGeminiCountTokens // models/{model}:countTokens
	apiGeminiEmbed       // models/{model}:embedContent
	apiConverse          // Bedrock /model/{modelId}/converse
	apiConverseStream    // Bedrock /model/{modelId}/converse-stream
	apiInvoke            // Bedrock /model/{modelId}/invoke, Anthropic models
	apiInvokeStream      // Bedrock /model/{modelId}/invoke-with-response-stream, Anthropic models
)

// apiByPath maps a request path to the endpoint serving it.
var apiByPath = map[string]api{
	"/v1/chat/completions": apiChat,
	"/v1/completions":      apiCompletions,
	"/v1/embeddings":       apiEmbeddings,
	"/v1/responses":        apiResponses,
	"/v1/messages":         apiMessages,
}

// anthropic reports whether a's bodies are Anthropic messages: /v1/messages and Bedrock's
// InvokeModel of an Anthropic model.
func (a api) anthropic() bool { return a == apiMessages || a == apiInvoke || a == apiInvokeStream }

// gemini reports whether a is one of Gemini's model methods.
func (a api) gemini() bool { return a >= apiGeminiGenerate && a <= apiGeminiEmbed }

// noOutput reports whether a generates nothing: embeddings and token counts.
func (a api) noOutput() bool {
	return a == apiEmbeddings || a == apiGeminiEmbed || a == apiGeminiCountTokens
}

// pathStreams reports whether a streams whatever the body says: the streaming methods of
// Gemini and Bedrock, which the path names.
func (a api) pathStreams() bool {
	return a == apiGeminiStream || a == apiConverseStream || a == apiInvokeStream
}

// parsedRequest is what the fake provider needs from a request body.
type parsedRequest struct {
	Model        string
	Stream       bool
	IncludeUsage bool
	// MaxTokens is the completion limit the body asks for; 0 when absent.
	MaxTokens int64
	// PromptTokens follows the formula documented on parseRequest.
	PromptTokens int64
	// Inputs holds each embeddings input as text (token arrays as their JSON),
	// so equal inputs get equal vectors.
	Inputs     []string
	Dimensions int
	Base64     bool
}

// wireRequest is the union of the body fields of every endpoint. Fields that
// take several JSON shapes stay raw and are read by the counting helpers.
type wireRequest struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	MaxOutputTokens     *int64          `json:"max_output_tokens"`
	Messages            json.RawMessage `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
	Input               json.RawMessage `json:"input"`
	Instructions        json.RawMessage `json:"instructions"`
	System              json.RawMessage `json:"system"`
	Dimensions          *int            `json:"dimensions"`
	EncodingFormat      string          `json:"encoding_format"`
}

// textCount accumulates the two parts of the prompt-token formula.
type textCount struct {
	bytes    int64
	tokenIDs int64
}

// tokens applies the formula: ceil(bytes/4) + token ids.
func (c textCount) tokens() int64 {
	return (c.bytes+3)/4 + c.tokenIDs
}

// parseRequest reads the body of a call routed to rt and computes its prompt tokens
// deterministically:
//
//	prompt_tokens = ceil(B / 4) + T
//
// B is the number of UTF-8 bytes of text in the request, summed over the
// whole request before rounding: chat and Anthropic messages' content (a
// string, or the "text" field of each content part), Anthropic's system
// (string or text blocks), the completions prompt and embeddings input
// (string or array of strings), the Responses API's instructions and
// input (a string, or each item's content as above), Gemini's contents,
// systemInstruction and embedContent content (each part's "text") and
// Bedrock Converse's messages and system (each block's "text"). T is the
// number of token ids when a prompt or input is given as token arrays ([]int
// or [][]int). Roles, names, tool definitions and images count nothing. The
// model is the body's, or the one the path names (Gemini, Bedrock, and an
// Azure deployment when the body names none). An error means the body is not
// what the real API accepts and becomes a 400.
func parseRequest(rt route, body []byte) (parsedRequest, error) {
	var p parsedRequest
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return p, errors.New("request body must be a JSON object")
	}
	a := rt.api
	switch {
	case a.gemini():
		return parseGemini(rt, trimmed)
	case a == apiConverse || a == apiConverseStream:
		return parseConverse(rt, trimmed)
	}
	var w wireRequest
	if err := json.Unmarshal(trimmed, &w); err != nil {
		return p, fmt.Errorf("request body is not valid JSON for this endpoint: %w", err)
	}
	switch {
	case a == apiInvoke || a == apiInvokeStream:
		// InvokeModel's body names no model and does not say whether it streams: the path does.
		if !strings.Contains(rt.model, "anthropic") {
			return p, fmt.Errorf("mockllm serves InvokeModel only for Anthropic models, not %s", rt.model)
		}
		w.Model, w.Stream = rt.model, a.pathStreams()
	case w.Model == "":
		w.Model = rt.model
	}
	if w.Model == "" {
		return p, errors.New("you must provide a model parameter")
	}
	p.Model = w.Model
	p.Stream = w.Stream && a != apiEmbeddings
	p.IncludeUsage = w.StreamOptions != nil && w.StreamOptions.IncludeUsage

	var limit *int64
	var limitName string
	switch a {
	case apiChat:
		limit, limitName = w.MaxTokens, "max_tokens"
		if w.MaxCompletionTokens != nil {
			limit, limitName = w.MaxCompletionTokens, "max_completion_tokens"
		}
	case apiCompletions, apiMessages, apiInvoke, apiInvokeStream:
		limit, limitName = w.MaxTokens, "max_tokens"
	case apiResponses:
		limit, limitName = w.MaxOutputTokens, "max_output_tokens"
	}
	if limit != nil {
		if *limit < 1 || *limit > maxCompletionTokens {
			return p, fmt.Errorf("%s %d must lie in [1, %d]", limitName, *limit, maxCompletionTokens)
		}
		p.MaxTokens = *limit
	}

	var c textCount
	var err error
	switch a {
	case apiChat, apiMessages, apiInvoke, apiInvokeStream:
		err = countMessages(&c, w.Messages)
		if err == nil && a.anthropic() {
			err = countContent(&c, w.System, "system")
		}
	case apiCompletions:
		_, err = countPromptLike(&c, w.Prompt, "prompt")
	case apiEmbeddings:
		p.Inputs, err = countPromptLike(&c, w.Input, "input")
		if err == nil {
			err = embeddingShape(&p, w)
		}
	case apiResponses:
		err = countResponsesInput(&c, w)
	}
	if err != nil {
		return p, err
	}
	p.PromptTokens = c.tokens()
	return p, nil
}

// embeddingShape reads the embeddings output options into p.
func embeddingShape(p *parsedRequest, w wireRequest) error {
	if w.Dimensions != nil {
		if *w.Dimensions < 1 || *w.Dimensions > maxEmbeddingDimensions {
			return fmt.Errorf("dimensions %d must lie in [1, %d]", *w.Dimensions, maxEmbeddingDimensions)
		}
		p.Dimensions = *w.Dimensions
	}
	switch w.EncodingFormat {
	case "", "float":
	case "base64":
		p.Base64 = true
	default:
		return fmt.Errorf("encoding_format %q must be \"float\" or \"base64\"", w.EncodingFormat)
	}
	return nil
}

// isNull reports whether raw is absent or the JSON null.
func isNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || bytes.Equal(t, []byte("null"))
}

// countMessages adds the content of a required, non-empty messages array.
func countMessages(c *textCount, raw json.RawMessage) error {
	if isNull(raw) {
		return errors.New("messages is required")
	}
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return fmt.Errorf("messages must be an array of message objects: %w", err)
	}
	if len(msgs) == 0 {
		return errors.New("messages must not be empty")
	}
	for i, m := range msgs {
		if err := countContent(c, m.Content, fmt.Sprintf("messages[%d].content", i)); err != nil {
			return err
		}
	}
	return nil
}

// countContent adds a content value: null, a string, or an array of parts
// whose "text" strings count.
func countContent(c *textCount, raw json.RawMessage, field string) error {
	t := bytes.TrimSpace(raw)
	if isNull(t) {
		return nil
	}
	switch t[0] {
	case '"':
		var s string
		if err := json.Unmarshal(t, &s); err != nil {
			return fmt.Errorf("%s: %w", field, err)
		}
		c.bytes += int64(len(s))
		return nil
	case '[':
		var parts []struct {
			Text *string `json:"text"`
		}
		if err := json.Unmarshal(t, &parts); err != nil {
			return fmt.Errorf("%s must be a string or an array of content parts: %w", field, err)
		}
		for _, part := range parts {
			if part.Text != nil {
				c.bytes += int64(len(*part.Text))
			}
		}
		return nil
	default:
		return fmt.Errorf("%s must be a string or an array of content parts", field)
	}
}

// countPromptLike adds a required prompt or input that is a string, an array
// of strings, an array of token ids or an array of token-id arrays. It returns
// each input as text, for embeddings.
func countPromptLike(c *textCount, raw json.RawMessage, field string) ([]string, error) {
	t := bytes.TrimSpace(raw)
	if isNull(t) {
		return nil, fmt.Errorf("%s is required", field)
	}
	if t[0] == '"' {
		var s string
		if err := json.Unmarshal(t, &s); err != nil {
			return nil, fmt.Errorf("%s: %w", field, err)
		}
		c.bytes += int64(len(s))
		return []string{s}, nil
	}
	if t[0] != '[' {
		return nil, fmt.Errorf("%s must be a string, an array of strings or an array of token arrays", field)
	}
	var items []json.RawMessage
	if err := json.Unmarshal(t, &items); err != nil {
		return nil, fmt.Errorf("%s: %w", field, err)
	}
	if len(items) == 0 {
		return nil, fmt.Errorf("%s must not be empty", field)
	}
	first := bytes.TrimSpace(items[0])
	if len(first) > 0 && (first[0] == '-' || (first[0] >= '0' && first[0] <= '9')) {
		ids, err := tokenIDs(t, field)
		if err != nil {
			return nil, err
		}
		c.tokenIDs += int64(len(ids))
		return []string{string(t)}, nil
	}
	inputs := make([]string, 0, len(items))
	for i, item := range items {
		it := bytes.TrimSpace(item)
		switch {
		case len(it) > 0 && it[0] == '"':
			var s string
			if err := json.Unmarshal(it, &s); err != nil {
				return nil, fmt.Errorf("%s[%d]: %w", field, i, err)
			}
			c.bytes += int64(len(s))
			inputs = append(inputs, s)
		case len(it) > 0 && it[0] == '[':
			ids, err := tokenIDs(it, fmt.Sprintf("%s[%d]", field, i))
			if err != nil {
				return nil, err
			}
			c.tokenIDs += int64(len(ids))
			inputs = append(inputs, string(it))
		default:
			return nil, fmt.Errorf("%s[%d] must be a string or an array of token ids", field, i)
		}
	}
	return inputs, nil
}

// tokenIDs reads a non-empty array of non-negative integer token ids.
func tokenIDs(raw json.RawMessage, field string) ([]int64, error) {
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err != nil {
		return nil, fmt.Errorf("%s must be an array of integer token ids: %w", field, err)
	}
	if len(ids) == 0 {
		return nil, fmt.Errorf("%s must not be empty", field)
	}
	for i, id := range ids {
		if id < 0 {
			return nil, fmt.Errorf("%s[%d]: token id %d must not be negative", field, i, id)
		}
	}
	return ids, nil
}

// countResponsesInput adds the Responses API's optional instructions and
// input (a string or an array of items with content).
func countResponsesInput(c *textCount, w wireRequest) error {
	if !isNull(w.Instructions) {
		var s string
		if err := json.Unmarshal(w.Instructions, &s); err != nil {
			return fmt.Errorf("instructions must be a string: %w", err)
		}
		c.bytes += int64(len(s))
	}
	t := bytes.TrimSpace(w.Input)
	if isNull(t) {
		return nil
	}
	switch t[0] {
	case '"':
		var s string
		if err := json.Unmarshal(t, &s); err != nil {
			return fmt.Errorf("input: %w", err)
		}
		c.bytes += int64(len(s))
		return nil
	case '[':
		var items []struct {
			Content json.RawMessage `json:"content"`
		}
		if err := json.Unmarshal(t, &items); err != nil {
			return fmt.Errorf("input must be a string or an array of input items: %w", err)
		}
		for i, it := range items {
			if err := countContent(c, it.Content, fmt.Sprintf("input[%d].content", i)); err != nil {
				return err
			}
		}
		return nil
	default:
		return errors.New("input must be a string or an array of input items")
	}
}

// tokenOverrides are the x-mockllm-* token headers of one request; nil
// fields were not sent.
type tokenOverrides struct {
	Completion *int64
	Cached     *int64
	Reasoning  *int64
}

// parseTokenHeaders reads the token override headers, rejecting anything
// that is not an integer in range.
func parseTokenHeaders(h http.Header) (tokenOverrides, error) {
	var o tokenOverrides
	var errs []error
	read := func(name string, dst **int64) {
		v, ok := headerValue(h, name)
		if !ok {
			return
		}
		n, err := strconv.ParseInt(v, 10, 64)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("header %s: %q: %w", name, v, err))
		case n < 0 || n > maxCompletionTokens:
			errs = append(errs, fmt.Errorf("header %s: %q must lie in [0, %d]", name, v, maxCompletionTokens))
		default:
			*dst = &n
		}
	}
	read(HeaderCompletionTokens, &o.Completion)
	read(HeaderCachedTokens, &o.Cached)
	read(HeaderReasoningTokens, &o.Reasoning)
	return o, errors.Join(errs...)
}

// usage is the token accounting of one response, reported exactly.
type usage struct {
	Prompt     int64
	Completion int64
	Cached     int64
	Reasoning  int64
}

// total is prompt plus completion tokens.
func (u usage) total() int64 { return u.Prompt + u.Completion }

// reportedUsage is what a response's usage object says: the real usage, or
// the counts a fault puts in its place (see Fault.report).
type reportedUsage struct {
	Prompt, Completion, Total, Cached, Reasoning int64
}

// visible is the number of completion tokens that appear as text.
func (u usage) visible() int64 { return u.Completion - u.Reasoning }

// computeUsage settles the numbers a request will be reported with: the
// header override wins, then the body's limit, then defaultCompletion.
// Embeddings generate nothing, and a token count uses nothing at all.
func computeUsage(a api, p parsedRequest, o tokenOverrides, defaultCompletion int64) (usage, error) {
	u := usage{Prompt: p.PromptTokens}
	switch {
	case a == apiGeminiCountTokens:
		// Counting tokens is free: nothing is used, whatever the count says.
		return usage{}, nil
	case a.noOutput():
	case o.Completion != nil:
		u.Completion = *o.Completion
	case p.MaxTokens > 0:
		u.Completion = p.MaxTokens
	default:
		u.Completion = defaultCompletion
	}
	if o.Cached != nil {
		if *o.Cached > u.Prompt {
			return u, fmt.Errorf("header %s: %d exceeds the %d prompt tokens", HeaderCachedTokens, *o.Cached, u.Prompt)
		}
		u.Cached = *o.Cached
	}
	if o.Reasoning != nil {
		if *o.Reasoning > u.Completion {
			return u, fmt.Errorf("header %s: %d exceeds the %d completion tokens", HeaderReasoningTokens, *o.Reasoning, u.Completion)
		}
		u.Reasoning = *o.Reasoning
	}
	return u, nil
}
