package config

import (
	"fmt"
	"sort"
	"strings"
)

// Problem is one thing wrong with a policy file.
type Problem struct {
	// File is the file name (or "<env>" for an environment override, "<embedded>" for the
	// built-in policy).
	File string
	// Line is the 1-based line of the offending key, 0 when unknown.
	Line int
	// Path is the key path, e.g. "features.chat.max_concurrent" or "compartments[1].key".
	Path string
	// Msg says what is wrong and, where it helps, how to fix it.
	Msg string
}

// String formats the problem as file:line: path: message.
func (p Problem) String() string {
	var b strings.Builder
	b.WriteString(p.File)
	if p.Line > 0 {
		fmt.Fprintf(&b, ":%d", p.Line)
	}
	b.WriteString(": ")
	if p.Path != "" {
		b.WriteString(p.Path)
		b.WriteString(": ")
	}
	b.WriteString(p.Msg)
	return b.String()
}

// Errors is every problem found in a policy file. It is returned as an error by Load.
type Errors []Problem

// Error lists the problems, one per line.
func (e Errors) Error() string {
	lines := make([]string, len(e))
	for i, p := range e {
		lines[i] = p.String()
	}
	return strings.Join(lines, "\n")
}

// problems collects Problems while a file is checked, attaching file and line.
type problems struct {
	file  string
	lines lineIndex
	// env maps key paths set by environment overrides to the variable that set them, so a bad
	// value is blamed on the variable, not the file.
	env  map[string]string
	list Errors
}

func (ps *problems) add(path, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if name, ok := ps.env[path]; ok {
		ps.list = append(ps.list, Problem{File: envFile, Path: path, Msg: name + ": " + msg})
		return
	}
	ps.list = append(ps.list, Problem{File: ps.file, Line: ps.lines.line(path), Path: path, Msg: msg})
}

func (ps *problems) err() error {
	if len(ps.list) == 0 {
		return nil
	}
	sort.SliceStable(ps.list, func(i, j int) bool {
		a, b := ps.list[i], ps.list[j]
		if a.File != b.File {
			return a.File < b.File
		}
		if a.Line != b.Line {
			return a.Line < b.Line
		}
		return a.Path < b.Path
	})
	return ps.list
}
