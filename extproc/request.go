package extproc

import (
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"time"
	"unsafe"

	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

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
	p.req.arrived = p.clock()
	if q := p.snap.QuotaPath; q != "" && path == q && p.method() == "GET" {
		return p.quotaReply()
	}
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
	if bodyComing && p.srv.settingsOf(p.snap).AllowModeOverride && p.reqBodyMode == extprocfilterv3.ProcessingMode_BUFFERED {
		// Decided without the body: tell Envoy not to buffer and send it. Both body modes must be
		// given, or Envoy would take the response body mode as NONE.
		resp.ModeOverride = p.override(extprocfilterv3.ProcessingMode_NONE, p.resBodyMode)
		p.reqBodyMode = extprocfilterv3.ProcessingMode_NONE
	}
	return resp
}

// wantBody reports whether deciding needs the request body: when a rule reads it, when the
// request's estimate (its prompt size and output limit) counts against a limit, a budget or a
// provider's quota, or when a re-route may rewrite it.
func (p *processor) wantBody() bool {
	s := p.snap
	if p.req.api.Multipart() {
		// An audio upload is multipart/form-data, up to 25 MB: nothing in it is read (no rule
		// reads a form field), so it is never buffered; its size comes from content-length.
		return false
	}
	if s.NeedsBodyForRules || s.TokenLimits || s.SpendLimits || s.ProviderQuota || s.RewritesModels {
		// RewritesModels: a re-route may have to rewrite the body's model, which only a reply to
		// the buffered body can do.
		return true
	}
	if p.srv.settingsOf(s).InjectIncludeUsage && p.req.api.IncludeUsage() {
		return true
	}
	return p.requiresValidJSON()
}

func (p *processor) requiresValidJSON() bool {
	if p.req.api.Multipart() {
		return false // an audio upload is multipart/form-data, never JSON
	}
	for _, prefix := range p.srv.settingsOf(p.snap).RequireValidJSON {
		if strings.HasPrefix(p.req.path, prefix) {
			return true
		}
	}
	return false
}

// holdsBody reports whether the stream holds the request body it receives: its request waits
// for a buffered body to be decided.
func (p *processor) holdsBody() bool {
	return p.phase == phaseRequest && p.reqBodyMode == extprocfilterv3.ProcessingMode_BUFFERED
}

func (p *processor) onRequestBody(b *extprocv3.HttpBody) *extprocv3.ProcessingResponse {
	if !p.holdsBody() {
		return continueRequestBody
	}
	// The codec counted the body as it arrived (and did not copy one that does not fit), or
	// it is counted now.
	kept := p.req.counted == bodyKept || (p.req.counted == bodyUncounted && p.holdBody(len(b.Body)))
	if !kept {
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
// that holding them would pass it: for a body the codec did not count as it arrived (see recv).
// Envoy has already sent the body, but a refused one is dropped at once instead of waiting,
// perhaps for seconds in a queue, with the others.
func (p *processor) holdBody(n int) bool {
	limit := p.srv.settingsOf(p.snap).MaxBufferedBodyBytes
	if limit <= 0 {
		return true
	}
	if !takeBody(&p.srv.buffered, limit, int64(n)) {
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
	if timeout, ok := p.requestTimeout(); ok {
		r.Deadline = p.req.arrived.Add(timeout)
	}
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
	p.followAttempts()
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
	st := p.srv.settingsOf(p.snap)
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
	// The client's API key stays here when the policy says Envoy sets the provider's key. The
	// snapshot's slice is shared, and full: an append below copies it.
	mut.RemoveHeaders = s.StripHeaders()
	if p.srv.settingsOf(s).StripAcceptEncoding && p.resBodyMode != extprocfilterv3.ProcessingMode_NONE {
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
		body, changed := llmapi.EditBody(p.req.api, p.req.body, &p.req.fields, model, p.srv.settingsOf(s).InjectIncludeUsage)
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
	st := p.srv.settingsOf(p.snap)
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

// quotaReply answers a client's question about its own limits (quota_endpoint): the caller is
// classified as its LLM requests are, and gets its compartments' limits and what is left of
// them as JSON. The request is answered here and never forwarded; it is not an LLM call, so it
// counts against nothing.
func (p *processor) quotaReply() *extprocv3.ProcessingResponse {
	p.phase = phaseDone
	q := p.snap.ClientQuota(p.snap.Classify(p), p.clock())
	body, err := json.Marshal(q)
	status := typev3.StatusCode_OK
	if err != nil {
		body, status = []byte(`{"error":{"message":"the quota could not be written"}}`), typev3.StatusCode_InternalServerError
	}
	headers := []*corev3.HeaderValueOption{setHeader("content-type", "application/json"), setHeader("cache-control", "no-store")}
	if id := refusalRequestID(p.req.id); id != "" {
		headers = append(headers, setHeader(HeaderRequestID, id))
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status: &typev3.HttpStatus{Code: status}, Headers: &extprocv3.HeaderMutation{SetHeaders: headers}, Body: body,
	}}}
}
