package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// BodySize is the size of the benchmark's request body.
const BodySize = 1024

// LimitOverrides raise the example policy's limits so that every benchmark stream is admitted
// and runs the full path (classify, estimate, reserve, admit, settle) instead of being refused:
// the example admits 20 concurrent chat requests and 200 000 chat tokens a minute, far below a
// 512-stream load or 10 000 held streams. Each variable is the policy's documented
// LLM_BULKHEAD_ override of one scalar:
//
//   - features.chat.max_concurrent 20 → 100 000 and tokens_per_minute 200 000 → 10¹² (the
//     feature/chat compartment);
//   - tiers.enterprise.max_concurrent 30 → 250 000 and tokens_per_minute 500 000 → 2.5 × 10¹²
//     (tenant/acme, and tier_feature/enterprise/chat at the chat ratio 0.40: 100 000 and 10¹²);
//   - providers.deepseek.max_concurrent 30 → 100 000 (provider/deepseek, where the model map
//     sends deepseek-chat);
//   - breakers.standard.slow_call_duration 800ms → 10m, so a machine too loaded to answer within
//     800 ms (and the held streams, whose first byte comes when the benchmark releases them) is
//     not taken for a slow provider, which would open the breaker and re-route to qwen;
//   - server.max_streams_per_connection 5 000 → 20 000: the simulator puts every stream on one
//     connection (as an Envoy worker does), and 10 000 held streams must fit on it.
//
// Everything else — classification, compartments, queues, budgets' windows, breakers'
// windows, response headers, usage injection — is the example policy unchanged.
var LimitOverrides = []string{
	"LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURRENT=100000",
	"LLM_BULKHEAD_FEATURES__CHAT__TOKENS_PER_MINUTE=1000000000000",
	"LLM_BULKHEAD_TIERS__ENTERPRISE__MAX_CONCURRENT=250000",
	"LLM_BULKHEAD_TIERS__ENTERPRISE__TOKENS_PER_MINUTE=2500000000000",
	"LLM_BULKHEAD_PROVIDERS__DEEPSEEK__MAX_CONCURRENT=100000",
	"LLM_BULKHEAD_BREAKERS__STANDARD__SLOW_CALL_DURATION=10m",
	"LLM_BULKHEAD_SERVER__MAX_STREAMS_PER_CONNECTION=20000",
}

// ServerEnv returns the environment for a server process: this process's environment without
// any LLM_BULKHEAD_ variable (so the caller's shell cannot change the policy under test), plus
// LimitOverrides.
func ServerEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "LLM_BULKHEAD_") {
			env = append(env, kv)
		}
	}
	return append(env, LimitOverrides...)
}

// FilterConfig returns the simulator's filter for the example policy with LimitOverrides, as
// `llm-bulkhead envoy-config` prints it, with message_timeout raised to messageTimeout: with
// hundreds of streams on two cores a reply can take longer than Envoy's 200 ms default without
// anything being wrong with either server, and a timeout would end the stream early.
func FilterConfig(messageTimeout time.Duration) (envoysim.FilterConfig, error) {
	p, _, err := app.LoadPolicy("", LimitOverrides)
	if err != nil {
		return envoysim.FilterConfig{}, err
	}
	fc, err := harness.FilterFromPolicy(p)
	if err != nil {
		return envoysim.FilterConfig{}, err
	}
	fc.MessageTimeout = messageTimeout
	if fc.MaxMessageTimeout < messageTimeout {
		fc.MaxMessageTimeout = messageTimeout
	}
	return fc, nil
}

// ChatBody returns an OpenAI chat completions request of exactly size bytes: a model the
// example policy maps to a provider, a system and a user message (padded to size), stream,
// max_tokens, temperature and user, as an SDK sends them.
func ChatBody(size int) ([]byte, error) {
	const head = `{"model":"deepseek-chat","messages":[{"role":"system","content":"You are the support assistant of Acme Corp. Answer in at most three sentences and cite the knowledge-base article you used."},{"role":"user","content":"`
	const tail = `"}],"stream":true,"max_tokens":256,"temperature":0.2,"user":"user-4711"}`
	const text = "My order #48213 arrived with a cracked screen and the replacement I was promised last week has not shipped. "
	pad := size - len(head) - len(tail)
	if pad < 0 {
		return nil, fmt.Errorf("a chat body needs at least %d bytes, asked for %d", len(head)+len(tail), size)
	}
	b := make([]byte, 0, size)
	b = append(b, head...)
	for pad > 0 {
		n := min(pad, len(text))
		b = append(b, text[:n]...)
		pad -= n
	}
	return append(b, tail...), nil
}

// ChatRequest is the benchmark's HTTP request: a streamed chat completion for tenant acme,
// feature chat, with body as its buffered body. The Request is read-only and may be shared by
// concurrent round trips.
func ChatRequest(body []byte) *envoysim.Request {
	return &envoysim.Request{
		Method: "POST",
		Path:   "/v1/chat/completions",
		Headers: envoysim.H(
			"content-type", "application/json",
			"accept", "text/event-stream",
			"authorization", "Bearer sk-bench-not-a-real-key",
			"user-agent", "OpenAI/Python 1.99.0",
			"x-llm-feature", "chat",
			"x-tenant-id", "acme",
		),
		Body: body,
	}
}

// SSEChunks is the upstream's streamed answer: two content chunks, then a final chunk with the
// usage (as OpenAI sends it with stream_options.include_usage) and the [DONE] marker.
var SSEChunks = []string{
	`data: {"id":"chatcmpl-b1","object":"chat.completion.chunk","created":1767225600,"model":"deepseek-chat","choices":[{"index":0,"delta":{"role":"assistant","content":"Sorry about the screen. "},"finish_reason":null}]}` + "\n\n",
	`data: {"id":"chatcmpl-b1","object":"chat.completion.chunk","created":1767225600,"model":"deepseek-chat","choices":[{"index":0,"delta":{"content":"I have escalated the replacement (KB-112)."},"finish_reason":"stop"}]}` + "\n\n",
	`data: {"id":"chatcmpl-b1","object":"chat.completion.chunk","created":1767225600,"model":"deepseek-chat","choices":[],"usage":{"prompt_tokens":231,"completion_tokens":17,"total_tokens":248}}` + "\n\ndata: [DONE]\n\n",
}

// StreamMessages is the number of ext_proc messages one benchmark stream sends: request
// headers, the buffered request body, response headers and one message per SSE chunk.
var StreamMessages = 3 + len(SSEChunks)

// SSEUpstream returns the in-process upstream: no HTTP, no latency, a 200 text/event-stream
// response of SSEChunks delivered one chunk per ext_proc message (lockstep), so every stream
// sends exactly StreamMessages messages to either server.
func SSEUpstream() *envoysim.StaticResponse {
	r := &envoysim.StaticResponse{
		Status:   200,
		Headers:  envoysim.H("content-type", "text/event-stream", "cache-control", "no-cache"),
		Lockstep: true,
	}
	for _, c := range SSEChunks {
		r.Chunks = append(r.Chunks, envoysim.Chunk{Data: []byte(c)})
	}
	return r
}

// HeldUpstream is an upstream that reads the request body, then holds the request until
// Release, then answers like its inner upstream: the server under test keeps every held
// request admitted and its stream open. Safe for concurrent use.
type HeldUpstream struct {
	inner   envoysim.Upstream
	arrived atomic.Int64
	release chan struct{}
	once    sync.Once
}

// NewHeldUpstream returns a HeldUpstream answering with inner once released.
func NewHeldUpstream(inner envoysim.Upstream) *HeldUpstream {
	return &HeldUpstream{inner: inner, release: make(chan struct{})}
}

// Serve implements envoysim.Upstream.
func (h *HeldUpstream) Serve(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
	if _, err := io.Copy(io.Discard, req.Body); err != nil {
		return nil, err
	}
	h.arrived.Add(1)
	select {
	case <-h.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return h.inner.Serve(ctx, req)
}

// Arrived returns how many requests reached the upstream so far.
func (h *HeldUpstream) Arrived() int64 { return h.arrived.Load() }

// Release lets every held request, and every later one, through.
func (h *HeldUpstream) Release() { h.once.Do(func() { close(h.release) }) }

// Check verifies that a round trip ran the whole benchmark path: a 200 from the upstream (not a
// local reply), every message answered in order, no protocol problem and, for llm-bulkhead
// (admitted true), the admission headers on the request that reached the upstream.
func Check(res *envoysim.Result, admitted bool) error {
	switch {
	case res.Local != envoysim.NotLocal:
		return fmt.Errorf("local reply %s (%d): %s", res.Local, res.Status, res.LocalDetails)
	case res.Reset:
		return errors.New("the client saw a reset")
	case res.Status != 200:
		return fmt.Errorf("status %d", res.Status)
	case len(res.Problems) > 0:
		return fmt.Errorf("protocol problem %s: %s", res.Problems[0].Kind, res.Problems[0].Detail)
	case res.Upstream == nil:
		return errors.New("the upstream was not called")
	}
	sent := 0
	for _, r := range res.Exchange {
		if r.Sent != nil {
			sent++
		}
	}
	if sent != StreamMessages {
		return fmt.Errorf("%d ext_proc messages sent, want %d", sent, StreamMessages)
	}
	got := res.Upstream.Headers.Get(extproc.HeaderFeature)
	switch {
	case admitted && got != "chat":
		return fmt.Errorf("upstream request has %s %q, want chat (not admitted by the policy?)", extproc.HeaderFeature, got)
	case !admitted && got != "":
		return fmt.Errorf("upstream request has %s %q from a no-op server", extproc.HeaderFeature, got)
	}
	return nil
}
