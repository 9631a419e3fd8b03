package envoysim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// Chunk is one piece of a body, an immutable value. Delay is waited before the chunk arrives;
// Wait, when non-nil, must be closed before it arrives. Both let a test
// place a chunk relative to other events without sleeping in the test.
type Chunk struct {
	Data  []byte
	Delay time.Duration
	Wait  <-chan struct{}
}

// BodySource yields a body chunk by chunk. Next returns io.EOF after the
// last chunk and any other error to signal a reset mid-body. A BodySource
// is read by one goroutine at a time.
type BodySource interface {
	Next(ctx context.Context) ([]byte, error)
}

// TrailerSource is implemented by a BodySource whose trailers are only
// known once the body has been read (HTTP/1.1 and HTTP/2 trailers).
type TrailerSource interface {
	Trailers() Headers
}

// ErrUpstreamReset is returned by a BodySource built with ResetAfter to
// simulate the upstream resetting the stream mid-body.
var ErrUpstreamReset = errors.New("upstream reset mid-body")

// ChunkSource returns a BodySource that yields chunks in order, honouring
// each chunk's Delay and Wait. After resetAfter chunks (if resetAfter ≥ 0)
// it fails with ErrUpstreamReset instead of ending.
func ChunkSource(resetAfter int, chunks ...Chunk) BodySource {
	return &chunkSource{chunks: chunks, resetAfter: resetAfter}
}

type chunkSource struct {
	chunks     []Chunk
	next       int
	resetAfter int
}

// More reports whether another chunk (or a reset) follows, so the last
// chunk can carry end_of_stream as it does with a content-length body.
func (s *chunkSource) More() bool {
	return s.resetAfter >= 0 || s.next < len(s.chunks)
}

func (s *chunkSource) Next(ctx context.Context) ([]byte, error) {
	if s.resetAfter >= 0 && s.next >= s.resetAfter {
		return nil, ErrUpstreamReset
	}
	if s.next >= len(s.chunks) {
		return nil, io.EOF
	}
	c := s.chunks[s.next]
	s.next++
	if c.Delay > 0 {
		t := time.NewTimer(c.Delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		}
	}
	if c.Wait != nil {
		select {
		case <-c.Wait:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return c.Data, nil
}

// ReaderSource adapts an io.Reader (a request or response body) into a
// BodySource, one Read per chunk, so a streaming body keeps its pacing.
func ReaderSource(r io.Reader, bufSize int) BodySource {
	if bufSize <= 0 {
		bufSize = 32 << 10
	}
	return &readerSource{r: r, buf: make([]byte, bufSize)}
}

type readerSource struct {
	r   io.Reader
	buf []byte
}

func (s *readerSource) Next(ctx context.Context) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	for {
		n, err := s.r.Read(s.buf)
		if n > 0 {
			return append([]byte(nil), s.buf[:n]...), nil
		}
		if err != nil {
			return nil, err
		}
	}
}

// UpstreamRequest is the request as it leaves the ext_proc filter: headers
// after every mutation, body as the processor let it through. It belongs to
// the Serve call that receives it; Body is read by one goroutine.
type UpstreamRequest struct {
	Method, Path, Authority, Scheme string
	// Headers excludes pseudo-headers.
	Headers Headers
	// Body streams the body chunk by chunk as the filter forwards it; it
	// returns io.EOF at the end. Trailers is valid after that.
	Body io.Reader
	// RouteCacheCleared is set when the processor asked for re-routing.
	RouteCacheCleared bool
	trailers          func() Headers
}

// Trailers returns the request trailers; call it after Body hit io.EOF.
func (r *UpstreamRequest) Trailers() Headers {
	if r.trailers == nil {
		return nil
	}
	return r.trailers()
}

// UpstreamResponse describes what the upstream answers; the simulator reads
// it from one goroutine once Serve has returned it.
type UpstreamResponse struct {
	Status int
	// Headers excludes ":status".
	Headers Headers
	// Body is nil for a response without a body.
	Body BodySource
	// Trailers is sent after the body (or taken from Body when it is a
	// TrailerSource).
	Trailers Headers
	// Lockstep delivers each body chunk only once the filter is no longer
	// waiting for a reply in the response direction, so every chunk becomes
	// its own STREAMED message.
	Lockstep bool
}

// Upstream is the simulated cluster behind Envoy's router. Serve is called
// once per request that passes the filter, on its own goroutine; it must
// return when ctx is done. Implementations must be safe for concurrent use.
type Upstream interface {
	Serve(ctx context.Context, req *UpstreamRequest) (*UpstreamResponse, error)
}

// UpstreamFunc adapts a function to Upstream.
type UpstreamFunc func(ctx context.Context, req *UpstreamRequest) (*UpstreamResponse, error)

// Serve calls f.
func (f UpstreamFunc) Serve(ctx context.Context, req *UpstreamRequest) (*UpstreamResponse, error) {
	return f(ctx, req)
}

// FailureKind is how an upstream failed before sending headers.
type FailureKind int

// Failure kinds and the local reply Envoy's router sends for them.
const (
	// ConnectFailure: 503 "upstream connect error or disconnect/reset before headers".
	ConnectFailure FailureKind = iota
	// UpstreamTimeout: 504 "upstream request timeout".
	UpstreamTimeout
)

// UpstreamError is returned by an Upstream that failed before response
// headers. Any other error is treated as a ConnectFailure.
type UpstreamError struct {
	Kind FailureKind
	Err  error
}

// Error describes the failure.
func (e *UpstreamError) Error() string {
	kind := "connection failure"
	if e.Kind == UpstreamTimeout {
		kind = "upstream request timeout"
	}
	if e.Err != nil {
		return kind + ": " + e.Err.Error()
	}
	return kind
}

// Unwrap returns the cause.
func (e *UpstreamError) Unwrap() error { return e.Err }

// Failing returns an Upstream that reads the request body and then fails
// with the given kind, the way a refused connection or a route timeout does.
func Failing(kind FailureKind) Upstream {
	return UpstreamFunc(func(ctx context.Context, req *UpstreamRequest) (*UpstreamResponse, error) {
		_, _ = io.Copy(io.Discard, req.Body)
		return nil, &UpstreamError{Kind: kind}
	})
}

// StaticResponse is an Upstream that reads the whole request body and then
// answers with a fixed response. It is safe for concurrent use.
type StaticResponse struct {
	Status   int
	Headers  Headers
	Chunks   []Chunk
	Trailers Headers
	// ResetAfter ≥ 1 resets the stream after that many body chunks. Zero
	// means never (a reset before the first chunk is not expressible here;
	// use UpstreamFunc).
	ResetAfter int
	Lockstep   bool
}

// Serve implements Upstream.
func (s *StaticResponse) Serve(ctx context.Context, req *UpstreamRequest) (*UpstreamResponse, error) {
	if _, err := io.Copy(io.Discard, req.Body); err != nil {
		return nil, err
	}
	reset := -1
	if s.ResetAfter > 0 {
		reset = s.ResetAfter
	}
	status := s.Status
	if status == 0 {
		status = 200
	}
	resp := &UpstreamResponse{Status: status, Headers: s.Headers.Clone(), Trailers: s.Trailers.Clone(), Lockstep: s.Lockstep}
	if len(s.Chunks) > 0 || reset >= 0 {
		resp.Body = ChunkSource(reset, s.Chunks...)
	}
	return resp, nil
}

// Respond is a shorthand for a StaticResponse with one body chunk.
func Respond(status int, headers Headers, body string) *StaticResponse {
	r := &StaticResponse{Status: status, Headers: headers}
	if body != "" {
		r.Chunks = []Chunk{{Data: []byte(body)}}
	}
	return r
}

// HTTPUpstream forwards requests to a real HTTP server, streaming the
// request body as the filter releases it and the response body read by
// read, so server-sent events keep their pacing. It is safe for concurrent
// use.
type HTTPUpstream struct {
	base   *url.URL
	client *http.Client
	// RouteHeader and Routes re-route a request: when the (possibly
	// mutated) request header RouteHeader has a value listed in Routes, the
	// request goes to that base URL instead. This is how a processor's
	// "x-llm-provider: fallback" + clear_route_cache is honoured.
	RouteHeader string
	Routes      map[string]string
}

// NewHTTPUpstream returns an HTTPUpstream for baseURL (scheme and host, and
// optionally a path prefix).
func NewHTTPUpstream(baseURL string) (*HTTPUpstream, error) {
	u, err := url.Parse(baseURL)
	if err != nil {
		return nil, fmt.Errorf("upstream URL: %w", err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("upstream URL %q: scheme must be http or https", baseURL)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 1024
	tr.DisableCompression = true
	return &HTTPUpstream{base: u, client: &http.Client{Transport: tr}}, nil
}

// CloseIdleConnections releases pooled connections.
func (u *HTTPUpstream) CloseIdleConnections() { u.client.CloseIdleConnections() }

// hopHeaders are connection-specific and never forwarded, as in Envoy.
var hopHeaders = map[string]bool{"connection": true, "keep-alive": true, "proxy-connection": true,
	"transfer-encoding": true, "upgrade": true, "te": true, "trailer": true}

// Serve implements Upstream.
func (u *HTTPUpstream) Serve(ctx context.Context, req *UpstreamRequest) (*UpstreamResponse, error) {
	base := u.base
	if u.RouteHeader != "" {
		if alt, ok := u.Routes[req.Headers.Get(u.RouteHeader)]; ok {
			b, err := url.Parse(alt)
			if err != nil {
				return nil, &UpstreamError{Kind: ConnectFailure, Err: err}
			}
			base = b
		}
	}
	target := strings.TrimSuffix(base.String(), "/") + req.Path
	var body io.Reader = req.Body
	hreq, err := http.NewRequestWithContext(ctx, req.Method, target, body)
	if err != nil {
		return nil, &UpstreamError{Kind: ConnectFailure, Err: err}
	}
	hreq.ContentLength = -1
	for _, f := range req.Headers {
		if hopHeaders[f.Key] || f.Key == "content-length" || f.Key == "host" {
			continue
		}
		hreq.Header.Add(f.Key, f.Value)
	}
	if cl := req.Headers.Get("content-length"); cl != "" {
		var n int64
		if _, err := fmt.Sscan(cl, &n); err == nil && n >= 0 {
			hreq.ContentLength = n
		}
	}
	if hreq.ContentLength == 0 {
		hreq.Body = http.NoBody
	}
	if req.Authority != "" {
		hreq.Host = req.Authority
	}
	resp, err := u.client.Do(hreq)
	if err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil, &UpstreamError{Kind: UpstreamTimeout, Err: err}
		}
		return nil, &UpstreamError{Kind: ConnectFailure, Err: err}
	}
	out := &UpstreamResponse{Status: resp.StatusCode}
	for k, vs := range resp.Header {
		lk := strings.ToLower(k)
		if hopHeaders[lk] {
			continue
		}
		for _, v := range vs {
			out.Headers = append(out.Headers, Header{Key: lk, Value: v})
		}
	}
	if resp.ContentLength >= 0 && resp.Header.Get("Content-Length") == "" && resp.ContentLength > 0 {
		out.Headers.Set("content-length", fmt.Sprint(resp.ContentLength))
	}
	if resp.ContentLength == 0 || req.Method == http.MethodHead {
		_ = resp.Body.Close()
		return out, nil
	}
	out.Body = &httpBody{resp: resp, src: ReaderSource(resp.Body, 32<<10), remaining: resp.ContentLength}
	return out, nil
}

type httpBody struct {
	resp      *http.Response
	src       BodySource
	remaining int64
}

// More lets the last chunk of a content-length body carry end_of_stream;
// a chunked body ends with a separate empty chunk, as in Envoy.
func (b *httpBody) More() bool { return b.remaining != 0 }

func (b *httpBody) Next(ctx context.Context) ([]byte, error) {
	p, err := b.src.Next(ctx)
	if b.remaining > 0 {
		b.remaining -= int64(len(p))
		if b.remaining <= 0 {
			b.remaining = 0
			_ = b.resp.Body.Close()
		}
	}
	if err != nil {
		_ = b.resp.Body.Close()
		if errors.Is(err, io.EOF) {
			return nil, io.EOF
		}
		return nil, fmt.Errorf("%w: %v", ErrUpstreamReset, err)
	}
	return p, nil
}

// Close releases the response when the router drops it (a retried attempt).
func (b *httpBody) Close() error { return b.resp.Body.Close() }

func (b *httpBody) Trailers() Headers {
	var out Headers
	for k, vs := range b.resp.Trailer {
		for _, v := range vs {
			out = append(out, Header{Key: strings.ToLower(k), Value: v})
		}
	}
	return out
}

// bodyPipe carries the request body from the filter goroutine to the
// upstream goroutine without ever blocking the filter: pushes are queued.
type bodyPipe struct {
	mu       sync.Mutex
	queue    [][]byte
	cur      []byte
	closed   bool
	err      error
	trailers Headers
	ready    chan struct{}
}

func newBodyPipe() *bodyPipe { return &bodyPipe{ready: make(chan struct{}, 1)} }

func (p *bodyPipe) signal() {
	select {
	case p.ready <- struct{}{}:
	default:
	}
}

func (p *bodyPipe) push(b []byte) {
	if len(b) == 0 {
		return
	}
	p.mu.Lock()
	p.queue = append(p.queue, append([]byte(nil), b...))
	p.mu.Unlock()
	p.signal()
}

func (p *bodyPipe) finish(trailers Headers) {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		p.trailers = trailers.Clone()
	}
	p.mu.Unlock()
	p.signal()
}

func (p *bodyPipe) abort(err error) {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		p.err = err
	}
	p.mu.Unlock()
	p.signal()
}

func (p *bodyPipe) getTrailers() Headers {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.trailers.Clone()
}

// Read implements io.Reader.
func (p *bodyPipe) Read(b []byte) (int, error) {
	for {
		p.mu.Lock()
		if len(p.cur) == 0 && len(p.queue) > 0 {
			p.cur, p.queue = p.queue[0], p.queue[1:]
		}
		if len(p.cur) > 0 {
			n := copy(b, p.cur)
			p.cur = p.cur[n:]
			p.mu.Unlock()
			return n, nil
		}
		if p.closed {
			err := p.err
			p.mu.Unlock()
			if err == nil {
				err = io.EOF
			}
			return 0, err
		}
		p.mu.Unlock()
		<-p.ready
	}
}
