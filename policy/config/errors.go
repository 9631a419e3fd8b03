package config

import (
	"fmt"
	"slices"
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
	// meta holds what sorting and filtering need to know about each problem in list.
	meta []problemMeta
}

// problemMeta is what is known about a problem beyond what it says.
type problemMeta struct {
	// col is the problem's column, so problems on one line (keys of a flow mapping) come out in
	// the order they are written.
	col int
	// own is true when the problem is about the value at its path alone (a negative limit, a
	// mode that is not one of the modes), so it stands even when a sibling key of the same entry
	// could not be decoded (see dropInside).
	own bool
}

func (ps *problems) add(path, format string, args ...any) {
	ps.record(path, false, format, args...)
}

// addOwn records a problem about the value at path alone: checking it read no other key.
func (ps *problems) addOwn(path, format string, args ...any) {
	ps.record(path, true, format, args...)
}

func (ps *problems) record(path string, own bool, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if name := ps.envVar(path); name != "" {
		ps.addEnv(path, name, "%s", msg)
	} else {
		ps.addAt(ps.lines.at(path), path, "%s", msg)
	}
	ps.meta[len(ps.meta)-1].own = own
}

// addAt records a problem in the file at an explicit position.
func (ps *problems) addAt(at pos, path, format string, args ...any) {
	ps.list = append(ps.list, Problem{File: ps.file, Line: at.line, Path: path, Msg: fmt.Sprintf(format, args...)})
	ps.meta = append(ps.meta, problemMeta{col: at.col})
}

// addEnv records a problem caused by the environment variable name.
func (ps *problems) addEnv(path, name, format string, args ...any) {
	ps.list = append(ps.list, Problem{File: envFile, Path: path, Msg: name + ": " + fmt.Sprintf(format, args...)})
	ps.meta = append(ps.meta, problemMeta{})
}

// envVar returns the override that owns path, or "". An override owns the key it sets, and a
// key it created or replaced: one the file does not have (a misspelt section in a variable's
// name), or one where the file has a scalar or a list that the override turned into a mapping.
// Where file and override both hold a mapping they were merged, and the file is blamed for what
// is wrong with the mapping itself.
func (ps *problems) envVar(path string) string {
	if name, ok := ps.env[path]; ok {
		return name
	}
	if path == "" || len(ps.env) == 0 {
		return ""
	}
	if at, ok := ps.lines[path]; ok && at.mapping {
		return ""
	}
	owner := ""
	for set, name := range ps.env {
		if inside(set, path) && (owner == "" || name < owner) {
			owner = name
		}
	}
	return owner
}

// inside reports whether path is entry or lies below it.
func inside(path, entry string) bool {
	if !strings.HasPrefix(path, entry) {
		return false
	}
	rest := path[len(entry):]
	return rest == "" || rest[0] == '.' || rest[0] == '['
}

// dropInside removes, from index from on, the validation problems that describe what the decoder
// left rather than what the file says (see decoder.fail): a problem about a value that could not
// be decoded (at or below a path in failed), and a problem that reads several keys of an entry
// one of whose keys could not be decoded (inside one of holes). A problem about one value alone
// (addOwn) is kept when only a sibling failed: `max_concurrent: -1` next to `max_wait: soon` is
// two problems.
func (ps *problems) dropInside(from int, holes, failed []string) {
	if len(holes) == 0 && len(failed) == 0 {
		return
	}
	keep := from
	for i := from; i < len(ps.list); i++ {
		in := func(h string) bool { return inside(ps.list[i].Path, h) }
		if slices.ContainsFunc(failed, in) || (!ps.meta[i].own && slices.ContainsFunc(holes, in)) {
			continue
		}
		ps.list[keep], ps.meta[keep] = ps.list[i], ps.meta[i]
		keep++
	}
	ps.list, ps.meta = ps.list[:keep], ps.meta[:keep]
}

// err returns the problems in reading order, or nil: first those of environment overrides (by
// key path), then those of the file by line, column and key path; a problem of the file that has
// no line (about the policy as a whole, or a key the file does not write) comes before the
// file's first line.
func (ps *problems) err() error {
	if len(ps.list) == 0 {
		return nil
	}
	type entry struct {
		Problem
		col int
	}
	all := make([]entry, len(ps.list))
	for i, p := range ps.list {
		all[i] = entry{Problem: p, col: ps.meta[i].col}
	}
	sort.SliceStable(all, func(i, j int) bool {
		a, b := all[i], all[j]
		if ae, be := a.File == envFile, b.File == envFile; ae != be {
			return ae
		}
		if a.File != b.File {
			return a.File < b.File
		}
		if a.Line != b.Line {
			return a.Line < b.Line
		}
		if a.col != b.col {
			return a.col < b.col
		}
		return a.Path < b.Path
	})
	// A value reached through several aliases can report the same problem more than once.
	ps.list = ps.list[:0]
	for i, e := range all {
		if i == 0 || e.Problem != all[i-1].Problem {
			ps.list = append(ps.list, e.Problem)
		}
	}
	ps.meta = nil
	return ps.list
}
