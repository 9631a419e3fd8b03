package mock

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// benchServer serves with latencies scaled to almost nothing, so the
// benchmarks measure the fake provider's own cost.
func benchServer(b *testing.B) (string, *http.Client) {
	b.Helper()
	s, err := New(Options{TimeScale: 1e-9})
	if err != nil {
		b.Fatal(err)
	}
	ts := httptest.NewServer(s)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	b.Cleanup(func() {
		client.CloseIdleConnections()
		ts.Close()
	})
	return ts.URL, client
}

func benchmarkCall(b *testing.B, path, body string) {
	base, client := benchServer(b)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := client.Post(base+path, contentTypeJSON, strings.NewReader(body))
			if err != nil {
				b.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b.Errorf("status %d", resp.StatusCode)
				return
			}
		}
	})
}

func BenchmarkChatJSON(b *testing.B) {
	benchmarkCall(b, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":64}`)
}

func BenchmarkChatStream64Chunks(b *testing.B) {
	benchmarkCall(b, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`)
}

func BenchmarkParseRequest1MiB(b *testing.B) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("abcd ", 1<<18/5*4) + `"}]}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := parseRequest(route{api: apiChat}, body); err != nil {
			b.Fatal(err)
		}
	}
}
