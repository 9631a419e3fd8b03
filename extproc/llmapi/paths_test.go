package llmapi

import (
	"strings"
	"testing"
)

func TestTreesCompile(t *testing.T) {
	if treesErr != nil {
		t.Fatal(treesErr)
	}
	for i, tree := range trees {
		if len(tree) < 3 {
			t.Fatalf("tree %d is empty", i)
		}
	}
}

func TestCompileTreeRejects(t *testing.T) {
	tests := []struct {
		name  string
		paths []string
		want  string
	}{
		{"no leaf", []string{"usage.prompt_tokens"}, "no leaf"},
		{"bad slot", []string{"usage.x=#99"}, "bad slot"},
		{"slot not a number", []string{"usage.x=#a"}, "bad slot"},
		{"conflict", []string{"a.b=$", "a=$"}, "conflicts"},
		{"too many members", []string{"a=$", "b=$", "c=$", "d=$", "e=$", "f=$", "g=$"}, "more than"},
		{"too deep", []string{"a.b.c.d.e.f.g.h.i=$"}, "deeper"},
		{"empty member name", []string{"a..b=$"}, "1 to 63"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := compileTree(tc.paths...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestTreeShape(t *testing.T) {
	tree, err := compileTree("usage.a=#0", "usage.d.b=#3", "choices[].x=$", "type=@")
	if err != nil {
		t.Fatal(err)
	}
	root := &tree[1]
	usage := &tree[root.kids[root.lookup([]byte("usage"))]]
	if usage.kind != nodeObject || usage.clear != 1<<0|1<<3 {
		t.Fatalf("usage node %+v", usage)
	}
	choices := &tree[root.kids[root.lookup([]byte("choices"))]]
	if choices.kind != nodeArray || tree[choices.elem].kind != nodeObject {
		t.Fatalf("choices node %+v", choices)
	}
	if root.lookup([]byte("nope")) != -1 || root.lookup(nil) != -1 {
		t.Fatal("lookup found a missing key")
	}
	if treeFor(APIUnknown, true)[1].kind != nodeObject {
		t.Fatal("unknown API has no tree")
	}
}
