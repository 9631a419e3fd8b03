package envoysim

import (
	"errors"
	"fmt"
	"strings"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
)

// HeaderMode mirrors ProcessingMode.HeaderSendMode. Its zero value,
// HeaderDefault, means SEND for headers and SKIP for trailers, exactly as in
// Envoy.
type HeaderMode int

// Header send modes, numbered as in processing_mode.proto.
const (
	HeaderDefault HeaderMode = 0
	HeaderSend    HeaderMode = 1
	HeaderSkip    HeaderMode = 2
)

// BodyMode mirrors ProcessingMode.BodySendMode for the modes the simulator
// implements. Its zero value is BodyNone.
type BodyMode int

// Body send modes, numbered as in processing_mode.proto.
const (
	BodyNone            BodyMode = 0
	BodyStreamed        BodyMode = 1
	BodyBuffered        BodyMode = 2
	BodyBufferedPartial BodyMode = 3
)

// String returns the proto enum name.
func (m HeaderMode) String() string {
	switch m {
	case HeaderDefault:
		return "DEFAULT"
	case HeaderSend:
		return "SEND"
	case HeaderSkip:
		return "SKIP"
	}
	return fmt.Sprintf("HeaderMode(%d)", int(m))
}

// String returns the proto enum name.
func (m BodyMode) String() string {
	switch m {
	case BodyNone:
		return "NONE"
	case BodyStreamed:
		return "STREAMED"
	case BodyBuffered:
		return "BUFFERED"
	case BodyBufferedPartial:
		return "BUFFERED_PARTIAL"
	}
	return fmt.Sprintf("BodyMode(%d)", int(m))
}

// ParseHeaderMode parses DEFAULT, SEND or SKIP (case-insensitive).
func ParseHeaderMode(s string) (HeaderMode, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "", "DEFAULT":
		return HeaderDefault, nil
	case "SEND":
		return HeaderSend, nil
	case "SKIP":
		return HeaderSkip, nil
	}
	return 0, fmt.Errorf("unknown header mode %q (want DEFAULT, SEND or SKIP)", s)
}

// ParseBodyMode parses NONE, STREAMED, BUFFERED or BUFFERED_PARTIAL
// (case-insensitive).
func ParseBodyMode(s string) (BodyMode, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "", "NONE":
		return BodyNone, nil
	case "STREAMED":
		return BodyStreamed, nil
	case "BUFFERED":
		return BodyBuffered, nil
	case "BUFFERED_PARTIAL":
		return BodyBufferedPartial, nil
	}
	return 0, fmt.Errorf("unknown body mode %q (want NONE, STREAMED, BUFFERED or BUFFERED_PARTIAL)", s)
}

// ProcessingMode mirrors envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.
// The zero value is Envoy's default: both header directions sent, no
// bodies, no trailers.
type ProcessingMode struct {
	RequestHeader   HeaderMode
	ResponseHeader  HeaderMode
	RequestBody     BodyMode
	ResponseBody    BodyMode
	RequestTrailer  HeaderMode
	ResponseTrailer HeaderMode
}

func (m ProcessingMode) validate() error {
	var errs []error
	for name, hm := range map[string]HeaderMode{
		"request_header_mode": m.RequestHeader, "response_header_mode": m.ResponseHeader,
		"request_trailer_mode": m.RequestTrailer, "response_trailer_mode": m.ResponseTrailer,
	} {
		if hm < HeaderDefault || hm > HeaderSkip {
			errs = append(errs, fmt.Errorf("%s: unknown value %d", name, int(hm)))
		}
	}
	for name, bm := range map[string]BodyMode{"request_body_mode": m.RequestBody, "response_body_mode": m.ResponseBody} {
		if bm < BodyNone || bm > BodyBufferedPartial {
			errs = append(errs, fmt.Errorf("%s: unsupported value %d (FULL_DUPLEX_STREAMED and GRPC are not simulated)", name, int(bm)))
		}
	}
	return errors.Join(errs...)
}

func modeFromProto(p *extprocfilterv3.ProcessingMode) ProcessingMode {
	return ProcessingMode{
		RequestHeader:   HeaderMode(p.GetRequestHeaderMode()),
		ResponseHeader:  HeaderMode(p.GetResponseHeaderMode()),
		RequestBody:     BodyMode(p.GetRequestBodyMode()),
		ResponseBody:    BodyMode(p.GetResponseBodyMode()),
		RequestTrailer:  HeaderMode(p.GetRequestTrailerMode()),
		ResponseTrailer: HeaderMode(p.GetResponseTrailerMode()),
	}
}

// Defaults that Envoy applies when a field is unset.
const (
	DefaultMessageTimeout       = 200 * time.Millisecond
	DefaultStatusOnError        = 500
	DefaultBufferLimit          = 1 << 20
	DefaultRemoteCloseTimeout   = time.Second
	DefaultDeferredCloseTimeout = 5 * time.Second
)

// FilterConfig holds the Envoy ext_proc filter settings the simulator
// honours. Every zero value means what Envoy does when the field is unset,
// so FilterConfig{} is a filter with the default processing mode. A
// FilterConfig is a plain value; copies are independent except for the
// shared slices, which the simulator never mutates.
type FilterConfig struct {
	// Mode is processing_mode. Zero: headers both ways, no bodies, no trailers.
	Mode ProcessingMode
	// MessageTimeout is message_timeout. Zero: 200 ms.
	MessageTimeout time.Duration
	// MaxMessageTimeout is max_message_timeout, the cap on
	// override_message_timeout. Zero: overrides are ignored.
	MaxMessageTimeout time.Duration
	// FailureModeAllow is failure_mode_allow: on processor errors, continue
	// without the processor instead of answering StatusOnError.
	FailureModeAllow bool
	// AllowModeOverride is allow_mode_override.
	AllowModeOverride bool
	// AllowedOverrideModes is allowed_override_modes. Empty: any override.
	AllowedOverrideModes []ProcessingMode
	// DisableImmediateResponse is disable_immediate_response: an
	// ImmediateResponse is then treated as a spurious message.
	DisableImmediateResponse bool
	// StatusOnError is status_on_error. Zero: 500.
	StatusOnError int
	// ObservabilityMode is observability_mode: messages are sent, replies
	// are not awaited and are ignored.
	ObservabilityMode bool
	// DeferredCloseTimeout is deferred_close_timeout, used only in
	// observability mode. Zero: 5 s.
	DeferredCloseTimeout time.Duration
	// BufferLimit is the listener's per_connection_buffer_limit_bytes (or the
	// route's request_body_buffer_limit). Zero: 1 MiB.
	BufferLimit int
	// GracefulClose is the runtime flag
	// envoy.reloadable_features.ext_proc_graceful_grpc_close: close the
	// stream with a half-close and wait for the server instead of resetting.
	GracefulClose bool
	// RemoteCloseTimeout is how long a graceful close waits for the server
	// (runtime key envoy.filters.http.ext_proc.remote_close_timeout_milliseconds).
	// Zero: 1 s.
	RemoteCloseTimeout time.Duration
	// DisableStreamCloseOptimization turns off the 1.37 runtime guard
	// envoy.reloadable_features.ext_proc_stream_close_optimization, which
	// closes the stream right after the last expected reply.
	DisableStreamCloseOptimization bool
	// ForwardingNamespaces is metadata_options.forwarding_namespaces.untyped.
	ForwardingNamespaces []string
	// ReceivingNamespaces is metadata_options.receiving_namespaces.untyped.
	ReceivingNamespaces []string
	// RequestAttributes and ResponseAttributes are request_attributes and
	// response_attributes (attribute names, evaluated from Request.Attributes
	// and a few built-ins).
	RequestAttributes  []string
	ResponseAttributes []string
	// MutationRules is mutation_rules. Zero: Envoy's defaults.
	MutationRules MutationRules
	// RouteCacheAction is route_cache_action: "" or "DEFAULT" honours
	// clear_route_cache, "CLEAR" clears on every header mutation, "RETAIN"
	// never clears.
	RouteCacheAction string
	// OmitProtocolConfig stops protocol_config from being sent on the first
	// message, to exercise servers written against Envoy before 1.35.
	OmitProtocolConfig bool
	// RateLimit, when set, puts Envoy's global rate limit filter before the ext_proc filter
	// (see RateLimit). The pointer is shared by copies of the config and never changed.
	RateLimit *RateLimit
	// InitialMetadata is grpc_service.initial_metadata: gRPC metadata sent when each stream
	// opens (keys lower-case).
	InitialMetadata Headers
}

// withDefaults returns c with every unset field replaced by Envoy's default.
func (c FilterConfig) withDefaults() FilterConfig {
	if c.MessageTimeout == 0 {
		c.MessageTimeout = DefaultMessageTimeout
	}
	if c.StatusOnError == 0 {
		c.StatusOnError = DefaultStatusOnError
	}
	if c.BufferLimit == 0 {
		c.BufferLimit = DefaultBufferLimit
	}
	if c.RemoteCloseTimeout == 0 {
		c.RemoteCloseTimeout = DefaultRemoteCloseTimeout
	}
	if c.DeferredCloseTimeout == 0 {
		c.DeferredCloseTimeout = DefaultDeferredCloseTimeout
	}
	c.RouteCacheAction = strings.ToUpper(c.RouteCacheAction)
	if c.RouteCacheAction == "" {
		c.RouteCacheAction = "DEFAULT"
	}
	return c
}

// Validate reports every setting Envoy would refuse or the simulator cannot
// honour, all at once.
func (c FilterConfig) Validate() error {
	var errs []error
	if err := c.Mode.validate(); err != nil {
		errs = append(errs, err)
	}
	for i, m := range c.AllowedOverrideModes {
		if err := m.validate(); err != nil {
			errs = append(errs, fmt.Errorf("allowed_override_modes[%d]: %w", i, err))
		}
	}
	if c.MessageTimeout < 0 || c.MessageTimeout >= time.Hour {
		errs = append(errs, fmt.Errorf("message_timeout %v: must be in [0, 1h)", c.MessageTimeout))
	}
	if c.MaxMessageTimeout < 0 || c.MaxMessageTimeout >= time.Hour {
		errs = append(errs, fmt.Errorf("max_message_timeout %v: must be in [0, 1h)", c.MaxMessageTimeout))
	}
	if c.StatusOnError != 0 && (c.StatusOnError < 200 || c.StatusOnError > 599) {
		errs = append(errs, fmt.Errorf("status_on_error %d: not an HTTP status Envoy can send", c.StatusOnError))
	}
	if c.BufferLimit < 0 {
		errs = append(errs, fmt.Errorf("buffer limit %d: must not be negative", c.BufferLimit))
	}
	if c.RemoteCloseTimeout < 0 || c.DeferredCloseTimeout < 0 {
		errs = append(errs, errors.New("close timeouts must not be negative"))
	}
	if c.RateLimit != nil {
		if err := c.RateLimit.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	switch strings.ToUpper(c.RouteCacheAction) {
	case "", "DEFAULT", "CLEAR", "RETAIN":
	default:
		errs = append(errs, fmt.Errorf("route_cache_action %q: want DEFAULT, CLEAR or RETAIN", c.RouteCacheAction))
	}
	return errors.Join(errs...)
}

// FromProto converts Envoy's filter proto into a FilterConfig, failing on
// anything Envoy would reject at load time and on settings the simulator
// does not implement (HTTP service, FULL_DUPLEX_STREAMED, GRPC body modes),
// so a shipped YAML cannot silently differ from what tests exercised.
// Listener-level settings (the buffer limit) and runtime flags (graceful
// close) are not in the filter proto; set them on the result.
func FromProto(p *extprocfilterv3.ExternalProcessor) (FilterConfig, error) {
	if p == nil {
		return FilterConfig{}, errors.New("nil ExternalProcessor")
	}
	var errs []error
	if err := p.ValidateAll(); err != nil {
		errs = append(errs, err)
	}
	if p.GetGrpcService() == nil {
		errs = append(errs, errors.New("grpc_service is required (http_service is not simulated)"))
	}
	if p.GetHttpService() != nil {
		errs = append(errs, errors.New("http_service is not simulated"))
	}
	if p.GetDisableClearRouteCache() && p.GetRouteCacheAction() != extprocfilterv3.ExternalProcessor_DEFAULT {
		errs = append(errs, errors.New("disable_clear_route_cache and route_cache_action cannot both be set"))
	}
	if p.GetSendBodyWithoutWaitingForHeaderResponse() {
		errs = append(errs, errors.New("send_body_without_waiting_for_header_response is not simulated"))
	}
	c := FilterConfig{
		Mode:                     modeFromProto(p.GetProcessingMode()),
		MessageTimeout:           p.GetMessageTimeout().AsDuration(),
		MaxMessageTimeout:        p.GetMaxMessageTimeout().AsDuration(),
		FailureModeAllow:         p.GetFailureModeAllow(),
		AllowModeOverride:        p.GetAllowModeOverride(),
		DisableImmediateResponse: p.GetDisableImmediateResponse(),
		StatusOnError:            int(p.GetStatusOnError().GetCode()),
		ObservabilityMode:        p.GetObservabilityMode(),
		DeferredCloseTimeout:     p.GetDeferredCloseTimeout().AsDuration(),
		ForwardingNamespaces:     append([]string(nil), p.GetMetadataOptions().GetForwardingNamespaces().GetUntyped()...),
		ReceivingNamespaces:      append([]string(nil), p.GetMetadataOptions().GetReceivingNamespaces().GetUntyped()...),
		RequestAttributes:        append([]string(nil), p.GetRequestAttributes()...),
		ResponseAttributes:       append([]string(nil), p.GetResponseAttributes()...),
		RouteCacheAction:         p.GetRouteCacheAction().String(),
	}
	for _, h := range p.GetGrpcService().GetInitialMetadata() {
		c.InitialMetadata = append(c.InitialMetadata, Header{Key: strings.ToLower(h.GetKey()), Value: h.GetValue()})
	}
	if p.GetMessageTimeout() == nil {
		c.MessageTimeout = 0
	}
	if p.GetDisableClearRouteCache() {
		c.RouteCacheAction = "RETAIN"
	}
	for _, m := range p.GetAllowedOverrideModes() {
		c.AllowedOverrideModes = append(c.AllowedOverrideModes, modeFromProto(m))
	}
	if r := p.GetMutationRules(); r != nil {
		if r.GetAllowExpression() != nil || r.GetDisallowExpression() != nil {
			errs = append(errs, errors.New("mutation_rules allow_expression/disallow_expression are not simulated"))
		}
		c.MutationRules = MutationRules{
			AllowAllRouting: r.GetAllowAllRouting().GetValue(),
			AllowEnvoy:      r.GetAllowEnvoy().GetValue(),
			DisallowSystem:  r.GetDisallowSystem().GetValue(),
			DisallowAll:     r.GetDisallowAll().GetValue(),
			DisallowIsError: r.GetDisallowIsError().GetValue(),
		}
	}
	if err := c.Validate(); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return FilterConfig{}, errors.Join(errs...)
	}
	return c, nil
}
