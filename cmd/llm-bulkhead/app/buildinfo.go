package app

import (
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// BuildInfo says which build of llm-bulkhead is running: what `llm-bulkhead version` prints, the
// llm_bulkhead_build_info metric's labels and the start log line's version and commit, so that
// an operator can tell from any of them which code answered.
type BuildInfo struct {
	// Version is the release (git describe at build time, e.g. v1.2.0 or v1.2.0-3-gabc1234-dirty),
	// else the module version, else "(devel)".
	Version string
	// Commit is the VCS revision the binary was built from, "unknown" when the build did not
	// record one (go run, go test, a build outside a git checkout).
	Commit string
	// Modified is true when the working tree had uncommitted changes at build time.
	Modified bool
	// GoVersion is the Go toolchain that built the binary, e.g. go1.26.8.
	GoVersion string
	// Tags are the build tags, comma-separated ("" for none); vtprotobuf means replies are
	// marshalled with generated code rather than protobuf reflection.
	Tags string
	// OS and Arch are the platform the binary was built for.
	OS, Arch string
}

// ReadBuildInfo describes the running binary. version, when not empty, is the version stamped
// at link time (-ldflags "-X main.version=…") and wins over the module version.
func ReadBuildInfo(version string) BuildInfo {
	b := BuildInfo{Version: version, Commit: "unknown", GoVersion: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH}
	bi, ok := debug.ReadBuildInfo()
	if ok {
		b = fromDebug(b, bi)
	}
	if b.Version == "" {
		b.Version = "(devel)"
	}
	return b
}

// fromDebug fills b from the Go toolchain's build record.
func fromDebug(b BuildInfo, bi *debug.BuildInfo) BuildInfo {
	if b.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		b.Version = bi.Main.Version
	}
	if bi.GoVersion != "" {
		b.GoVersion = bi.GoVersion
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Commit = s.Value
		case "vcs.modified":
			b.Modified = s.Value == "true"
		case "-tags":
			b.Tags = s.Value
		case "GOOS":
			b.OS = s.Value
		case "GOARCH":
			b.Arch = s.Value
		}
	}
	return b
}

// CommitString is the commit with "-dirty" appended when the tree had uncommitted changes.
func (b BuildInfo) CommitString() string {
	if b.Modified && b.Commit != "unknown" {
		return b.Commit + "-dirty"
	}
	return b.Commit
}

// String is the multi-line description `llm-bulkhead version` prints.
func (b BuildInfo) String() string {
	var s strings.Builder
	s.WriteString("llm-bulkhead " + b.Version + "\n")
	commit := b.Commit
	if b.Modified && commit != "unknown" {
		commit += " (modified)"
	}
	s.WriteString("  commit:     " + commit + "\n")
	s.WriteString("  go version: " + b.GoVersion + "\n")
	tags := b.Tags
	if tags == "" {
		tags = "(none)"
	}
	s.WriteString("  build tags: " + tags + "\n")
	s.WriteString("  platform:   " + b.OS + "/" + b.Arch + "\n")
	return s.String()
}

// registerBuildInfo exports llm_bulkhead_build_info, the usual constant-1 gauge whose labels
// carry the build, so dashboards and alerts can join any series on the version running.
func registerBuildInfo(reg prometheus.Registerer, b BuildInfo) {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: observe.Namespace, Name: "build_info",
		Help: "Always 1; the labels say which build is running: version, commit (with -dirty for a modified tree), Go version and build tags."},
		[]string{"version", "commit", "go_version", "tags"})
	g.WithLabelValues(b.Version, b.CommitString(), b.GoVersion, b.Tags).Set(1)
	reg.MustRegister(g)
}
