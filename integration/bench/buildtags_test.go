package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/extproc"
)

// TestBuiltWithVTReadsTheBinary: the tag read from a binary's build information agrees with
// what the binary knows of itself (this test binary: tagged under `make test`, untagged under a
// plain `go test`), and a binary built without it is named as such in the report.
func TestBuiltWithVTReadsTheBinary(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	got, err := BuiltWithVT(self)
	if err != nil {
		t.Fatalf("BuiltWithVT(%s): %v", self, err)
	}
	if got != extproc.FastMarshal() {
		t.Errorf("BuiltWithVT(test binary) = %v, but its replies' generated marshalling is %v", got, extproc.FastMarshal())
	}

	var logged []string
	logf := func(format string, args ...any) { logged = append(logged, format) }
	note := untagged(self, logf)
	if (note == "") != got || (len(logged) == 0) == !got {
		t.Errorf("untagged(tagged=%v) = %q, logged %q", got, note, logged)
	}

	notGo := filepath.Join(t.TempDir(), "not-a-binary")
	if err := os.WriteFile(notGo, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := BuiltWithVT(notGo); err == nil {
		t.Error("BuiltWithVT of a shell script: no error")
	}
	if note := untagged(notGo, logf); !strings.Contains(note, "unknown") {
		t.Errorf("untagged(shell script) = %q, want build tags unknown", note)
	}
}

// TestReportWarnsOfReflectiveMarshalling: a report from a program built without the tag says
// what its in-process servers' figures are worth.
func TestReportWarnsOfReflectiveMarshalling(t *testing.T) {
	r := &Report{}
	r.Config.ReflectiveMarshalling = true
	r.finish()
	if md := r.Markdown(); !strings.Contains(md, "**Warning**: this program was built without `-tags vtprotobuf`") {
		t.Errorf("no warning in the report:\n%s", md)
	}
	r.Config.ReflectiveMarshalling = false
	if md := r.Markdown(); strings.Contains(md, "**Warning**") {
		t.Errorf("warning in a tagged program's report:\n%s", md)
	}
}
