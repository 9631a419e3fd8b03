package llmapi

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/aws/aws-sdk-go-v2/aws/protocol/eventstream"
)

// ErrCorruptEventStream means an AWS event stream could not be decoded (a checksum or length
// that does not add up); what was decoded before the problem still counts, nothing after it
// is read. The error wraps the decoder's own.
var ErrCorruptEventStream = errors.New("llmapi: corrupt AWS event stream")

// maxAWSMessage bounds the event-stream message gathered for decoding. Bedrock's events are
// at most a few kilobytes; a longer message is passed over, its bytes counted, unread.
const maxAWSMessage = 256 << 10

// awsEvents splits AWS's binary event stream (application/vnd.amazon.eventstream, as
// Bedrock's ConverseStream and InvokeModelWithResponseStream answer) into messages as the
// bytes arrive, split anywhere: each message's prelude gives its length, its bytes are
// gathered (at most maxAWSMessage; the buffer is kept for the next response) and decoded,
// checksums included, by the AWS SDK's decoder.
type awsEvents struct {
	buf     []byte
	need    int // the current message's length once its prelude is in buf; 0 before
	skip    int // bytes of an oversized message still to pass over
	payload []byte
	dec     eventstream.Decoder
	err     error
}

// awsSink receives decoded messages.
type awsSink interface {
	// awsEvent takes an event's type (":event-type") and payload.
	awsEvent(typ, payload []byte)
	// awsException takes an exception's or error's type (":exception-type" or ":error-code").
	awsException(typ []byte)
}

// reset prepares for a new body, keeping the buffers.
func (a *awsEvents) reset() {
	*a = awsEvents{buf: a.buf[:0], payload: a.payload[:0]}
}

// feed consumes the next piece of the body.
func (a *awsEvents) feed(p []byte, sink awsSink) {
	for len(p) > 0 && a.err == nil {
		if a.skip > 0 {
			n := min(a.skip, len(p))
			a.skip -= n
			p = p[n:]
			continue
		}
		if a.need == 0 {
			n := min(4-len(a.buf), len(p))
			a.buf = append(a.buf, p[:n]...)
			p = p[n:]
			if len(a.buf) < 4 {
				return
			}
			total := int(binary.BigEndian.Uint32(a.buf))
			switch {
			case total < 16:
				a.err = fmt.Errorf("%w: a message of %d bytes", ErrCorruptEventStream, total)
				return
			case total > maxAWSMessage:
				a.buf, a.skip = a.buf[:0], total-4
				continue
			}
			a.need = total
		}
		n := min(a.need-len(a.buf), len(p))
		a.buf = append(a.buf, p[:n]...)
		p = p[n:]
		if len(a.buf) < a.need {
			return
		}
		a.message(sink)
		a.buf, a.need = a.buf[:0], 0
	}
}

// message decodes the whole message in buf and hands it to sink.
func (a *awsEvents) message(sink awsSink) {
	m, err := a.dec.Decode(bytes.NewReader(a.buf), a.payload[:0])
	if err != nil {
		a.err = fmt.Errorf("%w: %w", ErrCorruptEventStream, err)
		return
	}
	a.payload = m.Payload[:0]
	switch headerString(m.Headers, ":message-type") {
	case "event", "":
		sink.awsEvent([]byte(headerString(m.Headers, ":event-type")), m.Payload)
	case "exception":
		sink.awsException([]byte(headerString(m.Headers, ":exception-type")))
	case "error":
		sink.awsException([]byte(headerString(m.Headers, ":error-code")))
	}
}

// headerString returns a string header's value, or "".
func headerString(h eventstream.Headers, name string) string {
	if v, ok := h.Get(name).(eventstream.StringValue); ok {
		return string(v)
	}
	return ""
}

// invokeChunk returns the Anthropic event an InvokeModelWithResponseStream chunk carries:
// the base64 "bytes" of its payload, decoded into dst.
func invokeChunk(dst, payload []byte) ([]byte, bool) {
	enc, ok := Field(payload, "bytes")
	if !ok {
		return dst, false
	}
	n := base64.StdEncoding.DecodedLen(len(enc))
	if cap(dst) < n {
		dst = make([]byte, n)
	}
	dst = dst[:n]
	n, err := base64.StdEncoding.Decode(dst, []byte(enc))
	return dst[:n], err == nil
}
