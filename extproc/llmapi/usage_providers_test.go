package llmapi

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws/protocol/eventstream"
)

// Gemini's responses, as the API sends them: the whole GenerateContentResponse, the SSE of
// streamGenerateContent?alt=sse (CRLF line ends) and the JSON array without it. Every chunk
// carries usageMetadata; the last one holds the output and the thinking.
const (
	geminiJSON = `{"candidates":[{"content":{"parts":[{"text":"The sky is blue because air scatters blue light."}],"role":"model"},"finishReason":"STOP","index":0}],` +
		`"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":11,"totalTokenCount":69,"promptTokensDetails":[{"modality":"TEXT","tokenCount":8}],"thoughtsTokenCount":50},` +
		`"modelVersion":"gemini-2.5-flash","responseId":"r1"}`
	geminiChunk1 = `{"candidates":[{"content":{"parts":[{"text":"The sky is "}],"role":"model"},"index":0}],"usageMetadata":{"promptTokenCount":8,"totalTokenCount":8},"modelVersion":"gemini-2.5-flash","responseId":"r1"}`
	geminiChunk2 = `{"candidates":[{"content":{"parts":[{"text":"blue \"because\" of air."}],"role":"model"},"finishReason":"STOP","index":0}],` +
		`"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":7,"totalTokenCount":65,"cachedContentTokenCount":4,"thoughtsTokenCount":50},"modelVersion":"gemini-2.5-flash","responseId":"r1"}`
	geminiSSE   = "data: " + geminiChunk1 + "\r\n\r\ndata: " + geminiChunk2 + "\r\n\r\n"
	geminiArray = "[" + geminiChunk1 + "\r\n,\r\n" + geminiChunk2 + "]"
)

// Bedrock Converse's response and ConverseStream's events.
const bedrockJSON = `{"metrics":{"latencyMs":812},"output":{"message":{"content":[{"text":"Hello! How can I help?"}],"role":"assistant"}},"stopReason":"end_turn",` +
	`"usage":{"inputTokens":12,"outputTokens":9,"totalTokens":121,"cacheReadInputTokens":100,"cacheWriteInputTokens":0}}`

// awsMessage encodes one event-stream message with the AWS SDK's encoder.
func awsMessage(tb testing.TB, kind, name string, payload []byte) []byte {
	tb.Helper()
	var h eventstream.Headers
	h.Set(":message-type", eventstream.StringValue(kind))
	switch kind {
	case "event":
		h.Set(":event-type", eventstream.StringValue(name))
		h.Set(":content-type", eventstream.StringValue("application/json"))
	case "exception":
		h.Set(":exception-type", eventstream.StringValue(name))
	}
	var buf bytes.Buffer
	if err := eventstream.NewEncoder().Encode(&buf, eventstream.Message{Headers: h, Payload: payload}); err != nil {
		tb.Fatal(err)
	}
	return buf.Bytes()
}

// converseStream is a ConverseStream answer: text deltas, then the metadata event's usage.
func converseStream(tb testing.TB, extra ...[]byte) []byte {
	var b []byte
	b = append(b, awsMessage(tb, "event", "messageStart", []byte(`{"role":"assistant"}`))...)
	b = append(b, awsMessage(tb, "event", "contentBlockDelta", []byte(`{"contentBlockIndex":0,"delta":{"text":"Hello! "},"p":"abcdef"}`))...)
	b = append(b, awsMessage(tb, "event", "contentBlockDelta", []byte(`{"contentBlockIndex":0,"delta":{"text":"How can I help?"},"p":"ab"}`))...)
	b = append(b, awsMessage(tb, "event", "contentBlockStop", []byte(`{"contentBlockIndex":0}`))...)
	for _, e := range extra {
		b = append(b, e...)
	}
	b = append(b, awsMessage(tb, "event", "messageStop", []byte(`{"stopReason":"end_turn"}`))...)
	return append(b, awsMessage(tb, "event", "metadata", []byte(`{"usage":{"inputTokens":12,"outputTokens":9,"totalTokens":21,"cacheWriteInputTokens":30},"metrics":{"latencyMs":500}}`))...)
}

// invokeStream is an InvokeModelWithResponseStream answer of an Anthropic model: Anthropic's
// events, each base64 in a chunk's bytes.
func invokeStream(tb testing.TB) []byte {
	var b []byte
	for _, ev := range []string{
		`{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude-3-haiku-20240307","content":[],"usage":{"input_tokens":15,"cache_read_input_tokens":5,"output_tokens":1}}}`,
		`{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`,
		`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi there"}}`,
		`{"type":"content_block_stop","index":0}`,
		`{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":20}}`,
		`{"type":"message_stop","amazon-bedrock-invocationMetrics":{"inputTokenCount":15,"outputTokenCount":20,"invocationLatency":500,"firstByteLatency":200}}`,
	} {
		payload := `{"bytes":"` + base64.StdEncoding.EncodeToString([]byte(ev)) + `","p":"abcd"}`
		b = append(b, awsMessage(tb, "event", "chunk", []byte(payload))...)
	}
	return b
}

// TestUsageProviders: what Gemini's and Bedrock's responses report, read whole, split at
// every byte boundary into two chunks, and one byte at a time.
func TestUsageProviders(t *testing.T) {
	const eventstreamType = "application/vnd.amazon.eventstream"
	tests := []struct {
		name, contentType string
		api               API
		body              []byte
		want              Usage
	}{
		{"gemini json", "application/json; charset=UTF-8", APIGeminiGenerate, []byte(geminiJSON),
			Usage{PromptTokens: 8, CompletionTokens: 61, TotalTokens: 69, ReasoningTokens: 50, Known: true, PromptKnown: true, ContentBytes: 48}},
		{"gemini sse", "text/event-stream", APIGeminiStream, []byte(geminiSSE),
			Usage{PromptTokens: 8, CompletionTokens: 57, TotalTokens: 65, CachedTokens: 4, ReasoningTokens: 50, Known: true, PromptKnown: true, ContentBytes: 11 + 22}},
		{"gemini array", "application/json", APIGeminiStream, []byte(geminiArray),
			Usage{PromptTokens: 8, CompletionTokens: 57, TotalTokens: 65, CachedTokens: 4, ReasoningTokens: 50, Known: true, PromptKnown: true, ContentBytes: 11 + 22}},
		{"gemini array sniffed", "", APIGeminiStream, []byte(" " + geminiArray),
			Usage{PromptTokens: 8, CompletionTokens: 57, TotalTokens: 65, CachedTokens: 4, ReasoningTokens: 50, Known: true, PromptKnown: true, ContentBytes: 11 + 22}},
		{"gemini array cut after the first chunk", "application/json", APIGeminiStream, []byte("[" + geminiChunk1 + ",{\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"bl"),
			Usage{PromptTokens: 8, TotalTokens: 8, PromptKnown: true, ContentBytes: 11 + 2}},
		{"gemini blocked prompt", "application/json", APIGeminiGenerate, []byte(`{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":9,"totalTokenCount":9}}`),
			Usage{PromptTokens: 9, TotalTokens: 9, Known: true, PromptKnown: true}},
		{"bedrock converse", "application/json", APIBedrockConverse, []byte(bedrockJSON),
			Usage{PromptTokens: 112, CompletionTokens: 9, TotalTokens: 121, CachedTokens: 100, Known: true, PromptKnown: true, ContentBytes: 22}},
		{"bedrock converse stream", eventstreamType, APIBedrockConverseStream, converseStream(t),
			Usage{PromptTokens: 42, CompletionTokens: 9, TotalTokens: 21, Known: true, PromptKnown: true, ContentBytes: 22}},
		{"bedrock converse stream without a content type", "", APIBedrockConverseStream, converseStream(t),
			Usage{PromptTokens: 42, CompletionTokens: 9, TotalTokens: 21, Known: true, PromptKnown: true, ContentBytes: 22}},
		{"bedrock invoke", "application/json", APIBedrockInvoke, []byte(`{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"Hi"}],"usage":{"input_tokens":15,"output_tokens":3}}`),
			Usage{PromptTokens: 15, CompletionTokens: 3, TotalTokens: 18, Known: true, PromptKnown: true, ContentBytes: 2}},
		{"bedrock invoke stream", eventstreamType, APIBedrockInvokeStream, invokeStream(t),
			Usage{PromptTokens: 20, CompletionTokens: 20, TotalTokens: 40, CachedTokens: 5, Known: true, PromptKnown: true, ContentBytes: 8}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			check := func(how string, chunks ...[]byte) {
				t.Helper()
				got, err := scanChunks(tc.api, tc.contentType, "", chunks...)
				if err != nil || got != tc.want {
					t.Fatalf("%s: %+v (%v)\nwant %+v", how, got, err, tc.want)
				}
			}
			check("whole", tc.body)
			for i := 1; i < len(tc.body); i++ {
				check("split", tc.body[:i], tc.body[i:])
			}
			check("bytes", splitBytes(tc.body)...)
		})
	}
}

// TestUsageProviderErrors: an error reported inside a 200 is classified by Google's status
// or AWS's exception, for the breaker.
func TestUsageProviderErrors(t *testing.T) {
	tests := []struct {
		name, contentType string
		api               API
		body              []byte
		want              ErrorKind
	}{
		{"gemini json quota", "application/json", APIGeminiGenerate, []byte(`{"error":{"code":429,"message":"Quota exceeded","status":"RESOURCE_EXHAUSTED"}}`), ErrorRateLimited},
		{"gemini sse overloaded", "text/event-stream", APIGeminiStream, []byte("data: " + geminiChunk1 + "\r\n\r\ndata: {\"error\":{\"code\":503,\"message\":\"The model is overloaded.\",\"status\":\"UNAVAILABLE\"}}\r\n\r\n"), ErrorServer},
		{"gemini array invalid argument", "application/json", APIGeminiStream, []byte("[" + geminiChunk1 + ",{\"error\":{\"code\":400,\"message\":\"bad\",\"status\":\"INVALID_ARGUMENT\"}}]"), ErrorClient},
		{"bedrock stream throttled", "application/vnd.amazon.eventstream", APIBedrockConverseStream,
			converseStream(t, awsMessage(t, "exception", "throttlingException", []byte(`{"message":"Too many requests, please wait before trying again."}`))), ErrorRateLimited},
		{"bedrock stream model error", "application/vnd.amazon.eventstream", APIBedrockConverseStream,
			converseStream(t, awsMessage(t, "exception", "modelStreamErrorException", []byte(`{"message":"x"}`))), ErrorServer},
		{"bedrock stream validation", "application/vnd.amazon.eventstream", APIBedrockInvokeStream,
			append(invokeStream(t), awsMessage(t, "exception", "validationException", []byte(`{"message":"x"}`))...), ErrorClient},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, chunks := range [][][]byte{{tc.body}, splitBytes(tc.body)} {
				got, err := scanChunks(tc.api, tc.contentType, "", chunks...)
				if err != nil || got.Error != tc.want {
					t.Fatalf("error %v (%v), want %v", got.Error, err, tc.want)
				}
			}
		})
	}
}

// TestCorruptEventStream: a checksum that does not match stops the reading with
// ErrCorruptEventStream, keeping what was read before; an oversized message is passed over.
func TestCorruptEventStream(t *testing.T) {
	body := converseStream(t)
	bad := bytes.Clone(body)
	bad[len(bad)-1] ^= 0xFF // the metadata event's message checksum
	u, err := scanChunks(APIBedrockConverseStream, "application/vnd.amazon.eventstream", "", bad)
	if !errors.Is(err, ErrCorruptEventStream) || u.Known || u.ContentBytes != 22 {
		t.Fatalf("%+v %v", u, err)
	}
	big := awsMessage(t, "event", "contentBlockDelta", []byte(`{"delta":{"text":"`+string(bytes.Repeat([]byte("x"), maxAWSMessage))+`"}}`))
	u, err = scanChunks(APIBedrockConverseStream, "application/vnd.amazon.eventstream", "", append(big, body...))
	if err != nil || !u.Known || u.ContentBytes != 22 {
		t.Fatalf("after an oversized message: %+v %v", u, err)
	}
	u, err = scanChunks(APIBedrockConverseStream, "application/vnd.amazon.eventstream", "", []byte{0, 0, 0, 3, 1, 2, 3})
	if !errors.Is(err, ErrCorruptEventStream) || u.Known {
		t.Fatalf("a 3-byte message: %+v %v", u, err)
	}
}

func FuzzAWSEvents(f *testing.F) {
	f.Add(converseStream(f), uint8(0))
	f.Add(invokeStream(f), uint8(1))
	f.Add(awsMessage(f, "exception", "throttlingException", []byte(`{"message":"m"}`)), uint8(0))
	f.Fuzz(func(t *testing.T, body []byte, which uint8) {
		api := APIBedrockConverseStream
		if which%2 == 1 {
			api = APIBedrockInvokeStream
		}
		whole, werr := scanChunks(api, "application/vnd.amazon.eventstream", "", body)
		split, serr := scanChunks(api, "application/vnd.amazon.eventstream", "", splitRandom(body, uint64(len(body)))...)
		if whole != split || (werr == nil) != (serr == nil) {
			t.Fatalf("whole %+v (%v), split %+v (%v)", whole, werr, split, serr)
		}
		if werr != nil && !errors.Is(werr, ErrCorruptEventStream) {
			t.Fatalf("error %v", werr)
		}
	})
}

func FuzzGeminiArray(f *testing.F) {
	f.Add([]byte(geminiArray))
	f.Add([]byte(`[{"a":"]\"}"},[1,2],3]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		whole, _ := scanChunks(APIGeminiStream, "application/json", "", body)
		split, _ := scanChunks(APIGeminiStream, "application/json", "", splitRandom(body, uint64(len(body)))...)
		if whole != split {
			t.Fatalf("whole %+v, split %+v", whole, split)
		}
		// A valid array reads as its elements sent as SSE events.
		var sse []byte
		var elems []json.RawMessage
		if json.Unmarshal(body, &elems) != nil || bytes.ContainsAny(body, "\r\n") {
			return
		}
		for _, e := range elems {
			sse = append(append(append(sse, "data: "...), e...), "\n\n"...)
		}
		if len(elems) == 0 {
			return
		}
		want, _ := scanChunks(APIGeminiStream, "text/event-stream", "", sse)
		if whole != want {
			t.Fatalf("array %+v, as SSE %+v", whole, want)
		}
	})
}
