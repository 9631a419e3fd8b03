package integration_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The HTTP transport of SDK clients keeps idle connections' goroutines briefly.
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		// Google's SDK imports OpenCensus, whose package init starts a worker that lives as
		// long as the process.
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
	)
}

// writePolicy writes a policy file for one test.
func writePolicy(t *testing.T, yaml string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func start(t *testing.T, o harness.Options) *harness.Stack {
	t.Helper()
	// Envoy's message timer is wall-clock time. These tests assert what the server decides, not
	// how fast: under -race on a starved 2-core machine, a reply to a 1 MiB body or to one of
	// sixty simultaneous requests can take longer than the policy's 200 ms, and the simulator
	// would answer 504 for it. The server still plans its waits (override_message_timeout)
	// against the policy's message_timeout; only the simulator's base timer is generous.
	testFilter := o.Filter
	o.Filter = func(f *envoysim.FilterConfig) {
		f.MessageTimeout = 30 * time.Second
		if testFilter != nil {
			testFilter(f)
		}
	}
	s, err := harness.Start(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func chatRequest(feature string) *envoysim.Request {
	return &envoysim.Request{
		Method:  "POST",
		Path:    "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: feature}},
		Body:    []byte(`{"model":"gpt-4o-mini","max_tokens":20,"messages":[{"role":"user","content":"Summarise the incident report."}]}`),
	}
}

// gate is an upstream that holds every request until released, reporting each arrival.
type gate struct {
	arrived chan struct{}
	release chan struct{}
}

func newGate() *gate {
	return &gate{arrived: make(chan struct{}, 1000), release: make(chan struct{}, 1000)}
}

func (g *gate) Serve(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
	g.arrived <- struct{}{}
	select {
	case <-g.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}},
		`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}`).Serve(ctx, req)
}

// hold sends one request for feature upstream through g and returns once g holds it; the
// result arrives on the returned channel after a release.
func hold(s *harness.Stack, g *gate, feature string) <-chan *envoysim.Result {
	out := make(chan *envoysim.Result, 1)
	go func() { r, _ := s.Sim.RoundTrip(context.Background(), chatRequest(feature), g); out <- r }()
	<-g.arrived
	return out
}

func header(r *envoysim.Result, name string) string {
	for _, h := range r.Headers {
		if h.Key == name {
			return h.Value
		}
	}
	return ""
}

func compartment(t *testing.T, s *harness.Stack, name string) policy.CompartmentView {
	t.Helper()
	var out struct {
		Compartments []policy.CompartmentView `json:"compartments"`
	}
	if err := s.Get("/admin/compartments", &out); err != nil {
		t.Fatal(err)
	}
	for _, c := range out.Compartments {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no compartment %s", name)
	return policy.CompartmentView{}
}

const noWaitChat = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 20, max_wait: 0s}
  default: {max_concurrent: 10}
`

// TestTwentyFirstChatRefused: 21 concurrent chat streams against max_concurrent 20, max_wait 0:
// 20 continue, the 21st gets 503 with retry-after, the reason header and an OpenAI error; when
// one of the 20 finishes, the next is admitted.
func TestTwentyFirstChatRefused(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, noWaitChat), NoMock: true})
	g := newGate()
	ctx := context.Background()
	results := make(chan *envoysim.Result, 21)
	for i := 0; i < 20; i++ {
		go func() {
			r, err := s.Sim.RoundTrip(ctx, chatRequest("chat"), g)
			if err != nil {
				t.Error(err)
			}
			results <- r
		}()
	}
	for i := 0; i < 20; i++ {
		<-g.arrived
	}
	r, err := s.Sim.RoundTrip(ctx, chatRequest("chat"), g)
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != 503 || r.Upstream != nil {
		t.Fatalf("21st: status %d, upstream called %v", r.Status, r.Upstream != nil)
	}
	if header(r, "x-bulkhead-reason") != "bulkhead_full" || header(r, "retry-after") == "" || header(r, "x-bulkhead-compartment") != "feature/chat" {
		t.Errorf("21st headers: %v", r.Headers)
	}
	var body struct {
		Error struct{ Message, Type, Code string } `json:"error"`
	}
	if err := json.Unmarshal(r.Body, &body); err != nil || body.Error.Type != "server_overloaded" || body.Error.Code != "bulkhead_full" ||
		!strings.Contains(body.Error.Message, "feature/chat is at capacity") {
		t.Errorf("21st body %s (%v)", r.Body, err)
	}
	if c := compartment(t, s, "feature/chat"); c.InFlight != 20 {
		t.Errorf("in flight = %d", c.InFlight)
	}
	// One finishes; the next request is admitted.
	g.release <- struct{}{}
	if done := <-results; done.Status != 200 {
		t.Fatalf("released request: %d", done.Status)
	}
	next := hold(s, g, "chat")
	for i := 0; i < 20; i++ {
		g.release <- struct{}{}
	}
	for i := 0; i < 19; i++ {
		if r := <-results; r.Status != 200 {
			t.Errorf("status %d", r.Status)
		}
	}
	if r := <-next; r.Status != 200 {
		t.Fatalf("next: %d", r.Status)
	}
	if n := s.App.Engine().InFlight(); n != 0 {
		t.Errorf("in flight at the end = %d", n)
	}
}

const waitingChat = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 1, max_wait: 5s}
  default: {max_concurrent: 10}
`

// TestWaitingRequestAdmitted: a request queued behind a full compartment is admitted when the
// slot frees within max_wait; Envoy's message timer is extended while it waits.
func TestWaitingRequestAdmitted(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, waitingChat), NoMock: true})
	g := newGate()
	ctx := context.Background()
	first := hold(s, g, "chat")

	queued := make(chan struct{})
	var once sync.Once
	req := chatRequest("chat")
	req.OnEvent = func(e envoysim.Event) envoysim.Action {
		if e.Kind == envoysim.EventReceived && e.Received.GetOverrideMessageTimeout() != nil {
			once.Do(func() { close(queued) })
		}
		return envoysim.Proceed
	}
	second := make(chan *envoysim.Result, 1)
	go func() { r, _ := s.Sim.RoundTrip(ctx, req, g); second <- r }()
	<-queued
	if c := compartment(t, s, "feature/chat"); c.Queued != 1 {
		t.Fatalf("queued = %d", c.Queued)
	}
	g.release <- struct{}{}
	<-g.arrived
	g.release <- struct{}{}
	if r := <-first; r.Status != 200 {
		t.Fatalf("first %d", r.Status)
	}
	r := <-second
	if r.Status != 200 || len(r.Problems) > 0 {
		t.Fatalf("queued request: %d, problems %v", r.Status, r.Problems)
	}
	var override *extprocv3.ProcessingResponse
	for _, rec := range r.Exchange {
		if rec.Received != nil && rec.Received.GetOverrideMessageTimeout() != nil {
			override = rec.Received
		}
	}
	if override == nil || override.GetOverrideMessageTimeout().AsDuration() < 5*time.Second {
		t.Errorf("no override_message_timeout covering the 5s wait: %v", override)
	}
}

// TestCancelledWaiterLeavesTheQueue: a queued request whose client goes away leaves the queue at
// once and holds nothing.
func TestCancelledWaiterLeavesTheQueue(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, waitingChat), NoMock: true})
	g := newGate()
	ctx := context.Background()
	first := hold(s, g, "chat")

	req := chatRequest("chat")
	req.OnEvent = func(e envoysim.Event) envoysim.Action {
		if e.Kind == envoysim.EventReceived && e.Received.GetOverrideMessageTimeout() != nil {
			return envoysim.Cancel // the client leaves while queued
		}
		return envoysim.Proceed
	}
	r, err := s.Sim.RoundTrip(ctx, req, g)
	if err != nil {
		t.Fatal(err)
	}
	if !r.Canceled || r.Upstream != nil {
		t.Fatalf("cancelled waiter: canceled %v, upstream %v", r.Canceled, r.Upstream != nil)
	}
	waitFor(t, func() bool { c := compartment(t, s, "feature/chat"); return c.Queued == 0 && c.InFlight == 1 })
	g.release <- struct{}{}
	<-first
	waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
}

// waitFor polls cond for up to 10 s: for state that settles on another goroutine after the
// client saw its answer (the server releases when the stream closes).
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached within 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

const sse = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n"

// streamingUpstream answers with an SSE stream of n content chunks and a usage chunk.
func streamingUpstream(n int) envoysim.Upstream {
	return envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		chunks := make([]envoysim.Chunk, 0, n+2)
		for i := 0; i < n; i++ {
			chunks = append(chunks, envoysim.Chunk{Data: []byte(sse)})
		}
		chunks = append(chunks,
			envoysim.Chunk{Data: []byte("data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":" + fmt.Sprint(n) + ",\"total_tokens\":" + fmt.Sprint(10+n) + "}}\n\n")},
			envoysim.Chunk{Data: []byte("data: [DONE]\n\n")})
		return &envoysim.UpstreamResponse{Status: 200, Headers: envoysim.Headers{{Key: "content-type", Value: "text/event-stream"}},
			Body: envoysim.ChunkSource(-1, chunks...)}, nil
	})
}

const endingsPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 8, max_wait: 50ms}
  batch: {max_concurrent: 2, max_wait: 0s}
  default: {max_concurrent: 4}
`

// TestInflightBackToZeroAfterRandomEndings: 10 000 streams ending every way a stream can end —
// normally, reset, half-close, client cancel before the reply, while queued or mid-SSE, and
// refusals — leave nothing in flight, and no goroutine behind.
func TestInflightBackToZeroAfterRandomEndings(t *testing.T) {
	n := 10_000
	if testing.Short() {
		n = 1000
	}
	// A minute of work for the processor under -race, on stacks of their own: it runs beside the
	// other parallel tests, and its halves beside each other.
	t.Parallel()
	for _, graceful := range []bool{false, true} {
		t.Run(fmt.Sprintf("graceful_close=%v", graceful), func(t *testing.T) {
			t.Parallel()
			s := start(t, harness.Options{PolicyPath: writePolicy(t, endingsPolicy), NoMock: true,
				Filter: func(f *envoysim.FilterConfig) { f.GracefulClose = graceful }})
			rng := rand.New(rand.NewPCG(uint64(n), 3))
			var mu sync.Mutex
			var statuses = map[int]int{}
			sem := make(chan struct{}, 64)
			var wg sync.WaitGroup
			for i := 0; i < n/2; i++ {
				feature := []string{"chat", "batch", "default"}[rng.IntN(3)]
				ending := rng.IntN(7)
				chunks := rng.IntN(6) + 1
				deadline := time.Duration(rng.IntN(3)) * time.Millisecond
				wg.Add(1)
				sem <- struct{}{}
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					req := chatRequest(feature)
					req.Body = []byte(`{"model":"m","stream":true,"max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`)
					var up envoysim.Upstream = streamingUpstream(chunks)
					ctx := context.Background()
					switch ending {
					case 1: // client gone before the request-headers reply
						req.OnEvent = envoysim.CancelWhenSent(envoysim.KindRequestHeaders, 1)
					case 2: // client gone while the body is being judged (or queued)
						req.OnEvent = envoysim.CancelWhenSent(envoysim.KindRequestBody, 1)
					case 3: // client gone mid-SSE
						req.OnEvent = envoysim.CancelAfterDownstreamChunks(1)
					case 4: // upstream fails with no response headers
						up = envoysim.Failing(envoysim.ConnectFailure)
					case 5: // upstream resets mid-body
						up = envoysim.UpstreamFunc(func(ctx context.Context, r *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
							return &envoysim.UpstreamResponse{Status: 200, Headers: envoysim.Headers{{Key: "content-type", Value: "text/event-stream"}},
								Body: envoysim.ChunkSource(1, envoysim.Chunk{Data: []byte(sse)}, envoysim.Chunk{Data: []byte(sse)})}, nil
						})
					case 6: // a context deadline mid-request
						var cancel context.CancelFunc
						ctx, cancel = context.WithTimeout(ctx, deadline)
						defer cancel()
					}
					r, err := s.Sim.RoundTrip(ctx, req, up)
					if err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
						t.Error(err)
						return
					}
					if r != nil {
						mu.Lock()
						statuses[r.Status]++
						mu.Unlock()
					}
				}()
			}
			wg.Wait()
			waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 && s.App.ExtProc().ActiveStreams() == 0 })
			for _, c := range s.App.Engine().Compartments() {
				if c.InFlight != 0 || c.Queued != 0 {
					t.Errorf("%s: in flight %d, queued %d", c.Name, c.InFlight, c.Queued)
				}
			}
			if statuses[200] == 0 || statuses[503] == 0 {
				t.Errorf("statuses %v: the mix did not exercise admissions and refusals", statuses)
			}
		})
	}
}

// TestPassThroughWithoutRequestHeaders: a stream whose first message is not request headers is
// let through, each message answered with its own type.
func TestPassThroughWithoutRequestHeaders(t *testing.T) {
	s := start(t, harness.Options{NoMock: true})
	raw, err := s.Sim.OpenRaw(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Reset()
	msgs := []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{}}},
		{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("x"), EndOfStream: true}}},
	}
	for _, m := range msgs {
		if err := raw.Send(m); err != nil {
			t.Fatal(err)
		}
		resp, err := raw.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if envoysim.KindOfResponse(resp) != envoysim.KindOfRequest(m) {
			t.Errorf("reply %v to %v", envoysim.KindOfResponse(resp), envoysim.KindOfRequest(m))
		}
	}
}

// TestEveryProcessingMode: every combination of body modes, with trailers, gets one reply of
// the matching type per message and the request through.
func TestEveryProcessingMode(t *testing.T) {
	modes := []envoysim.BodyMode{envoysim.BodyNone, envoysim.BodyBuffered, envoysim.BodyStreamed, envoysim.BodyBufferedPartial}
	for _, reqMode := range modes {
		for _, resMode := range modes {
			for _, trailers := range []bool{false, true} {
				name := fmt.Sprintf("request_%s/response_%s/trailers_%v", reqMode, resMode, trailers)
				t.Run(name, func(t *testing.T) {
					s := start(t, harness.Options{NoMock: true, Filter: func(f *envoysim.FilterConfig) {
						f.Mode.RequestBody, f.Mode.ResponseBody = reqMode, resMode
						if trailers {
							f.Mode.RequestTrailer, f.Mode.ResponseTrailer = envoysim.HeaderSend, envoysim.HeaderSend
						}
					}})
					req := chatRequest("chat")
					up := envoysim.Upstream(streamingUpstream(3))
					if trailers {
						req.Trailers = envoysim.Headers{{Key: "x-req-trailer", Value: "1"}}
						up = envoysim.UpstreamFunc(func(ctx context.Context, r *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
							// An LLM API reads the whole request before it answers, so the request's
							// trailers reach ext_proc before the response does; one that answered
							// first would race them, and lose when the machine is loaded.
							if _, err := io.Copy(io.Discard, r.Body); err != nil {
								return nil, err
							}
							resp, err := streamingUpstream(3).Serve(ctx, r)
							resp.Trailers = envoysim.Headers{{Key: "x-res-trailer", Value: "1"}}
							return resp, err
						})
					}
					r, err := s.Sim.RoundTrip(context.Background(), req, up)
					if err != nil {
						t.Fatal(err)
					}
					if r.Status != 200 || len(r.Problems) > 0 || r.Upstream == nil {
						t.Fatalf("status %d, problems %v, upstream %v", r.Status, r.Problems, r.Upstream != nil)
					}
					waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
				})
			}
		}
	}
}

// TestOpenAISDK: the official openai-go client, through the simulator's HTTP face and the mock
// LLM, completes a chat call, and surfaces our 503 as an API error with our message.
func TestOpenAISDK(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, noWaitChat)})
	url, err := s.ProxyURL()
	if err != nil {
		t.Fatal(err)
	}
	client := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey("test"), option.WithMaxRetries(0),
		option.WithHeader("x-llm-feature", "chat"))
	ctx := context.Background()
	resp, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:    "gpt-4o-mini",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hi")},
	})
	if err != nil {
		t.Fatalf("chat call: %v", err)
	}
	if len(resp.Choices) == 0 || resp.Usage.TotalTokens == 0 {
		t.Fatalf("response %+v", resp)
	}

	// Fill the chat compartment, then call again.
	var tickets atomic.Int64
	fill := func() {
		var done []func()
		for i := 0; i < 20; i++ {
			g := newGate()
			hold(s, g, "chat")
			tickets.Add(1)
			done = append(done, func() { g.release <- struct{}{} })
		}
		t.Cleanup(func() {
			for _, d := range done {
				d()
			}
		})
	}
	fill()
	_, err = client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:    "gpt-4o-mini",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hi")},
	})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) {
		t.Fatalf("err = %v, want *openai.Error", err)
	}
	if apiErr.StatusCode != 503 || apiErr.Type != "server_overloaded" || apiErr.Code != "bulkhead_full" ||
		!strings.Contains(apiErr.Message, "feature/chat is at capacity") {
		t.Errorf("API error: status %d type %q code %q message %q", apiErr.StatusCode, apiErr.Type, apiErr.Code, apiErr.Message)
	}
}

// TestDrain: on shutdown the server reports not ready and not serving, lets an in-flight
// request finish within the grace period, and releases everything.
func TestDrain(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, noWaitChat+"server: {drain_grace: 10s}\n"), NoMock: true})
	g := newGate()
	result := hold(s, g, "chat")
	stopped := make(chan struct{})
	go func() { s.App.Shutdown(context.Background()); close(stopped) }()
	waitFor(t, func() bool { return !s.App.Ready() })
	select {
	case <-stopped:
		t.Fatal("shutdown did not wait for the in-flight request")
	default:
	}
	g.release <- struct{}{}
	if r := <-result; r.Status != 200 {
		t.Fatalf("in-flight request during drain: %d", r.Status)
	}
	<-stopped
	if n := s.App.Engine().InFlight(); n != 0 {
		t.Errorf("in flight after drain: %d", n)
	}
}

// TestDrainGraceOver: a request still running when the grace period ends is cut, and what it
// held is released.
func TestDrainGraceOver(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, noWaitChat+"server: {drain_grace: 100ms}\n"), NoMock: true})
	g := newGate()
	hold(s, g, "chat")
	s.App.Shutdown(context.Background())
	waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
	g.release <- struct{}{}
}
