package extproc_test

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
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
