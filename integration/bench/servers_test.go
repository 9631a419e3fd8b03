package bench

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// newBulkhead builds llm-bulkhead's ext_proc service for the example policy with
// LimitOverrides, as app.New does, without the listeners.
func newBulkhead(tb testing.TB) *extproc.Server {
	srv, _ := newBulkheadWith(tb)
	return srv
}

// newBulkheadWith is newBulkhead with more overrides (LLM_BULKHEAD_… settings); it returns the
// registry of the server's and engine's metrics too.
func newBulkheadWith(tb testing.TB, overrides ...string) (*extproc.Server, *prometheus.Registry) {
	tb.Helper()
	p, _, err := app.LoadPolicy("", append(slices.Clone(LimitOverrides), overrides...))
	if err != nil {
		tb.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	log := slog.New(slog.DiscardHandler)
	eng, err := observe.NewEngine(p, policy.Options{Logger: log}, reg)
	if err != nil {
		tb.Fatal(err)
	}
	srv := extproc.NewServer(eng, extproc.Options{Logger: log})
	reg.MustRegister(srv.Collectors()...)
	tb.Cleanup(srv.Close)
	return srv, reg
}

// serve runs srv on a loopback port until the test ends and returns its address.
func serve(tb testing.TB, srv extprocv3.ExternalProcessorServer) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	gs := grpc.NewServer(grpc.MaxRecvMsgSize(noopMaxMessage))
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(ln)
	}()
	tb.Cleanup(func() {
		gs.Stop()
		<-done
	})
	return ln.Addr().String()
}

func newSim(tb testing.TB, addr string) *envoysim.Sim {
	tb.Helper()
	fc, err := FilterConfig(10 * time.Second)
	if err != nil {
		tb.Fatal(err)
	}
	sim, err := envoysim.New(addr, fc)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = sim.Close() })
	return sim
}

func chatRequest(tb testing.TB) *envoysim.Request {
	tb.Helper()
	body, err := ChatBody(BodySize)
	if err != nil {
		tb.Fatal(err)
	}
	return ChatRequest(body)
}

// streamMessages returns the messages one benchmark stream sends, as the simulator sends them.
func streamMessages(tb testing.TB) []*extprocv3.ProcessingRequest {
	tb.Helper()
	sim := newSim(tb, serve(tb, Noop{}))
	res, err := sim.RoundTrip(context.Background(), chatRequest(tb), SSEUpstream())
	if err != nil {
		tb.Fatal(err)
	}
	if err := Check(res, false); err != nil {
		tb.Fatal(err)
	}
	return res.Sent()
}

func TestWorkloadThroughBothServers(t *testing.T) {
	tests := []struct {
		name     string
		srv      func(testing.TB) extprocv3.ExternalProcessorServer
		admitted bool
	}{
		{SideNoop, func(testing.TB) extprocv3.ExternalProcessorServer { return Noop{} }, false},
		{SideBulkhead, func(tb testing.TB) extprocv3.ExternalProcessorServer { return newBulkhead(tb) }, true},
		{SideReplay, func(tb testing.TB) extprocv3.ExternalProcessorServer { return newReplay(tb) }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Given the benchmark's filter, request and upstream
			sim := newSim(t, serve(t, tt.srv(t)))
			// When a few loads run
			l := Load{Sim: sim, Request: chatRequest(t), Upstream: SSEUpstream(), Concurrency: 4,
				Warmup: 50 * time.Millisecond, Duration: 200 * time.Millisecond, Admitted: tt.admitted, Pid: os.Getpid()}
			smp, err := l.Run(context.Background())
			// Then every stream ran the whole path
			if err != nil {
				t.Fatal(err)
			}
			if smp.Errors > 0 || smp.Streams == 0 {
				t.Fatalf("%d streams, %d errors (first: %s)", smp.Streams, smp.Errors, smp.FirstError)
			}
			if !(smp.P50 > 0 && smp.P50 <= smp.P99 && smp.P99 <= smp.Max) {
				t.Errorf("percentiles out of order: %+v", smp)
			}
			if smp.Rate != float64(smp.Streams)/0.2 {
				t.Errorf("rate %v for %d streams in 0.2s", smp.Rate, smp.Streams)
			}
		})
	}
}

func TestNoopRepliesInKind(t *testing.T) {
	msgs := streamMessages(t)
	if len(msgs) != StreamMessages {
		t.Fatalf("%d messages, want %d", len(msgs), StreamMessages)
	}
	for _, m := range msgs {
		r := Continue(m)
		if got, want := envoysim.KindOfResponse(r), envoysim.KindOfRequest(m); got != want {
			t.Errorf("reply to %s is %s", want, got)
		}
	}
	for _, m := range []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}},
		{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}},
	} {
		if got, want := envoysim.KindOfResponse(Continue(m)), envoysim.KindOfRequest(m); got != want {
			t.Errorf("reply to %s is %s", want, got)
		}
	}
	if Continue(&extprocv3.ProcessingRequest{}) != nil {
		t.Error("a request without a message got a reply")
	}
}

func TestChildProcesses(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{CmdServeNoop}, {CmdServeBulkhead}, {CmdServeReplay}, {CmdServeNoop, "--server-codec"}, {CmdServeReplay, "--server-codec"}} {
		name := args[0]
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			// Given this test binary started as a server child (all accept --pprof-addr), the
			// no-op and replay servers with gRPC's codec or llm-bulkhead's
			argv := append(append([]string{self}, args...), "--pprof-addr", "127.0.0.1:0")
			p, err := StartProcess(Spec{Name: name, Argv: argv, Env: ServerEnv(), ReadyMsg: ReadyMessage}, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := p.Stop(); err != nil {
					t.Errorf("Stop: %v", err)
				}
			}()
			if name == CmdServeBulkhead && p.PprofAddr == "" {
				t.Error("no pprof address reported")
			}
			// When it holds a few streams
			sim := newSim(t, p.GRPCAddr)
			m, err := Hold(context.Background(), p, sim, chatRequest(t), 20, name != CmdServeNoop, 100*time.Millisecond, time.Minute)
			// Then its memory is measured
			if err != nil {
				t.Fatal(err)
			}
			if m.Held != 20 || m.Errors > 0 || m.IdleRSS <= 0 || m.HeldRSS <= 0 || m.PeakRSS < m.HeldRSS || !(m.HeldHeap > 0) {
				t.Errorf("memory %+v", m)
			}
		})
	}
}

func TestStartProcessFailures(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := StartProcess(Spec{Name: "bad flag", Argv: []string{self, CmdServeNoop, "--no-such-flag"}, ReadyMsg: ReadyMessage}, time.Minute); err == nil {
		t.Error("a child that exits at once was reported started")
	}
	if _, err := StartProcess(Spec{Name: "silent", Argv: []string{"sleep", "30"}, ReadyMsg: ReadyMessage}, 200*time.Millisecond); err == nil {
		t.Error("a process that never reports its addresses was reported started")
	}
	if _, err := StartProcess(Spec{Name: "empty"}, time.Second); err == nil {
		t.Error("an empty command line was accepted")
	}
}

// memStream is an in-memory Process stream replaying msgs, for measuring a server's handling of
// a whole stream without gRPC. It is used by one goroutine.
type memStream struct {
	ctx     context.Context
	msgs    []*extprocv3.ProcessingRequest
	next    int
	replies []*extprocv3.ProcessingResponse
	record  bool
}

var _ extprocv3.ExternalProcessor_ProcessServer = (*memStream)(nil)

func (s *memStream) Recv() (*extprocv3.ProcessingRequest, error) {
	if s.next == len(s.msgs) {
		return nil, io.EOF
	}
	s.next++
	return s.msgs[s.next-1], nil
}

func (s *memStream) Send(r *extprocv3.ProcessingResponse) error {
	if s.record {
		// A copy, as gRPC marshals it: the server may reuse the reply's memory after Send.
		s.replies = append(s.replies, proto.Clone(r).(*extprocv3.ProcessingResponse))
	}
	return nil
}

func (s *memStream) SetHeader(metadata.MD) error  { return nil }
func (s *memStream) SendHeader(metadata.MD) error { return nil }
func (s *memStream) SetTrailer(metadata.MD)       {}
func (s *memStream) Context() context.Context     { return s.ctx }
func (s *memStream) SendMsg(any) error            { return nil }
func (s *memStream) RecvMsg(any) error            { return nil }

func TestMemStreamReplays(t *testing.T) {
	msgs := streamMessages(t)
	srv := newBulkhead(t)
	st := &memStream{ctx: context.Background(), msgs: msgs, record: true}
	if err := srv.Process(st); err != nil {
		t.Fatal(err)
	}
	checkReplies(t, msgs, st.replies, true)
}

// checkReplies verifies one reply of the matching kind per message and, for llm-bulkhead, the
// admission's header mutation on the request body reply.
func checkReplies(tb testing.TB, msgs []*extprocv3.ProcessingRequest, replies []*extprocv3.ProcessingResponse, admitted bool) {
	tb.Helper()
	if len(replies) != len(msgs) {
		tb.Fatalf("%d replies to %d messages", len(replies), len(msgs))
	}
	for i, r := range replies {
		if got, want := envoysim.KindOfResponse(r), envoysim.KindOfRequest(msgs[i]); got != want {
			tb.Fatalf("reply %d is %s, want %s", i, got, want)
		}
	}
	set := replies[1].GetRequestBody().GetResponse().GetHeaderMutation().GetSetHeaders()
	found := false
	for _, h := range set {
		found = found || h.GetHeader().GetKey() == extproc.HeaderFeature
	}
	if found != admitted {
		tb.Fatalf("request body reply sets %s: %t, want %t", extproc.HeaderFeature, found, admitted)
	}
}

func newReplay(tb testing.TB) *Replay {
	tb.Helper()
	r, err := NewReplay(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	return r
}

// TestReplayAnswersLikeBulkhead: the proxy cannot tell the replay server from llm-bulkhead —
// every reply to the benchmark stream decodes to the same message.
func TestReplayAnswersLikeBulkhead(t *testing.T) {
	msgs := streamMessages(t)
	bh := &memStream{ctx: context.Background(), msgs: msgs, record: true}
	if err := newBulkhead(t).Process(bh); err != nil {
		t.Fatal(err)
	}
	rp := &memStream{ctx: context.Background(), msgs: msgs, record: true}
	if err := newReplay(t).Process(rp); err != nil {
		t.Fatal(err)
	}
	if len(rp.replies) != len(bh.replies) {
		t.Fatalf("%d replies from replay, %d from llm-bulkhead", len(rp.replies), len(bh.replies))
	}
	decode := func(m *extprocv3.ProcessingResponse) *extprocv3.ProcessingResponse {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		out := &extprocv3.ProcessingResponse{}
		if err := proto.Unmarshal(b, out); err != nil {
			t.Fatal(err)
		}
		return out
	}
	for i := range bh.replies {
		want, got := decode(bh.replies[i]), decode(rp.replies[i])
		// Values that depend on the moment: the budget's reset time.
		for _, m := range []*extprocv3.ProcessingResponse{want, got} {
			for _, h := range m.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
				if h.GetHeader().GetKey() == "x-ratelimit-reset-tokens" {
					h.Header.RawValue = nil
				}
			}
		}
		if !proto.Equal(want, got) {
			t.Errorf("reply %d differs:\nllm-bulkhead %v\nreplay       %v", i, want, got)
		}
	}
}
