package mock

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws/protocol/eventstream"
)

// errDisconnected reports that a response was cut on purpose by a
// disconnect fault.
var errDisconnected = errors.New("connection closed by an injected disconnect")

// Content types the real APIs answer with.
const (
	contentTypeJSON        = "application/json"
	contentTypeSSE         = "text/event-stream; charset=utf-8"
	contentTypeEventStream = "application/vnd.amazon.eventstream"
)

// framing is how the events of a stream are written.
type framing uint8

const (
	// framingSSE writes server-sent events ("event: name\ndata: {...}\n\n").
	framingSSE framing = iota
	// framingArray writes a JSON array, one element per event, as Gemini's
	// streamGenerateContent answers without alt=sse: "[{...},\r\n{...}]".
	framingArray
	// framingAWS writes AWS's binary event stream, as Bedrock's ConverseStream and
	// InvokeModelWithResponseStream answer: one message per event, named by its
	// :event-type (or :exception-type for an exception), its payload the event's JSON.
	framingAWS
)

// output writes one response: optionally gzipped, flushed event by event,
// and cut short when a disconnect fault says so. It belongs to one handler
// goroutine and is not safe for concurrent use.
type output struct {
	w  http.ResponseWriter
	rc *http.ResponseController
	gz *gzip.Writer
	// limit is the injected disconnect-after count; zero means never.
	limit   int
	events  int
	status  int
	framing framing
	enc     *eventstream.Encoder // framingAWS only
}

// newOutput prepares a response on w.
func newOutput(w http.ResponseWriter, gzipBody bool, disconnectAfter int) *output {
	o := &output{w: w, rc: http.NewResponseController(w), limit: disconnectAfter}
	if gzipBody {
		o.gz = gzip.NewWriter(w)
	}
	return o
}

// start sends the status line and headers. contentLength is the length of
// the uncompressed body, or -1 when unknown (streams).
func (o *output) start(status int, contentType string, contentLength int) {
	h := o.w.Header()
	h.Set("Content-Type", contentType)
	if o.gz != nil {
		h.Set("Content-Encoding", "gzip")
		h.Add("Vary", "Accept-Encoding")
		h.Del("Content-Length")
	} else if contentLength >= 0 {
		h.Set("Content-Length", strconv.Itoa(contentLength))
	}
	if contentType == contentTypeSSE {
		h.Set("Cache-Control", "no-cache")
	}
	o.status = status
	o.w.WriteHeader(status)
}

// write sends body bytes, compressed if asked.
func (o *output) write(p []byte) error {
	var err error
	if o.gz != nil {
		_, err = o.gz.Write(p)
	} else {
		_, err = o.w.Write(p)
	}
	return err
}

// flush pushes everything written so far to the client, so each SSE event
// leaves when the latency model says it should.
func (o *output) flush() error {
	if o.gz != nil {
		if err := o.gz.Flush(); err != nil {
			return err
		}
	}
	if err := o.rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return err
	}
	return nil
}

// endStream closes a stream that was sent in full: a JSON array's ']' and
// the gzip trailer, if any.
func (o *output) endStream() error {
	if o.framing == framingArray {
		end := "]"
		if o.events == 0 {
			end = "[]"
		}
		if err := o.write([]byte(end)); err != nil {
			return err
		}
	}
	return o.finish()
}

// finish completes the body (the gzip trailer, if any).
func (o *output) finish() error {
	if o.gz != nil {
		return o.gz.Close()
	}
	return nil
}

// abort flushes what was written and closes the connection without ending
// the body, as a provider crashing mid-response does: the client sees an
// unexpected EOF. Where the connection cannot be taken over (HTTP/2, test
// recorders) the body simply ends early. It always returns errDisconnected.
func (o *output) abort() error {
	if err := o.flush(); err != nil {
		return errors.Join(errDisconnected, err)
	}
	conn, _, err := o.rc.Hijack()
	if err != nil {
		return errors.Join(errDisconnected, fmt.Errorf("cannot take over the connection: %w", err))
	}
	return errors.Join(errDisconnected, conn.Close())
}

// json sends a whole JSON body. A disconnect fault cuts it after half, with
// Content-Length promising the whole.
func (o *output) json(status int, body []byte) error {
	o.start(status, contentTypeJSON, len(body))
	return o.body(body)
}

// body sends the whole body of a response whose headers went out with
// start, cut after half under a disconnect fault.
func (o *output) body(body []byte) error {
	if o.limit > 0 {
		if err := o.write(body[:len(body)/2]); err != nil {
			return err
		}
		return o.abort()
	}
	if err := o.write(body); err != nil {
		return err
	}
	return o.finish()
}

// setFraming chooses how the events of a stream are written.
func (o *output) setFraming(f framing) {
	o.framing = f
	if f == framingAWS && o.enc == nil {
		o.enc = eventstream.NewEncoder()
	}
}

// streamContentType is the content type of a stream in o's framing.
func (o *output) streamContentType() string {
	switch o.framing {
	case framingArray:
		return contentTypeJSON
	case framingAWS:
		return contentTypeEventStream
	}
	return contentTypeSSE
}

// event sends one event of a stream in o's framing (an SSE event's name may
// be empty for OpenAI's data-only events) and flushes it. Under a disconnect
// fault, once limit events were sent, or at the final event whatever the
// count, it closes the connection instead and returns errDisconnected.
func (o *output) event(ev sseEvent, final bool) error {
	if o.limit > 0 && (final || o.events >= o.limit) {
		return o.abort()
	}
	var buf bytes.Buffer
	buf.Grow(len(ev.name) + len(ev.data) + 16)
	switch o.framing {
	case framingArray:
		if o.events == 0 {
			buf.WriteByte('[')
		} else {
			buf.WriteString(",\r\n")
		}
		buf.Write(ev.data)
	case framingAWS:
		var h eventstream.Headers
		if ev.exception {
			h.Set(":message-type", eventstream.StringValue("exception"))
			h.Set(":exception-type", eventstream.StringValue(ev.name))
		} else {
			h.Set(":message-type", eventstream.StringValue("event"))
			h.Set(":event-type", eventstream.StringValue(ev.name))
		}
		h.Set(":content-type", eventstream.StringValue(contentTypeJSON))
		if err := o.enc.Encode(&buf, eventstream.Message{Headers: h, Payload: ev.data}); err != nil {
			return fmt.Errorf("encoding an event-stream message: %w", err)
		}
	default:
		if ev.name != "" {
			buf.WriteString("event: ")
			buf.WriteString(ev.name)
			buf.WriteByte('\n')
		}
		buf.WriteString("data: ")
		buf.Write(ev.data)
		buf.WriteString("\n\n")
	}
	if err := o.write(buf.Bytes()); err != nil {
		return err
	}
	o.events++
	return o.flush()
}

// sleepUntil waits until deadline or until ctx ends (the client left, or the
// server is shutting down), whichever is first. Deadlines are absolute so
// timer overshoot on one chunk does not push every later chunk back.
func sleepUntil(ctx context.Context, deadline time.Time) error {
	d := time.Until(deadline)
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
