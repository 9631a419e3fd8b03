package mock

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws/protocol/eventstream"
)

const geminiBody = `{"contents":[{"role":"user","parts":[{"text":"Why do ships have bulkheads?"}]}],"systemInstruction":{"parts":[{"text":"Be brief."}]},"generationConfig":{"maxOutputTokens":5}}`

// geminiChunk is what a test reads of a GenerateContentResponse or of an error.
type geminiChunk struct {
	Candidates []struct {
		Content struct {
			Parts []struct {
				Text string `json:"text"`
			} `json:"parts"`
		} `json:"content"`
		FinishReason string `json:"finishReason"`
	} `json:"candidates"`
	UsageMetadata *struct {
		PromptTokenCount     int64 `json:"promptTokenCount"`
		CandidatesTokenCount int64 `json:"candidatesTokenCount"`
		TotalTokenCount      int64 `json:"totalTokenCount"`
	} `json:"usageMetadata"`
	Error *googleErrorDetail `json:"error"`
}

// TestGeminiStreamAsJSONArray: streamGenerateContent without alt=sse answers a JSON array of
// chunks, each with the usage so far, the last one final; an error inside the 200 is the
// array's last element, and a disconnect leaves the array open.
func TestGeminiStreamAsJSONArray(t *testing.T) {
	_, base, hc := startServer(t, Options{})
	url := base + "/v1beta/models/gemini-2.5-pro:streamGenerateContent"
	wantPrompt := int64((len("Why do ships have bulkheads?") + len("Be brief.") + 3) / 4)

	resp, body, err := call(t, hc, "POST", url, geminiBody, nil)
	if err != nil || resp.StatusCode != 200 || resp.Header.Get("Content-Type") != contentTypeJSON {
		t.Fatalf("%v %d %v", err, resp.StatusCode, resp.Header)
	}
	if !bytes.HasPrefix(body, []byte("[{")) || !bytes.HasSuffix(body, []byte("}]")) || !bytes.Contains(body, []byte("},\r\n{")) {
		t.Errorf("not a streamed JSON array: %s", body)
	}
	var chunks []geminiChunk
	if err := json.Unmarshal(body, &chunks); err != nil {
		t.Fatal(err)
	}
	if len(chunks) != 6 {
		t.Fatalf("%d chunks, want 5 with text and the final one", len(chunks))
	}
	var text strings.Builder
	for i, c := range chunks {
		text.WriteString(c.Candidates[0].Content.Parts[0].Text)
		if c.UsageMetadata == nil || c.UsageMetadata.PromptTokenCount != wantPrompt || c.UsageMetadata.CandidatesTokenCount != int64(min(i+1, 5)) {
			t.Errorf("chunk %d usage %+v", i, c.UsageMetadata)
		}
	}
	last := chunks[len(chunks)-1]
	if last.Candidates[0].FinishReason != "STOP" || last.UsageMetadata.TotalTokenCount != wantPrompt+5 || text.Len() != 5*BytesPerToken {
		t.Errorf("last chunk %+v, text %q", last, text.String())
	}

	_, body, _ = call(t, hc, "POST", url, geminiBody, map[string]string{HeaderStreamError: "429"})
	if err := json.Unmarshal(body, &chunks); err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	if e := chunks[len(chunks)-1].Error; len(chunks) != 2 || e == nil || e.Code != 429 || e.Status != "RESOURCE_EXHAUSTED" {
		t.Errorf("stream error: %s", body)
	}

	_, body, readErr := call(t, hc, "POST", url, geminiBody, map[string]string{HeaderDisconnectAfter: "2"})
	if readErr == nil || bytes.HasSuffix(body, []byte("]")) || bytes.Count(body, []byte(`"candidates"`)) != 2 {
		t.Errorf("disconnect after 2: %v %s", readErr, body)
	}

	_, body, _ = call(t, hc, "POST", url+"?alt=sse", geminiBody, map[string]string{HeaderNoUsage: "1"})
	events := parseSSE(body)
	if len(events) != 6 || strings.Contains(string(body), "usageMetadata") || events[0].name != "" {
		t.Errorf("alt=sse without usage: %s", body)
	}
}

// TestGeminiCountAndEmbed: countTokens counts the prompt and uses nothing; embedContent
// answers one vector of the asked length and the prompt's usage.
func TestGeminiCountAndEmbed(t *testing.T) {
	s, base, hc := startServer(t, Options{})
	resp, body, _ := call(t, hc, "POST", base+"/v1beta/models/gemini-2.5-flash:countTokens", geminiBody, nil)
	wantPrompt := (len("Why do ships have bulkheads?") + len("Be brief.") + 3) / 4
	if resp.StatusCode != 200 || string(body) != `{"totalTokens":`+jsonInt(wantPrompt)+`}` ||
		resp.Header.Get(HeaderPromptTokens) != "0" || resp.Header.Get(HeaderCompletionTokens) != "0" {
		t.Errorf("countTokens %d %s %v", resp.StatusCode, body, resp.Header)
	}
	resp, body, _ = call(t, hc, "POST", base+"/v1/models/text-embedding-004:embedContent",
		`{"model":"models/text-embedding-004","content":{"parts":[{"text":"bulkheads"},{"text":" and budgets"}]},"outputDimensionality":8}`, nil)
	var e struct {
		Embedding struct {
			Values []float32 `json:"values"`
		} `json:"embedding"`
		UsageMetadata struct {
			PromptTokenCount int64 `json:"promptTokenCount"`
			TotalTokenCount  int64 `json:"totalTokenCount"`
		} `json:"usageMetadata"`
	}
	if err := json.Unmarshal(body, &e); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d %s %v", resp.StatusCode, body, err)
	}
	if len(e.Embedding.Values) != 8 || e.UsageMetadata.PromptTokenCount != 6 || e.UsageMetadata.TotalTokenCount != 6 || resp.Header.Get(HeaderCompletionTokens) != "0" {
		t.Errorf("embedContent %s", body)
	}
	st := s.Stats()
	if st.ByPath["/v1beta/models/{model}:countTokens"] != 1 || st.ByPath["/v1/models/{model}:embedContent"] != 1 {
		t.Errorf("paths %v", st.ByPath)
	}
	resp, body, _ = call(t, hc, "POST", base+"/v1beta/models/gemini-2.5-flash:generateContent", `{"contents":[]}`, nil)
	if resp.StatusCode != 400 || !strings.Contains(string(body), `"status":"INVALID_ARGUMENT"`) {
		t.Errorf("empty contents: %d %s", resp.StatusCode, body)
	}
}

func jsonInt(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// awsMessage is one decoded message of an event stream.
type awsMessage struct {
	kind, name string
	payload    string
}

// decodeEventStream reads every whole message of an AWS event stream.
func decodeEventStream(t *testing.T, body []byte) []awsMessage {
	t.Helper()
	var out []awsMessage
	dec := eventstream.NewDecoder()
	r := bytes.NewReader(body)
	for r.Len() > 0 {
		m, err := dec.Decode(r, nil)
		if err != nil {
			break
		}
		get := func(name string) string {
			if v, ok := m.Headers.Get(name).(eventstream.StringValue); ok {
				return string(v)
			}
			return ""
		}
		msg := awsMessage{kind: get(":message-type"), name: get(":event-type"), payload: string(m.Payload)}
		if msg.kind == "exception" {
			msg.name = get(":exception-type")
		}
		if get(":content-type") != "application/json" {
			t.Errorf("message %+v has content type %q", msg, get(":content-type"))
		}
		out = append(out, msg)
	}
	return out
}

func messageNames(ms []awsMessage) string {
	names := make([]string, len(ms))
	for i, m := range ms {
		names[i] = m.name
	}
	return strings.Join(names, ",")
}

// TestConverseStreamFraming: ConverseStream answers AWS's binary event stream, its events
// named as Bedrock names them and the usage in the metadata event; a percent-encoded model id
// is read as written; a stream error is an exception message, a no-usage fault leaves the
// usage out of the metadata.
func TestConverseStreamFraming(t *testing.T) {
	s, base, hc := startServer(t, Options{})
	url := base + "/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse-stream"
	body := `{"messages":[{"role":"user","content":[{"text":"Why do ships have bulkheads?"}]}],"system":[{"text":"Be brief."}],"inferenceConfig":{"maxTokens":3}}`
	resp, got, err := call(t, hc, "POST", url, body, nil)
	if err != nil || resp.StatusCode != 200 || resp.Header.Get("Content-Type") != contentTypeEventStream || resp.Header.Get("x-amzn-requestid") == "" {
		t.Fatalf("%v %d %v", err, resp.StatusCode, resp.Header)
	}
	ms := decodeEventStream(t, got)
	if n := messageNames(ms); n != "messageStart,contentBlockDelta,contentBlockDelta,contentBlockDelta,contentBlockStop,messageStop,metadata" {
		t.Fatalf("events %s", n)
	}
	wantPrompt := (len("Why do ships have bulkheads?") + len("Be brief.") + 3) / 4
	if meta := ms[len(ms)-1].payload; !strings.Contains(meta, `"usage":{"inputTokens":`+jsonInt(wantPrompt)+`,"outputTokens":3,"totalTokens":`+jsonInt(wantPrompt+3)+`}`) {
		t.Errorf("metadata %s", meta)
	}
	if ms[1].payload != `{"contentBlockIndex":0,"delta":{"text":"the "}}` {
		t.Errorf("delta %s", ms[1].payload)
	}
	reqs := s.Requests()
	if m := reqs[len(reqs)-1].Model; m != "anthropic.claude-3-haiku-20240307-v1:0" {
		t.Errorf("model %q", m)
	}
	if s.Stats().ByPath["/model/{modelId}/converse-stream"] != 1 {
		t.Errorf("paths %v", s.Stats().ByPath)
	}

	_, got, _ = call(t, hc, "POST", url, body, map[string]string{HeaderStreamError: "429"})
	ms = decodeEventStream(t, got)
	if last := ms[len(ms)-1]; messageNames(ms) != "messageStart,contentBlockDelta,throttlingException" || last.kind != "exception" || !strings.Contains(last.payload, `"message":"Rate limit`) {
		t.Errorf("stream error: %+v", ms)
	}
	_, got, _ = call(t, hc, "POST", url, body, map[string]string{HeaderNoUsage: "true"})
	ms = decodeEventStream(t, got)
	if meta := ms[len(ms)-1]; meta.name != "metadata" || strings.Contains(meta.payload, "usage") {
		t.Errorf("no-usage metadata %+v", meta)
	}
	_, got, readErr := call(t, hc, "POST", url, body, map[string]string{HeaderDisconnectAfter: "2"})
	if ms = decodeEventStream(t, got); readErr == nil || len(ms) != 2 {
		t.Errorf("disconnect after 2: %v, %d messages", readErr, len(ms))
	}

	resp, got, _ = call(t, hc, "POST", url, body, map[string]string{HeaderStatus: "503"})
	if resp.StatusCode != 503 || resp.Header.Get("x-amzn-errortype") != "ServiceUnavailableException" || !strings.HasPrefix(string(got), `{"message":"The server is overloaded`) {
		t.Errorf("503: %v %s", resp.Header, got)
	}
}

// TestInvokeModelStream: InvokeModelWithResponseStream wraps each Anthropic event in a chunk,
// base64 in its "bytes"; InvokeModel of a model other than Anthropic's is a ValidationException.
func TestInvokeModelStream(t *testing.T) {
	_, base, hc := startServer(t, Options{})
	body := `{"anthropic_version":"bedrock-2023-05-31","max_tokens":2,"system":"Be brief.","messages":[{"role":"user","content":"hi"}]}`
	resp, got, _ := call(t, hc, "POST", base+"/model/us.anthropic.claude-sonnet-4-20250514-v1:0/invoke-with-response-stream", body, nil)
	ms := decodeEventStream(t, got)
	if resp.StatusCode != 200 || len(ms) != 7 || messageNames(ms) != "chunk,chunk,chunk,chunk,chunk,chunk,chunk" {
		t.Fatalf("%d: %+v", resp.StatusCode, ms)
	}
	var kinds []string
	for _, m := range ms {
		var c struct {
			Bytes []byte `json:"bytes"`
		}
		if err := json.Unmarshal([]byte(m.payload), &c); err != nil {
			t.Fatal(err)
		}
		var ev struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal(c.Bytes, &ev); err != nil {
			t.Fatalf("%s: %v", c.Bytes, err)
		}
		kinds = append(kinds, ev.Type)
	}
	if strings.Join(kinds, ",") != "message_start,content_block_start,content_block_delta,content_block_delta,content_block_stop,message_delta,message_stop" {
		t.Errorf("events %v", kinds)
	}
	resp, got, _ = call(t, hc, "POST", base+"/model/meta.llama3-8b-instruct-v1:0/invoke", `{"prompt":"hi"}`, nil)
	if resp.StatusCode != 400 || resp.Header.Get("x-amzn-errortype") != "ValidationException" {
		t.Errorf("non-Anthropic invoke: %d %v %s", resp.StatusCode, resp.Header, got)
	}
}

// TestAzureRoutes: Azure OpenAI's deployment paths need api-version and name the model when
// the body does not; the v1 paths take the body's model; errors, in a response and inside a
// stream, take Azure's shape.
func TestAzureRoutes(t *testing.T) {
	s, base, hc := startServer(t, Options{})
	chat := `{"max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`
	resp, body, _ := call(t, hc, "POST", base+"/openai/deployments/prod-4o/chat/completions", chat, nil)
	if resp.StatusCode != 404 || !strings.HasPrefix(string(body), `{"error":{"code":"404","message":"Resource not found`) {
		t.Errorf("no api-version: %d %s", resp.StatusCode, body)
	}
	resp, body, _ = call(t, hc, "POST", base+"/openai/deployments/prod-4o/chat/completions?api-version=2024-10-21", chat, nil)
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"model":"prod-4o"`) {
		t.Errorf("deployment: %d %s", resp.StatusCode, body)
	}
	resp, body, _ = call(t, hc, "POST", base+"/openai/v1/chat/completions", `{"model":"gpt-4o",`+chat[1:], map[string]string{HeaderStatus: "503"})
	if resp.StatusCode != 503 || !strings.HasPrefix(string(body), `{"error":{"code":"ServiceUnavailable","message":"The server is overloaded`) {
		t.Errorf("v1 503: %d %s", resp.StatusCode, body)
	}
	_, body, _ = call(t, hc, "POST", base+"/openai/v1/chat/completions", `{"model":"gpt-4o","stream":true,`+chat[1:], map[string]string{HeaderStreamError: "429"})
	if ev := parseSSE(body); len(ev) != 3 || ev[2].data != `{"error":{"code":"429","message":"Rate limit reached for requests. (injected by mockllm)"}}` {
		t.Errorf("stream error: %s", body)
	}
	if resp, _, _ := call(t, hc, "POST", base+"/openai/v1/messages", `{"model":"m"}`, nil); resp.StatusCode != 404 {
		t.Errorf("/openai/v1/messages: %d", resp.StatusCode)
	}
	st := s.Stats()
	if st.ByPath["/openai/deployments/{deployment}/chat/completions"] != 2 || st.ByPath["/openai/v1/chat/completions"] != 2 {
		t.Errorf("paths %v", st.ByPath)
	}
}

// TestModelCheckInEachDialect: a provider sent a model it does not serve answers 404 in the
// error shape of the API called.
func TestModelCheckInEachDialect(t *testing.T) {
	_, base, hc := startServer(t, Options{ModelProviders: []ModelProvider{{Match: "gemini-*", Provider: "google"}, {Match: "*", Provider: "bedrock"}}})
	h := map[string]string{ProviderHeader: "bedrock"}
	resp, body, _ := call(t, hc, "POST", base+"/v1beta/models/gemini-2.5-flash:generateContent", geminiBody, h)
	if resp.StatusCode != 404 || !strings.Contains(string(body), `"status":"NOT_FOUND"`) {
		t.Errorf("gemini: %d %s", resp.StatusCode, body)
	}
	h[ProviderHeader] = "google"
	resp, body, _ = call(t, hc, "POST", base+"/model/anthropic.claude-v2/converse", `{"messages":[{"role":"user","content":[{"text":"x"}]}]}`, h)
	if resp.StatusCode != 404 || resp.Header.Get("x-amzn-errortype") != "ResourceNotFoundException" || !strings.HasPrefix(string(body), `{"message":`) {
		t.Errorf("bedrock: %d %v %s", resp.StatusCode, resp.Header, body)
	}
}

func TestRouteOf(t *testing.T) {
	tests := []struct {
		url  string
		want route
		ok   bool
	}{
		{"/v1/messages", route{api: apiMessages, dialect: dialectAnthropic, label: "/v1/messages"}, true},
		{"/openai/v1/embeddings", route{api: apiEmbeddings, dialect: dialectAzure, label: "/openai/v1/embeddings"}, true},
		{"/openai/deployments/d1/embeddings?api-version=x", route{api: apiEmbeddings, dialect: dialectAzure, model: "d1", label: "/openai/deployments/{deployment}/embeddings"}, true},
		{"/openai/deployments/d1/responses", route{}, false},
		{"/openai/deployments//chat/completions", route{}, false},
		{"/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse&key=k", route{api: apiGeminiStream, dialect: dialectGemini, model: "gemini-2.0-flash", sse: true, label: "/v1beta/models/{model}:streamGenerateContent"}, true},
		{"/v1beta/models/gemini-2.0-flash:batchEmbedContents", route{}, false},
		{"/v1beta/models/:generateContent", route{}, false},
		{"/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Ainference-profile%2Fus.anthropic.claude/invoke", route{api: apiInvoke, dialect: dialectBedrock, model: "arn:aws:bedrock:us-east-1:1:inference-profile/us.anthropic.claude", label: "/model/{modelId}/invoke"}, true},
		{"/model/m/unknown", route{}, false},
		{"/model//converse", route{}, false},
		{"/v2/chat/completions", route{}, false},
	}
	for _, tt := range tests {
		req, err := http.NewRequest("POST", "http://x"+tt.url, nil)
		if err != nil {
			t.Fatal(err)
		}
		got, ok := routeOf(req.URL)
		if ok != tt.ok || got != tt.want {
			t.Errorf("%s: %+v %v, want %+v %v", tt.url, got, ok, tt.want, tt.ok)
		}
	}
}
