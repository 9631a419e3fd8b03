package llmapi

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"math/rand/v2"
	"testing"
)

// sseText is an SSE stream of n small events, as an upstream streams them.
func sseText(n int) []byte {
	var b bytes.Buffer
	for i := range n {
		b.WriteString("data: {\"choices\":[{\"delta\":{\"content\":\"token ")
		b.WriteString(string(rune('a' + i%26)))
		b.WriteString("\"}}]}\n\n")
	}
	return b.Bytes()
}

// flushedGzip compresses data as a streaming server does, flushing after
// every piece of size bytes so that each arrives at the client at once.
func flushedGzip(tb testing.TB, data []byte, size int) []byte {
	tb.Helper()
	var buf bytes.Buffer
	w := gzip.NewWriter(&buf)
	for len(data) > 0 {
		n := min(size, len(data))
		w.Write(data[:n])
		if err := w.Flush(); err != nil {
			tb.Fatal(err)
		}
		data = data[n:]
	}
	w.Close()
	return buf.Bytes()
}

func TestDecompress(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	random := make([]byte, 300<<10)
	for i := range random {
		random[i] = byte(r.IntN(256))
	}
	text := sseText(20000) // about 1 MiB
	var zl bytes.Buffer
	zw := zlib.NewWriter(&zl)
	zw.Write(text)
	zw.Close()
	tests := []struct {
		name   string
		format uint8
		in     []byte
		want   []byte
	}{
		{"gzip text", formatGzip, gzipBytes(t, text, 6), text},
		{"gzip random (stored blocks)", formatGzip, gzipBytes(t, random, 6), random},
		{"gzip no compression", formatGzip, gzipBytes(t, text, gzip.NoCompression), text},
		{"gzip huffman only", formatGzip, gzipBytes(t, text, gzip.HuffmanOnly), text},
		{"gzip best", formatGzip, gzipBytes(t, text, gzip.BestCompression), text},
		{"gzip flushed after every event", formatGzip, flushedGzip(t, text, 56), text},
		{"gzip empty", formatGzip, gzipBytes(t, nil, 6), nil},
		{"empty gzip body", formatGzip, nil, nil},
		{"gzip members", formatGzip, append(gzipBytes(t, text[:5000], 1), gzipBytes(t, text[5000:], 9)...), text},
		{"gzip members around the lookahead", formatGzip, append(gzipBytes(t, random[:lookahead-100], 0), gzipBytes(t, random[lookahead-100:], 0)...), random},
		{"zlib", formatDeflate, zl.Bytes(), text},
		{"zlib with data after it", formatDeflate, append(bytes.Clone(zl.Bytes()), "trailing"...), text},
		{"raw deflate", formatDeflate, rawDeflate(text, 5), text},
		{"raw deflate random", formatDeflate, rawDeflate(random, 5), random},
		{"raw deflate stored", formatDeflate, rawDeflate(text[:100], 0), text[:100]},
		{"raw deflate tiny", formatDeflate, rawDeflate([]byte("a"), 5), []byte("a")},
		{"empty deflate body", formatDeflate, nil, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, chunks := range [][][]byte{{tc.in}, chunk(tc.in, 16<<10), chunk(tc.in, 1000), splitRandom(tc.in, 3)} {
				got, err := decompressChunks(tc.format, chunks)
				if err != nil || !bytes.Equal(got, tc.want) {
					t.Fatalf("%d chunks: %d bytes (%v), want %d", len(chunks), len(got), err, len(tc.want))
				}
			}
		})
	}
}

// TestDecompressStreams pins that a long body is decoded while it arrives, at
// most inputBuf bytes behind it, not held until it ends.
func TestDecompressStreams(t *testing.T) {
	text, _ := chatStreamCurrent(20000)
	gz := gzipBytes(t, text, 6)
	if len(gz) < 2*inputBuf {
		t.Fatalf("only %d compressed bytes", len(gz))
	}
	d := getDecompressor(formatGzip)
	defer putDecompressor(d)
	var c collect
	for i, ch := range chunk(gz, 4<<10) {
		if err := d.write(ch, &c); err != nil {
			t.Fatal(err)
		}
		if d.src.unread() > inputBuf {
			t.Fatalf("%d compressed bytes held", d.src.unread())
		}
		if sent := (i + 1) * 4 << 10; sent > inputBuf+8<<10 && len(c.b) == 0 {
			t.Fatalf("nothing decoded after %d compressed bytes", sent)
		}
	}
	if err := d.finish(&c); err != nil || !bytes.Equal(c.b, text) {
		t.Fatalf("%d bytes (%v), want %d", len(c.b), err, len(text))
	}
}

func TestDecompressBroken(t *testing.T) {
	text := bytes.Repeat([]byte("usage prompt_tokens completion_tokens "), 500)
	gz := gzipBytes(t, text, 6)
	t.Run("every truncation is reported", func(t *testing.T) {
		for i := 1; i < len(gz); i++ {
			got, err := decompressChunks(formatGzip, [][]byte{gz[:i]})
			if !errors.Is(err, ErrCorruptCompression) {
				t.Fatalf("cut at %d: %v", i, err)
			}
			if !bytes.HasPrefix(text, got) {
				t.Fatalf("cut at %d: output is not a prefix", i)
			}
		}
	})
	t.Run("bit flips never go unnoticed", func(t *testing.T) {
		for i := 10; i < len(gz); i++ {
			bad := bytes.Clone(gz)
			bad[i] ^= 1 << (i % 8)
			got, err := decompressChunks(formatGzip, [][]byte{bad})
			if err == nil && !bytes.Equal(got, text) {
				t.Fatalf("flip at %d: wrong output without an error", i)
			}
		}
	})
	tests := []struct {
		name   string
		format uint8
		in     []byte
		cause  error
	}{
		{"not gzip", formatGzip, []byte("data: {}\n\n"), gzip.ErrHeader},
		{"bad method", formatGzip, []byte{0x1f, 0x8b, 7, 0, 0, 0, 0, 0, 0, 0}, gzip.ErrHeader},
		{"bad checksum", formatGzip, append(bytes.Clone(gz[:len(gz)-8]), 0, 0, 0, 0, 0, 0, 0, 0), gzip.ErrChecksum},
		{"garbage after a member", formatGzip, append(bytes.Clone(gz), 0x00, 0x01), nil},
		{"zlib preset dictionary", formatDeflate, []byte{0x78, 0xbb, 0, 0, 0, 2, 3}, zlib.ErrDictionary},
		{"bad zlib checksum", formatDeflate, func() []byte {
			var b bytes.Buffer
			w := zlib.NewWriter(&b)
			w.Write(text)
			w.Close()
			z := b.Bytes()
			z[len(z)-1] ^= 1
			return z
		}(), zlib.ErrChecksum},
		{"reserved block type", formatDeflate, []byte{0x07, 0, 0}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decompressChunks(tc.format, [][]byte{tc.in})
			if !errors.Is(err, ErrCorruptCompression) || (tc.cause != nil && !errors.Is(err, tc.cause)) {
				t.Fatalf("err = %v, want ErrCorruptCompression wrapping %v", err, tc.cause)
			}
		})
	}
	t.Run("size limit", func(t *testing.T) {
		bomb := gzipBytes(t, make([]byte, 1<<20), 9)
		d := getDecompressor(formatGzip)
		defer putDecompressor(d)
		d.limit = 64 << 10
		var c collect
		d.write(bomb, &c)
		err := d.finish(&c)
		if !errors.Is(err, ErrCorruptCompression) || len(c.b) != 64<<10 {
			t.Fatalf("err %v after %d bytes", err, len(c.b))
		}
	})
	t.Run("more than the lookahead without output", func(t *testing.T) {
		// Empty flushes are 5 bytes of input each and decode to nothing: a
		// decoder asked for output reads through all of them at once.
		flushes := func(n int) []byte {
			var b bytes.Buffer
			w := gzip.NewWriter(&b)
			w.Write([]byte("data: {}\n\n"))
			for range n {
				w.Flush()
			}
			w.Write([]byte("data: {}\n\n"))
			w.Close()
			return b.Bytes()
		}
		got, err := decompressChunks(formatGzip, chunk(flushes(2*lookahead/5), 4<<10))
		if !errors.Is(err, ErrCorruptCompression) || !bytes.HasPrefix([]byte("data: {}\n\ndata: {}\n\n"), got) {
			t.Fatalf("%q (%v)", got, err)
		}
		got, err = decompressChunks(formatGzip, chunk(flushes(lookahead/2/5), 4<<10))
		if err != nil || string(got) != "data: {}\n\ndata: {}\n\n" {
			t.Fatalf("half the lookahead: %q (%v)", got, err)
		}
	})
}
