package extproc

import (
	"sync/atomic"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
)

// A buffered request body is counted against server.max_buffered_body_bytes as it arrives, in
// the codec, before it is copied out of gRPC's receive buffers: a body that does not fit is
// never copied, so the bytes of a refused body are only the receive buffers it arrived in,
// which go back to gRPC's pool as soon as the codec returns.
//
// The stream asks for it by receiving into a bodyRecv instead of a ProcessingRequest, only when
// it would hold the body (its request waits for a BUFFERED request body) and only on a server
// whose codec counts (Server.ServerOption); any other codec decodes a bodyRecv as the request
// it embeds, and the stream then counts the decoded body as before.

// ServerOption returns the gRPC server option that installs the server's codec (see the
// package's ServerOption) and has s's streams count each buffered request body in it, before
// the body is copied: one that does not fit server.max_buffered_body_bytes is refused with
// server_busy without ever being copied. Serve s only from gRPC servers made with it; call it
// before serving.
func (s *Server) ServerOption() grpc.ServerOption {
	s.countInCodec.Store(true)
	return ServerOption()
}

// bodyCount says what the codec did with the request body of the message a stream received.
type bodyCount uint8

const (
	// bodyUncounted: the codec did not count a body (the stream did not ask it to, the message
	// carries no request body, or the codec is not the server's): the stream counts it.
	bodyUncounted bodyCount = iota
	// bodyKept: the body fitted the bound; its bytes are counted and it was decoded.
	bodyKept
	// bodyDropped: the body did not fit the bound; it was not copied, and the message was
	// decoded without it.
	bodyDropped
)

// bodyRecv is what a stream receives a message into to have its request body counted as it
// arrives. It is the ProcessingRequest it embeds to any codec (its ProtoReflect is the
// request's); the server's codec recognises it.
type bodyRecv struct {
	*extprocv3.ProcessingRequest
	// bound is Server.buffered and limit server.max_buffered_body_bytes (above 0).
	bound *atomic.Int64
	limit int64
	// count and n are the codec's answer: what it did with the body, and the body's size.
	count bodyCount
	n     int64
}

// takeBody counts n bytes against limit (above 0) in bound, or reports that they would pass
// it, counting nothing.
func takeBody(bound *atomic.Int64, limit, n int64) bool {
	if bound.Add(n) > limit {
		bound.Add(-n)
		return false
	}
	return true
}

// recv receives the stream's next message. When the stream would hold the request body the
// message may carry and the server's codec counts bodies, it receives into p.in: the body
// arrives counted (heldBody) or dropped (see onRequestBody).
func (p *processor) recv() (*extprocv3.ProcessingRequest, error) {
	p.req.counted = bodyUncounted
	if !p.holdsBody() || !p.srv.countInCodec.Load() {
		return p.stream.Recv()
	}
	limit := p.srv.settingsOf(p.snap).MaxBufferedBodyBytes
	if limit <= 0 {
		return p.stream.Recv()
	}
	in := &p.in
	*in = bodyRecv{ProcessingRequest: new(extprocv3.ProcessingRequest), bound: &p.srv.buffered, limit: limit}
	err := p.stream.RecvMsg(in)
	req, counted, n := in.ProcessingRequest, in.count, in.n
	*in = bodyRecv{}
	if counted == bodyKept {
		if err != nil {
			// Decoded, then failed on the way up (a stream wrapper): nothing will hold it.
			p.srv.buffered.Add(-n)
			return nil, err
		}
		p.req.heldBody += n
	}
	if err != nil {
		return nil, err
	}
	p.req.counted = counted
	return req, nil
}

// receiveBody decodes data into in's request, counting the request body it carries against
// in's bound first; a body that does not fit is not copied, and the rest of the message is
// decoded without it. A message that carries no request body, or one whose encoding the
// codec would not decode as it reads it here, is decoded uncounted.
func (c codec) receiveBody(data mem.BufferSlice, in *bodyRecv) error {
	m := in.ProcessingRequest
	total := data.Len()
	s, ok := findRequestBody(data, total)
	if !ok {
		return c.unmarshalRequest(data, m)
	}
	n := int64(s.end - s.start)
	if !takeBody(in.bound, in.limit, n) {
		in.count, in.n = bodyDropped, n
		return c.unmarshalRequest(mem.BufferSlice{mem.SliceBuffer(s.without(data, total))}, m)
	}
	if err := c.unmarshalRequest(data, m); err != nil {
		in.bound.Add(-n)
		return err
	}
	if int64(len(m.GetRequestBody().GetBody())) != n {
		// Decoded otherwise than found (protobuf merged what it found twice): the stream counts
		// what it got.
		in.bound.Add(-n)
		return nil
	}
	in.count, in.n = bodyKept, n
	return nil
}

// bodySpan is where a request body lies in a ProcessingRequest's wire form: offsets of the
// request_body field (its tag, its content, its end) and of the body field inside it (its tag,
// its bytes). A request_body without a body has its body field empty at the content's start.
type bodySpan struct {
	member, content, memberEnd int
	field, start, end          int
}

// findRequestBody finds the request body in data, a ProcessingRequest's wire form of total
// bytes, without copying it. It reports false unless the message is a request_body message
// read as every decoder reads it: request_body once and no other member of the oneof, the body
// at most once, every field well formed.
func findRequestBody(data mem.BufferSlice, total int) (s bodySpan, ok bool) {
	w := newWireReader(data)
	found := false
	for w.off < total {
		start := w.off
		num, typ, ok := w.tag()
		if !ok {
			return s, false
		}
		if typ != protowire.BytesType {
			if !w.skipValue(typ, total) {
				return s, false
			}
			continue
		}
		size, ok := w.size(total)
		if !ok {
			return s, false
		}
		if num < fieldFirstMember || num > fieldLastMember {
			w.skip(size)
			continue
		}
		if num != fieldRequestBodyIn || found {
			return s, false
		}
		found = true
		s.member, s.content, s.memberEnd = start, w.off, w.off+size
		if !findBody(&w, &s) {
			return s, false
		}
	}
	return s, found
}

// findBody finds the body field in the HttpBody from s.content to s.memberEnd, w at its start.
func findBody(w *wireReader, s *bodySpan) bool {
	s.field, s.start, s.end = s.content, s.content, s.content
	seen := false
	for w.off < s.memberEnd {
		start := w.off
		num, typ, ok := w.tag()
		if !ok {
			return false
		}
		if num != fieldBodyIn {
			if !w.skipValue(typ, s.memberEnd) {
				return false
			}
			continue
		}
		if typ != protowire.BytesType || seen {
			return false
		}
		seen = true
		size, ok := w.size(s.memberEnd)
		if !ok {
			return false
		}
		s.field, s.start, s.end = start, w.off, w.off+size
		w.skip(size)
	}
	return w.off == s.memberEnd
}

// without returns the message of total bytes in data without its request body: the fields
// before and after request_body, then request_body with everything but the body.
func (s bodySpan) without(data mem.BufferSlice, total int) []byte {
	inner := (s.memberEnd - s.content) - (s.end - s.field)
	out := make([]byte, 0, total-(s.memberEnd-s.member)+protowire.SizeTag(fieldRequestBodyIn)+protowire.SizeVarint(uint64(inner))+inner)
	out = appendRange(out, data, 0, s.member)
	out = appendRange(out, data, s.memberEnd, total)
	out = protowire.AppendTag(out, fieldRequestBodyIn, protowire.BytesType)
	out = protowire.AppendVarint(out, uint64(inner))
	out = appendRange(out, data, s.content, s.field)
	return appendRange(out, data, s.end, s.memberEnd)
}

// appendRange appends bytes from to to of the message in data to out.
func appendRange(out []byte, data mem.BufferSlice, from, to int) []byte {
	off := 0
	for _, buf := range data {
		b := buf.ReadOnlyData()
		lo, hi := max(from-off, 0), min(to-off, len(b))
		if lo < hi {
			out = append(out, b[lo:hi]...)
		}
		off += len(b)
		if off >= to {
			break
		}
	}
	return out
}

// wireReader reads a message in the pieces gRPC received it in (one per HTTP/2 DATA frame),
// without copying them.
type wireReader struct {
	data mem.BufferSlice
	// next is the index of the piece after b; b is what is left of the current one, and off
	// the offset of b's first byte in the message.
	next int
	b    []byte
	off  int
}

func newWireReader(data mem.BufferSlice) wireReader {
	w := wireReader{data: data}
	w.fill()
	return w
}

// fill moves b to the next piece with bytes when b is empty.
func (w *wireReader) fill() {
	for len(w.b) == 0 && w.next < len(w.data) {
		w.b = w.data[w.next].ReadOnlyData()
		w.next++
	}
}

// varint reads a varint, as protowire.ConsumeVarint does across pieces.
func (w *wireReader) varint() (uint64, bool) {
	if len(w.b) >= protowire.SizeVarint(1<<63) {
		v, n := protowire.ConsumeVarint(w.b)
		if n < 0 {
			return 0, false
		}
		w.skip(n)
		return v, true
	}
	var buf [10]byte
	n := 0
	for n < len(buf) {
		w.fill()
		if len(w.b) == 0 {
			break
		}
		buf[n] = w.b[0]
		n++
		w.skip(1)
		if buf[n-1] < 0x80 {
			break
		}
	}
	v, m := protowire.ConsumeVarint(buf[:n])
	return v, m == n && m > 0
}

// tag reads a field's tag.
func (w *wireReader) tag() (protowire.Number, protowire.Type, bool) {
	v, ok := w.varint()
	num, typ := protowire.DecodeTag(v)
	return num, typ, ok && v>>3 <= uint64(protowire.MaxValidNumber) && num >= protowire.MinValidNumber
}

// size reads a length-delimited field's length, which must end by limit.
func (w *wireReader) size(limit int) (int, bool) {
	v, ok := w.varint()
	if !ok || w.off > limit || v > uint64(limit-w.off) {
		return 0, false
	}
	return int(v), true
}

// skipValue skips a value of type typ in a message that ends at limit; groups are not read.
func (w *wireReader) skipValue(typ protowire.Type, limit int) bool {
	switch typ {
	case protowire.VarintType:
		_, ok := w.varint()
		return ok
	case protowire.Fixed32Type:
		return w.skip(4)
	case protowire.Fixed64Type:
		return w.skip(8)
	case protowire.BytesType:
		n, ok := w.size(limit)
		return ok && w.skip(n)
	}
	return false
}

// skip moves n bytes on, reporting false when the message has fewer.
func (w *wireReader) skip(n int) bool {
	for n > 0 {
		w.fill()
		if len(w.b) == 0 {
			return false
		}
		k := min(n, len(w.b))
		w.b, w.off, n = w.b[k:], w.off+k, n-k
	}
	w.fill()
	return true
}
