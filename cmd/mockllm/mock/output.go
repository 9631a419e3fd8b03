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
)

// errDisconnected reports that a response was cut on purpose by a
// disconnect fault.
var errDisconnected = errors.New("connection closed by an injected disconnect")

// Content types the real APIs answer with.
const (
	contentTypeJSON = "application/json"
	contentTypeSSE  = "text/event-stream; charset=utf-8"
)

// output writes one response: optionally gzipped, flushed event by event,
// and cut short when a disconnect fault says so. It belongs to one handler
// goroutine and is not safe for concurrent use.
type output struct {
	w  http.ResponseWriter
	rc *http.ResponseController
	gz *gzip.Writer
	// limit is the injected disconnect-after count; zero means never.
	limit  int
	events int
	status int
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

// event sends one SSE event (name may be empty for OpenAI's data-only
// events) and flushes it. Under a disconnect fault, once limit events were
// sent, or at the final event whatever the count, it closes the connection
// instead and returns errDisconnected.
func (o *output) event(name string, data []byte, final bool) error {
	if o.limit > 0 && (final || o.events >= o.limit) {
		return o.abort()
	}
	var buf bytes.Buffer
	buf.Grow(len(name) + len(data) + 16)
	if name != "" {
		buf.WriteString("event: ")
		buf.WriteString(name)
		buf.WriteByte('\n')
	}
	buf.WriteString("data: ")
	buf.Write(data)
	buf.WriteString("\n\n")
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
