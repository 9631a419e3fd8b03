package envoysim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Proxy is the HTTP face of the simulator: an http.Handler that behaves
// like an Envoy listener with the ext_proc filter in front of one upstream
// cluster. Real clients (curl, SDKs) can be pointed at it. A Proxy is safe
// for concurrent use.
type Proxy struct {
	sim      *Sim
	up       *HTTPUpstream
	cfg      FilterConfig
	retry    *RetryPolicy
	upstream *FilterConfig
}

var _ http.Handler = (*Proxy)(nil)

// NewProxy returns a Proxy that runs every request through sim with cfg as
// the filter config and forwards admitted requests to upstreamBaseURL.
func NewProxy(sim *Sim, upstreamBaseURL string, cfg FilterConfig) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("filter config: %w", err)
	}
	up, err := NewHTTPUpstream(upstreamBaseURL)
	if err != nil {
		return nil, err
	}
	return &Proxy{sim: sim, up: up, cfg: cfg}, nil
}

// Upstream exposes the HTTP upstream so callers can add re-routing rules
// (RouteHeader, Routes) before serving.
func (p *Proxy) Upstream() *HTTPUpstream { return p.up }

// SetRetry makes the proxy's router retry like a route's retry_policy (see Retrying), behind
// the filter. Call it before serving.
func (p *Proxy) SetRetry(r RetryPolicy) { p.retry = &r }

// SetUpstreamFilter adds an ext_proc filter with cfg in the upstream (per-attempt) position,
// reached over the proxy's Sim (see UpstreamFilter): behind SetRetry's router it runs once per
// attempt. Call it before serving.
func (p *Proxy) SetUpstreamFilter(cfg FilterConfig) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("upstream filter config: %w", err)
	}
	p.upstream = &cfg
	return nil
}

// ServeHTTP runs one request through the simulated filter and writes what
// Envoy would send downstream, flushing every body chunk. A downstream
// reset is an aborted connection.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	_ = rc.EnableFullDuplex()
	req := &Request{
		Method: r.Method, Path: r.URL.RequestURI(), Authority: r.Host, Scheme: "http",
		Headers: sortedHeaders(r.Header),
	}
	if r.TLS != nil {
		req.Scheme = "https"
	}
	if r.ContentLength > 0 {
		req.Headers = append(req.Headers, Header{Key: "content-length", Value: strconv.FormatInt(r.ContentLength, 10)})
	}
	var body *requestBody
	if r.ContentLength != 0 && r.Body != nil && r.Body != http.NoBody {
		body = &requestBody{r: r, src: ReaderSource(r.Body, 32<<10), remaining: r.ContentLength}
		req.BodySource = body
	}
	cfg := p.cfg
	req.Filter = &cfg
	sk := &httpSink{w: w, rc: rc}
	var up Upstream = p.up
	if p.upstream != nil {
		up = UpstreamFilter(p.sim, *p.upstream, up)
	}
	if p.retry != nil {
		up = Retrying(up, *p.retry)
	}
	f, err := p.sim.prepare(r.Context(), req, up, sk)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	f.run()
	// The stream is over; its helpers may still be reading the request body (the processor
	// failed, or the response ended before the request). Once this handler returns the body is
	// net/http's: no read of it may outlive the handler.
	body.stop(rc)
	if !p.sim.background(f.finish) {
		f.finish()
	}
	if sk.aborted {
		// The documented way to make net/http reset the client connection,
		// which is what Envoy does to a downstream stream it resets.
		panic(http.ErrAbortHandler)
	}
}

// background runs fn on a goroutine tracked by Close; it reports false
// when the simulator is closed and fn must run inline.
func (s *Sim) background(fn func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		fn()
	}()
	return true
}

func sortedHeaders(hh http.Header) Headers {
	keys := make([]string, 0, len(hh))
	for k := range hh {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var out Headers
	for _, k := range keys {
		for _, v := range hh[k] {
			out = append(out, Header{Key: strings.ToLower(k), Value: v})
		}
	}
	return out
}

// requestBody exposes the request trailers once the body has been read,
// and, for a content-length body, lets the last chunk carry end_of_stream.
// Reads stop for good at stop: the handler that owns the body is returning.
type requestBody struct {
	r *http.Request
	// mu is held while the body is read; stopped is set (under it) by stop.
	mu        sync.Mutex
	stopped   bool
	src       BodySource
	remaining int64
}

// errBodyStopped is what a read of a request body whose handler has returned gets.
var errBodyStopped = errors.New("envoysim: the downstream request ended")

// stopGrace is how long stop lets a read already under way finish on its own.
const stopGrace = 50 * time.Millisecond

func (b *requestBody) Next(ctx context.Context) ([]byte, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopped {
		return nil, errBodyStopped
	}
	p, err := b.src.Next(ctx)
	if b.remaining > 0 {
		b.remaining -= int64(len(p))
	}
	return p, err
}

// stop ends every read of the body, waiting for one under way: within stopGrace, or at once by
// the connection's read deadline when the client keeps it waiting (net/http then closes the
// connection, as Envoy closes one whose request was not read whole when the response ended).
// Then it closes the body, which reads what is left of it here, in the handler: with full
// duplex on, net/http would otherwise do that after the handler returned, racing its own read
// of the next request (Go issue 68560: "invalid concurrent Body.Read call"). A nil body has
// nothing to stop.
func (b *requestBody) stop(rc *http.ResponseController) {
	if b == nil {
		return
	}
	if !b.mu.TryLock() {
		locked := make(chan struct{})
		go func() {
			b.mu.Lock()
			close(locked)
		}()
		t := time.NewTimer(stopGrace)
		select {
		case <-locked:
		case <-t.C:
			_ = rc.SetReadDeadline(time.Now())
			<-locked
		}
		t.Stop()
	}
	b.stopped = true
	_ = b.r.Body.Close()
	b.mu.Unlock()
}

func (b *requestBody) More() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.remaining != 0
}

func (b *requestBody) Trailers() Headers {
	b.mu.Lock()
	defer b.mu.Unlock()
	return sortedHeaders(b.r.Trailer)
}

type httpSink struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	aborted bool
}

func (s *httpSink) headers(status int, h Headers) {
	hh := s.w.Header()
	for _, f := range h {
		if hopHeaders[f.Key] {
			continue
		}
		hh.Add(f.Key, f.Value)
	}
	s.w.WriteHeader(status)
	_ = s.rc.Flush()
}

func (s *httpSink) data(b []byte) {
	_, _ = s.w.Write(b)
	_ = s.rc.Flush()
}

func (s *httpSink) end(trailers Headers) {
	for _, f := range trailers {
		s.w.Header().Add(http.TrailerPrefix+f.Key, f.Value)
	}
}

func (s *httpSink) reset() { s.aborted = true }

// ProxyServer is a Proxy listening on a local address. Close may be
// called from any goroutine, once.
type ProxyServer struct {
	// URL is the base URL clients should use, e.g. "http://127.0.0.1:40123".
	URL string
	srv *http.Server
	lis net.Listener
	err chan error
}

// ServeProxy listens on addr ("127.0.0.1:0" when empty) and serves p until
// Close.
func ServeProxy(p *Proxy, addr string) (*ProxyServer, error) {
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	ps := &ProxyServer{
		URL: "http://" + lis.Addr().String(), lis: lis, err: make(chan error, 1),
		srv: &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second},
	}
	go func() { ps.err <- ps.srv.Serve(lis) }()
	return ps, nil
}

// Close stops accepting, waits up to the context's deadline for in-flight
// requests, then closes the rest.
func (ps *ProxyServer) Close(ctx context.Context) error {
	err := ps.srv.Shutdown(ctx)
	if err != nil {
		_ = ps.srv.Close()
	}
	if serr := <-ps.err; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
		return serr
	}
	return err
}
