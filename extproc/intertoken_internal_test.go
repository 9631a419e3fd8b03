package extproc

import (
	"testing"
	"time"
)

// TestInterTokenLatency: a stream's inter-token latency runs from the chunk of its first token
// to the last chunk with generated text, over the tokens after the first (as reported, else
// estimated from the text); the role chunk before and the usage chunk after do not count, and
// an answer that arrived in a burst has none.
func TestInterTokenLatency(t *testing.T) {
	const s = time.Second
	// Chunks arrive at 5s (role), 7s (first token), 9s, 11s (the last text), 13s (usage).
	chunks := []string{
		"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\" there, \"}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"content\":\"friend!\"}}]}\n\n",
	}
	o := respond(t, s, append(chunks, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5}}\n\ndata: [DONE]\n\n")...)
	if o.TTFB != 6*s || o.InterToken != s {
		t.Errorf("first token %v, inter-token %v; want 6s and 4s over the 4 tokens after the first = 1s", o.TTFB, o.InterToken)
	}
	// Without usage: 17 bytes of text at 4 bytes per token are 4 tokens, 3 after the first.
	o = respond(t, s, append(chunks, "data: [DONE]\n\n")...)
	if want := 4 * s / 3; o.InterToken != want {
		t.Errorf("inter-token without usage %v, want %v", o.InterToken, want)
	}
	// The whole answer in one chunk (a burst): its timing says nothing about the decode.
	o = respond(t, s, chunks[1]+chunks[2]+chunks[3], "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5}}\n\n")
	if o.InterToken != 0 {
		t.Errorf("inter-token of an answer that came in one chunk %v, want 0", o.InterToken)
	}
	// Chunks less than a millisecond apart: below what the server can time.
	o = respond(t, 100*time.Microsecond, append(chunks, "data: [DONE]\n\n")...)
	if o.InterToken != 0 || o.TTFB == 0 {
		t.Errorf("inter-token of chunks 200µs apart %v (first token %v), want 0", o.InterToken, o.TTFB)
	}
	// One token: nothing to measure between tokens.
	o = respond(t, s, chunks[1], "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n")
	if o.InterToken != 0 {
		t.Errorf("inter-token of a one-token answer %v, want 0", o.InterToken)
	}
}
