package extproc

import (
	"hash/maphash"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/metadata"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/quota"
)

// Per-attempt outcomes. Envoy's router retries behind the HTTP connection manager's filters, so
// the (downstream) ext_proc filter sees one request and its last attempt's response. The same
// server may also run as Envoy's upstream ext_proc filter (a provider cluster's
// HttpProtocolOptions http_filters, policy envoy.upstream_filter): Envoy builds that filter
// chain anew for every attempt, so each attempt opens a stream of its own, with the attempt's
// request headers (x-request-id as on the client's request) and then its response headers.
//
// Such a stream is told apart by the gRPC metadata FilterPositionKey: FilterPositionUpstream,
// which the upstream filter's grpc_service.initial_metadata sends. It never admits, charges,
// waits or mutates: every message is answered at once with CONTINUE. What it reads — the
// attempt's status, time to headers, retry-after and rate-limit headers — goes to the request
// the downstream stream admitted, found by x-request-id in the server's attemptTable:
//
//   - rate-limit headers go to the provider's quota tracker as each attempt's response comes (a
//     reading replaces the last one, so the final response's, which the downstream stream also
//     reads, does not count twice);
//   - the breaker records an attempt once it is known to have been retried: when the next
//     attempt of the same request opens, or when the request ends with a later attempt. The
//     last attempt's outcome is the request's, which the downstream stream records as without
//     the upstream filter (with what only it sees: the body's usage, first token and errors).
//     A request with n attempts thus counts n outcomes, and one without upstream streams one.
//
// The table holds an entry per admitted request from its admission to the end of its
// downstream stream, which the server always ends (stream_idle_timeout at the latest), so it
// is bounded by the streams open; maxAttemptEntries bounds it besides. An attempt stream keeps
// its entry after that and records into it when it learns its outcome.

// FilterPositionKey is the gRPC metadata (Envoy's grpc_service.initial_metadata) that marks
// the streams of the upstream ext_proc filter, with value FilterPositionUpstream.
const (
	FilterPositionKey      = "x-llm-bulkhead-filter"
	FilterPositionUpstream = "upstream"
)

// maxAttemptEntries bounds the requests whose attempts are followed at once; beyond it a
// request's retried attempts go uncounted (its own outcome still counts).
const maxAttemptEntries = 1 << 18

// maxAttempts bounds the attempts followed per request (Envoy's num_retries is small).
const maxAttempts = 16

// attemptShards spreads the table's lock.
const attemptShards = 32

// attemptTable maps x-request-id to the admitted request whose attempts report to it.
type attemptTable struct {
	seed   maphash.Seed
	n      atomic.Int64
	shards [attemptShards]attemptShard
}

// attemptShard is one lock's part of the table.
type attemptShard struct {
	mu sync.Mutex
	m  map[string]*attemptEntry
}

// attemptEntry is one admitted request as its attempts see it.
type attemptEntry struct {
	target policy.AttemptTarget

	mu sync.Mutex
	// attempts are those whose streams opened, in order.
	attempts []attemptState
	// ended: the downstream stream settled; every attempt but the last was retried.
	ended bool
	// retried is how many attempts are known to have been retried: all but the last once
	// another opened, or once the request ended.
	retried int
}

// attemptState is one attempt: its outcome once known, and whether it was recorded.
type attemptState struct {
	known, recorded bool
	outcome         policy.Outcome
}

func (t *attemptTable) shard(id string) *attemptShard {
	return &t.shards[maphash.String(t.seed, id)%attemptShards]
}

// register makes e the entry of request id and returns the key it is kept under (a copy of
// id), unless id is empty, already taken (ids are not unique: the attempts could not be told
// apart) or the table is full.
func (t *attemptTable) register(id string, e *attemptEntry) (string, bool) {
	if id == "" {
		return "", false
	}
	if t.n.Add(1) > maxAttemptEntries {
		t.n.Add(-1)
		return "", false
	}
	sh := t.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if _, taken := sh.m[id]; taken {
		t.n.Add(-1)
		return "", false
	}
	if sh.m == nil {
		sh.m = map[string]*attemptEntry{}
	}
	key := strings.Clone(id)
	sh.m[key] = e
	return key, true
}

// remove forgets request id's entry e.
func (t *attemptTable) remove(id string, e *attemptEntry) {
	sh := t.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.m[id] == e {
		delete(sh.m, id)
		t.n.Add(-1)
	}
}

// lookup returns request id's entry, nil when none.
func (t *attemptTable) lookup(id string) *attemptEntry {
	sh := t.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.m[id]
}

// begin adds an attempt; every attempt before it was retried. It returns the attempt's index,
// -1 when the request has as many as are followed or has ended.
func (e *attemptEntry) begin(m *metrics) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.ended || len(e.attempts) >= maxAttempts {
		return -1
	}
	e.attempts = append(e.attempts, attemptState{})
	e.retried = len(e.attempts) - 1
	e.recordDue(m)
	return len(e.attempts) - 1
}

// known sets attempt i's outcome.
func (e *attemptEntry) known(i int, o policy.Outcome, m *metrics) {
	e.mu.Lock()
	defer e.mu.Unlock()
	a := &e.attempts[i]
	if a.known {
		return
	}
	a.known, a.outcome = true, o
	e.recordDue(m)
}

// end marks the request's end (its downstream stream settled): all attempts but the last were
// retried.
func (e *attemptEntry) end(m *metrics) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.ended = true
	e.retried = max(len(e.attempts)-1, 0)
	e.recordDue(m)
}

// recordDue records the retried attempts whose outcome is known and not yet recorded.
func (e *attemptEntry) recordDue(m *metrics) {
	for i := 0; i < e.retried; i++ {
		a := &e.attempts[i]
		if !a.known || a.recorded {
			continue
		}
		a.recorded = true
		if e.target.RecordRetried(a.outcome) {
			m.attemptsRecorded.Inc()
		} else {
			m.attemptsNotRecorded.Inc()
		}
	}
}

// isUpstreamStream reports whether the stream is the upstream ext_proc filter's (its gRPC
// metadata says so).
func isUpstreamStream(stream extprocv3.ExternalProcessor_ProcessServer) bool {
	v := metadata.ValueFromIncomingContext(stream.Context(), FilterPositionKey)
	return len(v) == 1 && v[0] == FilterPositionUpstream
}

// processAttempt serves a stream of the upstream ext_proc filter: one attempt of a request
// Envoy's router sends to a provider. Every message gets CONTINUE at once; nothing is admitted,
// held or changed. What the attempt showed reaches the request's entry (see attemptTable).
func (s *Server) processAttempt(stream extprocv3.ExternalProcessor_ProcessServer) error {
	s.metrics.attemptStreams.Inc()
	follow := s.Settings().UpstreamFilter
	var (
		e       *attemptEntry
		idx     = -1
		started time.Time
		replied bool // response headers came
		// sent places the attempt's quota reading by when it was sent.
		sent quota.Reservation
	)
	for {
		req, err := stream.Recv()
		if err != nil {
			if e != nil && idx >= 0 && !replied {
				// The attempt ended without response headers: reset, connect failure or timeout
				// (or the client left, which the stream cannot tell apart — as for a request, the
				// breaker's no_response_as decides).
				now := s.engine.Now()
				e.known(idx, policy.Outcome{Duration: now.Sub(started), At: now}, s.metrics)
			}
			return nil
		}
		var resp *extprocv3.ProcessingResponse
		switch v := req.Request.(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			resp = continueRequestHeaders
			if !follow || e != nil {
				break
			}
			hs := v.RequestHeaders.GetHeaders().GetHeaders()
			id, _ := findHeader(hs, HeaderRequestID)
			if e = s.attempts.lookup(id); e == nil {
				s.metrics.attemptsUnmatched.Inc()
				break
			}
			started = s.engine.Now()
			idx = e.begin(s.metrics)
			sent = e.target.QuotaSent(started)
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			resp = continueResponseHeaders
			if e == nil || idx < 0 || replied {
				break
			}
			replied = true
			now := s.engine.Now()
			hs := v.ResponseHeaders.GetHeaders().GetHeaders()
			st, _ := findHeader(hs, ":status")
			o := policy.Outcome{At: now}
			o.Status, _ = strconv.Atoi(st)
			o.Headers = now.Sub(started)
			o.TTFB, o.Duration = o.Headers, o.Headers
			if ra, ok := findHeader(hs, "retry-after"); ok {
				o.RetryAfter = llmapi.ParseRetryAfter(ra, now)
			}
			if e.target.TracksQuota() {
				var r quota.Reading
				invalid := 0
				for _, h := range hs {
					if known, err := quota.ParseHeader(h.Key, headerValue(h), now, &r); known && err != nil {
						invalid++
					}
				}
				e.target.ObserveQuota(&sent, &r, invalid, now)
			}
			e.known(idx, o, s.metrics)
		default:
			resp = passthroughReply(req)
		}
		if err := stream.Send(resp); err != nil {
			return nil
		}
	}
}

// findHeader returns the value of header name in hs.
func findHeader(hs []*corev3.HeaderValue, name string) (string, bool) {
	for _, h := range hs {
		if h.Key == name {
			return headerValue(h), true
		}
	}
	return "", false
}

// followAttempts registers the admitted request so its attempts report to it (policy
// envoy.upstream_filter).
func (p *processor) followAttempts() {
	if !p.srv.settingsOf(p.snap).UpstreamFilter || p.req.id == "" {
		return
	}
	e := &attemptEntry{target: p.dec.ticket.AttemptTarget()}
	if key, ok := p.srv.attempts.register(p.req.id, e); ok {
		p.attempts, p.attemptsKey = e, key
	} else {
		p.srv.metrics.attemptsUntracked.Inc()
	}
}

// endAttempts ends the request for its attempts: those before the last were retried. Runs
// when the request settles, and at the stream's end at the latest.
func (p *processor) endAttempts() {
	e := p.attempts
	if e == nil {
		return
	}
	p.attempts = nil
	e.end(p.srv.metrics)
	p.srv.attempts.remove(p.attemptsKey, e)
}
