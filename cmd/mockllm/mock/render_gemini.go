package mock

import (
	"encoding/json"
	"net/http"
)

type geminiPart struct {
	Text string `json:"text"`
}

type geminiContent struct {
	Parts []geminiPart `json:"parts"`
	Role  string       `json:"role"`
}

type geminiCandidate struct {
	Content      geminiContent `json:"content"`
	FinishReason string        `json:"finishReason,omitempty"`
	Index        int           `json:"index"`
}

// geminiUsage is Gemini's usageMetadata. Like the API (proto3's JSON), it leaves a zero count
// out. promptTokenCount includes the cached tokens; candidatesTokenCount leaves out the
// thinking, which thoughtsTokenCount reports; the total adds them all.
type geminiUsage struct {
	PromptTokenCount        int64 `json:"promptTokenCount,omitempty"`
	CandidatesTokenCount    int64 `json:"candidatesTokenCount,omitempty"`
	TotalTokenCount         int64 `json:"totalTokenCount,omitempty"`
	CachedContentTokenCount int64 `json:"cachedContentTokenCount,omitempty"`
	ThoughtsTokenCount      int64 `json:"thoughtsTokenCount,omitempty"`
}

type geminiResponse struct {
	Candidates    []geminiCandidate `json:"candidates"`
	UsageMetadata *geminiUsage      `json:"usageMetadata,omitempty"`
	ModelVersion  string            `json:"modelVersion"`
	ResponseID    string            `json:"responseId"`
}

// geminiRenderer renders generateContent and streamGenerateContent; a stream's chunks each
// carry the usage so far (the prompt, and the output up to that chunk), the last one final.
type geminiRenderer struct {
	r *response
	// sent counts the visible tokens streamed so far.
	sent int64
}

// usage is the usageMetadata with visible tokens of output, plus the thinking once final.
func (g *geminiRenderer) usage(visible int64, final bool) *geminiUsage {
	if !g.r.withUsage {
		return nil
	}
	u := g.r.reported
	out := &geminiUsage{PromptTokenCount: u.Prompt, CachedContentTokenCount: u.Cached, CandidatesTokenCount: visible}
	if final {
		out.CandidatesTokenCount, out.ThoughtsTokenCount = u.Completion-u.Reasoning, u.Reasoning
		out.TotalTokenCount = u.Total
	} else {
		out.TotalTokenCount = saturatingAdd(u.Prompt, visible)
	}
	return out
}

func (g *geminiRenderer) chunk(text, finish string, u *geminiUsage) ([]byte, error) {
	return json.Marshal(geminiResponse{
		Candidates:    []geminiCandidate{{Content: geminiContent{Parts: []geminiPart{{Text: text}}, Role: "model"}, FinishReason: finish}},
		UsageMetadata: u, ModelVersion: g.r.model, ResponseID: g.r.objectID,
	})
}

func (g *geminiRenderer) body() ([]byte, error) {
	return g.chunk(g.r.fullText(), "STOP", g.usage(0, true))
}

func (g *geminiRenderer) preamble() ([]sseEvent, error) { return nil, nil }

func (g *geminiRenderer) delta(text string) (sseEvent, error) {
	g.sent += int64(len(text) / BytesPerToken)
	b, err := g.chunk(text, "", g.usage(g.sent, false))
	return sseEvent{data: b}, err
}

func (g *geminiRenderer) trailer() ([]sseEvent, error) {
	b, err := g.chunk("", "STOP", g.usage(0, true))
	return []sseEvent{{data: b}}, err
}

// geminiCountRenderer renders countTokens.
type geminiCountRenderer struct{ r *response }

func (g geminiCountRenderer) body() ([]byte, error) {
	return json.Marshal(struct {
		TotalTokens int64 `json:"totalTokens"`
	}{g.r.parsed.PromptTokens})
}

// geminiEmbedRenderer renders embedContent: one vector, and the prompt's usage.
type geminiEmbedRenderer struct{ r *response }

func (g geminiEmbedRenderer) body() ([]byte, error) {
	r := g.r
	dims := r.parsed.Dimensions
	if dims == 0 {
		dims = r.dims
	}
	out := struct {
		Embedding struct {
			Values []float32 `json:"values"`
		} `json:"embedding"`
		UsageMetadata *geminiUsage `json:"usageMetadata,omitempty"`
	}{}
	out.Embedding.Values = embedding(r.parsed.Inputs[0], dims)
	if r.withUsage {
		out.UsageMetadata = &geminiUsage{PromptTokenCount: r.reported.Prompt, TotalTokenCount: r.reported.Total}
	}
	return json.Marshal(out)
}

// googleStatus is the status name Google's APIs give an HTTP status.
func googleStatus(status int) string {
	switch {
	case status == http.StatusBadRequest:
		return "INVALID_ARGUMENT"
	case status == http.StatusUnauthorized:
		return "UNAUTHENTICATED"
	case status == http.StatusForbidden:
		return "PERMISSION_DENIED"
	case status == http.StatusNotFound:
		return "NOT_FOUND"
	case status == http.StatusConflict:
		return "ABORTED"
	case status == http.StatusTooManyRequests:
		return "RESOURCE_EXHAUSTED"
	case status == http.StatusNotImplemented:
		return "UNIMPLEMENTED"
	case status == http.StatusServiceUnavailable || status == 529:
		return "UNAVAILABLE"
	case status == http.StatusGatewayTimeout:
		return "DEADLINE_EXCEEDED"
	case status >= 500:
		return "INTERNAL"
	default:
		return "FAILED_PRECONDITION"
	}
}

type googleErrorDetail struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	Status  string `json:"status"`
}

// googleErrorBody renders an error the way Google's APIs do.
func googleErrorBody(status int, message string) ([]byte, error) {
	return json.Marshal(struct {
		Error googleErrorDetail `json:"error"`
	}{googleErrorDetail{Code: status, Message: message, Status: googleStatus(status)}})
}
