package envoysim

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
)

// fakeLLM is a minimal OpenAI-compatible upstream: JSON or SSE chat
// completions, and a /who endpoint naming itself.
func fakeLLM(t *testing.T, name string) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		switch {
		case r.URL.Path == "/who":
			fmt.Fprintf(w, "%s %s", name, r.Header.Get("x-llm-provider"))
		case strings.Contains(string(body), `"stream":true`):
			w.Header().Set("content-type", "text/event-stream")
			fl := w.(http.Flusher)
			for _, tok := range []string{"Hel", "lo"} {
				fmt.Fprintf(w, "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":%q}}]}\n\n", tok)
				fl.Flush()
			}
			fmt.Fprint(w, "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n")
			fmt.Fprint(w, "data: [DONE]\n\n")
			fl.Flush()
		default:
			w.Header().Set("content-type", "application/json")
			fmt.Fprint(w, `{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func startProxy(t *testing.T, extproc string, upstream string, cfg FilterConfig, tune func(*Proxy)) *ProxyServer {
	t.Helper()
	s := newSim(t, extproc, cfg)
	p, err := NewProxy(s, upstream, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if tune != nil {
		tune(p)
	}
	ps, err := ServeProxy(p, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = ps.Close(ctx)
		p.Upstream().CloseIdleConnections()
	})
	return ps
}

func TestProxyOpenAISDK(t *testing.T) {
	ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		if req.GetResponseHeaders() != nil {
			return withCommon(req, &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{hvo("x-bulkhead-compartment", "chat", false)}}})
		}
		return cont(req)
	}))
	llm := fakeLLM(t, "primary")
	ps := startProxy(t, ts.addr, llm.URL, FilterConfig{Mode: ProcessingMode{RequestBody: BodyBuffered, ResponseBody: BodyStreamed}}, nil)
	client := openai.NewClient(option.WithBaseURL(ps.URL+"/v1/"), option.WithAPIKey("test"), option.WithMaxRetries(0))
	params := openai.ChatCompletionNewParams{Model: "m", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}}
	t.Run("non-streaming", func(t *testing.T) {
		var resp *http.Response
		c, err := client.Chat.Completions.New(context.Background(), params, option.WithResponseInto(&resp))
		if err != nil {
			t.Fatal(err)
		}
		if c.Choices[0].Message.Content != "Hello" || c.Usage.TotalTokens != 4 || resp.Header.Get("x-bulkhead-compartment") != "chat" {
			t.Fatalf("completion %+v headers %v", c, resp.Header)
		}
		ts.nextEnd(t)
	})
	t.Run("streaming", func(t *testing.T) {
		stream := client.Chat.Completions.NewStreaming(context.Background(), params)
		var text strings.Builder
		var total int64
		for stream.Next() {
			ch := stream.Current()
			if len(ch.Choices) > 0 {
				text.WriteString(ch.Choices[0].Delta.Content)
			}
			total += ch.Usage.TotalTokens
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if text.String() != "Hello" || total != 5 {
			t.Fatalf("text %q usage %d", text.String(), total)
		}
		end := ts.nextEnd(t)
		var bodies int
		for _, m := range end.received {
			if m.GetResponseBody() != nil {
				bodies++
			}
		}
		if bodies == 0 {
			t.Fatal("the processor saw no streamed response body")
		}
	})
}

func TestProxyLocalReplies(t *testing.T) {
	tests := []struct {
		name       string
		s          script
		wantStatus int
		wantBody   string
		wantHeader [2]string
	}{
		{
			name: "immediate response becomes the HTTP reply",
			s: func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
				return immediate(typev3.StatusCode_ServiceUnavailable, `{"error":{"type":"server_overloaded"}}`, "retry-after", "2", "x-bulkhead-reason", "bulkhead_full")
			},
			wantStatus: 503, wantBody: `{"error":{"type":"server_overloaded"}}`, wantHeader: [2]string{"Retry-After", "2"},
		},
		{
			name: "spurious reply becomes status_on_error",
			s: func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
				return &extprocv3.ProcessingResponse{}
			},
			wantStatus: 500,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t, scripted(tc.s))
			llm := fakeLLM(t, "primary")
			ps := startProxy(t, ts.addr, llm.URL, FilterConfig{}, nil)
			resp, err := http.Post(ps.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m"}`))
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			ts.nextEnd(t)
			if resp.StatusCode != tc.wantStatus || (tc.wantBody != "" && string(body) != tc.wantBody) {
				t.Fatalf("got %d %q", resp.StatusCode, body)
			}
			if tc.wantHeader[0] != "" && resp.Header.Get(tc.wantHeader[0]) != tc.wantHeader[1] {
				t.Fatalf("headers %v", resp.Header)
			}
		})
	}
}

func TestProxyReroute(t *testing.T) {
	ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		if req.GetRequestHeaders() != nil {
			return withCommon(req, &extprocv3.CommonResponse{
				HeaderMutation:  &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{hvo("x-llm-provider", "fallback", false)}},
				ClearRouteCache: true,
			})
		}
		return cont(req)
	}))
	primary, fallback := fakeLLM(t, "primary"), fakeLLM(t, "fallback")
	ps := startProxy(t, ts.addr, primary.URL, FilterConfig{}, func(p *Proxy) {
		p.Upstream().RouteHeader = "x-llm-provider"
		p.Upstream().Routes = map[string]string{"fallback": fallback.URL}
	})
	resp, err := http.Get(ps.URL + "/who")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	ts.nextEnd(t)
	if string(body) != "fallback fallback" {
		t.Fatalf("got %q", body)
	}
}

func TestProxyClientDisconnectResetsStream(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	sent := make(chan struct{})
	hold := make(chan struct{})
	defer close(hold)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-type", "text/event-stream")
		fmt.Fprint(w, "data: first\n\n")
		w.(http.Flusher).Flush()
		close(sent)
		select {
		case <-hold:
		case <-r.Context().Done():
		}
	}))
	defer upstream.Close()
	ps := startProxy(t, ts.addr, upstream.URL, FilterConfig{Mode: ProcessingMode{ResponseBody: BodyStreamed}}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, ps.URL+"/v1/stream", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	<-sent
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || line != "data: first\n" {
		t.Fatalf("read %q %v", line, err)
	}
	cancel()
	_ = resp.Body.Close()
	end := ts.nextEnd(t)
	if !isCanceled(end.recvErr) {
		t.Fatalf("server saw %v, want a reset", end.recvErr)
	}
}

func TestProxyRequestBodyOverLimit(t *testing.T) {
	ts := startServer(t, scripted(continueAll))
	llm := fakeLLM(t, "primary")
	ps := startProxy(t, ts.addr, llm.URL, FilterConfig{Mode: ProcessingMode{RequestBody: BodyBuffered}, BufferLimit: 16}, nil)
	resp, err := http.Post(ps.URL+"/v1/chat/completions", "application/json", strings.NewReader(strings.Repeat("x", 64)))
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	end := ts.nextEnd(t)
	if resp.StatusCode != 413 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	for _, m := range end.received {
		if m.GetRequestBody() != nil {
			t.Fatal("the body must never reach the server")
		}
	}
}

// TestProxyUnreachableProcessorAnswers500: with no ext_proc server listening, every request with
// a body is answered 500, as Envoy answers a stream whose processor cannot be reached
// (failure_mode_allow false), over one kept-alive connection. The proxy stops reading the
// request body before its handler returns: a read after it is one net/http turns into a panic
// ("invalid concurrent Body.Read call") and a broken connection.
func TestProxyUnreachableProcessorAnswers500(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone := lis.Addr().String()
	_ = lis.Close()
	llm := fakeLLM(t, "primary")
	cfg := FilterConfig{Mode: ProcessingMode{RequestBody: BodyBuffered}}
	p, err := NewProxy(newSim(t, gone, cfg), llm.URL, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var logs syncbuf.Buffer
	srv := httptest.NewUnstartedServer(p)
	srv.Config.ErrorLog = log.New(&logs, "", 0)
	srv.Start()
	defer srv.Close()
	client := srv.Client()
	for i := range 20 {
		resp, err := client.Post(srv.URL+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatalf("request %d: %v\n%s", i, err, logs.String())
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusInternalServerError {
			t.Fatalf("request %d: status %d, want 500", i, resp.StatusCode)
		}
	}
	if l := logs.String(); strings.Contains(l, "panic") {
		t.Fatalf("the server logged a panic:\n%s", l)
	}
}

// TestProxyRetries: with SetRetry, a 503 from the upstream is retried behind the filter (the
// replayed body intact), and the processor sees one response, the retry's 200.
func TestProxyRetries(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		if rh := req.GetResponseHeaders(); rh != nil {
			for _, h := range rh.GetHeaders().GetHeaders() {
				if h.GetKey() == ":status" {
					mu.Lock()
					seen = append(seen, string(h.GetRawValue())+h.GetValue())
					mu.Unlock()
				}
			}
		}
		return cont(req)
	}))
	attempts := 0
	llm := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		attempts++
		if string(body) != `{"model":"m"}` {
			t.Errorf("attempt %d got body %q", attempts, body)
		}
		if attempts == 1 {
			w.WriteHeader(503)
			fmt.Fprint(w, `{"error":{"message":"overloaded"}}`)
			return
		}
		fmt.Fprint(w, `{"ok":true}`)
	}))
	t.Cleanup(llm.Close)
	ps := startProxy(t, ts.addr, llm.URL, FilterConfig{}, func(p *Proxy) {
		p.SetRetry(RetryPolicy{NumRetries: 2, RetriableStatusCodes: []int{503, 429}, OnFailure: true, BackOff: time.Millisecond})
	})
	resp, err := http.Post(ps.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	ts.nextEnd(t)
	mu.Lock()
	defer mu.Unlock()
	if resp.StatusCode != 200 || string(body) != `{"ok":true}` || attempts != 2 || len(seen) != 1 || seen[0] != "200" {
		t.Fatalf("got %d %q after %d attempts; the processor saw statuses %q, want only 200", resp.StatusCode, body, attempts, seen)
	}
}
