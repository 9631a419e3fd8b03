package policy

import (
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/quota"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// Outcome is what happened to an admitted request, reported once when its stream ends.
type Outcome struct {
	// Status is the upstream response status, 0 when the stream ended without response headers.
	Status int
	// TTFB is admission to the first token: the arrival of the first response body chunk with
	// generated content (for a stream, the first event with generated text; for a JSON body,
	// its first byte). A response whose body was not read has its Headers time here, and a read
	// body that ended without any content the time it ended. 0 without response headers.
	// slow_call_measure: ttfb compares it with slow_call_duration.
	TTFB time.Duration
	// Headers is admission to the response headers (0 without response headers).
	Headers time.Duration
	// Duration is admission to the end of the stream.
	Duration time.Duration
	// StreamError is an error the response body reported although the status said success
	// (an error event inside a 200 stream, or a 200 JSON body with an error object).
	StreamError StreamError
	// Cancelled reports that the client went away before the response was complete.
	Cancelled bool
	// RetryAfter is the upstream retry-after on a 429 or 503.
	RetryAfter time.Duration
	// Usage is what the response reported.
	Usage Usage
	// Model is the model the response says answered (its model field), empty when it did not
	// say; spend is priced by it.
	Model string
	// InterToken is the mean time between tokens after the first in a streamed response (0
	// when it did not stream or had fewer than two tokens); adaptive limits read it.
	InterToken time.Duration
	// At is when the request ended, read from the engine's clock (Engine.Now) by a caller that
	// reads it anyway; zero: Done reads the clock itself.
	At time.Time
}

// StreamError classifies an error reported inside a successful response.
type StreamError uint8

const (
	// StreamErrorNone: the body reported no error.
	StreamErrorNone StreamError = iota
	// StreamErrorServer: the provider failed the call (overloaded, server error, or an error of
	// unknown type); judged by the breaker's stream_error verdict (a failure by default).
	StreamErrorServer
	// StreamErrorRateLimited: a rate-limit error; judged as an upstream 429 (rate_limited_as).
	StreamErrorRateLimited
	// StreamErrorClient: the request was at fault (an invalid request); judged as a 400.
	StreamErrorClient
)

// Usage is the token use a response reported.
type Usage struct {
	Prompt, Completion, Total, Cached, Reasoning int64
	// Known: the response reported complete usage.
	Known bool
	// PromptKnown: the prompt count was reported even if the completion count was not.
	PromptKnown bool
	// ContentBytes is the generated text seen, for a partial estimate when usage is unknown.
	ContentBytes int64
	// AudioMillis is the audio the response reported it was billed for by duration, in
	// milliseconds (0: none reported), priced per second.
	AudioMillis int64
}

// Settled is how a finished request was charged.
type Settled struct {
	// Prompt and Completion are the settled parts; Total their sum.
	Prompt, Completion, Total int64
	// Estimated reports that the numbers are a partial estimate, not reported usage.
	Estimated bool
	// Clamped reports that the response claimed more than the request could have cost and was
	// settled at that bound instead.
	Clamped bool
	// Cost is what the request was charged in its spend budgets (HasCost: a spend budget
	// applied to it).
	Cost    spend.Micros
	HasCost bool
}

// maxReported bounds any one reported count before arithmetic (2^40, about 10^12 tokens).
const maxReported = 1 << 40

// Settle computes what a request with this outcome is charged: reported usage when known,
// else a partial estimate — the prompt (reported or estimated) plus completion tokens estimated
// from the content seen — for responses that started, the estimated prompt for a request
// cancelled before any response, and nothing for a failure without usage (it was not served).
//
// Reported numbers are not trusted blindly: negative counts count as zero, a total below its
// parts is ignored (a total above them is charged: it covers tokens the parts do not name), and
// each part is clamped to what the request could have cost (Estimate.MaxPrompt and
// MaxCompletion). The result is never negative.
func (t *Ticket) Settle(o Outcome) Settled {
	u := o.Usage
	// Negative counts are zero; beyond maxReported (far more than any bound) is maxReported, so
	// the sums below cannot overflow.
	sane := func(v int64) int64 { return min(max(v, 0), maxReported) }
	var st Settled
	switch {
	case u.Known:
		prompt, completion := sane(u.Prompt), sane(u.Completion)
		if total := sane(u.Total); total > prompt+completion {
			completion = total - prompt
		}
		st = Settled{Prompt: prompt, Completion: completion}
	default:
		prompt := t.est.Prompt
		if u.PromptKnown {
			prompt = sane(u.Prompt)
		}
		switch {
		case o.Status == 0 && o.Cancelled:
			st = Settled{Prompt: prompt, Estimated: true}
		case o.Status == 0 || (o.Status >= 400 && !u.PromptKnown):
			return Settled{Estimated: true}
		default:
			bpt := t.est.BytesPerToken
			if bpt <= 0 {
				bpt = 4
			}
			st = Settled{Prompt: prompt, Completion: int64(float64(sane(u.ContentBytes))/bpt + 0.5), Estimated: true}
		}
	}
	if t.est.Bounded && st.Prompt > t.est.MaxPrompt {
		st.Prompt, st.Clamped = t.est.MaxPrompt, true
	}
	if t.est.Bounded && st.Completion > t.est.MaxCompletion {
		st.Completion, st.Clamped = t.est.MaxCompletion, true
	}
	st.Total = st.Prompt + st.Completion
	return st
}

// Done releases everything the ticket holds and settles it against outcome o: slots back,
// budgets corrected from the estimate to the real use, the breaker told how the call went, the
// estimator taught the model's real prompt ratio. Idempotent; never blocks. The release is
// deferred before any settlement work, so slots, references and the in-flight count come back
// even if settlement fails.
func (t *Ticket) Done(o Outcome) (settled Settled) {
	if !t.active || !t.done.CompareAndSwap(false, true) {
		return Settled{}
	}
	e, s := t.engine, t.snap
	now := o.At
	if now.IsZero() {
		now = e.clock.Now()
	}
	recorded := false
	defer func() {
		if t.brk != nil && !recorded {
			t.brk.Release(t.permit)
		}
		for i := 0; i < t.n; i++ {
			if in := t.insts[i]; in.family.dyn != nil {
				in.family.dyn.release(in, now)
			}
		}
		e.inflight.Add(-1)
	}()
	e.sched.Release(t.set[:t.n], t.held[:t.n], t.grantedAt, now)
	t.observeAdaptive(o, now)
	if t.brk != nil {
		bs := s.providers[t.dims.Provider].breakers
		outcome, d, openFor := bs.judge.outcome(o)
		t.brk.RecordDetail(t.permit, outcome, d, now, breaker.Detail{Status: o.Status, Provider: bs.provider})
		recorded = true
		bs.holdFor(t.dims.Tenant, o.Status, openFor, t.brk, now)
	}
	settled = t.Settle(o)
	settled.Cost, settled.HasCost = t.settleSpend(o, settled, now)
	t.settleQuota(quota.Need{Prompt: settled.Prompt, Completion: settled.Completion}, now)
	t.recordUsage(o, settled, now)
	switch t.mode {
	case ticketShared:
		e.cluster.store.Settle(t.shared.lease, settled.Total, t.shared.windows)
	case ticketTracked:
		e.cluster.store.Settle(t.shared.lease, settled.Total, nil)
		fallthrough
	default:
		for i := 0; i < t.n; i++ {
			in := t.insts[i]
			if in.rpm != nil && t.charged[i][winRPM] == chargedOutage {
				// A request counted here while the lease could not be used counts in the
				// fleet's window too, once Redis answers.
				if f := in.fleet; f != nil && f.ls != nil {
					f.ls.AddBack(f.idx[winRPM], t.rpm[i].Amount())
				}
			}
			if in.tpm != nil {
				t.settleWindow(i, winTPM, t.tpm[i], settled.Total, now)
			}
			if in.tpd != nil {
				t.settleWindow(i, winTPD, t.tpd[i], settled.Total, now)
			}
		}
	}
	f := s.features[t.dims.Feature]
	f.rec.Settled(settled.Prompt, settled.Completion, settled.Clamped)
	if settled.Clamped {
		e.logClamp(f.name, t.dims.Model, o.Usage, t.est)
	}
	if o.Usage.Known {
		if t.est.Total > 0 {
			f.rec.EstimateRatio(float64(settled.Total) / float64(t.est.Total))
		}
		// Learn from the text part only: media items have fixed costs of their own.
		if text := settled.Prompt - t.est.Media; t.bytes > 0 && text > 0 && !settled.Clamped && s.estimation.learn {
			e.est.learn(t.dims.Model, float64(t.bytes)/float64(text), s.startRatio(t.dims.Model), s.estimation)
		}
	} else if o.Status != 0 {
		f.rec.UsageUnknown()
	}
	return settled
}

// logClamp logs a clamped settlement, at most once a minute: one response claiming absurd usage
// is worth a line, a provider doing it on every response is what the metric is for.
func (e *Engine) logClamp(feature, model string, u Usage, est Estimate) {
	if !e.logDue(&e.clampLog) {
		return
	}
	e.log.Warn("reported usage is more than the request could cost; settled at the bound (further cases this minute are only counted in llm_bulkhead_usage_clamped_total)",
		"feature", feature, "model", model, "reported_prompt", u.Prompt, "reported_completion", u.Completion,
		"reported_total", u.Total, "max_prompt", est.MaxPrompt, "max_completion", est.MaxCompletion)
}
