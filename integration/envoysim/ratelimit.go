package envoysim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	rlcommonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	yaml "go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// RateLimitFilterName is the name of Envoy's global rate limit HTTP filter, the key of its
// typed_per_filter_config.
const RateLimitFilterName = "envoy.filters.http.ratelimit"

// DefaultRateLimitTimeout is the rate limit filter's timeout when unset.
const DefaultRateLimitTimeout = 20 * time.Millisecond

// maxHitsAddend is the largest hits_addend a format may produce (Envoy's MAX_HITS_ADDEND).
const maxHitsAddend = 1e9

// RateLimit plays Envoy's global rate limit filter (envoy.filters.http.ratelimit, Envoy 1.37)
// placed in http_filters right before the ext_proc filter, with its descriptors built from a
// route's RateLimitPerRoute.rate_limits (Rules, Domain). What it does, as ratelimit.cc does:
//
//   - On the request headers, before ext_proc sees anything, it builds one descriptor per rule
//     that is not OnStreamDone and, when there is at least one, calls
//     RateLimitService.ShouldRateLimit at Addr. OVER_LIMIT answers the client itself
//     (RateLimitedStatus, 429, with x-envoy-ratelimited: true and the service's
//     response_headers_to_add and raw_body); ext_proc and the upstream are never called. A
//     failed or timed-out call continues the request, or answers StatusOnError when
//     FailureModeDeny is set. An OK answer's request_headers_to_add are added to the request.
//   - When the stream is done (Envoy's onDestroy, unless the check was still in flight), it
//     builds the descriptors of the OnStreamDone rules from the request headers as they are
//     then (after ext_proc's mutations) and the dynamic metadata ext_proc left, and sends them
//     in one more call whose answer is ignored.
//
// A rule whose header is absent (without SkipIfAbsent) or whose hits_addend does not resolve
// to a number in [0, 1e9] produces no descriptor. Differences from Envoy: the stream-done call
// is made before RoundTrip returns (on the HTTP face, after the client has its response) so
// tests can count on it; only request_headers actions and hits_addend formats of exactly one
// %DYNAMIC_METADATA(...)% are simulated (RateLimitFromProto refuses the rest).
type RateLimit struct {
	// Addr is the rate limit service's gRPC target (rate_limit_service.grpc_service).
	Addr string
	// Domain is the domain sent (RateLimitPerRoute.domain, or the filter's domain).
	Domain string
	// Rules are the rate_limits entries, in order.
	Rules []RateLimitRule
	// Timeout is the filter's timeout for each call. Zero: 20 ms; negative: none.
	Timeout time.Duration
	// FailureModeDeny is failure_mode_deny: refuse the request when the call fails.
	FailureModeDeny bool
	// StatusOnError is status_on_error. Zero: 500.
	StatusOnError int
	// RateLimitedStatus is rate_limited_status. Zero (or below 400): 429.
	RateLimitedStatus int
	// DisableXEnvoyRateLimitedHeader is disable_x_envoy_ratelimited_header.
	DisableXEnvoyRateLimitedHeader bool
}

// RateLimitRule is one config.route.v3.RateLimit: its actions build one descriptor.
type RateLimitRule struct {
	// Headers are its request_headers actions, one descriptor entry each.
	Headers []RateLimitHeader
	// HitsAddend is hits_addend.number (nil: unset).
	HitsAddend *uint64
	// HitsAddendMetadata is hits_addend.format when it is %DYNAMIC_METADATA(ns:key...)%.
	HitsAddendMetadata *MetadataKey
	// OnStreamDone is apply_on_stream_done.
	OnStreamDone bool
}

// RateLimitHeader is a request_headers action.
type RateLimitHeader struct {
	HeaderName, DescriptorKey string
	SkipIfAbsent              bool
}

// MetadataKey names a dynamic metadata value: a namespace and a path of keys into its Struct.
type MetadataKey struct {
	Namespace string
	Path      []string
}

// RateLimitCall is one call the rate limit filter made.
type RateLimitCall struct {
	// OnStreamDone is false for the request-path check, true for the stream-done call.
	OnStreamDone bool
	Request      *rlsv3.RateLimitRequest
	// Response is nil when the call failed (Err).
	Response *rlsv3.RateLimitResponse
	Err      error
}

// Validate reports settings Envoy would refuse or the simulator cannot honour.
func (r *RateLimit) Validate() error {
	var errs []error
	if r.Addr == "" {
		errs = append(errs, errors.New("rate limit: Addr (the rate limit service) is required"))
	}
	if r.Domain == "" {
		errs = append(errs, errors.New("rate limit: Domain is required"))
	}
	if r.StatusOnError != 0 && (r.StatusOnError < 200 || r.StatusOnError > 599) {
		errs = append(errs, fmt.Errorf("rate limit: status_on_error %d is not an HTTP status", r.StatusOnError))
	}
	for i, rule := range r.Rules {
		if len(rule.Headers) == 0 {
			errs = append(errs, fmt.Errorf("rate limit: rule %d has no action", i))
		}
		if rule.HitsAddend != nil && rule.HitsAddendMetadata != nil {
			errs = append(errs, fmt.Errorf("rate limit: rule %d: hits_addend must contain either a format or a number", i))
		}
	}
	return errors.Join(errs...)
}

var dynamicMetadataFormat = regexp.MustCompile(`^%DYNAMIC_METADATA\(([^():]+)((?::[^():]+)+)\)%$`)

// RateLimitFromProto converts a RateLimitPerRoute into its domain and rules, failing on what
// Envoy refuses there (stage, disable_key, limit, a hits_addend with both or neither of format
// and number) and on what the simulator does not implement (actions other than
// request_headers, formats other than one %DYNAMIC_METADATA(...)%).
func RateLimitFromProto(p *ratelimitfilterv3.RateLimitPerRoute) (domain string, rules []RateLimitRule, err error) {
	if p == nil {
		return "", nil, errors.New("nil RateLimitPerRoute")
	}
	if err := p.ValidateAll(); err != nil {
		return "", nil, err
	}
	var errs []error
	for i, rl := range p.GetRateLimits() {
		if rl.GetStage() != nil || rl.GetDisableKey() != "" {
			errs = append(errs, fmt.Errorf("rate_limits[%d]: 'stage' field and 'disable_key' field are not supported", i))
		}
		if rl.GetLimit() != nil {
			errs = append(errs, fmt.Errorf("rate_limits[%d]: 'limit' field is not supported", i))
		}
		rule := RateLimitRule{OnStreamDone: rl.GetApplyOnStreamDone()}
		if h := rl.GetHitsAddend(); h != nil {
			switch {
			case h.GetFormat() != "" && h.GetNumber() != nil, h.GetFormat() == "" && h.GetNumber() == nil:
				errs = append(errs, fmt.Errorf("rate_limits[%d]: hits_addend must contain either a format or a number", i))
			case h.GetNumber() != nil:
				n := h.GetNumber().GetValue()
				rule.HitsAddend = &n
			default:
				m := dynamicMetadataFormat.FindStringSubmatch(h.GetFormat())
				if m == nil {
					errs = append(errs, fmt.Errorf("rate_limits[%d]: hits_addend format %q: only %%DYNAMIC_METADATA(namespace:key)%% is simulated", i, h.GetFormat()))
					break
				}
				rule.HitsAddendMetadata = &MetadataKey{Namespace: m[1], Path: strings.Split(m[2][1:], ":")}
			}
		}
		for j, a := range rl.GetActions() {
			rh := a.GetRequestHeaders()
			if rh == nil {
				errs = append(errs, fmt.Errorf("rate_limits[%d].actions[%d]: only request_headers actions are simulated", i, j))
				continue
			}
			rule.Headers = append(rule.Headers, RateLimitHeader{HeaderName: strings.ToLower(rh.GetHeaderName()),
				DescriptorKey: rh.GetDescriptorKey(), SkipIfAbsent: rh.GetSkipIfAbsent()})
		}
		rules = append(rules, rule)
	}
	if err := errors.Join(errs...); err != nil {
		return "", nil, err
	}
	return p.GetDomain(), rules, nil
}

// RateLimitFromVirtualHostYAML reads a virtual host (config.route.v3.VirtualHost, as YAML)
// the way Envoy does and converts its typed_per_filter_config for the rate limit filter with
// RateLimitFromProto.
func RateLimitFromVirtualHostYAML(data []byte) (domain string, rules []RateLimitRule, err error) {
	var v any
	if err := yaml.Unmarshal(data, &v); err != nil {
		return "", nil, err
	}
	js, err := json.Marshal(v)
	if err != nil {
		return "", nil, err
	}
	var vh routev3.VirtualHost
	if err := protojson.Unmarshal(js, &vh); err != nil {
		return "", nil, fmt.Errorf("not a VirtualHost: %w", err)
	}
	if err := vh.ValidateAll(); err != nil {
		return "", nil, err
	}
	a := vh.GetTypedPerFilterConfig()[RateLimitFilterName]
	if a == nil {
		return "", nil, fmt.Errorf("the virtual host has no typed_per_filter_config for %s", RateLimitFilterName)
	}
	var p ratelimitfilterv3.RateLimitPerRoute
	if err := a.UnmarshalTo(&p); err != nil {
		return "", nil, err
	}
	return RateLimitFromProto(&p)
}

// descriptor builds the rule's descriptor (RateLimitPolicy::populateDescriptors); false when
// the rule produces none.
func (rule RateLimitRule) descriptor(h Headers, md map[string]*structpb.Struct) (*rlcommonv3.RateLimitDescriptor, bool) {
	d := &rlcommonv3.RateLimitDescriptor{}
	for _, a := range rule.Headers {
		v, ok := h.Lookup(a.HeaderName)
		if !ok {
			if a.SkipIfAbsent {
				continue
			}
			return nil, false
		}
		d.Entries = append(d.Entries, &rlcommonv3.RateLimitDescriptor_Entry{Key: a.DescriptorKey, Value: v})
	}
	switch {
	case rule.HitsAddendMetadata != nil:
		n, ok := metadataHits(md, rule.HitsAddendMetadata)
		if !ok {
			return nil, false
		}
		d.HitsAddend = wrapperspb.UInt64(n)
	case rule.HitsAddend != nil:
		d.HitsAddend = wrapperspb.UInt64(*rule.HitsAddend)
	}
	return d, true
}

// metadataHits resolves a %DYNAMIC_METADATA% hits_addend: a number, or a string holding one,
// in [0, 1e9], truncated to an integer.
func metadataHits(md map[string]*structpb.Struct, k *MetadataKey) (uint64, bool) {
	st := md[k.Namespace]
	if st == nil {
		return 0, false
	}
	var v *structpb.Value
	for i, key := range k.Path {
		v = st.GetFields()[key]
		if v == nil {
			return 0, false
		}
		if i < len(k.Path)-1 {
			if st = v.GetStructValue(); st == nil {
				return 0, false
			}
		}
	}
	var n float64
	switch x := v.GetKind().(type) {
	case *structpb.Value_NumberValue:
		n = x.NumberValue
	case *structpb.Value_StringValue:
		f, err := strconv.ParseFloat(strings.TrimSpace(x.StringValue), 64)
		if err != nil {
			return 0, false
		}
		n = f
	default:
		return 0, false
	}
	if math.IsNaN(n) || n < 0 || n > maxHitsAddend {
		return 0, false
	}
	return uint64(n), true
}

// descriptors builds the descriptors of the rules applied at one point (request path or
// stream done).
func (r *RateLimit) descriptors(onStreamDone bool, h Headers, md map[string]*structpb.Struct) []*rlcommonv3.RateLimitDescriptor {
	var out []*rlcommonv3.RateLimitDescriptor
	for _, rule := range r.Rules {
		if rule.OnStreamDone != onStreamDone {
			continue
		}
		if d, ok := rule.descriptor(h, md); ok {
			out = append(out, d)
		}
	}
	return out
}

// rateLimitClient returns a client of the rate limit service at addr, sharing one connection
// per address for the simulator's lifetime, as Envoy shares its connection to the cluster.
func (s *Sim) rateLimitClient(addr string) (rlsv3.RateLimitServiceClient, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	if c, ok := s.rlConns[addr]; ok {
		return rlsv3.NewRateLimitServiceClient(c), nil
	}
	c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	if s.rlConns == nil {
		s.rlConns = map[string]*grpc.ClientConn{}
	}
	s.rlConns[addr] = c
	return rlsv3.NewRateLimitServiceClient(c), nil
}

// callRateLimit makes one ShouldRateLimit call under the filter's timeout and records it.
func (f *filter) callRateLimit(ctx context.Context, onStreamDone bool, descs []*rlcommonv3.RateLimitDescriptor) RateLimitCall {
	rl := f.cfg.RateLimit
	call := RateLimitCall{OnStreamDone: onStreamDone, Request: &rlsv3.RateLimitRequest{Domain: rl.Domain, Descriptors: descs}}
	client, err := f.sim.rateLimitClient(rl.Addr)
	if err == nil {
		timeout := rl.Timeout
		if timeout == 0 {
			timeout = DefaultRateLimitTimeout
		}
		if timeout > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, timeout)
			defer cancel()
		}
		call.Response, err = client.ShouldRateLimit(ctx, call.Request)
	}
	call.Err = err
	f.res.RateLimitCalls = append(f.res.RateLimitCalls, call)
	return call
}

// checkRateLimit is the rate limit filter's decodeHeaders and its completion; it reports
// whether the request goes on to the next filter.
func (f *filter) checkRateLimit() bool {
	rl := f.cfg.RateLimit
	f.rlStarted = true
	descs := rl.descriptors(false, f.dec.headers, f.dynMeta)
	if len(descs) == 0 {
		return true
	}
	call := f.callRateLimit(f.ctx, false, descs)
	if f.ctx.Err() != nil {
		// The client went away while the call was in flight: Envoy cancels it, and its
		// onDestroy makes no stream-done call.
		f.rlCanceled = true
		f.cancelRequested = true
		return false
	}
	if call.Err != nil {
		if !rl.FailureModeDeny {
			return true
		}
		code := rl.StatusOnError
		if code == 0 {
			code = http.StatusInternalServerError
		}
		f.localReplyWith(LocalRateLimitError, code, nil, nil, nil, "rate_limiter_error")
		return false
	}
	resp := call.Response
	if md := resp.GetDynamicMetadata(); md != nil && len(md.GetFields()) > 0 {
		mergeMetadata(f.dynMeta, RateLimitFilterName, md)
	}
	if resp.GetOverallCode() == rlsv3.RateLimitResponse_OVER_LIMIT {
		var extra Headers
		for _, h := range resp.GetResponseHeadersToAdd() {
			extra = append(extra, Header{Key: strings.ToLower(h.GetKey()), Value: h.GetValue()})
		}
		if !rl.DisableXEnvoyRateLimitedHeader {
			extra = append(extra, Header{Key: "x-envoy-ratelimited", Value: "true"})
		}
		code := rl.RateLimitedStatus
		if code < 400 {
			code = http.StatusTooManyRequests
		}
		f.localReplyWith(LocalRateLimited, code, nil, extra, resp.GetRawBody(), "request_rate_limited")
		return false
	}
	for _, h := range resp.GetRequestHeadersToAdd() {
		f.dec.headers = append(f.dec.headers, Header{Key: strings.ToLower(h.GetKey()), Value: h.GetValue()})
	}
	return true
}

// chargeOnStreamDone is the rate limit filter's onDestroy: the stream-done descriptors, built
// from the request headers and dynamic metadata as they are at the end, in one call whose
// answer changes nothing.
func (f *filter) chargeOnStreamDone() {
	rl := f.cfg.RateLimit
	if rl == nil || !f.rlStarted || f.rlCanceled {
		return
	}
	descs := rl.descriptors(true, f.dec.headers, f.dynMeta)
	if len(descs) == 0 {
		return
	}
	f.callRateLimit(context.Background(), true, descs)
}
