// Command slowest reads `go test -json` output and prints the slowest tests and packages, to
// find what makes the test suite slow:
//
//	go test -race -count=1 -json ./... | go run ./scripts/slowest
//	go run ./scripts/slowest -n 40 run1.json run2.json
//
// A test's time is what `go test` reports for it: from its start to its end, subtests included,
// without the time a parallel test waited for its turn. Subtests are listed only with -sub. A
// package's time is the whole `go test` run of its binary (its tests, TestMain, and the waits of
// its parallel tests), not the build.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// event is the part of a `go test -json` line (cmd/test2json) this command reads.
type event struct {
	Action  string
	Package string
	Test    string
	Elapsed float64
}

type result struct {
	pkg, test, outcome string
	seconds            float64
}

func main() {
	n := flag.Int("n", 20, "how many tests (and packages) to print")
	sub := flag.Bool("sub", false, "list subtests too, not only top-level tests")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(),
			"usage: go test -json ./... | go run ./scripts/slowest [-n N] [-sub]\n"+
				"       go run ./scripts/slowest [-n N] [-sub] FILE...\n")
		flag.PrintDefaults()
	}
	flag.Parse()

	var tests, pkgs []result
	read := func(r io.Reader, name string) {
		t, p, err := parse(r, *sub)
		if err != nil {
			fmt.Fprintf(os.Stderr, "slowest: %s: %v\n", name, err)
			os.Exit(1)
		}
		tests, pkgs = append(tests, t...), append(pkgs, p...)
	}
	if flag.NArg() == 0 {
		read(os.Stdin, "standard input")
	}
	for _, name := range flag.Args() {
		f, err := os.Open(name)
		if err != nil {
			fmt.Fprintf(os.Stderr, "slowest: %v\n", err)
			os.Exit(1)
		}
		read(f, name)
		f.Close()
	}
	if len(tests) == 0 && len(pkgs) == 0 {
		fmt.Fprintln(os.Stderr, "slowest: no test results in the input (was it `go test -json` output?)")
		os.Exit(1)
	}
	ts, ps := top(tests, *n), top(pkgs, *n)
	width := len("package")
	for _, r := range append(ts, ps...) {
		width = max(width, len(r.pkg))
	}
	fmt.Printf("%8s  %-*s  %s\n", "seconds", width, "package", "test")
	for _, r := range ts {
		fmt.Printf("%8.2f  %-*s  %s%s\n", r.seconds, width, r.pkg, r.test, mark(r.outcome))
	}
	fmt.Printf("\n%8s  %s\n", "seconds", "package (whole run of its test binary)")
	for _, r := range ps {
		fmt.Printf("%8.2f  %s%s\n", r.seconds, r.pkg, mark(r.outcome))
	}
}

// parse reads the events of r; lines that are not JSON (a build error printed by a script
// around go test, say) are skipped.
func parse(r io.Reader, sub bool) (tests, pkgs []result, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) == 0 || line[0] != '{' {
			continue
		}
		var e event
		if json.Unmarshal(line, &e) != nil {
			continue
		}
		if e.Action != "pass" && e.Action != "fail" && e.Action != "skip" {
			continue
		}
		switch {
		case e.Test == "":
			pkgs = append(pkgs, result{pkg: e.Package, outcome: e.Action, seconds: e.Elapsed})
		case sub || !strings.Contains(e.Test, "/"):
			tests = append(tests, result{pkg: e.Package, test: e.Test, outcome: e.Action, seconds: e.Elapsed})
		}
	}
	return tests, pkgs, sc.Err()
}

// top returns the n slowest of rs, slowest first.
func top(rs []result, n int) []result {
	sort.SliceStable(rs, func(i, j int) bool { return rs[i].seconds > rs[j].seconds })
	return rs[:min(n, len(rs))]
}

func mark(outcome string) string {
	if outcome == "pass" {
		return ""
	}
	return " (" + outcome + ")"
}
