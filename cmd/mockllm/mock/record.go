package mock

import (
	"maps"
	"net/http"
	"sync"
	"time"
)

// Outcomes of an API request, as recorded in RecordedRequest.Outcome and
// counted in Stats.ByOutcome.
const (
	OutcomeOK         = "ok"          // answered in full
	OutcomeFault      = "fault"       // answered with an injected error status
	OutcomeDisconnect = "disconnect"  // connection closed on purpose mid-response
	OutcomeClientGone = "client_gone" // the client left (or the server shut down) before the end
	OutcomeRejected   = "rejected"    // the request itself was invalid (400, 404, 405, 413)
)

// redactedHeaders are request headers whose values are never kept, so a demo
// run with real-looking keys does not expose them through /mockllm/requests.
var redactedHeaders = []string{"Authorization", "Proxy-Authorization", "X-Api-Key", "Api-Key"}

// RecordedRequest is one API request as the fake provider received it, and
// how it was answered. Values returned by Server.Requests are copies and safe
// for concurrent use.
type RecordedRequest struct {
	// ID is the x-mockllm-request-id the response carried.
	ID     string    `json:"id"`
	Time   time.Time `json:"time"`
	Method string    `json:"method"`
	Path   string    `json:"path"`
	// Provider is the x-llm-provider request header ("" when absent).
	Provider string `json:"provider"`
	// Model is the body's model ("" until parsed, or when invalid).
	Model  string `json:"model"`
	Stream bool   `json:"stream"`
	// Header holds the request headers; credentials are replaced by "[redacted]".
	Header http.Header `json:"header"`
	// Body is the request body, cut to Options.MaxLoggedBodyBytes.
	Body          string `json:"body"`
	BodyTruncated bool   `json:"body_truncated"`
	// Status is the response status; zero while the request is in progress or
	// when the client left before any headers were sent.
	Status int `json:"status"`
	// Outcome is one of the Outcome* constants; empty while in progress.
	Outcome string `json:"outcome"`
	// PromptTokens and CompletionTokens are what the x-mockllm-* response
	// headers said.
	PromptTokens     int64 `json:"prompt_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
}

// clone returns a deep copy of r.
func (r *RecordedRequest) clone() RecordedRequest {
	c := *r
	c.Header = r.Header.Clone()
	return c
}

// Stats are the fake provider's counters at one instant. Values returned by
// Server.Stats are copies and safe for concurrent use.
type Stats struct {
	// Requests counts API requests received (not /mockllm endpoints).
	Requests int64 `json:"requests"`
	// ByPath counts requests per path; unknown paths count as "other".
	ByPath map[string]int64 `json:"by_path"`
	// ByModel counts requests per body model ("" when the body had none).
	ByModel map[string]int64 `json:"by_model"`
	// ByProvider counts requests per x-llm-provider header ("" when absent).
	ByProvider map[string]int64 `json:"by_provider"`
	// ByStatus counts responses per HTTP status.
	ByStatus map[int]int64 `json:"by_status"`
	// ByOutcome counts finished requests per Outcome* constant.
	ByOutcome map[string]int64 `json:"by_outcome"`
	// PromptTokens and CompletionTokens sum the usage of requests answered in
	// full (OutcomeOK).
	PromptTokens     int64 `json:"prompt_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	// Global is the occupancy of the whole provider (Options.Capacity).
	Global PoolStats `json:"global"`
	// Providers is the occupancy per x-llm-provider value seen or configured.
	Providers map[string]PoolStats `json:"providers"`
}

// recorder keeps the request log ring and the counters. It is safe for
// concurrent use.
type recorder struct {
	maxBody int

	mu      sync.Mutex
	ring    []*RecordedRequest
	next    int
	filled  bool
	counted Stats
}

// newRecorder returns a recorder keeping the last size requests.
func newRecorder(size, maxBody int) *recorder {
	r := &recorder{maxBody: maxBody, ring: make([]*RecordedRequest, size)}
	r.resetLocked()
	return r
}

// resetLocked empties the log and zeroes the counters; r.mu must be held.
func (r *recorder) resetLocked() {
	clear(r.ring)
	r.next, r.filled = 0, false
	r.counted = Stats{
		ByPath:     map[string]int64{},
		ByModel:    map[string]int64{},
		ByProvider: map[string]int64{},
		ByStatus:   map[int]int64{},
		ByOutcome:  map[string]int64{},
	}
}

// reset empties the log and zeroes the counters.
func (r *recorder) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.resetLocked()
}

// bump increments m[key], folding new keys into overflowLabel once m holds
// maxTrackedLabels of them, so client-chosen values cannot grow memory
// without bound.
func bump(m map[string]int64, key string) {
	if _, ok := m[key]; !ok && len(m) >= maxTrackedLabels {
		key = overflowLabel
	}
	m[key]++
}

// received logs a new request and counts it under pathLabel and its
// provider. The returned entry is updated by parsed and finished.
func (r *recorder) received(id string, req *http.Request, pathLabel string, body []byte) *RecordedRequest {
	h := req.Header.Clone()
	for _, name := range redactedHeaders {
		if _, ok := h[name]; ok {
			h[name] = []string{"[redacted]"}
		}
	}
	e := &RecordedRequest{
		ID:       id,
		Time:     time.Now(),
		Method:   req.Method,
		Path:     req.URL.Path,
		Provider: req.Header.Get(ProviderHeader),
		Header:   h,
	}
	if len(body) > r.maxBody {
		e.Body, e.BodyTruncated = string(body[:r.maxBody]), true
	} else {
		e.Body = string(body)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ring[r.next] = e
	r.next++
	if r.next == len(r.ring) {
		r.next, r.filled = 0, true
	}
	r.counted.Requests++
	bump(r.counted.ByPath, pathLabel)
	bump(r.counted.ByProvider, e.Provider)
	return e
}

// parsed records the body's model and stream flag, counting the model.
func (r *recorder) parsed(e *RecordedRequest, model string, stream bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e.Model, e.Stream = model, stream
	bump(r.counted.ByModel, model)
}

// finished records how a request ended. status is zero when no headers were
// sent.
func (r *recorder) finished(e *RecordedRequest, status int, outcome string, u usage) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e.Status, e.Outcome = status, outcome
	e.PromptTokens, e.CompletionTokens = u.Prompt, u.Completion
	if status != 0 {
		r.counted.ByStatus[status]++
	}
	r.counted.ByOutcome[outcome]++
	if outcome == OutcomeOK {
		r.counted.PromptTokens += u.Prompt
		r.counted.CompletionTokens += u.Completion
	}
}

// requests returns copies of the logged requests, oldest first.
func (r *recorder) requests() []RecordedRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]RecordedRequest, 0, len(r.ring))
	if r.filled {
		for _, e := range r.ring[r.next:] {
			out = append(out, e.clone())
		}
	}
	for _, e := range r.ring[:r.next] {
		out = append(out, e.clone())
	}
	return out
}

// stats returns a copy of the counters (pool occupancy is filled in by the
// server).
func (r *recorder) stats() Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.counted
	s.ByPath = maps.Clone(r.counted.ByPath)
	s.ByModel = maps.Clone(r.counted.ByModel)
	s.ByProvider = maps.Clone(r.counted.ByProvider)
	s.ByStatus = maps.Clone(r.counted.ByStatus)
	s.ByOutcome = maps.Clone(r.counted.ByOutcome)
	return s
}
