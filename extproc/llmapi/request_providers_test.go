package llmapi

import (
	"errors"
	"testing"
)

// TestScanRequestProviders: the request shapes of Gemini and Bedrock, read for the estimate
// (prompt text and media), the bound (output limit, choices) and the stream flag; the model is
// the path's (ParsePath), never the body's.
func TestScanRequestProviders(t *testing.T) {
	tests := []struct {
		name string
		path string
		body string
		want RequestFields
		err  error
	}{
		{"gemini generateContent", "/v1beta/models/gemini-2.5-flash:generateContent",
			`{"contents":[{"role":"user","parts":[{"text":"Why is the sky blue?"},{"inlineData":{"mimeType":"image/jpeg","data":"AAAA"}}]},{"role":"model","parts":[{"text":"Rayleigh."}]}],` +
				`"systemInstruction":{"parts":[{"text":"Be brief."}]},"generationConfig":{"maxOutputTokens":200,"candidateCount":2,"temperature":0.2}}`,
			RequestFields{MaxTokens: 200, HasMaxTokens: true, N: 2, Choices: 2, PromptBytes: 20 + 9 + 9, Images: 1}, nil},
		{"gemini snake_case, streamed", "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
			`{"contents":[{"parts":[{"text":"hi"},{"inline_data":{"mime_type":"audio/wav","data":"AA"}},{"file_data":{"mime_type":"application/pdf","file_uri":"gs://x"}}]}],` +
				`"system_instruction":{"parts":[{"text":"s"}]},"generation_config":{"max_output_tokens":64}}`,
			RequestFields{MaxTokens: 64, HasMaxTokens: true, N: 1, Choices: 1, Stream: true, PromptBytes: 3, Audio: 1, Files: 1}, nil},
		{"gemini streamed array", "/v1beta/models/gemini-2.5-flash:streamGenerateContent",
			`{"contents":[{"parts":[{"text":"hi"}]}]}`,
			RequestFields{N: 1, Choices: 1, Stream: true, PromptBytes: 2}, nil},
		{"gemini OpenAI fields are not Gemini's", "/v1beta/models/g:generateContent",
			`{"contents":[],"max_tokens":10,"n":3}`,
			RequestFields{N: 1, Choices: 1}, nil},
		{"gemini embedContent", "/v1beta/models/text-embedding-004:embedContent",
			`{"model":"models/text-embedding-004","content":{"parts":[{"text":"embed this"}]},"taskType":"RETRIEVAL_DOCUMENT"}`,
			RequestFields{Model: "models/text-embedding-004", N: 1, Choices: 1, PromptBytes: 10}, nil},
		{"gemini countTokens", "/v1beta/models/g:countTokens",
			`{"contents":[{"parts":[{"text":"count"}]}]}`,
			RequestFields{N: 1, Choices: 1, PromptBytes: 5}, nil},
		{"gemini candidateCount 0", "/v1beta/models/g:generateContent",
			`{"generationConfig":{"candidateCount":0}}`,
			RequestFields{N: 1, Choices: 1}, ErrFieldValue},
		{"gemini generationConfig not an object", "/v1beta/models/g:generateContent",
			`{"generationConfig":[1]}`,
			RequestFields{N: 1, Choices: 1}, ErrFieldType},
		{"bedrock converse", "/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse",
			`{"messages":[{"role":"user","content":[{"text":"Hello"},{"image":{"format":"png","source":{"bytes":"AAAA"}}},{"document":{"format":"pdf","name":"d","source":{"bytes":"AA"}}}]},` +
				`{"role":"assistant","content":[{"toolUse":{"toolUseId":"t","name":"f","input":{"q":1}}}]},{"role":"user","content":[{"toolResult":{"toolUseId":"t","content":[{"text":"42"}]}}]}],` +
				`"system":[{"text":"Be brief."}],"inferenceConfig":{"maxTokens":300,"temperature":0.5}}`,
			RequestFields{MaxTokens: 300, HasMaxTokens: true, N: 1, Choices: 1, PromptBytes: 5 + 2 + 9, Images: 1, Files: 1}, nil},
		{"bedrock converse-stream", "/model/amazon.nova-lite-v1:0/converse-stream",
			`{"messages":[{"role":"user","content":[{"text":"Hi"},{"video":{"format":"mp4"}},{"audio":{"format":"mp3"}}]}],"max_tokens":99}`,
			RequestFields{N: 1, Choices: 1, Stream: true, PromptBytes: 2, Audio: 1, Files: 1}, nil},
		{"bedrock converse maxTokens negative", "/model/m/converse",
			`{"inferenceConfig":{"maxTokens":-1}}`,
			RequestFields{N: 1, Choices: 1}, ErrFieldValue},
		{"bedrock invoke anthropic", "/model/anthropic.claude-3-haiku-20240307-v1:0/invoke",
			`{"anthropic_version":"bedrock-2023-05-31","max_tokens":512,"system":"sys","messages":[{"role":"user","content":"Hello"}],"metadata":{"user_id":"u-9"},"user":"x"}`,
			RequestFields{MaxTokens: 512, HasMaxTokens: true, N: 1, Choices: 1, PromptBytes: 3 + 5, User: "u-9"}, nil},
		{"bedrock invoke anthropic streamed", "/model/anthropic.claude-3-haiku-20240307-v1:0/invoke-with-response-stream",
			`{"anthropic_version":"bedrock-2023-05-31","max_tokens":64,"messages":[{"role":"user","content":"Hello"}]}`,
			RequestFields{MaxTokens: 64, HasMaxTokens: true, N: 1, Choices: 1, Stream: true, PromptBytes: 5}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := ParsePath(tc.path)
			var got RequestFields
			err := ScanRequest(r.API, []byte(tc.body), &got)
			want := tc.want
			want.BestOf, want.Prompts = 1, 1
			if public(got) != want {
				t.Errorf("%v: got  %+v\nwant %+v", r.API, public(got), want)
			}
			if !errors.Is(err, tc.err) || (err == nil) != (tc.err == nil) {
				t.Errorf("err = %v, want %v", err, tc.err)
			}
			ref, rerr := refScanRequest(r.API, []byte(tc.body))
			if ref != public(got) || (rerr == nil) != (err == nil) {
				t.Errorf("reference: %+v (%v)", ref, rerr)
			}
		})
	}
}
