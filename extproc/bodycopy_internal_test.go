package extproc

import (
	"bytes"
	"strings"
	"testing"
	"unsafe"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
)

// streamedChat is a streamed chat request body of about n bytes.
func streamedChat(n int) []byte {
	const head, tail = `{"model":"m","stream":true,"max_tokens":10,"messages":[{"role":"user","content":"`, `"}]}`
	return []byte(head + strings.Repeat("a", n-len(head)-len(tail)) + tail)
}

// chunks splits b into a BufferSlice of 16 KiB buffers, as gRPC hands a received message over
// (one buffer per HTTP/2 DATA frame).
func chunks(b []byte) mem.BufferSlice {
	var s mem.BufferSlice
	for len(b) > 0 {
		n := min(len(b), 16<<10)
		s = append(s, mem.SliceBuffer(bytes.Clone(b[:n])))
		b = b[n:]
	}
	return s
}

func sameArray(a, b []byte) bool {
	return len(a) > 0 && len(b) > 0 && unsafe.SliceData(a) == unsafe.SliceData(b)
}

// TestLargeRequestBodyIsEditedWhereItWasDecoded: a buffered body used to be copied once more for
// its rewrites (include_usage, a re-route's model): 8 MiB bodies cost twice their size until the
// reply was marshalled. The decoder leaves room after a large request body and the edits are made
// in it.
func TestLargeRequestBodyIsEditedWhereItWasDecoded(t *testing.T) {
	body := streamedChat(1 << 20)
	// With metadata_context, which protobuf-go writes before the body, Envoy after it.
	msg, err := proto.Marshal(&extprocv3.ProcessingRequest{
		Request:         &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}},
		MetadataContext: &corev3.Metadata{},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, model := range []string{"", "a-longer-model-name"} {
		t.Run("model "+model, func(t *testing.T) {
			var m extprocv3.ProcessingRequest
			if err := newCodec().Unmarshal(chunks(msg), &m); err != nil {
				t.Fatal(err)
			}
			got := m.GetRequestBody().GetBody()
			if !bytes.Equal(got, body) {
				t.Fatal("decoded body differs")
			}
			var f llmapi.RequestFields
			if err := llmapi.ScanRequest(llmapi.APIOpenAIChat, got, &f); err != nil {
				t.Fatal(err)
			}
			edited, changed := llmapi.EditBody(llmapi.APIOpenAIChat, got, &f, model, true)
			if !changed || !bytes.HasSuffix(edited, []byte(`,"stream_options":{"include_usage":true}}`)) {
				t.Fatalf("edited body ends %q", edited[max(0, len(edited)-60):])
			}
			if model != "" && !bytes.HasPrefix(edited, []byte(`{"model":"`+model+`"`)) {
				t.Errorf("edited body starts %q", edited[:40])
			}
			if !sameArray(edited, got) {
				t.Error("the body was copied for its edits")
			}
		})
	}
}

// TestLargeReplyBodyIsSentWhereItIs: the reply carrying a rewritten body was marshalled into a
// buffer of its own (and gRPC's pool kept it after): a second copy of every large body in
// flight. The codec now hands gRPC the body itself, after the rest of the reply; the two decode
// as the reply did, and the reply is left as it was.
func TestLargeReplyBodyIsSentWhereItIs(t *testing.T) {
	body := streamedChat(1 << 20)
	common := mutation(setHeader(HeaderFeature, "chat"), setHeader("content-length", "1048617"))
	common.ClearRouteCache = true
	common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}}
	reply := bodyReply(true, common)
	reply.ModeOverride = &extprocfilterv3.ProcessingMode{ResponseBodyMode: extprocfilterv3.ProcessingMode_STREAMED}
	reply.DynamicMetadata = &structpb.Struct{Fields: map[string]*structpb.Value{"llm_bulkhead": structpb.NewStringValue("admitted")}}
	want := proto.Clone(reply)

	data, err := newCodec().Marshal(reply)
	if err != nil {
		t.Fatal(err)
	}
	shared := false
	for _, b := range data {
		shared = shared || sameArray(b.ReadOnlyData(), body)
	}
	if !shared {
		t.Error("the body was copied into the marshalled reply")
	}
	got := &extprocv3.ProcessingResponse{}
	if err := proto.Unmarshal(data.Materialize(), got); err != nil {
		t.Fatal(err)
	}
	data.Free()
	if !proto.Equal(got, want) {
		t.Error("the reply decodes to something else")
	}
	if !proto.Equal(reply, want) || !sameArray(reply.GetRequestBody().GetResponse().GetBodyMutation().GetBody(), body) {
		t.Error("marshalling changed the reply")
	}

	// A small body is marshalled with the rest, in one buffer.
	common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: streamedChat(1 << 10)}}
	if data, err := newCodec().Marshal(bodyReply(true, common)); err != nil || len(data) != 1 {
		t.Errorf("a 1 KiB body: %d buffers, %v; want 1", len(data), err)
	}
}
