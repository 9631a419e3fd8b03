package app

import (
	"runtime/debug"
	"testing"
)

// TestBuildInfoFromTheGoBuildRecord: the commit, the modified flag, build tags and platform come
// from the toolchain's record; a version stamped at link time wins over the module version, and
// a devel module version is not taken for one.
func TestBuildInfoFromTheGoBuildRecord(t *testing.T) {
	bi := &debug.BuildInfo{GoVersion: "go1.99.1", Main: debug.Module{Version: "v0.4.0"}, Settings: []debug.BuildSetting{
		{Key: "-tags", Value: "vtprotobuf"}, {Key: "GOOS", Value: "plan9"}, {Key: "GOARCH", Value: "mips"},
		{Key: "vcs.revision", Value: "0123abcd"}, {Key: "vcs.modified", Value: "true"},
	}}
	tests := []struct {
		name, stamped, module string
		want                  BuildInfo
	}{
		{"module version", "", "v0.4.0", BuildInfo{Version: "v0.4.0", Commit: "0123abcd", Modified: true, GoVersion: "go1.99.1", Tags: "vtprotobuf", OS: "plan9", Arch: "mips"}},
		{"stamped wins", "v0.5.0-2-g0123abc-dirty", "v0.4.0", BuildInfo{Version: "v0.5.0-2-g0123abc-dirty", Commit: "0123abcd", Modified: true, GoVersion: "go1.99.1", Tags: "vtprotobuf", OS: "plan9", Arch: "mips"}},
		{"devel is no version", "", "(devel)", BuildInfo{Commit: "0123abcd", Modified: true, GoVersion: "go1.99.1", Tags: "vtprotobuf", OS: "plan9", Arch: "mips"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := *bi
			rec.Main.Version = tt.module
			if got := fromDebug(BuildInfo{Version: tt.stamped, Commit: "unknown"}, &rec); got != tt.want {
				t.Errorf("got %+v\nwant %+v", got, tt.want)
			}
		})
	}
	if got := (BuildInfo{Commit: "0123abcd", Modified: true}).CommitString(); got != "0123abcd-dirty" {
		t.Errorf("CommitString = %q", got)
	}
	if got := (BuildInfo{Commit: "unknown", Modified: true}).CommitString(); got != "unknown" {
		t.Errorf("CommitString without a commit = %q", got)
	}
}

// TestReadBuildInfoAlwaysSaysSomething: a binary without a version (go test, go run) still
// names a version, a commit and its platform, and a stamped version is kept.
func TestReadBuildInfoAlwaysSaysSomething(t *testing.T) {
	b := ReadBuildInfo("")
	if b.Version == "" || b.Commit == "" || b.GoVersion == "" || b.OS == "" || b.Arch == "" {
		t.Errorf("incomplete: %+v", b)
	}
	if got := ReadBuildInfo("v9.9.9").Version; got != "v9.9.9" {
		t.Errorf("stamped version = %q", got)
	}
}
