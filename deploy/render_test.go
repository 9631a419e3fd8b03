package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	chart "helm.sh/helm/v4/pkg/chart/v2"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"helm.sh/helm/v4/pkg/engine"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/yaml"
)

const (
	chartDir    = "helm/llm-bulkhead"
	releaseName = "bulkhead"
	namespace   = "llm"
)

// loadChart loads the chart from its directory as `helm install ./deploy/helm/llm-bulkhead`
// would (symbolic links followed).
func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatalf("load chart: %v", err)
	}
	return c
}

// manifest is one rendered Kubernetes object: the template it came from and its YAML.
type manifest struct {
	template string
	gvk      schema.GroupVersionKind
	name     string
	doc      []byte
}

// rendered is a rendered release: its manifests, and NOTES.txt.
type rendered struct {
	manifests []manifest
	notes     string
}

// render renders the chart with values over values.yaml, as `helm template` does for an
// install into namespace llm. It fails the test on a template error.
func render(t *testing.T, values map[string]any) rendered {
	t.Helper()
	r, err := tryRender(t, values)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	return r
}

// tryRender renders and returns the error a template raised (fail included).
func tryRender(t *testing.T, values map[string]any) (rendered, error) {
	t.Helper()
	return renderRelease(t, releaseName, namespace, values)
}

// renderRelease renders the chart as release name in namespace ns.
func renderRelease(t *testing.T, name, ns string, values map[string]any) (rendered, error) {
	t.Helper()
	c := loadChart(t)
	vals, err := util.ToRenderValues(c, values, common.ReleaseOptions{
		Name: name, Namespace: ns, Revision: 1, IsInstall: true,
	}, common.DefaultCapabilities)
	if err != nil {
		return rendered{}, err
	}
	out, err := engine.Render(c, vals)
	if err != nil {
		return rendered{}, err
	}
	var r rendered
	names := make([]string, 0, len(out))
	for name := range out {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		text := out[name]
		base := filepath.Base(name)
		switch {
		case base == "NOTES.txt":
			r.notes = text
			continue
		case strings.HasPrefix(base, "_"):
			continue
		}
		for _, doc := range splitYAML(text) {
			m, err := parseManifest(name, doc)
			if err != nil {
				t.Fatal(err)
			}
			r.manifests = append(r.manifests, m)
		}
	}
	return r, nil
}

// readManifests reads a multi-document YAML file of manifests written by hand.
func readManifests(t *testing.T, path string) []manifest {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []manifest
	for _, doc := range splitYAML(string(b)) {
		m, err := parseManifest(path, doc)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

// parseManifest reads a document's apiVersion, kind and name.
func parseManifest(source string, doc []byte) (manifest, error) {
	var meta struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := yaml.Unmarshal(doc, &meta); err != nil {
		return manifest{}, fmt.Errorf("%s: not YAML: %w\n%s", source, err, doc)
	}
	gv, err := schema.ParseGroupVersion(meta.APIVersion)
	if err != nil || meta.Kind == "" || meta.Metadata.Name == "" {
		return manifest{}, fmt.Errorf("%s: a document without apiVersion, kind or name:\n%s", source, doc)
	}
	return manifest{template: source, gvk: gv.WithKind(meta.Kind), name: meta.Metadata.Name, doc: doc}, nil
}

var docSeparator = regexp.MustCompile(`(?m)^---\s*$`)

// splitYAML splits a multi-document YAML file, dropping empty documents and comment-only ones.
func splitYAML(text string) [][]byte {
	var docs [][]byte
	for _, part := range docSeparator.Split(text, -1) {
		empty := true
		for _, line := range strings.Split(part, "\n") {
			line = strings.TrimSpace(line)
			if line != "" && !strings.HasPrefix(line, "#") {
				empty = false
				break
			}
		}
		if !empty {
			docs = append(docs, []byte(part))
		}
	}
	return docs
}

// find returns the one manifest of kind named name (empty: the only one of that kind).
func (r rendered) find(t *testing.T, kind, name string) manifest {
	t.Helper()
	var found []manifest
	for _, m := range r.manifests {
		if m.gvk.Kind == kind && (name == "" || m.name == name) {
			found = append(found, m)
		}
	}
	if len(found) != 1 {
		t.Fatalf("want one %s %q in the rendered chart, found %d (%v)", kind, name, len(found), r.kinds())
	}
	return found[0]
}

func (r rendered) kinds() []string {
	var ks []string
	for _, m := range r.manifests {
		ks = append(ks, m.gvk.Kind+"/"+m.name)
	}
	return ks
}

// strict decodes YAML into out, refusing unknown and duplicate fields: a misspelt key in a
// manifest fails here instead of being dropped silently by the API server.
func strict(t *testing.T, what string, doc []byte, out any) {
	t.Helper()
	if err := yaml.UnmarshalStrict(doc, out); err != nil {
		t.Fatalf("%s does not decode strictly into %T: %v\n%s", what, out, err, doc)
	}
}

// strictJSON decodes JSON into out, refusing unknown fields.
func strictJSON(what string, data []byte, out any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(out); err != nil {
		return fmt.Errorf("%s does not decode strictly into %T: %w", what, out, err)
	}
	return nil
}

// readRepoFile reads a file of the repository (this module lives in its deploy/ folder).
func readRepoFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", path))
	if err != nil {
		t.Fatal(err)
	}
	return b
}
