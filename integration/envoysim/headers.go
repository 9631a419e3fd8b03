package envoysim

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// Header is one HTTP header field, a plain value. Keys are kept lower-case, as Envoy's
// header map stores them; pseudo-headers (":method", ":status", …) are
// ordinary entries whose key starts with a colon.
type Header struct {
	Key   string
	Value string
}

// Headers is an ordered multimap of header fields, the shape of Envoy's
// header map. The zero value is an empty list. A Headers value is not safe
// for concurrent mutation; the simulator hands out copies.
type Headers []Header

// H builds Headers from alternating key/value strings, lower-casing keys.
// A trailing key without a value is ignored.
func H(kv ...string) Headers {
	h := make(Headers, 0, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		h = append(h, Header{Key: strings.ToLower(kv[i]), Value: kv[i+1]})
	}
	return h
}

// Get returns the first value for key (case-insensitive) or "".
func (h Headers) Get(key string) string {
	v, _ := h.Lookup(key)
	return v
}

// Lookup returns the first value for key and whether the key is present.
func (h Headers) Lookup(key string) (string, bool) {
	key = strings.ToLower(key)
	for _, f := range h {
		if f.Key == key {
			return f.Value, true
		}
	}
	return "", false
}

// Values returns every value stored under key, in order.
func (h Headers) Values(key string) []string {
	key = strings.ToLower(key)
	var out []string
	for _, f := range h {
		if f.Key == key {
			out = append(out, f.Value)
		}
	}
	return out
}

// Clone returns an independent copy.
func (h Headers) Clone() Headers {
	if h == nil {
		return nil
	}
	return append(Headers(nil), h...)
}

// Set replaces every entry for key with one entry, keeping the position of
// the first one (Envoy's setCopy) or appending when absent.
func (h *Headers) Set(key, value string) {
	key = strings.ToLower(key)
	out := (*h)[:0]
	done := false
	for _, f := range *h {
		if f.Key != key {
			out = append(out, f)
			continue
		}
		if !done {
			out = append(out, Header{Key: key, Value: value})
			done = true
		}
	}
	if !done {
		out = append(out, Header{Key: key, Value: value})
	}
	*h = out
}

// Add appends an entry (Envoy's addCopy).
func (h *Headers) Add(key, value string) {
	*h = append(*h, Header{Key: strings.ToLower(key), Value: value})
}

// Del removes every entry for key.
func (h *Headers) Del(key string) {
	key = strings.ToLower(key)
	out := (*h)[:0]
	for _, f := range *h {
		if f.Key != key {
			out = append(out, f)
		}
	}
	*h = out
}

// WithoutPseudo returns the entries whose keys do not start with ':'.
func (h Headers) WithoutPseudo() Headers {
	out := make(Headers, 0, len(h))
	for _, f := range h {
		if !strings.HasPrefix(f.Key, ":") {
			out = append(out, f)
		}
	}
	return out
}

// HTTPHeader converts to net/http's representation, dropping pseudo-headers.
func (h Headers) HTTPHeader() http.Header {
	out := make(http.Header, len(h))
	for _, f := range h {
		if strings.HasPrefix(f.Key, ":") {
			continue
		}
		out.Add(f.Key, f.Value)
	}
	return out
}

// FromHTTPHeader converts net/http headers into lower-case Headers, sorted
// by nothing but Go's map order being unpredictable: callers that need a
// stable order should sort afterwards.
func FromHTTPHeader(hh http.Header) Headers {
	out := make(Headers, 0, len(hh))
	for k, vs := range hh {
		lk := strings.ToLower(k)
		for _, v := range vs {
			out = append(out, Header{Key: lk, Value: v})
		}
	}
	return out
}

// toProto renders headers the way Envoy 1.37 does with
// send_header_raw_value enabled (the default): lower-case key, value bytes
// in raw_value, value left empty.
func (h Headers) toProto() *corev3.HeaderMap {
	out := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, 0, len(h))}
	for _, f := range h {
		out.Headers = append(out.Headers, &corev3.HeaderValue{Key: f.Key, RawValue: []byte(f.Value)})
	}
	return out
}

// HeadersFromProto reads a header map the way a tolerant server should:
// raw_value first, value as the fallback.
func HeadersFromProto(m *corev3.HeaderMap) Headers {
	out := make(Headers, 0, len(m.GetHeaders()))
	for _, hv := range m.GetHeaders() {
		v := string(hv.GetRawValue())
		if len(hv.GetRawValue()) == 0 {
			v = hv.GetValue()
		}
		out = append(out, Header{Key: strings.ToLower(hv.GetKey()), Value: v})
	}
	return out
}

// MutationRules is a plain value that mirrors envoy.config.common.mutation_rules.v3.HeaderMutationRules
// minus the regular-expression fields. The zero value is Envoy's default rule
// set: ":authority", "host", ":method" and ":scheme" may not be changed,
// "x-envoy-*" may not be changed, other headers and ":path"/":status" may.
type MutationRules struct {
	AllowAllRouting bool
	AllowEnvoy      bool
	DisallowSystem  bool
	DisallowAll     bool
	DisallowIsError bool
}

type checkResult int

const (
	checkOK checkResult = iota
	checkIgnore
	checkFail
)

type checkOp int

const (
	opSet checkOp = iota
	opAppend
	opRemove
)

func (r MutationRules) check(op checkOp, key, value string) checkResult {
	deny := checkIgnore
	if r.DisallowIsError {
		deny = checkFail
	}
	if key == ":status" && op != opRemove {
		n, err := strconv.Atoi(value)
		if err != nil || n < 200 || n > 599 {
			return deny
		}
	}
	if r.allowed(op, key) {
		return checkOK
	}
	return deny
}

func (r MutationRules) allowed(op checkOp, key string) bool {
	system := strings.HasPrefix(key, ":")
	if op == opRemove && system {
		return false
	}
	if r.DisallowAll {
		return false
	}
	if system {
		if r.DisallowSystem {
			return false
		}
		if !r.AllowAllRouting && (key == ":authority" || key == ":method" || key == ":scheme") {
			return false
		}
		return true
	}
	if key == "host" && !r.AllowAllRouting {
		return false
	}
	if !r.AllowEnvoy && strings.HasPrefix(key, "x-envoy-") {
		return false
	}
	return true
}

// validHeaderName accepts what Envoy's HeaderUtility::headerNameIsValid
// accepts: a non-empty token, optionally prefixed by ':' for pseudo-headers.
func validHeaderName(k string) bool {
	k = strings.TrimPrefix(k, ":")
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte("\"(),/:;<=>?@[\\]{}", c) >= 0 {
			return false
		}
	}
	return true
}

// validHeaderValue accepts what Envoy's HeaderUtility::headerValueIsValid accepts (quiche's
// HeaderValidator::IsValidHeaderValue with obs-text allowed; nghttp2's
// nghttp2_check_header_value in older builds, the same set): horizontal tab, the visible ASCII
// characters and space, and every byte from 0x80 (obs-text). Any other control character —
// NUL, CR and LF among them — and DEL make Envoy refuse the mutation and fail the request.
func validHeaderValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}

// applyHeaderMutation applies an ext_proc HeaderMutation the way Envoy's
// MutationUtils::applyHeaderMutations does: removals first, then sets.
// Only the deprecated-looking `append` BoolValue is consulted — Envoy's
// ext_proc filter ignores HeaderValueOption.append_action — and only
// raw_value is read, because send_header_raw_value is on. A returned error
// makes the filter answer with status_on_error.
func applyHeaderMutation(m *extprocv3.HeaderMutation, h *Headers, replacing bool, rules MutationRules, dropContentLength bool) (rejected int, err error) {
	for _, name := range m.GetRemoveHeaders() {
		if !validHeaderName(name) {
			return rejected + 1, fmt.Errorf("invalid character in remove_headers mutation")
		}
		key := strings.ToLower(name)
		switch rules.check(opRemove, key, "") {
		case checkOK:
			h.Del(key)
		case checkIgnore:
			rejected++
		case checkFail:
			return rejected + 1, fmt.Errorf("invalid attempt to remove %s", key)
		}
	}
	for _, opt := range m.GetSetHeaders() {
		hv := opt.GetHeader()
		if hv == nil {
			continue
		}
		if dropContentLength && strings.EqualFold(hv.GetKey(), "content-length") {
			continue
		}
		if hv.GetValue() != "" && len(hv.GetRawValue()) != 0 {
			return rejected + 1, fmt.Errorf("only one of value or raw_value in the HeaderValue message should be set")
		}
		value := string(hv.GetRawValue())
		if !validHeaderName(hv.GetKey()) || !validHeaderValue(value) {
			return rejected + 1, fmt.Errorf("invalid character in set_headers mutation")
		}
		key := strings.ToLower(hv.GetKey())
		//lint:ignore SA1019 Envoy's ext_proc filter reads only this deprecated field, not append_action.
		appendIt := opt.GetAppend().GetValue()
		op := opSet
		if _, present := h.Lookup(key); appendIt && present {
			op = opAppend
		}
		res := rules.check(op, key, value)
		if replacing && key == ":method" {
			res = checkOK
		}
		switch res {
		case checkOK:
			if appendIt {
				h.Add(key, value)
			} else {
				h.Set(key, value)
			}
		case checkIgnore:
			rejected++
		case checkFail:
			return rejected + 1, fmt.Errorf("invalid attempt to modify %s", key)
		}
	}
	return rejected, nil
}

// applyBodyMutation returns the body after an ext_proc BodyMutation.
func applyBodyMutation(m *extprocv3.BodyMutation, body []byte) []byte {
	switch mm := m.GetMutation().(type) {
	case *extprocv3.BodyMutation_Body:
		return append([]byte(nil), mm.Body...)
	case *extprocv3.BodyMutation_ClearBody:
		if mm.ClearBody {
			return nil
		}
	}
	return body
}
