package llmapi_test

import (
	"fmt"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
)

// A request's life: read what admission needs from the body, make sure a
// streamed response will report its usage, then read that usage from the
// response chunks as they pass, however they are split.
func Example() {
	api := llmapi.APIFromPath("/openai/v1/chat/completions?trace=1")
	body := []byte(`{"model":"gpt-4o-mini","stream":true,"max_tokens":256,"messages":[{"role":"user","content":"Hello!"}]}`)

	var f llmapi.RequestFields
	if err := llmapi.ScanRequest(api, body, &f); err != nil {
		fmt.Println("bad request:", err)
		return
	}
	fmt.Println(api, f.Model, f.MaxTokens, f.Stream, f.PromptBytes)

	if injected, ok := llmapi.InjectIncludeUsage(api, body); ok {
		fmt.Println(string(injected))
	}

	var s llmapi.UsageScanner
	s.Reset(api, "text/event-stream", "")
	s.Write([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"Hi!\"}}]}\n\nda"))
	s.Write([]byte("ta: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\ndata: [DONE]\n\n"))
	u := s.Finish()
	fmt.Println(u.PromptTokens, u.CompletionTokens, u.TotalTokens, u.Known, u.ContentBytes)
	// Output:
	// openai.chat gpt-4o-mini 256 true 6
	// {"model":"gpt-4o-mini","stream":true,"max_tokens":256,"messages":[{"role":"user","content":"Hello!"}],"stream_options":{"include_usage":true}}
	// 9 2 11 true 3
}

// Classification rules read single fields by path.
func ExampleField() {
	body := []byte(`{"model":"claude-sonnet-4-5","metadata":{"user_id":"acct-42","feature":"batch_summarize"}}`)
	feature, ok := llmapi.Field(body, "metadata.feature")
	fmt.Println(feature, ok)
	_, ok = llmapi.Field(body, "metadata.tier")
	fmt.Println(ok)
	// Output:
	// batch_summarize true
	// false
}
