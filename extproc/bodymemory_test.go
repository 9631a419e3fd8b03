package extproc_test

import (
	"context"
	"runtime"
	"runtime/metrics"
	"strings"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
)

// awaitBody opens a stream whose request headers say a buffered body follows, and reads their
// reply.
func awaitBody(ctx context.Context, t *testing.T, client extprocv3.ExternalProcessorClient) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	st, err := client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(requestHeaders(chatPath, false, extprocfilterv3.ProcessingMode_BUFFERED)); err != nil {
		t.Fatal(err)
	}
	if r, err := st.Recv(); err != nil || r.GetRequestHeaders() == nil {
		t.Fatalf("request headers: %v, %v", r, err)
	}
	return st
}

// streamedBody is a streamed chat request body of size bytes: the server rewrites it
// (include_usage), so its reply carries it whole.
func streamedBody(size int) *extprocv3.ProcessingRequest {
	const head, tail = `{"model":"m","stream":true,"max_tokens":10,"messages":[{"role":"user","content":"`, `"}]}`
	return requestBody(head+strings.Repeat("a", size-len(head)-len(tail))+tail, true)
}

func liveHeap() uint64 {
	// Twice: gRPC's buffer pools keep what was put back until a second collection.
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestBodiesAreNotHeldWhileRequestsRunUpstream: a buffered body stayed reachable after its
// request was admitted — the reply that carried it rewritten was kept until the stream's next
// message, which comes only when the provider answers — so 40 admitted 8 MiB requests held
// 320 MiB for as long as they ran. Once the reply is handed to gRPC, nothing of the body is
// left: the heap of 16 admitted 1 MiB requests whose responses have not come is what it was
// before their bodies arrived.
func TestBodiesAreNotHeldWhileRequestsRunUpstream(t *testing.T) {
	const yaml = `
envoy: {max_message_timeout: 10s, max_request_body: 2MiB}
features:
  default: {max_concurrent: 100, tokens_per_minute: 1000000000}
`
	m, client := grpcServer(t, yaml)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	const n, size = 16, 1 << 20
	body := streamedBody(size)
	var streams []extprocv3.ExternalProcessor_ProcessClient
	for range n {
		streams = append(streams, awaitBody(ctx, t, client))
	}
	before := liveHeap()
	for _, st := range streams {
		if err := st.Send(body); err != nil {
			t.Fatal(err)
		}
		r, err := st.Recv()
		if err != nil || !strings.HasSuffix(string(r.GetRequestBody().GetResponse().GetBodyMutation().GetBody()), `"include_usage":true}}`) {
			t.Fatalf("request body: %v", err)
		}
	}
	if m.eng.InFlight() != n {
		t.Fatalf("in flight %d, want %d", m.eng.InFlight(), n)
	}
	after := liveHeap()
	if grew := int64(after) - int64(before); grew > n*size/4 {
		t.Errorf("the heap grew by %.1f MiB while %d requests of %d MiB each run upstream: their bodies are still held",
			float64(grew)/(1<<20), n, size>>20)
	}
	runtime.KeepAlive(body)
	for _, st := range streams {
		_ = st.CloseSend()
		_, _ = st.Recv()
	}
}

// TestRewrittenBodyCountsUntilWritten: a body's bytes were counted against
// server.max_buffered_body_bytes only until its request was decided, while the body lived on in
// the reply that carried it back rewritten — 40 such 8 MiB bodies took a process bounded at
// 128 MiB past 480 MB. They now count until gRPC has written the reply: a body arriving while
// an unread reply still holds one is refused when both would pass the bound, and taken once
// the reply is read.
func TestRewrittenBodyCountsUntilWritten(t *testing.T) {
	const yaml = `
envoy: {max_message_timeout: 10s, max_request_body: 1MiB}
server: {max_buffered_body_bytes: 1536KiB}
features:
  default: {max_concurrent: 100, tokens_per_minute: 1000000000}
`
	// A fixed 64 KiB window: the server can write no more of a reply than that until it is read.
	m, client := grpcServer(t, yaml, grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	open := func() extprocv3.ExternalProcessor_ProcessClient { return awaitBody(ctx, t, client) }
	buffered := func() float64 { return metric(t, m.reg, "llm_bulkhead_extproc_buffered_body_bytes") }
	waitBuffered := func(want float64) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); buffered() != want; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("buffered body bytes %v, want %v", buffered(), want)
			}
		}
	}
	const size = 1 << 20
	a := open()
	if err := a.Send(streamedBody(size)); err != nil {
		t.Fatal(err)
	}
	// a's reply is not read: its body stays counted.
	waitBuffered(size)

	b := open()
	if err := b.Send(streamedBody(size)); err != nil {
		t.Fatal(err)
	}
	r, err := b.Recv()
	if err != nil || r.GetImmediateResponse() == nil {
		t.Fatalf("a body past the bound while another's reply is unread: %v, %v; want a refusal", r, err)
	}

	// Reading a's reply lets gRPC write it: its body's bytes are given back.
	if r, err := a.Recv(); err != nil || r.GetRequestBody().GetResponse().GetBodyMutation() == nil {
		t.Fatalf("a's reply: %v", err)
	}
	waitBuffered(0)
	c := open()
	if err := c.Send(streamedBody(size)); err != nil {
		t.Fatal(err)
	}
	if r, err := c.Recv(); err != nil || r.GetRequestBody().GetResponse().GetBodyMutation() == nil {
		t.Fatalf("a body once the bytes were given back: %v, %v; want its admission", r, err)
	}
	waitBuffered(0)
	for _, st := range []extprocv3.ExternalProcessor_ProcessClient{a, b, c} {
		_ = st.CloseSend()
		_, _ = st.Recv()
	}
}

// sendPrepared opens a stream awaiting a buffered body, sends the body, already marshalled,
// and returns the reply.
func sendPrepared(ctx context.Context, t *testing.T, client extprocv3.ExternalProcessorClient, body *grpc.PreparedMsg) *extprocv3.ProcessingResponse {
	t.Helper()
	st := awaitBody(ctx, t, client)
	if err := st.SendMsg(body); err != nil {
		t.Fatal(err)
	}
	r, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	_ = st.CloseSend()
	_, _ = st.Recv()
	return r
}

// prepare marshals req once, so that sending it allocates nothing of its size on the client's
// side of the process.
func prepare(ctx context.Context, t *testing.T, client extprocv3.ExternalProcessorClient, req *extprocv3.ProcessingRequest) *grpc.PreparedMsg {
	t.Helper()
	st, err := client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var msg grpc.PreparedMsg
	if err := msg.Encode(st, req); err != nil {
		t.Fatal(err)
	}
	_ = st.CloseSend()
	_, _ = st.Recv()
	return &msg
}

// largeAllocs returns how many objects over 32 KiB the process has allocated: a copy of a body
// of several MiB is one; gRPC's receive buffers, of 16 KiB, are not.
func largeAllocs() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs-by-size:bytes"}}
	metrics.Read(s)
	h := s[0].Value.Float64Histogram()
	// The last bucket holds every object past the largest size class, 32 KiB.
	return h.Counts[len(h.Counts)-1]
}

// TestRefusedBodiesAreNotCopied: a body refused for server.max_buffered_body_bytes was copied
// out of gRPC's receive buffers before it was counted, then thrown away (of 40 concurrent 8 MiB
// bodies under a 128 MiB bound, 24 were copied only to become garbage). The codec now counts a
// body before copying it: a refused body costs the process a few KiB, not its size (its receive
// buffers go back to gRPC's pool), and an admitted one is copied exactly once.
func TestRefusedBodiesAreNotCopied(t *testing.T) {
	const yaml = `
envoy: {max_message_timeout: 60s, max_request_body: 2MiB}
server: {max_buffered_body_bytes: 2MiB}
features:
  default: {max_concurrent: 1, max_wait: 30s, tokens_per_minute: 1000000000}
`
	// Both ends write through buffers of 16 KiB, below the sizes counted: the race detector's
	// sync.Pool drops some of gRPC's pooled write buffers, which are then allocated again.
	m, client := grpcServerWith(t, yaml, []grpc.ServerOption{grpc.WriteBufferSize(16 << 10)}, grpc.WithWriteBufferSize(16<<10))
	ctx := t.Context()
	const size = 3 << 19
	body := prepare(ctx, t, client, requestBody(bigBody(size), true))
	buffered := func() float64 { return metric(t, m.reg, "llm_bulkhead_extproc_buffered_body_bytes") }

	// a takes the only slot; b's body queues behind it, held: the next body would pass the bound.
	a := awaitBody(ctx, t, client)
	if err := a.Send(requestBody(`{"model":"m","messages":[]}`, true)); err != nil {
		t.Fatal(err)
	}
	if r, err := a.Recv(); err != nil || r.GetRequestBody() == nil {
		t.Fatalf("a: %v, %v", r, err)
	}
	b := awaitBody(ctx, t, client)
	if err := b.SendMsg(body); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); buffered() != size; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("buffered body bytes %v while b queues, want %d", buffered(), size)
		}
	}

	// Allocations over 32 KiB per body: a body's copy is one. (Not bytes: the race detector's
	// sync.Pool also drops some of gRPC's pooled receive buffers, of 16 KiB.)
	perBody := func(want func(*extprocv3.ProcessingResponse) bool) float64 {
		t.Helper()
		const warm, n = 2, 8
		for range warm {
			sendPrepared(ctx, t, client, body)
		}
		before := largeAllocs()
		for range n {
			if r := sendPrepared(ctx, t, client, body); !want(r) {
				t.Fatalf("reply %v", r)
			}
		}
		return float64(largeAllocs()-before) / n
	}
	isRefusal := func(r *extprocv3.ProcessingResponse) bool {
		for _, h := range r.GetImmediateResponse().GetHeaders().GetSetHeaders() {
			if h.GetHeader().GetKey() == extproc.HeaderReason {
				return string(h.GetHeader().GetRawValue()) == "server_busy"
			}
		}
		return false
	}
	if got := perBody(isRefusal); got > 0.2 {
		t.Errorf("%.2f allocations over 32 KiB per refused body of %d KiB: the body was copied", got, size>>10)
	}
	if got := metric(t, m.reg, "llm_bulkhead_extproc_bodies_refused_total"); got != 10 {
		t.Errorf("bodies refused counted %v, want 10", got)
	}

	// a ends: b is admitted; once b ends too, each body is admitted in turn.
	if err := a.Send(responseHeaders("200", true)); err != nil {
		t.Fatal(err)
	}
	for _, st := range []extprocv3.ExternalProcessor_ProcessClient{a, b} {
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		_ = st.CloseSend()
		_, _ = st.Recv()
	}
	if got := perBody(func(r *extprocv3.ProcessingResponse) bool { return r.GetRequestBody() != nil }); got < 1 || got > 1.2 {
		t.Errorf("%.2f allocations over 32 KiB per admitted body of %d KiB, want one copy", got, size>>10)
	}
}

// TestBodyBoundReturnsToZero: whatever becomes of a body counted as it arrives — admitted, refused
// for the bound, sent back rewritten, held while its request queues and then abandoned by a
// client that hangs up — server.max_buffered_body_bytes counts none of it once it is over.
func TestBodyBoundReturnsToZero(t *testing.T) {
	m, client := grpcServer(t, bodyBoundYAML)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	buffered := func() float64 { return metric(t, m.reg, "llm_bulkhead_extproc_buffered_body_bytes") }
	waitBuffered := func(what string, want float64) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); buffered() != want; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: buffered body bytes %v, want %v", what, buffered(), want)
			}
		}
	}
	exchange := func(st extprocv3.ExternalProcessor_ProcessClient, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		t.Helper()
		if err := st.Send(req); err != nil {
			t.Fatal(err)
		}
		for {
			r, err := st.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if r.Response != nil {
				return r
			}
		}
	}
	const size = 1 << 20

	// Kept: a body admitted as it is, its request in flight until its response.
	a := awaitBody(ctx, t, client)
	if r := exchange(a, requestBody(bigBody(size), true)); r.GetRequestBody() == nil {
		t.Fatalf("kept: %v", r)
	}
	waitBuffered("kept, its request upstream", 0)

	// Abandoned: a body held while its request queues behind a's, then the client hangs up.
	bctx, hangUp := context.WithCancel(ctx)
	b := awaitBody(bctx, t, client)
	if err := b.Send(requestBody(bigBody(size), true)); err != nil {
		t.Fatal(err)
	}
	waitBuffered("queued", size)

	// Refused: a body that would pass the bound while b's is held.
	c := awaitBody(ctx, t, client)
	if r := exchange(c, requestBody(bigBody(size), true)); r.GetImmediateResponse() == nil {
		t.Fatalf("refused: %v", r)
	}
	waitBuffered("one queued, one refused", size)
	hangUp()
	waitBuffered("abandoned", 0)
	nothingQueued := func() {
		t.Helper()
		if got := metric(t, m.reg, "llm_bulkhead_extproc_bodies_refused_total"); got != 1 {
			t.Errorf("bodies refused %v, want 1", got)
		}
	}
	nothingQueued()

	// Rewritten: a's response ends; a streamed body is admitted and sent back with
	// include_usage, its bytes counted until the reply is written.
	if r := exchange(a, responseHeaders("200", true)); r.GetResponseHeaders() == nil {
		t.Fatalf("a's response headers: %v", r)
	}
	d := awaitBody(ctx, t, client)
	r := exchange(d, streamedBody(size))
	if !strings.HasSuffix(string(r.GetRequestBody().GetResponse().GetBodyMutation().GetBody()), `"include_usage":true}}`) {
		t.Fatalf("rewritten: %v", r)
	}
	waitBuffered("rewritten and written", 0)
	for _, st := range []extprocv3.ExternalProcessor_ProcessClient{a, c, d} {
		_ = st.CloseSend()
		_, _ = st.Recv()
	}
	waitBuffered("every stream over", 0)
}
