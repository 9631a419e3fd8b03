package llmapi

import (
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"fmt"
	"io"
	"sync"
)

// decompressor decodes a gzip or deflate response body, delivered in chunks,
// with the standard library's decoders, and hands the decoded bytes to the
// scanner.
//
// compress/gzip, compress/zlib and compress/flate pull their input from an
// io.Reader and cannot resume after it has reported an error, so they cannot
// simply be handed each chunk as Envoy delivers it: a reader that ran dry in
// the middle of a block would kill the decoder, and a reader that blocked
// until the next chunk would need a goroutine per response and a Write that
// waits. Instead the compressed bytes are copied into a bounded buffer, and
// the decoder is asked for output only while that buffer holds at least
// lookahead bytes it has not read yet, or once the body has ended. One Read
// of these decoders stops when its 32 KiB window is full, at the end of every
// stored run and at every flush point, so in streams that encoders write it
// consumes at most about 32 KiB of input (with Go's and zlib's encoders at
// every level, flushing or not: 32 773 bytes for incompressible data, under
// 2.8 KiB for SSE text without flushes, a few hundred bytes with them); with
// twice that in hand it never runs dry mid-stream. What is left in the buffer
// is decoded when the body ends, which is where the usage is.
//
// A stream that needs more than lookahead bytes of input before it yields any
// output (thousands of empty blocks in a row, or a gzip header with an extra
// field of 64 KiB: nothing an encoder writes by itself) cannot be decoded this
// way. The scan then stops with ErrCorruptCompression, keeping what it had
// decoded, and the response is settled like any response whose usage could
// not be read.
//
// Memory per compressed response is bounded: the input buffer (at most
// inputBuf, and only as large as the body has needed), the output run
// (outRun), and the decoder's own 32 KiB window and Huffman tables: about
// 55 KiB for a short response, 135 KiB at most. Decoded bytes go to the scanner outRun bytes at a time and are never kept,
// and decoding stops with ErrCorruptCompression once the body has decoded to
// limit bytes, so a small body that expands enormously (a zip bomb) costs
// bounded memory and bounded time.
//
// A decompressor is not safe for concurrent use; they are pooled per format
// and reused across responses.
type decompressor struct {
	format  uint8
	src     compressedInput
	r       io.Reader // the decoder in use: nil until the first output is asked for
	decoded int64
	limit   int64
	done    bool // the compressed stream ended: the rest of the body is not read
	err     error

	// The decoders, kept across responses so that their windows and tables
	// are reused.
	gz *gzip.Reader
	zl io.ReadCloser
	fl io.ReadCloser

	out [outRun]byte
}

const (
	// lookahead is how much unread compressed input must be at hand before
	// the decoder is asked for output in the middle of a body.
	lookahead = 64 << 10
	// inputBuf is the most compressed input held: the lookahead plus room to
	// take in the next chunk without moving bytes for every small one.
	inputBuf = lookahead + 16<<10
	// outRun is the most decoded bytes handed to the scanner at once: enough
	// for dozens of events, so few are split between two runs.
	outRun = 8 << 10
	// maxDecoded bounds what one response may expand to, so that a small
	// compressed body cannot make the scanner chew through gigabytes.
	maxDecoded = 256 << 20
)

// Content encodings read.
const (
	formatGzip    uint8 = iota // gzip and x-gzip: gzip members, one after another
	formatDeflate              // HTTP deflate: zlib, or raw deflate as some servers send
)

// plainSink receives decoded bytes; it must not retain them.
type plainSink interface {
	plain(p []byte)
}

var decompressors [2]sync.Pool

func getDecompressor(format uint8) *decompressor {
	d, _ := decompressors[format].Get().(*decompressor)
	if d == nil {
		d = &decompressor{format: format}
	}
	d.r, d.decoded, d.limit, d.done, d.err = nil, 0, maxDecoded, false, nil
	d.src.r, d.src.w, d.src.end = 0, 0, false
	return d
}

func putDecompressor(d *decompressor) {
	if d != nil {
		d.r = nil
		decompressors[d.format].Put(d)
	}
}

// errStarved is what the input reports when the decoder wants bytes that have
// not arrived yet; it never leaves this file.
var errStarved = errors.New("llmapi: compressed input ran dry mid-stream")

// compressedInput is the bounded buffer of compressed bytes the decoder reads
// from. It implements io.ByteReader, so the decoders read exactly the bytes
// they need and leave the rest in place (without it they would wrap it in a
// bufio.Reader that reads ahead).
type compressedInput struct {
	buf  []byte // grows as needed up to inputBuf, and is kept with the pooled decompressor
	r, w int
	end  bool // the body has ended: running dry is the end of the stream
}

func (c *compressedInput) Read(p []byte) (int, error) {
	if c.r == c.w {
		return 0, c.dry()
	}
	n := copy(p, c.buf[c.r:c.w])
	c.r += n
	return n, nil
}

func (c *compressedInput) ReadByte() (byte, error) {
	if c.r == c.w {
		return 0, c.dry()
	}
	c.r++
	return c.buf[c.r-1], nil
}

func (c *compressedInput) dry() error {
	if c.end {
		return io.EOF
	}
	return errStarved
}

func (c *compressedInput) unread() int { return c.w - c.r }

// fill takes as much of p as fits and returns how much that was. Read bytes
// are dropped only when the room is needed, so that a stream of small chunks
// does not move the buffer for each one, and the buffer grows only as far as
// the body needs: a short compressed response keeps a few kilobytes.
func (c *compressedInput) fill(p []byte) int {
	if len(p) > len(c.buf)-c.w {
		if c.r > 0 {
			c.w = copy(c.buf, c.buf[c.r:c.w])
			c.r = 0
		}
		if len(p) > len(c.buf)-c.w && len(c.buf) < inputBuf {
			grown := make([]byte, min(inputBuf, max(2*len(c.buf), c.w+len(p), 4<<10)))
			copy(grown, c.buf[:c.w])
			c.buf = grown
		}
	}
	n := copy(c.buf[c.w:], p)
	c.w += n
	return n
}

// write takes the next chunk of compressed body, decoding what can be decoded
// safely.
func (d *decompressor) write(p []byte, out plainSink) error {
	for len(p) > 0 && d.err == nil && !d.done {
		n := d.src.fill(p)
		p = p[n:]
		d.decode(out)
	}
	return d.err
}

// finish decodes the rest now that no more input will come, and reports a
// stream that ended before its end.
func (d *decompressor) finish(out plainSink) error {
	d.src.end = true
	d.decode(out)
	return d.err
}

// decode hands decoded output to out while the input at hand is enough to
// ask for it, or until the stream's end once the body has ended.
func (d *decompressor) decode(out plainSink) {
	for d.err == nil && !d.done && (d.src.end || d.src.unread() >= lookahead) {
		if d.r == nil {
			d.start()
			continue
		}
		n, err := d.r.Read(d.out[:])
		if n > 0 {
			if rest := d.limit - d.decoded; int64(n) > rest {
				out.plain(d.out[:int(rest)])
				d.decoded = d.limit
				d.fail(errors.New("decoded body exceeds the size limit"))
				return
			}
			d.decoded += int64(n)
			out.plain(d.out[:n])
		}
		switch {
		case err == io.EOF:
			// gzip: the body ended after a whole member. zlib and raw
			// deflate: the stream ended; whatever follows is ignored, as
			// HTTP clients do.
			d.done = true
		case err != nil:
			d.fail(err)
		}
	}
}

// start sets up the decoder for the body's format, reading its header.
func (d *decompressor) start() {
	var err error
	switch d.format {
	case formatGzip:
		if d.gz == nil {
			d.gz = new(gzip.Reader)
		}
		err = d.gz.Reset(&d.src)
		d.r = d.gz
		if err == io.EOF {
			d.done = true // an empty body
			return
		}
	default:
		b := d.src.buf[d.src.r:d.src.w]
		if len(b) == 0 {
			d.done = true // an empty body (decode starts only with input or at the end)
			return
		}
		if len(b) >= 2 && zlibHeader(b[0], b[1]) {
			if d.zl == nil {
				d.zl, err = zlib.NewReader(&d.src)
			} else {
				err = d.zl.(zlib.Resetter).Reset(&d.src, nil)
			}
			d.r = d.zl
			break
		}
		// Some servers send raw deflate under "deflate".
		if d.fl == nil {
			d.fl = flate.NewReader(&d.src)
		} else {
			err = d.fl.(flate.Resetter).Reset(&d.src, nil)
		}
		d.r = d.fl
	}
	if err != nil {
		d.fail(err)
	}
}

// zlibHeader reports whether cmf and flg open a zlib stream (RFC 1950): method
// 8 (deflate), a window of at most 32 KiB, and a check that makes the pair a
// multiple of 31. This is the test compress/zlib applies; anything else under
// "deflate" is read as raw deflate.
func zlibHeader(cmf, flg byte) bool {
	return cmf&0x0f == 8 && cmf>>4 <= 7 && (uint16(cmf)<<8|uint16(flg))%31 == 0
}

func (d *decompressor) fail(err error) {
	if err == errStarved {
		err = fmt.Errorf("more than %d KiB of compressed input before the next decoded bytes", lookahead>>10)
	}
	d.err = fmt.Errorf("%w: %w", ErrCorruptCompression, err)
}
