package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// Replay is the benchmark's third server. It answers each message with the reply llm-bulkhead
// gave to the same message of the benchmark stream, recorded once at start and kept encoded,
// and does nothing else. Envoy's side (here the simulator) gets exactly llm-bulkhead's
// replies, the server's side costs what the no-op costs plus writing bigger replies. So the
// no-op → Replay difference is what llm-bulkhead's replies cost the proxy, and the Replay →
// llm-bulkhead difference is the server's own work: classifying, admitting, building replies
// and settling. Safe for concurrent use.
type Replay struct {
	extprocv3.UnimplementedExternalProcessorServer
	byKind map[envoysim.Kind]*extprocv3.ProcessingResponse
	// last answers the response body message that ends the stream (it carries the metadata).
	last *extprocv3.ProcessingResponse
}

var _ extprocv3.ExternalProcessorServer = (*Replay)(nil)

// NewReplay records llm-bulkhead's replies to the benchmark stream: it runs llm-bulkhead
// in-process on a loopback port with the example policy and LimitOverrides, sends it one
// benchmark stream through the simulator and keeps every reply, encoded.
func NewReplay(ctx context.Context) (*Replay, error) {
	p, _, err := app.LoadPolicy("", LimitOverrides)
	if err != nil {
		return nil, err
	}
	log := slog.New(slog.DiscardHandler)
	reg := prometheus.NewRegistry()
	eng, err := observe.NewEngine(p, policy.Options{Logger: log}, reg)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	gs := grpc.NewServer(grpc.MaxRecvMsgSize(noopMaxMessage))
	srv := extproc.NewServer(eng, extproc.Options{Logger: log})
	reg.MustRegister(srv.Collectors()...)
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(ln)
	}()
	defer func() {
		gs.Stop()
		<-done
		srv.Close()
		_ = eng.Close(context.Background())
	}()
	filter, err := FilterConfig(30 * time.Second)
	if err != nil {
		return nil, err
	}
	sim, err := envoysim.New(ln.Addr().String(), filter)
	if err != nil {
		return nil, err
	}
	defer sim.Close()
	body, err := ChatBody(BodySize)
	if err != nil {
		return nil, err
	}
	res, err := sim.RoundTrip(ctx, ChatRequest(body), SSEUpstream())
	if err != nil {
		return nil, err
	}
	if err := Check(res, true); err != nil {
		return nil, fmt.Errorf("recording llm-bulkhead's replies: %w", err)
	}
	return replayFrom(res.Exchange)
}

// replayFrom pairs the recorded messages with their replies, in order, and encodes each reply.
func replayFrom(exchange []envoysim.Record) (*Replay, error) {
	var sent []*extprocv3.ProcessingRequest
	var got []*extprocv3.ProcessingResponse
	for _, rec := range exchange {
		switch {
		case rec.Sent != nil:
			sent = append(sent, rec.Sent)
		case rec.Received != nil && !rec.Ignored:
			got = append(got, rec.Received)
		}
	}
	if len(sent) != len(got) {
		return nil, fmt.Errorf("%d messages and %d replies recorded", len(sent), len(got))
	}
	r := &Replay{byKind: map[envoysim.Kind]*extprocv3.ProcessingResponse{}}
	for i, m := range sent {
		enc, err := encoded(got[i])
		if err != nil {
			return nil, err
		}
		if m.GetResponseBody().GetEndOfStream() {
			r.last = enc
			continue
		}
		if _, seen := r.byKind[envoysim.KindOfRequest(m)]; !seen {
			r.byKind[envoysim.KindOfRequest(m)] = enc
		}
	}
	if r.last == nil {
		return nil, errors.New("no reply to the last response body message was recorded")
	}
	return r, nil
}

// encoded returns a message that marshals to exactly m's encoding without any work: an empty
// ProcessingResponse whose unknown fields are m's bytes (receivers decode them as m).
func encoded(m *extprocv3.ProcessingResponse) (*extprocv3.ProcessingResponse, error) {
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, err
	}
	out := &extprocv3.ProcessingResponse{}
	out.ProtoReflect().SetUnknown(protoreflect.RawFields(b))
	return out, nil
}

// Process serves one stream until Envoy ends it.
func (r *Replay) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		req, err := stream.Recv()
		if err != nil {
			return nil
		}
		resp := r.byKind[envoysim.KindOfRequest(req)]
		if req.GetResponseBody().GetEndOfStream() {
			resp = r.last
		}
		if resp == nil {
			// A message the benchmark stream does not have: let it through unchanged.
			if resp = Continue(req); resp == nil {
				return status.Error(codes.InvalidArgument, "ProcessingRequest carries no message")
			}
		}
		if err := stream.Send(resp); err != nil {
			return nil
		}
	}
}
