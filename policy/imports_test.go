package policy_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestRuntimeIsWatchedNotWatching: the runtime tells a Recorder what it does and is read by
// policy/observe; it imports neither observe nor Prometheus, nor anything of Envoy or gRPC (the
// adapter's business), so that its metrics can change without touching admission.
func TestRuntimeIsWatchedNotWatching(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", `{{join .Imports "\n"}}`, ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	imports := strings.Fields(string(out))
	if len(imports) < 5 {
		t.Fatalf("go list found only %d imports of package policy:\n%s", len(imports), out)
	}
	const module = "github.com/llm-bulkhead/llm-bulkhead/"
	for _, imp := range imports {
		switch {
		case strings.HasPrefix(imp, "github.com/prometheus/"), strings.HasPrefix(imp, "github.com/envoyproxy/"),
			strings.HasPrefix(imp, "google.golang.org/grpc"), imp == module+"policy/observe", strings.HasPrefix(imp, module+"extproc"):
			t.Errorf("package policy imports %s", imp)
		}
	}
}
