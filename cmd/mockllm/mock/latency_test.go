package mock

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

func TestLatencyModel(t *testing.T) {
	tests := []struct {
		name   string
		model  LatencyModel
		tokens int64
		u      float64
		want   time.Duration
	}{
		{name: "default model, no tokens, lowest jitter", tokens: 0, u: 0, want: 180 * time.Millisecond},
		{name: "default model, 1000 tokens, lowest jitter", tokens: 1000, u: 0, want: 270 * time.Millisecond},
		{name: "default model, 1000 tokens, mid jitter", tokens: 1000, u: 0.5, want: 330 * time.Millisecond},
		{name: "default model, 10000 tokens, top jitter", tokens: 10000, u: 1, want: 1560 * time.Millisecond},
		{name: "custom model", model: LatencyModel{Base: time.Second, TokensPerSecond: 100, JitterMin: 1, JitterMax: 1}, tokens: 50, u: 0.7, want: 1500 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.model.Latency(tt.tokens, tt.u); got != tt.want {
				t.Fatalf("Latency(%d, %v) = %v, want %v", tt.tokens, tt.u, got, tt.want)
			}
		})
	}
}

func TestNewRejectsNonsense(t *testing.T) {
	tests := []struct {
		name    string
		opts    Options
		wantErr []string
	}{
		{name: "zero value is fine", opts: Options{}},
		{
			name: "every problem reported at once",
			opts: Options{
				TimeScale: -1, Capacity: -1, ProviderCapacity: map[string]int{"": 1, "p": -2},
				DefaultCompletionTokens: -5, ChunkTokens: -1, EmbeddingDimensions: 99999, RequestLogSize: -1,
				MaxLoggedBodyBytes: -1, MaxRequestBodyBytes: -1,
				Latency: LatencyModel{Base: -time.Second, TokensPerSecond: -1, JitterMin: 2, JitterMax: 1, TTFBFraction: 1.5, DecodeSlowdown: -1},
				Faults:  []FaultRule{{Model: "[", Fault: Fault{Status: 200}}},
			},
			wantErr: []string{
				"time scale", "capacity -1", "provider name", "capacity -2", "default completion", "chunk tokens",
				"embedding dimensions", "request log size", "logged body", "request body bytes", "latency base",
				"tokens per second", "jitter", "ttfb", "decode slowdown", "glob", "status 200",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.opts)
			if len(tt.wantErr) == 0 {
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("New accepted nonsense")
			}
			for _, want := range tt.wantErr {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("New error does not mention %q:\n%v", want, err)
				}
			}
		})
	}
}

// timedWriter is an http.ResponseWriter that notes when, on the (fake)
// clock, the headers and each body write happened.
type timedWriter struct {
	start time.Time

	mu       sync.Mutex
	header   http.Header
	status   int
	headerAt time.Duration
	writes   []timedWrite
}

type timedWrite struct {
	at   time.Duration
	data string
}

func newTimedWriter() *timedWriter {
	return &timedWriter{start: time.Now(), header: http.Header{}}
}

func (w *timedWriter) Header() http.Header { return w.header }

func (w *timedWriter) WriteHeader(code int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.status == 0 {
		w.status, w.headerAt = code, time.Since(w.start)
	}
}

func (w *timedWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.writes = append(w.writes, timedWrite{at: time.Since(w.start), data: string(p)})
	return len(p), nil
}

func (w *timedWriter) Flush() {}

// lastAt is when the last body write happened.
func (w *timedWriter) lastAt() time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.writes) == 0 {
		return -1
	}
	return w.writes[len(w.writes)-1].at
}

// fixedLatency has no jitter, so a request of n tokens takes exactly
// base + n ms.
var fixedLatency = LatencyModel{Base: 100 * time.Millisecond, TokensPerSecond: 1000, JitterMin: 1, JitterMax: 1, TTFBFraction: 0.25}

func TestLatencyTimeline(t *testing.T) {
	// Prompt "abcdefgh" is 2 tokens; max_tokens 8 → 10 tokens → 110 ms.
	chat := `{"model":"m","messages":[{"content":"abcdefgh"}],"max_tokens":8` // closed below
	tests := []struct {
		name      string
		path      string
		body      string
		headers   map[string]string
		scale     float64
		wantHead  time.Duration
		wantLast  time.Duration
		wantFirst time.Duration // first body write; -1 to skip
	}{
		{name: "json waits the whole latency", path: "/v1/chat/completions", body: chat + `}`, scale: 1, wantHead: 110 * time.Millisecond, wantLast: 110 * time.Millisecond, wantFirst: 110 * time.Millisecond},
		{
			name: "sse sends headers at the ttfb fraction and ends at the latency",
			path: "/v1/chat/completions", body: chat + `,"stream":true}`, scale: 1,
			wantHead: 27500 * time.Microsecond, wantFirst: 27500 * time.Microsecond, wantLast: 110 * time.Millisecond,
		},
		{
			name: "time scale shrinks everything",
			path: "/v1/chat/completions", body: chat + `,"stream":true}`, scale: 0.01,
			wantHead: 275 * time.Microsecond, wantFirst: 275 * time.Microsecond, wantLast: 1100 * time.Microsecond,
		},
		{
			name: "header delay comes first and is scaled",
			path: "/v1/messages", body: `{"model":"c","messages":[{"content":"abcdefgh"}],"max_tokens":8,"stream":true}`,
			headers: map[string]string{HeaderDelayHeaders: "2s"}, scale: 0.5,
			wantHead: time.Second + 13750*time.Microsecond, wantFirst: time.Second + 13750*time.Microsecond, wantLast: time.Second + 55*time.Millisecond,
		},
		{
			name: "first-token delay: sse headers and preamble on time, the rest later",
			path: "/v1/chat/completions", body: chat + `,"stream":true}`,
			headers: map[string]string{HeaderFirstTokenDelay: "1s"}, scale: 1,
			wantHead: 27500 * time.Microsecond, wantFirst: 27500 * time.Microsecond, wantLast: time.Second + 110*time.Millisecond,
		},
		{
			name: "first-token delay: json headers at once, the body after latency and delay",
			path: "/v1/chat/completions", body: chat + `}`,
			headers: map[string]string{HeaderFirstTokenDelay: "2s"}, scale: 0.5,
			wantHead: 0, wantFirst: time.Second + 55*time.Millisecond, wantLast: time.Second + 55*time.Millisecond,
		},
		{
			name: "injected error skips the model but not the header delay",
			path: "/v1/chat/completions", body: chat + `}`,
			headers: map[string]string{HeaderStatus: "503", HeaderDelayHeaders: "300ms"}, scale: 1,
			wantHead: 300 * time.Millisecond, wantFirst: 300 * time.Millisecond, wantLast: 300 * time.Millisecond,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s, err := New(Options{Latency: fixedLatency, TimeScale: tt.scale})
				if err != nil {
					t.Fatal(err)
				}
				req := httptest.NewRequest(http.MethodPost, tt.path, strings.NewReader(tt.body))
				for k, v := range tt.headers {
					req.Header.Set(k, v)
				}
				w := newTimedWriter()
				s.ServeHTTP(w, req)
				if w.headerAt != tt.wantHead {
					t.Errorf("headers at %v, want %v", w.headerAt, tt.wantHead)
				}
				if len(w.writes) == 0 {
					t.Fatal("no body written")
				}
				if w.writes[0].at != tt.wantFirst {
					t.Errorf("first write at %v, want %v", w.writes[0].at, tt.wantFirst)
				}
				if got := w.lastAt(); got != tt.wantLast {
					t.Errorf("last write at %v, want %v", got, tt.wantLast)
				}
			})
		})
	}
}

func TestStreamSpreadsChunksEvenly(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// 4 prompt tokens + 4 completion tokens = 8 → 108 ms; ttfb 27 ms; the
		// 81 ms left are spread over 4 content events, ~20.25 ms apart.
		s, err := New(Options{Latency: fixedLatency})
		if err != nil {
			t.Fatal(err)
		}
		body := `{"model":"m","messages":[{"content":"0123456789abcdef"}],"max_tokens":4,"stream":true}`
		w := newTimedWriter()
		s.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)))
		var contentAt []time.Duration
		for _, wr := range w.writes {
			if strings.Contains(wr.data, `"delta":{"content":"`) && !strings.Contains(wr.data, `"content":""`) {
				contentAt = append(contentAt, wr.at)
			}
		}
		want := []time.Duration{47250 * time.Microsecond, 67500 * time.Microsecond, 87750 * time.Microsecond, 108 * time.Millisecond}
		if len(contentAt) != len(want) {
			t.Fatalf("content events at %v, want %v", contentAt, want)
		}
		for i := range want {
			if contentAt[i] != want[i] {
				t.Fatalf("content events at %v, want %v", contentAt, want)
			}
		}
	})
}

func TestSeededJitterIsReproducible(t *testing.T) {
	// Each server answers the same five requests one after another; the
	// latencies must be equal for equal seeds and differ for another seed.
	run := func(t *testing.T, seed uint64) []time.Duration {
		var out []time.Duration
		synctest.Test(t, func(t *testing.T) {
			s, err := New(Options{Seed: seed})
			if err != nil {
				t.Fatal(err)
			}
			for range 5 {
				w := newTimedWriter()
				s.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/v1/embeddings", strings.NewReader(`{"model":"e","input":"abcd"}`)))
				// 1 token: (200 ms + 0.1 ms) × [0.9, 1.3).
				if w.headerAt < 180090*time.Microsecond || w.headerAt >= 260130*time.Microsecond {
					t.Fatalf("latency %v outside the jitter range", w.headerAt)
				}
				out = append(out, w.headerAt)
			}
		})
		return out
	}
	tests := []struct {
		name      string
		a, b      uint64
		wantEqual bool
	}{
		{name: "same seed", a: 7, b: 7, wantEqual: true},
		{name: "other seed", a: 7, b: 8, wantEqual: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x, y := run(t, tt.a), run(t, tt.b)
			equal := len(x) == len(y)
			for i := range x {
				equal = equal && x[i] == y[i]
			}
			if equal != tt.wantEqual {
				t.Fatalf("latencies %v and %v: equal = %v, want %v", x, y, equal, tt.wantEqual)
			}
		})
	}
}

func TestCapacityQueuesFIFO(t *testing.T) {
	tests := []struct {
		name     string
		opts     Options
		provider string
	}{
		{name: "whole provider", opts: Options{Latency: fixedLatency, Capacity: 1}},
		{name: "per provider", opts: Options{Latency: fixedLatency, ProviderCapacity: map[string]int{"shared": 1}}, provider: "shared"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s, err := New(tt.opts)
				if err != nil {
					t.Fatal(err)
				}
				// Each embeddings request of 1 token takes 100 ms + 1 ms.
				const each = 101 * time.Millisecond
				const n = 3
				done := make([]time.Duration, n)
				start := time.Now()
				var wg sync.WaitGroup
				for i := range n {
					req := httptest.NewRequest(http.MethodPost, "/v1/embeddings", strings.NewReader(`{"model":"e","input":"abcd"}`))
					if tt.provider != "" {
						req.Header.Set(ProviderHeader, tt.provider)
					}
					wg.Go(func() {
						s.ServeHTTP(newTimedWriter(), req)
						done[i] = time.Since(start)
					})
					synctest.Wait() // request i is queued before i+1 arrives
				}
				st := s.Stats()
				pool := st.Global
				if tt.provider != "" {
					pool = st.Providers[tt.provider]
				}
				if pool.InFlight != 1 || pool.Queued != n-1 {
					t.Errorf("while busy: %+v, want 1 in flight and %d queued", pool, n-1)
				}
				wg.Wait()
				for i := range n {
					if want := time.Duration(i+1) * each; done[i] != want {
						t.Errorf("request %d done at %v, want %v (FIFO behind %d others)", i, done[i], want, i)
					}
				}
				st = s.Stats()
				if st.Global.InFlight != 0 || st.Global.Queued != 0 {
					t.Errorf("after the burst: %+v, want an idle pool", st.Global)
				}
			})
		})
	}
}

func TestClientLeavingWhileQueuedFreesItsPlace(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := New(Options{Latency: fixedLatency, Capacity: 1})
		if err != nil {
			t.Fatal(err)
		}
		body := `{"model":"e","input":"abcd"}`
		var wg sync.WaitGroup
		wg.Go(func() {
			s.ServeHTTP(newTimedWriter(), httptest.NewRequest(http.MethodPost, "/v1/embeddings", strings.NewReader(body)))
		})
		synctest.Wait()
		ctx, cancel := context.WithCancel(context.Background())
		gone := newTimedWriter()
		wg.Go(func() {
			req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/embeddings", strings.NewReader(body))
			s.ServeHTTP(gone, req)
		})
		synctest.Wait()
		if q := s.Stats().Global.Queued; q != 1 {
			t.Fatalf("queued = %d, want 1", q)
		}
		cancel()
		synctest.Wait()
		if q := s.Stats().Global.Queued; q != 0 {
			t.Fatalf("queued after cancel = %d, want 0", q)
		}
		wg.Wait()
		if gone.status != 0 {
			t.Errorf("the client that left got status %d, want none", gone.status)
		}
		st := s.Stats()
		if st.ByOutcome[OutcomeClientGone] != 1 || st.ByOutcome[OutcomeOK] != 1 {
			t.Errorf("outcomes = %v, want one ok and one client_gone", st.ByOutcome)
		}
	})
}

// TestFirstTokenDelayHoldsTheText: under a first-token delay the headers and
// the opening events leave on the latency model's time and the first text
// only after the delay.
func TestFirstTokenDelayHoldsTheText(t *testing.T) {
	for _, tt := range []struct{ path, body, text string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"content":"0123456789abcdef"}],"max_tokens":4,"stream":true}`, `"delta":{"content":"`},
		{"/v1/messages", `{"model":"c","messages":[{"content":"0123456789abcdef"}],"max_tokens":4,"stream":true}`, `"text_delta"`},
		{"/v1/responses", `{"model":"m","input":"0123456789abcdef","max_output_tokens":4,"stream":true}`, `response.output_text.delta`},
	} {
		t.Run(tt.path, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s, err := New(Options{Latency: fixedLatency})
				if err != nil {
					t.Fatal(err)
				}
				req := httptest.NewRequest(http.MethodPost, tt.path, strings.NewReader(tt.body))
				req.Header.Set(HeaderFirstTokenDelay, "20s")
				w := newTimedWriter()
				s.ServeHTTP(w, req)
				if w.headerAt != 27*time.Millisecond {
					t.Errorf("headers at %v, want 27ms", w.headerAt)
				}
				var first time.Duration = -1
				for _, wr := range w.writes {
					if strings.Contains(wr.data, tt.text) && !strings.Contains(wr.data, `"content":""`) {
						first = wr.at
						break
					}
				}
				if first != 20*time.Second+47250*time.Microsecond {
					t.Errorf("first text at %v, want 20.04725s", first)
				}
			})
		})
	}
}

// TestDecodeSlowdown: with DecodeSlowdown 0.5, a request that starts while others are in
// service spends half as long again after its first byte per other request; its first byte
// is not moved.
func TestDecodeSlowdown(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(map[bool]string{true: "sse", false: "json"}[stream], func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				model := fixedLatency
				model.DecodeSlowdown = 0.5
				s, err := New(Options{Latency: model})
				if err != nil {
					t.Fatal(err)
				}
				// 110 ms each: the first byte at 27.5 ms, 82.5 ms after it.
				body := `{"model":"m","messages":[{"content":"abcdefgh"}],"max_tokens":8}`
				if stream {
					body = `{"model":"m","messages":[{"content":"abcdefgh"}],"max_tokens":8,"stream":true}`
				}
				writers := make([]*timedWriter, 3)
				var wg sync.WaitGroup
				for i := range writers {
					writers[i] = newTimedWriter()
					req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
					wg.Go(func() { s.ServeHTTP(writers[i], req) })
					synctest.Wait() // request i starts with i others in service
				}
				wg.Wait()
				for i, w := range writers {
					want := 27500*time.Microsecond + time.Duration(float64(82500*time.Microsecond)*(1+0.5*float64(i)))
					if got := w.lastAt(); got != want {
						t.Errorf("request %d ended at %v, want %v", i, got, want)
					}
					if stream && w.headerAt != 27500*time.Microsecond {
						t.Errorf("request %d: first byte at %v, want 27.5ms", i, w.headerAt)
					}
				}
			})
		})
	}
}
