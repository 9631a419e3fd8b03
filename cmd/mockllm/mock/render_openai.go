package mock

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// sseEvent is one event of a stream; name is empty for OpenAI's and
// Gemini's data-only events. In AWS's event stream, name is the event's
// type, or the exception's when exception is set.
type sseEvent struct {
	name      string
	data      []byte
	exception bool
}

// bodyRenderer produces the whole JSON body of one successful response. A
// renderer belongs to one request.
type bodyRenderer interface {
	body() ([]byte, error)
}

// streamRenderer produces the SSE events of one successful streamed
// response. A renderer belongs to one request.
type streamRenderer interface {
	// preamble are the events sent together at time to first byte.
	preamble() ([]sseEvent, error)
	// delta is the content event carrying text.
	delta(text string) (sseEvent, error)
	// trailer are the events sent after the last content event; the last
	// of them ends the stream.
	trailer() ([]sseEvent, error)
}

// response describes the successful answer to one request, shared by all
// renderers.
type response struct {
	// objectID is the unique part of the ids of the objects returned; each
	// renderer puts its API's prefix in front ("chatcmpl-", "resp_", "msg_").
	objectID string
	model    string
	created  int64
	usage    usage
	// reported is what the usage object says: usage, unless a fault says otherwise.
	reported reportedUsage
	// withUsage is false under a no-usage fault.
	withUsage bool
	// includeUsage mirrors stream_options.include_usage.
	includeUsage bool
	parsed       parsedRequest
	dims         int
	// latencyMs is the response's latency, for the APIs that report it (Bedrock's metrics).
	latencyMs int64
}

// fullText is the whole visible completion.
func (r *response) fullText() string { return generatedText(0, r.usage.visible()) }

// rawNull is the JSON null, for fields the real APIs send as null.
var rawNull = json.RawMessage("null")

// --- chat completions -------------------------------------------------------

type chatPromptDetails struct {
	CachedTokens int64 `json:"cached_tokens"`
	AudioTokens  int64 `json:"audio_tokens"`
}

type chatCompletionDetails struct {
	ReasoningTokens          int64 `json:"reasoning_tokens"`
	AudioTokens              int64 `json:"audio_tokens"`
	AcceptedPredictionTokens int64 `json:"accepted_prediction_tokens"`
	RejectedPredictionTokens int64 `json:"rejected_prediction_tokens"`
}

type chatUsage struct {
	PromptTokens            int64                 `json:"prompt_tokens"`
	CompletionTokens        int64                 `json:"completion_tokens"`
	TotalTokens             int64                 `json:"total_tokens"`
	PromptTokensDetails     chatPromptDetails     `json:"prompt_tokens_details"`
	CompletionTokensDetails chatCompletionDetails `json:"completion_tokens_details"`
}

func newChatUsage(u reportedUsage) *chatUsage {
	return &chatUsage{
		PromptTokens:            u.Prompt,
		CompletionTokens:        u.Completion,
		TotalTokens:             u.Total,
		PromptTokensDetails:     chatPromptDetails{CachedTokens: u.Cached},
		CompletionTokensDetails: chatCompletionDetails{ReasoningTokens: u.Reasoning},
	}
}

type chatMessage struct {
	Role        string          `json:"role"`
	Content     string          `json:"content"`
	Refusal     json.RawMessage `json:"refusal"`
	Annotations []struct{}      `json:"annotations"`
}

type chatChoice struct {
	Index        int             `json:"index"`
	Message      chatMessage     `json:"message"`
	Logprobs     json.RawMessage `json:"logprobs"`
	FinishReason string          `json:"finish_reason"`
}

type chatCompletion struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"`
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	Choices           []chatChoice `json:"choices"`
	Usage             *chatUsage   `json:"usage,omitempty"`
	ServiceTier       string       `json:"service_tier"`
	SystemFingerprint string       `json:"system_fingerprint"`
}

type chatDelta struct {
	Role    string          `json:"role,omitempty"`
	Content *string         `json:"content,omitempty"`
	Refusal json.RawMessage `json:"refusal,omitempty"`
}

type chatChunkChoice struct {
	Index        int             `json:"index"`
	Delta        chatDelta       `json:"delta"`
	Logprobs     json.RawMessage `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
}

type chatChunk struct {
	ID                string            `json:"id"`
	Object            string            `json:"object"`
	Created           int64             `json:"created"`
	Model             string            `json:"model"`
	ServiceTier       string            `json:"service_tier"`
	SystemFingerprint string            `json:"system_fingerprint"`
	Choices           []chatChunkChoice `json:"choices"`
	// Usage is absent unless include_usage was asked for; then it is null on
	// every chunk but the usage chunk, as the real API sends it.
	Usage json.RawMessage `json:"usage,omitempty"`
}

const systemFingerprint = "fp_mockllm"

// chatRenderer renders /v1/chat/completions.
type chatRenderer struct{ r *response }

func (c chatRenderer) body() ([]byte, error) {
	out := chatCompletion{
		ID: "chatcmpl-" + c.r.objectID, Object: "chat.completion", Created: c.r.created, Model: c.r.model,
		Choices: []chatChoice{{
			Message:      chatMessage{Role: "assistant", Content: c.r.fullText(), Refusal: rawNull, Annotations: []struct{}{}},
			Logprobs:     rawNull,
			FinishReason: "stop",
		}},
		ServiceTier: "default", SystemFingerprint: systemFingerprint,
	}
	if c.r.withUsage {
		out.Usage = newChatUsage(c.r.reported)
	}
	return json.Marshal(out)
}

// chunk builds one chunk with the given choices.
func (c chatRenderer) chunk(choices []chatChunkChoice) chatChunk {
	ch := chatChunk{
		ID: "chatcmpl-" + c.r.objectID, Object: "chat.completion.chunk", Created: c.r.created, Model: c.r.model,
		ServiceTier: "default", SystemFingerprint: systemFingerprint, Choices: choices,
	}
	if c.r.includeUsage {
		ch.Usage = rawNull
	}
	return ch
}

func (c chatRenderer) event(ch chatChunk) (sseEvent, error) {
	b, err := json.Marshal(ch)
	return sseEvent{data: b}, err
}

func (c chatRenderer) preamble() ([]sseEvent, error) {
	empty := ""
	ev, err := c.event(c.chunk([]chatChunkChoice{{
		Delta:    chatDelta{Role: "assistant", Content: &empty, Refusal: rawNull},
		Logprobs: rawNull,
	}}))
	return []sseEvent{ev}, err
}

func (c chatRenderer) delta(text string) (sseEvent, error) {
	return c.event(c.chunk([]chatChunkChoice{{Delta: chatDelta{Content: &text}, Logprobs: rawNull}}))
}

func (c chatRenderer) trailer() ([]sseEvent, error) {
	stop := "stop"
	fin, err := c.event(c.chunk([]chatChunkChoice{{Logprobs: rawNull, FinishReason: &stop}}))
	if err != nil {
		return nil, err
	}
	evs := []sseEvent{fin}
	if c.r.includeUsage && c.r.withUsage {
		ch := c.chunk([]chatChunkChoice{})
		u, err := json.Marshal(newChatUsage(c.r.reported))
		if err != nil {
			return nil, err
		}
		ch.Usage = u
		ev, err := c.event(ch)
		if err != nil {
			return nil, err
		}
		evs = append(evs, ev)
	}
	return append(evs, sseEvent{data: []byte("[DONE]")}), nil
}

// --- legacy completions -----------------------------------------------------

type completionChoice struct {
	Text         string          `json:"text"`
	Index        int             `json:"index"`
	Logprobs     json.RawMessage `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
}

type completion struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	SystemFingerprint string             `json:"system_fingerprint"`
	Choices           []completionChoice `json:"choices"`
	Usage             json.RawMessage    `json:"usage,omitempty"`
}

// completionsRenderer renders /v1/completions.
type completionsRenderer struct{ r *response }

// usage is the same usage object chat reports: the OpenAI API shares it.
func (c completionsRenderer) usage() (json.RawMessage, error) {
	return json.Marshal(newChatUsage(c.r.reported))
}

// make builds a completion; while streaming with include_usage, usage is
// null on every chunk but the usage chunk, as for chat.
func (c completionsRenderer) make(choices []completionChoice, streaming bool) completion {
	out := completion{ID: "cmpl-" + c.r.objectID, Object: "text_completion", Created: c.r.created, Model: c.r.model, SystemFingerprint: systemFingerprint, Choices: choices}
	if streaming && c.r.includeUsage {
		out.Usage = rawNull
	}
	return out
}

func (c completionsRenderer) body() ([]byte, error) {
	stop := "stop"
	out := c.make([]completionChoice{{Text: c.r.fullText(), Logprobs: rawNull, FinishReason: &stop}}, false)
	if c.r.withUsage {
		u, err := c.usage()
		if err != nil {
			return nil, err
		}
		out.Usage = u
	}
	return json.Marshal(out)
}

func (c completionsRenderer) preamble() ([]sseEvent, error) { return nil, nil }

func (c completionsRenderer) delta(text string) (sseEvent, error) {
	b, err := json.Marshal(c.make([]completionChoice{{Text: text, Logprobs: rawNull}}, true))
	return sseEvent{data: b}, err
}

func (c completionsRenderer) trailer() ([]sseEvent, error) {
	stop := "stop"
	b, err := json.Marshal(c.make([]completionChoice{{Text: "", Logprobs: rawNull, FinishReason: &stop}}, true))
	if err != nil {
		return nil, err
	}
	evs := []sseEvent{{data: b}}
	if c.r.includeUsage && c.r.withUsage {
		out := c.make([]completionChoice{}, true)
		if out.Usage, err = c.usage(); err != nil {
			return nil, err
		}
		if b, err = json.Marshal(out); err != nil {
			return nil, err
		}
		evs = append(evs, sseEvent{data: b})
	}
	return append(evs, sseEvent{data: []byte("[DONE]")}), nil
}

// --- embeddings -------------------------------------------------------------

type embeddingItem struct {
	Object    string `json:"object"`
	Index     int    `json:"index"`
	Embedding any    `json:"embedding"`
}

type embeddingUsage struct {
	PromptTokens int64 `json:"prompt_tokens"`
	TotalTokens  int64 `json:"total_tokens"`
}

type embeddingList struct {
	Object string          `json:"object"`
	Data   []embeddingItem `json:"data"`
	Model  string          `json:"model"`
	Usage  *embeddingUsage `json:"usage,omitempty"`
}

// embeddingsRenderer renders /v1/embeddings, which never streams.
type embeddingsRenderer struct{ r *response }

func (c embeddingsRenderer) body() ([]byte, error) {
	r := c.r
	dims := r.parsed.Dimensions
	if dims == 0 {
		dims = r.dims
	}
	out := embeddingList{Object: "list", Model: r.model, Data: make([]embeddingItem, len(r.parsed.Inputs))}
	for i, in := range r.parsed.Inputs {
		v := embedding(in, dims)
		item := embeddingItem{Object: "embedding", Index: i, Embedding: v}
		if r.parsed.Base64 {
			item.Embedding = embeddingBase64(v)
		}
		out.Data[i] = item
	}
	if r.withUsage {
		out.Usage = &embeddingUsage{PromptTokens: r.reported.Prompt, TotalTokens: r.reported.Total}
	}
	return json.Marshal(out)
}

// --- models -----------------------------------------------------------------

// models are listed by GET /v1/models. Any model name is accepted by the
// other endpoints; this list only makes SDK model listing work.
var models = []string{"gpt-4o", "gpt-4o-mini", "gpt-4.1-mini", "o4-mini", "text-embedding-3-small", "claude-sonnet-4-5", "claude-haiku-4-5", "deepseek-chat"}

type modelObject struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

type modelList struct {
	Object string        `json:"object"`
	Data   []modelObject `json:"data"`
}

// modelsBody renders GET /v1/models.
func modelsBody() ([]byte, error) {
	out := modelList{Object: "list", Data: make([]modelObject, len(models))}
	for i, m := range models {
		out.Data[i] = modelObject{ID: m, Object: "model", Created: 1700000000, OwnedBy: "mockllm"}
	}
	return json.Marshal(out)
}

// --- errors -----------------------------------------------------------------

type openAIErrorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

type openAIError struct {
	Error openAIErrorDetail `json:"error"`
}

// openAIErrorBody renders an error the way the OpenAI API does for status.
func openAIErrorBody(status int, message string) ([]byte, error) {
	d := openAIErrorDetail{Message: message, Type: "invalid_request_error"}
	code := func(s string) { d.Code = &s }
	switch {
	case status == http.StatusUnauthorized:
		code("invalid_api_key")
	case status == http.StatusNotFound:
		code("unknown_url")
	case status == http.StatusTooManyRequests:
		d.Type = "requests"
		code("rate_limit_exceeded")
	case status >= 500:
		d.Type = "server_error"
	}
	return json.Marshal(openAIError{Error: d})
}

// azureCode is the code Azure OpenAI's error bodies give an error of status: "429" for every
// rate or quota limit, a name for its own failures.
func azureCode(status int) string {
	switch {
	case status == http.StatusTooManyRequests, status == http.StatusUnauthorized, status == http.StatusNotFound:
		return strconv.Itoa(status)
	case status == http.StatusServiceUnavailable || status == 529:
		return "ServiceUnavailable"
	case status == http.StatusGatewayTimeout || status == http.StatusRequestTimeout:
		return "Timeout"
	case status >= 500:
		return "InternalServerError"
	default:
		return "BadRequest"
	}
}

type azureErrorDetail struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// azureErrorBody renders an error the way Azure OpenAI does: {"error":{"code","message"}}.
func azureErrorBody(status int, message string) ([]byte, error) {
	return json.Marshal(struct {
		Error azureErrorDetail `json:"error"`
	}{azureErrorDetail{Code: azureCode(status), Message: message}})
}

// defaultErrorMessage is the message of an injected error, in the words the
// real providers use, marked so nobody mistakes it for a real outage.
func defaultErrorMessage(status int) string {
	var m string
	switch status {
	case http.StatusTooManyRequests:
		m = "Rate limit reached for requests."
	case http.StatusInternalServerError:
		m = "The server had an error while processing your request."
	case http.StatusServiceUnavailable, 529:
		m = "The server is overloaded. Please try again later."
	default:
		m = http.StatusText(status)
		if m == "" {
			m = "Error"
		}
	}
	return m + " (injected by mockllm)"
}
