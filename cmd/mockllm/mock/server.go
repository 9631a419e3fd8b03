// Package mock is a fake LLM provider speaking the OpenAI, Anthropic, Azure
// OpenAI, Google Gemini and AWS Bedrock HTTP APIs, for demos, experiments and
// end-to-end tests of llm-bulkhead.
//
// It serves POST /v1/chat/completions, /v1/completions, /v1/embeddings,
// /v1/responses and /v1/messages (JSON and SSE) and GET /v1/models; Azure
// OpenAI's /openai/v1/{chat/completions,completions,embeddings,responses} and
// /openai/deployments/{deployment}/{chat/completions,completions,embeddings}
// (api-version required; the deployment is the model unless the body names
// one); Gemini's /v1beta/models/{model}: (or /v1/models/{model}:)
// generateContent, streamGenerateContent (server-sent events with alt=sse, a
// streamed JSON array without), countTokens and embedContent; and Bedrock's
// /model/{modelId}/converse, /converse-stream (AWS's binary event stream),
// and /invoke and /invoke-with-response-stream for Anthropic models (their
// bodies Anthropic messages; the stream's events base64 in event-stream
// chunks). Errors take each API's own shape: OpenAI's, Anthropic's, Azure's
// {"error":{"code","message"}} ("429" for rate limits), Google's
// {"error":{"code","message","status"}}, and AWS's {"message"} with the
// exception named in x-amzn-errortype (an exception message inside an event
// stream).
//
// It has a latency model (LatencyModel), a capacity that queues requests FIFO
// when the fake provider is full (fixed, Options.Capacity, or changing during
// the run, Options.CapacitySchedule), faults injected by request header, by
// rule per provider or model, or at run time (Fault, FaultRule), and
// optionally a check that each provider is sent only the models it serves
// (Options.ModelProviders; 404 model_not_found otherwise). Every API response
// carries x-mockllm-prompt-tokens, x-mockllm-completion-tokens and
// x-mockllm-request-id, so a test can compare what a client settled with what
// was reported, and x-mockllm-queue-wait, the simulated seconds it waited for
// a capacity slot. Responses always hold one choice (or candidate), whatever
// n or candidateCount asks for.
//
// Token accounting is deterministic and reported exactly:
//
//	prompt_tokens     = ceil(B / 4) + T
//	completion_tokens = x-mockllm-completion-tokens header, else
//	                    max_completion_tokens / max_tokens / max_output_tokens /
//	                    generationConfig.maxOutputTokens / inferenceConfig.maxTokens, else
//	                    Options.DefaultCompletionTokens (embeddings: 0)
//
// B is the number of UTF-8 bytes of text in the request, summed before
// rounding: message content (strings, or the "text" of content parts),
// Anthropic's system, the completions prompt, the embeddings input, the
// Responses API's instructions and input, Gemini's contents and
// systemInstruction, and Converse's messages and system. Gemini's
// countTokens answers the prompt's count and uses (reports) nothing. T is the number of token ids when a
// prompt or input is given as token arrays. The generated text is made of
// BytesPerToken-byte words, one per visible completion token (completion
// minus x-mockllm-reasoning-tokens).
//
// Admin endpoints, outside the APIs:
//
//	GET  /mockllm/requests  the most recent requests (RecordedRequest, oldest first)
//	GET  /mockllm/stats     counters and occupancy (Stats)
//	GET  /mockllm/faults    the fault rules in force: {"rules": [FaultRule...]}
//	POST /mockllm/faults    replace them (same JSON; unknown keys are errors)
//	POST /mockllm/capacity  set the whole provider's capacity now: {"capacity": N} (0: unlimited);
//	                        stops the capacity schedule
//	POST /mockllm/reset     empty the request log, zero the counters, restart the capacity schedule
//	GET  /mockllm/healthz   200 while serving
package mock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ProviderHeader is the request header naming the upstream provider; faults
// and capacities can be set per value.
const ProviderHeader = "x-llm-provider"

// Server is the fake LLM provider. It is an http.Handler; Run serves it on a
// listener. All its methods are safe for concurrent use.
type Server struct {
	opts   Options
	log    *slog.Logger
	faults atomic.Pointer[[]FaultRule]
	rec    *recorder
	pools  *pools
	sched  *scheduler // nil without a capacity schedule
	quotas *quotas
	seq    atomic.Uint64

	rngMu sync.Mutex
	rng   *rand.Rand
}

var _ http.Handler = (*Server)(nil)

// New builds a Server from opts, reporting every invalid option at once.
func New(opts Options) (*Server, error) {
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, fmt.Errorf("mockllm options: %w", err)
	}
	s := &Server{
		opts:   opts,
		log:    opts.Logger,
		rec:    newRecorder(opts.RequestLogSize, opts.MaxLoggedBodyBytes),
		pools:  newPools(opts.Capacity, opts.ProviderCapacity),
		quotas: newQuotas(opts.Quotas, opts.TimeScale),
		rng:    rand.New(rand.NewPCG(opts.Seed, 0x6d6f636b6c6c6d)),
	}
	rules := cloneRules(opts.Faults)
	s.faults.Store(&rules)
	if len(opts.CapacitySchedule) > 0 {
		s.sched = &scheduler{steps: opts.CapacitySchedule, scale: opts.TimeScale, pool: s.pools.global}
		s.sched.start()
	}
	return s, nil
}

// SetCapacity sets the whole provider's capacity from now on (0: unlimited), stopping the
// capacity schedule if there is one. Like a schedule's step, a lower capacity revokes nothing
// and a higher one lets the oldest waiters in at once.
func (s *Server) SetCapacity(n int) error {
	if n < 0 || n > maxScheduleCapacity {
		return fmt.Errorf("capacity %d must lie in [0, %d]", n, maxScheduleCapacity)
	}
	s.StopSchedule()
	s.pools.global.setLimit(n)
	return nil
}

// StopSchedule cancels the capacity changes still to come; the capacity in
// force stays. Run calls it when it returns; a Server used only as an
// http.Handler should call it when done, or its pending changes keep it
// reachable until they are due. It does nothing without a schedule.
func (s *Server) StopSchedule() {
	if s.sched != nil {
		s.sched.stop()
	}
}

// SetFaults replaces the fault rules applied to requests from now on. Rules
// are validated first; on error the rules in force stay.
func (s *Server) SetFaults(rules []FaultRule) error {
	if err := validateRules(rules); err != nil {
		return err
	}
	rules = cloneRules(rules)
	s.faults.Store(&rules)
	return nil
}

// Faults returns a copy of the fault rules in force.
func (s *Server) Faults() []FaultRule {
	return cloneRules(*s.faults.Load())
}

// Requests returns copies of the most recent requests, oldest first.
func (s *Server) Requests() []RecordedRequest {
	return s.rec.requests()
}

// Stats returns the counters and the current occupancy of the capacity pools.
func (s *Server) Stats() Stats {
	st := s.rec.stats()
	st.Global, st.Providers = s.pools.stats(s.opts.TimeScale)
	return st
}

// Reset empties the request log, zeroes the counters (queue waits included),
// starts every quota's window again with the next request and the capacity
// schedule again from its first step. Fault rules
// and requests in progress are left alone.
func (s *Server) Reset() {
	s.rec.reset()
	s.pools.resetWaits()
	s.quotas.reset()
	if s.sched != nil {
		s.sched.start()
	}
}

// Run serves s on l until ctx ends, then shuts down gracefully: it stops
// accepting, lets requests in progress finish for up to grace, and then
// closes the connections still open (which ends their requests). It returns
// nil after a clean shutdown and an error when serving failed or grace ran
// out. Run closes l.
func (s *Server) Run(ctx context.Context, l net.Listener, grace time.Duration) error {
	defer s.StopSchedule()
	hs := &http.Server{
		Handler:           s,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(l) }()
	select {
	case err := <-served:
		return fmt.Errorf("mockllm: serving %s: %w", l.Addr(), err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := hs.Shutdown(sctx)
	if err != nil {
		err = errors.Join(fmt.Errorf("mockllm: requests still running after the %v grace period were cut: %w", grace, err), hs.Close())
	}
	if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}

// ServeHTTP routes to the API endpoints and the /mockllm admin endpoints.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Path
	switch {
	case strings.HasPrefix(p, "/mockllm/"):
		s.serveAdmin(w, r)
	case p == "/v1/models":
		s.serveModels(w, r)
	default:
		if rt, ok := routeOf(r.URL); ok {
			s.serveAPI(w, r, rt)
			return
		}
		s.serveUnknown(w, r)
	}
}

// newID returns the next request id.
func (s *Server) newID() (id string, seq uint64) {
	seq = s.seq.Add(1)
	return "mock-" + strconv.FormatUint(seq, 10), seq
}

// draw takes the two random numbers every API request uses, fail roll first
// and jitter second, so the sequence does not depend on which faults apply.
func (s *Server) draw() (failRoll, jitter float64) {
	s.rngMu.Lock()
	defer s.rngMu.Unlock()
	return s.rng.Float64(), s.rng.Float64()
}

// scale applies the time scale to a simulated delay.
// now is the time of the quota windows (Options.QuotaClock).
func (s *Server) now() time.Time {
	if s.opts.QuotaClock != nil {
		return s.opts.QuotaClock()
	}
	return time.Now()
}

func (s *Server) scale(d time.Duration) time.Duration {
	return time.Duration(float64(d) * s.opts.TimeScale)
}

// exchange is one API request being answered. It belongs to the handler
// goroutine.
type exchange struct {
	s     *Server
	w     http.ResponseWriter
	r     *http.Request
	rt    route
	id    string
	entry *RecordedRequest
	usage usage
}

// setIDHeaders sets the request-id headers every response carries, using
// each API's own header as well as the mockllm one.
func (e *exchange) setIDHeaders() {
	h := e.w.Header()
	h.Set(HeaderRequestID, e.id)
	switch e.rt.dialect {
	case dialectAnthropic:
		h.Set("request-id", "req_"+e.id)
	case dialectBedrock:
		h.Set("x-amzn-requestid", "req_"+e.id)
	default:
		h.Set("x-request-id", "req_"+e.id)
	}
	e.setUsageHeaders()
}

// setUsageHeaders reports what usage says (or would say) in headers.
func (e *exchange) setUsageHeaders() {
	h := e.w.Header()
	h.Set(HeaderPromptTokens, strconv.FormatInt(e.usage.Prompt, 10))
	h.Set(HeaderCompletionTokens, strconv.FormatInt(e.usage.Completion, 10))
}

// errorBody renders an error in the called API's format. A Bedrock error names its
// exception in the x-amzn-errortype header, which it sets.
func (e *exchange) errorBody(status int, message string) ([]byte, error) {
	switch e.rt.dialect {
	case dialectAnthropic:
		return anthropicErrorBody(status, message, "req_"+e.id)
	case dialectAzure:
		return azureErrorBody(status, message)
	case dialectGemini:
		return googleErrorBody(status, message)
	case dialectBedrock:
		e.w.Header().Set("x-amzn-errortype", bedrockException(status))
		return bedrockErrorBody(message)
	}
	return openAIErrorBody(status, message)
}

// fail answers with an error in the API's format through out and records
// the outcome.
func (e *exchange) fail(out *output, status int, message, outcome string) {
	body, err := e.errorBody(status, message)
	if err != nil {
		e.s.log.Warn("encoding an error body", "id", e.id, "err", err)
		http.Error(e.w, message, status)
		e.finish(status, outcome)
		return
	}
	err = out.json(status, body)
	switch {
	case errors.Is(err, errDisconnected):
		outcome = OutcomeDisconnect
	case err != nil:
		outcome = OutcomeClientGone
	}
	e.finish(status, outcome)
}

// reject answers an invalid request with a plain (never faulted) error.
func (e *exchange) reject(status int, message string) {
	e.fail(newOutput(e.w, false, 0), status, message, OutcomeRejected)
}

// finish records the outcome and logs the request.
func (e *exchange) finish(status int, outcome string) {
	e.s.rec.finished(e.entry, status, outcome, e.usage)
	e.s.log.Debug("request", "id", e.id, "path", e.r.URL.Path, "provider", e.entry.Provider,
		"model", e.entry.Model, "status", status, "outcome", outcome,
		"prompt_tokens", e.usage.Prompt, "completion_tokens", e.usage.Completion)
}

// serveAPI answers one call to an API endpoint.
func (s *Server) serveAPI(w http.ResponseWriter, r *http.Request, rt route) {
	id, seq := s.newID()
	a := rt.api
	body, readErr := io.ReadAll(http.MaxBytesReader(w, r.Body, s.opts.MaxRequestBodyBytes))
	e := &exchange{s: s, w: w, r: r, rt: rt, id: id, entry: s.rec.received(id, r, rt.label, body)}
	e.setIDHeaders()

	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		e.reject(http.StatusMethodNotAllowed, fmt.Sprintf("Method %s is not allowed for %s; use POST.", r.Method, r.URL.Path))
		return
	}
	if readErr != nil {
		if mbe := (*http.MaxBytesError)(nil); errors.As(readErr, &mbe) {
			e.reject(http.StatusRequestEntityTooLarge, fmt.Sprintf("Request body exceeds %d bytes.", mbe.Limit))
			return
		}
		e.finish(0, OutcomeClientGone)
		return
	}
	if missingAPIVersion(rt, r) {
		e.reject(http.StatusNotFound, "Resource not found: an Azure OpenAI deployment path needs the api-version query parameter.")
		return
	}
	p, err := parseRequest(rt, body)
	s.rec.parsed(e.entry, p.Model, p.Stream)
	if err != nil {
		e.reject(http.StatusBadRequest, err.Error())
		return
	}
	overrides, err := parseTokenHeaders(r.Header)
	if err != nil {
		e.reject(http.StatusBadRequest, err.Error())
		return
	}
	if e.usage, err = computeUsage(a, p, overrides, s.opts.DefaultCompletionTokens); err != nil {
		e.usage = usage{}
		e.reject(http.StatusBadRequest, err.Error())
		return
	}
	provider := r.Header.Get(ProviderHeader)
	if wrongProvider(s.opts.ModelProviders, provider, p.Model) {
		e.rejectModel(p.Model)
		return
	}
	f, err := applyFaultHeaders(mergeRules(*s.faults.Load(), provider, p.Model), r.Header)
	if err != nil {
		e.reject(http.StatusBadRequest, err.Error())
		return
	}
	e.setUsageHeaders()
	failRoll, jitter := s.draw()
	if f.RetryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(f.RetryAfter))
	}
	out := newOutput(w, f.Gzip && acceptsGzip(r.Header.Values("Accept-Encoding")), f.DisconnectAfter)
	ctx := r.Context()
	delay := s.scale(time.Duration(f.DelayHeaders))

	now := s.now()
	var account string
	if s.opts.QuotaAccountHeader != "" {
		account = r.Header.Get(s.opts.QuotaAccountHeader)
	}
	if has, ok, left := s.quotas.take(provider, account, e.usage.Prompt+e.usage.Completion, now); has {
		// The reset is in real time: it is when the quota really refills.
		e.setQuotaHeaders(left, now, r.Header.Get(HeaderRateLimitMalformed) == "true")
		if !ok {
			e.quotaRefusal(out, left.reset)
			return
		}
	}
	if status := f.failStatus(failRoll); status != 0 {
		// A failing provider answers fast and without queueing, as real
		// overloaded providers do; only an injected header delay applies.
		if err := sleepUntil(ctx, time.Now().Add(delay)); err != nil {
			e.finish(0, OutcomeClientGone)
			return
		}
		e.fail(out, status, defaultErrorMessage(status), OutcomeFault)
		return
	}

	release, wait, err := s.pools.acquire(ctx, provider)
	if err != nil {
		e.finish(0, OutcomeClientGone)
		return
	}
	defer release()
	w.Header().Set(HeaderQueueWait, strconv.FormatFloat(wait.Seconds()/s.opts.TimeScale, 'f', 3, 64))

	resp := &response{
		objectID: "mock" + strconv.FormatUint(seq, 10), model: p.Model, created: time.Now().Unix(),
		usage: e.usage, reported: f.report(e.usage), withUsage: !f.NoUsage, includeUsage: p.IncludeUsage, parsed: p,
		dims: s.opts.EmbeddingDimensions,
	}
	start := time.Now().Add(delay)
	latency := s.scale(s.opts.Latency.Latency(e.usage.total(), jitter))
	resp.latencyMs = latency.Milliseconds()
	t := timing{start: start, latency: latency, firstToken: s.scale(time.Duration(f.FirstTokenDelay)), decode: 1}
	if d := s.opts.Latency.DecodeSlowdown; d > 0 {
		t.decode = 1 + d*float64(max(s.pools.global.stats(1).InFlight-1, 0))
	}
	var errEv *sseEvent
	if f.StreamError != 0 {
		msg := defaultErrorMessage(f.StreamError)
		ev, err := streamErrorEvent(rt, f.StreamError, msg)
		if err == nil && !p.Stream {
			ev.data, err = e.errorBody(f.StreamError, msg)
		}
		if err != nil {
			e.s.log.Warn("encoding a stream error", "id", e.id, "err", err)
			e.finish(0, OutcomeClientGone)
			return
		}
		errEv = &ev
	}
	if p.Stream {
		switch {
		case a == apiConverseStream || a == apiInvokeStream:
			out.setFraming(framingAWS)
		case a == apiGeminiStream && !rt.sse:
			out.setFraming(framingArray)
		}
		err = s.stream(ctx, out, streamRendererFor(a, resp), e.usage, t, errEv)
	} else {
		err = s.whole(ctx, out, bodyRendererFor(a, resp), t, errEv)
	}
	switch {
	case err == nil && errEv != nil:
		e.finish(out.status, OutcomeFault)
	case err == nil:
		e.finish(out.status, OutcomeOK)
	case errors.Is(err, errDisconnected):
		e.finish(out.status, OutcomeDisconnect)
	default:
		e.finish(out.status, OutcomeClientGone)
	}
}

// bodyRendererFor returns the JSON renderer of endpoint a.
func bodyRendererFor(a api, r *response) bodyRenderer {
	switch a {
	case apiChat:
		return chatRenderer{r}
	case apiCompletions:
		return completionsRenderer{r}
	case apiEmbeddings:
		return embeddingsRenderer{r}
	case apiResponses:
		return &responsesRenderer{r: r}
	case apiGeminiGenerate, apiGeminiStream:
		return &geminiRenderer{r: r}
	case apiGeminiCountTokens:
		return geminiCountRenderer{r}
	case apiGeminiEmbed:
		return geminiEmbedRenderer{r}
	case apiConverse, apiConverseStream:
		return converseRenderer{r}
	default:
		return messagesRenderer{r}
	}
}

// streamRendererFor returns the stream renderer of endpoint a; embeddings
// and token counts never stream (parseRequest leaves their stream flag
// clear).
func streamRendererFor(a api, r *response) streamRenderer {
	switch a {
	case apiChat:
		return chatRenderer{r}
	case apiCompletions:
		return completionsRenderer{r}
	case apiResponses:
		return &responsesRenderer{r: r}
	case apiGeminiGenerate, apiGeminiStream:
		return &geminiRenderer{r: r}
	case apiConverse, apiConverseStream:
		return converseRenderer{r}
	case apiInvokeStream:
		return invokeStreamRenderer{messagesRenderer{r}}
	default:
		return messagesRenderer{r}
	}
}

// timing is when one response's parts are due.
type timing struct {
	start   time.Time     // the latency model's origin (after any header delay)
	latency time.Duration // the latency model's whole response
	// firstToken holds the first token back on top of the latency, with the
	// headers sent at once (first-token-delay).
	firstToken time.Duration
	// decode stretches the time after the first byte (LatencyModel.DecodeSlowdown); 1 leaves
	// it alone.
	decode float64
}

// end is when the response is complete: the first byte at ttfb of the latency, the rest of
// the latency stretched by the decode factor, plus any first-token delay.
func (t timing) end(ttfb time.Duration) time.Duration {
	return ttfb + t.firstToken + time.Duration(float64(t.latency-ttfb)*t.decodeFactor())
}

func (t timing) decodeFactor() float64 {
	if t.decode <= 0 {
		return 1
	}
	return t.decode
}

// whole answers with one JSON body once the whole latency has passed (its
// part after the first byte stretched by the decode factor), as a
// non-streaming provider does. Under a first-token delay the headers leave
// at once and the body after the latency plus the delay. errEv, when set,
// holds an error body sent instead, with status 200.
func (s *Server) whole(ctx context.Context, out *output, rend bodyRenderer, t timing, errEv *sseEvent) error {
	var body []byte
	var err error
	if errEv != nil {
		body = errEv.data
	} else if body, err = rend.body(); err != nil {
		return fmt.Errorf("encoding the response: %w", err)
	}
	if t.firstToken > 0 {
		if err := sleepUntil(ctx, t.start); err != nil {
			return err
		}
		out.start(http.StatusOK, contentTypeJSON, len(body))
		if err := out.flush(); err != nil {
			return err
		}
	}
	ttfb := time.Duration(float64(t.latency) * s.opts.Latency.TTFBFraction)
	if err := sleepUntil(ctx, t.start.Add(t.end(ttfb))); err != nil {
		return err
	}
	if t.firstToken > 0 {
		return out.body(body)
	}
	return out.json(http.StatusOK, body)
}

// streamErrorEvent renders the event a provider sends inside a 200 stream
// to report an error of status: Anthropic's and the Responses API's error
// events, an OpenAI (or Azure, or Google) error object as a data-only event
// (a JSON array's element for Gemini), and an exception message in Bedrock's
// event stream.
func streamErrorEvent(rt route, status int, message string) (sseEvent, error) {
	a := rt.api
	switch {
	case a == apiConverseStream || a == apiInvokeStream:
		b, err := bedrockErrorBody(message)
		return sseEvent{name: bedrockStreamException(status), data: b, exception: true}, err
	case rt.dialect == dialectGemini:
		b, err := googleErrorBody(status, message)
		return sseEvent{data: b}, err
	case rt.dialect == dialectAzure && a != apiResponses:
		b, err := azureErrorBody(status, message)
		return sseEvent{data: b}, err
	case a.anthropic():
		b, err := json.Marshal(anthropicError{Type: "error", Error: anthropicErrorDetail{Type: anthropicErrorType(status), Message: message}})
		return sseEvent{name: "error", data: b}, err
	case a == apiResponses:
		code := "server_error"
		switch {
		case status == http.StatusTooManyRequests:
			code = "rate_limit_exceeded"
		case status < 500:
			code = "invalid_request_error"
		}
		b, err := json.Marshal(struct {
			Type    string  `json:"type"`
			Code    string  `json:"code"`
			Message string  `json:"message"`
			Param   *string `json:"param"`
		}{Type: "error", Code: code, Message: message})
		return sseEvent{name: "error", data: b}, err
	}
	b, err := openAIErrorBody(status, message)
	return sseEvent{data: b}, err
}

// stream answers with SSE: headers and the preamble at TTFBFraction of the
// latency, content events evenly spread until the full latency (its part
// after the first byte stretched by the decode factor), then the trailer
// events at once. A first-token delay moves the content events and
// the trailer that much later. errEv, when set, is sent after the first
// content event (or the preamble, without content) and ends the stream.
func (s *Server) stream(ctx context.Context, out *output, rend streamRenderer, u usage, t timing, errEv *sseEvent) error {
	start, latency := t.start, t.latency
	ttfb := time.Duration(float64(latency) * s.opts.Latency.TTFBFraction)
	pre, err := rend.preamble()
	if err != nil {
		return fmt.Errorf("encoding the stream: %w", err)
	}
	if err := sleepUntil(ctx, start.Add(ttfb)); err != nil {
		return err
	}
	out.start(http.StatusOK, out.streamContentType(), -1)
	if err := out.flush(); err != nil {
		return err
	}
	for _, ev := range pre {
		if err := out.event(ev, false); err != nil {
			return err
		}
	}
	visible := u.visible()
	n := chunkCount(visible, s.opts.ChunkTokens)
	rest := float64(latency-ttfb) * t.decodeFactor()
	for i := range n {
		at := ttfb + t.firstToken + time.Duration(rest*float64(i+1)/float64(n))
		if err := sleepUntil(ctx, start.Add(at)); err != nil {
			return err
		}
		ev, err := rend.delta(chunkText(i, visible, s.opts.ChunkTokens))
		if err != nil {
			return fmt.Errorf("encoding the stream: %w", err)
		}
		if err := out.event(ev, false); err != nil {
			return err
		}
		if errEv != nil {
			break
		}
	}
	if errEv != nil {
		if err := sleepUntil(ctx, start.Add(ttfb+t.firstToken)); err != nil {
			return err
		}
		if err := out.event(*errEv, false); err != nil {
			return err
		}
		return out.endStream()
	}
	if err := sleepUntil(ctx, start.Add(t.end(ttfb))); err != nil {
		return err
	}
	tr, err := rend.trailer()
	if err != nil {
		return fmt.Errorf("encoding the stream: %w", err)
	}
	for i, ev := range tr {
		if err := out.event(ev, i == len(tr)-1); err != nil {
			return err
		}
	}
	return out.endStream()
}

// serveModels answers GET /v1/models.
func (s *Server) serveModels(w http.ResponseWriter, r *http.Request) {
	id, _ := s.newID()
	e := &exchange{s: s, w: w, r: r, rt: route{api: apiChat}, id: id, entry: s.rec.received(id, r, r.URL.Path, nil)}
	e.setIDHeaders()
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		e.reject(http.StatusMethodNotAllowed, fmt.Sprintf("Method %s is not allowed for %s; use GET.", r.Method, r.URL.Path))
		return
	}
	body, err := modelsBody()
	if err != nil {
		e.reject(http.StatusInternalServerError, "encoding the model list failed")
		return
	}
	outcome := OutcomeOK
	if err := newOutput(w, false, 0).json(http.StatusOK, body); err != nil {
		outcome = OutcomeClientGone
	}
	e.finish(http.StatusOK, outcome)
}

// serveUnknown answers any other path the way the OpenAI API does.
func (s *Server) serveUnknown(w http.ResponseWriter, r *http.Request) {
	id, _ := s.newID()
	e := &exchange{s: s, w: w, r: r, rt: route{api: apiChat}, id: id, entry: s.rec.received(id, r, overflowLabel, nil)}
	e.setIDHeaders()
	e.reject(http.StatusNotFound, fmt.Sprintf("Invalid URL (%s %s)", r.Method, r.URL.Path))
}

// faultsDoc is the JSON shape of GET and POST /mockllm/faults.
type faultsDoc struct {
	Rules []FaultRule `json:"rules"`
}

// serveAdmin answers the /mockllm endpoints.
func (s *Server) serveAdmin(w http.ResponseWriter, r *http.Request) {
	route := r.Method + " " + r.URL.Path
	switch route {
	case "GET /mockllm/requests":
		writeAdminJSON(w, http.StatusOK, s.Requests())
	case "GET /mockllm/stats":
		writeAdminJSON(w, http.StatusOK, s.Stats())
	case "GET /mockllm/faults":
		writeAdminJSON(w, http.StatusOK, faultsDoc{Rules: s.Faults()})
	case "POST /mockllm/faults":
		var doc faultsDoc
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&doc); err != nil {
			writeAdminJSON(w, http.StatusBadRequest, adminError{Error: "fault rules: " + err.Error()})
			return
		}
		if dec.More() {
			writeAdminJSON(w, http.StatusBadRequest, adminError{Error: "fault rules: trailing data after the JSON object"})
			return
		}
		if err := s.SetFaults(doc.Rules); err != nil {
			writeAdminJSON(w, http.StatusBadRequest, adminError{Error: err.Error()})
			return
		}
		writeAdminJSON(w, http.StatusOK, faultsDoc{Rules: s.Faults()})
	case "POST /mockllm/capacity":
		var doc struct {
			Capacity *int `json:"capacity"`
		}
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<10))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&doc); err != nil || doc.Capacity == nil || dec.More() {
			writeAdminJSON(w, http.StatusBadRequest, adminError{Error: `capacity: want {"capacity": N}`})
			return
		}
		if err := s.SetCapacity(*doc.Capacity); err != nil {
			writeAdminJSON(w, http.StatusBadRequest, adminError{Error: err.Error()})
			return
		}
		writeAdminJSON(w, http.StatusOK, s.Stats().Global)
	case "POST /mockllm/reset":
		s.Reset()
		w.WriteHeader(http.StatusNoContent)
	case "GET /mockllm/healthz":
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, "ok\n")
	default:
		switch r.URL.Path {
		case "/mockllm/requests", "/mockllm/stats", "/mockllm/faults", "/mockllm/capacity", "/mockllm/reset", "/mockllm/healthz":
			writeAdminJSON(w, http.StatusMethodNotAllowed, adminError{Error: "method " + r.Method + " not allowed on " + r.URL.Path})
		default:
			writeAdminJSON(w, http.StatusNotFound, adminError{Error: "no admin endpoint " + r.URL.Path})
		}
	}
}

// adminError is the body of a failed admin call.
type adminError struct {
	Error string `json:"error"`
}

// writeAdminJSON writes v as an admin response.
func writeAdminJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", contentTypeJSON)
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}
