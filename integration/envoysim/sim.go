package envoysim

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// MaxMessageSize is the gRPC message size limit the simulator uses in both
// directions, well above a 1 MiB body plus headers. Envoy itself has no
// per-message limit on its side stream.
const MaxMessageSize = 64 << 20

// ErrClosed is returned by calls on a closed Sim.
var ErrClosed = errors.New("envoysim: simulator closed")

// Sim plays Envoy's side of the ext_proc protocol against one gRPC target,
// sharing one client connection across any number of concurrent simulated
// HTTP requests, as an Envoy worker shares its connection to the
// ext_proc cluster. A Sim is safe for concurrent use.
type Sim struct {
	conn   *grpc.ClientConn
	client extprocv3.ExternalProcessorClient
	cfg    FilterConfig

	mu       sync.Mutex
	closed   bool
	deferred map[*procStream]*time.Timer
	bg       sync.WaitGroup
	rlConns  map[string]*grpc.ClientConn
}

// New connects (lazily, as gRPC does) to target, a gRPC target such as
// "127.0.0.1:9002", and returns a simulator whose filter behaves as cfg
// says. Extra dial options are appended after the simulator's own
// (insecure transport, 64 MiB messages).
func New(target string, cfg FilterConfig, opts ...grpc.DialOption) (*Sim, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("filter config: %w", err)
	}
	dial := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxMessageSize), grpc.MaxCallSendMsgSize(MaxMessageSize)),
		grpc.WithInitialWindowSize(4 << 20),
		grpc.WithInitialConnWindowSize(16 << 20),
	}, opts...)
	conn, err := grpc.NewClient(target, dial...)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", target, err)
	}
	return &Sim{conn: conn, client: extprocv3.NewExternalProcessorClient(conn), cfg: cfg,
		deferred: map[*procStream]*time.Timer{}}, nil
}

// Config returns the filter configuration the simulator was built with.
func (s *Sim) Config() FilterConfig { return s.cfg }

// Close resets streams still waiting for a deferred close, waits for
// background closes started by the HTTP face, and closes the connection.
// In-flight RoundTrips must have returned first.
func (s *Sim) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	pending := s.deferred
	s.deferred = nil
	s.mu.Unlock()
	for st, t := range pending {
		t.Stop()
		st.reset()
		<-st.recvDone
		<-st.sendDone
	}
	s.bg.Wait()
	s.mu.Lock()
	rl := s.rlConns
	s.rlConns = nil
	s.mu.Unlock()
	for _, c := range rl {
		_ = c.Close()
	}
	return s.conn.Close()
}

func (s *Sim) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// deferReset resets st after d, as Envoy's deferred close in observability
// mode does; Close does it at once.
func (s *Sim) deferReset(st *procStream, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		st.reset()
		return
	}
	s.deferred[st] = time.AfterFunc(d, func() {
		s.mu.Lock()
		_, mine := s.deferred[st]
		delete(s.deferred, st)
		s.mu.Unlock()
		if mine {
			st.reset()
		}
	})
}

// RoundTrip runs one HTTP request through the simulated filter exactly as
// Envoy would, calling up for the upstream part, and returns what happened
// once the client has its answer and the gRPC stream is finished (for a
// graceful close: once the server returned or the remote-close timeout
// passed). Cancelling ctx is a downstream reset. The error is non-nil only
// for an invalid request or a closed simulator; everything Envoy would do
// about failures is in the Result.
func (s *Sim) RoundTrip(ctx context.Context, req *Request, up Upstream) (*Result, error) {
	f, err := s.prepare(ctx, req, up, nil)
	if err != nil {
		return nil, err
	}
	f.run()
	f.finish()
	return f.res, nil
}

func (s *Sim) prepare(ctx context.Context, req *Request, up Upstream, sk sink) (*filter, error) {
	if s.isClosed() {
		return nil, ErrClosed
	}
	if req == nil {
		return nil, errors.New("nil request")
	}
	if err := req.validate(); err != nil {
		return nil, err
	}
	if up == nil {
		up = Respond(200, nil, "")
	}
	if ctx == nil {
		ctx = context.Background()
	}
	cfg := s.cfg
	if req.Filter != nil {
		cfg = *req.Filter
	}
	return newFilter(s, cfg, req, up, ctx, sk), nil
}

// RawStream is an unscripted Process stream for protocol-edge tests: the
// caller sends and receives whatever it likes. Send and Recv may be used
// from two different goroutines; each by one goroutine at a time.
type RawStream struct {
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
}

// OpenRaw opens a Process stream on the simulator's connection.
func (s *Sim) OpenRaw(ctx context.Context) (*RawStream, error) {
	if s.isClosed() {
		return nil, ErrClosed
	}
	ctx, cancel := context.WithCancel(ctx)
	st, err := s.client.Process(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	return &RawStream{stream: st, cancel: cancel}, nil
}

// Send sends one message.
func (r *RawStream) Send(m *extprocv3.ProcessingRequest) error { return r.stream.Send(m) }

// Recv receives one reply; io.EOF means the server ended with status OK.
func (r *RawStream) Recv() (*extprocv3.ProcessingResponse, error) { return r.stream.Recv() }

// CloseSend half-closes the stream: the server's Recv returns io.EOF.
func (r *RawStream) CloseSend() error { return r.stream.CloseSend() }

// Reset cancels the stream: the server's Recv returns codes.Canceled. It
// must be called eventually to release the stream's resources.
func (r *RawStream) Reset() { r.cancel() }
