package mock

import (
	"encoding/base64"
	"encoding/json"
	"net/http"
)

// converseUsage is Bedrock's usage. inputTokens leaves out the tokens read from (and
// written to) the prompt cache, which have counts of their own; the total adds them all.
type converseUsage struct {
	InputTokens           int64 `json:"inputTokens"`
	OutputTokens          int64 `json:"outputTokens"`
	TotalTokens           int64 `json:"totalTokens"`
	CacheReadInputTokens  int64 `json:"cacheReadInputTokens,omitempty"`
	CacheWriteInputTokens int64 `json:"cacheWriteInputTokens,omitempty"`
}

type converseMetrics struct {
	LatencyMs int64 `json:"latencyMs"`
}

type converseText struct {
	Text string `json:"text"`
}

type converseMessage struct {
	Role    string         `json:"role"`
	Content []converseText `json:"content"`
}

type converseOutput struct {
	Message converseMessage `json:"message"`
}

type converseResponse struct {
	Output     converseOutput  `json:"output"`
	StopReason string          `json:"stopReason"`
	Usage      *converseUsage  `json:"usage,omitempty"`
	Metrics    converseMetrics `json:"metrics"`
}

// converseRenderer renders Converse and ConverseStream; the stream's events are named by
// their AWS event type (messageStart, contentBlockDelta, contentBlockStop, messageStop,
// metadata), the usage in the metadata event.
type converseRenderer struct{ r *response }

func (c converseRenderer) usage() *converseUsage {
	if !c.r.withUsage {
		return nil
	}
	u := c.r.reported
	return &converseUsage{InputTokens: u.Prompt - u.Cached, OutputTokens: u.Completion, TotalTokens: u.Total, CacheReadInputTokens: u.Cached}
}

func (c converseRenderer) body() ([]byte, error) {
	return json.Marshal(converseResponse{
		Output:     converseOutput{Message: converseMessage{Role: "assistant", Content: []converseText{{Text: c.r.fullText()}}}},
		StopReason: "end_turn", Usage: c.usage(), Metrics: converseMetrics{LatencyMs: c.r.latencyMs},
	})
}

func awsEvent(name string, v any) (sseEvent, error) {
	b, err := json.Marshal(v)
	return sseEvent{name: name, data: b}, err
}

func (c converseRenderer) preamble() ([]sseEvent, error) {
	ev, err := awsEvent("messageStart", struct {
		Role string `json:"role"`
	}{"assistant"})
	return []sseEvent{ev}, err
}

type converseDelta struct {
	ContentBlockIndex int          `json:"contentBlockIndex"`
	Delta             converseText `json:"delta"`
}

func (c converseRenderer) delta(text string) (sseEvent, error) {
	return awsEvent("contentBlockDelta", converseDelta{Delta: converseText{Text: text}})
}

func (c converseRenderer) trailer() ([]sseEvent, error) {
	stop, err := awsEvent("contentBlockStop", struct {
		ContentBlockIndex int `json:"contentBlockIndex"`
	}{0})
	if err != nil {
		return nil, err
	}
	msgStop, err := awsEvent("messageStop", struct {
		StopReason string `json:"stopReason"`
	}{"end_turn"})
	if err != nil {
		return nil, err
	}
	meta, err := awsEvent("metadata", struct {
		Usage   *converseUsage  `json:"usage,omitempty"`
		Metrics converseMetrics `json:"metrics"`
	}{c.usage(), converseMetrics{LatencyMs: c.r.latencyMs}})
	return []sseEvent{stop, msgStop, meta}, err
}

// invokeStreamRenderer renders InvokeModelWithResponseStream of an Anthropic model: each of
// the Messages API's events, base64-encoded in the "bytes" of a chunk event. The last one,
// message_stop, also carries Bedrock's invocation metrics, token counts included.
type invokeStreamRenderer struct {
	inner messagesRenderer
}

type invocationMetrics struct {
	InputTokenCount   int64 `json:"inputTokenCount"`
	OutputTokenCount  int64 `json:"outputTokenCount"`
	InvocationLatency int64 `json:"invocationLatency"`
	FirstByteLatency  int64 `json:"firstByteLatency"`
}

// chunk wraps one Anthropic event.
func (c invokeStreamRenderer) chunk(ev sseEvent) (sseEvent, error) {
	data := ev.data
	if ev.name == "message_stop" && c.inner.r.withUsage {
		u := c.inner.r.reported
		b, err := json.Marshal(struct {
			Type    string            `json:"type"`
			Metrics invocationMetrics `json:"amazon-bedrock-invocationMetrics"`
		}{"message_stop", invocationMetrics{InputTokenCount: u.Prompt, OutputTokenCount: u.Completion,
			InvocationLatency: c.inner.r.latencyMs, FirstByteLatency: c.inner.r.latencyMs / 5}})
		if err != nil {
			return sseEvent{}, err
		}
		data = b
	}
	return awsEvent("chunk", struct {
		Bytes string `json:"bytes"`
	}{base64.StdEncoding.EncodeToString(data)})
}

func (c invokeStreamRenderer) chunks(evs []sseEvent, err error) ([]sseEvent, error) {
	if err != nil {
		return nil, err
	}
	out := make([]sseEvent, 0, len(evs))
	for _, ev := range evs {
		if ev.name == "ping" {
			continue // Bedrock does not relay Anthropic's pings
		}
		w, err := c.chunk(ev)
		if err != nil {
			return nil, err
		}
		out = append(out, w)
	}
	return out, nil
}

func (c invokeStreamRenderer) preamble() ([]sseEvent, error) { return c.chunks(c.inner.preamble()) }

func (c invokeStreamRenderer) delta(text string) (sseEvent, error) {
	ev, err := c.inner.delta(text)
	if err != nil {
		return ev, err
	}
	return c.chunk(ev)
}

func (c invokeStreamRenderer) trailer() ([]sseEvent, error) { return c.chunks(c.inner.trailer()) }

// bedrockException is the AWS exception Bedrock names an error of status by, in the
// x-amzn-errortype header of an error response. In an event stream the name starts with a
// lower-case letter (throttlingException).
func bedrockException(status int) string {
	switch {
	case status == http.StatusForbidden:
		return "AccessDeniedException"
	case status == http.StatusNotFound:
		return "ResourceNotFoundException"
	case status == http.StatusRequestTimeout:
		return "ModelTimeoutException"
	case status == http.StatusFailedDependency:
		return "ModelErrorException"
	case status == http.StatusTooManyRequests:
		return "ThrottlingException"
	case status == http.StatusServiceUnavailable || status == 529:
		return "ServiceUnavailableException"
	case status >= 500:
		return "InternalServerException"
	default:
		return "ValidationException"
	}
}

// bedrockStreamException is the name of the exception an event stream reports for status,
// among those ConverseStream and InvokeModelWithResponseStream declare.
func bedrockStreamException(status int) string {
	switch {
	case status == http.StatusTooManyRequests:
		return "throttlingException"
	case status == http.StatusServiceUnavailable || status == 529:
		return "serviceUnavailableException"
	case status == http.StatusFailedDependency:
		return "modelStreamErrorException"
	case status >= 500:
		return "internalServerException"
	default:
		return "validationException"
	}
}

// bedrockErrorBody renders an error's body the way AWS's JSON protocols do; the exception's
// name goes in the x-amzn-errortype header.
func bedrockErrorBody(message string) ([]byte, error) {
	return json.Marshal(struct {
		Message string `json:"message"`
	}{message})
}
