package envoysim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/upstream_codec/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
)

// UpstreamFilter returns an Upstream that runs every call through a simulated ext_proc filter
// configured with cfg in Envoy's upstream HTTP filter position (a cluster's
// HttpProtocolOptions http_filters, before envoy.filters.http.upstream_codec), then calls up.
// Behind Retrying, that is Envoy's per-attempt position: the router builds the upstream filter
// chain anew for every attempt, so each attempt, the first and every retry, opens its own
// ext_proc stream on sim's connection, carrying that attempt's request headers (the client's
// x-request-id on every one) and then its response. As in Envoy:
//
//   - an attempt that fails before response headers (connect failure, reset, timeout) fails
//     to the router, which may retry it; the attempt's stream is reset and gets no response
//     headers;
//   - a local reply of the upstream filter (an ImmediateResponse, or status_on_error when the
//     processor fails and failure_mode_allow is false) is the attempt's response, and the
//     router does not retry it;
//   - the response streams back through the filter chunk by chunk as it does downstream.
//
// cfg.InitialMetadata is sent on every stream (grpc_service.initial_metadata). sim may be the
// one the downstream filter uses: Envoy reaches the same ext_proc cluster from both positions,
// and cfg replaces sim's own filter config for the attempts.
func UpstreamFilter(sim *Sim, cfg FilterConfig, up Upstream) Upstream {
	return UpstreamFunc(func(ctx context.Context, ureq *UpstreamRequest) (*UpstreamResponse, error) {
		req := &Request{Method: ureq.Method, Path: ureq.Path, Authority: ureq.Authority, Scheme: ureq.Scheme,
			Headers: ureq.Headers.Clone(), Filter: &cfg}
		if ureq.Body != nil {
			req.BodySource = ReaderSource(ureq.Body, 32<<10)
		}
		// The upstream's own failure goes to the router as it is; the filter's local reply for
		// it is what a downstream filter would make of it, not what an upstream filter does.
		var upErr error
		var mu sync.Mutex
		tracked := UpstreamFunc(func(ctx context.Context, r *UpstreamRequest) (*UpstreamResponse, error) {
			resp, err := up.Serve(ctx, r)
			if err != nil {
				mu.Lock()
				upErr = err
				mu.Unlock()
			}
			return resp, err
		})
		sk := &attemptSink{ready: make(chan struct{}), body: newBodyPipe()}
		f, err := sim.prepare(ctx, req, tracked, sk)
		if err != nil {
			return nil, err
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			f.run()
			f.finish()
		}()
		select {
		case <-sk.ready:
		case <-done:
		case <-ctx.Done():
			<-done
			return nil, ctx.Err()
		}
		mu.Lock()
		failed := upErr
		mu.Unlock()
		if failed != nil {
			<-done
			return nil, failed
		}
		sk.mu.Lock()
		status, headers, reset := sk.status, sk.hdrs, sk.aborted
		sk.mu.Unlock()
		if status == 0 || reset {
			<-done
			return nil, &UpstreamError{Kind: ConnectFailure, Err: io.ErrUnexpectedEOF}
		}
		return &UpstreamResponse{Status: status, Headers: headers, Body: &attemptBody{pipe: sk.body, done: done}}, nil
	})
}

// attemptSink hands what the upstream filter passes on to the router.
type attemptSink struct {
	mu      sync.Mutex
	once    sync.Once
	ready   chan struct{}
	status  int
	hdrs    Headers
	aborted bool
	body    *bodyPipe
}

func (s *attemptSink) signal() { s.once.Do(func() { close(s.ready) }) }

func (s *attemptSink) headers(status int, h Headers) {
	s.mu.Lock()
	s.status, s.hdrs = status, h.Clone()
	s.mu.Unlock()
	s.signal()
}

func (s *attemptSink) data(b []byte) { s.body.push(b) }

func (s *attemptSink) end(trailers Headers) { s.body.finish(trailers) }

func (s *attemptSink) reset() {
	s.mu.Lock()
	s.aborted = true
	s.mu.Unlock()
	s.body.abort(ErrUpstreamReset)
	s.signal()
}

// attemptBody is the attempt's response body as the upstream filter passes it on.
type attemptBody struct {
	pipe *bodyPipe
	done <-chan struct{}
	buf  [32 << 10]byte
}

func (b *attemptBody) Next(ctx context.Context) ([]byte, error) {
	n, err := b.pipe.Read(b.buf[:])
	if n > 0 {
		return append([]byte(nil), b.buf[:n]...), nil
	}
	if err == io.EOF {
		<-b.done
	}
	return nil, err
}

// Trailers implements TrailerSource.
func (b *attemptBody) Trailers() Headers { return b.pipe.getTrailers() }

// UpstreamFilterFromClusterYAML reads the ext_proc filter of an Envoy cluster's upstream HTTP
// filters (typed_extension_protocol_options HttpProtocolOptions http_filters), as Envoy loads
// the cluster: YAML → proto3 JSON with unknown fields rejected, Envoy's validation rules, and
// upstream_codec last, which Envoy requires of an upstream filter chain.
func UpstreamFilterFromClusterYAML(data []byte) (FilterConfig, error) {
	c, err := parseCluster(data)
	if err != nil {
		return FilterConfig{}, err
	}
	if err := c.ValidateAll(); err != nil {
		return FilterConfig{}, err
	}
	raw := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
	if raw == nil {
		return FilterConfig{}, fmt.Errorf("cluster %s: no HttpProtocolOptions, so no upstream filters", c.GetName())
	}
	var opts httpv3.HttpProtocolOptions
	if err := raw.UnmarshalTo(&opts); err != nil {
		return FilterConfig{}, err
	}
	filters := opts.GetHttpFilters()
	if n := len(filters); n == 0 || filters[n-1].GetName() != "envoy.filters.http.upstream_codec" {
		return FilterConfig{}, fmt.Errorf("cluster %s: the upstream filters must end with envoy.filters.http.upstream_codec", c.GetName())
	}
	for _, f := range filters {
		if f.GetName() != "envoy.filters.http.ext_proc" {
			continue
		}
		var ep extprocfilterv3.ExternalProcessor
		if err := f.GetTypedConfig().UnmarshalTo(&ep); err != nil {
			return FilterConfig{}, err
		}
		return FromProto(&ep)
	}
	return FilterConfig{}, errors.New("cluster " + c.GetName() + ": no envoy.filters.http.ext_proc upstream filter")
}
