package config_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// leafImports is what package config may import from this module: small value packages that
// themselves import only the standard library (breaker's Config and its rules, which validation
// reports at their keys).
var leafImports = []string{
	"github.com/llm-bulkhead/llm-bulkhead/policy/apikey",
	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker",
	"github.com/llm-bulkhead/llm-bulkhead/policy/files",
	"github.com/llm-bulkhead/llm-bulkhead/policy/glob",
	"github.com/llm-bulkhead/llm-bulkhead/policy/money",
}

// TestConfigIsALeaf: reading and validating a policy (llm-bulkhead validate, a linter, a test)
// links no Redis client, no Prometheus and nothing of the runtime: go list -deps of the package
// names no go-redis or Prometheus module, and of this module only the value packages above.
func TestConfigIsALeaf(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	const module = "github.com/llm-bulkhead/llm-bulkhead/"
	found := 0
	for _, dep := range strings.Fields(string(out)) {
		switch {
		case strings.HasPrefix(dep, "github.com/redis/"), strings.HasPrefix(dep, "github.com/prometheus/"):
			t.Errorf("package config imports %s", dep)
		case dep == module+"policy/config":
			found++
		case strings.HasPrefix(dep, module) && !slices.Contains(leafImports, dep):
			t.Errorf("package config imports %s, which is not a small value package", dep)
		}
	}
	if found != 1 {
		t.Fatalf("go list -deps did not list package config itself:\n%s", out)
	}
}
