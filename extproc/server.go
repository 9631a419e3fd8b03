// Package extproc is llm-bulkhead's Envoy adapter: the gRPC ext_proc service, one processor per
// stream, translating Envoy's messages into policy calls and policy decisions back into
// replies. It holds no policy of its own: it reads the policy Snapshot's accessors, and
// compiles the settings it needs of the policy file (Settings: body modes, mode_override,
// include_usage, stream bounds) once per snapshot.
//
// A processor moves through one explicit phase — new, request, admitted, responding, done, or
// passthrough — and keeps what the request said, what was decided and what the response showed
// in three small parts. The server bounds what streams may hold (open streams, buffered request
// bodies) and ends streams that go silent, releasing what they hold; a message out of Envoy's
// order ends its stream. The server's gRPC codec decodes Envoy's requests with a decoder of its
// own and marshals the replies with go-control-plane's generated code; anything else is
// protobuf's. A buffered body is held once: counted against server.max_buffered_body_bytes as
// it arrives, before it is copied out of gRPC's receive buffers (one that does not fit is never
// copied), decoded into memory of its own, rewritten there (llmapi.EditBody) and sent back from
// there, counted until gRPC has written it. gRPC marshals
// a reply inside Send, so an admitted request's replies are built in memory its processor keeps
// (replyMem), valid until the stream's next message, and a processor goes back to a pool when
// its stream ends.
//
// Where each thing lives:
//
//   - server.go: the Server, its Options and Process, the loop that reads a stream's messages
//     and sends the replies.
//   - processor.go: the stream state machine: the processor, its phases and parts, Envoy's
//     message order, the dispatch of each message, body modes, and the end of a stream.
//   - request.go: the request's messages: buffering the body and counting it against
//     server.max_buffered_body_bytes, the decision (classify, estimate, admit), the refusal or
//     the admitted request's header and body mutations, and the message-timeout override while
//     it queues.
//   - response.go: the response's messages: status, retry-after (llmapi.ParseRetryAfter),
//     rate-limit headers, the usage scan, first-token and inter-token timing, and settlement.
//   - input.go: the policy.Input adapter over the current message (headers, path, body fields,
//     metadata_context, attributes).
//   - reply.go: replies and their formatting: the shared CONTINUE replies, replyMem, the
//     refusal's status, headers and body in the dialect of the API called, rate-limit header
//     values.
//   - metadata.go: the request's dynamic metadata, written in protobuf's wire form onto the
//     replies that carry it.
//   - idle.go: silent streams and the reaper that ends them (EndableStreams).
//   - attempts.go: streams of the upstream (per-attempt) filter, which admit nothing, and the
//     table that matches them to their admitted request by x-request-id (envoy.upstream_filter).
//   - codec.go, decode.go: the gRPC codec (ServerOption) and its decoder of Envoy's requests.
//   - receive.go: counting a buffered request body in the codec as it arrives, before it is
//     copied (Server.ServerOption).
//   - settings.go: the policy settings the adapter reads, compiled once per snapshot.
//   - cache.go: settings and reply pieces built once per policy snapshot.
//   - decisionlog.go: the rate-limited log of refusals.
//   - metrics.go, tracing.go: the adapter's metrics and spans.
//
// Package llmapi, below it, reads the LLM API traffic itself: request bodies, response usage
// and errors, paths, retry-after.
//
// Imports: package policy (the Engine, Snapshot and Input), policy/config (only in settings.go),
// policy/observe (the metric namespace), llmapi, go-control-plane, gRPC, OpenTelemetry and
// Prometheus; the server registers no metric itself (Collectors). Imported by: the app, and
// tests and benchmarks that serve ext_proc. Package policy never imports it.
package extproc

import (
	"errors"
	"hash/maphash"
	"io"
	"log/slog"
	"runtime/debug"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// Options configure a Server.
type Options struct {
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Tracing records a span per request; the zero value records none.
	Tracing Tracing
	// MemoryLimit is the process's memory limit in bytes (GOMEMLIMIT or its cgroup's; 0: none),
	// from which defaults that size memory are derived (server.max_buffered_body_bytes).
	MemoryLimit int64
}

// Server implements Envoy's ExternalProcessor service over a policy Engine. Safe for
// concurrent use: each stream gets its own processor.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	engine  *policy.Engine
	log     *slog.Logger
	metrics *metrics
	active  atomic.Int64
	// buffered counts the request-body bytes held from a buffered body's arrival until its
	// request is decided and the reply that may carry it has been written (bodyHold); it is
	// what server.max_buffered_body_bytes bounds.
	buffered atomic.Int64
	// countInCodec: the server's streams are served by gRPC servers whose codec counts their
	// buffered request bodies as they arrive (Server.ServerOption).
	countInCodec atomic.Bool
	// epoch anchors the timestamps of stream activity (see idleWatch); like every time the
	// server reads, it comes from the engine's clock.
	epoch time.Time
	// systemClock: the engine's clock is the system clock, so a duration since one of its
	// readings needs only the monotonic clock (time.Since), half of reading the time.
	systemClock bool
	// idle releases admitted requests whose streams went silent.
	idle idleReaper
	// memLimit is Options.MemoryLimit.
	memLimit int64
	// policyParts caches the settings and reply pieces of the live policy snapshot.
	policyParts atomic.Pointer[policyParts]
	// refusals limits the refusals' log lines.
	refusals *refusalLog
	// tracer records requests' spans; nil when tracing is off.
	tracer *tracer
	// attempts follows the attempts of admitted requests (envoy.upstream_filter).
	attempts attemptTable

	// beforeHandle, set only by tests, runs before each message is handled.
	beforeHandle func(*extprocv3.ProcessingRequest)
}

var _ extprocv3.ExternalProcessorServer = (*Server)(nil)

// NewServer returns a Server deciding with engine.
func NewServer(engine *policy.Engine, o Options) *Server {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	s := &Server{engine: engine, log: o.Logger, memLimit: o.MemoryLimit, epoch: engine.Now(), systemClock: engine.SystemClock(), refusals: newRefusalLog(o.Logger)}
	s.idle.srv, s.idle.wake = s, make(chan struct{}, 1)
	s.attempts.seed = maphash.MakeSeed()
	s.tracer = newTracer(o.Tracing)
	s.metrics = newMetrics(s)
	return s
}

// since returns the time elapsed since t, a reading of the engine's clock.
func (s *Server) since(t time.Time) time.Duration {
	if s.systemClock {
		return time.Since(t)
	}
	return s.engine.Now().Sub(t)
}

// Close stops the server's background work (the idle watch, the refusal log's reports of
// lines it held back). Streams still open go on, but an admitted one that goes silent is no
// longer released early. Call it after the gRPC server has stopped. Idempotent.
func (s *Server) Close() {
	s.idle.Close()
	s.refusals.Close()
}

// ActiveStreams returns the number of Process streams currently open.
func (s *Server) ActiveStreams() int64 { return s.active.Load() }

// Process serves one ext_proc stream: one HTTP request as Envoy sees it. It replies to every
// message with exactly one response of the matching type and releases whatever the request
// holds exactly once, however the stream ends.
//
// A stream beyond server.max_streams is refused with RESOURCE_EXHAUSTED before it holds
// anything. A message Envoy would never send at that point (a second request_headers, a request
// message after the response began…) ends the stream with INVALID_ARGUMENT: the client is not
// Envoy, or not one this server understands, and judging the message again would admit the same
// request twice.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	s.metrics.streams.Inc()
	st := s.Settings()
	limit := int64(st.MaxStreams)
	if n := s.active.Add(1); limit > 0 && n > limit {
		s.active.Add(-1)
		s.metrics.refusedMaxStreams.Inc()
		return status.Errorf(codes.ResourceExhausted, "llm-bulkhead already serves %d ext_proc streams (server.max_streams)", limit)
	}
	defer s.active.Add(-1)
	if isUpstreamStream(stream) {
		return s.processAttempt(stream)
	}

	p := newProcessor(s, stream)
	defer func() {
		p.finish()
		// Not reached when finish panics: a processor in an unknown state is not reused.
		p.recycle()
	}()
	p.watch(st.FirstMessageTimeout, st.StreamIdleTimeout)
	for {
		req, err := p.recv()
		if err != nil {
			// Envoy is done with the stream (reset, half-close or error), or the server ended
			// it for silence (see endStatus).
			p.ended(endReason(err))
			return p.endStatus()
		}
		p.busy()
		if err := p.checkOrder(req); err != nil {
			return err
		}
		resp := p.safeHandle(req)
		p.heard()
		if resp == nil {
			// The request was abandoned while queued (the stream is gone): nothing to send.
			return p.endStatus()
		}
		if err := stream.Send(resp); err != nil {
			p.ended(endSendFailed)
			return p.endStatus()
		}
		p.afterSend(resp)
	}
}

// endStatus is what Process returns when its stream ends without an error of its own: OK when
// Envoy ended it (nobody reads the status then), DEADLINE_EXCEEDED when the server ended it for
// silence — never OK, which Envoy would take as "continue without the processor" and let a
// request still waiting for its decision pass unjudged. Over gRPC the status is written as
// Recv or Send fails (see endable); this is the same for other transports.
func (p *processor) endStatus() error {
	why := p.idle.expired.Load()
	if why == silenceNone {
		return nil
	}
	st := p.srv.Settings()
	if why == silenceFirst {
		return status.Errorf(codes.DeadlineExceeded, "no message within server.first_message_timeout (%s) of the stream opening", st.FirstMessageTimeout)
	}
	return status.Errorf(codes.DeadlineExceeded, "no message for server.stream_idle_timeout (%s)", st.StreamIdleTimeout)
}

// endReason classifies how Envoy ended the stream, for the outcome and metrics.
func endReason(err error) end {
	if errors.Is(err, io.EOF) {
		return endHalfClosed
	}
	if status.Code(err) == codes.Canceled {
		return endReset
	}
	return endError
}

// safeHandle runs handle, turning a panic into a pass-through reply of the matching type so
// the request continues without the processor (fail-open for that request only).
func (p *processor) safeHandle(req *extprocv3.ProcessingRequest) (resp *extprocv3.ProcessingResponse) {
	if p.phase != phasePassthrough && p.idle.released.Load() {
		// The admission was released while the stream was silent: nothing is held any more, so
		// nothing is left to judge or settle.
		p.phase = phasePassthrough
	}
	if p.phase == phasePassthrough {
		return passthroughReply(req)
	}
	defer func() {
		if r := recover(); r != nil {
			p.srv.metrics.panics.Inc()
			p.srv.log.Error("panic while processing a message; the request continues without the processor",
				"request_id", p.req.id, "panic", r, "stack", string(debug.Stack()))
			p.phase, p.now = phasePassthrough, time.Time{}
			resp = passthroughReply(req)
		}
	}()
	if p.srv.beforeHandle != nil {
		p.srv.beforeHandle(req)
	}
	return p.handle(req)
}
