package extproc

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	protoenc "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
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
	if r, ok := v.(*extprocv3.ProcessingResponse); ok {
		if bm := largeBodyMutation(r); bm != nil {
			return c.marshalSharingBody(r, bm)
		}
	}
	return c.marshal(v)
}

func (c codec) marshal(v any) (mem.BufferSlice, error) {
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
	switch m := v.(type) {
	case *extprocv3.ProcessingRequest:
		return c.unmarshalRequest(data, m)
	case *bodyRecv:
		return c.receiveBody(data, m)
	}
	return c.fallback.Unmarshal(data, v)
}

func (c codec) unmarshalRequest(data mem.BufferSlice, m *extprocv3.ProcessingRequest) error {
	if decodeRequest(materialize(data), m) {
		return nil
	}
	return c.fallback.Unmarshal(data, m)
}

// Room for the server's edits of a request body (include_usage, a re-route's model name) after
// a large message, so that they are made in place instead of in a copy. Only bodies make a
// message that large; below editRoomFrom a copy costs less than the room would.
const (
	editRoom     = 512
	editRoomFrom = 64 << 10
)

// materialize copies the message data into memory of its own — the one copy of a request body
// the server makes: gRPC's receive buffers go back to its pool when Unmarshal returns — with
// editRoom spare capacity after a large message.
func materialize(data mem.BufferSlice) []byte {
	n := data.Len()
	if n == 0 {
		return nil
	}
	room := 0
	if n >= editRoomFrom {
		room = editRoom
	}
	b := make([]byte, n, n+room)
	data.CopyTo(b)
	return b
}

// shareBodyFrom is the size from which a reply's replacement request body is sent from where it
// is rather than copied into the marshalled reply: a buffered body of several MiB would
// otherwise be held twice (and the copy kept in gRPC's buffer pool) for each request in flight.
const shareBodyFrom = 64 << 10

// largeBodyMutation returns the body mutation of a request-body reply whose replacement body is
// at least shareBodyFrom bytes, else nil.
func largeBodyMutation(r *extprocv3.ProcessingResponse) *extprocv3.BodyMutation {
	rb, ok := r.Response.(*extprocv3.ProcessingResponse_RequestBody)
	if !ok {
		return nil
	}
	bm := rb.RequestBody.GetResponse().GetBodyMutation()
	if len(bm.GetBody()) < shareBodyFrom {
		return nil
	}
	return bm
}

// Field numbers on the path from a reply to its replacement body.
var (
	fieldRequestBody  = fieldNumber(&extprocv3.ProcessingResponse{}, "request_body")
	fieldResponse     = fieldNumber(&extprocv3.BodyResponse{}, "response")
	fieldBodyMutation = fieldNumber(&extprocv3.CommonResponse{}, "body_mutation")
	fieldBody         = fieldNumber(&extprocv3.BodyMutation{}, "body")
)

func fieldNumber(m proto.Message, name protoreflect.Name) protowire.Number {
	f := m.ProtoReflect().Descriptor().Fields().ByName(name)
	if f == nil {
		panic(fmt.Sprintf("%T has no field %s", m, name))
	}
	return f.Number()
}

// marshalSharingBody marshals r, whose body mutation bm holds a large body, without copying the
// body: the result is r marshalled without the body, then a second encoding of the reply that
// holds only request_body.response.body_mutation.body, whose bytes are the body itself.
// Protobuf merges a message field that occurs twice (Envoy's parser, like every other, does),
// so the two read as r. gRPC writes the pieces in order and frees them once written; the body
// must not change until then, and does not: the request it came with is over for the server.
// Freeing the body's piece gives back the bytes a bodyHold counts for it.
//
// r is the stream's own reply, marshalled inside Send on the stream's goroutine: its body
// mutation is taken out while the rest is marshalled and put back after.
func (c codec) marshalSharingBody(r *extprocv3.ProcessingResponse, bm *extprocv3.BodyMutation) (mem.BufferSlice, error) {
	mutation := bm.Mutation
	body := bm.GetBody()
	bm.Mutation = nil
	head, err := c.marshal(r)
	bm.Mutation = mutation
	if err != nil {
		return nil, err
	}
	// The sizes of the nested messages, inside out: the body mutation's body field, the body
	// mutation, the common response, the body response; then each one's tag and size,
	// outermost first.
	path := [...]protowire.Number{fieldBody, fieldBodyMutation, fieldResponse, fieldRequestBody}
	var sizes [len(path)]int
	n := len(body)
	for i, num := range path {
		sizes[i] = n
		n += protowire.SizeTag(num) + protowire.SizeVarint(uint64(n))
	}
	prefix := make([]byte, 0, n-len(body))
	for i := len(path) - 1; i >= 0; i-- {
		prefix = protowire.AppendTag(prefix, path[i], protowire.BytesType)
		prefix = protowire.AppendVarint(prefix, uint64(sizes[i]))
	}
	return append(head, mem.SliceBuffer(prefix), bodyBuffer(body)), nil
}

// bodyHold counts a request body's bytes against server.max_buffered_body_bytes while gRPC
// sends them from where they are (marshalSharingBody): it is the pool of the body's gRPC buffer,
// to which gRPC gives the buffer back once written, releasing the bytes; the stream gives them
// back at its end at the latest. Safe for concurrent use.
type bodyHold struct {
	srv *Server
	// key is the address of the body's first byte: not a reference, which would keep the body
	// for as long as the stream keeps the hold. It names the body only while the reply that
	// holds the body is alive (until the stream is done with its Send).
	key uintptr
	n   atomic.Int64
	// listed: the stream has not yet looked whether the codec took the hold out of bodyHolds
	// (the stream's goroutine only).
	listed bool
}

var _ mem.BufferPool = (*bodyHold)(nil)

// bodyHolds holds each bodyHold from the moment its reply is built until the codec marshals
// it (or the stream finds it was not), keyed by the address of the body's first byte.
var bodyHolds sync.Map

// release gives the bytes back, once.
func (h *bodyHold) release() {
	if n := h.n.Swap(0); n != 0 {
		h.srv.buffered.Add(-n)
	}
}

// Get is never called for the one buffer a bodyHold is the pool of; it allocates.
func (h *bodyHold) Get(length int) *[]byte {
	b := make([]byte, length)
	return &b
}

// Put is gRPC giving the body's buffer back: the body has been written.
func (h *bodyHold) Put(*[]byte) { h.release() }

// bodyBuffer is body as a gRPC buffer: one whose release gives back the bytes a bodyHold counts
// for it, when there is one.
func bodyBuffer(body []byte) mem.Buffer {
	h, ok := bodyHolds.LoadAndDelete(uintptr(unsafe.Pointer(unsafe.SliceData(body))))
	if !ok {
		return mem.SliceBuffer(body)
	}
	return mem.NewBuffer(&body, h.(*bodyHold))
}
