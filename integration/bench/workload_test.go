package bench

import (
	"encoding/json"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

func TestChatBody(t *testing.T) {
	body, err := ChatBody(BodySize)
	if err != nil {
		t.Fatal(err)
	}
	if len(body) != BodySize {
		t.Errorf("len = %d, want %d", len(body), BodySize)
	}
	var doc struct {
		Model    string `json:"model"`
		Stream   bool   `json:"stream"`
		Messages []struct{ Role, Content string }
	}
	if err := json.Unmarshal(body, &doc); err != nil {
		t.Fatalf("not JSON: %v", err)
	}
	if !doc.Stream || doc.Model != "deepseek-chat" || len(doc.Messages) != 2 {
		t.Errorf("body = %+v, want a streamed deepseek-chat request with two messages", doc)
	}
	// The server's scanner reads it as it would any SDK's request.
	var f llmapi.RequestFields
	if err := llmapi.ScanRequest(llmapi.APIOpenAIChat, body, &f); err != nil {
		t.Fatalf("ScanRequest: %v", err)
	}
	if !f.Stream || f.MaxTokens != 256 || f.PromptBytes == 0 {
		t.Errorf("scanned %+v, want stream, max_tokens 256 and a prompt", f)
	}
	if _, err := ChatBody(100); err == nil {
		t.Error("ChatBody(100) succeeded, want an error: the fixed fields alone are longer")
	}
}

func TestSSEChunksReportUsage(t *testing.T) {
	var s llmapi.UsageScanner
	s.Reset(llmapi.APIOpenAIChat, "text/event-stream", "")
	for _, c := range SSEChunks {
		s.Write([]byte(c))
	}
	u := s.Finish()
	s.Close()
	if !u.Known || u.PromptTokens != 231 || u.CompletionTokens != 17 || u.TotalTokens != 248 {
		t.Errorf("usage = %+v, want 231 + 17 = 248, known", u)
	}
}

func TestCheck(t *testing.T) {
	sent := func(n int) []envoysim.Record {
		var out []envoysim.Record
		for range n {
			out = append(out, envoysim.Record{Sent: &extprocv3.ProcessingRequest{}}, envoysim.Record{Received: &extprocv3.ProcessingResponse{}})
		}
		return out
	}
	admittedUp := &envoysim.UpstreamSeen{Headers: envoysim.H("x-bulkhead-feature", "chat")}
	plainUp := &envoysim.UpstreamSeen{Headers: envoysim.H("content-type", "application/json")}
	tests := []struct {
		name     string
		res      envoysim.Result
		admitted bool
		wantErr  string
	}{
		{"admitted by llm-bulkhead", envoysim.Result{Status: 200, Upstream: admittedUp, Exchange: sent(StreamMessages)}, true, ""},
		{"passed by the no-op server", envoysim.Result{Status: 200, Upstream: plainUp, Exchange: sent(StreamMessages)}, false, ""},
		{"refused", envoysim.Result{Status: 503, Local: envoysim.LocalImmediate}, true, "local reply immediate_response"},
		{"reset", envoysim.Result{Status: 200, Reset: true}, true, "reset"},
		{"upstream error status", envoysim.Result{Status: 500, Upstream: plainUp}, false, "status 500"},
		{"protocol problem", envoysim.Result{Status: 200, Upstream: admittedUp, Problems: []envoysim.Problem{{Kind: envoysim.ProblemSpurious, Detail: "x"}}}, true, "spurious"},
		{"no upstream", envoysim.Result{Status: 200}, true, "not called"},
		{"a message missing", envoysim.Result{Status: 200, Upstream: admittedUp, Exchange: sent(StreamMessages - 1)}, true, "messages sent"},
		{"not admitted by llm-bulkhead", envoysim.Result{Status: 200, Upstream: plainUp, Exchange: sent(StreamMessages)}, true, "not admitted"},
		{"admission headers from the no-op server", envoysim.Result{Status: 200, Upstream: admittedUp, Exchange: sent(StreamMessages)}, false, "no-op"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Check(&tt.res, tt.admitted)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("Check = %v, want nil", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("Check = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}
