package extproc

import (
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
)

// TestCodecRoundTrips: every kind of reply the server builds — with header and body
// mutations, metadata written as raw fields, mode overrides, timeouts, refusals — and a
// message without generated marshalling decode to what was marshalled.
func TestCodecRoundTrips(t *testing.T) {
	md := &extprocv3.ProcessingResponse{}
	md.ProtoReflect().SetUnknown(protoreflect.RawFields(protoMetadataBytes(t)))
	big := make([]byte, 64<<10)
	for i := range big {
		big[i] = byte('a' + i%26)
	}
	admit := mutation(setHeader(HeaderFeature, "chat"), setHeader(HeaderCompartment, "feature/chat,tenant/acme"))
	admit.HeaderMutation.RemoveHeaders = []string{"accept-encoding"}
	admit.ClearRouteCache = true
	admit.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: big}}
	withMode := headersReply(true, admit)
	withMode.ModeOverride = &extprocfilterv3.ProcessingMode{RequestBodyMode: extprocfilterv3.ProcessingMode_NONE, ResponseBodyMode: extprocfilterv3.ProcessingMode_STREAMED}
	for name, m := range map[string]proto.Message{
		"continue":      continueResponseBody,
		"admission":     bodyReply(true, admit),
		"mode override": withMode,
		"raw metadata":  md,
		"timeout":       &extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(7e9)},
		"refusal": &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
			Status: &typev3.HttpStatus{Code: typev3.StatusCode_TooManyRequests}, Body: []byte(`{"error":{}}`),
			Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setHeader(HeaderRetryAfter, "3")}}}},
			DynamicMetadata: &structpb.Struct{Fields: map[string]*structpb.Value{"ns": structpb.NewStringValue("v")}}},
		"no generated code": &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING},
	} {
		t.Run(name, func(t *testing.T) {
			data, err := newCodec().Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			b := data.Materialize()
			data.Free()
			got := m.ProtoReflect().New().Interface()
			if err := proto.Unmarshal(b, got); err != nil {
				t.Fatal(err)
			}
			want := m.ProtoReflect().New().Interface()
			raw, err := proto.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			if err := proto.Unmarshal(raw, want); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(got, want) {
				t.Errorf("decoded %v, want %v", got, want)
			}
			// And the codec's own Unmarshal reads it back.
			again := m.ProtoReflect().New().Interface()
			if err := newCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, again); err != nil || !proto.Equal(again, want) {
				t.Errorf("codec Unmarshal: %v, %v", err, again)
			}
		})
	}
	if newCodec().Name() != "proto" {
		t.Errorf("codec name %q: gRPC only uses a codec registered for the content subtype proto", newCodec().Name())
	}
}

// protoMetadataBytes is a dynamic_metadata field as the server writes it.
func protoMetadataBytes(t *testing.T) []byte {
	t.Helper()
	st := &structpb.Struct{Fields: map[string]*structpb.Value{"llm_bulkhead": structpb.NewStructValue(&structpb.Struct{
		Fields: map[string]*structpb.Value{"decision": structpb.NewStringValue("admitted"), "total_tokens": structpb.NewNumberValue(248)}})}}
	b, err := proto.Marshal(&extprocv3.ProcessingResponse{DynamicMetadata: st})
	if err != nil {
		t.Fatal(err)
	}
	return b
}
