package integration_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// identityPolicy takes the tenant from a JWT claim, a trusted body field and a trusted header,
// names it in tenant-keyed compartments (and their metric labels), and prices models so that
// the model a response names is read.
const identityPolicy = `
envoy: {max_message_timeout: 10s}
admin: {tenant_label: true}
responses: {compartment_header: true}
classification:
  tenant:
    rules:
      - metadata: {namespace: envoy.filters.http.jwt_authn, key: jwt_payload.tenant}
      - body: user
        trusted: true
      - header: x-tenant-id
        trusted: true
  model:
    rules: [{body: model}]
prices:
  - {match: default, input_per_mtok: 1, output_per_mtok: 1}
compartments:
  - {name: tenant, key: [tenant], limits: {max_concurrent: 50, spend_per_day: 1000}}
`

// TestIdentityValuesThatCannotBeHeaderValues: a tenant or model read from a trusted source with
// CR, LF, NUL or bytes that are not UTF-8 is treated as absent, so every header and metadata
// field the server sends is one Envoy accepts — the simulator refuses what Envoy refuses and
// answers 500 for it, as Envoy did for every such request. The model a response names reaches
// the metadata as UTF-8, and /metrics, which labels tenant compartments, keeps answering.
func TestIdentityValuesThatCannotBeHeaderValues(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, identityPolicy), NoMock: true})
	claims := func(tenant string) map[string]*structpb.Struct {
		c, err := structpb.NewStruct(map[string]any{"jwt_payload": map[string]any{"tenant": tenant}})
		if err != nil {
			t.Fatal(err)
		}
		return map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": c}
	}
	ok := envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}},
		`{"model":"gpt-4o-mini","usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	for _, tc := range []struct {
		name                  string
		user, header          string // the body's "user" and x-tenant-id
		claim                 string
		model                 string // JSON, quoted
		upstream              *envoysim.StaticResponse
		wantTenant, wantModel string
		wantResponseModel     string
	}{
		{name: "CR LF in a trusted body field", user: `"acme\r\nx-injected: 1"`, model: `"gpt-4o-mini"`, wantTenant: "anonymous", wantModel: "gpt-4o-mini"},
		{name: "NUL in a trusted body field, the header rule next", user: `"ac\u0000me"`, header: "globex", model: `"gpt-4o-mini"`, wantTenant: "globex", wantModel: "gpt-4o-mini"},
		{name: "LF in a JWT claim", claim: "ac\nme", model: `"gpt-4o-mini"`, wantTenant: "anonymous", wantModel: "gpt-4o-mini"},
		{name: "obs-text in a trusted header", header: "\xffacme", model: `"gpt-4o-mini"`, wantTenant: "anonymous", wantModel: "gpt-4o-mini"},
		{name: "NUL in the model", user: `"acme"`, model: `"gpt-4o\u0000"`, wantTenant: "acme", wantModel: "unknown"},
		{name: "a response that names a model not in UTF-8", user: `"acme"`, model: `"gpt-4o-mini"`,
			upstream: envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}},
				"{\"model\":\"gpt-\xff\",\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1,\"total_tokens\":2}}"),
			wantTenant: "acme", wantModel: "gpt-4o-mini", wantResponseModel: "gpt-\uFFFD"},
		{name: "valid values pass unchanged", user: `"acme"`, model: `"gpt-4o-mini"`, wantTenant: "acme", wantModel: "gpt-4o-mini", wantResponseModel: "gpt-4o-mini"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := `{"model":` + tc.model + `,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]`
			if tc.user != "" {
				body += `,"user":` + tc.user
			}
			req := &envoysim.Request{Method: "POST", Path: "/v1/chat/completions",
				Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}}, Body: []byte(body + "}")}
			if tc.header != "" {
				req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: tc.header})
			}
			if tc.claim != "" {
				req.Metadata = claims(tc.claim)
			}
			up := tc.upstream
			if up == nil {
				up = ok
			}
			r, err := s.Sim.RoundTrip(context.Background(), req, up)
			if err != nil {
				t.Fatal(err)
			}
			if r.Status != 200 || r.Upstream == nil || len(r.Problems) != 0 {
				t.Fatalf("status %d (%s), problems %v: %s", r.Status, r.LocalDetails, r.Problems, r.Body)
			}
			want := "tenant/" + tc.wantTenant
			if got := upstreamHeader(r, "x-bulkhead-compartment"); got != want {
				t.Errorf("upstream x-bulkhead-compartment %q, want %q", got, want)
			}
			if got := header(r, "x-bulkhead-compartment"); got != want {
				t.Errorf("client x-bulkhead-compartment %q, want %q", got, want)
			}
			for _, h := range r.Upstream.Headers {
				if strings.Contains(h.Key, "injected") {
					t.Errorf("a header was injected: %s: %s", h.Key, h.Value)
				}
			}
			md := r.DynamicMetadata["llm_bulkhead"].GetFields()
			if md["tenant"].GetStringValue() != tc.wantTenant || md["model"].GetStringValue() != tc.wantModel {
				t.Errorf("metadata tenant %v, model %v", md["tenant"], md["model"])
			}
			if tc.wantResponseModel != "" && md["response_model"].GetStringValue() != tc.wantResponseModel {
				t.Errorf("metadata response_model %v, want %q", md["response_model"], tc.wantResponseModel)
			}
		})
	}
	waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
	b, err := s.Scrape()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b, `compartment="tenant/acme"`) ||
		!strings.Contains(b, `llm_bulkhead_classify_errors_total{reason="invalid_tenant"} 4`) ||
		!strings.Contains(b, `llm_bulkhead_classify_errors_total{reason="invalid_model"} 1`) {
		t.Errorf("/metrics:\n%s", grepLines(b, "tenant/", "classify_errors"))
	}
}

// grepLines returns the lines of s that contain any of words.
func grepLines(s string, words ...string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		for _, w := range words {
			if strings.Contains(l, w) {
				out = append(out, l)
				break
			}
		}
	}
	return strings.Join(out, "\n")
}
