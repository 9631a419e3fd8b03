package extproc

import (
	"runtime/debug"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/quota"
)

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
	if p.dec.ticket.TracksQuota() {
		p.observeQuota(now)
	}
	var common *extprocv3.CommonResponse
	out := &p.out
	add := func(h *corev3.HeaderValueOption) {
		if common == nil {
			common = out.mutation()
		}
		common.HeaderMutation.SetHeaders = append(common.HeaderMutation.SetHeaders, h)
	}
	pol := p.srv.settingsOf(p.snap)
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
	} else if bodyComing && p.srv.settingsOf(p.snap).AllowModeOverride {
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
	// The request is over: the attempts before its last were retried (the last one's outcome is
	// the request's, below).
	p.endAttempts()
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

// observeQuota reads the provider's rate-limit headers (x-ratelimit-*, anthropic-ratelimit-*)
// into its quota, for a provider whose policy follows them.
func (p *processor) observeQuota(now time.Time) {
	var r quota.Reading
	invalid := 0
	for _, h := range p.headers {
		if known, err := quota.ParseHeader(h.Key, headerValue(h), now, &r); known && err != nil {
			invalid++
		}
	}
	p.dec.ticket.ObserveQuota(&r, invalid, now)
}
