package extproc_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// serveLogged is serve with the server's JSON log (at level) kept.
func serveLogged(t *testing.T, yaml string, level slog.Level) (*envoysim.Sim, *syncbuf.Buffer) {
	t.Helper()
	p, err := config.Load("p.yaml", []byte(yaml), nil)
	if err != nil {
		t.Fatal(err)
	}
	buf := &syncbuf.Buffer{}
	log := slog.New(slog.NewJSONHandler(buf, &slog.HandlerOptions{Level: level}))
	eng, err := policy.NewEngine(p, policy.Options{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	srv := extproc.NewServer(eng, extproc.Options{Logger: log})
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, srv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(ln) }()
	sim, err := envoysim.New(ln.Addr().String(), buffered)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sim.Close(); gs.Stop(); srv.Close(); _ = eng.Close(context.Background()) })
	return sim, buf
}

const refusalLogPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  feature:
    rules: [{header: x-llm-feature}]
  model:
    rules: [{body: model}]
features:
  chat: {max_concurrent: 5, tokens_per_minute: 100}
  default: {max_concurrent: 5}
`

func refusedLines(t *testing.T, logs string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(logs), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if m["msg"] == "request refused" {
			out = append(out, m)
		}
	}
	return out
}

// TestRefusalIsLoggedAtInfo: a refusal writes one info line naming reason, compartment,
// classification, retry-after and the request id the client got back, and nothing of the
// prompt, the API key or other headers.
func TestRefusalIsLoggedAtInfo(t *testing.T) {
	sim, logs := serveLogged(t, refusalLogPolicy, slog.LevelInfo)
	req := &envoysim.Request{Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: "chat"},
			{Key: "x-tenant-id", Value: "acme"}, {Key: "authorization", Value: "Bearer sk-SECRET-KEY"}, {Key: "x-custom", Value: "HEADER-VALUE"}},
		Body: []byte(`{"model":"gpt-4o","max_tokens":500,"messages":[{"role":"user","content":"TOP-SECRET-PROMPT"}]}`)}
	// The first request uses up chat's 100 tokens a minute (an empty window admits even a
	// request larger than it); the second is refused.
	var r *envoysim.Result
	for range 2 {
		var err error
		if r, err = sim.RoundTrip(context.Background(), req, envoysim.Respond(200, nil, `{}`)); err != nil {
			t.Fatal(err)
		}
	}
	if r.Status != 429 {
		t.Fatalf("status %d %s", r.Status, r.Body)
	}
	id := ""
	for _, h := range r.Headers {
		if h.Key == "x-request-id" {
			id = h.Value
		}
	}
	lines := refusedLines(t, logs.String())
	if len(lines) != 1 {
		t.Fatalf("refusal lines %v", lines)
	}
	m := lines[0]
	want := map[string]any{"level": "INFO", "reason": "token_budget", "compartment": "feature/chat", "feature": "chat", "tenant": "acme",
		"provider": "default", "model": "gpt-4o", "status": float64(429), "request_id": id}
	for k, v := range want {
		if m[k] != v {
			t.Errorf("%s = %v, want %v (line %v)", k, m[k], v, m)
		}
	}
	if id == "" || m["retry_after"] == nil || m["retry_after"] == "" {
		t.Errorf("request id %q, retry_after %v", id, m["retry_after"])
	}
	for _, secret := range []string{"TOP-SECRET-PROMPT", "sk-SECRET-KEY", "HEADER-VALUE"} {
		if strings.Contains(logs.String(), secret) {
			t.Errorf("the log holds %q:\n%s", secret, logs.String())
		}
	}
}

// TestRefusalIsNotLoggedAboveInfo: at warn, refusals write nothing.
func TestRefusalIsNotLoggedAboveInfo(t *testing.T) {
	sim, logs := serveLogged(t, refusalLogPolicy, slog.LevelWarn)
	req := request()
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-llm-feature", Value: "chat"})
	req.Body = []byte(`{"model":"m","max_tokens":500,"messages":[{"role":"user","content":"hi"}]}`)
	for i := range 2 {
		r, err := sim.RoundTrip(context.Background(), req, envoysim.Respond(200, nil, `{}`))
		if err != nil || r.Status != 200+229*i {
			t.Fatalf("request %d: %v %v", i, r.Status, err)
		}
	}
	if strings.Contains(logs.String(), "request refused") {
		t.Errorf("refusal logged at warn:\n%s", logs.String())
	}
}
