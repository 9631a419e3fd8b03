package extproc_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type server struct {
	srv  *extproc.Server
	eng  *policy.Engine
	reg  *prometheus.Registry
	sim  *envoysim.Sim
	stop func()
}

func serve(t *testing.T, yaml string, cfg envoysim.FilterConfig) *server {
	t.Helper()
	p, err := config.Load("p.yaml", []byte(yaml), nil)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	reg := prometheus.NewRegistry()
	eng, err := observe.NewEngine(p, policy.Options{Logger: log}, reg)
	if err != nil {
		t.Fatal(err)
	}
	srv := extproc.NewServer(eng, extproc.Options{Logger: log})
	reg.MustRegister(srv.Collectors()...)
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(ln) }()
	if cfg.MessageTimeout == 0 {
		// Envoy's 200 ms default is the server's budget in production; a race-detector build
		// on a loaded test machine can take longer for a first message, which is not what
		// these tests are about.
		cfg.MessageTimeout = 5 * time.Second
	}
	sim, err := envoysim.New(ln.Addr().String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := &server{srv: srv, eng: eng, reg: reg, sim: sim, stop: func() { sim.Close(); gs.Stop(); srv.Close() }}
	t.Cleanup(s.stop)
	return s
}

const policyYAML = `
envoy: {max_message_timeout: 10s}
features:
  default: {max_concurrent: 5, tokens_per_minute: 1000000}
`

func request() *envoysim.Request {
	return &envoysim.Request{Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}},
		Body:    []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
}

var buffered = envoysim.FilterConfig{Mode: envoysim.ProcessingMode{RequestBody: envoysim.BodyBuffered, ResponseBody: envoysim.BodyStreamed}}

// TestPanicIsRecovered: a panic while handling a message is counted, the message gets a reply of
// its type, and the request continues (without the processor) to the end; what the request
// held is released.
func TestPanicIsRecovered(t *testing.T) {
	s := serve(t, policyYAML, buffered)
	s.srv.SetBeforeHandle(func(req *extprocv3.ProcessingRequest) {
		if req.GetResponseHeaders() != nil {
			panic("boom")
		}
	})
	r, err := s.sim.RoundTrip(context.Background(), request(), envoysim.Respond(200, nil, `{"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`))
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != 200 || len(r.Problems) > 0 {
		t.Fatalf("status %d problems %v", r.Status, r.Problems)
	}
	if got := counter(t, s.reg, "llm_bulkhead_extproc_panics_total"); got != 1 {
		t.Errorf("panics counted %v", got)
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.eng.InFlight() != 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if s.eng.InFlight() != 0 {
		t.Error("the request's slot was not released after the panic")
	}
}

func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// TestOldEnvoyWithoutProtocolConfig: an Envoy that sends no protocol_config (before 1.30) is
// served from the policy's declared body modes.
func TestOldEnvoyWithoutProtocolConfig(t *testing.T) {
	cfg := buffered
	cfg.OmitProtocolConfig = true
	s := serve(t, policyYAML, cfg)
	r, err := s.sim.RoundTrip(context.Background(), request(), envoysim.Respond(200, nil, `{}`))
	if err != nil || r.Status != 200 || len(r.Problems) > 0 {
		t.Fatalf("%v %v", r, err)
	}
}

// TestErrorResponseBodySkipped: with allow_mode_override, the body of an upstream error is not
// sent to the server at all.
func TestErrorResponseBodySkipped(t *testing.T) {
	cfg := buffered
	cfg.AllowModeOverride = true
	s := serve(t, strings.Replace(policyYAML, "envoy: {", "envoy: {allow_mode_override: true, ", 1), cfg)
	r, err := s.sim.RoundTrip(context.Background(), request(), envoysim.Respond(503, nil, `{"error":{"message":"down"}}`))
	if err != nil || r.Status != 503 {
		t.Fatalf("%v %v", r, err)
	}
	for _, k := range r.SentKinds() {
		if k == envoysim.KindResponseBody {
			t.Error("the error response's body was sent to the server")
		}
	}
}
