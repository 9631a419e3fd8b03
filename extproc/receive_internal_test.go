package extproc

import (
	"bytes"
	"fmt"
	"sync/atomic"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/encoding"
	protoenc "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// pieces splits b into a BufferSlice of pieces of n bytes (the last one shorter).
func pieces(b []byte, n int) mem.BufferSlice {
	var s mem.BufferSlice
	for len(b) > 0 {
		k := min(len(b), n)
		s = append(s, mem.SliceBuffer(bytes.Clone(b[:k])))
		b = b[k:]
	}
	return s
}

// receive runs the codec on msg, in pieces of n bytes, as a stream counting its body against
// limit with held bytes already counted; it returns the decoded request, the codec's answer and
// the bound after.
func receive(msg []byte, n int, limit, held int64) (*extprocv3.ProcessingRequest, bodyRecv, int64, error) {
	var bound atomic.Int64
	bound.Store(held)
	in := bodyRecv{ProcessingRequest: new(extprocv3.ProcessingRequest), bound: &bound, limit: limit}
	err := newCodec().Unmarshal(pieces(msg, n), &in)
	return in.ProcessingRequest, in, bound.Load(), err
}

// bodyMessage is a buffered request body as Envoy sends it, with metadata around it: protobuf-go
// writes the metadata context before the body, Envoy after it.
func bodyMessage(t testing.TB, body []byte) []byte {
	t.Helper()
	md, err := structpb.NewStruct(map[string]any{"route": "chat"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := proto.Marshal(&extprocv3.ProcessingRequest{
		Request:         &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}},
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.filters.http.router": md}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestCodecCountsBodyBeforeCopying: the codec finds the body in the pieces gRPC received it in,
// wherever they are cut; a body that fits is counted and decoded, one that does not is left
// out of the decoded message, the rest of which is as protobuf decodes it.
func TestCodecCountsBodyBeforeCopying(t *testing.T) {
	body := streamedChat(40 << 10)
	msg := bodyMessage(t, body)
	want := &extprocv3.ProcessingRequest{}
	if err := proto.Unmarshal(msg, want); err != nil {
		t.Fatal(err)
	}
	dropped := proto.Clone(want).(*extprocv3.ProcessingRequest)
	dropped.GetRequestBody().Body = nil
	n := int64(len(body))
	for _, size := range []int{1, 2, 3, 7, 64, 1000, 16 << 10, len(msg)} {
		got, in, bound, err := receive(msg, size, n+10, 10)
		if err != nil || in.count != bodyKept || in.n != n || bound != n+10 || !proto.Equal(got, want) {
			t.Fatalf("pieces of %d, a body that fits: %v, count %d, n %d, bound %d", size, err, in.count, in.n, bound)
		}
		got, in, bound, err = receive(msg, size, n+10, 11)
		if err != nil || in.count != bodyDropped || in.n != n || bound != 11 || !proto.Equal(got, dropped) {
			t.Fatalf("pieces of %d, a body that does not fit: %v, count %d, n %d, bound %d, %v", size, err, in.count, in.n, bound, got)
		}
	}

	// Not a request body, or not one read as it is here: decoded, not counted.
	headers, err := proto.Marshal(requestHeadersMsg())
	if err != nil {
		t.Fatal(err)
	}
	twice := append(bytes.Clone(msg), protowire.AppendTag(nil, fieldRequestBodyIn, protowire.BytesType)...)
	twice = protowire.AppendBytes(twice, protowire.AppendBytes(protowire.AppendTag(nil, fieldBodyIn, protowire.BytesType), []byte("x")))
	for name, m := range map[string][]byte{"request headers": headers, "request_body twice": twice} {
		want := &extprocv3.ProcessingRequest{}
		if err := proto.Unmarshal(m, want); err != nil {
			t.Fatal(err)
		}
		got, in, bound, err := receive(m, 5, 1, 0)
		if err != nil || in.count != bodyUncounted || bound != 0 || !proto.Equal(got, want) {
			t.Errorf("%s: %v, count %d, bound %d", name, err, in.count, bound)
		}
	}
}

func requestHeadersMsg() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":path", RawValue: []byte("/v1/chat/completions")}}}}}}
}

// TestAnyCodecDecodesBodyRecv: a stream receiving into a bodyRecv through gRPC's own codec (a
// server without the server's codec) gets the request, uncounted.
func TestAnyCodecDecodesBodyRecv(t *testing.T) {
	msg := bodyMessage(t, []byte(`{"model":"m"}`))
	in := bodyRecv{ProcessingRequest: new(extprocv3.ProcessingRequest)}
	if err := encoding.GetCodecV2(protoenc.Name).Unmarshal(pieces(msg, 7), &in); err != nil {
		t.Fatal(err)
	}
	if string(in.GetRequestBody().GetBody()) != `{"model":"m"}` || in.count != bodyUncounted {
		t.Errorf("decoded %v, count %d", in.ProcessingRequest, in.count)
	}
}

// FuzzReceiveBody: whatever the message and however it is cut, the codec decodes what protobuf
// decodes (without the body when it drops it), counts exactly the body it keeps, and leaves
// the bound as it was for anything else.
func FuzzReceiveBody(f *testing.F) {
	f.Add(bodyMessage(f, streamedChat(300)), uint16(7), uint16(400), uint16(0))
	f.Add(bodyMessage(f, streamedChat(300)), uint16(16), uint16(400), uint16(200))
	f.Add(bodyMessage(f, nil), uint16(1), uint16(1), uint16(1))
	for _, m := range envoyMessages() {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, uint16(3), uint16(100), uint16(0))
	}
	f.Fuzz(func(t *testing.T, msg []byte, size, limit, held uint16) {
		lim, pre := int64(limit)+1, min(int64(held), int64(limit)+1)
		got, in, bound, err := receive(msg, int(size)+1, lim, pre)
		want := &extprocv3.ProcessingRequest{}
		wantErr := proto.Unmarshal(msg, want)
		if (err == nil) != (wantErr == nil) {
			t.Fatalf("codec %v, protobuf %v: %x", err, wantErr, msg)
		}
		body := int64(len(want.GetRequestBody().GetBody()))
		switch {
		case err != nil:
			if bound != pre {
				t.Fatalf("bound %d after an error, want %d", bound, pre)
			}
			return
		case in.count == bodyKept:
			if in.n != body || bound != pre+body || pre+body > lim {
				t.Fatalf("kept %d of %d, bound %d from %d (limit %d)", in.n, body, bound, pre, lim)
			}
		case in.count == bodyDropped:
			if in.n != body || bound != pre || pre+body <= lim {
				t.Fatalf("dropped %d of %d, bound %d from %d (limit %d)", in.n, body, bound, pre, lim)
			}
			if got.GetRequestBody().GetBody() != nil {
				t.Fatal("a dropped body was decoded")
			}
			want.GetRequestBody().Body = nil
		case bound != pre:
			t.Fatalf("bound %d after an uncounted message, want %d", bound, pre)
		}
		if !proto.Equal(got, want) {
			t.Fatalf("decoded %v\nprotobuf %v\ninput %x", got, want, msg)
		}
	})
}

// BenchmarkReceiveBody: the codec decoding a buffered request body as a stream receives it,
// counted (bodyRecv) and not (ProcessingRequest), for a small and a large body.
func BenchmarkReceiveBody(b *testing.B) {
	for _, size := range []int{1 << 10, 1 << 20} {
		msg := pieces(bodyMessage(b, streamedChat(size)), 16<<10)
		var bound atomic.Int64
		b.Run(fmt.Sprintf("%dKiB/uncounted", size>>10), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if err := newCodec().Unmarshal(msg, new(extprocv3.ProcessingRequest)); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("%dKiB/counted", size>>10), func(b *testing.B) {
			b.ReportAllocs()
			in := new(bodyRecv) // a stream's is part of its processor
			for b.Loop() {
				*in = bodyRecv{ProcessingRequest: new(extprocv3.ProcessingRequest), bound: &bound, limit: 1 << 30}
				if err := newCodec().Unmarshal(msg, in); err != nil || in.count != bodyKept {
					b.Fatal(err)
				}
				bound.Add(-in.n)
			}
		})
	}
}
