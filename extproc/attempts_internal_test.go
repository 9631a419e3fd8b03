package extproc

import (
	"context"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
)

// attemptsPolicy has one provider with a breaker and the upstream filter on (unless off).
func attemptsPolicy(on bool) string {
	p := `
providers: {default: {breaker: b}}
breakers: {b: {sliding_window_type: COUNT_BASED, sliding_window_size: 100, minimum_calls: 100, failure_rate_threshold: 50, wait_in_open: 10s}}
features: {default: {max_concurrent: 10}}
`
	if on {
		p += "envoy: {upstream_filter: true}\n"
	}
	return p
}

// replayStream plays msgs to Process and keeps its replies; upstream marks it as the upstream
// filter's (gRPC metadata).
type replayStream struct {
	grpc.ServerStream
	ctx     context.Context
	msgs    []*extprocv3.ProcessingRequest
	next    int
	replies []*extprocv3.ProcessingResponse
	record  bool
}

func newReplay(upstream bool, msgs ...*extprocv3.ProcessingRequest) *replayStream {
	ctx := context.Background()
	if upstream {
		ctx = metadata.NewIncomingContext(ctx, metadata.Pairs(FilterPositionKey, FilterPositionUpstream))
	}
	return &replayStream{ctx: ctx, msgs: msgs, record: true}
}

func (s *replayStream) Context() context.Context { return s.ctx }
func (s *replayStream) Recv() (*extprocv3.ProcessingRequest, error) {
	if s.next == len(s.msgs) {
		return nil, io.EOF
	}
	s.next++
	return s.msgs[s.next-1], nil
}
func (s *replayStream) Send(r *extprocv3.ProcessingResponse) error {
	if s.record {
		s.replies = append(s.replies, proto.Clone(r).(*extprocv3.ProcessingResponse))
	}
	return nil
}

func reqHeaders(id string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: headersMsg(true, ":method", "POST", ":path", "/v1/chat/completions", "x-request-id", id)}}
}

func resHeaders(status string, kv ...string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: headersMsg(true, append([]string{":status", status}, kv...)...)}}
}

// admitDownstream admits request id on a downstream stream and leaves it open (in flight).
func admitDownstream(t testing.TB, srv *Server, id string) *processor {
	t.Helper()
	pr := newProcessor(srv, quietStream{ctx: context.Background()})
	resp := pr.handle(reqHeaders(id))
	if _, ok := resp.Response.(*extprocv3.ProcessingResponse_RequestHeaders); !ok || pr.phase != phaseAdmitted {
		t.Fatalf("request %s not admitted: %v", id, resp)
	}
	pr.afterSend(resp)
	return pr
}

func calls(t testing.TB, eng *policy.Engine) breaker.Counts {
	t.Helper()
	for _, b := range eng.Breakers() {
		if b.Name == "default" {
			return b.Calls
		}
	}
	t.Fatal("no breaker")
	return breaker.Counts{}
}

// TestAttemptStreamsOnlyObserve: a stream of the upstream filter is answered CONTINUE on every
// message without being judged — nothing is admitted, even with the option off — and,
// unmatched by any admitted request, it records nothing.
func TestAttemptStreamsOnlyObserve(t *testing.T) {
	for _, on := range []bool{false, true} {
		eng, srv := internalServer(t, attemptsPolicy(on), nil)
		st := newReplay(true, reqHeaders("r1"), resHeaders("503"))
		if err := srv.Process(st); err != nil {
			t.Fatal(err)
		}
		if len(st.replies) != 2 || !proto.Equal(st.replies[0], continueRequestHeaders) || !proto.Equal(st.replies[1], continueResponseHeaders) {
			t.Errorf("upstream_filter %v: replies %v, want CONTINUE for each", on, st.replies)
		}
		if c := calls(t, eng); c.Failure+c.Success != 0 || eng.InFlight() != 0 {
			t.Errorf("upstream_filter %v: an attempt stream of no admitted request counted %+v, in flight %d", on, c, eng.InFlight())
		}
	}
}

// TestRetriedAttemptsCountOnce: three attempts of one admitted request — a 503, one that failed
// before response headers (its stream ended after the request headers), then a 200 — are three
// breaker outcomes: the first two recorded by their streams once a later attempt began, the
// last by the request itself, and the request's entry goes with its stream.
func TestRetriedAttemptsCountOnce(t *testing.T) {
	eng, srv := internalServer(t, attemptsPolicy(true), nil)
	pr := admitDownstream(t, srv, "r1")
	if err := srv.Process(newReplay(true, reqHeaders("r1"), resHeaders("503"))); err != nil {
		t.Fatal(err)
	}
	if c := calls(t, eng); c.Failure != 0 {
		t.Fatalf("the first attempt was recorded before it was known to be retried: %+v", c)
	}
	if err := srv.Process(newReplay(true, reqHeaders("r1"))); err != nil {
		t.Fatal(err)
	}
	if c := calls(t, eng); c.Failure != 1 {
		t.Fatalf("after a second attempt: %+v, want the first one's failure", c)
	}
	if err := srv.Process(newReplay(true, reqHeaders("r1"), resHeaders("200"))); err != nil {
		t.Fatal(err)
	}
	if c := calls(t, eng); c.Failure != 2 || c.Success != 0 {
		t.Fatalf("after the third attempt: %+v, want two failures (a 503, no response)", c)
	}
	pr.afterSend(pr.handle(resHeaders("200")))
	pr.finish()
	if c := calls(t, eng); c.Failure != 2 || c.Success != 1 {
		t.Fatalf("after the request: %+v, want 2 failures and 1 success", c)
	}
	if srv.attempts.lookup("r1") != nil || srv.attempts.n.Load() != 0 {
		t.Error("the request's entry outlived its stream")
	}
}

// TestResetAttemptRecordedLate: an attempt that failed before response headers is known only
// when its stream ends, possibly after its request ended: it is recorded then, as no_response_as
// says (a failure by default).
func TestResetAttemptRecordedLate(t *testing.T) {
	eng, srv := internalServer(t, attemptsPolicy(true), nil)
	pr := admitDownstream(t, srv, "r1")
	e := srv.attempts.lookup("r1")
	first := e.begin(srv.metrics) // the first attempt's stream opened; its end is pending
	if err := srv.Process(newReplay(true, reqHeaders("r1"), resHeaders("200"))); err != nil {
		t.Fatal(err)
	}
	pr.afterSend(pr.handle(resHeaders("200")))
	pr.finish()
	if c := calls(t, eng); c.Failure != 0 || c.Success != 1 {
		t.Fatalf("before the reset attempt's end: %+v, want the request's success only", c)
	}
	e.known(first, policy.Outcome{Duration: time.Second, At: eng.Now()}, srv.metrics)
	if c := calls(t, eng); c.Failure != 1 || c.Success != 1 {
		t.Fatalf("after the reset attempt's end: %+v, want its failure too", c)
	}
}

// TestRetriesNotRecordedInHalfOpen: while the breaker is HALF_OPEN its probes are the requests
// it admitted; a retry the router made on its own is left out (and counted as not recorded).
func TestRetriesNotRecordedInHalfOpen(t *testing.T) {
	eng, srv := internalServer(t, attemptsPolicy(true), nil)
	pr := admitDownstream(t, srv, "r1")
	for _, st := range []string{"OPEN", "HALF_OPEN"} {
		if err := eng.ForceBreaker("default", st); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if err := srv.Process(newReplay(true, reqHeaders("r1"), resHeaders("503"))); err != nil {
			t.Fatal(err)
		}
	}
	pr.afterSend(pr.handle(resHeaders("503")))
	pr.finish()
	if c := calls(t, eng); c.Failure != 0 {
		t.Errorf("retries recorded while the breaker was half open: %+v", c)
	}
}

// TestRetriedAttemptRetryAfterHoldsTenant: a retried attempt's 429 with retry-after holds its
// tenant back as a final one does (retry_after_scope: tenant): the router's next attempt goes
// on (it was admitted), but the tenant's next request is refused at once, another tenant's not.
func TestRetriedAttemptRetryAfterHoldsTenant(t *testing.T) {
	_, srv := internalServer(t, `
envoy: {upstream_filter: true}
classification:
  tenant: {rules: [{header: x-tenant-id, trusted: true}]}
providers: {default: {breaker: b}}
breakers: {b: {sliding_window_type: COUNT_BASED, sliding_window_size: 100, minimum_calls: 100, failure_rate_threshold: 50,
  wait_in_open: 60s, honor_retry_after: true, retry_after_scope: tenant}}
features: {default: {max_concurrent: 10}}
`, nil)
	headers := func(id, tenant string) *extprocv3.ProcessingRequest {
		return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
			RequestHeaders: headersMsg(true, ":method", "POST", ":path", "/v1/chat/completions", "x-request-id", id, "x-tenant-id", tenant)}}
	}
	pr := newProcessor(srv, quietStream{ctx: context.Background()})
	pr.afterSend(pr.handle(headers("r1", "acme")))
	if pr.phase != phaseAdmitted {
		t.Fatal("not admitted")
	}
	defer pr.finish()
	if err := srv.Process(newReplay(true, headers("r1", "acme"), resHeaders("429", "retry-after", "30"))); err != nil {
		t.Fatal(err)
	}
	second := newReplay(true, headers("r1", "acme"))
	if err := srv.Process(second); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(second.replies[0], continueRequestHeaders) {
		t.Fatalf("the router's next attempt was not let through: %v", second.replies[0])
	}
	for tenant, refused := range map[string]bool{"acme": true, "other": false} {
		st := newReplay(false, headers("n-"+tenant, tenant))
		if err := srv.Process(st); err != nil {
			t.Fatal(err)
		}
		_, isRefusal := st.replies[0].Response.(*extprocv3.ProcessingResponse_ImmediateResponse)
		if isRefusal != refused {
			t.Errorf("tenant %s's next request refused %v, want %v: %v", tenant, isRefusal, refused, st.replies[0])
		}
	}
}

// TestDuplicateRequestIDUntracked: a request whose x-request-id another request in flight has
// is not followed (its attempts could not be told apart); the first keeps its entry.
func TestDuplicateRequestIDUntracked(t *testing.T) {
	_, srv := internalServer(t, attemptsPolicy(true), nil)
	a := admitDownstream(t, srv, "same")
	b := admitDownstream(t, srv, "same")
	if a.attempts == nil || b.attempts != nil || srv.attempts.lookup("same") != a.attempts {
		t.Errorf("entries %p %p, table %p: want the first request's only", a.attempts, b.attempts, srv.attempts.lookup("same"))
	}
	b.finish()
	if srv.attempts.lookup("same") != a.attempts {
		t.Error("the second request's end removed the first one's entry")
	}
	a.finish()
	if srv.attempts.lookup("same") != nil || srv.attempts.n.Load() != 0 {
		t.Error("an entry outlived its request")
	}
}

// exampleWithUpstreamFilter is the example policy with envoy.upstream_filter as on says.
func exampleWithUpstreamFilter(tb testing.TB, on bool) string {
	tb.Helper()
	p := string(examples.DefaultPolicy)
	if !strings.Contains(p, "  failure_mode_allow: false\n") {
		tb.Fatal("the example policy's envoy section changed")
	}
	return strings.Replace(p, "  failure_mode_allow: false\n", "  failure_mode_allow: false\n  upstream_filter: "+strconv.FormatBool(on)+"\n", 1)
}

// downstreamMessages is one streamed chat request as the downstream filter sends it: request
// headers, a buffered body, response headers with rate-limit headers, three SSE chunks.
func downstreamMessages(id string) []*extprocv3.ProcessingRequest {
	body := `{"model":"deepseek-chat","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"` + strings.Repeat("hello ", 150) + `"}]}`
	chunks := []string{
		"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\" there\"}}]}\n\n",
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":160,\"completion_tokens\":2,\"total_tokens\":162}}\n\ndata: [DONE]\n\n",
	}
	msgs := []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: headersMsg(false, ":method", "POST", ":path", "/v1/chat/completions",
			"content-type", "application/json", "x-request-id", id, "x-llm-feature", "chat", "x-tenant-id", "acme")}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: true}}},
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: headersMsg(false, ":status", "200",
			"content-type", "text/event-stream", "x-ratelimit-remaining-requests", "99")}},
	}
	for i, c := range chunks {
		msgs = append(msgs, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: []byte(c), EndOfStream: i == len(chunks)-1}}})
	}
	return msgs
}

// BenchmarkStreamKinds compares the server's work per stream in each filter position, under the
// example policy: a downstream stream (one streamed chat request, downstreamMessages), with
// envoy.upstream_filter off and on (on: the request is registered for its attempts), and an
// attempt stream of the upstream filter (request headers; a 503's response headers with a
// rate-limit header) matched to an admitted request, whose start records the attempt before
// it in the breaker.
func BenchmarkStreamKinds(b *testing.B) {
	for _, on := range []bool{false, true} {
		b.Run("downstream/upstream_filter="+strconv.FormatBool(on), func(b *testing.B) {
			_, srv := internalServer(b, exampleWithUpstreamFilter(b, on), nil)
			st := newReplay(false, downstreamMessages("r1")...)
			if err := srv.Process(st); err != nil {
				b.Fatal(err)
			}
			if len(st.replies) != len(st.msgs) || st.replies[0].GetRequestBody() == nil && st.replies[0].GetRequestHeaders() == nil {
				b.Fatalf("replies %v", st.replies)
			}
			st.record = false
			b.ReportAllocs()
			for b.Loop() {
				st.next = 0
				if err := srv.Process(st); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("attempt", func(b *testing.B) {
		eng, srv := internalServer(b, exampleWithUpstreamFilter(b, true), nil)
		pr := newProcessor(srv, quietStream{ctx: context.Background()})
		msgs := downstreamMessages("r1")
		pr.afterSend(pr.handle(msgs[0]))
		pr.afterSend(pr.handle(msgs[1]))
		defer pr.finish()
		e := srv.attempts.lookup("r1")
		if e == nil {
			b.Fatal("the request is not followed")
		}
		st := newReplay(true, reqHeaders("r1"), resHeaders("503", "x-ratelimit-remaining-requests", "99"))
		st.record = false
		b.ReportAllocs()
		for b.Loop() {
			// One earlier attempt, known and not yet recorded: this one's start records it (as a
			// success, so the breaker stays closed and records every one).
			e.mu.Lock()
			e.attempts = append(e.attempts[:0], attemptState{known: true, outcome: policy.Outcome{Status: 200}})
			e.mu.Unlock()
			st.next = 0
			if err := srv.Process(st); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		var recorded uint64
		for _, v := range eng.Breakers() {
			recorded += v.Calls.Success
		}
		if recorded < uint64(b.N) {
			b.Fatalf("%d attempts recorded in %d streams", recorded, b.N)
		}
	})
}
