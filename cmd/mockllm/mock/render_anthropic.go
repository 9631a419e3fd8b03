package mock

import (
	"encoding/json"
	"net/http"
)

// anthropicUsage is Anthropic's usage object. Anthropic reports cached
// prompt tokens apart from input_tokens, so input_tokens is the prompt minus
// the cached tokens and the three input counts add up to the prompt.
type anthropicUsage struct {
	InputTokens              int64  `json:"input_tokens"`
	CacheCreationInputTokens int64  `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int64  `json:"cache_read_input_tokens"`
	OutputTokens             int64  `json:"output_tokens"`
	ServiceTier              string `json:"service_tier"`
}

type anthropicBlock struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type anthropicMessage struct {
	ID           string           `json:"id"`
	Type         string           `json:"type"`
	Role         string           `json:"role"`
	Model        string           `json:"model"`
	Content      []anthropicBlock `json:"content"`
	StopReason   *string          `json:"stop_reason"`
	StopSequence json.RawMessage  `json:"stop_sequence"`
	Usage        *anthropicUsage  `json:"usage,omitempty"`
}

type anthropicStopDelta struct {
	StopReason   string          `json:"stop_reason"`
	StopSequence json.RawMessage `json:"stop_sequence"`
}

type anthropicTextDelta struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type anthropicOutputUsage struct {
	OutputTokens int64 `json:"output_tokens"`
}

// anthropicEvent carries every field any Messages stream event uses.
type anthropicEvent struct {
	Type         string            `json:"type"`
	Message      *anthropicMessage `json:"message,omitempty"`
	Index        *int              `json:"index,omitempty"`
	ContentBlock *anthropicBlock   `json:"content_block,omitempty"`
	Delta        any               `json:"delta,omitempty"`
	Usage        any               `json:"usage,omitempty"`
}

// messagesRenderer renders Anthropic's /v1/messages.
type messagesRenderer struct{ r *response }

// usage is the usage object with outputTokens as the output count.
func (c messagesRenderer) usage(outputTokens int64) *anthropicUsage {
	if !c.r.withUsage {
		return nil
	}
	u := c.r.reported
	return &anthropicUsage{
		InputTokens:          u.Prompt - u.Cached,
		CacheReadInputTokens: u.Cached,
		OutputTokens:         outputTokens,
		ServiceTier:          "standard",
	}
}

// message is the message object; stopReason is nil while streaming.
func (c messagesRenderer) message(content []anthropicBlock, stopReason *string, outputTokens int64) *anthropicMessage {
	return &anthropicMessage{
		ID: "msg_" + c.r.objectID, Type: "message", Role: "assistant", Model: c.r.model,
		Content: content, StopReason: stopReason, StopSequence: rawNull, Usage: c.usage(outputTokens),
	}
}

func (c messagesRenderer) body() ([]byte, error) {
	stop := "end_turn"
	return json.Marshal(c.message([]anthropicBlock{{Type: "text", Text: c.r.fullText()}}, &stop, c.r.reported.Completion))
}

func (c messagesRenderer) event(e anthropicEvent) (sseEvent, error) {
	b, err := json.Marshal(e)
	return sseEvent{name: e.Type, data: b}, err
}

func (c messagesRenderer) events(es ...anthropicEvent) ([]sseEvent, error) {
	out := make([]sseEvent, 0, len(es))
	for _, e := range es {
		ev, err := c.event(e)
		if err != nil {
			return nil, err
		}
		out = append(out, ev)
	}
	return out, nil
}

// preamble starts the message. Like the real API, message_start already
// counts the first output token; message_delta carries the cumulative total.
func (c messagesRenderer) preamble() ([]sseEvent, error) {
	zero := 0
	return c.events(
		anthropicEvent{Type: "message_start", Message: c.message([]anthropicBlock{}, nil, min(1, c.r.reported.Completion))},
		anthropicEvent{Type: "content_block_start", Index: &zero, ContentBlock: &anthropicBlock{Type: "text", Text: ""}},
		anthropicEvent{Type: "ping"},
	)
}

func (c messagesRenderer) delta(text string) (sseEvent, error) {
	zero := 0
	return c.event(anthropicEvent{Type: "content_block_delta", Index: &zero, Delta: anthropicTextDelta{Type: "text_delta", Text: text}})
}

func (c messagesRenderer) trailer() ([]sseEvent, error) {
	zero := 0
	md := anthropicEvent{Type: "message_delta", Delta: anthropicStopDelta{StopReason: "end_turn", StopSequence: rawNull}}
	if c.r.withUsage {
		md.Usage = anthropicOutputUsage{OutputTokens: c.r.reported.Completion}
	}
	return c.events(
		anthropicEvent{Type: "content_block_stop", Index: &zero},
		md,
		anthropicEvent{Type: "message_stop"},
	)
}

type anthropicErrorDetail struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}

type anthropicError struct {
	Type      string               `json:"type"`
	Error     anthropicErrorDetail `json:"error"`
	RequestID string               `json:"request_id,omitempty"`
}

// anthropicErrorType maps a status to the error type Anthropic uses for it.
func anthropicErrorType(status int) string {
	switch {
	case status == http.StatusUnauthorized:
		return "authentication_error"
	case status == http.StatusForbidden:
		return "permission_error"
	case status == http.StatusNotFound:
		return "not_found_error"
	case status == http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case status == http.StatusTooManyRequests:
		return "rate_limit_error"
	case status == http.StatusServiceUnavailable || status == 529:
		return "overloaded_error"
	case status == http.StatusGatewayTimeout:
		return "timeout_error"
	case status >= 500:
		return "api_error"
	default:
		return "invalid_request_error"
	}
}

// anthropicErrorBody renders an error the way the Anthropic API does.
func anthropicErrorBody(status int, message, requestID string) ([]byte, error) {
	return json.Marshal(anthropicError{
		Type:      "error",
		Error:     anthropicErrorDetail{Type: anthropicErrorType(status), Message: message},
		RequestID: requestID,
	})
}
