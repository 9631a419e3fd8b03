package extproc

import (
	"unicode/utf8"
	"unsafe"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// Field numbers of ProcessingRequest's request oneof (request_headers … response_trailers), its
// request_body, and HttpBody's body, for the decoders of the wire form (decodeRequest and the
// codec's findRequestBody).
const (
	fieldFirstMember   = 2
	fieldLastMember    = 7
	fieldRequestBodyIn = 4
	fieldBodyIn        = 1
)

// decodeRequest decodes the ProcessingRequest messages Envoy sends on every stream — headers,
// bodies and trailers with the metadata context Envoy adds to each, and the protocol
// configuration and observability flag of the first message — into m, which must be new. It
// reports false for anything else: a field it does not decode (attributes, flow control, an
// unknown field), a field repeated where protobuf would merge or replace, a malformed or
// invalid message. The caller then decodes with protobuf, which resets m and gives the same
// message or the error.
//
// It exists for speed: protobuf's reflective decoder allocates every header separately and
// copies every string; here the message is copied once into b (which the caller hands over:
// it must not be written afterwards), strings and bytes point into it, each message is one
// allocation with its oneof wrapper, and each header list one more. Decoding Envoy's messages
// is a large share of a stream's CPU in every ext_proc server. FuzzDecodeRequest checks it
// against protobuf's decoder.
func decodeRequest(b []byte, m *extprocv3.ProcessingRequest) bool {
	return eachField(b, func(num protowire.Number, typ protowire.Type, field []byte, v uint64) bool {
		if num == 10 { // observability_mode
			m.ObservabilityMode = v != 0
			return typ == protowire.VarintType
		}
		if typ != protowire.BytesType {
			return false
		}
		if num >= fieldFirstMember && num <= fieldLastMember && m.Request != nil {
			return false // a second member of the request oneof replaces the first: protobuf's to do
		}
		switch num {
		case 2, 3:
			x := new(headersMember)
			return decodeHeaders(field, x.attach(m, num == 2), &x.headers)
		case fieldRequestBodyIn, 5:
			request := num == fieldRequestBodyIn
			return decodeBody(field, new(bodyMember).attach(m, request), request)
		case 6, 7:
			x := new(trailersMember)
			return decodeTrailers(field, x.attach(m, num == 6), &x.trailers)
		case 8:
			m.MetadataContext = new(corev3.Metadata)
			return decodeMetadata(field, m.MetadataContext)
		case 11:
			m.ProtocolConfig = new(extprocv3.ProtocolConfiguration)
			return decodeProtocol(field, m.ProtocolConfig)
		}
		return false
	})
}

// eachField calls f with each field of the message b: its number, wire type, and its bytes
// (length-delimited) or value (varint). It reports false when f does, and for a field it
// cannot read, of another wire type, or seen before: a repeated singular field, which
// protobuf merges or replaces, is left to protobuf.
func eachField(b []byte, f func(num protowire.Number, typ protowire.Type, field []byte, v uint64) bool) bool {
	var seen fieldSet
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || !seen.add(num) {
			return false
		}
		b = b[n:]
		var field []byte
		var v uint64
		switch typ {
		case protowire.VarintType:
			v, n = protowire.ConsumeVarint(b)
		case protowire.BytesType:
			field, n = protowire.ConsumeBytes(b)
		default:
			return false
		}
		if n < 0 || !f(num, typ, field, v) {
			return false
		}
		b = b[n:]
	}
	return true
}

// fieldSet records which field numbers below 64 a message has had; any larger number is left
// to protobuf.
type fieldSet uint64

func (s *fieldSet) add(num protowire.Number) bool {
	if num >= 64 || *s&(1<<num) != 0 {
		return false
	}
	*s |= 1 << num
	return true
}

// nestedLimit is the recursion limit for protobuf decoding a field of the request on its own:
// one level less than the request's, so that the depth at which protobuf refuses a message is
// the same as when it decodes the whole request.
const nestedLimit = protowire.DefaultRecursionLimit - 1

// decodeMetadata decodes the metadata_context Envoy sends with every message: empty unless the
// filter forwards namespaces of its dynamic metadata, whose Structs protobuf decodes.
func decodeMetadata(b []byte, md *corev3.Metadata) bool {
	return len(b) == 0 || (proto.UnmarshalOptions{RecursionLimit: nestedLimit}).Unmarshal(b, md) == nil
}

// Each member of the request oneof is allocated at once with its message, its header map and
// the wrapper of either direction (one of them unused).
type (
	headersMember struct {
		request  extprocv3.ProcessingRequest_RequestHeaders
		response extprocv3.ProcessingRequest_ResponseHeaders
		msg      extprocv3.HttpHeaders
		headers  corev3.HeaderMap
	}
	bodyMember struct {
		request  extprocv3.ProcessingRequest_RequestBody
		response extprocv3.ProcessingRequest_ResponseBody
		msg      extprocv3.HttpBody
	}
	trailersMember struct {
		request  extprocv3.ProcessingRequest_RequestTrailers
		response extprocv3.ProcessingRequest_ResponseTrailers
		msg      extprocv3.HttpTrailers
		trailers corev3.HeaderMap
	}
)

// attach makes x's message m's request member, the request's or the response's, and
// returns it.
func (x *headersMember) attach(m *extprocv3.ProcessingRequest, request bool) *extprocv3.HttpHeaders {
	x.request.RequestHeaders, x.response.ResponseHeaders, m.Request = &x.msg, &x.msg, &x.response
	if request {
		m.Request = &x.request
	}
	return &x.msg
}

func (x *bodyMember) attach(m *extprocv3.ProcessingRequest, request bool) *extprocv3.HttpBody {
	x.request.RequestBody, x.response.ResponseBody, m.Request = &x.msg, &x.msg, &x.response
	if request {
		m.Request = &x.request
	}
	return &x.msg
}

func (x *trailersMember) attach(m *extprocv3.ProcessingRequest, request bool) *extprocv3.HttpTrailers {
	x.request.RequestTrailers, x.response.ResponseTrailers, m.Request = &x.msg, &x.msg, &x.response
	if request {
		m.Request = &x.request
	}
	return &x.msg
}

// decodeHeaders decodes an HttpHeaders message into h, its header map (if it has one) into
// hm: the header map and end_of_stream, not attributes.
func decodeHeaders(b []byte, h *extprocv3.HttpHeaders, hm *corev3.HeaderMap) bool {
	return eachField(b, func(num protowire.Number, typ protowire.Type, field []byte, v uint64) bool {
		switch {
		case num == 1 && typ == protowire.BytesType:
			h.Headers = hm
			return decodeHeaderMap(field, hm)
		case num == 3 && typ == protowire.VarintType:
			h.EndOfStream = v != 0
			return true
		}
		return false
	})
}

// decodeHeaderMap decodes a HeaderMap into hm, all its headers in one allocation.
func decodeHeaderMap(b []byte, hm *corev3.HeaderMap) bool {
	count := 0
	for rest := b; len(rest) > 0; {
		num, typ, n := protowire.ConsumeTag(rest)
		if n < 0 || num != 1 || typ != protowire.BytesType {
			return false
		}
		_, m := protowire.ConsumeBytes(rest[n:])
		if m < 0 {
			return false
		}
		rest = rest[n+m:]
		count++
	}
	if count == 0 {
		return true
	}
	vals := make([]corev3.HeaderValue, count)
	hm.Headers = make([]*corev3.HeaderValue, count)
	for i := range vals {
		_, _, n := protowire.ConsumeTag(b)
		field, m := protowire.ConsumeBytes(b[n:])
		b = b[n+m:]
		if !decodeHeaderValue(field, &vals[i]) {
			return false
		}
		hm.Headers[i] = &vals[i]
	}
	return true
}

func decodeHeaderValue(b []byte, h *corev3.HeaderValue) bool {
	return eachField(b, func(num protowire.Number, typ protowire.Type, field []byte, _ uint64) bool {
		if typ != protowire.BytesType {
			return false
		}
		switch num {
		case 1, 2: // key, value: proto3 strings, which must be UTF-8
			if !utf8.Valid(field) {
				return false
			}
			s := ""
			if len(field) > 0 {
				s = unsafe.String(unsafe.SliceData(field), len(field))
			}
			if num == 1 {
				h.Key = s
			} else {
				h.Value = s
			}
			return true
		case 3: // raw_value
			h.RawValue = alias(field)
			return true
		}
		return false
	})
}

// decodeBody decodes an HttpBody message into body: the body and its four flags. A request
// body keeps the capacity of the message's memory after it (room, see codec.Unmarshal): once
// the message is decoded nothing else refers to those bytes (the metadata that may follow is
// decoded by protobuf, which copies), so the server may rewrite the body in place.
func decodeBody(b []byte, body *extprocv3.HttpBody, room bool) bool {
	return eachField(b, func(num protowire.Number, typ protowire.Type, field []byte, v uint64) bool {
		if num == fieldBodyIn {
			body.Body = alias(field)
			if room && len(field) > 0 {
				body.Body = field
			}
			return typ == protowire.BytesType
		}
		if typ != protowire.VarintType {
			return false
		}
		switch num {
		case 2:
			body.EndOfStream = v != 0
		case 3:
			body.EndOfStreamWithoutMessage = v != 0
		case 4:
			body.GrpcMessageCompressed = v != 0
		case 5:
			body.DrainComplete = v != 0
		default:
			return false
		}
		return true
	})
}

// decodeTrailers decodes an HttpTrailers message into t, its header map into hm.
func decodeTrailers(b []byte, t *extprocv3.HttpTrailers, hm *corev3.HeaderMap) bool {
	return eachField(b, func(num protowire.Number, typ protowire.Type, field []byte, _ uint64) bool {
		t.Trailers = hm
		return num == 1 && typ == protowire.BytesType && decodeHeaderMap(field, hm)
	})
}

// decodeProtocol decodes the ProtocolConfiguration Envoy sends with a stream's first message.
func decodeProtocol(b []byte, pc *extprocv3.ProtocolConfiguration) bool {
	return eachField(b, func(num protowire.Number, typ protowire.Type, _ []byte, v uint64) bool {
		if typ != protowire.VarintType {
			return false
		}
		switch num {
		case 1:
			pc.RequestBodyMode = extprocfilterv3.ProcessingMode_BodySendMode(int32(v))
		case 2:
			pc.ResponseBodyMode = extprocfilterv3.ProcessingMode_BodySendMode(int32(v))
		case 3:
			pc.SendBodyWithoutWaitingForHeaderResponse = v != 0
		default:
			return false
		}
		return true
	})
}

// alias returns field itself, capped so that an append copies instead of writing over what
// follows it in the message; an empty field is nil, as protobuf decodes it.
func alias(field []byte) []byte {
	if len(field) == 0 {
		return nil
	}
	return field[:len(field):len(field)]
}
