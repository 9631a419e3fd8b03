package examples_test

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	yaml "go.yaml.in/yaml/v3"
)

// dfInstruction is one Dockerfile instruction, continuation lines joined.
type dfInstruction struct {
	Line  int    // where it starts, 1-based
	Cmd   string // upper case: FROM, RUN, COPY…
	Flags map[string]string
	// Args is what follows the instruction and its flags; Exec is the exec form (a JSON array
	// of strings) when Args is one, else nil.
	Args string
	Exec []string
}

// dfStage is a FROM and the instructions up to the next FROM.
type dfStage struct {
	Image, Name string
	Body        []dfInstruction
}

// dfInstructions are the instructions Docker knows (MAINTAINER included, deprecated but valid).
var dfInstructions = []string{"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK",
	"LABEL", "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}

// flagsFor are the instructions whose leading --name=value words are flags, not arguments.
var flagsFor = []string{"ADD", "COPY", "FROM", "HEALTHCHECK", "RUN"}

// parseDockerfile reads the instructions of a Dockerfile with the default escape character:
// comment lines (parser directives included) are skipped, a line ending in a backslash
// continues on the next (comment lines inside are skipped, as Docker does), and exec forms are
// decoded as JSON. Heredocs (<<EOF) are not supported and are reported.
func parseDockerfile(src string) ([]dfStage, error) {
	var (
		stages  []dfStage
		pending strings.Builder
		start   int
	)
	flush := func() error {
		text := strings.TrimSpace(pending.String())
		pending.Reset()
		if text == "" {
			return nil
		}
		in, err := parseInstruction(start, text)
		if err != nil {
			return err
		}
		if in.Cmd == "FROM" {
			st, err := parseFrom(in)
			if err != nil {
				return err
			}
			stages = append(stages, st)
			return nil
		}
		if len(stages) == 0 {
			// Only ARGs (for FROM lines) may come before the first FROM.
			if in.Cmd != "ARG" {
				return fmt.Errorf("line %d: %s before the first FROM", in.Line, in.Cmd)
			}
			return nil
		}
		stages[len(stages)-1].Body = append(stages[len(stages)-1].Body, in)
		return nil
	}
	for i, line := range strings.Split(strings.ReplaceAll(src, "\r\n", "\n"), "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") {
			continue
		}
		if pending.Len() == 0 {
			if trimmed == "" {
				continue
			}
			start = i + 1
		}
		if body, ok := strings.CutSuffix(strings.TrimRight(line, " \t"), `\`); ok {
			pending.WriteString(body)
			pending.WriteString(" ")
			continue
		}
		pending.WriteString(line)
		if err := flush(); err != nil {
			return nil, err
		}
	}
	if err := flush(); err != nil {
		return nil, err
	}
	if len(stages) == 0 {
		return nil, fmt.Errorf("no FROM instruction")
	}
	return stages, nil
}

func parseInstruction(line int, text string) (dfInstruction, error) {
	cmd, rest, _ := strings.Cut(text, " ")
	in := dfInstruction{Line: line, Cmd: strings.ToUpper(cmd), Flags: map[string]string{}}
	if !slices.Contains(dfInstructions, in.Cmd) {
		return in, fmt.Errorf("line %d: unknown instruction %q", line, cmd)
	}
	rest = strings.TrimSpace(rest)
	if slices.Contains(flagsFor, in.Cmd) {
		for strings.HasPrefix(rest, "--") {
			word, after, _ := strings.Cut(rest, " ")
			name, value, _ := strings.Cut(strings.TrimPrefix(word, "--"), "=")
			if name == "" {
				return in, fmt.Errorf("line %d: empty flag in %s", line, in.Cmd)
			}
			in.Flags[name] = value
			rest = strings.TrimSpace(after)
		}
	}
	if strings.Contains(rest, "<<") && (in.Cmd == "RUN" || in.Cmd == "COPY" || in.Cmd == "ADD") {
		return in, fmt.Errorf("line %d: heredocs are not supported by this parser", line)
	}
	in.Args = rest
	if strings.HasPrefix(rest, "[") {
		var exec []string
		// Docker falls back to the shell form when the array is not valid JSON of strings.
		if json.Unmarshal([]byte(rest), &exec) == nil {
			in.Exec = exec
			if in.Exec == nil {
				in.Exec = []string{}
			}
		}
	}
	if in.Args == "" && in.Cmd != "HEALTHCHECK" {
		return in, fmt.Errorf("line %d: %s without arguments", line, in.Cmd)
	}
	return in, nil
}

func parseFrom(in dfInstruction) (dfStage, error) {
	f := strings.Fields(in.Args)
	switch {
	case len(f) == 1:
		return dfStage{Image: f[0]}, nil
	case len(f) == 3 && strings.EqualFold(f[1], "AS"):
		return dfStage{Image: f[0], Name: strings.ToLower(f[2])}, nil
	}
	return dfStage{}, fmt.Errorf("line %d: FROM %q: want IMAGE [AS NAME]", in.Line, in.Args)
}

// words splits LABEL and ENV arguments into key=value words, honouring double and single
// quotes and backslash escapes.
func words(s string) ([]string, error) {
	var out []string
	var cur strings.Builder
	var quote rune
	inWord := false
	runes := []rune(s)
	for i := 0; i < len(runes); i++ {
		r := runes[i]
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != '\'' && r == '\\' && i+1 < len(runes):
			i++
			cur.WriteRune(runes[i])
			inWord = true
		case quote != 0:
			cur.WriteRune(r)
		case r == '"' || r == '\'':
			quote, inWord = r, true
		case r == ' ' || r == '\t':
			if inWord {
				out = append(out, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated %c quote in %q", quote, s)
	}
	if inWord {
		out = append(out, cur.String())
	}
	return out, nil
}

func (s dfStage) all(cmd string) []dfInstruction {
	var out []dfInstruction
	for _, in := range s.Body {
		if in.Cmd == cmd {
			out = append(out, in)
		}
	}
	return out
}

// last returns the stage's last cmd instruction: the one that takes effect.
func (s dfStage) last(cmd string) (dfInstruction, bool) {
	all := s.all(cmd)
	if len(all) == 0 {
		return dfInstruction{}, false
	}
	return all[len(all)-1], true
}

func readDockerfile(t *testing.T) []dfStage {
	t.Helper()
	src, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	stages, err := parseDockerfile(string(src))
	if err != nil {
		t.Fatal(err)
	}
	return stages
}

// TestDockerfileIsAProductionImage: no Docker daemon runs the tests, so the image's recipe is
// checked for what running it depends on: a build with the same tags as `make build` and a
// stamped version, a static binary, and a final stage on distroless (or scratch) as a numeric
// non-root user, with an exec-form entrypoint, both ports and the OCI labels.
func TestDockerfileIsAProductionImage(t *testing.T) {
	stages := readDockerfile(t)
	if len(stages) < 2 {
		t.Fatalf("%d stage(s): the build must not be the image", len(stages))
	}
	build, final := stages[0], stages[len(stages)-1]

	// The Go toolchain is pinned, and matches go.mod's go line.
	gomod, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	goLine := regexp.MustCompile(`(?m)^go (\d+)\.(\d+)`).FindStringSubmatch(string(gomod))
	img := regexp.MustCompile(`^golang:(\d+)\.(\d+)\.(\d+)(-[a-z0-9]+)?$`).FindStringSubmatch(build.Image)
	if img == nil || goLine == nil || img[1] != goLine[1] || img[2] != goLine[2] {
		t.Errorf("build stage FROM %s: want golang:%s.%s.<patch>, pinned to go.mod's go line", build.Image, goLine[1], goLine[2])
	}
	var builds []string
	for _, r := range build.all("RUN") {
		if strings.Contains(r.Args, "go build") && strings.Contains(r.Args, "./cmd/llm-bulkhead") {
			builds = append(builds, r.Args)
		}
	}
	if len(builds) != 1 {
		t.Fatalf("%d RUN instructions build ./cmd/llm-bulkhead in the build stage, want 1", len(builds))
	}
	cmd := builds[0]
	for _, want := range []string{"CGO_ENABLED=0", "-tags=vtprotobuf", "-X main.version=${VERSION}", "-o /out/llm-bulkhead"} {
		if !strings.Contains(cmd, want) {
			t.Errorf("the build %q lacks %q", cmd, want)
		}
	}
	if !slices.ContainsFunc(build.all("ARG"), func(in dfInstruction) bool { return strings.HasPrefix(in.Args, "VERSION") }) {
		t.Error("the build stage declares no ARG VERSION for the version stamp")
	}

	if final.Image != "gcr.io/distroless/static-debian12:nonroot" && final.Image != "scratch" {
		t.Errorf("final stage FROM %s: want distroless static nonroot or scratch", final.Image)
	}
	user, ok := final.last("USER")
	if !ok {
		t.Fatal("the final stage sets no USER: the image would run as root")
	}
	uid, gid, _ := strings.Cut(user.Args, ":")
	if n, err := strconv.Atoi(uid); err != nil || n == 0 {
		t.Errorf("USER %q: want a numeric non-root uid (Kubernetes runAsNonRoot checks it without a passwd file)", user.Args)
	}
	if gid != "" {
		if n, err := strconv.Atoi(gid); err != nil || n == 0 {
			t.Errorf("USER %q: want a numeric non-root gid", user.Args)
		}
	}
	copied := false
	for _, c := range final.all("COPY") {
		if c.Flags["from"] == build.Name && strings.HasSuffix(c.Args, " /llm-bulkhead") {
			copied = true
		}
	}
	if !copied {
		t.Error("the final stage does not copy the binary from the build stage to /llm-bulkhead")
	}
	ep, ok := final.last("ENTRYPOINT")
	if !ok || !slices.Equal(ep.Exec, []string{"/llm-bulkhead"}) {
		t.Errorf("ENTRYPOINT %q: want the exec form [\"/llm-bulkhead\"] (distroless has no shell; signals reach the server)", ep.Args)
	}
	cmdIn, ok := final.last("CMD")
	if !ok || len(cmdIn.Exec) == 0 || cmdIn.Exec[0] != "serve" {
		t.Fatalf("CMD %q: want the exec form, starting with serve", cmdIn.Args)
	}
	args := strings.Join(cmdIn.Exec, " ")
	for _, want := range []string{"--grpc-addr 0.0.0.0:9002", "--admin-addr 0.0.0.0:9090"} {
		if !strings.Contains(args, want) {
			t.Errorf("CMD %v lacks %q: a container must listen beyond its loopback", cmdIn.Exec, want)
		}
	}
	// Every flag of the command is one serve has (README lists serve's synopsis).
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	synopsis := regexp.MustCompile(`(?m)^llm-bulkhead \[serve\].*$`).FindString(string(readme))
	for _, a := range cmdIn.Exec {
		if strings.HasPrefix(a, "--") && !strings.Contains(synopsis, "["+a+" ") && !strings.Contains(synopsis, "["+a+"]") {
			t.Errorf("CMD passes %s, which serve's synopsis does not have: %s", a, synopsis)
		}
	}
	var ports []string
	for _, e := range final.all("EXPOSE") {
		ports = append(ports, strings.Fields(e.Args)...)
	}
	for _, p := range []string{"9002", "9090"} {
		if !slices.Contains(ports, p) && !slices.Contains(ports, p+"/tcp") {
			t.Errorf("EXPOSE %v lacks %s", ports, p)
		}
	}
	if hc, ok := final.last("HEALTHCHECK"); ok && !strings.EqualFold(hc.Args, "NONE") {
		probe := strings.TrimSpace(strings.TrimPrefix(hc.Args, "CMD"))
		var exec []string
		if json.Unmarshal([]byte(probe), &exec) != nil || len(exec) < 2 || exec[0] != "/llm-bulkhead" || exec[1] != "health" {
			t.Errorf("HEALTHCHECK %q: want CMD in exec form running /llm-bulkhead health (distroless has no shell)", hc.Args)
		}
	}
	labels := map[string]string{}
	for _, l := range final.all("LABEL") {
		ws, err := words(l.Args)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range ws {
			k, v, ok := strings.Cut(w, "=")
			if !ok {
				t.Errorf("LABEL word %q is not key=value", w)
			}
			labels[k] = v
		}
	}
	for _, k := range []string{"title", "description", "source", "version", "revision"} {
		if labels["org.opencontainers.image."+k] == "" {
			t.Errorf("no org.opencontainers.image.%s label", k)
		}
	}
	if labels["org.opencontainers.image.version"] != "${VERSION}" {
		t.Errorf("the version label %q is not the stamped VERSION", labels["org.opencontainers.image.version"])
	}
}

// TestComposeUsesTheImage: docker-compose builds the image's default target for llm-bulkhead
// (whose entrypoint is the binary, so the command is serve's arguments) and the mockllm
// target, which must exist.
func TestComposeUsesTheImage(t *testing.T) {
	stages := readDockerfile(t)
	src, err := os.ReadFile("docker-compose.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var compose struct {
		Services map[string]struct {
			Build struct {
				Context, Dockerfile, Target string
			} `yaml:"build"`
			Command []string `yaml:"command"`
		} `yaml:"services"`
	}
	if err := yaml.Unmarshal(src, &compose); err != nil {
		t.Fatal(err)
	}
	lb, ok := compose.Services["llm-bulkhead"]
	if !ok || lb.Build.Dockerfile != "examples/Dockerfile" || lb.Build.Target != "" {
		t.Fatalf("llm-bulkhead service builds %+v: want examples/Dockerfile's final stage", lb.Build)
	}
	if len(lb.Command) == 0 || lb.Command[0] != "serve" {
		t.Errorf("llm-bulkhead command %v: the entrypoint is the binary, so it starts with serve", lb.Command)
	}
	mock, ok := compose.Services["mockllm"]
	if !ok || !slices.ContainsFunc(stages, func(s dfStage) bool { return s.Name == mock.Build.Target && s.Name != "" }) {
		t.Errorf("mockllm builds target %q, which is no stage of the Dockerfile", mock.Build.Target)
	}
	if len(mock.Command) > 0 && mock.Command[0] == "mockllm" {
		t.Errorf("mockllm command %v repeats the entrypoint", mock.Command)
	}
}

// TestParseDockerfile: continuations, comments inside them, flags, exec and shell forms, and
// what the parser refuses.
func TestParseDockerfile(t *testing.T) {
	stages, err := parseDockerfile("# syntax=docker/dockerfile:1\nARG BASE=x\nfrom golang:1.26 as Build\n" +
		"RUN a \\\n  # a comment inside\n  b\nCOPY --from=build --chmod=0755 /x /y\n\n" +
		"FROM scratch\nCMD [\"serve\", \"--x\"]\nENTRYPOINT /bin/sh -c 'x'\nENTRYPOINT [not json\nLABEL a=\"b c\" d='e f' g=h\\ i\n")
	if err != nil {
		t.Fatal(err)
	}
	if len(stages) != 2 || stages[0].Name != "build" || stages[0].Image != "golang:1.26" || stages[1].Image != "scratch" {
		t.Fatalf("stages %+v", stages)
	}
	run := stages[0].Body[0]
	if run.Cmd != "RUN" || run.Line != 4 || strings.Join(strings.Fields(run.Args), " ") != "a b" {
		t.Errorf("RUN %+v", run)
	}
	cp := stages[0].Body[1]
	if cp.Flags["from"] != "build" || cp.Flags["chmod"] != "0755" || cp.Args != "/x /y" {
		t.Errorf("COPY %+v", cp)
	}
	if c, _ := stages[1].last("CMD"); !slices.Equal(c.Exec, []string{"serve", "--x"}) {
		t.Errorf("CMD exec %v", c.Exec)
	}
	eps := stages[1].all("ENTRYPOINT")
	if eps[0].Exec != nil || eps[1].Exec != nil {
		t.Errorf("shell forms read as exec forms: %+v", eps)
	}
	l, _ := stages[1].last("LABEL")
	if ws, err := words(l.Args); err != nil || !slices.Equal(ws, []string{"a=b c", "d=e f", "g=h i"}) {
		t.Errorf("LABEL words %q %v", ws, err)
	}
	for name, src := range map[string]string{
		"no FROM":             "RUN x\n",
		"unknown instruction": "FROM a\nFOO bar\n",
		"FROM with junk":      "FROM a b c d\n",
		"heredoc":             "FROM a\nRUN <<EOF\nx\nEOF\n",
		"empty":               "# nothing\n",
		"no arguments":        "FROM a\nUSER\n",
	} {
		if _, err := parseDockerfile(src); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := words(`a="b`); err == nil {
		t.Error("an unterminated quote was accepted")
	}
}

// FuzzParseDockerfile: any input is stages or an error, never a panic; every stage has an
// image, every instruction a known name and a line within the input.
func FuzzParseDockerfile(f *testing.F) {
	if src, err := os.ReadFile("Dockerfile"); err == nil {
		f.Add(string(src))
	}
	f.Add("FROM a AS b\nRUN x \\\n y\nCMD [\"a\"]\nLABEL k=\"v w\"\n")
	f.Add("ARG X\nFROM ${X}\nCOPY --from=0 a b\n")
	f.Fuzz(func(t *testing.T, src string) {
		stages, err := parseDockerfile(src)
		if err != nil {
			return
		}
		lines := strings.Count(src, "\n") + 1
		for _, s := range stages {
			if s.Image == "" {
				t.Fatalf("a stage without an image from %q", src)
			}
			for _, in := range s.Body {
				if !slices.Contains(dfInstructions, in.Cmd) || in.Line < 1 || in.Line > lines {
					t.Fatalf("instruction %+v from %q", in, src)
				}
				if in.Cmd == "LABEL" || in.Cmd == "ENV" {
					_, _ = words(in.Args)
				}
			}
		}
	})
}
