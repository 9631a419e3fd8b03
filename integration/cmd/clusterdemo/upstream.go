package main

import (
	"context"
	"io"
	"sync"
	"sync/atomic"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// countingUpstream forwards to the mock LLM and counts, per feature, the requests the upstream
// is serving across the whole fleet, and the most it served at once.
//
// A request counts from the moment the router calls the upstream until its response body has
// been read to the end (or the upstream failed). Both edges lie inside the time the replica that
// admitted the request holds its slot: the slot is taken before the request is forwarded, and
// given back only once the last response chunk has reached the replica, which is after this
// wrapper has seen it. So the peak counted here never exceeds what the replicas held together.
type countingUpstream struct {
	inner envoysim.Upstream

	mu       sync.Mutex
	inFlight map[string]int
	peak     map[string]int
}

func newCountingUpstream(inner envoysim.Upstream) *countingUpstream {
	return &countingUpstream{inner: inner, inFlight: map[string]int{}, peak: map[string]int{}}
}

// Serve implements envoysim.Upstream.
func (u *countingUpstream) Serve(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
	feature := req.Headers.Get(extproc.HeaderFeature)
	if feature == "" {
		feature = req.Headers.Get(headerFeature)
	}
	u.add(feature, 1)
	var once sync.Once
	done := func() { once.Do(func() { u.add(feature, -1) }) }
	resp, err := u.inner.Serve(ctx, req)
	if err != nil || resp == nil || resp.Body == nil {
		done()
		return resp, err
	}
	b := &countedBody{inner: resp.Body, done: done}
	if m, ok := resp.Body.(interface{ More() bool }); ok {
		resp.Body = &countedBodyMore{countedBody: b, more: m}
	} else {
		resp.Body = b
	}
	return resp, nil
}

func (u *countingUpstream) add(feature string, d int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.inFlight[feature] += d
	u.peak[feature] = max(u.peak[feature], u.inFlight[feature])
}

// snapshot returns the requests in flight and the peaks per feature.
func (u *countingUpstream) snapshot() (inFlight, peak map[string]int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	inFlight, peak = map[string]int{}, map[string]int{}
	for k, v := range u.inFlight {
		inFlight[k] = v
	}
	for k, v := range u.peak {
		peak[k] = v
	}
	return inFlight, peak
}

// countedBody calls done once the body has ended, failed or been closed.
type countedBody struct {
	inner envoysim.BodySource
	done  func()
	ended atomic.Bool
}

func (b *countedBody) Next(ctx context.Context) ([]byte, error) {
	p, err := b.inner.Next(ctx)
	if err != nil {
		b.end()
	}
	return p, err
}

func (b *countedBody) end() {
	if !b.ended.Swap(true) {
		b.done()
	}
}

// Trailers passes the inner body's trailers on (none when it has none).
func (b *countedBody) Trailers() envoysim.Headers {
	if ts, ok := b.inner.(envoysim.TrailerSource); ok {
		return ts.Trailers()
	}
	return nil
}

// Close releases the inner body when the router drops it.
func (b *countedBody) Close() error {
	b.end()
	if c, ok := b.inner.(io.Closer); ok {
		return c.Close()
	}
	return nil
}

// countedBodyMore is a countedBody whose inner body can tell its last chunk: the simulator then
// sends that chunk with end_of_stream and reads no further, so the end is counted there.
type countedBodyMore struct {
	*countedBody
	more interface{ More() bool }
}

func (b *countedBodyMore) Next(ctx context.Context) ([]byte, error) {
	p, err := b.countedBody.Next(ctx)
	if err == nil && !b.more.More() {
		b.end()
	}
	return p, err
}

func (b *countedBodyMore) More() bool { return b.more.More() }
