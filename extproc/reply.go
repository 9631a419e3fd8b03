package extproc

import (
	"strconv"
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
	// HeaderRemainingTokens and HeaderResetTokens mirror OpenAI's rate-limit headers for the
	// tightest per-minute token budget of the request's compartments.
	HeaderRemainingTokens = "x-ratelimit-remaining-tokens"
	HeaderResetTokens     = "x-ratelimit-reset-tokens"
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

func headersReply(request bool, common *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	m := &headersMem{}
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

func bodyReply(request bool, common *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	m := &bodyMem{}
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

// mutation returns a CommonResponse whose header mutation sets headers (appending more does
// not allocate up to mutationHeaders in all).
func mutation(headers ...*corev3.HeaderValueOption) *extprocv3.CommonResponse {
	m := &mutationMem{}
	m.mut.SetHeaders = append(m.set[:0], headers...)
	m.common.HeaderMutation = &m.mut
	return &m.common
}

// setHeader returns a header_mutation entry that sets key to value, replacing any value the
// message had. The raw value shares value's bytes: strings are immutable and marshalling only
// reads them.
func setHeader(key, value string) *corev3.HeaderValueOption {
	m := &headerMem{}
	m.val.Key = key
	m.val.RawValue = unsafe.Slice(unsafe.StringData(value), len(value))
	m.opt.Header = &m.val
	m.opt.AppendAction = corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD
	return &m.opt
}

// refusalStatus is the HTTP status of a refusal in the API family the client called: 429 for
// budgets and rates, 503 when there is no capacity (Anthropic's overloaded is 529), 400 for a
// body that cannot be read.
func refusalStatus(r policy.Reason, api llmapi.API) int {
	switch r {
	case policy.ReasonTokenBudget, policy.ReasonRateLimit:
		return 429
	case policy.ReasonBadRequest:
		return 400
	}
	if api.Anthropic() {
		return 529
	}
	return 503
}

// refusalBody writes the error JSON in the format of the API the client called, so the
// client's own SDK raises its usual error types.
func refusalBody(d policy.Decision, api llmapi.API) []byte {
	msg := d.Message()
	if api.Anthropic() {
		typ := "overloaded_error"
		switch d.Reason {
		case policy.ReasonTokenBudget, policy.ReasonRateLimit:
			typ = "rate_limit_error"
		case policy.ReasonBadRequest:
			typ = "invalid_request_error"
		}
		b := []byte(`{"type":"error","error":{"type":`)
		b = strconv.AppendQuote(b, typ)
		b = append(b, `,"message":`...)
		b = llmapi.AppendJSONString(b, msg)
		return append(b, "}}"...)
	}
	typ := "server_overloaded"
	switch d.Reason {
	case policy.ReasonTokenBudget, policy.ReasonRateLimit:
		typ = "rate_limit_exceeded"
	case policy.ReasonBadRequest:
		typ = "invalid_request_error"
	}
	b := []byte(`{"error":{"message":`)
	b = llmapi.AppendJSONString(b, msg)
	b = append(b, `,"type":`...)
	b = strconv.AppendQuote(b, typ)
	b = append(b, `,"code":`...)
	b = strconv.AppendQuote(b, string(d.Reason))
	return append(b, `,"param":null}}`...)
}

// immediateReply refuses a request with the degradation contract's status, headers and body.
func immediateReply(d policy.Decision, api llmapi.API) *extprocv3.ProcessingResponse {
	headers := []*corev3.HeaderValueOption{
		setHeader("content-type", "application/json"),
		setHeader(HeaderReason, string(d.Reason)),
	}
	if d.Compartment != "" {
		headers = append(headers, setHeader(HeaderCompartment, d.Compartment))
	}
	if d.Reason != policy.ReasonBadRequest {
		headers = append(headers, setHeader(HeaderRetryAfter, strconv.FormatInt(d.RetryAfterSeconds(), 10)))
	}
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(refusalStatus(d.Reason, api))},
			Headers: &extprocv3.HeaderMutation{SetHeaders: headers},
			Body:    refusalBody(d, api),
			Details: "llm_bulkhead_" + string(d.Reason),
		}},
	}
}
