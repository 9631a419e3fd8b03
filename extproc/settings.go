package extproc

import (
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// parseBodyMode is Envoy's processing mode for a body mode as the policy names it.
func parseBodyMode(s string) bodyMode {
	switch s {
	case "STREAMED":
		return extprocfilterv3.ProcessingMode_STREAMED
	case "BUFFERED":
		return extprocfilterv3.ProcessingMode_BUFFERED
	case "BUFFERED_PARTIAL":
		return extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL
	}
	return extprocfilterv3.ProcessingMode_NONE
}

// Settings are the policy settings the adapter reads — how Envoy's filter is configured
// (body modes, mode_override, message timers), what the bodies and replies get, and the bounds
// on streams — compiled once per policy snapshot into plain typed values: no pointers to
// optional values, strings to compare or durations to convert per request. Read-only. The
// domain (package policy) knows none of them.
type Settings struct {
	// RequestBodyMode and ResponseBodyMode are the filter's body modes as the policy declares
	// them (Envoy's protocol_config, when sent, says the same).
	RequestBodyMode, ResponseBodyMode bodyMode
	// MessageTimeout and MaxMessageTimeout are the filter's message timers.
	MessageTimeout, MaxMessageTimeout time.Duration
	// AllowModeOverride: the filter honours mode_override.
	AllowModeOverride bool
	// MetadataNamespace is where the server writes dynamic metadata.
	MetadataNamespace string
	// InjectIncludeUsage and StripAcceptEncoding are body.inject_include_usage and
	// body.strip_accept_encoding.
	InjectIncludeUsage, StripAcceptEncoding bool
	// RequireValidJSON lists path prefixes where an invalid body is refused.
	RequireValidJSON []string
	// CompartmentHeader and RateLimitHeaders say which headers admitted responses get.
	CompartmentHeader, RateLimitHeaders bool
	// NoRetryAbove is refusals.no_retry_above: a refusal whose retry-after is longer gets
	// x-should-retry: false (0: never). RefusalRateLimitHeaders is refusals.ratelimit_headers.
	NoRetryAbove            time.Duration
	RefusalRateLimitHeaders bool
	// FirstMessageTimeout ends a stream that sends no message this long after it opened.
	FirstMessageTimeout time.Duration
	// StreamIdleTimeout ends a stream that hears nothing from Envoy this long after a message
	// (releasing an admitted request's admission first).
	StreamIdleTimeout time.Duration
	// MaxBufferedBodyBytes bounds the request bodies held while deciding, over all streams.
	MaxBufferedBodyBytes int64
	// MaxStreams bounds the ext_proc streams open at once.
	MaxStreams int
	// UpstreamFilter is envoy.upstream_filter: the attempts of admitted requests are followed.
	UpstreamFilter bool
}

// compileSettings compiles p's settings for a process whose memory is limited to memLimit bytes
// (0: no limit).
func compileSettings(p *config.Policy, memLimit int64) Settings {
	return Settings{
		RequestBodyMode:      parseBodyMode(p.Envoy.RequestBodyMode),
		ResponseBodyMode:     parseBodyMode(p.Envoy.ResponseBodyMode),
		MessageTimeout:       p.Envoy.MessageTimeout.D(),
		MaxMessageTimeout:    p.Envoy.MaxMessageTimeout.D(),
		AllowModeOverride:    p.Envoy.AllowModeOverride,
		MetadataNamespace:    p.Envoy.MetadataNamespace,
		InjectIncludeUsage:   config.Bool(p.Body.InjectIncludeUsage),
		StripAcceptEncoding:  config.Bool(p.Body.StripAcceptEncoding),
		RequireValidJSON:     p.Body.RequireValidJSON,
		CompartmentHeader:    p.Responses.CompartmentHeader,
		RateLimitHeaders:     p.Responses.RateLimitHeaders,
		FirstMessageTimeout:  p.Server.FirstMessageTimeout.D(),
		StreamIdleTimeout:    p.Server.StreamIdleTimeout.D(),
		MaxBufferedBodyBytes: p.BufferedBodyBytes(memLimit),
		MaxStreams:           p.Server.MaxStreams,
		UpstreamFilter:       p.Envoy.UpstreamFilter,

		NoRetryAbove:            p.Refusals.NoRetryAboveOrDefault(),
		RefusalRateLimitHeaders: p.Refusals.RateLimitHeadersOrDefault(),
	}
}

// Settings returns the settings of the live policy.
func (s *Server) Settings() *Settings { return s.settingsOf(s.engine.Snapshot()) }

// settingsOf returns the settings of snapshot snap.
func (s *Server) settingsOf(snap *policy.Snapshot) *Settings { return &s.parts(snap).settings }
