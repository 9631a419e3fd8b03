package llmapi

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"unicode/utf8"
)

// sampleFiles are the recorded response bodies in testdata, with the API and
// content type each belongs to.
var sampleFiles = []struct {
	name, file  string
	api         API
	contentType string
}{
	{"openai chat sse", "openai_chat.sse", APIOpenAIChat, "text/event-stream"},
	{"openai chat json", "openai_chat.json", APIOpenAIChat, "application/json"},
	{"openai completions sse", "openai_completions.sse", APIOpenAICompletions, "text/event-stream; charset=utf-8"},
	{"openai embeddings json", "openai_embeddings.json", APIOpenAIEmbeddings, "application/json"},
	{"responses sse", "responses.sse", APIOpenAIResponses, "text/event-stream"},
	{"responses json", "responses.json", APIOpenAIResponses, "application/json"},
	{"anthropic sse", "anthropic.sse", APIAnthropicMessages, "text/event-stream"},
	{"anthropic json", "anthropic.json", APIAnthropicMessages, "application/json"},
}

func readSample(tb testing.TB, file string) []byte {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", file))
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

var contentTypes = []string{"text/event-stream", "application/json", ""}

// scanChunks runs a fresh scanner over chunks.
func scanChunks(api API, contentType, contentEncoding string, chunks ...[]byte) (Usage, error) {
	var s UsageScanner
	s.Reset(api, contentType, contentEncoding)
	for _, c := range chunks {
		s.Write(c)
	}
	u := s.Finish()
	return u, s.Err()
}

// splitRandom cuts data at random points chosen by seed.
func splitRandom(data []byte, seed uint64) [][]byte {
	r := rand.New(rand.NewPCG(seed, 7))
	var out [][]byte
	for len(data) > 0 {
		n := 1 + r.IntN(min(len(data), 1+r.IntN(64)))
		out = append(out, data[:n])
		data = data[n:]
	}
	return out
}

func splitBytes(data []byte) [][]byte {
	out := make([][]byte, len(data))
	for i := range data {
		out[i] = data[i : i+1]
	}
	return out
}

func gzipBytes(tb testing.TB, data []byte, level int) []byte {
	tb.Helper()
	var buf bytes.Buffer
	w, err := gzip.NewWriterLevel(&buf, level)
	if err != nil {
		tb.Fatal(err)
	}
	w.Name = "body.json"
	w.Comment = "x"
	w.Extra = []byte{1, 2, 3}
	if _, err := w.Write(data); err != nil {
		tb.Fatal(err)
	}
	if err := w.Close(); err != nil {
		tb.Fatal(err)
	}
	return buf.Bytes()
}

func FuzzUsageScanner(f *testing.F) {
	for _, s := range sampleFiles {
		b := readSample(f, s.file)
		for ct := range contentTypes {
			f.Add(b, uint8(s.api), uint8(ct), uint64(1))
		}
	}
	f.Add([]byte("data:{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\r\n\r\n"), uint8(APIOpenAIChat), uint8(0), uint64(2))
	f.Add([]byte("\xEF\xBB\xBFevent:message_start\rdata:{\"type\":\"message_start\",\r\ndata:\"message\":{\"usage\":{\"input_tokens\":3}}}\r\r"), uint8(APIAnthropicMessages), uint8(0), uint64(3))
	// Streams of events that repeat a shape with a difference here and there,
	// for the path that reads an event against the one before it.
	f.Add([]byte(`data: {"n":1,"choices":[{"delta":{"content":"a","content":"bb"}}],"x":null}

data: {"n":22,"choices":[{"delta":{"content":"ccc","content":"d"}}],"x":[1,{"y":"\u00e9"}]}

data: {"n":3,"choices":[{"delta":{"content":"e","content":"\ud83d\ude00"}}],"x":"z"}

data: {"n":3,"choices":[{"delta":{"content":"e","content":"f"}}],"x":"z"} x

data: {"n":4,"choices":[{"delta":{"content":"e","content":"f"}}],"x":"z"}

data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}

`), uint8(APIOpenAIChat), uint8(0), uint64(4))
	f.Add([]byte(`event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"\n\t"}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":null}}

data: {"type":"message_start","message":{"usage":{"input_tokens":3}}}

data: {"type":"message_delta","usage":{"output_tokens":2}}

`), uint8(APIAnthropicMessages), uint8(0), uint64(5))
	f.Add([]byte(`data: {"type":"response.output_text.delta","sequence_number":9,"delta":"a","obfuscation":"Qx"}

data: {"type":"response.output_text.delta","sequence_number":10,"delta":"bc","obfuscation":"Q"}

event: response.refusal.delta
data: {"sequence_number":11,"delta":"no"}

event: response.refusal.delta
data: {"sequence_number":12,"delta":"pe"}

data: {"type":"response.completed","response":{"usage":{"input_tokens":1,"output_tokens":2}}}

`), uint8(APIOpenAIResponses), uint8(0), uint64(6))
	// Errors reported inside a successful response.
	for _, c := range streamErrorCases {
		f.Add([]byte(c.body), uint8(c.api), uint8(slices.Index(contentTypes, c.ct)), uint64(len(c.body)))
	}
	f.Add([]byte(`data: {"id":"a","choices":[{"delta":{"content":"x"}}]}

data: {"id":"b","error":{"type":"rate_limit_error","type":"overloaded_error","message":"m"}}

data: {"id":"c","error":{"type":"overloaded_error","message":"n"},"error":{"code":"\u0072ate_limit_exceeded"}}

`), uint8(APIOpenAIChat), uint8(0), uint64(7))
	for _, b := range []string{audioTokensJSON, audioDurationJSON, audioSSE} {
		f.Add([]byte(b), uint8(6), uint8(0), uint64(len(b)))
	}
	// The APIs up to Anthropic's, and audio transcriptions (byte 6).
	fuzzed := [...]API{APIUnknown, APIOpenAIChat, APIOpenAICompletions, APIOpenAIEmbeddings, APIOpenAIResponses, APIAnthropicMessages, APIOpenAITranscriptions}
	f.Fuzz(func(t *testing.T, data []byte, apiByte, ctByte uint8, seed uint64) {
		api := fuzzed[int(apiByte)%len(fuzzed)]
		ct := contentTypes[int(ctByte)%len(contentTypes)]
		whole, err := scanChunks(api, ct, "", data)
		if err != nil {
			t.Fatalf("plain body reported %v", err)
		}
		if got, _ := scanChunks(api, ct, "", splitRandom(data, seed)...); got != whole {
			t.Fatalf("split at random points: %+v, whole: %+v", got, whole)
		}
		if len(data) <= 4096 {
			if got, _ := scanChunks(api, ct, "", splitBytes(data)...); got != whole {
				t.Fatalf("byte by byte: %+v, whole: %+v", got, whole)
			}
		}
		gz := gzipBytes(t, data, int(seed%10))
		got, err := scanChunks(api, ct, "gzip", splitRandom(gz, seed)...)
		if got != whole || err != nil {
			t.Fatalf("gzip: %+v (%v), plain: %+v", got, err, whole)
		}
		if !utf8.Valid(data) {
			return
		}
		want, comparable := refUsage(api, ct, data)
		if comparable && want != whole {
			t.Fatalf("scanner: %+v\nreference: %+v", whole, want)
		}
	})
}

// FuzzDecompress checks the decompressor against the standard library's
// decoders reading the whole body at once: fed in pieces, through its bounded
// buffer, it must hand on exactly the bytes they decode, and fail where they
// fail. The decoded size is limited to fuzzLimit, which keeps each run short
// (deflate expands up to 1032 times) and puts the limit itself under test.
func FuzzDecompress(f *testing.F) {
	const fuzzLimit = 256 << 10
	for _, s := range sampleFiles {
		b := readSample(f, s.file)
		for _, level := range []int{gzip.NoCompression, gzip.BestSpeed, gzip.DefaultCompression, gzip.BestCompression, gzip.HuffmanOnly} {
			f.Add(gzipBytes(f, b, level), uint64(level+2), false)
		}
		var z bytes.Buffer
		w := zlib.NewWriter(&z)
		w.Write(b)
		w.Close()
		f.Add(z.Bytes(), uint64(9), true)
		f.Add(rawDeflate(b, 5), uint64(10), true)
	}
	two := append(gzipBytes(f, []byte("first "), 6), gzipBytes(f, []byte("second"), 0)...)
	f.Add(two, uint64(4), false)
	f.Add(gzipBytes(f, make([]byte, 2*fuzzLimit), 9), uint64(11), false)
	f.Fuzz(func(t *testing.T, data []byte, seed uint64, deflate bool) {
		format, enc := formatGzip, "gzip"
		if deflate {
			format, enc = formatDeflate, "deflate"
		}
		d := getDecompressor(format)
		defer putDecompressor(d)
		d.limit = fuzzLimit
		var c collect
		var err error
		for _, ch := range splitRandom(data, seed) {
			if err = d.write(ch, &c); err != nil {
				break
			}
		}
		if err == nil {
			err = d.finish(&c)
		}
		if err != nil && !errors.Is(err, ErrCorruptCompression) {
			t.Fatalf("error %v is not ErrCorruptCompression", err)
		}
		want, werr := stdlibDecode(format, data, fuzzLimit+1)
		if len(want) > fuzzLimit {
			want, werr = want[:fuzzLimit], errors.New("over the limit")
		}
		if !bytes.Equal(c.b, want) || (err == nil) != (werr == nil) {
			t.Fatalf("%s: got %d bytes (%v), the standard library decoded %d bytes (%v)", enc, len(c.b), err, len(want), werr)
		}
	})
}

// stdlibDecode decodes a whole body, up to limit bytes, with the standard
// library's decoders directly: gzip members for gzip; for deflate, zlib where
// compress/zlib accepts the header and raw deflate where it rejects it. An
// empty body is an empty body.
func stdlibDecode(format uint8, data []byte, limit int64) ([]byte, error) {
	if len(data) == 0 {
		return nil, nil
	}
	var r io.Reader
	var err error
	if format == formatGzip {
		r, err = gzip.NewReader(bytes.NewReader(data))
	} else {
		r, err = zlib.NewReader(bytes.NewReader(data))
		if errors.Is(err, zlib.ErrHeader) || errors.Is(err, io.ErrUnexpectedEOF) && len(data) < 2 {
			r, err = flate.NewReader(bytes.NewReader(data)), nil
		}
	}
	if err != nil {
		return nil, err
	}
	out, err := io.ReadAll(io.LimitReader(r, limit))
	if len(out) == 0 {
		out = nil
	}
	return out, err
}

func rawDeflate(data []byte, level int) []byte {
	var b bytes.Buffer
	w, _ := flate.NewWriter(&b, level)
	w.Write(data)
	w.Close()
	return b.Bytes()
}

type collect struct{ b []byte }

func (c *collect) plain(p []byte) { c.b = append(c.b, p...) }

// decompressChunks runs a fresh decompressor over chunks.
func decompressChunks(format uint8, chunks [][]byte) ([]byte, error) {
	d := getDecompressor(format)
	defer putDecompressor(d)
	var c collect
	for _, ch := range chunks {
		if err := d.write(ch, &c); err != nil {
			return c.b, err
		}
	}
	return c.b, d.finish(&c)
}

func FuzzScanRequest(f *testing.F) {
	f.Add([]byte(`{"model":"gpt-4o","max_tokens":10,"n":2,"stream":true,"stream_options":{"include_usage":true},"user":"u","messages":[{"role":"user","content":"hi \u00e9"}]}`), uint8(APIOpenAIChat))
	f.Add([]byte(`{"model":"claude","max_tokens":"9","system":[{"type":"text","text":"s"}],"metadata":{"user_id":"x"},"messages":[{"role":"user","content":[{"type":"image","source":{}},{"type":"tool_result","content":[{"type":"text","text":"r"}]}]}]}`), uint8(APIAnthropicMessages))
	f.Add([]byte(`{"input":[{"role":"user","content":[{"type":"input_text","text":"t"},{"type":"input_file"}]},{"type":"function_call_output","output":"o"}],"instructions":"i","max_output_tokens":-1}`), uint8(APIOpenAIResponses))
	f.Add([]byte(`{"prompt":["a","b",[1,2]],"n":0,"model":null,"model":"m"}`), uint8(APIOpenAICompletions))
	f.Add(chatBody(2048, 3), uint8(APIOpenAIChat))
	f.Add([]byte(`{"contents":[{"role":"user","parts":[{"text":"hi"},{"inline_data":{"mime_type":"image/png","data":"AA"}},{"fileData":{"fileUri":"u"}}]}],"system_instruction":{"parts":[{"text":"s"}]},"generationConfig":{"maxOutputTokens":9,"candidate_count":2}}`), uint8(APIGeminiStream))
	f.Add([]byte(`{"content":{"parts":[{"text":"embed me"}]},"generation_config":{"max_output_tokens":-1}}`), uint8(APIGeminiEmbed))
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"text":"hi"},{"image":{"format":"png","source":{"bytes":"AA"}}},{"document":{}}]}],"system":[{"text":"s"}],"inferenceConfig":{"maxTokens":5}}`), uint8(APIBedrockConverseStream))
	f.Add([]byte(`{"anthropic_version":"bedrock-2023-05-31","max_tokens":7,"messages":[{"role":"user","content":"hi"}],"metadata":{"user_id":"u"}}`), uint8(APIBedrockInvoke))
	f.Fuzz(func(t *testing.T, body []byte, apiByte uint8) {
		api := API(apiByte % uint8(numAPIs))
		var got RequestFields
		err := ScanRequest(api, body, &got)
		want, werr := refScanRequest(api, body)
		if errors.Is(err, ErrInvalidJSON) != errors.Is(werr, ErrInvalidJSON) {
			t.Fatalf("invalid JSON: scanner %v, reference %v", err, werr)
		}
		if errors.Is(err, ErrInvalidJSON) || !utf8.Valid(body) {
			return
		}
		if public(got) != want {
			t.Fatalf("scanner:   %+v\nreference: %+v", got, want)
		}
		if (err == nil) != (werr == nil) || (err != nil && err.Error() != werr.Error()) {
			t.Fatalf("scanner error %v, reference error %v", err, werr)
		}
	})
}

func FuzzField(f *testing.F) {
	f.Add([]byte(`{"metadata":{"feature":"chat","n":1.5e3,"ok":true}}`), "metadata.feature")
	f.Add([]byte(`{"metadata":{"feature":"chat","n":1.5e3,"ok":true}}`), "metadata.n")
	f.Add([]byte(`{"a":{"b":1},"a":{"c":"\u00e9"}}`), "a.c")
	f.Add([]byte(`{"a":{"b":1},"a":{"c":"\u00e9"}}`), "a.b")
	f.Add([]byte(`{"user":null}`), "user")
	f.Fuzz(func(t *testing.T, body []byte, path string) {
		got, ok := Field(body, path)
		if !json.Valid(body) {
			if ok {
				t.Fatalf("Field on invalid JSON returned %q", got)
			}
			return
		}
		if !utf8.Valid(body) {
			return
		}
		want, wok := refField(body, path)
		if got != want || ok != wok {
			t.Fatalf("Field(%q) = %q, %v; reference %q, %v", path, got, ok, want, wok)
		}
	})
}

var injections = []string{`,"stream_options":{"include_usage":true}`, `{"include_usage":true}`, `"include_usage":true`, `"include_usage":true,`, `true`}

// oneSplice reports whether out is body with one known insertion added, or
// with a null replaced by one: everything else byte for byte the same.
func oneSplice(body, out []byte) bool {
	p := 0
	for p < len(body) && p < len(out) && body[p] == out[p] {
		p++
	}
	for _, ins := range injections {
		for _, removed := range []string{"", "null"} {
			if len(out) != len(body)-len(removed)+len(ins) {
				continue
			}
			for idx := max(0, p-len(ins)-len(removed)); idx <= p; idx++ {
				if idx+len(removed) <= len(body) && idx+len(ins) <= len(out) &&
					string(body[idx:idx+len(removed)]) == removed &&
					string(out[idx:idx+len(ins)]) == ins &&
					bytes.Equal(out[:idx], body[:idx]) &&
					bytes.Equal(out[idx+len(ins):], body[idx+len(removed):]) {
					return true
				}
			}
		}
	}
	return false
}

func FuzzInjectIncludeUsage(f *testing.F) {
	f.Add([]byte(`{"stream":true}`), uint8(APIOpenAIChat))
	f.Add([]byte(`{"stream":true,"stream_options":null}`), uint8(APIOpenAIChat))
	f.Add([]byte(`{"stream":true,"stream_options":{}}`), uint8(APIOpenAICompletions))
	f.Add([]byte(`{"stream":true,"stream_options":{"x":1}}`), uint8(APIOpenAIChat))
	f.Add([]byte(`{"stream":true,"stream_options":{"include_usage":null}} `), uint8(APIOpenAIChat))
	f.Add([]byte(`{"stream":true,"stream_options":{"include_usage":false}}`), uint8(APIOpenAIChat))
	f.Add([]byte(` { "messages" : [ ] , "stream" : true } `), uint8(APIOpenAIChat))
	f.Fuzz(func(t *testing.T, body []byte, apiByte uint8) {
		api := API(apiByte % 6)
		orig := bytes.Clone(body)
		out, changed := InjectIncludeUsage(api, body)
		if !bytes.Equal(body, orig) {
			t.Fatal("input modified")
		}
		if want := refWantsInjection(api, body); changed != want {
			t.Fatalf("changed = %v, want %v", changed, want)
		}
		if !changed {
			if !bytes.Equal(out, body) {
				t.Fatal("unchanged body differs")
			}
			return
		}
		if !json.Valid(out) {
			t.Fatalf("output is not valid JSON: %s", out)
		}
		if !oneSplice(body, out) {
			t.Fatalf("not a single splice of a known insertion:\n%s\n%s", body, out)
		}
		var gotV, wantV any
		gotV, _ = decodeAny(out)
		wantV, _ = decodeAny(body)
		m := wantV.(map[string]any)
		if so, ok := m["stream_options"].(map[string]any); ok {
			so["include_usage"] = true
		} else {
			m["stream_options"] = map[string]any{"include_usage": true}
		}
		if !reflect.DeepEqual(gotV, wantV) {
			t.Fatalf("content differs:\n got %v\nwant %v", gotV, wantV)
		}
	})
}

// FuzzInjectIncludeUsageAt checks that injecting at the places ScanRequest found gives exactly
// what InjectIncludeUsage gives reading the body again, byte for byte.
func FuzzInjectIncludeUsageAt(f *testing.F) {
	f.Add([]byte(`{"stream":true}`), uint8(APIOpenAIChat))
	f.Add([]byte(`{"stream":true,"stream_options":null,"stream":false}`), uint8(APIOpenAIChat))
	f.Add([]byte(`{"stream":true,"stream_options":{},"stream_options":{"x":1}}`), uint8(APIOpenAICompletions))
	f.Add([]byte(`{"stream":true,"stream_options":{"include_usage":null}} `), uint8(APIOpenAIChat))
	f.Add([]byte(`{"stream":true,"stream_options":{"include_usage":false}}`), uint8(APIOpenAIChat))
	f.Add([]byte(`{"str\u0065am":true,"stream_options":[1]}`), uint8(APIOpenAIChat))
	f.Add([]byte(` { "messages" : [ {"role":"user","content":"hi"} ] , "stream" : true } `), uint8(APIOpenAIChat))
	f.Add(chatBody(2048, 3), uint8(APIOpenAIChat))
	f.Add([]byte(`{"contents":[{"role":"user","parts":[{"text":"hi"},{"inline_data":{"mime_type":"image/png","data":"AA"}},{"fileData":{"fileUri":"u"}}]}],"system_instruction":{"parts":[{"text":"s"}]},"generationConfig":{"maxOutputTokens":9,"candidate_count":2}}`), uint8(APIGeminiStream))
	f.Add([]byte(`{"content":{"parts":[{"text":"embed me"}]},"generation_config":{"max_output_tokens":-1}}`), uint8(APIGeminiEmbed))
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"text":"hi"},{"image":{"format":"png","source":{"bytes":"AA"}}},{"document":{}}]}],"system":[{"text":"s"}],"inferenceConfig":{"maxTokens":5}}`), uint8(APIBedrockConverseStream))
	f.Add([]byte(`{"anthropic_version":"bedrock-2023-05-31","max_tokens":7,"messages":[{"role":"user","content":"hi"}],"metadata":{"user_id":"u"}}`), uint8(APIBedrockInvoke))
	f.Fuzz(func(t *testing.T, body []byte, apiByte uint8) {
		api := API(apiByte % uint8(numAPIs))
		var fields RequestFields
		_ = ScanRequest(api, body, &fields)
		want, wantChanged := InjectIncludeUsage(api, body)
		got, changed := InjectIncludeUsageAt(api, body, &fields)
		if changed != wantChanged || !bytes.Equal(got, want) {
			t.Fatalf("at the scanned places: %v %s\nreading again:         %v %s", changed, got, wantChanged, want)
		}
	})
}

// public is f without what ScanRequest records for its own package's later use.
func public(f RequestFields) RequestFields {
	f.at = injectPoints{}
	return f
}

// FuzzEditBody: EditBody, editing a body in its own array whatever room it leaves there, gives
// byte for byte what RewriteModel then InjectIncludeUsage give on a copy.
func FuzzEditBody(f *testing.F) {
	f.Add([]byte(`{"model":"m","stream":true}`), uint8(APIOpenAIChat), "other-model", true, uint8(0))
	f.Add([]byte(`{"stream":true,"model":"a","model":"b"}`), uint8(APIOpenAIChat), "z", true, uint8(200))
	f.Add([]byte(`{"stream":true,"stream_options":null}`), uint8(APIOpenAICompletions), "", true, uint8(64))
	f.Add([]byte(`{"model":"a-very-long-model-name","stream":true,"stream_options":{}}`), uint8(APIOpenAIChat), "b", true, uint8(3))
	f.Add([]byte(` {"messages":[]} `), uint8(APIAnthropicMessages), "claude", false, uint8(10))
	f.Add(chatBody(2048, 3), uint8(APIOpenAIChat), "gpt", true, uint8(40))
	f.Fuzz(func(t *testing.T, body []byte, apiByte uint8, model string, includeUsage bool, room uint8) {
		api := API(apiByte % 6)
		var fields RequestFields
		_ = ScanRequest(api, body, &fields)
		want, wantChanged := body, false
		if model != "" {
			want, wantChanged = RewriteModel(want, model)
		}
		if includeUsage {
			if injected, ok := InjectIncludeUsage(api, want); ok {
				want, wantChanged = injected, true
			}
		}
		own := append(make([]byte, 0, len(body)+int(room)), body...)
		got, changed := EditBody(api, own, &fields, model, includeUsage)
		if changed != wantChanged || !bytes.Equal(got, want) {
			t.Fatalf("in place: %v %s\ncopied:   %v %s", changed, got, wantChanged, want)
		}
	})
}
