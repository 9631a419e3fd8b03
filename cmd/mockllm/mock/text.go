package mock

import (
	"encoding/base64"
	"encoding/binary"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"strings"
)

// BytesPerToken is the size of one generated token: every token of generated
// text is a fixed four-byte word, so ceil(len(text)/4) of the visible text is
// exactly the number of visible completion tokens reported.
const BytesPerToken = 4

// words are the tokens of generated text, each exactly BytesPerToken bytes.
var words = [...]string{"the ", "fox ", "ran ", "far ", "and ", "saw ", "big ", "sky "}

// generatedText returns tokens [from, to) of the endless generated text.
func generatedText(from, to int64) string {
	if to <= from {
		return ""
	}
	var b strings.Builder
	b.Grow(int(to-from) * BytesPerToken)
	for t := from; t < to; t++ {
		b.WriteString(words[t%int64(len(words))])
	}
	return b.String()
}

// chunkCount is how many content events carry visible tokens in chunks of
// per tokens (the last one may be shorter).
func chunkCount(visible int64, per int) int64 {
	if visible <= 0 {
		return 0
	}
	return (visible + int64(per) - 1) / int64(per)
}

// chunkText returns the text of content event i.
func chunkText(i, visible int64, per int) string {
	from := i * int64(per)
	return generatedText(from, min(from+int64(per), visible))
}

// embedding returns a deterministic unit vector of dims values for input, so
// the same input always embeds the same way and tests can compare vectors.
func embedding(input string, dims int) []float32 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(input))
	r := rand.New(rand.NewPCG(h.Sum64(), uint64(dims)))
	v := make([]float32, dims)
	var norm float64
	for i := range v {
		x := r.Float64()*2 - 1
		v[i] = float32(x)
		norm += x * x
	}
	if norm == 0 {
		return v
	}
	scale := 1 / math.Sqrt(norm)
	for i := range v {
		v[i] = float32(float64(v[i]) * scale)
	}
	return v
}

// embeddingBase64 encodes v as the API's base64 format: little-endian float32s.
func embeddingBase64(v []float32) string {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return base64.StdEncoding.EncodeToString(b)
}
