package extproc

import (
	"fmt"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	protoenc "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
)

// vtMarshaler is the generated marshalling go-control-plane ships for its messages (and the
// well-known types they embed), compiled in only with the build tag vtprotobuf. It writes a
// message straight to its wire form without protobuf's reflection tables.
type vtMarshaler interface {
	SizeVT() int
	MarshalToSizedBufferVTStrict(dAtA []byte) (int, error)
}

// codec is gRPC's protobuf codec, except that messages with generated marshalling (see
// vtMarshaler) are marshalled by it, and Envoy's requests are decoded by decodeRequest where
// it can. Any other message, and any request decodeRequest leaves, is the default codec's.
type codec struct{ fallback encoding.CodecV2 }

// ServerOption returns the gRPC server option that installs the server's codec. Built without
// the vtprotobuf tag, the codec behaves exactly as gRPC's default one.
func ServerOption() grpc.ServerOption {
	return grpc.ForceServerCodecV2(newCodec())
}

func newCodec() codec {
	return codec{fallback: encoding.GetCodecV2(protoenc.Name)}
}

// FastMarshal reports whether the server's replies are marshalled by generated code (the
// binary was built with -tags vtprotobuf).
func FastMarshal() bool {
	var m any = continueRequestBody
	_, ok := m.(vtMarshaler)
	return ok
}

func (c codec) Name() string { return protoenc.Name }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(vtMarshaler)
	if !ok {
		return c.fallback.Marshal(v)
	}
	size := m.SizeVT()
	if mem.IsBelowBufferPoolingThreshold(size) {
		buf := make([]byte, size)
		if _, err := m.MarshalToSizedBufferVTStrict(buf); err != nil {
			return nil, fmt.Errorf("marshal %T: %w", v, err)
		}
		return mem.BufferSlice{mem.SliceBuffer(buf)}, nil
	}
	pool := mem.DefaultBufferPool()
	buf := pool.Get(size)
	if _, err := m.MarshalToSizedBufferVTStrict(*buf); err != nil {
		pool.Put(buf)
		return nil, fmt.Errorf("marshal %T: %w", v, err)
	}
	return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	if m, ok := v.(*extprocv3.ProcessingRequest); ok && decodeRequest(data.Materialize(), m) {
		return nil
	}
	return c.fallback.Unmarshal(data, v)
}
