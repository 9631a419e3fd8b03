package llmapi

import (
	"bytes"
	"strings"
	"testing"
)

// streamDoc runs the streaming parser over doc in pieces of size n.
func streamDoc(tree pathTree, doc []byte, n int) (docResult, bool) {
	var s jsonStream
	s.begin(tree)
	for len(doc) > 0 {
		k := min(n, len(doc))
		s.feed(doc[:k])
		doc = doc[k:]
	}
	ok := s.finish()
	return s.docResult, ok
}

// sameDoc compares what two parses recorded, ignoring slots not present.
func sameDoc(a, b docResult) bool {
	if a.has != b.has || a.content != b.content || !bytes.Equal(a.typ(nil), b.typ(nil)) {
		return false
	}
	for k := range a.vals {
		if a.has&(1<<k) != 0 && a.vals[k] != b.vals[k] {
			return false
		}
	}
	return true
}

var docSeeds = []string{
	`{"type":"message_start","message":{"usage":{"input_tokens":3,"cache_read_input_tokens":2}}}`,
	`{"type":"content_block_delta","delta":{"type":"text_delta","text":"h\u00e9\ud83d\ude00\n"}}`,
	`{"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3},"usage":{"prompt_tokens":7}}`,
	`{"choices":[{"delta":{"content":"ab","content":"c"}},{"text":"xyz"},{"message":{"tool_calls":[{"function":{"arguments":"{}"}}]}}]}`,
	`{"t\u0079pe":"response.completed","response":{"usage":{"input_tokens":1e3,"output_tokens":-1,"total_tokens":0}}}`,
	`{"type":"` + strings.Repeat("x", 49) + `","delta":"d"}`,
	`{"type":"` + strings.Repeat("\u0078", 48) + `"}`,
	`{"type":5,"type":"message_delta","usage":{"output_tokens":99999999999999999999}}`,
	` [1, {"usage": {"prompt_tokens": 4}}] `,
	`"just a string"`,
	`123`,
	`-0.5e+7`,
	`{"a":[[[[[[[[[[{"usage":{"prompt_tokens":1}}]]]]]]]]]]}`,
	`{"type":"message\u005fstart","message":{"usage":{"\ud800x":1,"input_tokens":2,"\ud83d\ude00":3}}}`,
	`{"type":"\ud83dmessage_delta\ud83d\ude00\udc00\ud83d\u0041","usage":{"output_tokens":1}}`,
	`{"type":"` + strings.Repeat(`\u00e9`, 25) + `"}`,
	`{"choices":[{"logprobs":{"content":[{"token":"a","logprob":-0.1,"bytes":[97]}]},"x":true,"y":false,"delta":{"content":"\ud800"}}]}`,
	`{"choices":[],"usage":{"prompt_tokens":0,"completion_tokens":0,"prompt_tokens_details":null,"completion_tokens_details":{"reasoning_tokens":7}}}`,
}

func TestScanDocMatchesStream(t *testing.T) {
	docs := append([]string(nil), docSeeds...)
	docs = append(docs, `{"a":"","b":""}`, `{"":"","":"x","n":1,"z":null}`)
	for _, sf := range sampleFiles {
		for _, line := range strings.Split(string(readSample(t, sf.file)), "\n") {
			if d, ok := strings.CutPrefix(line, "data: "); ok && d != "[DONE]" {
				docs = append(docs, d)
				var r docResult
				if !scanDoc(treeFor(sf.api, true), []byte(d), &r) {
					t.Fatalf("%s: the fast path refused %s", sf.file, d)
				}
			}
		}
	}
	for i, d := range docs {
		for ti, tree := range trees {
			var fast docResult
			ok := scanDoc(tree, []byte(d), &fast)
			for _, n := range []int{1, 3, len(d)} {
				slow, sok := streamDoc(tree, []byte(d), n)
				if ok != sok || (ok && !sameDoc(fast, slow)) {
					t.Fatalf("doc %d tree %d pieces of %d: fast %v %+v, stream %v %+v", i, ti, n, ok, fast, sok, slow)
				}
			}
		}
	}
}

func FuzzScanDoc(f *testing.F) {
	for _, d := range docSeeds {
		f.Add([]byte(d), uint8(0), uint8(7))
	}
	f.Fuzz(func(t *testing.T, doc []byte, treeByte, piece uint8) {
		tree := trees[int(treeByte)%len(trees)]
		var fast docResult
		ok := scanDoc(tree, doc, &fast)
		slow, sok := streamDoc(tree, doc, 1+int(piece))
		if ok != sok {
			t.Fatalf("valid: fast %v, stream %v", ok, sok)
		}
		if ok && !sameDoc(fast, slow) {
			t.Fatalf("fast %+v\nstream %+v", fast, slow)
		}
	})
}

// TestScanDocShortMembersRegression pins a bug where an object whose keys and
// values were all short enough for the one-word check was refused by the
// fast path (its success flag was never set) and silently re-parsed by the
// streaming parser: correct results, several times slower.
func TestScanDocShortMembersRegression(t *testing.T) {
	for _, d := range []string{`{"a":"","b":""}`, `{"":"","":""}`, `{"id":"x","usage":{"prompt_tokens":1}}`} {
		var r docResult
		if !scanDoc(trees[treeOpenAIChat], []byte(d), &r) {
			t.Errorf("fast path refused %s", d)
		}
	}
}
