package llmapi

import (
	"testing"
)

// OpenAI's audio transcriptions, as the API sends them: verbose_json and json with usage in
// tokens (gpt-4o-transcribe) or in seconds (whisper-1), and the SSE of a streamed
// transcription.
const (
	audioTokensJSON   = `{"text":"Hello there, general.","usage":{"type":"tokens","input_tokens":14,"input_token_details":{"text_tokens":0,"audio_tokens":14},"output_tokens":6,"total_tokens":20}}`
	audioDurationJSON = `{"task":"transcribe","language":"english","duration":9.215,"text":"Hello there.","segments":[{"id":0,"start":0.0,"end":9.2,"text":"Hello there."}],"usage":{"type":"duration","seconds":9.215}}`
	audioSSE          = "event: transcript.text.delta\ndata: {\"type\":\"transcript.text.delta\",\"delta\":\"Hello\",\"logprobs\":null}\n\n" +
		"data: {\"type\":\"transcript.text.delta\",\"delta\":\" there.\"}\n\n" +
		"data: {\"type\":\"transcript.text.done\",\"text\":\"Hello there.\",\"usage\":{\"type\":\"tokens\",\"input_tokens\":14,\"input_token_details\":{\"text_tokens\":0,\"audio_tokens\":14},\"output_tokens\":4,\"total_tokens\":18}}\n\n"
)

// TestUsageAudio: a transcription's or translation's usage, in tokens or in seconds, read
// whole, split at every byte boundary into two chunks, and one byte at a time.
func TestUsageAudio(t *testing.T) {
	tests := []struct {
		name, contentType string
		api               API
		body              string
		want              Usage
	}{
		{"tokens", "application/json", APIOpenAITranscriptions, audioTokensJSON,
			Usage{PromptTokens: 14, CompletionTokens: 6, TotalTokens: 20, Known: true, PromptKnown: true, ContentBytes: 21}},
		{"seconds, verbose_json", "application/json", APIOpenAITranscriptions, audioDurationJSON,
			Usage{AudioMillis: 9_215, Known: true, PromptKnown: true, ContentBytes: 12}},
		{"seconds rounded up to the millisecond", "application/json", APIOpenAITranslations, `{"text":"x","usage":{"type":"duration","seconds":3.00001}}`,
			Usage{AudioMillis: 3_001, Known: true, PromptKnown: true, ContentBytes: 1}},
		{"whole seconds", "application/json", APIOpenAITranslations, `{"usage":{"seconds":12,"type":"duration"},"text":""}`,
			Usage{AudioMillis: 12_000, Known: true, PromptKnown: true}},
		{"seconds with an exponent are not read", "application/json", APIOpenAITranscriptions, `{"text":"x","usage":{"type":"duration","seconds":1e2}}`,
			Usage{ContentBytes: 1}},
		{"negative seconds are not read", "application/json", APIOpenAITranscriptions, `{"text":"x","usage":{"type":"duration","seconds":-4.5}}`,
			Usage{ContentBytes: 1}},
		{"absurd seconds are not read", "application/json", APIOpenAITranscriptions, `{"usage":{"type":"duration","seconds":99999999999.5}}`,
			Usage{}},
		{"no usage: text only", "application/json", APIOpenAITranscriptions, `{"text":"Hello there."}`,
			Usage{ContentBytes: 12}},
		{"plain text format", "text/plain; charset=utf-8", APIOpenAITranscriptions, "Hello there.\n",
			Usage{}},
		{"streamed", "text/event-stream", APIOpenAITranscriptions, audioSSE,
			Usage{PromptTokens: 14, CompletionTokens: 4, TotalTokens: 18, Known: true, PromptKnown: true, ContentBytes: 12}},
		{"streamed, cut before the usage", "text/event-stream", APIOpenAITranscriptions, audioSSE[:len(audioSSE)-40],
			Usage{PromptTokens: 14, TotalTokens: 14, ContentBytes: 12}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(tc.body)
			check := func(how string, chunks ...[]byte) {
				t.Helper()
				got, err := scanChunks(tc.api, tc.contentType, "", chunks...)
				if err != nil || got != tc.want {
					t.Fatalf("%s: %+v (%v)\nwant %+v", how, got, err, tc.want)
				}
			}
			check("whole", body)
			for i := 1; i < len(body); i++ {
				check("split", body[:i], body[i:])
			}
			check("bytes", splitBytes(body)...)
			if want, ok := refUsage(tc.api, tc.contentType, body); ok && want != tc.want {
				t.Errorf("reference %+v", want)
			}
		})
	}
}

// FuzzMillis: the whole-document reader of seconds (millisOf) and the streaming one
// (jsonStream, fed one byte at a time) agree on every number, and both read what the
// reference computes in exact arithmetic.
func FuzzMillis(f *testing.F) {
	for _, s := range []string{"9.215", "0", "0.0005", "3.00001", "12", "1e2", "-4.5", "99999999999.5", "1000000000", "1000000000.0001", "0.1234567890123", "01", "1.", ".5"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, num string) {
		body := []byte(`{"usage":{"seconds":` + num + `}}`)
		whole, _ := scanChunks(APIOpenAITranscriptions, "application/json", "", body)
		streamed, _ := scanChunks(APIOpenAITranscriptions, "application/json", "", splitBytes(body)...)
		if whole != streamed {
			t.Fatalf("%q: whole %+v, byte by byte %+v", num, whole, streamed)
		}
		if want, ok := refUsage(APIOpenAITranscriptions, "application/json", body); ok && want != whole {
			t.Fatalf("%q: %+v, reference %+v", num, whole, want)
		}
		if whole.AudioMillis < 0 || whole.AudioMillis > maxCount {
			t.Fatalf("%q: %d ms", num, whole.AudioMillis)
		}
	})
}
