package deploy

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"
)

// llmBulkhead is the server's binary, built from this checkout for `llm-bulkhead validate`.
var llmBulkhead string

func TestMain(m *testing.M) {
	// Helm's loader logs, at info, every symbolic link it follows; files/ is made of them.
	slog.SetDefault(slog.New(slog.NewTextHandler(io.Discard, nil)))
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "llm-bulkhead-deploy-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	// The server is its own module (the parent folder): built with its own go.mod, so this
	// module never depends on the server's packages or their dependencies.
	llmBulkhead = filepath.Join(dir, "llm-bulkhead")
	build := exec.Command("go", "build", "-o", llmBulkhead, "./cmd/llm-bulkhead")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build llm-bulkhead: %v\n%s", err, out)
		return 1
	}
	code := m.Run()
	// The probe test's HTTP client and the server process it waits for must be gone.
	http.DefaultClient.CloseIdleConnections()
	if err := goleak.Find(); code == 0 && err != nil {
		fmt.Fprintln(os.Stderr, "goroutines left behind:", err)
		return 1
	}
	return code
}
