package extproc

import (
	"strconv"
	"time"
	"unsafe"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// Header names the server reads and writes. They are part of the product's contract.
const (
	HeaderFeature     = "x-bulkhead-feature"
	HeaderCompartment = "x-bulkhead-compartment"
	HeaderReason      = "x-bulkhead-reason"
	HeaderProvider    = "x-llm-provider"
	HeaderRetryAfter  = "retry-after"
	HeaderRequestID   = "x-request-id"
	// HeaderRetryAfterMs is retry-after in milliseconds; the OpenAI and Anthropic SDKs read it
	// before retry-after.
	HeaderRetryAfterMs = "retry-after-ms"
	// HeaderShouldRetry: false tells the OpenAI and Anthropic SDKs not to retry a refusal.
	HeaderShouldRetry = "x-should-retry"
	// HeaderAnthropicRequestID is where the Anthropic SDK reads a request id (Error.RequestID).
	HeaderAnthropicRequestID = "request-id"
	// HeaderAmznRequestID is where the AWS SDKs read a request id; HeaderAmznErrorType names
	// the exception of an error response (ThrottlingException, ServiceUnavailableException,
	// ValidationException), which they raise as its own type.
	HeaderAmznRequestID = "x-amzn-requestid"
	HeaderAmznErrorType = "x-amzn-errortype"
	// HeaderRemainingTokens and HeaderResetTokens mirror OpenAI's rate-limit headers for the
	// tightest per-minute token budget of the request's compartments.
	HeaderRemainingTokens = "x-ratelimit-remaining-tokens"
	HeaderResetTokens     = "x-ratelimit-reset-tokens"
	// HeaderSpendReset is when the spend budget that refused a request resets (the end of its
	// window), in RFC 3339 with the offset of the policy's time_zone.
	HeaderSpendReset = "x-bulkhead-spend-reset"
)

// Plain CONTINUE replies, one of each type, shared by every stream: most messages need nothing
// more, and a message that is never changed after it is built may be marshalled by many
// streams at once. Code that adds to a reply builds its own with headersReply or bodyReply.
var (
	continueRequestHeaders   = headersReply(true, nil)
	continueResponseHeaders  = headersReply(false, nil)
	continueRequestBody      = bodyReply(true, nil)
	continueResponseBody     = bodyReply(false, nil)
	continueRequestTrailers  = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
	continueResponseTrailers = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
)

// passthroughReply is the shared reply of the matching type that lets a message continue
// unchanged. It must not be modified.
func passthroughReply(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	switch req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return continueRequestHeaders
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return continueResponseHeaders
	case *extprocv3.ProcessingRequest_RequestBody:
		return continueRequestBody
	case *extprocv3.ProcessingRequest_ResponseBody:
		return continueResponseBody
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return continueRequestTrailers
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return continueResponseTrailers
	}
	return nil
}

// A reply's messages are allocated together, one allocation per reply instead of one per
// message: the reply is built by one stream, sent once and then dropped whole.
type (
	headersMem struct {
		resp extprocv3.ProcessingResponse
		req  extprocv3.ProcessingResponse_RequestHeaders
		res  extprocv3.ProcessingResponse_ResponseHeaders
		hr   extprocv3.HeadersResponse
	}
	bodyMem struct {
		resp extprocv3.ProcessingResponse
		req  extprocv3.ProcessingResponse_RequestBody
		res  extprocv3.ProcessingResponse_ResponseBody
		br   extprocv3.BodyResponse
	}
	// mutationMem is a CommonResponse with a header mutation that has room for
	// mutationHeaders set_headers without growing.
	mutationMem struct {
		common extprocv3.CommonResponse
		mut    extprocv3.HeaderMutation
		set    [mutationHeaders]*corev3.HeaderValueOption
	}
	headerMem struct {
		opt corev3.HeaderValueOption
		val corev3.HeaderValue
	}
)

// mutationHeaders is the most headers a reply of an admitted request sets: feature,
// compartment, provider and content-length on the request; compartment and two rate-limit
// headers on the response.
const mutationHeaders = 4

// replyMem is the memory of the replies a stream builds for its admitted request. gRPC
// marshals a reply inside Send, before the stream's next message is read, so every reply of a
// stream is built in the same memory and none allocates: a reply built here is valid until
// the stream's next message is handled (Server.Process). Each message starts with begin.
type replyMem struct {
	headers headersMem
	body    bodyMem
	mut     mutationMem
	set     [mutationHeaders]headerMem
	nset    int
	// vals holds the header values formatted for the current reply (numbers and durations).
	vals  [48]byte
	nvals int
	// meta is the dynamic metadata's wire form; its array is kept from reply to reply.
	meta []byte
}

// begin makes all of m available to the current message's reply.
func (m *replyMem) begin() { m.nset, m.nvals = 0, 0 }

// sent forgets what the reply, once handed to gRPC, referenced beyond the stream's own memory:
// a body mutation holds a whole request body, which must not stay reachable while the request
// runs upstream.
func (m *replyMem) sent() { m.mut.common.BodyMutation = nil }

// headersReply is headersReply built in m.
func (m *replyMem) headersReply(request bool, common *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	m.headers = headersMem{}
	return m.headers.build(request, common)
}

// bodyReply is bodyReply built in m.
func (m *replyMem) bodyReply(request bool, common *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	m.body = bodyMem{}
	return m.body.build(request, common)
}

// mutation is mutation built in m: a CommonResponse whose header mutation sets nothing yet.
func (m *replyMem) mutation() *extprocv3.CommonResponse {
	m.mut = mutationMem{}
	return m.mut.build()
}

// setHeader is setHeader built in m; value is read only when the reply is marshalled.
func (m *replyMem) setHeader(key string, value []byte) *corev3.HeaderValueOption {
	if m.nset == len(m.set) {
		return setHeader(key, string(value))
	}
	h := &m.set[m.nset]
	m.nset++
	*h = headerMem{}
	return h.build(key, value)
}

// setString sets key to value; value's bytes are shared, not copied.
func (m *replyMem) setString(key, value string) *corev3.HeaderValueOption {
	return m.setHeader(key, stringBytes(value))
}

// setInt sets key to the decimal form of v.
func (m *replyMem) setInt(key string, v int64) *corev3.HeaderValueOption {
	return m.setHeader(key, m.format(strconv.AppendInt(m.vals[m.nvals:m.nvals], v, 10)))
}

// setReset sets key to a time until reset in OpenAI's form (formatReset).
func (m *replyMem) setReset(key string, d time.Duration) *corev3.HeaderValueOption {
	return m.setHeader(key, m.format(appendReset(m.vals[m.nvals:m.nvals], d)))
}

// formatReset writes a duration the way OpenAI's x-ratelimit-reset-* headers do ("6m0s",
// "1.5s", "250ms"): Go's Duration text rounded to milliseconds.
func formatReset(d time.Duration) string {
	return d.Round(time.Millisecond).String()
}

// appendReset appends formatReset(d) to b, without allocating when b has room:
// Duration.String is inlined here, so the string it returns does not escape and is built on
// the stack (TestAppendResetDoesNotAllocate).
func appendReset(b []byte, d time.Duration) []byte {
	return append(b, d.Round(time.Millisecond).String()...)
}

// format takes b, just appended at the free part of vals, as a formatted value: it stays in
// vals when it fitted there (appending beyond the array's end moved it elsewhere).
func (m *replyMem) format(b []byte) []byte {
	if len(b) > 0 && len(b) <= len(m.vals)-m.nvals && &b[0] == &m.vals[m.nvals] {
		m.nvals += len(b)
	}
	return b[:len(b):len(b)]
}

func headersReply(request bool, common *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	return new(headersMem).build(request, common)
}

func bodyReply(request bool, common *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	return new(bodyMem).build(request, common)
}

// mutation returns a CommonResponse whose header mutation sets headers (appending more does
// not allocate up to mutationHeaders in all).
func mutation(headers ...*corev3.HeaderValueOption) *extprocv3.CommonResponse {
	m := new(mutationMem)
	c := m.build()
	m.mut.SetHeaders = append(m.mut.SetHeaders, headers...)
	return c
}

// setHeader returns a header_mutation entry that sets key to value, replacing any value the
// message had. The raw value shares value's bytes: strings are immutable and marshalling only
// reads them.
func setHeader(key, value string) *corev3.HeaderValueOption {
	return new(headerMem).build(key, stringBytes(value))
}

// stringBytes returns s's bytes without copying them. They must not be written: a header's raw
// value is only read, by marshalling.
func stringBytes(s string) []byte { return unsafe.Slice(unsafe.StringData(s), len(s)) }

// build links m, which must be zero, into a reply to request or response headers.
func (m *headersMem) build(request bool, common *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	m.hr.Response = common
	if request {
		m.req.RequestHeaders = &m.hr
		m.resp.Response = &m.req
	} else {
		m.res.ResponseHeaders = &m.hr
		m.resp.Response = &m.res
	}
	return &m.resp
}

// build links m, which must be zero, into a reply to a request or response body.
func (m *bodyMem) build(request bool, common *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	m.br.Response = common
	if request {
		m.req.RequestBody = &m.br
		m.resp.Response = &m.req
	} else {
		m.res.ResponseBody = &m.br
		m.resp.Response = &m.res
	}
	return &m.resp
}

// build links m, which must be zero, into a CommonResponse whose header mutation sets nothing
// yet and has room for mutationHeaders headers.
func (m *mutationMem) build() *extprocv3.CommonResponse {
	m.mut.SetHeaders = m.set[:0]
	m.common.HeaderMutation = &m.mut
	return &m.common
}

// build links m, which must be zero, into a header_mutation entry that sets key to value.
func (m *headerMem) build(key string, value []byte) *corev3.HeaderValueOption {
	m.val.Key = key
	m.val.RawValue = value
	m.opt.Header = &m.val
	m.opt.AppendAction = corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD
	return &m.opt
}

// refusalStatus is the HTTP status of a refusal in the dialect of the API the client called:
// 429 for budgets and rates, 503 when there is no capacity (Anthropic's overloaded is 529), 400
// for a body that cannot be read, 401 for an API key that is missing or unknown.
func refusalStatus(r policy.Reason, d llmapi.Dialect) int {
	switch r {
	case policy.ReasonTokenBudget, policy.ReasonRateLimit, policy.ReasonSpendBudget, policy.ReasonProviderQuota:
		return 429
	case policy.ReasonBadRequest:
		return 400
	case policy.ReasonUnknownKey:
		return 401
	}
	if d == llmapi.DialectAnthropic {
		return 529
	}
	return 503
}

// refusal is what a refusal's reply says besides the decision.
type refusal struct {
	// requestID is the request's id (refusalRequestID): sent back in headers and the body.
	requestID string
	// now is the server's time, for Anthropic's reset timestamps.
	now time.Time
	// noRetryAbove is refusals.no_retry_above (0: never say not to retry).
	noRetryAbove time.Duration
	// rateLimitHeaders is refusals.ratelimit_headers.
	rateLimitHeaders bool
}

// refusalBody writes the error JSON in the format of the API the client called, so the
// client's own SDK raises its usual error types. Anthropic's error shape has a top-level
// request_id; OpenAI's and Azure's have no field for it, so it is an extra member of the error
// object (SDKs keep unknown members: openai-go in Error.JSON.ExtraFields). Google's carries
// the reason in an ErrorInfo and the wait in a RetryInfo detail, as Google's own APIs do;
// AWS's names the exception in the x-amzn-errortype header (bedrockException) and holds only
// the message.
func refusalBody(d policy.Decision, dialect llmapi.Dialect, requestID string) []byte {
	msg := d.Message()
	switch dialect {
	case llmapi.DialectAnthropic:
		typ := byKind(d.Reason, "rate_limit_error", "invalid_request_error", "authentication_error", "overloaded_error")
		b := []byte(`{"type":"error","error":{"type":`)
		b = strconv.AppendQuote(b, typ)
		b = append(b, `,"message":`...)
		b = llmapi.AppendJSONString(b, msg)
		b = append(b, '}')
		if requestID != "" {
			b = append(b, `,"request_id":`...)
			b = llmapi.AppendJSONString(b, requestID)
		}
		return append(b, '}')
	case llmapi.DialectGemini:
		status := byKind(d.Reason, "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNAUTHENTICATED", "UNAVAILABLE")
		b := []byte(`{"error":{"code":`)
		b = strconv.AppendInt(b, int64(refusalStatus(d.Reason, dialect)), 10)
		b = append(b, `,"message":`...)
		b = llmapi.AppendJSONString(b, msg)
		b = append(b, `,"status":"`...)
		b = append(b, status...)
		b = append(b, `","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":`...)
		b = strconv.AppendQuote(b, string(d.Reason))
		b = append(b, `,"domain":"llm-bulkhead"`...)
		if requestID != "" {
			b = append(b, `,"metadata":{"request_id":`...)
			b = llmapi.AppendJSONString(b, requestID)
			b = append(b, '}')
		}
		b = append(b, '}')
		if retryable(d.Reason) {
			b = append(b, `,{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"`...)
			b = appendProtoDuration(b, time.Duration(retryAfterMillis(d))*time.Millisecond)
			b = append(b, `"}`...)
		}
		return append(b, "]}}"...)
	case llmapi.DialectBedrock:
		b := []byte(`{"message":`)
		b = llmapi.AppendJSONString(b, msg)
		return append(b, '}')
	}
	typ := "server_overloaded"
	switch d.Reason {
	case policy.ReasonTokenBudget, policy.ReasonRateLimit, policy.ReasonProviderQuota:
		typ = "rate_limit_exceeded"
	case policy.ReasonSpendBudget:
		// OpenAI's own error for a spending limit reached.
		typ = "insufficient_quota"
	case policy.ReasonBadRequest, policy.ReasonUnknownKey:
		// OpenAI's type for a bad request and for an invalid API key alike.
		typ = "invalid_request_error"
	}
	code := string(d.Reason)
	if dialect == llmapi.DialectAzure {
		// Azure OpenAI's codes: "429" for every rate or quota limit, a name otherwise.
		code = byKind(d.Reason, "429", "BadRequest", "401", "ServiceUnavailable")
	}
	b := []byte(`{"error":{"message":`)
	b = llmapi.AppendJSONString(b, msg)
	b = append(b, `,"type":`...)
	b = strconv.AppendQuote(b, typ)
	b = append(b, `,"code":`...)
	b = strconv.AppendQuote(b, code)
	b = append(b, `,"param":null`...)
	if dialect == llmapi.DialectAzure {
		b = append(b, `,"innererror":{"code":`...)
		b = strconv.AppendQuote(b, string(d.Reason))
		b = append(b, '}')
	}
	if requestID != "" {
		b = append(b, `,"request_id":`...)
		b = llmapi.AppendJSONString(b, requestID)
	}
	return append(b, "}}"...)
}

// appendProtoDuration appends d in the JSON form of a google.protobuf.Duration: seconds with
// up to nine decimals and an "s" ("7s", "0.250s").
func appendProtoDuration(b []byte, d time.Duration) []byte {
	b = strconv.AppendInt(b, int64(d/time.Second), 10)
	if frac := d % time.Second; frac > 0 {
		b = append(b, '.')
		digits := strconv.AppendInt(nil, int64(frac)+int64(time.Second), 10)[1:]
		for len(digits) > 1 && digits[len(digits)-1] == '0' {
			digits = digits[:len(digits)-1]
		}
		b = append(b, digits...)
	}
	return append(b, 's')
}

// bedrockException is the AWS exception a Bedrock refusal names in x-amzn-errortype, which
// the AWS SDKs turn into their error types (ThrottlingException is retried by them).
func bedrockException(r policy.Reason) string {
	return byKind(r, "ThrottlingException", "ValidationException", "UnrecognizedClientException", "ServiceUnavailableException")
}

// byKind names a refusal by its kind: limited for a rate or a budget (a 429), bad for a body
// that cannot be read (a 400), unauthenticated for an API key missing or unknown (a 401),
// unavailable for no capacity (a 503).
func byKind(r policy.Reason, limited, bad, unauthenticated, unavailable string) string {
	switch r {
	case policy.ReasonTokenBudget, policy.ReasonRateLimit, policy.ReasonSpendBudget, policy.ReasonProviderQuota:
		return limited
	case policy.ReasonBadRequest:
		return bad
	case policy.ReasonUnknownKey:
		return unauthenticated
	}
	return unavailable
}

// retryable reports whether a retry of the refused request can succeed later: not for a body
// that cannot be read, nor for an API key that is missing or unknown, whose refusals say
// nothing of when to retry.
func retryable(r policy.Reason) bool {
	return r != policy.ReasonBadRequest && r != policy.ReasonUnknownKey
}

// retryAfterMillis is the retry-after-ms of a refusal: its wait in milliseconds, rounded up.
// A refusal that knows no wait says 1000, as its retry-after says 1 (a client told 0 would
// retry at once, into the same refusal).
func retryAfterMillis(d policy.Decision) int64 {
	if d.RetryAfter <= 0 {
		return 1000
	}
	return int64((d.RetryAfter + time.Millisecond - 1) / time.Millisecond)
}

// immediateReply refuses a request with the degradation contract's status, headers and body:
// x-bulkhead-reason and -compartment, retry-after and retry-after-ms (the SDKs prefer the
// latter), x-should-retry: false when the wait is longer than the policy's bound, the request
// id, and on a 429 by a rate or budget the refusing window's limit, remaining and reset in
// the rate-limit headers of the API called.
func immediateReply(d policy.Decision, dialect llmapi.Dialect, r refusal) *extprocv3.ProcessingResponse {
	status := refusalStatus(d.Reason, dialect)
	headers := make([]*corev3.HeaderValueOption, 0, 16)
	headers = append(headers,
		setHeader("content-type", "application/json"),
		setHeader(HeaderReason, string(d.Reason)),
	)
	if dialect == llmapi.DialectBedrock {
		headers = append(headers, setHeader(HeaderAmznErrorType, bedrockException(d.Reason)))
	}
	if d.Compartment != "" {
		headers = append(headers, setHeader(HeaderCompartment, d.Compartment))
	}
	if d.Reason == policy.ReasonSpendBudget && !d.SpendReset.IsZero() {
		headers = append(headers, setHeader(HeaderSpendReset, d.SpendReset.Format(time.RFC3339)))
	}
	if retryable(d.Reason) {
		ms := retryAfterMillis(d)
		headers = append(headers,
			setHeader(HeaderRetryAfter, strconv.FormatInt(d.RetryAfterSeconds(), 10)),
			setHeader(HeaderRetryAfterMs, strconv.FormatInt(ms, 10)))
		if r.noRetryAbove > 0 && time.Duration(ms)*time.Millisecond > r.noRetryAbove {
			headers = append(headers, setHeader(HeaderShouldRetry, "false"))
		}
	}
	if r.requestID != "" {
		headers = append(headers, setHeader(HeaderRequestID, r.requestID))
		switch dialect {
		case llmapi.DialectAnthropic:
			headers = append(headers, setHeader(HeaderAnthropicRequestID, r.requestID))
		case llmapi.DialectBedrock:
			headers = append(headers, setHeader(HeaderAmznRequestID, r.requestID))
		}
	}
	if status == 429 && r.rateLimitHeaders && dialect != llmapi.DialectGemini && dialect != llmapi.DialectBedrock {
		headers = appendRateLimitHeaders(headers, d.Limits, dialect, r.now)
	}
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(status)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: headers},
			Body:    refusalBody(d, dialect, r.requestID),
			Details: "llm_bulkhead_" + string(d.Reason),
		}},
	}
}

// appendRateLimitHeaders adds the headers of each window l has, named as the API called names
// them: OpenAI's (and Azure's) x-ratelimit-{limit,remaining,reset}-{requests,tokens}, the reset
// a duration ("1s", "6m0s", "120ms"); Anthropic's
// anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}, the reset an RFC 3339 time.
// Gemini and Bedrock have no such headers.
func appendRateLimitHeaders(h []*corev3.HeaderValueOption, l policy.RefusalLimits, dialect llmapi.Dialect, now time.Time) []*corev3.HeaderValueOption {
	add := func(kind string, w policy.RateWindow) {
		limit, remaining := strconv.FormatInt(w.Limit, 10), strconv.FormatInt(w.Remaining, 10)
		if dialect == llmapi.DialectAnthropic {
			prefix := "anthropic-ratelimit-" + kind + "-"
			h = append(h, setHeader(prefix+"limit", limit), setHeader(prefix+"remaining", remaining),
				setHeader(prefix+"reset", formatResetTime(now, w.Reset)))
			return
		}
		h = append(h, setHeader("x-ratelimit-limit-"+kind, limit), setHeader("x-ratelimit-remaining-"+kind, remaining),
			setHeader("x-ratelimit-reset-"+kind, formatReset(w.Reset)))
	}
	if l.HasRequests {
		add("requests", l.Requests)
	}
	if l.HasTokens {
		add("tokens", l.Tokens)
	}
	return h
}

// formatResetTime is the instant reset from now, in RFC 3339 (UTC, whole seconds rounded up so
// the window is full by then), as Anthropic's anthropic-ratelimit-*-reset headers write it.
func formatResetTime(now time.Time, reset time.Duration) string {
	t := now.Add(reset)
	if u := t.Truncate(time.Second); u.Before(t) {
		t = u.Add(time.Second)
	}
	return t.UTC().Format(time.RFC3339)
}
