package llmapi

import (
	"bytes"
	"encoding/json"
	"maps"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestRewriteModel(t *testing.T) {
	tests := []struct {
		name, body, model, want string
		changed                 bool
	}{
		{"chat", `{"model":"deepseek-chat","messages":[{"role":"user","content":"model"}]}`, "qwen-plus",
			`{"model":"qwen-plus","messages":[{"role":"user","content":"model"}]}`, true},
		{"spacing and order kept", "{ \"stream\" : true ,\n \"model\" :\t\"deepseek-chat\" , \"n\":1 }", "qwen-plus",
			"{ \"stream\" : true ,\n \"model\" :\t\"qwen-plus\" , \"n\":1 }", true},
		{"nested model untouched", `{"metadata":{"model":"x"},"model":"a"}`, "b", `{"metadata":{"model":"x"},"model":"b"}`, true},
		{"escaped key", `{"mod\u0065l":"a","input":"x"}`, "b", `{"mod\u0065l":"b","input":"x"}`, true},
		{"every duplicate", `{"model":"a","x":1,"model":"c"}`, "b", `{"model":"b","x":1,"model":"b"}`, true},
		{"not a string", `{"model":42}`, "b", `{"model":"b"}`, true},
		{"absent", `{"messages":[]}`, "b", `{"model":"b","messages":[]}`, true},
		{"absent, empty object", ` { } `, "b", ` {"model":"b" } `, true},
		{"quoted", `{"model":"a"}`, `we"ird\name` + "\n", `{"model":"we\"ird\\name\u000a"}`, true},
		{"already so", `{"model":"b","x":1}`, "b", `{"model":"b","x":1}`, false},
		{"invalid JSON", `{"model":"a",}`, "b", `{"model":"a",}`, false},
		{"trailing garbage", `{"model":"a"} x`, "b", `{"model":"a"} x`, false},
		{"array", `[{"model":"a"}]`, "b", `[{"model":"a"}]`, false},
		{"empty", ``, "b", ``, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := []byte(tt.body)
			orig := bytes.Clone(in)
			got, changed := RewriteModel(in, tt.model)
			if string(got) != tt.want || changed != tt.changed {
				t.Errorf("RewriteModel(%s, %q) = %s, %v; want %s, %v", tt.body, tt.model, got, changed, tt.want, tt.changed)
			}
			if !bytes.Equal(in, orig) {
				t.Error("the input was modified")
			}
		})
	}
}

// FuzzRewriteModel: a body RewriteModel changes is a JSON object, and so is the result, with
// the new model and every other member's bytes as they were.
func FuzzRewriteModel(f *testing.F) {
	for _, s := range []string{`{"model":"a","messages":[]}`, `{}`, `{"model":{"x":[1,2]},"model":null}`, `{"a":"\u00e9"}`, `[1]`} {
		f.Add([]byte(s), "qwen-plus")
	}
	f.Fuzz(func(t *testing.T, body []byte, model string) {
		if !utf8.ValidString(model) {
			return // model names come from the policy file, which is UTF-8
		}
		got, changed := RewriteModel(body, model)
		if !changed {
			if !bytes.Equal(got, body) {
				t.Fatalf("unchanged, yet %q became %q", body, got)
			}
			return
		}
		var before, after map[string]json.RawMessage
		if err := json.Unmarshal(body, &before); err != nil || before == nil {
			t.Fatalf("rewrote %q, which is not a JSON object (%v)", body, err)
		}
		if err := json.Unmarshal(got, &after); err != nil {
			t.Fatalf("result is not a JSON object: %v\n%q", err, got)
		}
		var m string
		if err := json.Unmarshal(after["model"], &m); err != nil || m != model {
			t.Fatalf("model = %s, want %q", after["model"], model)
		}
		delete(before, "model")
		delete(after, "model")
		if !maps.EqualFunc(before, after, func(a, b json.RawMessage) bool { return bytes.Equal(a, b) }) {
			t.Fatalf("other members changed:\n%q\n%q", body, got)
		}
	})
}

// BenchmarkRewriteModel rewrites the model of a 4 KiB chat request, the one allocation being the
// new body.
func BenchmarkRewriteModel(b *testing.B) {
	body := []byte(`{"model":"deepseek-chat","max_tokens":500,"stream":true,"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"` +
		strings.Repeat("lorem ipsum ", 340) + `"}]}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := RewriteModel(body, "qwen-plus"); !ok {
			b.Fatal("not rewritten")
		}
	}
}
