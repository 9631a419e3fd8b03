package extproc_test

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
)

// fuzzClock is the engine's clock in the fuzz target: each input starts an hour after the one
// before, so budgets refill and breakers close again between inputs.
type fuzzClock struct{ ns atomic.Int64 }

func (c *fuzzClock) Now() time.Time { return time.Unix(0, c.ns.Load()) }

// Message kinds in the fuzz input's op bytes (op%7).
const (
	opRequestHeaders = iota
	opRequestBody
	opRequestTrailers
	opResponseHeaders
	opResponseBody
	opResponseTrailers
	opEmpty
)

// How a fuzzed stream ends (first byte % 3).
const (
	endAfterReplies = iota // half-close once every message was answered
	endCancel              // reset after a chosen message, without waiting for its reply
	endAtOnce              // half-close right after the last message, replies still coming
)

var (
	fuzzPaths    = []string{"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages", "/other?x=1"}
	fuzzFeatures = []string{"", "chat", "batch_summarize", "embedding", "background_analysis", "no-such-feature"}
	fuzzTenants  = []string{"", "acme", "globex", "initech", "someone-else"}
	fuzzStatuses = []string{"200", "200", "429", "503", "500", "204", "400", "abc", ""}
	fuzzTypes    = []string{"application/json", "text/event-stream", "text/event-stream; charset=utf-8", ""}
	// fuzzNumbers fill the %s of the bodies below: ordinary, negative, enormous and wrong-typed.
	fuzzNumbers = []string{"0", "1", "7", "250", "100000", "-1", "-9223372036854775808", "9223372036854775807",
		"18446744073709551616", "1e308", "3.5", "null", `"12"`, "1000000000"}
	fuzzRequestBodies = []string{
		`{"model":"deepseek-chat","max_tokens":%s,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"qwen-max","stream":true,"n":%s,"messages":[{"role":"user","content":"hello there"}]}`,
		`not json`,
		`{"model":"claude","max_tokens":%s,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]}`,
		`{"input":["a","b"],"model":"text-embedding"}`,
		`{"model":5,"max_tokens":"x"}`,
		``,
		`{"model":"local-llama","max_tokens":%s,"prompt":"x","stream_options":{"include_usage":false},"stream":true}`,
	}
	fuzzResponseBodies = []string{
		"data: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"hello\"}}]}\n\n",
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":%s,\"completion_tokens\":%s,\"total_tokens\":%s}}\n\n",
		"data: [DONE]\n\n",
		`{"usage":{"prompt_tokens":%s,"completion_tokens":%s,"total_tokens":%s}}`,
		"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":%s,\"output_tokens\":%s}}}\n\n",
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":%s}}\n\n",
		`{"usage":{"input_tokens":%s,"output_tokens":%s}}`,
		"data: {\"usage\":{\"prompt_tok",
		`{"usage":{"prompt_tokens":%s,"total_tokens":%s}}`,
		"data: {\"usage\":{\"prompt_tokens\":%s,\"completion_tokens\":%s,\"total_tokens\":%s,\"prompt_tokens_details\":{\"cached_tokens\":%s},\"completion_tokens_details\":{\"reasoning_tokens\":%s}}}\n\n",
	}
)

// fuzzInput reads the fuzz input; past its end it reads zeros.
type fuzzInput struct{ b []byte }

func (in *fuzzInput) next() int {
	if len(in.b) == 0 {
		return 0
	}
	c := in.b[0]
	in.b = in.b[1:]
	return int(c)
}

func (in *fuzzInput) pick(list []string) string { return list[in.next()%len(list)] }

// fill replaces each %s of s with a number the input picks.
func (in *fuzzInput) fill(s string) string {
	for strings.Contains(s, "%s") {
		s = strings.Replace(s, "%s", in.pick(fuzzNumbers), 1)
	}
	return s
}

// body is one of bodies (arg < 15) or raw input bytes (arg 15).
func (in *fuzzInput) body(arg int, bodies []string) []byte {
	if arg == 15 {
		n := min(in.next(), len(in.b))
		raw := in.b[:n]
		in.b = in.b[n:]
		return append([]byte(nil), raw...)
	}
	return []byte(in.fill(bodies[arg%len(bodies)]))
}

var fuzzModes = []extprocfilterv3.ProcessingMode_BodySendMode{extprocfilterv3.ProcessingMode_NONE, extprocfilterv3.ProcessingMode_BUFFERED,
	extprocfilterv3.ProcessingMode_STREAMED, extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL}

// decodeSequence turns the fuzz input into ext_proc messages and says how the stream ends.
// Layout: a config byte (end mode %3, request body mode bits 2-3, response body mode bits 4-5,
// protocol_config on the first message bit 6), the message after which a cancel comes, then
// one op byte per message (kind %7, end_of_stream bit 3, argument bits 4-7) with the bytes its
// kind reads.
func decodeSequence(data []byte) (msgs []*extprocv3.ProcessingRequest, end, cancelAfter int) {
	in := &fuzzInput{b: data}
	cfg := in.next()
	end = cfg % 3
	pc := &extprocv3.ProtocolConfiguration{RequestBodyMode: fuzzModes[cfg>>2&3], ResponseBodyMode: fuzzModes[cfg>>4&3]}
	withConfig := cfg>>6&1 == 1
	cancelAfter = in.next()
	for len(in.b) > 0 && len(msgs) < 32 {
		op := in.next()
		eos, arg := op&8 != 0, op>>4
		req := &extprocv3.ProcessingRequest{}
		switch op % 7 {
		case opRequestHeaders:
			kv := []string{":method", "POST", ":path", fuzzPaths[arg%len(fuzzPaths)], "content-type", "application/json"}
			if f := in.pick(fuzzFeatures); f != "" {
				kv = append(kv, "x-llm-feature", f)
			}
			if t := in.pick(fuzzTenants); t != "" {
				kv = append(kv, "x-tenant-id", t)
			}
			if arg&8 != 0 {
				kv = append(kv, "x-llm-provider", "qwen")
			}
			req.Request = &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: headers(eos, kv...)}
		case opRequestBody:
			req.Request = &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: in.body(arg, fuzzRequestBodies), EndOfStream: eos}}
		case opRequestTrailers:
			req.Request = &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}
		case opResponseHeaders:
			kv := []string{":status", fuzzStatuses[arg%len(fuzzStatuses)], "content-type", in.pick(fuzzTypes)}
			if arg&8 != 0 {
				kv = append(kv, "retry-after", in.pick(fuzzNumbers))
			}
			req.Request = &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: headers(eos, kv...)}
		case opResponseBody:
			req.Request = &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: in.body(arg, fuzzResponseBodies), EndOfStream: eos}}
		case opResponseTrailers:
			req.Request = &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}
		case opEmpty:
			// A message with neither part: not something Envoy sends.
		}
		if len(msgs) == 0 && withConfig {
			req.ProtocolConfig = pc
		}
		msgs = append(msgs, req)
	}
	return msgs, end, cancelAfter
}

// replyMatches reports whether resp is a reply Envoy accepts for req.
func replyMatches(req *extprocv3.ProcessingRequest, resp *extprocv3.ProcessingResponse) bool {
	_, immediate := resp.Response.(*extprocv3.ProcessingResponse_ImmediateResponse)
	switch req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return resp.GetRequestHeaders() != nil || immediate
	case *extprocv3.ProcessingRequest_RequestBody:
		return resp.GetRequestBody() != nil || immediate
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return resp.GetRequestTrailers() != nil
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return resp.GetResponseHeaders() != nil
	case *extprocv3.ProcessingRequest_ResponseBody:
		return resp.GetResponseBody() != nil
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return resp.GetResponseTrailers() != nil
	}
	return false
}

// op encodes one message of a seed: kind, end_of_stream, argument, then the bytes it reads.
func op(kind int, eos bool, arg int, more ...byte) []byte {
	b := byte(kind) | byte(arg)<<4
	if eos {
		b |= 8
	}
	return append([]byte{b}, more...)
}

// seed is a fuzz input: the config byte, the cancel point and the messages.
func seed(end int, reqMode, resMode int, cancelAfter byte, ops ...[]byte) []byte {
	b := []byte{byte(end) | byte(reqMode)<<2 | byte(resMode)<<4 | 1<<6, cancelAfter}
	for _, o := range ops {
		b = append(b, o...)
	}
	return b
}

// FuzzMessageSequence drives a server over the example policy with any sequence of ext_proc
// messages, in any order, ended any way. Whatever arrives: no panic, nothing stays held once
// the stream has ended, and every message gets at most one reply, of its own type.
func FuzzMessageSequence(f *testing.F) {
	const buffered, streamed = 1, 2
	// An ordinary streamed chat completion with usage at the end.
	f.Add(seed(endAfterReplies, buffered, streamed, 0,
		op(opRequestHeaders, false, 0, 1, 1), op(opRequestBody, true, 0, 2),
		op(opResponseHeaders, false, 0, 1), op(opResponseBody, false, 0),
		op(opResponseBody, true, 1, 2, 2, 3)))
	// request_headers twice.
	f.Add(seed(endAfterReplies, 0, streamed, 0, op(opRequestHeaders, false, 0, 1, 1), op(opRequestHeaders, false, 0, 1, 1)))
	// A request message after the response began.
	f.Add(seed(endAfterReplies, 0, streamed, 0, op(opRequestHeaders, false, 0, 1, 1),
		op(opResponseHeaders, false, 0, 1), op(opRequestBody, true, 0, 2)))
	// Reported usage whose total is below its prompt, and absurd numbers.
	f.Add(seed(endAfterReplies, buffered, streamed, 0,
		op(opRequestHeaders, false, 0, 1, 2), op(opRequestBody, true, 0, 2),
		op(opResponseHeaders, false, 0, 0), op(opResponseBody, true, 8, 4, 1)))
	f.Add(seed(endAfterReplies, buffered, streamed, 0,
		op(opRequestHeaders, false, 0, 1, 2), op(opRequestBody, true, 0, 2),
		op(opResponseHeaders, false, 0, 1), op(opResponseBody, true, 9, 7, 6, 8, 5, 9)))
	// A reset in the middle of the response, and a half-close while replies are on their way.
	f.Add(seed(endCancel, buffered, streamed, 3,
		op(opRequestHeaders, false, 4, 1, 1), op(opRequestBody, true, 3, 3),
		op(opResponseHeaders, false, 0, 1), op(opResponseBody, false, 4, 3, 3), op(opResponseBody, true, 5, 3)))
	f.Add(seed(endAtOnce, buffered, streamed, 0,
		op(opRequestHeaders, false, 0, 2, 3), op(opRequestBody, true, 2),
		op(opResponseHeaders, false, 3, 0), op(opResponseTrailers, false, 0)))
	// An upstream error whose body never comes, then trailers; an empty message.
	f.Add(seed(endAfterReplies, 0, streamed, 0, op(opRequestHeaders, true, 0, 1, 1),
		op(opResponseHeaders, false, 4, 0), op(opResponseTrailers, false, 0), op(opEmpty, false, 0)))

	clock := &fuzzClock{}
	clock.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	m := newMemServer(f, string(examples.DefaultPolicy), clock)

	f.Fuzz(func(t *testing.T, data []byte) {
		clock.ns.Add(int64(time.Hour))
		msgs, end, cancelAfter := decodeSequence(data)
		m.t = t
		s := m.open()
		var replies []*extprocv3.ProcessingResponse
		collect := func() {
			for {
				select {
				case r := <-s.out:
					if r.Response == nil && r.OverrideMessageTimeout != nil {
						continue // asks Envoy to wait longer; not a reply
					}
					replies = append(replies, r)
				default:
					return
				}
			}
		}
		sent := 0
		for i, req := range msgs {
			if !s.send(req) {
				break
			}
			sent++
			if end == endCancel && i == cancelAfter%len(msgs) {
				break
			}
			if end == endAfterReplies {
				if r := s.reply(t); r != nil {
					replies = append(replies, r)
				}
			}
		}
		var err error
		if end == endCancel {
			s.cancel()
			err = s.wait()
		} else {
			err = s.close()
		}
		collect()

		if got := metric(t, m.reg, "llm_bulkhead_extproc_panics_total"); got != 0 {
			t.Fatalf("%v panics counted", got)
		}
		nothingHeld(t, m.eng)
		if got := metric(t, m.reg, "llm_bulkhead_extproc_buffered_body_bytes"); got != 0 {
			t.Errorf("%v request-body bytes still accounted after the stream ended", got)
		}
		if n := m.srv.ActiveStreams(); n != 0 {
			t.Errorf("%d streams active after the stream ended", n)
		}
		// Replies come in order, one per message, until the stream ends: reply i answers message i.
		if len(replies) > sent {
			t.Fatalf("%d replies to %d messages (stream ended with %v)", len(replies), sent, err)
		}
		for i, r := range replies {
			if !replyMatches(msgs[i], r) {
				t.Fatalf("message %d (%T) got a reply of another type: %v", i, msgs[i].Request, r)
			}
		}
	})
}
