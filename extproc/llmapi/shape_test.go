package llmapi

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
)

// shapeRun reads docs in order the way UsageScanner.wholeEvent does, each
// against the shape of the last one parsed in full, and checks every fit
// against a full parse of the same document. The pattern it returns has a
// '+' for each document that fitted and a '-' for each that was parsed.
func shapeRun(tree pathTree, docs [][]byte) (string, error) {
	var sh eventShape
	var pattern strings.Builder
	for i, b := range docs {
		var want docResult
		valid := scanDoc(tree, b, &want)
		if content, ok := sh.fit(b); ok {
			got := sh.res
			got.content = content
			if !valid {
				return pattern.String(), fmt.Errorf("doc %d fitted but is not valid: %q", i, b)
			}
			if !sameDoc(got, want) {
				return pattern.String(), fmt.Errorf("doc %d: fit %+v, parse %+v", i, got, want)
			}
			pattern.WriteByte('+')
			continue
		}
		pattern.WriteByte('-')
		if !sh.beginLearn(b) {
			continue
		}
		var d docResult
		if ok := scanDocRec(tree, b, &d, &sh); ok != valid {
			return pattern.String(), fmt.Errorf("doc %d: recording parse valid %v, parse %v", i, ok, valid)
		}
		if valid {
			if !sameDoc(d, want) {
				return pattern.String(), fmt.Errorf("doc %d: recording parse %+v, parse %+v", i, d, want)
			}
			sh.learn(b, &d)
		}
	}
	return pattern.String(), nil
}

func nested(depth int, inner string) string {
	return strings.Repeat("[", depth) + inner + strings.Repeat("]", depth)
}

func TestEventShape(t *testing.T) {
	chat := trees[treeOpenAIChat]
	tests := []struct {
		name string
		tree pathTree
		docs []string
		want string
	}{
		{
			name: "text varies",
			tree: chat,
			docs: []string{
				`{"id":"c1","choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":null}],"usage":null}`,
				`{"id":"c1","choices":[{"index":0,"delta":{"content":" world"},"finish_reason":null}],"usage":null}`,
				`{"id":"c1","choices":[{"index":0,"delta":{"content":"\u00e9\n\ud83d\ude00\"\\"},"finish_reason":null}],"usage":null}`,
				`{"id":"c1","choices":[{"index":0,"delta":{"content":""},"finish_reason":null}],"usage":null}`,
			},
			want: "-+++",
		},
		{
			name: "numbers and padding vary",
			tree: chat,
			docs: []string{
				`{"created":9,"choices":[{"delta":{"content":"a"}}],"obfuscation":"xY"}`,
				`{"created":10,"choices":[{"delta":{"content":"bb"}}],"obfuscation":"x"}`,
				`{"created":1e3,"choices":[{"delta":{"content":"c"}}],"obfuscation":"abc"}`,
				`{"created":-0.5,"choices":[{"delta":{"content":"c"}}],"obfuscation":""}`,
			},
			want: "-+++",
		},
		{
			name: "unread values change kind",
			tree: chat,
			docs: []string{
				`{"choices":[{"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]}`,
				`{"choices":[{"delta":{"content":"b"},"logprobs":{"content":[{"token":"b","bytes":[98]}]},"finish_reason":"stop"}]}`,
				`{"choices":[{"delta":{"content":"c"},"logprobs":[true,false,{}],"finish_reason":3}]}`,
				`{"choices":[{"delta":{"content":"c"},"logprobs": "x","finish_reason":3}]}`,
				`{"choices":[{"delta":{"content":"c"},"logprobs": "x" ,"finish_reason":3}]}`,
			},
			want: "-+++-",
		},
		{
			name: "a repeated member keeps only its last value",
			tree: chat,
			docs: []string{
				`{"choices":[{"delta":{"content":"a","content":"bb"}}]}`,
				`{"choices":[{"delta":{"content":"ccc","content":"d"}}]}`,
				`{"choices":[{"delta":{"content":"eeeee","refusal":"f"},"delta":{"content":"gg"}}]}`,
				`{"choices":[{"delta":{"content":"h","refusal":"ii"},"delta":{"content":"jjj"}}]}`,
			},
			want: "-+-+",
		},
		{
			name: "text that turns into another kind of value",
			tree: chat,
			docs: []string{
				`{"choices":[{"delta":{"content":"a"}}]}`,
				`{"choices":[{"delta":{"content":null}}]}`,
				`{"choices":[{"delta":{"content":["b"]}}]}`,
			},
			want: "---",
		},
		{
			name: "usage counts are never holes",
			tree: chat,
			docs: []string{
				`{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}`,
				`{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":3}}`,
				`{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":3}}`,
			},
			want: "--+",
		},
		{
			name: "member names and structure are never holes",
			tree: chat,
			docs: []string{
				`{"a":1,"choices":[{"delta":{"content":"x"}}]}`,
				`{"b":1,"choices":[{"delta":{"content":"x"}}]}`,
				`{"b":1,"choices":[{"delta":{"content":"x"}},{"delta":{"content":"y"}}]}`,
				`{"b":1,"choices":[{"delta":{"content":"x"}}],"c":2}`,
				`{"b":1,"choices":[{"delta":{"content":"x"}}],"c":2} `,
			},
			want: "-----",
		},
		{
			name: "the nesting limit holds inside holes",
			tree: chat,
			docs: []string{
				`{"x":0,"choices":[]}`,
				`{"x":` + nested(9999, "1") + `,"choices":[]}`,
				`{"x":` + nested(10000, "1") + `,"choices":[]}`,
			},
			want: "-+-",
		},
		{
			name: "anthropic deltas",
			tree: trees[treeAnthropicSSE],
			docs: []string{
				`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hel"}}`,
				`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"lo"}}`,
				`{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"a\""}}`,
				`{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":":1}"}}`,
				`{"type":"content_block_stop","index":1}`,
				`{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}`,
			},
			want: "-+-+--",
		},
		{
			name: "responses deltas",
			tree: trees[treeResponsesSSE],
			docs: []string{
				`{"type":"response.output_text.delta","sequence_number":9,"item_id":"msg_1","delta":"a","obfuscation":"Qx"}`,
				`{"type":"response.output_text.delta","sequence_number":10,"item_id":"msg_1","delta":"bc","obfuscation":"Q"}`,
				`{"type":"response.output_text.delta","sequence_number":11,"item_id":"msg_1","delta":"","obfuscation":"Qxyz"}`,
				`{"type":"response.output_text.done","sequence_number":12,"item_id":"msg_1","text":"abc"}`,
			},
			want: "-++-",
		},
	}
	// An invalid event never fits, whatever holes it comes after.
	for _, bad := range []string{
		`{"n":2,"choices":[{"delta":{"content":"z"}}]}x`,
		`{"n":2,"choices":[{"delta":{"content":"z` + "\x01" + `"}}]}`,
		`{"n":2,"choices":[{"delta":{"content":"z\q"}}]}`,
		`{"n":2,"choices":[{"delta":{"content":"z`,
		`{"n":1.,"choices":[{"delta":{"content":"z"}}]}`,
		`{"n":01,"choices":[{"delta":{"content":"z"}}]}`,
		`{"n":-,"choices":[{"delta":{"content":"z"}}]}`,
		`{"n":1 2,"choices":[{"delta":{"content":"z"}}]}`,
		`{"n":"\q","choices":[{"delta":{"content":"z"}}]}`,
		`{"n":[1,],"choices":[{"delta":{"content":"z"}}]}`,
		`{"n":nul,"choices":[{"delta":{"content":"z"}}]}`,
		`{"n":2,"choices":[{"delta":{"content":"z"}}]`,
		`{"n":2,"choices":[{"delta":{"content":"z"}}]}}`,
	} {
		tests = append(tests, struct {
			name string
			tree pathTree
			docs []string
			want string
		}{
			name: "invalid " + bad,
			tree: chat,
			docs: []string{
				`{"n":0,"choices":[{"delta":{"content":"x"}}]}`,
				`{"n":1,"choices":[{"delta":{"content":"y"}}]}`,
				bad,
			},
			want: "-+-",
		})
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var docs [][]byte
			for _, d := range tc.docs {
				docs = append(docs, []byte(d))
			}
			got, err := shapeRun(tc.tree, docs)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Fatalf("fits %s, want %s", got, tc.want)
			}
		})
	}
}

// TestEventShapeFitsStreams pins that the streams the benchmarks model are
// read against their shape, not parsed in full event after event: correct
// either way, but several times slower.
func TestEventShapeFitsStreams(t *testing.T) {
	type stream struct {
		name   string
		api    API
		events [][]byte
	}
	var streams []stream
	for _, gen := range []struct {
		name string
		api  API
		make func(int) ([]byte, [][]byte)
	}{
		{"chat", APIOpenAIChat, chatStream},
		{"chat current", APIOpenAIChat, chatStreamCurrent},
		{"chat logprobs", APIOpenAIChat, chatStreamLogprobs},
		{"responses", APIOpenAIResponses, responsesStream},
		{"anthropic", APIAnthropicMessages, anthropicStream},
	} {
		_, events := gen.make(200)
		streams = append(streams, stream{gen.name, gen.api, events})
	}
	for _, s := range streams {
		t.Run(s.name, func(t *testing.T) {
			var docs [][]byte
			for _, ev := range s.events {
				for _, line := range bytes.Split(ev, []byte("\n")) {
					if d, ok := bytes.CutPrefix(line, []byte("data: ")); ok && string(d) != "[DONE]" {
						docs = append(docs, d)
					}
				}
			}
			pattern, err := shapeRun(treeFor(s.api, true), docs)
			if err != nil {
				t.Fatal(err)
			}
			if misses := strings.Count(pattern, "-"); misses > 4 {
				t.Fatalf("%d of %d events parsed in full: %s", misses, len(docs), pattern)
			}
		})
	}
}

// FuzzEventShape holds the shape path to the full parser: a document that
// fits the shape learned from another, or from an edit of it, must be valid
// and yield exactly what parsing it does; and a template must still fit
// itself after whatever it learned.
func FuzzEventShape(f *testing.F) {
	f.Add([]byte(`{"id":"c","created":7,"choices":[{"index":0,"delta":{"content":"ab"},"logprobs":null}],"usage":null,"obfuscation":"Qx"}`), uint16(60), uint8(2), []byte(`x\u00e9y`), uint8(treeOpenAIChat))
	f.Add([]byte(`{"id":"c","created":7,"choices":[{"index":0,"delta":{"content":"ab"},"logprobs":null}],"usage":null,"obfuscation":"Qx"}`), uint16(23), uint8(1), []byte(`1e5`), uint8(treeOpenAIChat))
	f.Add([]byte(`{"id":"c","created":7,"choices":[{"index":0,"delta":{"content":"ab"},"logprobs":null}],"usage":null,"obfuscation":"Qx"}`), uint16(85), uint8(4), []byte(`{"a":[1,"\n"]}`), uint8(treeOpenAIChat))
	f.Add([]byte(`{"choices":[{"delta":{"content":"a","content":"bb"},"delta":{"refusal":"c"}}]}`), uint16(30), uint8(1), []byte(`zzz`), uint8(treeOpenAIChat))
	f.Add([]byte(`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}`), uint16(75), uint8(2), []byte(`\ud83d\ude00`), uint8(treeAnthropicSSE))
	f.Add([]byte(`{"type":"response.output_text.delta","sequence_number":9,"item_id":"m","delta":"a"}`), uint16(56), uint8(1), []byte(`10`), uint8(treeResponsesSSE))
	f.Add([]byte(`{"x":[[[]]],"choices":[{"text":"a"},{"message":{"tool_calls":[{"function":{"arguments":"{}"}}]}}]}`), uint16(7), uint8(2), []byte(`[[[[]]]]`), uint8(treeOpenAIChat))
	f.Fuzz(func(t *testing.T, first []byte, at uint16, cut uint8, insert []byte, treeByte uint8) {
		tree := trees[int(treeByte)%len(trees)]
		i := min(int(at), len(first))
		j := min(i+int(cut), len(first))
		edited := append(append(bytes.Clone(first[:i]), insert...), first[j:]...)
		var sh eventShape
		var d, want docResult
		if !sh.beginLearn(first) {
			return
		}
		valid := scanDoc(tree, first, &want)
		if ok := scanDocRec(tree, first, &d, &sh); ok != valid || (ok && !sameDoc(d, want)) {
			t.Fatalf("recording parse %v %+v, parse %v %+v", ok, d, valid, want)
		}
		if !valid {
			return
		}
		sh.learn(first, &d)
		for k, doc := range [][]byte{edited, first, edited} {
			content, ok := sh.fit(doc)
			if k == 1 && !ok {
				t.Fatalf("the template no longer fits itself")
			}
			if !ok {
				continue
			}
			var want docResult
			if !scanDoc(tree, doc, &want) {
				t.Fatalf("fitted an invalid document: %q", doc)
			}
			got := sh.res
			got.content = content
			if !sameDoc(got, want) {
				t.Fatalf("fit %+v, parse %+v: %q", got, want, doc)
			}
		}
	})
}
