package config

import (
	"encoding"
	"errors"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"

	"github.com/go-viper/mapstructure/v2"
	koanfyaml "github.com/knadh/koanf/parsers/yaml"
	"github.com/knadh/koanf/providers/rawbytes"
	"github.com/knadh/koanf/v2"
	yaml "go.yaml.in/yaml/v3"
)

// EnvPrefix starts every environment override. Levels are separated by a double underscore and
// names are matched case-insensitively: LLM_BULKHEAD_SERVER__LOG_LEVEL=debug sets
// server.log_level, LLM_BULKHEAD_FEATURES__CHAT__MAX_CONCURRENT=30 sets
// features.chat.max_concurrent. Variables without a double underscore (such as the admin token
// LLM_BULKHEAD_ADMIN_TOKEN) are not overrides. Values are read as YAML scalars.
const EnvPrefix = "LLM_BULKHEAD_"

// envFile is the File of problems caused by environment overrides.
const envFile = "<env>"

// LoadFile reads, decodes, resolves and validates the policy file at path, applying environment
// overrides from env (os.Environ() form, "KEY=value"). The error, when not nil, is an Errors
// listing every problem with file, line and key path.
func LoadFile(path string, env []string) (*Policy, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, Errors{{File: path, Msg: fmt.Sprintf("cannot read policy file: %v", errors.Unwrap(err))}}
	}
	return Load(path, data, env)
}

// Load is LoadFile for a policy already in memory; name is used in messages.
func Load(name string, data []byte, env []string) (*Policy, error) {
	ps := &problems{file: name}

	var root yaml.Node
	if err := yaml.Unmarshal(data, &root); err != nil {
		return nil, Errors{yamlProblem(name, err)}
	}
	ps.lines = indexLines(&root)
	if root.Kind == 0 {
		// An empty file is a valid policy with every default; koanf wants a mapping.
		data = []byte("{}")
	} else if doc := root.Content[0]; doc.Kind != yaml.MappingNode {
		return nil, Errors{{File: name, Line: doc.Line, Msg: "a policy file must be a YAML mapping of sections (server, features, …)"}}
	}

	k := koanf.New(".")
	if err := k.Load(rawbytes.Provider(data), koanfyaml.Parser()); err != nil {
		return nil, Errors{yamlProblem(name, err)}
	}
	fileKeys := k.Raw()
	checkKeys(ps, reflect.TypeOf(Policy{}), fileKeys, "")

	envPS := &problems{file: envFile}
	over, names := envOverrides(envPS, env)
	ps.env, envPS.env = names, names
	if len(over) > 0 {
		checkKeys(envPS, reflect.TypeOf(Policy{}), over, "")
		if err := k.Load(confmapProvider(over), nil); err != nil {
			envPS.add("", "%v", err)
		}
	}
	if len(ps.list)+len(envPS.list) > 0 {
		return nil, append(ps.list, envPS.list...)
	}

	var p Policy
	dc := &mapstructure.DecoderConfig{
		DecodeHook:  textHook,
		ErrorUnused: true,
		TagName:     "koanf",
		Result:      &p,
		Squash:      true,
	}
	if err := k.UnmarshalWithConf("", &p, koanf.UnmarshalConf{Tag: "koanf", DecoderConfig: dc}); err != nil {
		decodeProblems(ps, err)
		return nil, ps.err()
	}

	p.applyDefaults()
	validate(ps, &p)
	if err := ps.err(); err != nil {
		return nil, err
	}
	return &p, nil
}

// yamlProblem turns a YAML syntax error into a Problem, keeping its line.
func yamlProblem(name string, err error) Problem {
	msg := err.Error()
	if _, rest, ok := strings.Cut(msg, "unmarshal errors:\n"); ok {
		// Several problems may follow, one per line; the first is enough to act on.
		msg, _, _ = strings.Cut(strings.TrimSpace(rest), "\n")
	}
	line := 0
	if _, rest, ok := strings.Cut(msg, "line "); ok {
		if end := strings.IndexByte(rest, ':'); end > 0 {
			line, _ = strconv.Atoi(rest[:end])
		}
	}
	msg = strings.TrimPrefix(msg, "yaml: ")
	if i := strings.Index(msg, ": "); i > 0 && strings.HasPrefix(msg, "line ") {
		msg = msg[i+2:]
	}
	return Problem{File: name, Line: line, Msg: "invalid YAML: " + msg}
}

// textHook decodes scalar strings into types implementing encoding.TextUnmarshaler (Duration,
// Size) and refuses non-string scalars for them, so `max_wait: 5` is an error, not 5ns.
func textHook(from, to reflect.Type, data any) (any, error) {
	target := to
	if target.Kind() == reflect.Pointer {
		target = target.Elem()
	}
	ptr := reflect.New(target)
	u, ok := ptr.Interface().(encoding.TextUnmarshaler)
	if !ok {
		return data, nil
	}
	var text string
	switch v := data.(type) {
	case string:
		text = v
	case int, int64, uint64, float64:
		if target == reflect.TypeOf(Size(0)) {
			text = fmt.Sprint(v)
			break
		}
		return nil, fmt.Errorf("%v is not a duration (write it with a unit, like 100ms or 5s)", v)
	default:
		return data, nil
	}
	if err := u.UnmarshalText([]byte(text)); err != nil {
		return nil, err
	}
	if to.Kind() == reflect.Pointer {
		return ptr.Interface(), nil
	}
	return ptr.Elem().Interface(), nil
}

// decodeProblems converts mapstructure's joined errors into Problems with key paths.
func decodeProblems(ps *problems, err error) {
	var walk func(error)
	walk = func(err error) {
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				walk(e)
			}
			return
		}
		var de *mapstructure.DecodeError
		if errors.As(err, &de) {
			path := mapstructurePath(de.Name())
			inner := de.Unwrap()
			var ute *mapstructure.UnconvertibleTypeError
			switch {
			case errors.As(inner, &ute):
				ps.add(path, "expected %s, got %s", kindName(ute.Expected.Type()), describeValue(ute.Value))
			default:
				ps.add(path, "%v", strings.TrimPrefix(inner.Error(), "error decoding '': "))
			}
			return
		}
		ps.add("", "%v", err)
	}
	walk(err)
}

// mapstructurePath turns "features[chat].max_concurrent" into "features.chat.max_concurrent" and
// keeps list indexes as [i].
func mapstructurePath(name string) string {
	var b strings.Builder
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c != '[' {
			b.WriteByte(c)
			continue
		}
		end := strings.IndexByte(name[i:], ']')
		if end < 0 {
			b.WriteString(name[i:])
			break
		}
		inner := name[i+1 : i+end]
		if _, err := strconv.Atoi(inner); err == nil {
			b.WriteString("[" + inner + "]")
		} else {
			b.WriteString("." + inner)
		}
		i += end
	}
	return b.String()
}

func kindName(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t {
	case reflect.TypeOf(Duration(0)):
		return "a duration"
	case reflect.TypeOf(Size(0)):
		return "a size"
	}
	switch t.Kind() {
	case reflect.Int, reflect.Int64, reflect.Int32:
		return "an integer"
	case reflect.Float64, reflect.Float32:
		return "a number"
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Slice:
		return "a list"
	case reflect.Map, reflect.Struct:
		return "a mapping"
	}
	return t.String()
}

func describeValue(v any) string {
	switch x := v.(type) {
	case string:
		return fmt.Sprintf("the string %q", x)
	case []any:
		return "a list"
	case map[string]any:
		return "a mapping"
	case nil:
		return "nothing"
	case bool:
		return fmt.Sprintf("%v", x)
	default:
		return fmt.Sprintf("%v", x)
	}
}

// checkKeys reports every key in m that the schema type t does not have, with its full path.
func checkKeys(ps *problems, t reflect.Type, v any, path string) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct:
		m, ok := v.(map[string]any)
		if !ok {
			return // a type error, reported by the decoder
		}
		fields := structFields(t)
		keys := make([]string, 0, len(m))
		for key := range m {
			keys = append(keys, key)
		}
		sort.Strings(keys)
		for _, key := range keys {
			ft, ok := fields[key]
			sub := joinPath(path, key)
			if !ok {
				ps.add(sub, "unknown key %q%s", key, suggest(key, fields))
				continue
			}
			checkKeys(ps, ft, m[key], sub)
		}
	case reflect.Map:
		m, ok := v.(map[string]any)
		if !ok {
			return
		}
		for key, val := range m {
			checkKeys(ps, t.Elem(), val, joinPath(path, key))
		}
	case reflect.Slice:
		l, ok := v.([]any)
		if !ok {
			return
		}
		for i, val := range l {
			checkKeys(ps, t.Elem(), val, fmt.Sprintf("%s[%d]", path, i))
		}
	}
}

func joinPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// structFields maps koanf tag names to field types, flattening squashed embedded structs.
func structFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := f.Tag.Get("koanf")
		if strings.Contains(tag, ",squash") {
			for k, v := range structFields(f.Type) {
				out[k] = v
			}
			continue
		}
		if tag == "" || tag == "-" {
			continue
		}
		out[tag] = f.Type
	}
	return out
}

// suggest offers the closest known key for a misspelt one.
func suggest(key string, fields map[string]reflect.Type) string {
	best, bestD := "", 3
	for k := range fields {
		if d := editDistance(key, k); d < bestD || (d == bestD && k < best) {
			best, bestD = k, d
		}
	}
	if best == "" {
		return ""
	}
	return fmt.Sprintf(" (did you mean %q?)", best)
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// envOverrides turns LLM_BULKHEAD_A__B__C=value variables into a nested map {a:{b:{c:value}}}.
// It also returns which variable set each key path.
func envOverrides(ps *problems, env []string) (map[string]any, map[string]string) {
	out := map[string]any{}
	names := map[string]string{}
	sort.Strings(env)
	for _, kv := range env {
		name, value, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(name, EnvPrefix) || !strings.Contains(name, "__") {
			continue
		}
		parts := strings.Split(strings.ToLower(strings.TrimPrefix(name, EnvPrefix)), "__")
		var scalar any
		if err := yaml.Unmarshal([]byte(value), &scalar); err != nil {
			scalar = value
		}
		switch scalar.(type) {
		case map[string]any, []any:
			ps.add(strings.Join(parts, "."), "%s must be a single value, not a YAML %s", name, describeValue(scalar))
			continue
		case nil:
			scalar = value
		}
		m := out
		for i, p := range parts {
			if p == "" {
				ps.add(strings.Join(parts, "."), "%s has an empty level between double underscores", name)
				break
			}
			if i == len(parts)-1 {
				m[p] = scalar
				names[strings.Join(parts, ".")] = name
				break
			}
			next, ok := m[p].(map[string]any)
			if !ok {
				next = map[string]any{}
				m[p] = next
			}
			m = next
		}
	}
	return out, names
}

// confmapProvider feeds a ready nested map to koanf.
type confmapProvider map[string]any

func (c confmapProvider) ReadBytes() ([]byte, error) {
	return nil, errors.New("confmap provider does not support ReadBytes")
}
func (c confmapProvider) Read() (map[string]any, error) { return c, nil }

// lineIndex maps key paths to the line they appear on.
type lineIndex map[string]int

func indexLines(root *yaml.Node) lineIndex {
	idx := lineIndex{}
	var walk func(n *yaml.Node, path string)
	walk = func(n *yaml.Node, path string) {
		switch n.Kind {
		case yaml.DocumentNode:
			for _, c := range n.Content {
				walk(c, path)
			}
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				key := n.Content[i]
				sub := joinPath(path, key.Value)
				idx[sub] = key.Line
				walk(n.Content[i+1], sub)
			}
		case yaml.SequenceNode:
			for i, c := range n.Content {
				sub := fmt.Sprintf("%s[%d]", path, i)
				idx[sub] = c.Line
				walk(c, sub)
			}
		case yaml.AliasNode:
			if n.Alias != nil {
				walk(n.Alias, path)
			}
		}
	}
	walk(root, "")
	return idx
}

// line returns the line of path, or of its nearest ancestor present in the file.
func (l lineIndex) line(path string) int {
	for path != "" {
		if n, ok := l[path]; ok {
			return n
		}
		cut := max(strings.LastIndexByte(path, '.'), strings.LastIndexByte(path, '['))
		if cut <= 0 {
			break
		}
		path = path[:cut]
	}
	return 0
}
