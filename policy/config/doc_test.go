package config_test

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	yaml "go.yaml.in/yaml/v3"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
)

// TestPolicyDocIsCurrent keeps docs/policy.md equal to what the schema's doc comments say:
// every key of the policy file with its type, default, description and, where the example
// policy sets it, an example. Run with UPDATE_DOCS=1 to rewrite the file after changing the
// schema.
func TestPolicyDocIsCurrent(t *testing.T) {
	got := generatePolicyDoc(t)
	const path = "../../docs/policy.md"
	if os.Getenv("UPDATE_DOCS") == "1" {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run UPDATE_DOCS=1 go test ./policy/config -run TestPolicyDocIsCurrent)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("docs/policy.md is out of date with policy/config/schema.go: run UPDATE_DOCS=1 go test ./policy/config -run TestPolicyDocIsCurrent")
	}
}

type docField struct {
	path, typ, def, doc, example string
}

type schema struct {
	types map[string]*ast.StructType
	docs  map[string]string // "Type.Field" → doc
	tdocs map[string]string // type → doc
}

func parseSchema(t *testing.T) *schema {
	fset := token.NewFileSet()
	// The policy's sections are declared in schema.go and in files of their own (refusals.go…).
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var decls []ast.Decl
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		decls = append(decls, f.Decls...)
	}
	s := &schema{types: map[string]*ast.StructType{}, docs: map[string]string{}, tdocs: map[string]string{}}
	for _, d := range decls {
		gd, ok := d.(*ast.GenDecl)
		if !ok {
			continue
		}
		for _, spec := range gd.Specs {
			ts, ok := spec.(*ast.TypeSpec)
			if !ok {
				continue
			}
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				continue
			}
			s.types[ts.Name.Name] = st
			s.tdocs[ts.Name.Name] = strings.TrimSpace(gd.Doc.Text())
			for _, fld := range st.Fields.List {
				for _, n := range fld.Names {
					s.docs[ts.Name.Name+"."+n.Name] = strings.TrimSpace(fld.Doc.Text())
				}
			}
		}
	}
	return s
}

var defaultRE = regexp.MustCompile(`(?s)Defaults?:? (.*?)(\.\s|\.$|$)`)

func typeName(e ast.Expr) (name string, elem ast.Expr, kind string) {
	switch x := e.(type) {
	case *ast.StarExpr:
		return typeName(x.X)
	case *ast.Ident:
		switch x.Name {
		case "string":
			return "string", nil, "scalar"
		case "bool":
			return "boolean", nil, "scalar"
		case "int", "int64":
			return "integer", nil, "scalar"
		case "float64":
			return "number", nil, "scalar"
		case "Duration":
			return "duration", nil, "scalar"
		case "Size":
			return "size", nil, "scalar"
		case "Amount":
			return "amount", nil, "scalar"
		case "Concurrency":
			return "integer or adaptive", nil, "scalar"
		case "KeyHashes":
			return "list of strings", nil, "scalar"
		}
		return x.Name, nil, "struct"
	case *ast.ArrayType:
		n, _, k := typeName(x.Elt)
		if k == "struct" {
			return "list of mappings", x.Elt, "list"
		}
		return "list of " + n + "s", nil, "scalar"
	case *ast.MapType:
		n, _, k := typeName(x.Value)
		if k == "struct" {
			return "mapping of name → " + n, x.Value, "map"
		}
		if a, ok := x.Value.(*ast.ArrayType); ok {
			en, _, _ := typeName(a.Elt)
			return "mapping of name → list of " + en + "s", nil, "scalar"
		}
		return "mapping of string → " + n, nil, "scalar"
	}
	return "?", nil, "scalar"
}

func (s *schema) walk(typ, path string, out *[]docField) {
	st := s.types[typ]
	for _, f := range st.Fields.List {
		tag := ""
		if f.Tag != nil {
			tag = reflectTag(f.Tag.Value)
		}
		if strings.Contains(tag, ",squash") {
			id := f.Type.(*ast.Ident).Name
			s.walk(id, path, out)
			continue
		}
		if tag == "" || len(f.Names) == 0 {
			continue
		}
		key := path + tag
		doc := s.docs[typ+"."+f.Names[0].Name]
		name, elem, kind := typeName(f.Type)
		df := docField{path: key, typ: name, doc: oneLine(doc)}
		if m := defaultRE.FindStringSubmatch(doc); m != nil {
			df.def = oneLine(m[1])
		}
		switch kind {
		case "struct":
			df.typ = "mapping"
			*out = append(*out, df)
			s.walk(name, key+".", out)
		case "list":
			*out = append(*out, df)
			en, _, _ := typeName(elem)
			s.walk(en, key+"[].", out)
		case "map":
			*out = append(*out, df)
			en, _, _ := typeName(elem)
			s.walk(en, key+".<name>.", out)
		default:
			*out = append(*out, df)
		}
	}
}

func reflectTag(lit string) string {
	m := regexp.MustCompile(`koanf:"([^"]*)"`).FindStringSubmatch(lit)
	if m == nil {
		return ""
	}
	return m[1]
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// exampleValue finds the value of a doc path in the example policy: "<name>" takes the first
// key of a mapping, "[]" the first element of a list.
func exampleValue(root *yaml.Node, path string) string {
	n := root
	if n.Kind == yaml.DocumentNode {
		n = n.Content[0]
	}
	parts := strings.Split(strings.ReplaceAll(path, "[]", ".[]"), ".")
	for _, p := range parts {
		switch {
		case p == "[]":
			if n.Kind != yaml.SequenceNode || len(n.Content) == 0 {
				return ""
			}
			n = n.Content[0]
		case p == "<name>":
			if n.Kind != yaml.MappingNode || len(n.Content) == 0 {
				return ""
			}
			n = n.Content[1]
		default:
			if n.Kind != yaml.MappingNode {
				return ""
			}
			var next *yaml.Node
			for i := 0; i+1 < len(n.Content); i += 2 {
				if n.Content[i].Value == p {
					next = n.Content[i+1]
				}
			}
			if next == nil {
				return ""
			}
			n = next
		}
	}
	switch n.Kind {
	case yaml.ScalarNode:
		return n.Value
	case yaml.SequenceNode:
		var vals []string
		for _, c := range n.Content {
			if c.Kind != yaml.ScalarNode {
				return ""
			}
			vals = append(vals, c.Value)
		}
		return "[" + strings.Join(vals, ", ") + "]"
	}
	return ""
}

func generatePolicyDoc(t *testing.T) []byte {
	s := parseSchema(t)
	var fields []docField
	s.walk("Policy", "", &fields)
	var root yaml.Node
	if err := yaml.Unmarshal(examples.DefaultPolicy, &root); err != nil {
		t.Fatal(err)
	}
	for i := range fields {
		fields[i].example = exampleValue(&root, fields[i].path)
	}
	var b bytes.Buffer
	b.WriteString(`# Policy file reference

Generated from ` + "`policy/config/schema.go`" + ` by ` + "`UPDATE_DOCS=1 go test ./policy/config -run TestPolicyDocIsCurrent`" + `;
a test fails when this file and the schema disagree. Examples come from
[examples/policy.yaml](../examples/policy.yaml).

Rules that hold for the whole file:

- Unknown keys are errors (with file, line and key path, and a suggestion for a misspelling).
  Wrong types are errors that show the offending value. One run — ` + "`llm-bulkhead validate`" + `, the
  server's start or a reload — reports every problem of every kind (unknown keys, wrong types,
  values out of bounds, keys that contradict each other), counted and ordered by line, problems
  of ` + "`LLM_BULKHEAD_`" + ` overrides first. Only checks that would judge a value the decoder could not
  take are skipped: that value's own, and those reading several keys of the entry holding it
  (a feature, a pool, a breaker…); a check of one sibling value against fixed bounds still runs.
- Durations are written with a unit (` + "`100ms`, `5s`, `1m30s`" + `); sizes as bytes or with a unit
  (` + "`512KiB`, `8MiB`" + `).
- ` + "`<name>`" + ` in a path stands for a name you choose (a feature, tier, provider, template or breaker
  name: lower-case letters, digits, ` + "`_`" + ` and ` + "`-`" + `); ` + "`[]`" + ` for an item of a list.
- Every scalar can be overridden from the environment: ` + "`LLM_BULKHEAD_`" + ` followed by the path in
  upper case with levels separated by ` + "`__`" + `, e.g. ` + "`LLM_BULKHEAD_FEATURES__CHAT__MAX_WAIT=3s`" + `
  (list items cannot be overridden).
- Limit sets (features, tiers, providers, templates, tenant overrides, family limits) inherit
  unset keys from their ` + "`template`" + `, which may inherit from another (cycles are refused).

`)
	sections := map[string][]docField{}
	var order []string
	for _, f := range fields {
		top, _, _ := strings.Cut(f.path, ".")
		top, _, _ = strings.Cut(top, "[")
		if _, ok := sections[top]; !ok {
			order = append(order, top)
		}
		sections[top] = append(sections[top], f)
	}
	policyFields := map[string]string{}
	for _, f := range s.types["Policy"].Fields.List {
		policyFields[reflectTag(f.Tag.Value)] = oneLine(s.docs["Policy."+f.Names[0].Name])
	}
	for _, sec := range order {
		fmt.Fprintf(&b, "## `%s`\n\n%s\n\n", sec, policyFields[sec])
		b.WriteString("| key | type | default | example | meaning |\n|---|---|---|---|---|\n")
		for _, f := range sections[sec] {
			ex := f.example
			if ex != "" {
				ex = "`" + ex + "`"
			}
			fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s |\n", f.path, f.typ, mdEscape(f.def), mdEscape(ex), mdEscape(f.doc))
		}
		b.WriteString("\n")
	}
	keys := make([]string, 0, len(fields))
	for _, f := range fields {
		keys = append(keys, f.path)
	}
	sort.Strings(keys)
	fmt.Fprintf(&b, "%d keys in all.\n", len(keys))
	return b.Bytes()
}

func mdEscape(s string) string { return strings.ReplaceAll(s, "|", `\|`) }
