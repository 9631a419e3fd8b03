package llmapi

import (
	"bytes"
	"compress/gzip"
	"strings"
	"testing"
)

func TestResponseModel(t *testing.T) {
	tests := []struct {
		name, body, ct, want string
		api                  API
	}{
		{"OpenAI JSON", `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o-2024-08-06","choices":[]}`, "application/json", "gpt-4o-2024-08-06", APIOpenAIChat},
		{"OpenAI stream", "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\" : \"deepseek-chat\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n", "text/event-stream", "deepseek-chat", APIOpenAIChat},
		{"Anthropic stream", "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5\",\"usage\":{\"input_tokens\":3}}}\n\n", "text/event-stream", "claude-sonnet-4-5", APIAnthropicMessages},
		{"Responses API event", "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"model\":\"gpt-4.1\"}}\n\n", "text/event-stream", "gpt-4.1", APIOpenAIResponses},
		{"a quoted mention in content is not the model", `{"choices":[{"message":{"content":"say \"model\": \"fake\""}}],"model":"real"}`, "application/json", "real", APIOpenAIChat},
		{"a value model is not a key", `{"object":"model","model":"m1"}`, "application/json", "m1", APIOpenAIChat},
		{"no model", `{"choices":[]}`, "application/json", "", APIOpenAIChat},
		{"a model that is not a string", `{"model":null,"choices":[]}`, "application/json", "", APIOpenAIChat},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Whole, and one byte at a time: a chunk may end anywhere.
			for _, step := range []int{len(tt.body), 1} {
				s := &UsageScanner{}
				s.Reset(tt.api, tt.ct, "")
				s.SniffModel()
				for i := 0; i < len(tt.body); i += step {
					s.Write([]byte(tt.body[i:min(i+step, len(tt.body))]))
				}
				s.Finish()
				if got := s.Model(); got != tt.want {
					t.Fatalf("step %d: Model() = %q, want %q", step, got, tt.want)
				}
			}
		})
	}
}

func TestResponseModelOnlyWhenAskedAndBounded(t *testing.T) {
	body := []byte(`{"model":"m","choices":[]}`)
	s := &UsageScanner{}
	s.Reset(APIOpenAIChat, "application/json", "")
	s.Write(body)
	if s.Model() != "" {
		t.Fatal("the model was sniffed without SniffModel")
	}
	// A model named after the first 8 KiB is not looked for.
	late := []byte(`{"pad":"` + strings.Repeat("x", maxModelSniff) + `","model":"late"}`)
	s.Reset(APIOpenAIChat, "application/json", "")
	s.SniffModel()
	s.Write(late)
	if s.Model() != "" || len(s.model.buf) > maxModelSniff {
		t.Fatalf("model %q, %d bytes kept", s.Model(), len(s.model.buf))
	}
	// Reset forgets the last response's model.
	s.Reset(APIOpenAIChat, "application/json", "")
	s.SniffModel()
	s.Write(body)
	s.Reset(APIOpenAIChat, "application/json", "")
	if s.Model() != "" {
		t.Fatal("Reset kept the model")
	}
}

func TestResponseModelOfCompressedBody(t *testing.T) {
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	_, _ = zw.Write([]byte(`{"id":"x","model":"qwen-plus","choices":[]}`))
	_ = zw.Close()
	s := &UsageScanner{}
	s.Reset(APIOpenAIChat, "application/json", "gzip")
	s.SniffModel()
	s.Write(b.Bytes())
	s.Finish()
	if got := s.Model(); got != "qwen-plus" {
		t.Fatalf("Model() = %q", got)
	}
}

// FuzzFindModel checks that whatever the bytes, the model found is a string that appears
// quoted in them, after a "model" key, and that finding it does not depend on how the bytes
// were split into chunks.
func FuzzFindModel(f *testing.F) {
	for _, s := range []string{`{"model":"a"}`, `{"model" :  "b"`, `"model"`, `\"model\":\"x\"`, `{"model":1,"x":{"model":"c"}}`, ``} {
		f.Add([]byte(s), 3)
	}
	f.Fuzz(func(t *testing.T, b []byte, split int) {
		model, ok := findModel(b)
		if !ok {
			if model != "" {
				t.Fatalf("not found but %q", model)
			}
		} else if model == "" || !bytes.Contains(b, []byte(`"`+model+`"`)) || strings.ContainsAny(model, `"\`) {
			t.Fatalf("findModel(%q) = %q", b, model)
		}
		var m modelSniffer
		m.on = true
		if split <= 0 {
			split = 1
		}
		for i := 0; i < len(b); i += split {
			m.write(b[i:min(i+split, len(b))])
		}
		if len(b) <= maxModelSniff && m.model != model {
			t.Fatalf("in chunks of %d: %q, whole: %q", split, m.model, model)
		}
	})
}
