package llmapi

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
)

func TestInflate(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	random := make([]byte, 100<<10)
	for i := range random {
		random[i] = byte(r.IntN(256))
	}
	text := bytes.Repeat([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"token\"}}]}\n\n"), 3000)
	rawDeflate := func(data []byte, level int) []byte {
		var b bytes.Buffer
		w, _ := flate.NewWriter(&b, level)
		w.Write(data)
		w.Close()
		return b.Bytes()
	}
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
		{"gzip empty", formatGzip, gzipBytes(t, nil, 6), nil},
		{"gzip members", formatGzip, append(gzipBytes(t, text[:5000], 1), gzipBytes(t, text[5000:], 9)...), text},
		{"raw deflate", formatZlibOrRaw, rawDeflate(text, 5), text},
		{"raw deflate stored", formatZlibOrRaw, rawDeflate(text[:100], 0), text[:100]},
		{"raw deflate tiny", formatZlibOrRaw, rawDeflate([]byte("a"), 5), []byte("a")},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, chunks := range [][][]byte{{tc.in}, splitRandom(tc.in, 3), splitBytes(tc.in)} {
				got, err := inflateChunks(tc.format, chunks)
				if err != nil || !bytes.Equal(got, tc.want) {
					t.Fatalf("%d chunks: %d bytes (%v), want %d", len(chunks), len(got), err, len(tc.want))
				}
			}
		})
	}
}

func TestInflateBroken(t *testing.T) {
	text := bytes.Repeat([]byte("usage prompt_tokens completion_tokens "), 500)
	gz := gzipBytes(t, text, 6)
	t.Run("every truncation is reported", func(t *testing.T) {
		for i := range len(gz) {
			got, err := inflateChunks(formatGzip, [][]byte{gz[:i]})
			if !errors.Is(err, ErrCorruptCompression) && i > 0 {
				t.Fatalf("cut at %d: %v", i, err)
			}
			if !bytes.HasPrefix(text, got) {
				t.Fatalf("cut at %d: output is not a prefix", i)
			}
		}
	})
	t.Run("bit flips never panic and never go unnoticed silently", func(t *testing.T) {
		for i := 10; i < len(gz); i++ {
			bad := bytes.Clone(gz)
			bad[i] ^= 1 << (i % 8)
			got, err := inflateChunks(formatGzip, [][]byte{bad})
			if err == nil && !bytes.Equal(got, text) {
				t.Fatalf("flip at %d: wrong output without an error", i)
			}
		}
	})
	tests := []struct {
		name string
		in   []byte
		why  string
	}{
		{"bad magic", []byte{0x1f, 0x8c, 8, 0, 0, 0, 0, 0, 0, 0}, "not gzip"},
		{"bad method", []byte{0x1f, 0x8b, 7, 0, 0, 0, 0, 0, 0, 0}, "method"},
		{"reserved block type", append([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0}, 0x07), "block type"},
		{"stored length mismatch", append([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0}, 0x01, 0x05, 0x00, 0x00, 0x00), "stored block length"},
		// A fixed-code block whose first symbol is a match (length 3, distance 1).
		{"distance before the start", append([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0}, 0x03, 0x02, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0), "distance too far"},
		{"garbage after a member", append(bytes.Clone(gz), 0x00, 0x01), "not gzip"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := inflateChunks(formatGzip, [][]byte{tc.in})
			if !errors.Is(err, ErrCorruptCompression) || !strings.Contains(err.Error(), tc.why) {
				t.Fatalf("err = %v, want %q", err, tc.why)
			}
		})
	}
	t.Run("size limit", func(t *testing.T) {
		bomb := gzipBytes(t, make([]byte, 1<<20), 9)
		z := getInflater(formatGzip)
		defer putInflater(z)
		z.limit = 64 << 10
		var c collect
		err := z.write(bomb, &c)
		if !errors.Is(err, ErrCorruptCompression) || len(c.b) > 64<<10+windowSize {
			t.Fatalf("err %v after %d bytes", err, len(c.b))
		}
	})
}
