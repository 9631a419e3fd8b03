package mock

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestModelProviderCheck: with a model table, a provider is answered only for its own models;
// another provider's model, or one no entry matches, gets 404 model_not_found in the API's
// format. Requests without x-llm-provider, or for an unlisted provider, are not checked.
func TestModelProviderCheck(t *testing.T) {
	_, url, client := startServer(t, Options{ModelProviders: []ModelProvider{
		{Match: "deepseek-*", Provider: "deepseek"}, {Match: "qwen-*", Provider: "qwen"}, {Match: "local-*", Provider: "local"},
	}})
	chat := func(model string) string {
		return `{"model":"` + model + `","max_tokens":3,"messages":[{"role":"user","content":"hi"}]}`
	}
	tests := []struct {
		provider, model string
		status          int
	}{
		{"deepseek", "deepseek-chat", 200},
		{"qwen", "qwen-plus", 200},
		{"qwen", "deepseek-chat", 404},
		{"local", "deepseek-chat", 404},
		{"local", "gpt-4o", 404}, // matches no entry
		{"local", "local-llama", 200},
		{"", "deepseek-chat", 200},       // no provider header: not checked
		{"openai", "deepseek-chat", 200}, // a provider the table does not name
	}
	for _, tt := range tests {
		headers := map[string]string{}
		if tt.provider != "" {
			headers[ProviderHeader] = tt.provider
		}
		resp, body, err := call(t, client, "POST", url+"/v1/chat/completions", chat(tt.model), headers)
		if err != nil || resp.StatusCode != tt.status {
			t.Errorf("%s to %q: %d %s (%v), want %d", tt.model, tt.provider, resp.StatusCode, body, err, tt.status)
			continue
		}
		if tt.status != 404 {
			continue
		}
		var e struct {
			Error struct{ Type, Code, Param, Message string }
		}
		if err := json.Unmarshal(body, &e); err != nil || e.Error.Code != "model_not_found" || e.Error.Param != "model" ||
			e.Error.Type != "invalid_request_error" || !strings.Contains(e.Error.Message, tt.model) {
			t.Errorf("%s to %s: body %s", tt.model, tt.provider, body)
		}
	}
	// Anthropic's format.
	resp, body, _ := call(t, client, "POST", url+"/v1/messages",
		`{"model":"deepseek-chat","max_tokens":3,"messages":[{"role":"user","content":"hi"}]}`, map[string]string{ProviderHeader: "qwen"})
	var a struct {
		Type  string
		Error struct{ Type, Message string }
	}
	if err := json.Unmarshal(body, &a); err != nil || resp.StatusCode != 404 || a.Type != "error" || a.Error.Type != "not_found_error" ||
		!strings.Contains(a.Error.Message, "deepseek-chat") {
		t.Errorf("anthropic: %d %s", resp.StatusCode, body)
	}
}

func TestModelProvidersValidated(t *testing.T) {
	_, err := New(Options{ModelProviders: []ModelProvider{{Match: "[", Provider: "x"}, {Match: "a*"}}})
	if err == nil || !strings.Contains(err.Error(), "model glob") || !strings.Contains(err.Error(), "needs both") {
		t.Errorf("New = %v", err)
	}
}
