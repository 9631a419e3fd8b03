package integration_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/anthropics/anthropic-sdk-go/v2"
	anthropicoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
)

// Recognisable keys: a known one (acme's, in the keys file) and an unknown one.
const (
	canaryKey  = "sk-canary-KNOWN-7f3a9c1e5b2d4f6a8c0e"
	unknownKey = "sk-canary-UNKNOWN-0d9b7a5c3e1f2a4b6c8d"
)

func sha256Hex(s string) string { return fmt.Sprintf("%x", sha256.Sum256([]byte(s))) }

// keysPolicyFile writes a policy whose tenants come from API keys (acme's in the keys file,
// globex's in the directory), refuses unknown keys, strips the client's key before the
// upstream, logs at debug, labels metrics by tenant and keeps tenant compartments.
func keysPolicyFile(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys")
	if err := os.WriteFile(keys, []byte("# tenants' keys\n"+sha256Hex(canaryKey)+" acme\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	policy := `
server: {log_level: debug}
envoy: {max_message_timeout: 10s}
admin: {tenant_label: true}
responses: {compartment_header: true}
classification:
  tenant:
    rules:
      - {api_key: true, trusted: true, strip_client_key: true}
      - {header: x-tenant-id, trusted: true}
  model:
    rules: [{body: model}]
tenants:
  keys_file: ` + keys + `
  unknown_key: reject
  directory:
    - {id: globex, tier: free, key_sha256: [` + sha256Hex("sk-globex") + `]}
tiers: {free: {}}
prices:
  - {match: default, input_per_mtok: 1, output_per_mtok: 1}
compartments:
  - {name: tenant, key: [tenant], limits: {max_concurrent: 50, spend_per_day: 1000}}
`
	path := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(path, []byte(policy), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// spanSink is an OTLP/HTTP trace receiver on loopback that keeps what it is sent as JSON.
type spanSink struct {
	mu   sync.Mutex
	json []string
}

func startSpanSink(t *testing.T) (*spanSink, string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &spanSink{}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if err != nil || proto.Unmarshal(body, &req) != nil {
			http.Error(w, "bad export", http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.json = append(s.json, protojson.Format(&req))
		s.mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("content-type", "application/x-protobuf")
		_, _ = w.Write(out)
	})}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })
	return s, "http://" + ln.Addr().String()
}

func (s *spanSink) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Join(s.json, "\n")
}

// TestAPIKeyTenantsThroughEnvoy: through the simulated Envoy, a known key (OpenAI's bearer or
// Anthropic's x-api-key) gives its tenant whatever x-tenant-id claims, the upstream receives
// no client key (strip_client_key), and an unknown or missing key is refused with 401. The keys
// appear nowhere the server writes: not in any log line (at debug), metric, span, dynamic
// metadata field, reply to Envoy or admin response — nor do their full hashes.
func TestAPIKeyTenantsThroughEnvoy(t *testing.T) {
	logs := &syncbuf.Buffer{}
	sink, endpoint := startSpanSink(t)
	s := start(t, harness.Options{PolicyPath: keysPolicyFile(t), Logs: logs,
		Env: []string{"OTEL_SERVICE_NAME=keys-under-test", "OTEL_EXPORTER_OTLP_ENDPOINT=" + endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"}})
	chat := func(headers ...envoysim.Header) *envoysim.Request {
		return &envoysim.Request{Method: "POST", Path: "/v1/chat/completions",
			Headers: append(envoysim.Headers{{Key: "content-type", Value: "application/json"},
				{Key: "traceparent", Value: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}, headers...),
			Body: []byte(`{"model":"gpt-4o-mini","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`)}
	}
	anthropicReq := &envoysim.Request{Method: "POST", Path: "/v1/messages",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-api-key", Value: canaryKey},
			{Key: "anthropic-version", Value: "2023-06-01"}, {Key: "x-tenant-id", Value: "globex"}},
		Body: []byte(`{"model":"claude-sonnet-4-5","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`)}
	var results []*envoysim.Result
	for _, tc := range []struct {
		name   string
		req    *envoysim.Request
		status int
		tenant string
	}{
		{"bearer with a forged x-tenant-id", chat(envoysim.Header{Key: "authorization", Value: "Bearer " + canaryKey}, envoysim.Header{Key: "x-tenant-id", Value: "globex"}), 200, "acme"},
		{"anthropic's x-api-key", anthropicReq, 200, "acme"},
		{"a directory key", chat(envoysim.Header{Key: "authorization", Value: "Bearer sk-globex"}), 200, "globex"},
		{"an unknown key", chat(envoysim.Header{Key: "authorization", Value: "Bearer " + unknownKey}, envoysim.Header{Key: "x-tenant-id", Value: "acme"}), 401, ""},
		{"no key", chat(envoysim.Header{Key: "x-tenant-id", Value: "acme"}), 401, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := s.Do(context.Background(), tc.req)
			if err != nil {
				t.Fatal(err)
			}
			results = append(results, r)
			if r.Status != tc.status || len(r.Problems) != 0 {
				t.Fatalf("status %d, want %d; problems %v: %s", r.Status, tc.status, r.Problems, r.Body)
			}
			if tc.status != 200 {
				if header(r, "x-bulkhead-reason") != "unknown_key" || r.Upstream != nil {
					t.Errorf("reason %q, upstream called: %v", header(r, "x-bulkhead-reason"), r.Upstream != nil)
				}
				return
			}
			if got := r.DynamicMetadata["llm_bulkhead"].GetFields()["tenant"].GetStringValue(); got != tc.tenant {
				t.Errorf("metadata tenant %q, want %q", got, tc.tenant)
			}
			if got := upstreamHeader(r, "x-bulkhead-compartment"); got != "tenant/"+tc.tenant {
				t.Errorf("compartment %q, want tenant/%s", got, tc.tenant)
			}
			for _, h := range r.Upstream.Headers {
				if h.Key == "authorization" || h.Key == "x-api-key" {
					t.Errorf("the upstream received the client's %s", h.Key)
				}
			}
		})
	}
	waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })

	// Everything the server wrote: its replies to Envoy and the metadata, every admin page,
	// the metrics, then (once the server has shut down and flushed them) the spans and the logs.
	var written strings.Builder
	for _, r := range results {
		for _, rec := range r.Exchange {
			if rec.Received != nil {
				written.WriteString(protojson.Format(rec.Received))
			}
		}
		for ns, md := range r.DynamicMetadata {
			written.WriteString(ns + protojson.Format(md))
		}
		written.Write(r.Body)
		for _, h := range r.Headers {
			written.WriteString(h.Key + ": " + h.Value + "\n")
		}
	}
	for _, path := range []string{"/metrics", "/admin/compartments", "/admin/decisions", "/admin/breakers", "/admin/cluster",
		"/admin/spend", "/admin/config", "/"} {
		resp, err := http.Get(s.AdminURL() + path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("GET %s: %d", path, resp.StatusCode)
		}
		if path == "/metrics" && !strings.Contains(string(b), "tenant/acme") {
			t.Error("the metrics do not name the key's tenant: the scan saw the wrong page")
		}
		written.WriteString(path + "\n" + string(b))
	}
	s.App.Shutdown(context.Background())
	spans := sink.String()
	if !strings.Contains(spans, "acme") {
		t.Errorf("no span names the tenant acme: the scan saw no spans\n%s", spans)
	}
	if !strings.Contains(logs.String(), "unknown_key") {
		t.Errorf("no log line tells of the refusals: the scan saw no logs\n%s", logs.String())
	}
	for where, text := range map[string]string{"replies to Envoy, metadata and admin": written.String(), "spans": spans, "logs": logs.String()} {
		for _, secret := range []string{canaryKey, unknownKey, "sk-canary", sha256Hex(canaryKey), sha256Hex(unknownKey), sha256Hex("sk-globex")} {
			if strings.Contains(text, secret) {
				t.Errorf("the %s hold %q", where, secret)
			}
		}
	}
}

// TestSDKsSeeAnUnknownKeyAsTheirAuthenticationError: a request with an unknown key is refused
// in the API's own 401, which each official SDK raises as its authentication error without
// retrying; a known key goes through.
func TestSDKsSeeAnUnknownKeyAsTheirAuthenticationError(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: keysPolicyFile(t)})
	url, err := s.ProxyURL()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	t.Run("openai", func(t *testing.T) {
		var a attempts
		c := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey(unknownKey), option.WithMiddleware(a.openai))
		params := openai.ChatCompletionNewParams{Model: "gpt-4o-mini", MaxTokens: openai.Int(5),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")}}
		_, err := c.Chat.Completions.New(ctx, params)
		var e *openai.Error
		if !errors.As(err, &e) || e.StatusCode != 401 || e.Type != "invalid_request_error" || e.Code != "unknown_key" {
			t.Fatalf("err %v", err)
		}
		if n := a.n.Load(); n != 1 || strings.Contains(e.RawJSON(), "sk-canary") {
			t.Errorf("%d attempts; body %s", n, e.RawJSON())
		}
		ok := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey(canaryKey))
		if _, err := ok.Chat.Completions.New(ctx, params); err != nil {
			t.Errorf("a known key: %v", err)
		}
	})
	t.Run("anthropic", func(t *testing.T) {
		var a attempts
		c := anthropic.NewClient(anthropicoption.WithBaseURL(url), anthropicoption.WithAPIKey(unknownKey), anthropicoption.WithMiddleware(a.anthropic))
		params := anthropic.MessageNewParams{Model: "claude-sonnet-4-5", MaxTokens: 5,
			Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hello"))}}
		_, err := c.Messages.New(ctx, params)
		var e *anthropic.Error
		if !errors.As(err, &e) || e.StatusCode != 401 || !strings.Contains(e.RawJSON(), `"type":"authentication_error"`) {
			t.Fatalf("err %v", err)
		}
		if n := a.n.Load(); n != 1 {
			t.Errorf("%d attempts", n)
		}
		ok := anthropic.NewClient(anthropicoption.WithBaseURL(url), anthropicoption.WithAPIKey(canaryKey))
		if _, err := ok.Messages.New(ctx, params); err != nil {
			t.Errorf("a known key: %v", err)
		}
	})
}
