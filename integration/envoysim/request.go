package envoysim

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/structpb"
)

// Request is one HTTP request as the downstream client sends it to Envoy.
// At most one of Body, Chunks and BodySource may be set; none means a
// request without a body (end_of_stream on the headers). A Request is read
// by the RoundTrip using it and must not be changed until it returns.
type Request struct {
	// Method defaults to GET (POST when a body is set), Path to "/",
	// Authority to "localhost", Scheme to "http".
	Method, Path, Authority, Scheme string
	// Headers are the client's headers; keys are lower-cased. A "host"
	// header is folded into :authority as Envoy's codec does.
	Headers Headers
	// Body is the whole body, arriving at once with a content-length.
	Body []byte
	// Chunks is a body arriving in pieces over time (chunked encoding).
	Chunks []Chunk
	// BodySource streams a body of unknown length; its end reaches the
	// filter as a separate empty end_of_stream chunk, as with HTTP/1.1
	// chunked uploads.
	BodySource BodySource
	// Trailers, when set, end the request instead of end_of_stream on data.
	Trailers Headers
	// Lockstep releases each body chunk only when the filter is not waiting
	// for a reply in the request direction, making one STREAMED message per
	// chunk deterministic.
	Lockstep bool
	// Metadata is Envoy dynamic metadata present before this filter runs
	// (for instance claims written by jwt_authn), keyed by namespace.
	Metadata map[string]*structpb.Struct
	// Attributes supplies values for request_attributes/response_attributes
	// by name; a few (request.path, request.method, request.host,
	// request.scheme, request.id, request.url_path, response.code) are
	// derived when absent.
	Attributes map[string]any
	// MessageTimeout, when non-zero, overrides the filter's message_timeout
	// for this request only.
	MessageTimeout time.Duration
	// Filter, when non-nil, replaces the simulator's filter config for this
	// request only (like a per-route override).
	Filter *FilterConfig
	// OnEvent is called synchronously on the filter goroutine at each step;
	// returning Cancel makes the client reset the request right there,
	// before anything else happens.
	OnEvent func(Event) Action
}

// EventKind names a step of a simulated request.
type EventKind int

// Steps reported to Request.OnEvent.
const (
	EventStreamOpened EventKind = iota + 1
	EventSent
	EventReceived
	EventUpstreamCalled
	EventUpstreamResponse
	EventDownstreamHeaders
	EventDownstreamData
)

// Event describes one step; it is a value handed to the hook, never shared. Message is the kind of the message sent or
// received; DownstreamChunks counts body chunks the client got so far.
type Event struct {
	Kind             EventKind
	Message          Kind
	Sent             *extprocv3.ProcessingRequest
	Received         *extprocv3.ProcessingResponse
	DownstreamChunks int
	At               time.Time
}

// Action is what an OnEvent hook asks for.
type Action int

// Hook actions.
const (
	Proceed Action = iota
	// Cancel resets the request from the client side (downstream reset).
	Cancel
)

// CancelWhenSent returns a hook that cancels the request right after the
// n-th message of kind k (counting from 1) has been sent, before any reply
// to it can be processed.
func CancelWhenSent(k Kind, n int) func(Event) Action {
	seen := 0
	return func(e Event) Action {
		if e.Kind == EventSent && e.Message == k {
			seen++
			if seen == n {
				return Cancel
			}
		}
		return Proceed
	}
}

// CancelAfterDownstreamChunks returns a hook that cancels the request once
// the client has received n response body chunks (mid-SSE disconnect).
func CancelAfterDownstreamChunks(n int) func(Event) Action {
	return func(e Event) Action {
		if e.Kind == EventDownstreamData && e.DownstreamChunks >= n {
			return Cancel
		}
		return Proceed
	}
}

func (r *Request) validate() error {
	var errs []error
	n := 0
	if r.Body != nil {
		n++
	}
	if r.Chunks != nil {
		n++
	}
	if r.BodySource != nil {
		n++
	}
	if n > 1 {
		errs = append(errs, errors.New("set at most one of Body, Chunks and BodySource"))
	}
	if r.Path != "" && !strings.HasPrefix(r.Path, "/") && r.Path != "*" {
		errs = append(errs, fmt.Errorf("path %q must start with '/'", r.Path))
	}
	if r.Filter != nil {
		if err := r.Filter.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (r *Request) hasBody() bool {
	return len(r.Body) > 0 || r.Chunks != nil || r.BodySource != nil
}

// headerList builds the request header map the way Envoy's HTTP/1 codec
// and connection manager present it to the first filter.
func (r *Request) headerList() Headers {
	method := r.Method
	if method == "" {
		method = "GET"
		if r.hasBody() {
			method = "POST"
		}
	}
	path := r.Path
	if path == "" {
		path = "/"
	}
	scheme := r.Scheme
	if scheme == "" {
		scheme = "http"
	}
	authority := r.Authority
	if authority == "" {
		authority = r.Headers.Get("host")
	}
	if authority == "" {
		authority = "localhost"
	}
	h := Headers{{":authority", authority}, {":path", path}, {":method", method}, {":scheme", scheme}}
	for _, f := range r.Headers {
		k := strings.ToLower(f.Key)
		if k == "host" || strings.HasPrefix(k, ":") || hopHeaders[k] {
			continue
		}
		h = append(h, Header{Key: k, Value: f.Value})
	}
	if len(r.Body) > 0 {
		if _, ok := h.Lookup("content-length"); !ok {
			h = append(h, Header{Key: "content-length", Value: strconv.Itoa(len(r.Body))})
		}
	}
	if _, ok := h.Lookup("x-forwarded-proto"); !ok {
		h = append(h, Header{Key: "x-forwarded-proto", Value: scheme})
	}
	if _, ok := h.Lookup("x-request-id"); !ok {
		h = append(h, Header{Key: "x-request-id", Value: uuid.NewString()})
	}
	return h
}

// requestSource turns the request's body fields into a BodySource plus the
// knowledge of whether the end is known with the last chunk.
func (r *Request) source() BodySource {
	switch {
	case len(r.Body) > 0:
		return ChunkSource(-1, Chunk{Data: r.Body})
	case r.Chunks != nil:
		return ChunkSource(-1, r.Chunks...)
	case r.BodySource != nil:
		return r.BodySource
	}
	return nil
}
