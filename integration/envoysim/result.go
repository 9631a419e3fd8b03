package envoysim

import (
	"fmt"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/structpb"
)

// Kind names the message types of the ext_proc protocol.
type Kind int

// Message kinds. KindImmediate, KindEmpty and KindOther only occur for
// replies.
const (
	KindUnknown Kind = iota
	KindRequestHeaders
	KindRequestBody
	KindRequestTrailers
	KindResponseHeaders
	KindResponseBody
	KindResponseTrailers
	KindImmediate
	KindEmpty
	KindOther
)

var kindNames = [...]string{"unknown", "request_headers", "request_body", "request_trailers",
	"response_headers", "response_body", "response_trailers", "immediate_response", "empty", "other"}

// String returns the proto field name of the kind.
func (k Kind) String() string {
	if k >= 0 && int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// KindOfRequest tells which message a ProcessingRequest carries.
func KindOfRequest(r *extprocv3.ProcessingRequest) Kind {
	switch r.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return KindRequestHeaders
	case *extprocv3.ProcessingRequest_RequestBody:
		return KindRequestBody
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return KindRequestTrailers
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return KindResponseHeaders
	case *extprocv3.ProcessingRequest_ResponseBody:
		return KindResponseBody
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return KindResponseTrailers
	case nil:
		return KindEmpty
	}
	return KindOther
}

// KindOfResponse tells which reply a ProcessingResponse carries.
func KindOfResponse(r *extprocv3.ProcessingResponse) Kind {
	switch r.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		return KindRequestHeaders
	case *extprocv3.ProcessingResponse_RequestBody:
		return KindRequestBody
	case *extprocv3.ProcessingResponse_RequestTrailers:
		return KindRequestTrailers
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		return KindResponseHeaders
	case *extprocv3.ProcessingResponse_ResponseBody:
		return KindResponseBody
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		return KindResponseTrailers
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		return KindImmediate
	case nil:
		return KindEmpty
	}
	return KindOther
}

// Record is one entry of the recorded exchange: exactly one of Sent and
// Received is set. Records are read-only once RoundTrip returned.
type Record struct {
	At       time.Time
	Sent     *extprocv3.ProcessingRequest
	Received *extprocv3.ProcessingResponse
	// Ignored marks a reply Envoy discards: after processing completed, in
	// observability mode, or an override_message_timeout that was refused.
	Ignored bool
}

// Kind returns the kind of the recorded message.
func (r Record) Kind() Kind {
	if r.Sent != nil {
		return KindOfRequest(r.Sent)
	}
	return KindOfResponse(r.Received)
}

// StreamEnd says how the gRPC stream of one request ended.
type StreamEnd int

// Stream endings.
const (
	// StreamNotOpened: no message had to be sent.
	StreamNotOpened StreamEnd = iota
	// StreamOpenFailed: opening the stream failed (server unreachable).
	StreamOpenFailed
	// StreamServerClosed: the server ended the stream with status OK first.
	StreamServerClosed
	// StreamServerError: the server ended the stream with a non-OK status first.
	StreamServerError
	// StreamReset: the simulator reset the stream (server's Recv sees Canceled).
	StreamReset
	// StreamHalfClosed: the simulator half-closed (server's Recv sees io.EOF)
	// and the server finished within the remote-close timeout.
	StreamHalfClosed
	// StreamHalfCloseTimedOut: the simulator half-closed, the server did not
	// finish in time, and the stream was then reset.
	StreamHalfCloseTimedOut
	// StreamDeferredReset: observability mode; the reset happens
	// DeferredCloseTimeout after the HTTP stream ended (or at Sim.Close).
	StreamDeferredReset
)

var streamEndNames = [...]string{"not_opened", "open_failed", "server_closed", "server_error",
	"reset", "half_closed", "half_close_timed_out", "deferred_reset"}

// String returns a stable name.
func (e StreamEnd) String() string {
	if e >= 0 && int(e) < len(streamEndNames) {
		return streamEndNames[e]
	}
	return fmt.Sprintf("StreamEnd(%d)", int(e))
}

// CloseReason says why the simulator ended the stream, when it did.
type CloseReason int

// Reasons for the simulator to end the stream.
const (
	CloseNone CloseReason = iota
	CloseImmediateResponse
	CloseLastResponse
	CloseNoResponseProcessing
	CloseSpurious
	CloseMessageTimeout
	CloseGRPCError
	CloseServerClosed
	CloseHTTPStreamDone
	CloseProcessingError
)

var closeReasonNames = [...]string{"none", "immediate_response", "last_response", "no_response_processing",
	"spurious", "message_timeout", "grpc_error", "server_closed", "http_stream_done", "processing_error"}

// String returns a stable name.
func (r CloseReason) String() string {
	if r >= 0 && int(r) < len(closeReasonNames) {
		return closeReasonNames[r]
	}
	return fmt.Sprintf("CloseReason(%d)", int(r))
}

// LocalReply says why the client got a reply that Envoy generated itself.
type LocalReply int

// Local reply causes.
const (
	// NotLocal: the response came from the upstream.
	NotLocal LocalReply = iota
	// LocalImmediate: the processor sent an ImmediateResponse.
	LocalImmediate
	// LocalProcessingError: status_on_error after a gRPC error, a spurious
	// reply or a rejected mutation.
	LocalProcessingError
	// LocalMessageTimeout: 504 after message_timeout expired.
	LocalMessageTimeout
	// LocalPayloadTooLarge: 413 for a buffered request body over the limit.
	LocalPayloadTooLarge
	// LocalResponseTooLarge: 500 for a buffered response body over the limit.
	LocalResponseTooLarge
	// LocalUpstreamFailure: 503/504 from the router; not sent to ext_proc.
	LocalUpstreamFailure
	// LocalRateLimited: 429 from the rate limit filter (RateLimit) before ext_proc ran.
	LocalRateLimited
	// LocalRateLimitError: the rate limit filter's status_on_error when the service failed
	// and failure_mode_deny is set.
	LocalRateLimitError
)

var localReplyNames = [...]string{"not_local", "immediate_response", "processing_error", "message_timeout",
	"request_payload_too_large", "response_payload_too_large", "upstream_failure", "rate_limited", "rate_limit_error"}

// String returns a stable name.
func (l LocalReply) String() string {
	if l >= 0 && int(l) < len(localReplyNames) {
		return localReplyNames[l]
	}
	return fmt.Sprintf("LocalReply(%d)", int(l))
}

// ProblemKind classifies protocol problems the simulator detected.
type ProblemKind int

// Protocol problems.
const (
	ProblemSpurious ProblemKind = iota + 1
	ProblemTimeout
	ProblemGRPCError
	ProblemMutationRejected
	ProblemOverrideIgnored
	ProblemLateReply
	ProblemInvalidReply
)

var problemNames = [...]string{"", "spurious", "timeout", "grpc_error", "mutation_rejected", "override_ignored", "late_reply", "invalid_reply"}

// String returns a stable name.
func (p ProblemKind) String() string {
	if p > 0 && int(p) < len(problemNames) {
		return problemNames[p]
	}
	return fmt.Sprintf("ProblemKind(%d)", int(p))
}

// Problem is one protocol problem detected during a request, a plain value.
type Problem struct {
	Kind   ProblemKind
	Detail string
}

// UpstreamSeen is what the upstream received, read-only after RoundTrip.
type UpstreamSeen struct {
	Method, Path, Authority, Scheme string
	// Headers excludes pseudo-headers.
	Headers  Headers
	Body     []byte
	Trailers Headers
	// Complete is true when the whole request reached the upstream.
	Complete bool
	// RouteCacheCleared is true when the processor asked Envoy to re-pick
	// the route before the request headers left the filter.
	RouteCacheCleared bool
}

// Result is everything one simulated request produced. It is built by one
// goroutine and handed over when RoundTrip returns.
type Result struct {
	// Status, Headers, Body and Trailers are what the client saw. Headers
	// excludes ":status". Chunks is the body as the client received it.
	Status   int
	Headers  Headers
	Body     []byte
	Chunks   [][]byte
	Trailers Headers
	// Local is why Envoy answered itself; LocalDetails is the
	// response-code-details string Envoy would log.
	Local        LocalReply
	LocalDetails string
	// Reset is true when the client saw the stream reset instead of a
	// complete response (headers may have arrived before).
	Reset bool
	// Canceled is true when the client itself went away (a hook or the context).
	Canceled bool
	// Upstream is nil when the upstream was never called.
	Upstream *UpstreamSeen
	// UpstreamFailure is the upstream's error, if it failed.
	UpstreamFailure error
	// DynamicMetadata holds what the processor set in receiving namespaces.
	DynamicMetadata map[string]*structpb.Struct
	// Exchange is every message sent and received, in order.
	Exchange []Record
	// Stream is how the gRPC stream ended; StreamCode is the status the
	// client side of the stream saw last; CloseReason is why the simulator
	// ended it, if it did.
	Stream      StreamEnd
	StreamCode  codes.Code
	CloseReason CloseReason
	// RateLimitCalls are the rate limit filter's calls to the rate limit service (RateLimit),
	// in order: the check on the request path, then the one made when the stream was done.
	RateLimitCalls []RateLimitCall
	// Problems lists protocol problems in the order they were detected.
	Problems []Problem
	// Started and Completed bracket the HTTP exchange as the client saw it;
	// the gRPC close may finish later.
	Started, Completed time.Time
}

// Sent returns the sent messages in order.
func (r *Result) Sent() []*extprocv3.ProcessingRequest {
	var out []*extprocv3.ProcessingRequest
	for _, rec := range r.Exchange {
		if rec.Sent != nil {
			out = append(out, rec.Sent)
		}
	}
	return out
}

// SentKinds returns the kinds of the sent messages in order.
func (r *Result) SentKinds() []Kind {
	var out []Kind
	for _, rec := range r.Exchange {
		if rec.Sent != nil {
			out = append(out, KindOfRequest(rec.Sent))
		}
	}
	return out
}

// HasProblem reports whether a problem of kind k was detected.
func (r *Result) HasProblem(k ProblemKind) bool {
	for _, p := range r.Problems {
		if p.Kind == k {
			return true
		}
	}
	return false
}
