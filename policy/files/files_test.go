package files_test

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
)

func TestReadRegularFile(t *testing.T) {
	dir := t.TempDir()
	for _, size := range []int{0, 1, 100, 4096, 100_000} {
		want := bytes.Repeat([]byte{'x'}, size)
		path := filepath.Join(dir, "f")
		if err := os.WriteFile(path, want, 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := files.Read(path, 100_000)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%d bytes: got %d bytes, %v", size, len(got), err)
		}
	}
}

// TestReadRefusesAFileAboveTheBound: a file one byte above the bound is refused, whole or
// not; one at the bound is read.
func TestReadRefusesAFileAboveTheBound(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, make([]byte, 1001), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := files.Read(path, 1000); !errors.Is(err, files.ErrTooLarge) || !strings.Contains(err.Error(), path) {
		t.Errorf("1001 bytes read with a bound of 1000: %v, want ErrTooLarge naming the file", err)
	}
	if b, err := files.Read(path, 1001); err != nil || len(b) != 1001 {
		t.Errorf("1001 bytes read with a bound of 1001: %d bytes, %v", len(b), err)
	}
}

// TestReadRefusesWhatIsNotARegularFile: /dev/zero used to be read until memory ran out, and a
// directory gave a confusing read error; both are refused before anything is read.
func TestReadRefusesWhatIsNotARegularFile(t *testing.T) {
	for _, path := range []string{"/dev/zero", "/dev/null", t.TempDir()} {
		if _, err := os.Stat(path); err != nil {
			t.Logf("%s: %v; skipped", path, err)
			continue
		}
		_, err := files.Read(path, files.MaxPolicy)
		if !errors.Is(err, files.ErrNotRegular) || !strings.Contains(err.Error(), path) {
			t.Errorf("%s: %v, want ErrNotRegular naming the path", path, err)
		}
	}
}

func TestReadMissingFile(t *testing.T) {
	_, err := files.Read(filepath.Join(t.TempDir(), "none"), 10)
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v, want fs.ErrNotExist", err)
	}
}

// TestReadFollowsSymlinks: Kubernetes mounts ConfigMaps and Secrets as symbolic links into a
// ..data directory; the file they name is read.
func TestReadFollowsSymlinks(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "real"), []byte("policy"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("real", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	if b, err := files.Read(filepath.Join(dir, "link"), 100); err != nil || string(b) != "policy" {
		t.Errorf("through a symlink: %q, %v", b, err)
	}
}
