package config

import (
	"fmt"
	"testing"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
)

// FuzzYAMLSource: the loader parses a file once and walks yaml.v3's node tree itself, so that
// walk must read a file as yaml.v3's own decoding into a map does (which is how koanf read it
// before): the same map when yaml.v3 accepts the file, a problem when yaml.v3 refuses it.
// Documented differences are skipped: an unquoted date stays text, keys are taken as written
// (0x10 stays "0x10"), and a key reached through an alias counts as a duplicate.
func FuzzYAMLSource(f *testing.F) {
	f.Add(examples.DefaultPolicy)
	for _, s := range []string{
		"a: &x {b: 1, c: [1, 2]}\nd: {<<: *x, b: 2}\n",
		"a: &x {b: 1}\ny: &y {b: 3, e: 4}\nd: {<<: [*x, *y], f: 5}\n",
		"a: 1\na: 2\n",
		"a: {<<: 5}\n",
		"a: {<<: {b: 1}, <<: {c: 2}}\n",
		"a: !!int x\n",
		"a: !!binary aGk=\nb: .inf\nc: 0o17\nd: 1_000\ne: ~\n",
		"? [a]\n: b\n",
		"a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n",
		"a: !!str 5\nb: '5'\nc: 2001-12-14\n",
		"!!binary 0: 1\n!!binary aGk=: 2\n!!int x: 3\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var root yaml.Node
		if yaml.Unmarshal(data, &root) != nil || root.Kind == 0 || root.Content[0].Kind != yaml.MappingNode {
			return // refused by the parser both share, or not a policy at all
		}
		ps := &problems{file: "f.yaml"}
		src := &yamlSource{root: &root, ps: ps, lines: lineIndex{}}
		got, err := src.Read()
		refused := err != nil || len(ps.list) > 0

		var want map[string]any
		if wantErr := yaml.Unmarshal(data, &want); wantErr != nil {
			if !refused {
				t.Fatalf("yaml.v3 refuses the file (%v); the loader took it as %v", wantErr, got)
			}
			return
		}
		if !comparable(&root) || hasTime(want) {
			return
		}
		if refused {
			t.Fatalf("yaml.v3 reads the file as %v; the loader refused it: %v %v", want, err, ps.list)
		}
		if g, w := fmt.Sprintf("%#v", normalize(got)), fmt.Sprintf("%#v", normalize(want)); g != w {
			t.Fatalf("the loader read\n%s\nyaml.v3 read\n%s", g, w)
		}
	})
}

// comparable reports whether every key in the tree is a plain string: only there must the two
// readings agree key for key.
func comparable(n *yaml.Node) bool {
	if n.Kind == yaml.MappingNode {
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i]
			if k.Kind != yaml.ScalarNode || (k.ShortTag() != "!!str" && !isMerge(k)) {
				return false
			}
		}
	}
	for _, c := range n.Content {
		if !comparable(c) {
			return false
		}
	}
	return true // an alias's node is checked where its anchor is
}

func hasTime(v any) bool {
	switch x := v.(type) {
	case time.Time:
		return true
	case map[string]any:
		for _, e := range x {
			if hasTime(e) {
				return true
			}
		}
	case map[any]any:
		for _, e := range x {
			if hasTime(e) {
				return true
			}
		}
	case []any:
		for _, e := range x {
			if hasTime(e) {
				return true
			}
		}
	}
	return false
}

// normalize turns nested map[any]any (yaml.v3's choice for some nested mappings) into
// map[string]any, as koanf did.
func normalize(v any) any {
	switch x := v.(type) {
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[k] = normalize(e)
		}
		return out
	case map[any]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[fmt.Sprint(k)] = normalize(e)
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = normalize(e)
		}
		return out
	}
	return v
}
