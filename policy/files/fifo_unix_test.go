//go:build unix

package files_test

import (
	"errors"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
)

// TestReadRefusesAFIFOWithoutWaiting: opening a FIFO used to wait for a writer forever (a
// spend state file that was a FIFO hung the start); it is refused at once. Were Read to wait,
// the test would never end.
func TestReadRefusesAFIFOWithoutWaiting(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := files.Read(path, files.MaxSmall); !errors.Is(err, files.ErrNotRegular) {
		t.Errorf("a FIFO: %v, want ErrNotRegular", err)
	}
}
