package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	yaml3 "go.yaml.in/yaml/v3"
	"sigs.k8s.io/yaml"
)

// chartValue is one documented value of values.yaml: its dotted path and its comment.
type chartValue struct {
	path, comment string
}

// chartValues walks values.yaml. A value is a key whose comment starts with "# --" (the
// helm-docs convention); every leaf must be a value or lie under one.
func chartValues(t *testing.T) []chartValue {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var root yaml3.Node
	if err := yaml3.Unmarshal(b, &root); err != nil {
		t.Fatal(err)
	}
	var out []chartValue
	var walk func(n *yaml3.Node, prefix string, documented bool)
	walk = func(n *yaml3.Node, prefix string, documented bool) {
		for i := 0; i+1 < len(n.Content); i += 2 {
			key, val := n.Content[i], n.Content[i+1]
			path := strings.TrimPrefix(prefix+"."+key.Value, ".")
			comment := key.HeadComment
			if j := strings.LastIndex(comment, "# --"); j >= 0 {
				comment = comment[j:]
			}
			isValue := strings.HasPrefix(comment, "# --")
			if isValue {
				out = append(out, chartValue{path: path, comment: comment})
			}
			if val.Kind == yaml3.MappingNode && len(val.Content) > 0 && !isValue {
				walk(val, path, documented)
				continue
			}
			if !isValue && !documented {
				t.Errorf("values.yaml: %s has no '# --' comment saying what it does", path)
			}
		}
	}
	walk(root.Content[0], "", false)
	return out
}

// Every value of the chart is in the table of docs/kubernetes.md, and the table names no value
// the chart does not have.
func TestChartValuesDocumented(t *testing.T) {
	doc := string(readRepoFile(t, "docs/kubernetes.md"))
	values := chartValues(t)
	if len(values) < 40 {
		t.Fatalf("found only %d documented values in values.yaml", len(values))
	}
	known := map[string]bool{}
	for _, v := range values {
		known[v.path] = true
		if !strings.Contains(doc, "| `"+v.path+"` |") {
			t.Errorf("docs/kubernetes.md has no row for value %s", v.path)
		}
	}
	rows := regexp.MustCompile("(?m)^\\| `([a-zA-Z0-9_.]+)` \\|").FindAllStringSubmatch(doc, -1)
	for _, r := range rows {
		if !known[r[1]] && isChartValueRow(r[1]) {
			t.Errorf("docs/kubernetes.md documents value %s, which values.yaml does not have", r[1])
		}
	}
	// Every value named in a template exists in values.yaml (a misspelt .Values.x renders empty).
	var defaults map[string]any
	if err := yaml.Unmarshal(readRepoFileIn(t, chartDir, "values.yaml"), &defaults); err != nil {
		t.Fatal(err)
	}
	templates, _ := filepath.Glob(filepath.Join(chartDir, "templates", "*"))
	ref := regexp.MustCompile(`\.Values\.([a-zA-Z0-9_.]+)`)
	for _, tpl := range templates {
		b, _ := os.ReadFile(tpl)
		for _, m := range ref.FindAllStringSubmatch(string(b), -1) {
			if !hasPath(defaults, m[1]) {
				t.Errorf("%s uses .Values.%s, which values.yaml does not define", filepath.Base(tpl), m[1])
			}
		}
	}
}

// isChartValueRow tells a row of the values table from rows of other tables on the page
// (which name policy keys such as envoy.message_timeout, with underscores).
func isChartValueRow(path string) bool {
	return !strings.Contains(path, "_")
}

func hasPath(m map[string]any, path string) bool {
	var cur any = m
	for _, k := range strings.Split(path, ".") {
		mm, ok := cur.(map[string]any)
		if !ok {
			return false
		}
		if cur, ok = mm[k]; !ok {
			return false
		}
	}
	return true
}

func readRepoFileIn(t *testing.T, dir, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// docs/operations.md says what to do for every alert examples/alerts.yaml ships.
func TestOperationsCoversEveryAlert(t *testing.T) {
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert string `json:"alert"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(readRepoFile(t, "examples/alerts.yaml"), &rules); err != nil {
		t.Fatal(err)
	}
	doc := string(readRepoFile(t, "docs/operations.md"))
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if !strings.Contains(doc, "### "+r.Alert) {
				t.Errorf("docs/operations.md has no section \"### %s\" saying what to do", r.Alert)
			}
		}
	}
	if n == 0 {
		t.Fatal("no alerts in examples/alerts.yaml")
	}
}

// Every example file under deploy/ is named in the guide that explains it.
func TestGatewayExamplesAreInTheGuides(t *testing.T) {
	guides := string(readRepoFile(t, "docs/gateways.md")) + string(readRepoFile(t, "docs/kubernetes.md"))
	for _, dir := range []string{"envoy-gateway", "ai-gateway", "istio"} {
		files, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
		for _, f := range files {
			if !strings.Contains(guides, "deploy/"+f) {
				t.Errorf("deploy/%s is not explained in docs/gateways.md", f)
			}
		}
	}
}
