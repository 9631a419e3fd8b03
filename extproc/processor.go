package extproc

import (
	"context"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

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
	// arrived is when the request headers arrived: a client's timeout counts from there.
	arrived time.Time
	// body is the buffered request body until the decision is made.
	body   []byte
	bodyOK bool
	fields llmapi.RequestFields
	// heldBody is how many bytes of Server.buffered this stream's body accounts for, until the
	// reply that may carry it is handed to gRPC; hold has them after, when that reply carries it.
	heldBody int64
	hold     *bodyHold
	// counted is what the codec did with the current message's request body (see recv).
	counted bodyCount
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
	// attempts is the request's entry in the server's attempt table (envoy.upstream_filter),
	// kept under attemptsKey; nil when its attempts are not followed.
	attempts    *attemptEntry
	attemptsKey string

	idle idleWatch

	// out is the memory of the admitted request's replies.
	out replyMem
	// in is what a message whose request body the codec counts is received into (see recv).
	in bodyRecv
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
	st := p.srv.Settings()
	p.reqBodyMode, p.resBodyMode = st.RequestBodyMode, st.ResponseBodyMode
}

// override is a mode_override with both body modes given (Envoy applies body modes as they
// are, so leaving one out would turn it to NONE) and header and trailer modes left at DEFAULT,
// which keeps what the filter is configured with.
func (p *processor) override(req, res bodyMode) *extprocfilterv3.ProcessingMode {
	return &extprocfilterv3.ProcessingMode{RequestBodyMode: req, ResponseBodyMode: res}
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
	defer p.endAttempts()
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
