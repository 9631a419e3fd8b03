package envoysim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// attributesKey is where Envoy puts request/response attributes.
const attributesKey = "envoy.filters.http.ext_proc"

type evKind int

const (
	evReply evKind = iota
	evStreamEnd
	evReqChunk
	evReqEnd
	evReqFail
	evUpHeaders
	evUpChunk
	evUpEnd
	evUpFail
	evUpReset
)

type event struct {
	kind     evKind
	reply    *extprocv3.ProcessingResponse
	err      error
	at       time.Time
	data     []byte
	eos      bool
	trailers Headers
	resp     *UpstreamResponse
}

// cbState mirrors ProcessorState::CallbackState.
type cbState int

const (
	cbIdle cbState = iota
	cbHeaders
	cbBufferedBody
	cbStreamedBody
	cbPartialBody
	cbTrailers
)

type qchunk struct {
	data []byte
	eos  bool
}

// dirState mirrors one ProcessorState (decoding or encoding) plus the
// filter-manager bookkeeping the simulator needs to forward data.
type dirState struct {
	isReq        bool
	sendHeaders  bool
	sendTrailers bool
	bodyMode     BodyMode
	cb           cbState

	timer        *time.Timer
	timerOn      bool
	overrideUsed bool

	started       bool
	noBody        bool
	completeBody  bool
	bodyReplaced  bool
	partialDone   bool
	attrsSent     bool
	trailersSent  bool
	trailersAvail bool
	paused        bool

	headers     Headers
	hdrHeld     bool // Envoy's headers_ pointer: the headers may still be mutated
	hdrFwd      bool
	endFwd      bool
	buffered    []byte
	hasBuffered bool
	queue       []qchunk
	trailers    Headers

	lockstep bool
	granted  bool
	grant    chan struct{}
}

func (d *dirState) setMode(m ProcessingMode) {
	if d.isReq {
		d.sendHeaders = m.RequestHeader != HeaderSkip
		d.sendTrailers = m.RequestTrailer == HeaderSend
		d.bodyMode = m.RequestBody
	} else {
		d.sendHeaders = m.ResponseHeader != HeaderSkip
		d.sendTrailers = m.ResponseTrailer == HeaderSend
		d.bodyMode = m.ResponseBody
	}
}

func (d *dirState) shouldRemoveContentLength() bool {
	return d.bodyMode == BodyStreamed || d.bodyMode == BodyBufferedPartial ||
		(d.bodyMode == BodyBuffered && !d.sendHeaders)
}

func (d *dirState) noExternalProcess() bool {
	return !d.sendHeaders && !d.sendTrailers && d.bodyMode == BodyNone
}

func (d *dirState) queueBytes() int {
	n := 0
	for _, c := range d.queue {
		n += len(c.data)
	}
	return n
}

func (d *dirState) timerC() <-chan time.Time {
	if d.timerOn {
		return d.timer.C
	}
	return nil
}

// sink receives what the downstream client would see; the HTTP face uses
// it to write to a real connection.
type sink interface {
	headers(status int, h Headers)
	data(b []byte)
	end(trailers Headers)
	reset()
}

type closeMode int

const (
	closeNotYet closeMode = iota
	closeReset
	closeGraceful
	closeDeferred
	closeByServer
)

// filter runs one HTTP request through a simulated ext_proc filter. All of
// its state is owned by the goroutine that calls run.
type filter struct {
	sim     *Sim
	cfg     FilterConfig
	req     *Request
	up      Upstream
	ctx     context.Context
	sink    sink
	timeout time.Duration

	events   chan event
	loopDone chan struct{}
	helpers  sync.WaitGroup

	dec, enc *dirState

	stream             *procStream
	streamClosed       bool
	closeMode          closeMode
	processingComplete bool
	protocolConfigSent bool
	sentImmediate      bool

	done            bool
	cancelRequested bool
	downHdrSent     bool
	downChunks      int

	dynMeta    map[string]*structpb.Struct
	routeCache bool

	// rlStarted: the rate limit filter saw the request headers (Envoy's request_headers_);
	// rlCanceled: its check was cancelled in flight.
	rlStarted, rlCanceled bool

	upCtx    context.Context
	upCancel context.CancelFunc
	upPipe   *bodyPipe
	reqSrc   BodySource

	res *Result
}

func newFilter(s *Sim, cfg FilterConfig, req *Request, up Upstream, ctx context.Context, sk sink) *filter {
	cfg = cfg.withDefaults()
	f := &filter{
		sim: s, cfg: cfg, req: req, up: up, ctx: ctx, sink: sk,
		timeout:  cfg.MessageTimeout,
		events:   make(chan event, 16),
		loopDone: make(chan struct{}),
		dec:      &dirState{isReq: true, grant: make(chan struct{}, 1), lockstep: req.Lockstep},
		enc:      &dirState{grant: make(chan struct{}, 1)},
		dynMeta:  map[string]*structpb.Struct{},
		res:      &Result{},
	}
	if req.MessageTimeout > 0 {
		f.timeout = req.MessageTimeout
	}
	f.dec.setMode(cfg.Mode)
	f.enc.setMode(cfg.Mode)
	for ns, st := range req.Metadata {
		f.dynMeta[ns] = proto.Clone(st).(*structpb.Struct)
	}
	f.upCtx, f.upCancel = context.WithCancel(context.Background())
	return f
}

// run drives the request to completion: until the client has a complete
// response, a local reply, or a reset.
func (f *filter) run() {
	f.res.Started = time.Now()
	f.startRequestPump()
	f.decodeHeaders()
	for !f.done {
		if f.cancelRequested {
			f.downstreamCanceled()
			break
		}
		f.grantLockstep(f.dec)
		f.grantLockstep(f.enc)
		select {
		case ev := <-f.events:
			f.handle(ev)
		case <-f.dec.timerC():
			f.dec.timerOn = false
			f.onMessageTimeout()
		case <-f.enc.timerC():
			f.enc.timerOn = false
			f.onMessageTimeout()
		case <-f.ctx.Done():
			f.cancelRequested = true
		}
	}
	f.res.Completed = time.Now()
	f.destroy()
	close(f.loopDone)
	f.upCancel()
	if f.upPipe != nil {
		f.upPipe.abort(errors.New("downstream stream ended"))
	}
	f.helpers.Wait()
	for _, d := range []*dirState{f.dec, f.enc} {
		if d.timer != nil {
			d.timer.Stop()
		}
	}
}

func (f *filter) grantLockstep(d *dirState) {
	if d.lockstep && !d.granted && d.started && d.cb == cbIdle && !f.done {
		select {
		case d.grant <- struct{}{}:
			d.granted = true
		default:
		}
	}
}

// emit reports a step to the request's hook; a Cancel is acted upon before
// the next event is taken, never in the middle of a step.
func (f *filter) emit(e Event) {
	if f.req.OnEvent == nil || f.cancelRequested {
		return
	}
	e.At = time.Now()
	if f.req.OnEvent(e) == Cancel {
		f.cancelRequested = true
	}
}

func (f *filter) post(ev event) bool {
	select {
	case f.events <- ev:
		return true
	case <-f.loopDone:
		return false
	}
}

func (f *filter) startRequestPump() {
	src := f.req.source()
	if src == nil {
		return
	}
	f.reqSrc = src
	f.helpers.Add(1)
	go func() {
		defer f.helpers.Done()
		f.pump(f.upCtx, src, f.dec.grant, f.req.Lockstep, f.req.Trailers, evReqChunk, evReqEnd, evReqFail)
	}()
}

// pump reads a body source and posts chunk events. The last chunk carries
// end_of_stream when the source can tell it is last and no trailers follow.
func (f *filter) pump(ctx context.Context, src BodySource, grant <-chan struct{}, lockstep bool, trailers Headers, chunkKind, endKind, failKind evKind) {
	more, canTell := src.(interface{ More() bool })
	for {
		if lockstep {
			select {
			case <-grant:
			case <-ctx.Done():
				return
			}
		}
		b, err := src.Next(ctx)
		if err != nil {
			if errors.Is(err, io.EOF) {
				if ts, ok := src.(TrailerSource); ok && len(ts.Trailers()) > 0 {
					trailers = ts.Trailers()
				}
				f.post(event{kind: endKind, trailers: trailers, at: time.Now()})
				return
			}
			if ctx.Err() == nil {
				f.post(event{kind: failKind, err: err, at: time.Now()})
			}
			return
		}
		eos := canTell && !more.More() && len(trailers) == 0
		if !f.post(event{kind: chunkKind, data: b, eos: eos, at: time.Now()}) || eos {
			return
		}
	}
}

func (f *filter) handle(ev event) {
	switch ev.kind {
	case evReply:
		f.onReply(ev.reply, ev.at)
	case evStreamEnd:
		f.onStreamEnd(ev.err)
	case evReqChunk:
		f.dec.granted = false
		f.onData(f.dec, ev.data, ev.eos)
	case evReqEnd:
		f.onBodyEnd(f.dec, ev.trailers)
	case evReqFail:
		f.downstreamCanceled()
	case evUpHeaders:
		f.emit(Event{Kind: EventUpstreamResponse})
		f.encodeHeaders(ev.resp)
	case evUpChunk:
		f.enc.granted = false
		f.onData(f.enc, ev.data, ev.eos)
	case evUpEnd:
		f.onBodyEnd(f.enc, ev.trailers)
	case evUpFail:
		f.res.UpstreamFailure = ev.err
		var ue *UpstreamError
		if errors.As(ev.err, &ue) && ue.Kind == UpstreamTimeout {
			f.localReply(LocalUpstreamFailure, http.StatusGatewayTimeout, nil, []byte("upstream request timeout"), "upstream_response_timeout")
		} else {
			f.localReply(LocalUpstreamFailure, http.StatusServiceUnavailable, nil,
				[]byte("upstream connect error or disconnect/reset before headers. reset reason: connection failure"),
				"upstream_reset_before_response_started{connection_failure}")
		}
	case evUpReset:
		f.res.UpstreamFailure = ev.err
		f.downstreamReset()
	}
}

// --- opening and sending ----------------------------------------------

type openState int

const (
	openOK openState = iota
	openIgnore
	openError
)

func (f *filter) openStream() openState {
	if f.processingComplete {
		return openIgnore
	}
	if f.stream != nil {
		return openOK
	}
	st, err := openStream(f.sim.client, f.cfg.InitialMetadata, f.events, f.loopDone)
	if err != nil {
		f.res.Stream = StreamOpenFailed
		f.res.StreamCode = status.Code(err)
		f.onGrpcError(err)
		if f.sentImmediate {
			return openError
		}
		return openIgnore
	}
	f.stream = st
	f.emit(Event{Kind: EventStreamOpened})
	return openOK
}

func (f *filter) decorate(d *dirState, m *extprocv3.ProcessingRequest) {
	names := f.cfg.ResponseAttributes
	if d.isReq {
		names = f.cfg.RequestAttributes
	}
	if !d.attrsSent && len(names) > 0 {
		fields := map[string]*structpb.Value{}
		for _, n := range names {
			if v, ok := f.attribute(n); ok {
				fields[n] = v
			}
		}
		d.attrsSent = true
		m.Attributes = map[string]*structpb.Struct{attributesKey: {Fields: fields}}
	}
	md := &corev3.Metadata{}
	for _, ns := range f.cfg.ForwardingNamespaces {
		if st, ok := f.dynMeta[ns]; ok {
			if md.FilterMetadata == nil {
				md.FilterMetadata = map[string]*structpb.Struct{}
			}
			// A copy of the namespace's fields as they are now (the message may be marshalled on
			// another goroutine while a later reply merges into the filter's metadata).
			md.FilterMetadata[ns] = &structpb.Struct{Fields: maps.Clone(st.Fields)}
		}
	}
	m.MetadataContext = md
	if !f.protocolConfigSent && !f.cfg.ObservabilityMode {
		f.protocolConfigSent = true
		if !f.cfg.OmitProtocolConfig {
			m.ProtocolConfig = &extprocv3.ProtocolConfiguration{
				RequestBodyMode:  extprocfilterv3.ProcessingMode_BodySendMode(f.dec.bodyMode),
				ResponseBodyMode: extprocfilterv3.ProcessingMode_BodySendMode(f.enc.bodyMode),
			}
		}
	}
}

func (f *filter) attribute(name string) (*structpb.Value, bool) {
	if v, ok := f.req.Attributes[name]; ok {
		pv, err := structpb.NewValue(v)
		if err != nil {
			return nil, false
		}
		return pv, true
	}
	h := f.dec.headers
	switch name {
	case "request.path":
		return structpb.NewStringValue(h.Get(":path")), true
	case "request.url_path":
		p := h.Get(":path")
		if i := strings.IndexByte(p, '?'); i >= 0 {
			p = p[:i]
		}
		return structpb.NewStringValue(p), true
	case "request.method":
		return structpb.NewStringValue(h.Get(":method")), true
	case "request.host":
		return structpb.NewStringValue(h.Get(":authority")), true
	case "request.scheme":
		return structpb.NewStringValue(h.Get(":scheme")), true
	case "request.id":
		if id, ok := h.Lookup("x-request-id"); ok {
			return structpb.NewStringValue(id), true
		}
	case "request.protocol":
		return structpb.NewStringValue("HTTP/1.1"), true
	case "response.code":
		if c, err := strconv.Atoi(f.enc.headers.Get(":status")); err == nil {
			return structpb.NewNumberValue(float64(c)), true
		}
	}
	return nil, false
}

func (f *filter) transmit(m *extprocv3.ProcessingRequest) {
	if f.done {
		return
	}
	f.res.Exchange = append(f.res.Exchange, Record{At: time.Now(), Sent: m})
	f.stream.send(m)
	f.emit(Event{Kind: EventSent, Message: KindOfRequest(m), Sent: m})
}

func (f *filter) startCall(d *dirState, next cbState) {
	d.cb = next
	if d.timer == nil {
		d.timer = time.NewTimer(f.timeout)
	} else {
		d.timer.Reset(f.timeout)
	}
	d.timerOn = true
	d.overrideUsed = false
}

func (f *filter) finishCall(d *dirState, next cbState) {
	if d.timer != nil {
		d.timer.Stop()
	}
	d.timerOn = false
	d.cb = next
	d.overrideUsed = false
}

func headersMsg(d *dirState, eos bool) *extprocv3.ProcessingRequest {
	hh := &extprocv3.HttpHeaders{Headers: d.headers.toProto(), EndOfStream: eos}
	if d.isReq {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hh}}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hh}}
}

func bodyMsg(d *dirState, b []byte, eos bool) *extprocv3.ProcessingRequest {
	hb := &extprocv3.HttpBody{Body: append([]byte(nil), b...), EndOfStream: eos}
	if d.isReq {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: hb}}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: hb}}
}

func trailersMsg(d *dirState) *extprocv3.ProcessingRequest {
	ht := &extprocv3.HttpTrailers{Trailers: d.trailers.toProto()}
	if d.isReq {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: ht}}
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: ht}}
}

func (f *filter) sendHeaders(d *dirState, eos bool) {
	m := headersMsg(d, eos)
	f.decorate(d, m)
	f.startCall(d, cbHeaders)
	f.transmit(m)
	d.paused = true
}

func (f *filter) sendBody(d *dirState, b []byte, eos bool, next cbState) {
	m := bodyMsg(d, b, eos)
	f.decorate(d, m)
	f.startCall(d, next)
	f.transmit(m)
}

func (f *filter) sendTrailers(d *dirState) {
	if d.trailersSent {
		return
	}
	d.trailersSent = true
	m := trailersMsg(d)
	f.decorate(d, m)
	f.startCall(d, cbTrailers)
	f.transmit(m)
}

func (f *filter) sendObservability(d *dirState, m *extprocv3.ProcessingRequest) {
	if f.openStream() != openOK {
		return
	}
	m.ObservabilityMode = true
	f.decorate(d, m)
	f.transmit(m)
}

// --- forwarding (what leaves the filter) ---------------------------------

func (f *filter) fwdHeaders(d *dirState) {
	if d.hdrFwd || f.done {
		return
	}
	d.hdrFwd = true
	d.hdrHeld = false
	if d.isReq {
		f.startUpstream()
		return
	}
	st, _ := strconv.Atoi(d.headers.Get(":status"))
	f.downHdrSent = true
	f.res.Status = st
	f.res.Headers = d.headers.WithoutPseudo()
	if f.sink != nil {
		f.sink.headers(st, f.res.Headers)
	}
	f.emit(Event{Kind: EventDownstreamHeaders})
}

func (f *filter) fwdData(d *dirState, b []byte) {
	if f.done {
		return
	}
	f.fwdHeaders(d)
	if len(b) == 0 {
		return
	}
	if d.isReq {
		if f.upPipe != nil {
			f.upPipe.push(b)
			f.res.Upstream.Body = append(f.res.Upstream.Body, b...)
		}
		return
	}
	c := append([]byte(nil), b...)
	f.res.Body = append(f.res.Body, c...)
	f.res.Chunks = append(f.res.Chunks, c)
	f.downChunks++
	if f.sink != nil {
		f.sink.data(c)
	}
	f.emit(Event{Kind: EventDownstreamData, DownstreamChunks: f.downChunks})
}

func (f *filter) fwdEnd(d *dirState) {
	if d.endFwd || f.done {
		return
	}
	f.fwdHeaders(d)
	d.endFwd = true
	var tr Headers
	if d.trailersAvail {
		tr = d.trailers.Clone()
	}
	if d.isReq {
		if f.upPipe != nil {
			f.upPipe.finish(tr)
			f.res.Upstream.Trailers = tr
			f.res.Upstream.Complete = true
		}
		return
	}
	f.res.Trailers = tr
	if f.sink != nil {
		f.sink.end(tr)
	}
	f.finishHTTP()
}

// release is Envoy's continueDecoding/continueEncoding: held headers,
// buffered data and, when nothing is pending, the end of the stream go on.
func (f *filter) release(d *dirState) {
	f.fwdHeaders(d)
	if len(d.buffered) > 0 {
		b := d.buffered
		d.buffered = nil
		f.fwdData(d, b)
	}
	d.hasBuffered = false
	f.maybeEnd(d)
}

func (f *filter) maybeEnd(d *dirState) {
	if d.endFwd || !d.completeBody || len(d.queue) > 0 || d.cb != cbIdle {
		return
	}
	if d.trailersAvail && d.sendTrailers && !d.trailersSent && !f.processingComplete {
		return
	}
	f.fwdEnd(d)
}

func (f *filter) continueDir(d *dirState) {
	if d.paused {
		d.paused = false
		f.release(d)
	}
}

func (f *filter) startUpstream() {
	if f.done || f.upPipe != nil {
		return
	}
	h := f.dec.headers
	seen := &UpstreamSeen{
		Method: h.Get(":method"), Path: h.Get(":path"), Authority: h.Get(":authority"), Scheme: h.Get(":scheme"),
		Headers: h.WithoutPseudo(), RouteCacheCleared: f.routeCache,
	}
	f.res.Upstream = seen
	pipe := newBodyPipe()
	f.upPipe = pipe
	ureq := &UpstreamRequest{
		Method: seen.Method, Path: seen.Path, Authority: seen.Authority, Scheme: seen.Scheme,
		Headers: seen.Headers.Clone(), Body: pipe, RouteCacheCleared: seen.RouteCacheCleared,
		trailers: pipe.getTrailers,
	}
	f.emit(Event{Kind: EventUpstreamCalled})
	f.helpers.Add(1)
	go func() {
		defer f.helpers.Done()
		resp, err := f.up.Serve(f.upCtx, ureq)
		if err != nil {
			if f.upCtx.Err() == nil {
				f.post(event{kind: evUpFail, err: err, at: time.Now()})
			}
			return
		}
		if resp == nil {
			f.post(event{kind: evUpFail, err: errors.New("upstream returned no response"), at: time.Now()})
			return
		}
		if !f.post(event{kind: evUpHeaders, resp: resp, at: time.Now()}) || resp.Body == nil {
			return
		}
		f.pump(f.upCtx, resp.Body, f.enc.grant, resp.Lockstep, resp.Trailers, evUpChunk, evUpEnd, evUpReset)
	}()
}

// --- local replies and endings -------------------------------------------

// localReply is FilterManager::sendLocalReply: before response headers went
// downstream it replaces the response, afterwards it can only reset.
func (f *filter) localReply(kind LocalReply, code int, mutation *extprocv3.HeaderMutation, body []byte, details string) {
	f.localReplyWith(kind, code, mutation, nil, body, details)
}

// localReplyWith is localReply with headers the replying filter adds (extra), which no
// mutation rule applies to.
func (f *filter) localReplyWith(kind LocalReply, code int, mutation *extprocv3.HeaderMutation, extra Headers, body []byte, details string) {
	if f.done {
		return
	}
	if f.downHdrSent {
		f.downstreamReset()
		return
	}
	h := Headers{}
	if len(body) > 0 {
		h = append(h, Header{"content-length", strconv.Itoa(len(body))}, Header{"content-type", "text/plain"})
	} else {
		h = append(h, Header{"content-length", "0"})
	}
	if mutation != nil {
		full := append(Headers{{":status", strconv.Itoa(code)}}, h...)
		if _, err := applyHeaderMutation(mutation, &full, false, f.cfg.MutationRules, false); err != nil {
			f.problem(ProblemMutationRejected, "immediate response headers: "+err.Error())
		}
		if c, err := strconv.Atoi(full.Get(":status")); err == nil {
			code = c
		}
		h = full.WithoutPseudo()
	}
	h = append(h, extra...)
	f.res.Local = kind
	f.res.LocalDetails = strings.Join(strings.Fields(details), "_")
	f.downHdrSent = true
	f.res.Status = code
	f.res.Headers = h
	if f.sink != nil {
		f.sink.headers(code, h)
	}
	if len(body) > 0 {
		c := append([]byte(nil), body...)
		f.res.Body = c
		f.res.Chunks = [][]byte{c}
		if f.sink != nil {
			f.sink.data(c)
		}
	}
	if f.sink != nil {
		f.sink.end(nil)
	}
	f.finishHTTP()
}

func (f *filter) downstreamReset() {
	if f.done {
		return
	}
	f.res.Reset = true
	if f.sink != nil {
		f.sink.reset()
	}
	f.finishHTTP()
}

func (f *filter) downstreamCanceled() {
	if f.done {
		return
	}
	f.res.Canceled = true
	f.res.Reset = true
	f.finishHTTP()
}

// finishHTTP marks the HTTP exchange complete for the client. Envoy
// destroys the filter on a later dispatcher turn, so the gRPC stream is
// closed by destroy once the current step has finished.
func (f *filter) finishHTTP() {
	if f.done {
		return
	}
	f.done = true
	f.finishCall(f.dec, f.dec.cb)
	f.finishCall(f.enc, f.enc.cb)
}

// destroy is Filter::onDestroy: the HTTP stream is gone.
func (f *filter) destroy() {
	f.processingComplete = true
	if f.stream == nil || f.streamClosed {
		return
	}
	if f.cfg.ObservabilityMode {
		f.streamClosed = true
		f.closeMode = closeDeferred
		f.res.CloseReason = CloseHTTPStreamDone
		return
	}
	f.closeStreamMaybeGraceful(CloseHTTPStreamDone)
}

func (f *filter) closeStream(reason CloseReason) {
	if f.stream == nil || f.streamClosed {
		return
	}
	f.streamClosed = true
	f.closeMode = closeReset
	f.res.CloseReason = reason
	f.stream.reset()
}

func (f *filter) closeStreamMaybeGraceful(reason CloseReason) {
	f.processingComplete = true
	if !f.cfg.GracefulClose {
		f.closeStream(reason)
		return
	}
	if f.stream == nil || f.streamClosed {
		return
	}
	f.streamClosed = true
	f.closeMode = closeGraceful
	f.res.CloseReason = reason
	f.stream.halfClose()
}

func (f *filter) problem(k ProblemKind, detail string) {
	f.res.Problems = append(f.res.Problems, Problem{Kind: k, Detail: detail})
}

// --- decoding/encoding callbacks ----------------------------------------

func (f *filter) decodeHeaders() {
	d := f.dec
	d.started = true
	d.headers = f.req.headerList()
	if f.cfg.RateLimit != nil && !f.checkRateLimit() {
		return
	}
	eos := !f.req.hasBody() && len(f.req.Trailers) == 0
	if f.cfg.ObservabilityMode && d.sendHeaders {
		f.sendObservability(d, headersMsg(d, eos))
		f.fwdHeaders(d)
		if eos {
			d.completeBody = true
			f.fwdEnd(d)
		}
		return
	}
	if eos {
		d.completeBody = true
	}
	f.onHeaders(d, eos)
	if f.done {
		return
	}
	if !f.processingComplete && d.shouldRemoveContentLength() {
		d.headers.Del("content-length")
	}
	if !d.paused {
		f.fwdHeaders(d)
		if eos {
			f.fwdEnd(d)
		}
	}
}

func (f *filter) encodeHeaders(resp *UpstreamResponse) {
	d := f.enc
	d.started = true
	d.lockstep = resp.Lockstep
	code := resp.Status
	if code == 0 {
		code = http.StatusOK
	}
	d.headers = append(Headers{{":status", strconv.Itoa(code)}}, resp.Headers...)
	for i := range d.headers {
		d.headers[i].Key = strings.ToLower(d.headers[i].Key)
	}
	eos := resp.Body == nil && len(resp.Trailers) == 0
	if f.cfg.ObservabilityMode && d.sendHeaders {
		f.sendObservability(d, headersMsg(d, eos))
		f.fwdHeaders(d)
		if eos {
			d.completeBody = true
			f.fwdEnd(d)
		}
		return
	}
	if eos {
		d.completeBody = true
	}
	if !f.processingComplete {
		f.onHeaders(d, eos)
	}
	if f.done {
		return
	}
	if !f.processingComplete && d.shouldRemoveContentLength() {
		d.headers.Del("content-length")
	}
	if d.noExternalProcess() {
		f.closeStreamMaybeGraceful(CloseNoResponseProcessing)
	}
	if !d.paused {
		f.fwdHeaders(d)
		if eos {
			f.fwdEnd(d)
		}
	}
}

// onHeaders is Filter::onHeaders.
func (f *filter) onHeaders(d *dirState, eos bool) {
	if !d.sendHeaders {
		return
	}
	switch f.openStream() {
	case openError, openIgnore:
		return
	}
	d.hdrHeld = true
	d.noBody = eos
	f.sendHeaders(d, eos)
}

func (f *filter) tooLarge(d *dirState) {
	if d.isReq {
		f.localReply(LocalPayloadTooLarge, http.StatusRequestEntityTooLarge, nil, []byte("Payload Too Large"), "request_payload_too_large")
		return
	}
	f.localReply(LocalResponseTooLarge, http.StatusInternalServerError, nil, []byte("Internal Server Error"), "response_payload_too_large")
}

// bufferData is StopIterationAndBuffer: the filter manager keeps the data
// and enforces the buffer limit.
func (f *filter) bufferData(d *dirState, data []byte) bool {
	d.buffered = append(d.buffered, data...)
	d.hasBuffered = true
	if len(d.buffered) > f.cfg.BufferLimit {
		f.tooLarge(d)
		return false
	}
	return true
}

// onData is Filter::onData.
// onBodyEnd handles the end of a direction's body: its trailers, or an empty end-of-stream
// chunk when the last data did not already carry end_of_stream.
func (f *filter) onBodyEnd(d *dirState, trailers Headers) {
	d.granted = false
	if len(trailers) > 0 {
		f.onTrailers(d, trailers)
	} else if !d.completeBody {
		f.onData(d, nil, true)
	}
}

func (f *filter) onData(d *dirState, data []byte, eos bool) {
	if f.done {
		return
	}
	if f.cfg.ObservabilityMode {
		if d.bodyMode == BodyStreamed {
			f.sendObservability(d, bodyMsg(d, data, eos))
		}
		f.fwdData(d, data)
		if eos {
			d.completeBody = true
			f.fwdEnd(d)
		}
		return
	}
	if eos {
		d.completeBody = true
	}
	if d.bodyReplaced {
		if eos {
			f.maybeEnd(d)
		}
		return
	}
	if f.processingComplete {
		f.fwdData(d, data)
		if eos {
			f.fwdEnd(d)
		}
		return
	}
	if d.cb == cbHeaders {
		d.paused = true
		if d.bodyMode == BodyBuffered {
			f.bufferData(d, data)
			return
		}
		d.buffered = append(d.buffered, data...)
		d.hasBuffered = true
		return
	}
	switch d.bodyMode {
	case BodyBuffered:
		if !f.bufferData(d, data) {
			return
		}
		d.paused = true
		if !eos {
			return
		}
		switch f.openStream() {
		case openError:
			return
		case openIgnore:
			f.release(d)
			return
		}
		f.sendBody(d, d.buffered, true, cbBufferedBody)
	case BodyStreamed:
		switch f.openStream() {
		case openError:
			return
		case openIgnore:
			f.fwdData(d, data)
			if eos {
				f.fwdEnd(d)
			}
			return
		}
		d.queue = append(d.queue, qchunk{data: append([]byte(nil), data...), eos: eos})
		f.sendBody(d, data, eos, cbStreamedBody)
		if eos {
			d.paused = true
		}
	case BodyBufferedPartial:
		if d.partialDone {
			d.hdrHeld = false
			f.fwdData(d, data)
			if eos {
				f.fwdEnd(d)
			}
			return
		}
		d.queue = append(d.queue, qchunk{data: append([]byte(nil), data...), eos: eos})
		d.paused = true
		if d.cb == cbPartialBody {
			return
		}
		if eos || d.queueBytes() > f.cfg.BufferLimit {
			f.sendPartial(d, d.queue[len(d.queue)-1].eos)
		}
	default:
		f.fwdData(d, data)
		if eos {
			f.fwdEnd(d)
		}
	}
}

// sendPartial consolidates the queue into one message (sendStreamChunk).
func (f *filter) sendPartial(d *dirState, eos bool) {
	switch f.openStream() {
	case openError:
		return
	case openIgnore:
		f.injectQueue(d)
		f.continueDir(d)
		return
	}
	all := f.consolidate(d)
	f.sendBody(d, all.data, eos, cbPartialBody)
	d.paused = true
}

func (f *filter) consolidate(d *dirState) qchunk {
	var all qchunk
	for _, c := range d.queue {
		all.data = append(all.data, c.data...)
		all.eos = c.eos
	}
	if len(d.queue) > 0 {
		d.queue = []qchunk{all}
	}
	return all
}

// injectQueue forwards every queued chunk, as clearAsyncState does.
func (f *filter) injectQueue(d *dirState) {
	if len(d.queue) == 0 {
		return
	}
	all := f.consolidate(d)
	d.queue = nil
	f.fwdData(d, all.data)
	if all.eos {
		f.fwdEnd(d)
	}
}

// onTrailers is Filter::onTrailers.
func (f *filter) onTrailers(d *dirState, trailers Headers) {
	if f.done {
		return
	}
	d.trailers = trailers.Clone()
	d.trailersAvail = true
	if f.processingComplete {
		d.completeBody = true
		f.release(d)
		return
	}
	if f.cfg.ObservabilityMode {
		if d.sendTrailers && !d.trailersSent {
			d.trailersSent = true
			f.sendObservability(d, trailersMsg(d))
		}
		d.completeBody = true
		f.release(d)
		return
	}
	bodyDelivered := d.completeBody
	d.completeBody = true
	if d.cb != cbIdle {
		d.paused = true
		return
	}
	if !bodyDelivered && ((d.hasBuffered && d.bodyMode == BodyBuffered) || (len(d.queue) > 0 && d.bodyMode == BodyBufferedPartial)) {
		switch f.openStream() {
		case openError:
			return
		case openIgnore:
			f.injectQueue(d)
			f.release(d)
			return
		}
		if d.bodyMode == BodyBuffered {
			f.sendBody(d, d.buffered, false, cbBufferedBody)
		} else {
			all := f.consolidate(d)
			f.sendBody(d, all.data, false, cbPartialBody)
		}
		d.paused = true
		return
	}
	if !d.sendTrailers {
		f.release(d)
		return
	}
	switch f.openStream() {
	case openError:
		return
	case openIgnore:
		f.release(d)
		return
	}
	f.sendTrailers(d)
	d.paused = true
}

// --- replies ---------------------------------------------------------------

// errSpurious marks Envoy's FailedPrecondition: a reply that does not fit
// the state.
type errSpurious struct{ msg string }

func (e errSpurious) Error() string { return e.msg }

func (f *filter) onReply(resp *extprocv3.ProcessingResponse, at time.Time) {
	rec := Record{At: at, Received: resp}
	if f.streamClosed || f.cfg.ObservabilityMode || f.processingComplete {
		rec.Ignored = true
		f.res.Exchange = append(f.res.Exchange, rec)
		if !f.cfg.ObservabilityMode {
			f.problem(ProblemLateReply, "reply after processing completed: "+KindOfResponse(resp).String())
		}
		return
	}
	if resp.GetOverrideMessageTimeout() != nil {
		if !f.onNewTimeout(resp) {
			rec.Ignored = true
		}
		f.res.Exchange = append(f.res.Exchange, rec)
		f.emit(Event{Kind: EventReceived, Message: KindOfResponse(resp), Received: resp})
		return
	}
	f.res.Exchange = append(f.res.Exchange, rec)
	f.emit(Event{Kind: EventReceived, Message: KindOfResponse(resp), Received: resp})

	if f.cfg.AllowModeOverride && resp.GetModeOverride() != nil && (f.dec.cb == cbHeaders || f.enc.cb == cbHeaders) {
		f.applyModeOverride(resp.GetModeOverride())
	}
	isLastBody := false
	var err error
	switch r := resp.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		f.setDynamicMetadata(resp)
		err = f.handleHeadersResponse(f.dec, r.RequestHeaders)
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		f.setDynamicMetadata(resp)
		err = f.handleHeadersResponse(f.enc, r.ResponseHeaders)
	case *extprocv3.ProcessingResponse_RequestBody:
		isLastBody = isLastBodyResponse(f.dec)
		f.setDynamicMetadata(resp)
		err = f.handleBodyResponse(f.dec, r.RequestBody)
	case *extprocv3.ProcessingResponse_ResponseBody:
		isLastBody = isLastBodyResponse(f.enc)
		f.setDynamicMetadata(resp)
		err = f.handleBodyResponse(f.enc, r.ResponseBody)
	case *extprocv3.ProcessingResponse_RequestTrailers:
		f.setDynamicMetadata(resp)
		err = f.handleTrailersResponse(f.dec, r.RequestTrailers)
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		f.setDynamicMetadata(resp)
		err = f.handleTrailersResponse(f.enc, r.ResponseTrailers)
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		if f.cfg.DisableImmediateResponse {
			err = errSpurious{"unhandled immediate response due to config disabled it"}
			break
		}
		f.setDynamicMetadata(resp)
		f.processingComplete = true
		f.finishCall(f.dec, cbIdle)
		f.finishCall(f.enc, cbIdle)
		f.closeStreamMaybeGraceful(CloseImmediateResponse)
		f.sendImmediateResponse(r.ImmediateResponse)
	default:
		err = errSpurious{"unhandled message"}
	}
	var sp errSpurious
	switch {
	case err == nil:
	case errors.As(err, &sp):
		f.problem(ProblemSpurious, fmt.Sprintf("%s reply: %s", KindOfResponse(resp), sp.msg))
		if f.cfg.FailureModeAllow {
			f.closeStream(CloseSpurious)
			f.clearAsyncState()
			f.processingComplete = true
		} else {
			f.handleErrorResponse(err, CloseSpurious)
		}
	default:
		f.problem(ProblemInvalidReply, err.Error())
		f.handleErrorResponse(err, CloseProcessingError)
	}
	f.closeIfLastResponse(resp, isLastBody)
}

func isLastBodyResponse(d *dirState) bool {
	if d.bodyMode == BodyStreamed && len(d.queue) > 0 {
		return d.queue[0].eos
	}
	return false
}

// closeIfLastResponse is closeGrpcStreamIfLastRespReceived (Envoy 1.37).
func (f *filter) closeIfLastResponse(resp *extprocv3.ProcessingResponse, isLastBody bool) {
	if f.stream == nil || f.streamClosed || f.cfg.DisableStreamCloseOptimization {
		return
	}
	last := false
	switch resp.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		last = (f.dec.noBody || (f.dec.bodyMode == BodyNone && !f.dec.sendTrailers)) && f.enc.noExternalProcess()
	case *extprocv3.ProcessingResponse_RequestBody:
		last = isLastBody && f.enc.noExternalProcess()
	case *extprocv3.ProcessingResponse_RequestTrailers:
		last = f.enc.noExternalProcess()
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		last = f.enc.noBody || (f.enc.bodyMode == BodyNone && !f.enc.sendTrailers)
	case *extprocv3.ProcessingResponse_ResponseBody:
		last = isLastBody
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		last = true
	}
	if last {
		f.closeStreamMaybeGraceful(CloseLastResponse)
	}
}

func (f *filter) applyModeOverride(p *extprocfilterv3.ProcessingMode) {
	m := f.cfg.Mode
	if p.GetRequestHeaderMode() != extprocfilterv3.ProcessingMode_DEFAULT {
		m.RequestHeader = HeaderMode(p.GetRequestHeaderMode())
	}
	if p.GetResponseHeaderMode() != extprocfilterv3.ProcessingMode_DEFAULT {
		m.ResponseHeader = HeaderMode(p.GetResponseHeaderMode())
	}
	if p.GetRequestTrailerMode() != extprocfilterv3.ProcessingMode_DEFAULT {
		m.RequestTrailer = HeaderMode(p.GetRequestTrailerMode())
	}
	if p.GetResponseTrailerMode() != extprocfilterv3.ProcessingMode_DEFAULT {
		m.ResponseTrailer = HeaderMode(p.GetResponseTrailerMode())
	}
	m.RequestBody = BodyMode(p.GetRequestBodyMode())
	m.ResponseBody = BodyMode(p.GetResponseBodyMode())
	if len(f.cfg.AllowedOverrideModes) > 0 {
		ok := false
		for _, a := range f.cfg.AllowedOverrideModes {
			if a.RequestBody == m.RequestBody && a.RequestTrailer == m.RequestTrailer &&
				a.ResponseHeader == m.ResponseHeader && a.ResponseBody == m.ResponseBody && a.ResponseTrailer == m.ResponseTrailer {
				ok = true
				break
			}
		}
		if !ok {
			return
		}
	}
	f.dec.setMode(m)
	f.enc.setMode(m)
}

func (f *filter) setDynamicMetadata(resp *extprocv3.ProcessingResponse) {
	md := resp.GetDynamicMetadata()
	if md == nil || len(f.cfg.ReceivingNamespaces) == 0 {
		return
	}
	for ns, v := range md.GetFields() {
		allowed := false
		for _, r := range f.cfg.ReceivingNamespaces {
			if r == ns {
				allowed = true
				break
			}
		}
		st := v.GetStructValue()
		if !allowed || st == nil {
			continue
		}
		mergeMetadata(f.dynMeta, ns, st)
		if f.res.DynamicMetadata == nil {
			f.res.DynamicMetadata = map[string]*structpb.Struct{}
		}
		mergeMetadata(f.res.DynamicMetadata, ns, st)
	}
}

// mergeMetadata merges st into the namespace ns of md as Envoy's StreamInfo does (the
// namespace's Struct MergeFrom st): each top-level field of st replaces the field of the same
// name whole, other fields stay. The Values are shared, not copied: the simulator never
// changes a Value after a reply is received, and a later merge replaces map entries instead
// of changing the Values in them.
func mergeMetadata(md map[string]*structpb.Struct, ns string, st *structpb.Struct) {
	cur, ok := md[ns]
	if !ok {
		md[ns] = &structpb.Struct{Fields: maps.Clone(st.GetFields())}
		return
	}
	if cur.Fields == nil {
		cur.Fields = make(map[string]*structpb.Value, len(st.GetFields()))
	}
	maps.Copy(cur.Fields, st.GetFields())
}

func (f *filter) clearRouteCache(d *dirState, c *extprocv3.CommonResponse) {
	if !d.isReq || c.GetHeaderMutation() == nil {
		return
	}
	clear := false
	switch f.cfg.RouteCacheAction {
	case "CLEAR":
		clear = true
	case "RETAIN":
	default:
		clear = c.GetClearRouteCache()
	}
	if clear && !d.hdrFwd {
		f.routeCache = true
	}
}

// handleHeadersResponse is ProcessorState::handleHeadersResponse.
func (f *filter) handleHeadersResponse(d *dirState, hr *extprocv3.HeadersResponse) error {
	if d.cb != cbHeaders {
		return errSpurious{"spurious message"}
	}
	c := hr.GetResponse()
	replace := c.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE
	if c.GetHeaderMutation() != nil {
		n, err := applyHeaderMutation(c.GetHeaderMutation(), &d.headers, replace, f.cfg.MutationRules, d.shouldRemoveContentLength())
		if n > 0 {
			f.problem(ProblemMutationRejected, fmt.Sprintf("%d header mutation(s) ignored by mutation rules", n))
		}
		if err != nil {
			return err
		}
	}
	f.clearRouteCache(d, c)
	f.finishCall(d, cbIdle)
	if replace {
		if c.GetBodyMutation() != nil {
			d.headers.Del("content-length")
			d.bodyReplaced = true
			d.buffered = applyBodyMutation(c.GetBodyMutation(), d.buffered)
			d.hasBuffered = true
		}
		d.queue = nil
		d.bodyMode = BodyNone
		d.sendTrailers = false
	} else {
		switch {
		case d.noBody:
		case d.completeBody && d.bodyMode != BodyNone:
			if d.hasBuffered {
				f.sendBody(d, d.buffered, !d.trailersAvail, cbBufferedBody)
				return nil
			}
		case d.bodyMode == BodyBuffered:
			return nil
		case d.bodyMode == BodyStreamed:
			if len(d.buffered) > 0 {
				chunk := d.buffered
				d.buffered = nil
				d.queue = append(d.queue, qchunk{data: chunk})
				f.sendBody(d, chunk, false, cbStreamedBody)
			}
			f.continueDir(d)
			return nil
		case d.bodyMode == BodyBufferedPartial:
			if len(d.buffered) > 0 {
				d.queue = append(d.queue, qchunk{data: d.buffered})
				d.buffered = nil
			}
			if d.queueBytes() > f.cfg.BufferLimit {
				all := f.consolidate(d)
				f.sendBody(d, all.data, false, cbPartialBody)
			}
			return nil
		}
		if d.sendTrailers && d.trailersAvail {
			f.sendTrailers(d)
			return nil
		}
	}
	d.hdrHeld = false
	f.continueDir(d)
	return nil
}

// handleBodyResponse is ProcessorState::handleBodyResponse.
func (f *filter) handleBodyResponse(d *dirState, br *extprocv3.BodyResponse) error {
	c := br.GetResponse()
	shouldContinue := false
	switch d.cb {
	case cbBufferedBody:
		if c.GetHeaderMutation() != nil && d.hdrHeld {
			if err := f.mutateHeaders(d, c); err != nil {
				return err
			}
		}
		if bm := c.GetBodyMutation(); bm != nil {
			if d.hdrHeld {
				if cl, ok := d.headers.Lookup("content-length"); ok {
					if n, err := strconv.Atoi(cl); err == nil && n != len(bm.GetBody()) {
						return errors.New("mismatch between content length and the length of the mutated body")
					}
				}
			}
			d.buffered = applyBodyMutation(bm, d.buffered)
		}
		f.finishCall(d, cbIdle)
		shouldContinue = true
	case cbStreamedBody:
		if c.GetBodyMutation().GetStreamedResponse() != nil {
			return errSpurious{"spurious message: streamed_response is received while body_mode_ is not FULL_DUPLEX_STREAMED"}
		}
		if len(d.queue) == 0 {
			return errSpurious{"spurious message"}
		}
		chunk := d.queue[0]
		d.queue = d.queue[1:]
		if bm := c.GetBodyMutation(); bm != nil {
			chunk.data = applyBodyMutation(bm, chunk.data)
		}
		shouldContinue = chunk.eos
		if len(chunk.data) > 0 {
			f.fwdData(d, chunk.data)
		}
		if len(d.queue) == 0 {
			f.finishCall(d, cbIdle)
		} else {
			f.finishCall(d, d.cb)
		}
		if chunk.eos {
			f.fwdEnd(d)
		}
	case cbPartialBody:
		if len(d.queue) == 0 {
			return errSpurious{"spurious message"}
		}
		chunk := d.queue[0]
		d.queue = d.queue[1:]
		if c.GetHeaderMutation() != nil && d.hdrHeld {
			if err := f.mutateHeaders(d, c); err != nil {
				return err
			}
		}
		if bm := c.GetBodyMutation(); bm != nil {
			chunk.data = applyBodyMutation(bm, chunk.data)
		}
		f.fwdData(d, chunk.data)
		f.finishCall(d, cbIdle)
		if chunk.eos {
			f.fwdEnd(d)
		}
		f.injectQueue(d)
		d.partialDone = true
		shouldContinue = true
	default:
		return errSpurious{"spurious message"}
	}
	f.clearRouteCache(d, c)
	d.hdrHeld = false
	if d.sendTrailers && d.trailersAvail && len(d.queue) == 0 {
		f.sendTrailers(d)
		return nil
	}
	if shouldContinue || (d.trailersAvail && len(d.queue) == 0) {
		f.continueDir(d)
	}
	return nil
}

func (f *filter) mutateHeaders(d *dirState, c *extprocv3.CommonResponse) error {
	replace := c.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE
	n, err := applyHeaderMutation(c.GetHeaderMutation(), &d.headers, replace, f.cfg.MutationRules, d.shouldRemoveContentLength())
	if n > 0 {
		f.problem(ProblemMutationRejected, fmt.Sprintf("%d header mutation(s) ignored by mutation rules", n))
	}
	return err
}

// handleTrailersResponse is ProcessorState::handleTrailersResponse.
func (f *filter) handleTrailersResponse(d *dirState, tr *extprocv3.TrailersResponse) error {
	if d.cb != cbTrailers {
		return errSpurious{"spurious message"}
	}
	if m := tr.GetHeaderMutation(); m != nil {
		n, err := applyHeaderMutation(m, &d.trailers, false, f.cfg.MutationRules, false)
		if n > 0 {
			f.problem(ProblemMutationRejected, fmt.Sprintf("%d trailer mutation(s) ignored by mutation rules", n))
		}
		if err != nil {
			return err
		}
	}
	f.finishCall(d, cbIdle)
	f.continueDir(d)
	return nil
}

func (f *filter) sendImmediateResponse(ir *extprocv3.ImmediateResponse) {
	code := http.StatusOK
	if ir.GetStatus() != nil {
		code = int(ir.GetStatus().GetCode())
	}
	if code < 200 {
		code = http.StatusOK
	}
	f.sentImmediate = true
	f.upCancel()
	f.localReply(LocalImmediate, code, ir.GetHeaders(), ir.GetBody(), ir.GetDetails())
}

func (f *filter) handleErrorResponse(err error, reason CloseReason) {
	f.processingComplete = true
	f.finishCall(f.dec, cbIdle)
	f.finishCall(f.enc, cbIdle)
	f.closeStream(reason)
	f.sentImmediate = true
	f.upCancel()
	f.localReply(LocalProcessingError, f.cfg.StatusOnError, nil, nil, err.Error())
}

// clearAsyncState resets both directions to idle and lets everything held
// continue, as Envoy does when it gives up on the processor.
func (f *filter) clearAsyncState() {
	for _, d := range []*dirState{f.dec, f.enc} {
		f.finishCall(d, cbIdle)
		f.injectQueue(d)
		f.continueDir(d)
	}
}

// onNewTimeout handles override_message_timeout; it reports whether a
// timer was restarted.
func (f *filter) onNewTimeout(resp *extprocv3.ProcessingResponse) bool {
	dur := resp.GetOverrideMessageTimeout()
	if err := dur.CheckValid(); err != nil || dur.AsDuration() < 0 {
		f.problem(ProblemOverrideIgnored, "override_message_timeout out of duration range")
		return false
	}
	ms := dur.AsDuration().Milliseconds()
	if ms < 1 || ms > f.cfg.MaxMessageTimeout.Milliseconds() {
		f.problem(ProblemOverrideIgnored, fmt.Sprintf("override_message_timeout %dms outside [1ms, max_message_timeout %v]", ms, f.cfg.MaxMessageTimeout))
		return false
	}
	restarted := false
	for _, d := range []*dirState{f.dec, f.enc} {
		if d.timerOn && !d.overrideUsed {
			d.timer.Reset(time.Duration(ms) * time.Millisecond)
			d.overrideUsed = true
			restarted = true
		}
	}
	if !restarted {
		f.problem(ProblemOverrideIgnored, "override_message_timeout with no timer running or a second override in the same state")
	}
	return restarted
}

func (f *filter) onMessageTimeout() {
	if f.done || f.processingComplete {
		return
	}
	f.problem(ProblemTimeout, "message_timeout expired")
	if f.cfg.FailureModeAllow {
		f.processingComplete = true
		f.closeStream(CloseMessageTimeout)
		f.clearAsyncState()
		return
	}
	f.processingComplete = true
	f.closeStream(CloseMessageTimeout)
	f.finishCall(f.dec, cbIdle)
	f.finishCall(f.enc, cbIdle)
	f.sentImmediate = true
	f.upCancel()
	f.localReply(LocalMessageTimeout, http.StatusGatewayTimeout, nil, nil, "ext_proc_error_per-message_timeout_exceeded")
}

// onStreamEnd handles the server ending the stream (Recv returned).
func (f *filter) onStreamEnd(err error) {
	if f.streamClosed {
		return
	}
	f.streamClosed = true
	f.closeMode = closeByServer
	code := streamCode(err)
	f.res.StreamCode = code
	if code == codes.OK {
		f.res.Stream = StreamServerClosed
		f.res.CloseReason = CloseServerClosed
		if f.processingComplete {
			return
		}
		f.processingComplete = true
		f.clearAsyncState()
		return
	}
	f.res.Stream = StreamServerError
	f.res.CloseReason = CloseGRPCError
	f.onGrpcError(err)
}

func (f *filter) onGrpcError(err error) {
	f.problem(ProblemGRPCError, err.Error())
	if f.processingComplete {
		return
	}
	if f.cfg.FailureModeAllow {
		f.processingComplete = true
		f.closeStream(CloseGRPCError)
		f.clearAsyncState()
		return
	}
	f.processingComplete = true
	f.finishCall(f.dec, cbIdle)
	f.finishCall(f.enc, cbIdle)
	f.closeStream(CloseGRPCError)
	st := status.Convert(err)
	f.sentImmediate = true
	f.upCancel()
	f.localReply(LocalProcessingError, f.cfg.StatusOnError, nil, nil,
		fmt.Sprintf("ext_proc_error_gRPC_error_%d{%s}", int(st.Code()), st.Message()))
}

// finish is what happens after the HTTP exchange: the gRPC stream's close, then the rate
// limit filter's stream-done call.
func (f *filter) finish() {
	f.awaitClose()
	f.chargeOnStreamDone()
}

// awaitClose finishes the gRPC side after the HTTP exchange: it waits for a
// graceful close (up to the remote-close timeout), completes a reset, and
// classifies how the stream ended.
func (f *filter) awaitClose() {
	s := f.stream
	if s == nil {
		return
	}
	switch f.closeMode {
	case closeDeferred:
		f.res.Stream = StreamDeferredReset
		f.sim.deferReset(s, f.cfg.DeferredCloseTimeout)
		return
	case closeGraceful:
		t := time.NewTimer(f.cfg.RemoteCloseTimeout)
		select {
		case <-s.recvDone:
			f.res.Stream = StreamHalfClosed
		case <-t.C:
			f.res.Stream = StreamHalfCloseTimedOut
			s.reset()
			<-s.recvDone
		}
		t.Stop()
	case closeReset:
		s.reset()
		<-s.recvDone
		f.res.Stream = StreamReset
	default:
		s.reset()
		<-s.recvDone
	}
	<-s.sendDone
	s.reset()
	final := s.finalErr()
	code := streamCode(final)
	if f.closeMode == closeReset && code != codes.Canceled {
		if code == codes.OK {
			f.res.Stream = StreamServerClosed
		} else {
			f.res.Stream = StreamServerError
		}
	}
	if f.closeMode != closeByServer {
		f.res.StreamCode = code
	}
	f.res.Exchange = append(f.res.Exchange, s.lateRecords()...)
}
