package extproc

import (
	"context"
	"errors"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// attributesKey is where Envoy puts request and response attributes.
const attributesKey = "envoy.filters.http.ext_proc"

// scanners recycles usage scanners between streams.
var scanners = sync.Pool{New: func() any { return new(llmapi.UsageScanner) }}

// end says how a stream ended.
type end uint8

const (
	endReset end = iota + 1
	endHalfClosed
	endError
	endSendFailed
)

type bodyMode = extprocfilterv3.ProcessingMode_BodySendMode

// phase is where a stream's request stands. It only moves forward.
type phase uint8

const (
	// phaseNew: nothing received yet.
	phaseNew phase = iota
	// phaseRequest: request headers received, no decision yet (waiting for the buffered body).
	phaseRequest
	// phaseAdmitted: admitted; the request is upstream and its ticket holds slots.
	phaseAdmitted
	// phaseResponding: the response headers came; body chunks may follow.
	phaseResponding
	// phaseDone: refused, or settled and released: nothing is held any more.
	phaseDone
	// phasePassthrough: not judged (the stream did not start with request headers, a message
	// could not be handled, or the admission was released while the stream was silent); every
	// message continues untouched.
	phasePassthrough
)

// requestPart is what the request said.
type requestPart struct {
	id   string
	path string
	api  llmapi.API
	// route is what the path says: the API, the dialect of refusals, the model it names.
	route    llmapi.Route
	metadata *corev3.Metadata
	attrs    *structpb.Struct
	// body is the buffered request body until the decision is made.
	body   []byte
	bodyOK bool
	fields llmapi.RequestFields
	// heldBody is how many bytes of Server.buffered this stream's body accounts for, until the
	// reply that may carry it is handed to gRPC; hold has them after, when that reply carries it.
	heldBody int64
	hold     *bodyHold
}

// decisionPart is what the policy decided and what the admitted request holds.
type decisionPart struct {
	decision policy.Decision
	// compartments joins the ticket's compartment names, computed once at admission.
	compartments string
	estimate     policy.Estimate
	ticket       policy.Ticket
	admittedAt   time.Time
}

// responsePart is what the response showed and how the request was settled.
type responsePart struct {
	// started: the response headers came (the request reached the provider and it answered).
	started bool
	status  int
	// headers is admission to the response headers.
	headers time.Duration
	// firstToken is admission to the arrival of the body chunk that carried the first token;
	// tokenSeen says it came. chunkAt is when the chunk still to be scanned (pending) arrived.
	firstToken time.Duration
	tokenSeen  bool
	chunkAt    time.Time
	// contentBytes is the generated text scanned so far and lastContentAt the arrival of the
	// chunk that last added to it; contentChunks counts the chunks after the first token's that
	// added to it. With firstToken they time the tokens of a stream.
	contentBytes  int64
	lastContentAt time.Time
	contentChunks int
	retryAfter    time.Duration
	// reading: the response body is scanned for usage.
	reading bool
	// scanner is taken from scanners when the response is read, so streams that never reach
	// a response (refused, queued, held) do not carry its 2.5 KiB.
	scanner *llmapi.UsageScanner
	pending []byte // a response chunk to scan after its reply went out
	outcome policy.Outcome
	settled policy.Settled
}

// processor owns one stream's request: what Envoy said, what the policy decided and what the
// request holds. It is used only by its stream's goroutine, so it needs no locks — except idle,
// whose timer may release the ticket from another goroutine.
type processor struct {
	srv    *Server
	stream extprocv3.ExternalProcessor_ProcessServer
	ctx    context.Context
	snap   *policy.Snapshot

	phase       phase
	reqBodyMode bodyMode
	resBodyMode bodyMode
	// headers are the current message's headers (the request's, then the response's).
	headers []*corev3.HeaderValue
	// seen has a bit per message kind received, to tell a message out of Envoy's order.
	seen uint8
	// overrideFor is the message count at which a message-timeout override was last sent:
	// Envoy honours one override per state.
	overrideFor int
	messages    int
	// now is when the message being handled arrived (the engine's clock, read once per
	// message); zero outside handle. See clock.
	now time.Time

	req requestPart
	dec decisionPart
	res responsePart

	// onQueueFn is p.onQueue bound once, so admission does not allocate a method value.
	onQueueFn func(time.Duration)
	// trace is the request's span, nil unless tracing is on and the request is sampled.
	trace *requestTrace

	idle idleWatch

	// out is the memory of the admitted request's replies.
	out replyMem
}

// decided reports whether the policy has decided on the request (whatever it decided).
func (p *processor) decided() bool {
	return p.phase >= phaseAdmitted && p.phase <= phaseDone
}

// processors recycles processors between streams: a processor is a few KiB, and a server
// takes thousands of streams a second.
var processors = sync.Pool{New: func() any {
	p := new(processor)
	p.onQueueFn = p.onQueue
	return p
}}

// newProcessor returns a processor for stream; recycle gives it back when the stream is over.
func newProcessor(s *Server, stream extprocv3.ExternalProcessor_ProcessServer) *processor {
	p := processors.Get().(*processor)
	p.srv, p.stream, p.ctx, p.overrideFor = s, stream, stream.Context(), -1
	return p
}

// recycle clears p and gives it to the next stream. Only the stream's goroutine may call it,
// after finish: by then nothing else refers to p (the idle reaper let go of it in stopIdle,
// admission does not keep the ticket, and every reply was marshalled by Send).
func (p *processor) recycle() {
	p.clear()
	processors.Put(p)
}

// clear forgets everything of the stream but the bound onQueue and the metadata buffer's array.
func (p *processor) clear() {
	q, meta := p.onQueueFn, p.out.meta[:0]
	*p = processor{onQueueFn: q}
	p.out.meta = meta
}

var _ policy.Input = (*processor)(nil)

// messageKind returns the message's kind (msgRequestHeaders…), or -1 for a message that holds
// none of them.
func messageKind(req *extprocv3.ProcessingRequest) int {
	switch req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return msgRequestHeaders
	case *extprocv3.ProcessingRequest_RequestBody:
		return msgRequestBody
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return msgRequestTrailers
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return msgResponseHeaders
	case *extprocv3.ProcessingRequest_ResponseBody:
		return msgResponseBody
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return msgResponseTrailers
	}
	return -1
}

// responseKinds has the bits of seen for the response's messages.
const responseKinds = 1<<msgResponseHeaders | 1<<msgResponseBody | 1<<msgResponseTrailers

// checkOrder returns an INVALID_ARGUMENT error when req is a message Envoy never sends at this
// point of a stream, after releasing what the request holds. Envoy sends request headers, body
// chunks, trailers, then the same for the response; only body chunks repeat. A stream may
// start anywhere in that order (a mode may skip messages) and run to its end.
func (p *processor) checkOrder(req *extprocv3.ProcessingRequest) error {
	k := messageKind(req)
	if k < 0 {
		return p.violation(violUnknownMessage, "a message with no request or response part")
	}
	bit := uint8(1) << k
	seen := p.seen
	p.seen |= bit
	repeated := seen&bit != 0 && k != msgRequestBody && k != msgResponseBody
	switch {
	case k <= msgRequestTrailers && seen&responseKinds != 0:
		return p.violation(violRequestAfterResponse, msgNames[k]+" after the response began")
	case repeated && k == msgRequestHeaders:
		return p.violation(violRepeatedRequestHeaders, "request_headers twice")
	case repeated && k == msgResponseHeaders:
		return p.violation(violRepeatedResponseHeaders, "response_headers twice")
	case repeated:
		return p.violation(violRepeatedTrailers, msgNames[k]+" twice")
	case seen>>(k+1) != 0:
		return p.violation(violOutOfOrder, msgNames[k]+" after "+msgNames[bitsLen(seen)-1])
	}
	return nil
}

// bitsLen is the position of the highest set bit plus one.
func bitsLen(b uint8) int {
	n := 0
	for ; b != 0; b >>= 1 {
		n++
	}
	return n
}

// violation ends the stream for a message out of Envoy's order: it counts it, releases what the
// request holds as a cancel (whatever happened upstream, this stream will not say) and returns
// the status the stream ends with.
func (p *processor) violation(kind int, what string) error {
	p.srv.metrics.protocolErrors[kind].Inc()
	if p.dec.ticket.Admitted() {
		p.settleOnce(true)
	}
	p.srv.log.Debug("ext_proc protocol violation; ending the stream", "request_id", p.req.id, "kind", violNames[kind], "what", what)
	return status.Errorf(codes.InvalidArgument, "ext_proc protocol violation (%s): received %s", violNames[kind], what)
}

// handle answers one message. It returns nil only when a request was abandoned while queued
// (the stream is gone and there is nobody to answer).
func (p *processor) handle(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	p.messages++
	if p.phase == phaseNew {
		p.modes(req.ProtocolConfig)
		if _, ok := req.Request.(*extprocv3.ProcessingRequest_RequestHeaders); !ok {
			// Not a request we can judge (Envoy sends request headers first unless their mode is
			// SKIP): let the whole stream through.
			p.phase = phasePassthrough
			p.srv.metrics.passthrough.Inc()
			return passthroughReply(req)
		}
		p.phase = phaseRequest
	}
	// The one clock reading of the message: its arrival, for admission, the response's timings
	// and settlement alike.
	start := p.srv.engine.Now()
	p.now = start
	p.out.begin()
	var resp *extprocv3.ProcessingResponse
	var kind int
	switch v := req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		kind = msgRequestHeaders
		resp = p.onRequestHeaders(req, v.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		kind = msgRequestBody
		resp = p.onRequestBody(v.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		kind = msgRequestTrailers
		resp = passthroughReply(req)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		kind = msgResponseHeaders
		resp = p.onResponseHeaders(v.ResponseHeaders)
	case *extprocv3.ProcessingRequest_ResponseBody:
		kind = msgResponseBody
		resp = p.onResponseBody(v.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		kind = msgResponseTrailers
		p.complete()
		resp = p.withMetadata(&extprocv3.ProcessingResponse{
			Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}},
		})
	default:
		p.now = time.Time{}
		return passthroughReply(req)
	}
	p.now = time.Time{}
	p.srv.metrics.observe(kind, p.srv.since(start))
	return resp
}

// clock returns the time to use now: the arrival of the message being handled, or, outside
// handle (the stream's end), a fresh reading of the engine's clock.
func (p *processor) clock() time.Time {
	if !p.now.IsZero() {
		return p.now
	}
	return p.srv.engine.Now()
}

// modes records the body modes Envoy uses, from protocol_config (sent on the first message
// since Envoy 1.30), else from the policy's declaration of the filter.
func (p *processor) modes(pc *extprocv3.ProtocolConfiguration) {
	if pc != nil {
		p.reqBodyMode, p.resBodyMode = pc.RequestBodyMode, pc.ResponseBodyMode
		return
	}
	st := p.srv.engine.Snapshot().Settings()
	p.reqBodyMode = envoyBodyMode(st.RequestBodyMode)
	p.resBodyMode = envoyBodyMode(st.ResponseBodyMode)
}

// envoyBodyMode is Envoy's name for a policy body mode.
func envoyBodyMode(m policy.BodyMode) bodyMode {
	switch m {
	case policy.BodyStreamed:
		return extprocfilterv3.ProcessingMode_STREAMED
	case policy.BodyBuffered:
		return extprocfilterv3.ProcessingMode_BUFFERED
	case policy.BodyBufferedPartial:
		return extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL
	}
	return extprocfilterv3.ProcessingMode_NONE
}

func (p *processor) onRequestHeaders(req *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) *extprocv3.ProcessingResponse {
	p.snap = p.srv.engine.Snapshot()
	p.headers = h.GetHeaders().GetHeaders()
	path, _ := p.Header(":path")
	p.req.route = llmapi.ParsePath(path)
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	p.req.path = path
	p.req.api = p.req.route.API
	p.req.id, _ = p.Header(HeaderRequestID)
	p.req.metadata = req.MetadataContext
	p.req.attrs = req.Attributes[attributesKey]
	p.traceStart()

	bodyComing := !h.EndOfStream && p.reqBodyMode != extprocfilterv3.ProcessingMode_NONE
	if bodyComing && p.reqBodyMode == extprocfilterv3.ProcessingMode_BUFFERED && p.wantBody() {
		// Decide when the whole body is here: it tells model, size and stream.
		return continueRequestHeaders
	}
	if h.EndOfStream && p.requiresValidJSON() && (p.method() == "POST" || p.method() == "PUT" || p.method() == "PATCH") {
		// An LLM call without a body on a route that requires a JSON one.
		return p.refuse(&policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonBadRequest})
	}
	resp := p.decide(msgRequestHeaders)
	if resp == nil {
		return resp
	}
	if bodyComing && p.snap.Settings().AllowModeOverride && p.reqBodyMode == extprocfilterv3.ProcessingMode_BUFFERED {
		// Decided without the body: tell Envoy not to buffer and send it. Both body modes must be
		// given, or Envoy would take the response body mode as NONE.
		resp.ModeOverride = p.override(extprocfilterv3.ProcessingMode_NONE, p.resBodyMode)
		p.reqBodyMode = extprocfilterv3.ProcessingMode_NONE
	}
	return resp
}

// override is a mode_override with both body modes given (Envoy applies body modes as they
// are, so leaving one out would turn it to NONE) and header and trailer modes left at DEFAULT,
// which keeps what the filter is configured with.
func (p *processor) override(req, res bodyMode) *extprocfilterv3.ProcessingMode {
	return &extprocfilterv3.ProcessingMode{RequestBodyMode: req, ResponseBodyMode: res}
}

// wantBody reports whether deciding needs the request body.
func (p *processor) wantBody() bool {
	s := p.snap
	if p.req.api.Multipart() {
		// An audio upload is multipart/form-data, up to 25 MB: nothing in it is read (no rule
		// reads a form field), so it is never buffered; its size comes from content-length.
		return false
	}
	if s.NeedsBodyForRules || s.TokenLimits || s.SpendLimits || s.RewritesModels {
		// RewritesModels: a re-route may have to rewrite the body's model, which only a reply to
		// the buffered body can do.
		return true
	}
	if s.Settings().InjectIncludeUsage && p.req.api.IncludeUsage() {
		return true
	}
	return p.requiresValidJSON()
}

func (p *processor) requiresValidJSON() bool {
	if p.req.api.Multipart() {
		return false // an audio upload is multipart/form-data, never JSON
	}
	for _, prefix := range p.snap.Settings().RequireValidJSON {
		if strings.HasPrefix(p.req.path, prefix) {
			return true
		}
	}
	return false
}

func (p *processor) onRequestBody(b *extprocv3.HttpBody) *extprocv3.ProcessingResponse {
	if p.phase != phaseRequest || p.reqBodyMode != extprocfilterv3.ProcessingMode_BUFFERED {
		return continueRequestBody
	}
	if !p.holdBody(len(b.Body)) {
		p.srv.metrics.bodiesRefused.Inc()
		return p.refuse(&policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonServerBusy, RetryAfter: time.Second})
	}
	p.req.body = b.Body
	resp := p.decide(msgRequestBody)
	// Classification, the estimate and the body rewrite are done: nothing reads the body again.
	// Its bytes stay counted until the reply, which may carry them, is handed to gRPC.
	p.req.body = nil
	return resp
}

// holdBody accounts n bytes of request body against server.max_buffered_body_bytes, or reports
// that holding them would pass it. Envoy has already sent the body, but a refused one is dropped
// at once instead of waiting, perhaps for seconds in a queue, with the others.
func (p *processor) holdBody(n int) bool {
	limit := p.snap.Settings().MaxBufferedBodyBytes
	if limit <= 0 {
		return true
	}
	if p.srv.buffered.Add(int64(n)) > limit {
		p.srv.buffered.Add(-int64(n))
		return false
	}
	p.req.heldBody = int64(n)
	return true
}

// dropBody lets go of the request body and gives back the bytes it accounted for, unless a
// reply carries them (see holdReplyBody).
func (p *processor) dropBody() {
	p.req.body = nil
	if p.req.heldBody != 0 {
		p.srv.buffered.Add(-p.req.heldBody)
		p.req.heldBody = 0
	}
}

// holdReplyBody moves the body's bytes to a bodyHold when the reply carries body, the rewritten
// request body, large enough for gRPC to send it from where it is: they then stay counted until
// gRPC has written them.
func (p *processor) holdReplyBody(body []byte) {
	if p.req.heldBody == 0 || len(body) < shareBodyFrom {
		return
	}
	h := &bodyHold{srv: p.srv, key: uintptr(unsafe.Pointer(unsafe.SliceData(body))), listed: true}
	h.n.Store(p.req.heldBody)
	p.req.heldBody, p.req.hold = 0, h
	bodyHolds.Store(h.key, h)
}

// replySent ends the body hold's wait for the codec, while the reply still holds the body (so
// that the key still names it): a reply not marshalled (Send failed before) gives its bytes
// back now. The hold stays with the stream, which gives the bytes back at its end at the latest.
func (p *processor) replySent() {
	if h := p.req.hold; h != nil && h.listed {
		h.listed = false
		if _, waiting := bodyHolds.LoadAndDelete(h.key); waiting {
			h.release()
		}
	}
}

// releaseHold gives back the bytes of the body hold, if gRPC has not yet (the stream is over).
func (p *processor) releaseHold() {
	if h := p.req.hold; h != nil {
		p.replySent()
		h.release()
		p.req.hold = nil
	}
}

// decide classifies, estimates and admits the request, answering in the type of the message it
// decides at (msgRequestHeaders or msgRequestBody).
func (p *processor) decide(at int) *extprocv3.ProcessingResponse {
	s, e := p.snap, p.srv.engine
	noOutput := p.req.api.NoOutput()
	size := policy.RequestSize{N: 1, NoOutput: noOutput}
	if p.req.api.Multipart() {
		// One audio file, its estimate the policy's audio_tokens; the longest audio its size can
		// hold is reserved at a price per second.
		n, _ := p.Header("content-length")
		bytes, err := strconv.ParseInt(strings.TrimSpace(n), 10, 64)
		if err != nil || bytes < 0 {
			bytes = 0
		}
		size = policy.RequestSize{Scanned: true, BodyBytes: bytes, Audio: 1, N: 1, AudioMillis: llmapi.UploadAudioMillis(bytes)}
	}
	if at == msgRequestBody && !p.req.api.Multipart() {
		err := llmapi.ScanRequest(p.req.api, p.req.body, &p.req.fields)
		switch {
		case err == nil:
			p.req.bodyOK = true
		case errors.Is(err, llmapi.ErrInvalidJSON):
			e.ClassifyError("invalid_json")
			p.srv.log.Debug("request body is not a JSON object; classifying from headers and defaults", "request_id", p.req.id, "bytes", len(p.req.body))
			if p.requiresValidJSON() {
				return p.refuse(&policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonBadRequest})
			}
		default:
			// A known field has the wrong type or value: the rest of the body is still usable.
			p.req.bodyOK = true
			reason := "field_value"
			if errors.Is(err, llmapi.ErrFieldType) {
				reason = "field_type"
			}
			e.ClassifyError(reason)
			p.srv.log.Debug("request body field has a wrong type or value", "request_id", p.req.id, "err", err.Error())
		}
		if p.req.bodyOK && p.req.api != llmapi.APIGeminiCountTokens {
			// (Counting tokens is free: such a request is admitted as a request, its body is
			// not an estimate.)
			f := &p.req.fields
			size = policy.RequestSize{Scanned: true, BodyBytes: int64(len(p.req.body)), PromptBytes: f.PromptBytes, Images: f.Images, Audio: f.Audio,
				Files: f.Files, MaxTokens: f.MaxTokens, HasMaxTokens: f.HasMaxTokens, N: f.Choices, Prompts: f.Prompts, NoOutput: noOutput}
			if p.req.api == llmapi.APIOpenAIImages {
				size.OutputImages = f.Choices // n images, each priced per_image
			}
		}
	}
	dims := s.Classify(p)
	p.dec.estimate = s.Estimate(dims.Model, size)
	// A model the path names cannot be rewritten in the body.
	canRewrite := at == msgRequestBody && p.req.bodyOK && p.req.route.Model == "" && !p.req.api.Multipart()
	r := policy.Request{Dims: dims, Estimate: p.dec.estimate, PromptBytes: size.PromptBytes,
		CanRewriteModel: canRewrite, Stream: p.req.api.Streams() || (p.req.bodyOK && p.req.fields.Stream), Now: p.clock()}
	d := &p.dec.decision
	e.AdmitInto(p.ctx, s, &r, &p.dec.ticket, p.onQueueFn, d)
	p.traceDecided(d, true)
	if d.Verdict != policy.Admit {
		if d.Reason == policy.ReasonCancelled {
			p.phase = phaseDone
			return nil
		}
		return p.refuse(d)
	}
	if p.ctx.Err() != nil {
		// Envoy gave up on this stream while we decided (its message timeout, or the client
		// left): nobody will read the reply, and the provider was never called — release as a
		// cancel, which the breaker ignores.
		p.phase = phaseDone
		p.dec.ticket.Done(policy.Outcome{Cancelled: true})
		return nil
	}
	p.phase = phaseAdmitted
	p.dec.admittedAt = p.dec.ticket.GrantedAt()
	p.armIdle()
	return p.admitReply(at)
}

// refuse records refusal d, logs it (rate-limited) and answers with the degradation contract's
// ImmediateResponse. A request Envoy sent without a usable x-request-id gets one here, so the
// client, the log line and the operator all name the refusal alike.
func (p *processor) refuse(d *policy.Decision) *extprocv3.ProcessingResponse {
	p.traceDecided(d, false)
	p.dec.decision, p.phase = *d, phaseDone
	p.req.id = refusalRequestID(p.req.id)
	st := p.snap.Settings()
	r := refusal{requestID: p.req.id, now: p.clock(), noRetryAbove: st.NoRetryAbove, rateLimitHeaders: st.RefusalRateLimitHeaders}
	p.logRefusal(*d, refusalStatus(d.Reason, p.req.route.Dialect))
	return p.withMetadata(immediateReply(*d, p.req.route.Dialect, r))
}

// admitReply lets the request continue with the server's header (and body) mutations, in the
// reply type of the message it was decided at.
func (p *processor) admitReply(at int) *extprocv3.ProcessingResponse {
	s, d := p.snap, p.dec.decision
	names := s.Names(d.Dims)
	parts := p.srv.parts(s)
	p.dec.compartments = p.dec.ticket.JoinCompartments()
	out := &p.out
	common := out.mutation()
	mut := common.HeaderMutation
	mut.SetHeaders = append(mut.SetHeaders, parts.featureHeader[d.Dims.Feature], out.setString(HeaderCompartment, p.dec.compartments))
	if sent, _ := p.Header(HeaderProvider); sent != names.Provider {
		// Routes pick the upstream by x-llm-provider: set it to the provider the request was
		// classified to (e.g. by the model map) or re-routed to, and make Envoy route again.
		mut.SetHeaders = append(mut.SetHeaders, parts.provHeader[d.Dims.Provider])
		common.ClearRouteCache = true
	}
	if s.Settings().StripAcceptEncoding && p.resBodyMode != extprocfilterv3.ProcessingMode_NONE {
		// The response must be readable to settle usage: ask the upstream not to compress it.
		mut.RemoveHeaders = append(mut.RemoveHeaders, "accept-encoding")
	}
	if at == msgRequestBody && p.req.bodyOK {
		// One body mutation carries every rewrite: the model a re-route sends, then
		// include_usage. The body is the stream's own (decoded into memory of its own, see
		// codec.Unmarshal), so they are made in place where it has room.
		model := ""
		if d.OriginalModel != "" {
			model = d.Dims.Model
		}
		body, changed := llmapi.EditBody(p.req.api, p.req.body, &p.req.fields, model, s.Settings().InjectIncludeUsage)
		if changed {
			common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}}
			p.holdReplyBody(body)
			if _, ok := p.Header("content-length"); ok {
				mut.SetHeaders = append(mut.SetHeaders, out.setInt("content-length", int64(len(body))))
			}
		}
	}
	if at == msgRequestHeaders {
		return out.headersReply(true, common)
	}
	return out.bodyReply(true, common)
}

// onQueue runs when admission queues the request: when the wait may outlast Envoy's message
// timeout, it asks Envoy (once per state, as Envoy allows) to wait longer, within
// max_message_timeout.
func (p *processor) onQueue(maxWait time.Duration) {
	p.traceQueued()
	st := p.snap.Settings()
	limit := st.MaxMessageTimeout
	if limit <= 0 || p.overrideFor == p.messages {
		return
	}
	want := maxWait + st.MessageTimeout
	if maxWait < st.MessageTimeout/2 {
		return
	}
	p.overrideFor = p.messages
	resp := &extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(min(want, limit))}
	if err := p.stream.Send(resp); err == nil {
		p.srv.metrics.overrides.Inc()
	}
}

func (p *processor) onResponseHeaders(h *extprocv3.HttpHeaders) *extprocv3.ProcessingResponse {
	if p.phase != phaseAdmitted || !p.dec.ticket.Admitted() {
		return continueResponseHeaders
	}
	p.phase, p.res.started = phaseResponding, true
	p.headers = h.GetHeaders().GetHeaders()
	st, _ := p.Header(":status")
	p.res.status, _ = strconv.Atoi(st)
	now := p.clock()
	p.res.headers = now.Sub(p.dec.admittedAt)
	if ra, ok := p.Header("retry-after"); ok {
		p.res.retryAfter = llmapi.ParseRetryAfter(ra, now)
	}
	var common *extprocv3.CommonResponse
	out := &p.out
	add := func(h *corev3.HeaderValueOption) {
		if common == nil {
			common = out.mutation()
		}
		common.HeaderMutation.SetHeaders = append(common.HeaderMutation.SetHeaders, h)
	}
	pol := p.snap.Settings()
	if pol.CompartmentHeader {
		add(out.setString(HeaderCompartment, p.dec.compartments))
	}
	if pol.RateLimitHeaders {
		if left, reset, ok := p.dec.ticket.Remaining(now); ok {
			add(out.setInt(HeaderRemainingTokens, max(left, 0)))
			add(out.setReset(HeaderResetTokens, reset))
		}
	}
	resp := out.headersReply(false, common)

	bodyComing := !h.EndOfStream && p.resBodyMode != extprocfilterv3.ProcessingMode_NONE
	p.res.reading = bodyComing && p.res.status >= 200 && p.res.status < 300 && p.req.api != llmapi.APIGeminiCountTokens
	if p.res.reading {
		ct, _ := p.Header("content-type")
		ce, _ := p.Header("content-encoding")
		p.res.scanner = scanners.Get().(*llmapi.UsageScanner)
		p.res.scanner.Reset(p.req.api, ct, ce)
		if p.snap.SpendLimits {
			// Spend is priced by the model that answered.
			p.res.scanner.SniffModel()
		}
	} else if bodyComing && p.snap.Settings().AllowModeOverride {
		// Nothing to read in an error response: ask Envoy not to send its body at all.
		resp.ModeOverride = p.override(p.reqBodyMode, extprocfilterv3.ProcessingMode_NONE)
		bodyComing = false
	}
	if !bodyComing {
		// No body will reach us: the response is complete as far as the server can see.
		p.complete()
		p.withMetadata(resp)
	}
	return resp
}

func (p *processor) onResponseBody(b *extprocv3.HttpBody) *extprocv3.ProcessingResponse {
	if !p.dec.ticket.Admitted() {
		return continueResponseBody
	}
	if !b.EndOfStream {
		if p.res.reading {
			// Reply first, read after: the client's stream must not wait for the scan. The
			// first token's time is when its chunk arrived, not when it was scanned.
			p.res.pending = b.Body
			p.res.chunkAt = p.clock()
		}
		return continueResponseBody
	}
	if p.res.reading {
		p.res.chunkAt = p.clock()
		p.res.scanner.Write(b.Body)
		p.noteFirstToken()
	}
	p.complete()
	return p.withMetadata(p.out.bodyReply(false, nil))
}

// afterSend does the work that must not delay a reply.
func (p *processor) afterSend(resp *extprocv3.ProcessingResponse) {
	// gRPC has the reply: the request body it may carry is no longer the stream's to hold (the
	// hold's key names the body only while the reply holds it: replySent first).
	p.replySent()
	p.out.sent()
	p.dropBody()
	if p.res.pending != nil {
		p.res.scanner.Write(p.res.pending)
		p.res.pending = nil
		p.noteFirstToken()
	}
	if _, ok := resp.Response.(*extprocv3.ProcessingResponse_ImmediateResponse); ok {
		p.phase = phaseDone
	}
}

// noteFirstToken records, once the scanner has seen the first token, the arrival of the chunk
// just scanned, and reports it to the ticket when the response streams (adaptive limits learn
// from it before the answer ends). In a stream it also notes when generated text last came.
func (p *processor) noteFirstToken() {
	if !p.res.tokenSeen && p.res.scanner.FirstToken() {
		p.res.tokenSeen = true
		p.res.firstToken = p.res.chunkAt.Sub(p.dec.admittedAt)
		if p.res.scanner.Streaming() {
			p.dec.ticket.FirstToken(p.res.firstToken)
		}
	}
	if p.res.tokenSeen && p.res.scanner.Streaming() {
		if n := p.res.scanner.ContentBytes(); n > p.res.contentBytes {
			if p.res.contentBytes > 0 && p.res.chunkAt.After(p.res.lastContentAt) {
				p.res.contentChunks++
			}
			p.res.contentBytes, p.res.lastContentAt = n, p.res.chunkAt
		}
	}
}

// An inter-token latency is measured only from text that arrived in at least
// minContentChunks chunks after the first token's, at least minChunkGap apart on average:
// a stream delivered in a burst (buffered on the way, or read late by a stalled process)
// times the delivery, not the decode.
const (
	minContentChunks = 2
	minChunkGap      = time.Millisecond
)

// interToken is the mean time between the tokens of a streamed answer after its first: from
// the first token's chunk to the last chunk with generated text, over the tokens that came
// after the first (the completion count reported, else the text seen at bytesPerToken). 0 when
// the response did not stream, had fewer than two tokens, or came in a burst (see
// minContentChunks).
func (p *processor) interToken(u llmapi.Usage, bytesPerToken float64) time.Duration {
	if !p.res.tokenSeen || p.res.scanner == nil || !p.res.scanner.Streaming() {
		return 0
	}
	span := p.res.lastContentAt.Sub(p.dec.admittedAt.Add(p.res.firstToken))
	if p.res.contentChunks < minContentChunks || span < time.Duration(p.res.contentChunks)*minChunkGap {
		return 0
	}
	tokens := u.CompletionTokens - u.ReasoningTokens
	if !u.Known || tokens <= 0 {
		if bytesPerToken <= 0 {
			bytesPerToken = 4
		}
		tokens = int64(float64(p.res.contentBytes) / bytesPerToken)
	}
	if tokens < 2 {
		return 0
	}
	return span / time.Duration(tokens-1)
}

// complete settles a request whose response finished normally.
func (p *processor) complete() {
	if p.phase == phaseAdmitted || p.phase == phaseResponding {
		p.settleOnce(false)
	}
}

// ended handles the stream ending (Envoy reset or half-closed it, or Send failed).
func (p *processor) ended(how end) {
	if p.phase == phaseDone || !p.dec.ticket.Admitted() {
		return
	}
	// A response that started but did not finish was cut short, most likely by the client. A
	// stream that ends with no response at all may be a client cancel or an upstream failure
	// (Envoy does not send local replies to the processor); the breaker's no_response_as says
	// which it counts as.
	p.settleOnce(p.res.started)
	p.srv.metrics.endedEarly.WithLabelValues(endName(how)).Inc()
}

// finish runs when Process returns, whatever the reason: nothing may stay held.
func (p *processor) finish() {
	p.stopIdle()
	p.dropBody()
	p.releaseHold()
	if p.dec.ticket.Admitted() {
		p.settleOnce(p.res.started)
	}
	if p.dec.decision.Verdict == policy.Admit {
		p.srv.metrics.admissionsEnded.Inc()
		if !p.dec.ticket.Admitted() {
			p.srv.metrics.admissionsReleased.Inc()
		}
	}
	if p.res.scanner != nil {
		p.res.scanner.Close()
		scanners.Put(p.res.scanner)
		p.res.scanner = nil
	}
	p.traceEnd()
}

// settleOnce ends the request: the phase moves to done and the ticket is settled with the
// outcome seen; cancelled says the response was cut short.
func (p *processor) settleOnce(cancelled bool) {
	if p.phase != phasePassthrough {
		p.phase = phaseDone
	}
	p.settle(cancelled)
}

// settle releases the ticket with the outcome seen. It never panics: it also runs after the
// message loop (stream end), where a panic would take the whole server down; the ticket releases
// its slots before any settlement work, so a failed settlement leaves nothing held.
func (p *processor) settle(cancelled bool) {
	if !p.claimTicket() {
		// The idle watch released the ticket while the stream was silent.
		return
	}
	// headers is set with the response headers; 0 means there were none. A response whose body
	// is not read is timed to its first token at its headers.
	o := policy.Outcome{Status: p.res.status, Cancelled: cancelled, RetryAfter: p.res.retryAfter, Headers: p.res.headers, TTFB: p.res.headers,
		At: p.clock()}
	o.Duration = o.At.Sub(p.dec.admittedAt)
	defer func() {
		if r := recover(); r != nil {
			// Reading the usage failed: settle without it (Done is idempotent, so a panic inside
			// Done itself, which already released, is not settled twice).
			p.res.settled = p.dec.ticket.Done(policy.Outcome{Status: o.Status, Cancelled: o.Cancelled, TTFB: o.TTFB, Headers: o.Headers, Duration: o.Duration, At: o.At})
			p.srv.metrics.panics.Inc()
			p.srv.log.Error("panic while settling a request; its slots were released", "request_id", p.req.id,
				"panic", r, "stack", string(debug.Stack()))
		}
	}()
	if p.res.reading {
		if p.res.pending != nil {
			p.res.scanner.Write(p.res.pending)
			p.res.pending = nil
			p.noteFirstToken()
		}
		u := p.res.scanner.Finish()
		o.Usage = policy.Usage{Prompt: u.PromptTokens, Completion: u.CompletionTokens, Total: u.TotalTokens,
			Cached: u.CachedTokens, Reasoning: u.ReasoningTokens, Known: u.Known, PromptKnown: u.PromptKnown, ContentBytes: u.ContentBytes,
			AudioMillis: u.AudioMillis}
		o.StreamError = streamError(u.Error)
		o.Model = p.res.scanner.Model()
		// A body read to its end without a token waited for one all along.
		o.TTFB = o.Duration
		o.InterToken = p.interToken(u, p.dec.estimate.BytesPerToken)
	}
	if p.res.tokenSeen {
		o.TTFB = p.res.firstToken
	}
	p.res.outcome = o
	p.res.settled = p.dec.ticket.Done(o)
	p.traceSettled()
	p.srv.metrics.observeUpstream(p.snap.ProviderName(p.dec.decision.Dims.Provider), o, p.res.tokenSeen)
}

// streamError maps an error a response body reported to the policy's kinds.
func streamError(k llmapi.ErrorKind) policy.StreamError {
	switch k {
	case llmapi.ErrorServer:
		return policy.StreamErrorServer
	case llmapi.ErrorRateLimited:
		return policy.StreamErrorRateLimited
	case llmapi.ErrorClient:
		return policy.StreamErrorClient
	}
	return policy.StreamErrorNone
}

// Header implements policy.Input over the current message's headers. The value aliases the
// message's bytes (protobuf gives every message its own), so reading does not allocate; code
// that keeps a value beyond the request must copy it.
func (p *processor) Header(name string) (string, bool) {
	for _, h := range p.headers {
		if h.Key == name {
			if len(h.RawValue) > 0 {
				return unsafe.String(unsafe.SliceData(h.RawValue), len(h.RawValue)), true
			}
			return h.Value, true
		}
	}
	return "", false
}

func (p *processor) method() string {
	m, _ := p.Header(":method")
	return m
}

// Path implements policy.Input.
func (p *processor) Path() string { return p.req.path }

// BodyField implements policy.Input.
// For "model" it returns the model (or Azure deployment) the path names when it names one:
// that is the one the provider serves, whatever the body says, and it is known without a body.
func (p *processor) BodyField(path string) (string, bool) {
	if m := p.req.route.Model; m != "" && path == "model" {
		return m, true
	}
	if !p.req.bodyOK {
		return "", false
	}
	// The scan already read the common fields: do not walk a large body again for them.
	switch path {
	case "model":
		return p.req.fields.Model, p.req.fields.Model != ""
	case "user":
		if !p.req.api.Anthropic() {
			return p.req.fields.User, p.req.fields.User != ""
		}
	}
	return llmapi.Field(p.req.body, path)
}

// Metadata implements policy.Input over metadata_context (Envoy-forwarded, trusted).
func (p *processor) Metadata(namespace string, key []string) (string, bool) {
	st := p.req.metadata.GetFilterMetadata()[namespace]
	if st == nil || len(key) == 0 {
		return "", false
	}
	for i, k := range key {
		v := st.GetFields()[k]
		if v == nil {
			return "", false
		}
		if i == len(key)-1 {
			return scalar(v)
		}
		st = v.GetStructValue()
		if st == nil {
			return "", false
		}
	}
	return "", false
}

// Attribute implements policy.Input over the request attributes.
func (p *processor) Attribute(name string) (string, bool) {
	v := p.req.attrs.GetFields()[name]
	if v == nil {
		return "", false
	}
	return scalar(v)
}

func scalar(v *structpb.Value) (string, bool) {
	switch k := v.Kind.(type) {
	case *structpb.Value_StringValue:
		return k.StringValue, true
	case *structpb.Value_NumberValue:
		return strconv.FormatFloat(k.NumberValue, 'f', -1, 64), true
	case *structpb.Value_BoolValue:
		return strconv.FormatBool(k.BoolValue), true
	}
	return "", false
}
