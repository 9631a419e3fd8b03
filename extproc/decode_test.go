package extproc

import (
	"bytes"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

func envoyHeaders(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

// envoyMessages are the requests Envoy sends on a stream, in the shapes Envoy gives them:
// raw_value headers, the protocol configuration on the first message, buffered and streamed
// bodies, trailers, observability mode, and the metadata context on every message (empty, or
// with the namespaces the filter forwards).
func envoyMessages() map[string]*extprocv3.ProcessingRequest {
	msgs := envoyMessagesWithoutMetadata()
	for _, m := range msgs {
		m.MetadataContext = &corev3.Metadata{}
	}
	msgs["no metadata context"] = &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte("{}"), EndOfStream: true}}}
	msgs["forwarded metadata"] = &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: envoyHeaders("x-tenant-id", "acme")}},
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			"envoy.filters.http.jwt_authn": {Fields: map[string]*structpb.Value{
				"claims": structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
					"tenant": structpb.NewStringValue("acme"), "tier": structpb.NewNumberValue(2),
					"groups": structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewBoolValue(true), structpb.NewNullValue()}})}}),
			}},
		}},
	}
	return msgs
}

func envoyMessagesWithoutMetadata() map[string]*extprocv3.ProcessingRequest {
	reqHeaders := envoyHeaders(":method", "POST", ":path", "/v1/chat/completions", ":authority", "api.example.com",
		"content-type", "application/json", "x-llm-feature", "chat", "x-tenant-id", "acme", "x-empty", "")
	return map[string]*extprocv3.ProcessingRequest{
		"request headers, first message": {
			Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: reqHeaders}},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{
				RequestBodyMode:  extprocfilterv3.ProcessingMode_BUFFERED,
				ResponseBodyMode: extprocfilterv3.ProcessingMode_STREAMED,
			},
		},
		"request headers, observability mode, no body": {
			Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
				Headers: reqHeaders, EndOfStream: true}},
			ObservabilityMode: true,
			ProtocolConfig:    &extprocv3.ProtocolConfiguration{SendBodyWithoutWaitingForHeaderResponse: true},
		},
		"headers with the value field": {
			Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
				Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: "x-a", Value: "é"}, {Key: "x-b", Value: "v", RawValue: []byte("r")}}}}},
		},
		"buffered request body": {
			Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
				Body: []byte(`{"model":"deepseek-chat","stream":true,"messages":[]}`), EndOfStream: true}},
		},
		"response headers": {
			Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
				Headers: envoyHeaders(":status", "200", "content-type", "text/event-stream")}},
		},
		"streamed response chunk": {
			Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("data: {}\n\n")}},
		},
		"end of stream without a message": {
			Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
				EndOfStream: true, EndOfStreamWithoutMessage: true, GrpcMessageCompressed: true, DrainComplete: true}},
		},
		"empty body":         {Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{}}},
		"empty header map":   {Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{}}}},
		"request trailers":   {Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{Trailers: envoyHeaders("x-t", "1")}}},
		"response trailers":  {Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{Trailers: envoyHeaders("grpc-status", "0")}}},
		"trailers, no map":   {Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}},
		"nothing in the one": {Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{}}},
		"no request at all":  {},
	}
}

func protobufDecode(t testing.TB, b []byte) (*extprocv3.ProcessingRequest, error) {
	t.Helper()
	m := &extprocv3.ProcessingRequest{}
	return m, proto.Unmarshal(b, m)
}

// TestDecodeRequestTakesEnvoysMessages: every kind of message Envoy sends is decoded without
// protobuf's decoder, to the message protobuf decodes. If one fell through, the fast path
// would silently be lost.
func TestDecodeRequestTakesEnvoysMessages(t *testing.T) {
	for name, msg := range envoyMessages() {
		t.Run(name, func(t *testing.T) {
			b, err := proto.Marshal(msg)
			if err != nil {
				t.Fatal(err)
			}
			want, err := protobufDecode(t, b)
			if err != nil {
				t.Fatal(err)
			}
			got := &extprocv3.ProcessingRequest{}
			if !decodeRequest(bytes.Clone(b), got) {
				t.Fatalf("left to protobuf: %v", msg)
			}
			if !proto.Equal(got, want) {
				t.Errorf("decoded %v\nwant %v", got, want)
			}
		})
	}
}

// TestDecodedBytesDoNotOverlap: a body or header value points into the message, but
// appending to it copies instead of writing over the fields after it.
func TestDecodedBytesDoNotOverlap(t *testing.T) {
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: envoyHeaders("a", "1", "b", "2")}}}
	b, _ := proto.Marshal(msg)
	got := &extprocv3.ProcessingRequest{}
	if !decodeRequest(b, got) {
		t.Fatal("left to protobuf")
	}
	hs := got.GetRequestHeaders().GetHeaders().GetHeaders()
	_ = append(hs[0].RawValue, "XXXXXXXX"...)
	if hs[1].Key != "b" || string(hs[1].RawValue) != "2" {
		t.Errorf("appending to the first value changed the second header: %q=%q", hs[1].Key, hs[1].RawValue)
	}
}

// TestDecodeRequestLeavesTheRestToProtobuf: what decodeRequest does not decode reaches the
// server as protobuf decodes it, and a broken message is still an error.
func TestDecodeRequestLeavesTheRestToProtobuf(t *testing.T) {
	withAttrs := &extprocv3.ProcessingRequest{
		Request:    &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: envoyHeaders("a", "1")}},
		Attributes: map[string]*structpb.Struct{"envoy.filters.http.ext_proc": {Fields: map[string]*structpb.Value{"request.path": structpb.NewStringValue("/v1")}}},
	}
	withMetadata := &extprocv3.ProcessingRequest{
		Request:         &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte("{}")}},
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"ns": {}}},
		Attributes:      map[string]*structpb.Struct{"k": {}},
	}
	marshal := func(m proto.Message) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	emptyMetadata := protowire.AppendBytes(protowire.AppendTag(nil, 8, protowire.BytesType), nil)
	body := marshal(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte("ab")}}})
	headers := marshal(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: envoyHeaders(":status", "200")}}})
	// A header whose key is not UTF-8, written by hand: protobuf refuses to marshal it.
	hv := protowire.AppendTag(nil, 1, protowire.BytesType)
	hv = protowire.AppendBytes(hv, []byte{0xff, 'k'})
	hm := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), hv)
	hh := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), hm)
	badKey := protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), hh)
	// The deprecated attributes of HttpHeaders (field 2), an empty map entry.
	headerAttrs := protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), nil)
	headerAttrs = protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), headerAttrs)
	unknown := protowire.AppendVarint(protowire.AppendTag(bytes.Clone(body), 99, protowire.VarintType), 7)

	for name, tc := range map[string]struct {
		b       []byte
		wantErr bool
	}{
		"attributes":                      {b: marshal(withAttrs)},
		"attributes in the headers":       {b: headerAttrs},
		"attributes and metadata":         {b: marshal(withMetadata)},
		"metadata context twice":          {b: append(bytes.Clone(emptyMetadata), emptyMetadata...)},
		"an unknown field":                {b: unknown},
		"two members of the oneof":        {b: append(bytes.Clone(body), headers...)},
		"the same member twice":           {b: append(bytes.Clone(body), body...)},
		"a key that is not UTF-8":         {b: badKey, wantErr: true},
		"cut short":                       {b: headers[:len(headers)-3], wantErr: true},
		"a field number of zero":          {b: []byte{0x02, 0x00}, wantErr: true},
		"a group where a message belongs": {b: []byte{0x13, 0x14}}, // protobuf keeps it as unknown
		"broken metadata":                 {b: []byte{0x42, 0x02, 0x0a, 0x05}, wantErr: true},
	} {
		t.Run(name, func(t *testing.T) {
			if decodeRequest(bytes.Clone(tc.b), &extprocv3.ProcessingRequest{}) {
				t.Fatal("decodeRequest took a message it should leave to protobuf")
			}
			want, wantErr := protobufDecode(t, tc.b)
			if (wantErr != nil) != tc.wantErr {
				t.Fatalf("protobuf's error %v, want error: %v", wantErr, tc.wantErr)
			}
			got := &extprocv3.ProcessingRequest{}
			err := newCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(tc.b)}, got)
			if (err != nil) != tc.wantErr {
				t.Fatalf("codec error %v, want error: %v", err, tc.wantErr)
			}
			if err == nil && !proto.Equal(got, want) {
				t.Errorf("codec decoded %v\nwant %v", got, want)
			}
		})
	}
}

// TestDecodeRequestNestsAsDeepAsProtobuf: forwarded metadata nested just within protobuf's
// recursion limit is decoded, one level deeper is refused, as protobuf does for the whole
// message.
func TestDecodeRequestNestsAsDeepAsProtobuf(t *testing.T) {
	nested := func(depth int) []byte {
		v := structpb.NewStringValue("leaf")
		for range depth {
			v = structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{"k": v}})
		}
		b, err := proto.Marshal(&extprocv3.ProcessingRequest{MetadataContext: &corev3.Metadata{
			FilterMetadata: map[string]*structpb.Struct{"ns": v.GetStructValue()}}})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	// Find the deepest nesting protobuf accepts.
	lo, hi := 1, 20000
	for lo < hi {
		mid := (lo + hi + 1) / 2
		if _, err := protobufDecode(t, nested(mid)); err == nil {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	if lo == 20000 {
		t.Fatal("protobuf accepted every depth tried")
	}
	if !decodeRequest(nested(lo), &extprocv3.ProcessingRequest{}) {
		t.Errorf("depth %d, which protobuf accepts, was refused", lo)
	}
	if decodeRequest(nested(lo+1), &extprocv3.ProcessingRequest{}) {
		t.Errorf("depth %d, which protobuf refuses, was accepted", lo+1)
	}
}

// FuzzDecodeRequest: whatever decodeRequest takes, protobuf decodes to the same message.
func FuzzDecodeRequest(f *testing.F) {
	for _, m := range envoyMessages() {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0x12, 0x00, 0x50, 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		got := &extprocv3.ProcessingRequest{}
		if !decodeRequest(bytes.Clone(b), got) {
			return
		}
		want, err := protobufDecode(t, b)
		if err != nil {
			t.Fatalf("decodeRequest took a message protobuf refuses (%v): %x", err, b)
		}
		if !proto.Equal(got, want) {
			t.Fatalf("decoded %v\nprotobuf %v\ninput %x", got, want, b)
		}
	})
}

// BenchmarkDecodeRequest: a stream's six messages (as in the overhead benchmark), decoded
// by decodeRequest and by protobuf.
func BenchmarkDecodeRequest(b *testing.B) {
	msgs := envoyMessages()
	var stream [][]byte
	for _, name := range []string{"request headers, first message", "buffered request body", "response headers",
		"streamed response chunk", "streamed response chunk", "streamed response chunk"} {
		enc, err := proto.Marshal(msgs[name])
		if err != nil {
			b.Fatal(err)
		}
		stream = append(stream, enc)
	}
	b.Run("decodeRequest", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			for _, enc := range stream {
				if !decodeRequest(bytes.Clone(enc), &extprocv3.ProcessingRequest{}) {
					b.Fatal("left to protobuf")
				}
			}
		}
	})
	b.Run("protobuf", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			for _, enc := range stream {
				if err := proto.Unmarshal(enc, &extprocv3.ProcessingRequest{}); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}
