package integration_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

func upstreamHeader(r *envoysim.Result, name string) string {
	if r.Upstream == nil {
		return ""
	}
	for _, h := range r.Upstream.Headers {
		if h.Key == name {
			return h.Value
		}
	}
	return ""
}

// TestForgedTierIsIgnored: with the example policy, a free tenant that sends
// x-tenant-tier: enterprise is still judged as free, and jwt_authn claims forwarded by Envoy
// win over a client's x-tenant-id.
func TestForgedTierIsIgnored(t *testing.T) {
	s := start(t, harness.Options{Mock: mock.Options{TimeScale: 0.01}})
	ctx := context.Background()
	req := chatRequest("chat")
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: "initech"}, envoysim.Header{Key: "x-tenant-tier", Value: "enterprise"})
	r, err := s.Do(ctx, req)
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	got := upstreamHeader(r, "x-bulkhead-compartment")
	if !strings.Contains(got, "tier_feature/free/chat") || !strings.Contains(got, "tenant/initech") {
		t.Errorf("compartments %q: a free tenant claiming enterprise must stay free", got)
	}
	if md := r.DynamicMetadata["llm_bulkhead"].GetFields(); md["tier"].GetStringValue() != "free" {
		t.Errorf("metadata tier %v", md["tier"])
	}

	// A verified claim forwarded by Envoy beats the client's header.
	claims, _ := structpb.NewStruct(map[string]any{"jwt_payload": map[string]any{"tenant": "acme"}})
	req = chatRequest("chat")
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: "initech"})
	req.Metadata = map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": claims}
	r, err = s.Do(ctx, req)
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	if got := upstreamHeader(r, "x-bulkhead-compartment"); !strings.Contains(got, "tier_feature/enterprise/chat") || !strings.Contains(got, "tenant/acme") {
		t.Errorf("compartments %q, want acme's (from the jwt claim)", got)
	}
}

// TestModelMapRoutes: a request for a deepseek model is routed to the deepseek provider:
// x-llm-provider is set for Envoy's routes and the route cache is cleared.
func TestModelMapRoutes(t *testing.T) {
	s := start(t, harness.Options{Mock: mock.Options{TimeScale: 0.01}})
	req := chatRequest("chat")
	req.Body = []byte(`{"model":"deepseek-chat","messages":[{"role":"user","content":"hi"}]}`)
	r, err := s.Do(context.Background(), req)
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	if upstreamHeader(r, "x-llm-provider") != "deepseek" || !r.Upstream.RouteCacheCleared {
		t.Errorf("x-llm-provider %q, route cache cleared %v", upstreamHeader(r, "x-llm-provider"), r.Upstream.RouteCacheCleared)
	}
}

const headerOnlyPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: %v}
body: {inject_include_usage: false}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 5}
  default: {max_concurrent: 5}
`

// TestDecisionWithoutBody: when no rule or limit needs the body, the request is decided at
// request headers; with allow_mode_override Envoy is told not to send the body at all, without
// it the body is answered unchanged. The upstream gets the body either way.
func TestDecisionWithoutBody(t *testing.T) {
	for _, allow := range []bool{true, false} {
		t.Run(map[bool]string{true: "mode_override", false: "no_override"}[allow], func(t *testing.T) {
			s := start(t, harness.Options{PolicyPath: writePolicy(t, strings.Replace(headerOnlyPolicy, "%v", map[bool]string{true: "true", false: "false"}[allow], 1)),
				Mock: mock.Options{TimeScale: 0.01}})
			req := chatRequest("chat")
			r, err := s.Do(context.Background(), req)
			if err != nil || r.Status != 200 {
				t.Fatalf("%v %v", r, err)
			}
			sentBody := false
			for _, k := range r.SentKinds() {
				if k == envoysim.KindRequestBody {
					sentBody = true
				}
			}
			if sentBody == allow {
				t.Errorf("request body sent to the server: %v (allow_mode_override %v)", sentBody, allow)
			}
			if string(r.Upstream.Body) != string(req.Body) {
				t.Errorf("upstream body %q", r.Upstream.Body)
			}
			if upstreamHeader(r, "x-bulkhead-feature") != "chat" {
				t.Errorf("x-bulkhead-feature %q", upstreamHeader(r, "x-bulkhead-feature"))
			}
		})
	}
}

const requireJSONPolicy = `
envoy: {max_message_timeout: 10s}
body: {require_valid_json: [/v1/chat/]}
features:
  default: {max_concurrent: 5}
`

// TestInvalidBody: a body that is not JSON is refused with 400 in the API's format on a route
// that requires valid JSON, and classified from headers and admitted elsewhere.
func TestInvalidBody(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, requireJSONPolicy), Mock: mock.Options{TimeScale: 0.01}})
	for _, tc := range []struct {
		path, body string
		want       int
	}{
		{"/v1/chat/completions", `{"model": "x", "messages": [`, 400},
		{"/v1/chat/completions", `[1,2,3]`, 400},
		{"/v1/embeddings", `not json at all`, 0}, // admitted; the mock answers what it answers
	} {
		r, err := s.Do(context.Background(), &envoysim.Request{Method: "POST", Path: tc.path,
			Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}}, Body: []byte(tc.body)})
		if err != nil {
			t.Fatal(err)
		}
		if tc.want == 400 {
			if r.Status != 400 || header(r, "x-bulkhead-reason") != "bad_request" || r.Upstream != nil ||
				!strings.Contains(string(r.Body), `"type":"invalid_request_error"`) {
				t.Errorf("%s %q: status %d body %s", tc.path, tc.body, r.Status, r.Body)
			}
			continue
		}
		if r.Upstream == nil {
			t.Errorf("%s %q was not admitted (status %d)", tc.path, tc.body, r.Status)
		}
	}
}

const badBodyPolicy = `
envoy: {max_message_timeout: 10s}
body: {require_valid_json: [/strict/]}
classification:
  feature:
    rules:
      - header: x-llm-feature
      - body: metadata.feature
features:
  chat: {max_concurrent: 50}
  default: {max_concurrent: 50, tokens_per_minute: 100000000}
`

// TestBadBodies: every kind of broken body has a defined outcome — classified from headers and
// defaults and admitted, or 400 where the route requires valid JSON — never a panic, a hang or
// a wrong class; and each is counted.
func TestBadBodies(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, badBodyPolicy), NoMock: true})
	deep := strings.Repeat(`{"a":`, 10_000) + "1" + strings.Repeat("}", 10_000)
	big := `{"model":"m","metadata":{"feature":"chat"},"messages":[{"role":"user","content":"` + strings.Repeat("x", 1<<20) + `"}]}`
	tests := []struct {
		name        string
		body        string
		wantFeature string // from the body when it could be read, else the header/default
		valid       bool   // a JSON object, as a strict route requires
	}{
		{"invalid JSON", `{"model": "m", "messages": [}`, "default", false},
		{"truncated JSON", `{"model":"m","metadata":{"feature":"chat"},"messages":[{"role":"user","content":"hel`, "default", false},
		{"top-level array", `[{"model":"m"}]`, "default", false},
		{"top-level string", `"hello"`, "default", false},
		{"wrong type max_tokens", `{"model":"m","max_tokens":"9","metadata":{"feature":"chat"},"messages":[]}`, "chat", true},
		{"negative max_tokens", `{"model":"m","max_tokens":-5,"metadata":{"feature":"chat"},"messages":[]}`, "chat", true},
		{"absurd max_tokens", `{"model":"m","max_tokens":99999999999999,"metadata":{"feature":"chat"},"messages":[]}`, "chat", true},
		{"10 000-deep nesting", deep, "default", true},
		{"1 MiB body", big, "chat", true},
		{"invalid UTF-8", "{\"model\":\"m\",\"metadata\":{\"feature\":\"chat\"},\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", "chat", true},
		{"duplicate keys", `{"metadata":{"feature":"nope"},"metadata":{"feature":"chat"},"messages":[]}`, "chat", true},
		{"empty body", ``, "default", false},
	}
	up := envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}}, `{"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := &envoysim.Request{Method: "POST", Path: "/v1/chat/completions",
				Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}}, Body: []byte(tt.body)}
			r, err := s.Sim.RoundTrip(context.Background(), req, up)
			if err != nil {
				t.Fatal(err)
			}
			if r.Status != 200 || r.Upstream == nil {
				t.Fatalf("status %d: %s", r.Status, r.Body)
			}
			if got := upstreamHeader(r, "x-bulkhead-feature"); got != tt.wantFeature {
				t.Errorf("feature %q, want %q", got, tt.wantFeature)
			}
			if string(r.Upstream.Body) != tt.body {
				t.Errorf("the body changed on its way upstream")
			}
			// Where the route requires valid JSON, the unreadable ones are refused.
			req.Path = "/strict/v1/chat/completions"
			r, err = s.Sim.RoundTrip(context.Background(), req, up)
			if err != nil {
				t.Fatal(err)
			}
			if tt.valid != (r.Status == 200) || (!tt.valid && header(r, "x-bulkhead-reason") != "bad_request") {
				t.Errorf("strict route: status %d", r.Status)
			}
		})
	}
	waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
	mfs, _ := s.App.Registry().Gather()
	counts := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() == "llm_bulkhead_classify_errors_total" {
			for _, m := range mf.GetMetric() {
				counts[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
			}
		}
	}
	if counts["invalid_json"] < 7 || counts["field_type"] < 1 || counts["field_value"] < 1 {
		t.Errorf("classify_errors_total %v", counts)
	}
}
