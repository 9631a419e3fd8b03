package envoysim

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

func filterFromYAML(t testing.TB, src string) *extprocfilterv3.ExternalProcessor {
	t.Helper()
	var v any
	if err := yaml.Unmarshal([]byte(src), &v); err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	p := &extprocfilterv3.ExternalProcessor{}
	if err := protojson.Unmarshal(js, p); err != nil {
		t.Fatal(err)
	}
	return p
}

const shippedFilter = `
grpc_service:
  envoy_grpc: {cluster_name: llm_bulkhead}
processing_mode:
  request_header_mode: SEND
  response_header_mode: SEND
  request_body_mode: BUFFERED
  response_body_mode: STREAMED
  request_trailer_mode: SKIP
  response_trailer_mode: SKIP
message_timeout: 2s
max_message_timeout: 10s
allow_mode_override: true
status_on_error: {code: 503}
metadata_options:
  forwarding_namespaces: {untyped: [envoy.filters.http.jwt_authn]}
  receiving_namespaces: {untyped: [llm_bulkhead]}
request_attributes: [request.id]
`

func TestFromProto(t *testing.T) {
	c, err := FromProto(filterFromYAML(t, shippedFilter))
	if err != nil {
		t.Fatal(err)
	}
	want := FilterConfig{
		Mode:                 ProcessingMode{RequestHeader: HeaderSend, ResponseHeader: HeaderSend, RequestBody: BodyBuffered, ResponseBody: BodyStreamed, RequestTrailer: HeaderSkip, ResponseTrailer: HeaderSkip},
		MessageTimeout:       2 * time.Second,
		MaxMessageTimeout:    10 * time.Second,
		AllowModeOverride:    true,
		StatusOnError:        503,
		ForwardingNamespaces: []string{"envoy.filters.http.jwt_authn"},
		ReceivingNamespaces:  []string{"llm_bulkhead"},
		RequestAttributes:    []string{"request.id"},
		RouteCacheAction:     "DEFAULT",
	}
	if got, _ := json.Marshal(c); string(got) != string(must(json.Marshal(want))) {
		t.Fatalf("got  %s\nwant %s", got, must(json.Marshal(want)))
	}
}

func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}
	return b
}

func TestFromProtoRejects(t *testing.T) {
	tests := []struct {
		name, yaml, want string
	}{
		{"no grpc service", "processing_mode: {}", "grpc_service is required"},
		{"full duplex", "grpc_service: {envoy_grpc: {cluster_name: c}}\nprocessing_mode: {request_body_mode: FULL_DUPLEX_STREAMED}", "not simulated"},
		{"bad status_on_error", "grpc_service: {envoy_grpc: {cluster_name: c}}\nstatus_on_error: {code: 100}", "status_on_error"},
		{"message timeout too long", "grpc_service: {envoy_grpc: {cluster_name: c}}\nmessage_timeout: 7200s", "message_timeout"},
		{"route cache conflict", "grpc_service: {envoy_grpc: {cluster_name: c}}\ndisable_clear_route_cache: true\nroute_cache_action: CLEAR", "route_cache_action"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := FromProto(filterFromYAML(t, tc.yaml))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error mentioning %q", err, tc.want)
			}
		})
	}
	if _, err := FromProto(nil); err == nil {
		t.Fatal("nil must be rejected")
	}
}

func TestValidateReportsEverything(t *testing.T) {
	err := FilterConfig{StatusOnError: 7, BufferLimit: -1, RouteCacheAction: "SOMETIMES", Mode: ProcessingMode{RequestBody: 4}}.Validate()
	if err == nil {
		t.Fatal("want errors")
	}
	for _, want := range []string{"status_on_error", "buffer limit", "route_cache_action", "request_body_mode"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("missing %q in %v", want, err)
		}
	}
}

func TestParseModes(t *testing.T) {
	tests := []struct {
		in      string
		body    BodyMode
		bodyErr bool
		hdr     HeaderMode
		hdrErr  bool
	}{
		{in: "buffered", body: BodyBuffered, hdrErr: true},
		{in: "STREAMED", body: BodyStreamed, hdrErr: true},
		{in: "Buffered_Partial", body: BodyBufferedPartial, hdrErr: true},
		{in: "", body: BodyNone, hdr: HeaderDefault},
		{in: "skip", bodyErr: true, hdr: HeaderSkip},
		{in: "SEND", bodyErr: true, hdr: HeaderSend},
		{in: "FULL_DUPLEX_STREAMED", bodyErr: true, hdrErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			b, err := ParseBodyMode(tc.in)
			if (err != nil) != tc.bodyErr || (err == nil && b != tc.body) {
				t.Fatalf("ParseBodyMode = %v, %v", b, err)
			}
			h, err := ParseHeaderMode(tc.in)
			if (err != nil) != tc.hdrErr || (err == nil && h != tc.hdr) {
				t.Fatalf("ParseHeaderMode = %v, %v", h, err)
			}
		})
	}
}

func FuzzParseModes(f *testing.F) {
	for _, s := range []string{"", "SEND", "skip", "BUFFERED", "streamed", "BUFFERED_PARTIAL", "x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if b, err := ParseBodyMode(s); err == nil {
			if back, err := ParseBodyMode(b.String()); err != nil || back != b {
				t.Fatalf("%q -> %v does not round-trip", s, b)
			}
		}
		if h, err := ParseHeaderMode(s); err == nil {
			if back, err := ParseHeaderMode(h.String()); err != nil || back != h {
				t.Fatalf("%q -> %v does not round-trip", s, h)
			}
		}
	})
}

func FuzzFromProto(f *testing.F) {
	seed, _ := proto.Marshal(filterFromYAML(f, shippedFilter))
	f.Add(seed)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		p := &extprocfilterv3.ExternalProcessor{}
		if proto.Unmarshal(data, p) != nil {
			return
		}
		c, err := FromProto(p)
		if err == nil {
			if verr := c.Validate(); verr != nil {
				t.Fatalf("FromProto accepted a config Validate rejects: %v", verr)
			}
		}
	})
}

func FuzzApplyHeaderMutation(f *testing.F) {
	seed, _ := proto.Marshal(&extprocv3.HeaderMutation{
		SetHeaders:    []*corev3.HeaderValueOption{hvo("x-a", "1", false), hvo(":path", "/x", false), hvo("x-a", "2", true)},
		RemoveHeaders: []string{"authorization", ":method"},
	})
	f.Add(seed, false)
	f.Add([]byte{}, true)
	f.Fuzz(func(t *testing.T, data []byte, replace bool) {
		m := &extprocv3.HeaderMutation{}
		if proto.Unmarshal(data, m) != nil {
			return
		}
		h := H(":method", "GET", ":path", "/", "authorization", "k", "x-a", "0")
		if _, err := applyHeaderMutation(m, &h, replace, MutationRules{}, false); err != nil {
			return
		}
		for _, f := range h {
			if f.Key != strings.ToLower(f.Key) || !validHeaderName(f.Key) || !validHeaderValue(f.Value) {
				t.Fatalf("mutation produced invalid header %q: %q", f.Key, f.Value)
			}
		}
		if h.Get(":method") == "" && !replace {
			t.Fatal(":method removed")
		}
	})
}
