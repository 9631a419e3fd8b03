package extproc

import (
	"strconv"
	"unsafe"

	"google.golang.org/protobuf/types/known/structpb"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// A processor is the policy.Input that classification reads: the current message's headers,
// the request's path and body fields, and what Envoy forwarded in metadata_context and
// attributes.
var _ policy.Input = (*processor)(nil)

// attributesKey is where Envoy puts request and response attributes.
const attributesKey = "envoy.filters.http.ext_proc"

// Header implements policy.Input over the current message's headers. The value aliases the
// message's bytes (protobuf gives every message its own), so reading does not allocate; code
// that keeps a value beyond the request must copy it.
func (p *processor) Header(name string) (string, bool) { return findHeader(p.headers, name) }

// headerValue is a header's value as Envoy sent it (raw_value, or value from an Envoy that
// does not send raw values), without a copy: valid while the message is.
func headerValue(h *corev3.HeaderValue) string {
	if len(h.RawValue) > 0 {
		return unsafe.String(unsafe.SliceData(h.RawValue), len(h.RawValue))
	}
	return h.Value
}

func (p *processor) method() string {
	m, _ := p.Header(":method")
	return m
}

// Path implements policy.Input.
func (p *processor) Path() string { return p.req.path }

// BodyField implements policy.Input.
// For "model" it returns the model (or Azure deployment) the path names when it names one:
// that is the one the provider serves, whatever the body says, and it is known without a body.
func (p *processor) BodyField(path string) (string, bool) {
	if m := p.req.route.Model; m != "" && path == "model" {
		return m, true
	}
	if !p.req.bodyOK {
		return "", false
	}
	// The scan already read the common fields: do not walk a large body again for them.
	switch path {
	case "model":
		return p.req.fields.Model, p.req.fields.Model != ""
	case "user":
		if !p.req.api.Anthropic() {
			return p.req.fields.User, p.req.fields.User != ""
		}
	}
	return llmapi.Field(p.req.body, path)
}

// Metadata implements policy.Input over metadata_context (Envoy-forwarded, trusted).
func (p *processor) Metadata(namespace string, key []string) (string, bool) {
	st := p.req.metadata.GetFilterMetadata()[namespace]
	if st == nil || len(key) == 0 {
		return "", false
	}
	for i, k := range key {
		v := st.GetFields()[k]
		if v == nil {
			return "", false
		}
		if i == len(key)-1 {
			return scalar(v)
		}
		st = v.GetStructValue()
		if st == nil {
			return "", false
		}
	}
	return "", false
}

// Attribute implements policy.Input over the request attributes.
func (p *processor) Attribute(name string) (string, bool) {
	v := p.req.attrs.GetFields()[name]
	if v == nil {
		return "", false
	}
	return scalar(v)
}

func scalar(v *structpb.Value) (string, bool) {
	switch k := v.Kind.(type) {
	case *structpb.Value_StringValue:
		return k.StringValue, true
	case *structpb.Value_NumberValue:
		return strconv.FormatFloat(k.NumberValue, 'f', -1, 64), true
	case *structpb.Value_BoolValue:
		return strconv.FormatBool(k.BoolValue), true
	}
	return "", false
}
