package bench

import (
	"context"
	"net"
	"slices"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
)

// servers are the sides of every comparison. The replay server's replies are pre-encoded, so
// it is compared only over gRPC, where they are sent.
var servers = []struct {
	name     string
	new      func(testing.TB) extprocv3.ExternalProcessorServer
	admitted bool
	wireOnly bool
}{
	{SideNoop, func(testing.TB) extprocv3.ExternalProcessorServer { return Noop{} }, false, false},
	{SideReplay, func(tb testing.TB) extprocv3.ExternalProcessorServer { return newReplay(tb) }, true, true},
	{SideBulkhead, func(tb testing.TB) extprocv3.ExternalProcessorServer { return newBulkhead(tb) }, true, false},
}

// BenchmarkProcessStream measures one whole benchmark stream (request headers, 1 KiB buffered
// body, response headers, three SSE chunks) through a server's Process over an in-memory
// stream: the server's own work per stream, without gRPC or the network.
func BenchmarkProcessStream(b *testing.B) {
	msgs := streamMessages(b)
	for _, s := range servers {
		if s.wireOnly {
			continue
		}
		b.Run(s.name, func(b *testing.B) {
			srv := s.new(b)
			st := &memStream{ctx: context.Background(), msgs: msgs, record: true}
			if err := srv.Process(st); err != nil {
				b.Fatal(err)
			}
			checkReplies(b, msgs, st.replies, s.admitted)
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
}

// BenchmarkGRPCStream measures the same stream over a gRPC connection in memory (bufconn):
// open the stream, send each message and wait for its reply, half-close, wait for the end.
func BenchmarkGRPCStream(b *testing.B) {
	msgs := streamMessages(b)
	for _, s := range servers {
		b.Run(s.name, func(b *testing.B) {
			var opts []grpc.ServerOption
			srv := s.new(b)
			if bh, ok := srv.(*extproc.Server); ok {
				// As the server runs: its codec, which counts buffered bodies as they arrive, and
				// streams it can end when they go silent.
				opts = append(opts, bh.ServerOption(), extproc.EndableStreams())
			}
			client := bufconnClient(b, srv, opts...)
			replies := make([]*extprocv3.ProcessingResponse, len(msgs))
			stream := func() {
				st, err := client.Process(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				for i, m := range msgs {
					if err := st.Send(m); err != nil {
						b.Fatal(err)
					}
					if replies[i], err = st.Recv(); err != nil {
						b.Fatal(err)
					}
				}
				if err := st.CloseSend(); err != nil {
					b.Fatal(err)
				}
				if _, err := st.Recv(); err == nil {
					b.Fatal("a reply after the last one")
				}
			}
			stream()
			checkReplies(b, msgs, replies, s.admitted)
			b.ReportAllocs()
			for b.Loop() {
				stream()
			}
		})
	}
}

// bufconnClient serves srv over a gRPC connection in memory (bufconn) until the benchmark ends
// and returns a client of it.
func bufconnClient(b *testing.B, srv extprocv3.ExternalProcessorServer, opts ...grpc.ServerOption) extprocv3.ExternalProcessorClient {
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer(append([]grpc.ServerOption{grpc.MaxRecvMsgSize(noopMaxMessage)}, opts...)...)
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		conn.Close()
		gs.Stop()
		<-done
	})
	return extprocv3.NewExternalProcessorClient(conn)
}

// BenchmarkGRPCAttemptStream compares, over gRPC in memory and with envoy.upstream_filter on,
// the server's stream of a client request (the benchmark stream, as BenchmarkGRPCStream) with
// a stream of the upstream (per-attempt) filter: gRPC metadata x-llm-bulkhead-filter: upstream,
// the attempt's request headers, then a 503's response headers with rate-limit headers. The
// attempt's x-request-id is that of a request admitted on a stream held open, so each attempt
// is matched and records the one before it; the held request is renewed every 15 attempts,
// outside the timing.
func BenchmarkGRPCAttemptStream(b *testing.B) {
	msgs := withRequestID(b, streamMessages(b), "held")
	// METRICS_ONLY: the breaker records every attempt's 503 and never opens, so each attempt
	// costs what a retried attempt costs while the provider is judged.
	srv, reg := newBulkheadWith(b, "LLM_BULKHEAD_ENVOY__UPSTREAM_FILTER=true", "LLM_BULKHEAD_BREAKERS__STANDARD__STATE=METRICS_ONLY")
	client := bufconnClient(b, srv, extproc.ServerOption(), extproc.EndableStreams())
	exchange := func(ctx context.Context, ms []*extprocv3.ProcessingRequest, closeSend bool) extprocv3.ExternalProcessor_ProcessClient {
		st, err := client.Process(ctx)
		if err != nil {
			b.Fatal(err)
		}
		for _, m := range ms {
			if err := st.Send(m); err != nil {
				b.Fatal(err)
			}
			if _, err := st.Recv(); err != nil {
				b.Fatal(err)
			}
		}
		if closeSend {
			if err := st.CloseSend(); err != nil {
				b.Fatal(err)
			}
			if _, err := st.Recv(); err == nil {
				b.Fatal("a reply after the last one")
			}
		}
		return st
	}
	b.Run("downstream", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			exchange(context.Background(), msgs, true)
		}
	})
	b.Run("attempt", func(b *testing.B) {
		up := metadata.AppendToOutgoingContext(context.Background(), extproc.FilterPositionKey, extproc.FilterPositionUpstream)
		attempt := []*extprocv3.ProcessingRequest{
			{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: msgs[0].GetRequestHeaders()}},
			{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{EndOfStream: true,
				Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("503")},
					{Key: "x-ratelimit-remaining-requests", RawValue: []byte("99")}}}}}},
		}
		var held extprocv3.ExternalProcessor_ProcessClient
		// end half-closes the held stream and waits for the server to end it.
		end := func() {
			_ = held.CloseSend()
			for {
				if _, err := held.Recv(); err != nil {
					return
				}
			}
		}
		renew := func() {
			if held != nil {
				end()
			}
			// Request headers and body: admitted, and followed under x-request-id "held".
			held = exchange(context.Background(), msgs[:2], false)
		}
		renew()
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			if i%15 == 14 {
				b.StopTimer()
				renew()
				b.StartTimer()
			}
			exchange(up, attempt, true)
		}
		b.StopTimer()
		end()
		// Every attempt but the last of each held request was recorded.
		if n := counterValue(b, reg, "llm_bulkhead_extproc_attempts_total", "recorded"); n < float64(b.N-1-b.N/15) {
			b.Fatalf("%v attempts recorded in %d attempt streams", n, b.N)
		}
	})
}

// counterValue is the value of the counter family name whose one label has value label.
func counterValue(tb testing.TB, reg *prometheus.Registry, name, label string) float64 {
	tb.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		tb.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if ls := m.GetLabel(); len(ls) == 1 && ls[0].GetValue() == label {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// withRequestID returns msgs with their request headers carrying x-request-id id.
func withRequestID(tb testing.TB, msgs []*extprocv3.ProcessingRequest, id string) []*extprocv3.ProcessingRequest {
	tb.Helper()
	out := slices.Clone(msgs)
	rh := msgs[0].GetRequestHeaders()
	if rh == nil {
		tb.Fatal("the stream does not start with request headers")
	}
	h := proto.Clone(rh).(*extprocv3.HttpHeaders)
	h.Headers.Headers = append(h.Headers.Headers, &corev3.HeaderValue{Key: "x-request-id", RawValue: []byte(id)})
	out[0] = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: h},
		ProtocolConfig: msgs[0].GetProtocolConfig()}
	return out
}
