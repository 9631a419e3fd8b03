package bench

import (
	"context"
	"net"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

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
			lis := bufconn.Listen(1 << 20)
			opts := []grpc.ServerOption{grpc.MaxRecvMsgSize(noopMaxMessage)}
			srv := s.new(b)
			if bh, ok := srv.(*extproc.Server); ok {
				// As the server runs: its codec, which counts buffered bodies as they arrive, and
				// streams it can end when they go silent.
				opts = append(opts, bh.ServerOption(), extproc.EndableStreams())
			}
			gs := grpc.NewServer(opts...)
			extprocv3.RegisterExternalProcessorServer(gs, srv)
			done := make(chan struct{})
			go func() {
				defer close(done)
				_ = gs.Serve(lis)
			}()
			defer func() {
				gs.Stop()
				<-done
			}()
			conn, err := grpc.NewClient("passthrough:///bufconn",
				grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
				grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			client := extprocv3.NewExternalProcessorClient(conn)
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
