package config

// Loading is one pipeline — strict decoding with positions, environment overrides, template
// inheritance and defaults — whose steps hand each other the same intermediate tree.

import (
	"encoding"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/knadh/koanf/v2"
	yaml "go.yaml.in/yaml/v3"

	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
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
	data, err := files.Read(path, files.MaxPolicy)
	if err != nil {
		return nil, Errors{{File: path, Msg: fmt.Sprintf("cannot read policy file: %v", errors.Unwrap(err))}}
	}
	return Load(path, data, env)
}

// Load is LoadFile for a policy already in memory; name is used in messages.
//
// There is one path from bytes to a Policy, and it goes all the way whatever it finds:
//
//  1. yaml.v3 parses the file once into a node tree. One walk over the tree (yamlSource) gives
//     both the plain map koanf layers and the position of every key, so a problem found later
//     can name its line without a second parse.
//  2. koanf layers the environment overrides over the file.
//  3. One strict decoder fills the Policy from koanf's merged map. It records every unknown key
//     and every value of the wrong type and carries on; where a value could not be taken it
//     leaves the field zero and marks a hole (see decoder.fail).
//  4. Defaults are filled and the decoded part validated. Validation problems about a value that
//     could not be taken, or about an entry as a whole (several of its keys read together) when
//     one of its keys could not be taken, are dropped, because they would describe the zero the
//     decoder left rather than what the file says. Every other problem (a negative limit beside a
//     misspelt duration included) is reported with the decoding ones, ordered by line.
func Load(name string, data []byte, env []string) (*Policy, error) {
	ps := &problems{file: name}

	var root yaml.Node
	if err := yaml.Unmarshal(data, &root); err != nil {
		return nil, Errors{yamlProblem(name, err)}
	}
	if root.Kind != 0 {
		if doc := root.Content[0]; doc.Kind != yaml.MappingNode {
			return nil, Errors{{File: name, Line: doc.Line, Msg: "a policy file must be a YAML mapping of sections (server, features, …)"}}
		}
	}
	src := &yamlSource{root: &root, ps: ps, lines: lineIndex{}, texts: map[string]string{}}
	ps.lines = src.lines
	k := koanf.New(".")
	if err := k.Load(src, nil); err != nil {
		return nil, Errors{{File: name, Msg: "invalid YAML: " + err.Error()}}
	}
	over, names := envOverrides(ps, env)
	ps.env = names
	for path, name := range names {
		// An override's number is read from the variable's own text, like the file's.
		if v, ok := envValue(env, name); ok {
			src.texts[path] = strings.TrimSpace(v)
		}
	}
	if len(over) > 0 {
		if err := k.Load(confmapProvider(over), nil); err != nil {
			ps.add("", "%v", err)
		}
	}

	var p Policy
	d := &decoder{ps: ps, texts: src.texts}
	d.decode(reflect.ValueOf(&p).Elem(), k.Raw(), "", "")
	decoded := len(ps.list)

	p.Tracing.fromEnv(ps, env)
	p.applyDefaults()
	validate(ps, &p)
	readKeys(ps, &p)
	ps.dropInside(decoded, d.holes, d.failed)
	if err := ps.err(); err != nil {
		return nil, err
	}
	return &p, nil
}

// yamlProblem turns a YAML syntax error into a Problem, keeping its line.
func yamlProblem(name string, err error) Problem {
	line, msg := yamlMessage(err)
	return Problem{File: name, Line: line, Msg: "invalid YAML: " + msg}
}

// yamlMessage takes the line and the first message out of a yaml.v3 error.
func yamlMessage(err error) (int, string) {
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
	return line, msg
}

// pos is where a key (or a list item) starts in the file.
type pos struct {
	line, col int
	// mapping is true when the key's value is a mapping: an override below it is merged into
	// the file's mapping rather than replacing it (see problems.envVar).
	mapping bool
}

// lineIndex maps key paths to where they appear in the file.
type lineIndex map[string]pos

// at returns the position of path, or of its nearest ancestor present in the file.
func (l lineIndex) at(path string) pos {
	for path != "" {
		if p, ok := l[path]; ok {
			return p
		}
		cut := max(strings.LastIndexByte(path, '.'), strings.LastIndexByte(path, '['))
		if cut <= 0 {
			break
		}
		path = path[:cut]
	}
	return pos{}
}

// badValue stands in the map for a value the YAML walk already reported (a duplicate key, a
// scalar its tag cannot hold): the decoder takes it as a hole without a second message.
type badValue struct{}

// yamlSource is the policy file as a koanf Provider. Read walks the node tree yaml.v3 parsed
// and returns the plain map koanf layers, recording the position of every key in lines as it
// goes. It does what yaml.v3's own decoding into a map would (scalar tags, aliases, merge keys)
// and what that decoding checks (duplicate keys, excessive aliasing), so the file is parsed only
// once.
type yamlSource struct {
	root  *yaml.Node
	ps    *problems
	lines lineIndex
	// nodes counts values made so far and aliased those made through an alias: a small file
	// must not expand into a huge map (the "billion laughs"). Same rule as yaml.v3's decoder.
	nodes, aliased int
	// merging is above 0 while keys merged in with << are converted: an explicit key of the
	// same path was converted first and keeps its position.
	merging int
	// texts keeps the text of every number by key path: an amount of money is read from the
	// digits written, never from the float they would decode to.
	texts map[string]string
	err   error
}

// Read returns the file as a nested map, or an error when the file aliases excessively.
// Problems with single values are recorded and leave a badValue.
func (s *yamlSource) Read() (map[string]any, error) {
	out := map[string]any{}
	if s.root.Kind == 0 {
		return out, nil // an empty file is a valid policy with every default
	}
	s.mapping(s.root.Content[0], "", out, false)
	return out, s.err
}

// ReadBytes is not supported: the file has been parsed already.
func (s *yamlSource) ReadBytes() ([]byte, error) {
	return nil, errors.New("yamlSource does not support ReadBytes")
}

// Aliasing limits, as in yaml.v3: up to 400 000 values nearly all may come through aliases;
// from there the allowed share falls to 10% at 4 000 000.
const (
	aliasRatioLow  = 400_000
	aliasRatioHigh = 4_000_000
)

func (s *yamlSource) count(viaAlias bool) bool {
	if s.err != nil {
		return false
	}
	s.nodes++
	if viaAlias {
		s.aliased++
	}
	if s.aliased > 100 && s.nodes > 1000 {
		allowed := 0.99
		switch {
		case s.nodes >= aliasRatioHigh:
			allowed = 0.10
		case s.nodes > aliasRatioLow:
			allowed = 0.99 - 0.89*float64(s.nodes-aliasRatioLow)/float64(aliasRatioHigh-aliasRatioLow)
		}
		if float64(s.aliased)/float64(s.nodes) > allowed {
			s.err = errors.New("document contains excessive aliasing")
			return false
		}
	}
	return true
}

// setPos records where the value at path is written: at its key (or at the list item itself,
// when value is not given).
func (s *yamlSource) setPos(path string, at *yaml.Node, value ...*yaml.Node) {
	if _, ok := s.lines[path]; ok && s.merging > 0 {
		return
	}
	v := at
	if len(value) > 0 {
		v = value[0]
	}
	s.lines[path] = pos{line: at.Line, col: at.Column, mapping: resolve(v).Kind == yaml.MappingNode}
}

func (s *yamlSource) problem(n *yaml.Node, format string, args ...any) {
	s.ps.addAt(pos{line: n.Line, col: n.Column}, "", "invalid YAML: "+format, args...)
}

// value converts one node; path is its key path.
func (s *yamlSource) value(n *yaml.Node, path string, viaAlias bool) any {
	if !s.count(viaAlias) {
		return badValue{}
	}
	switch n.Kind {
	case yaml.AliasNode:
		return s.value(n.Alias, path, true)
	case yaml.MappingNode:
		out := make(map[string]any, len(n.Content)/2)
		s.mapping(n, path, out, viaAlias)
		return out
	case yaml.SequenceNode:
		out := make([]any, len(n.Content))
		for i, item := range n.Content {
			sub := path + "[" + strconv.Itoa(i) + "]"
			s.setPos(sub, item)
			out[i] = s.value(item, sub, viaAlias)
		}
		return out
	case yaml.ScalarNode:
		if tag := n.ShortTag(); tag == "!!int" || tag == "!!float" {
			if s.texts == nil {
				s.texts = map[string]string{}
			}
			if _, ok := s.texts[path]; !ok || s.merging == 0 {
				s.texts[path] = n.Value
			}
		}
		return s.scalar(n)
	}
	return badValue{}
}

// scalar resolves a scalar as yaml.v3 decodes one into an interface, except that an untagged
// date stays the text it is (no policy key is a time; a string key should get what was written).
func (s *yamlSource) scalar(n *yaml.Node) any {
	switch n.ShortTag() {
	case "!!str":
		return n.Value
	case "!!null":
		return nil
	case "!!timestamp":
		if n.Style&yaml.TaggedStyle == 0 {
			return n.Value
		}
	}
	var v any
	if err := n.Decode(&v); err != nil {
		_, msg := yamlMessage(err)
		s.problem(n, "%s", msg)
		return badValue{}
	}
	return v
}

// resolve follows an alias to the node it names.
func resolve(n *yaml.Node) *yaml.Node {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	return n
}

func isMerge(key *yaml.Node) bool {
	return key.Kind == yaml.ScalarNode && key.Value == "<<" && key.ShortTag() == "!!merge"
}

// mapping converts a mapping node into out. Keys written in the mapping win over merged ones
// (<<: *anchor), and earlier merges over later ones, as in yaml.v3.
func (s *yamlSource) mapping(n *yaml.Node, path string, out map[string]any, viaAlias bool) {
	var merge *yaml.Node
	seen := make(map[string]int, len(n.Content)/2)
	for i := 0; i+1 < len(n.Content); i += 2 {
		keyNode, valNode := n.Content[i], n.Content[i+1]
		name := keyNode.Value
		if key := resolve(keyNode); key.Kind != yaml.ScalarNode {
			s.problem(keyNode, "a key must be a name, not a %s", nodeKind(key))
			continue
		} else if !isMerge(keyNode) {
			name = key.Value
			// A key is taken as written, but one yaml.v3 cannot read at all (a !!binary key
			// that is not base64, an !!int key that is not a number) is refused as it would be.
			if key.ShortTag() != "!!str" {
				var v any
				if err := key.Decode(&v); err != nil {
					_, msg := yamlMessage(err)
					s.problem(keyNode, "%s", msg)
					continue
				}
			}
		}
		if line, dup := seen[name]; dup {
			s.problem(keyNode, "mapping key %q already defined at line %d", name, line)
			if !isMerge(keyNode) {
				// Neither value can be taken for the one the author meant.
				out[name] = badValue{}
			}
			continue
		}
		seen[name] = keyNode.Line
		if isMerge(keyNode) {
			merge = valNode
			continue
		}
		sub := joinPath(path, name)
		s.setPos(sub, keyNode, valNode)
		out[name] = s.value(valNode, sub, viaAlias)
	}
	if merge == nil {
		return
	}
	s.merging++
	defer func() { s.merging-- }()
	from := []*yaml.Node{merge}
	if resolve(merge).Kind == yaml.SequenceNode {
		from = resolve(merge).Content
	}
	for _, f := range from {
		alias := f.Kind == yaml.AliasNode
		if !s.count(viaAlias || alias) {
			return // an empty mapping merged into itself over and over makes no values to count
		}
		if f = resolve(f); f.Kind != yaml.MappingNode {
			s.problem(merge, "map merge requires map or sequence of maps as the value")
			continue
		}
		merged := map[string]any{}
		s.mapping(f, path, merged, viaAlias || alias)
		for k, v := range merged {
			if _, ok := out[k]; !ok {
				out[k] = v
			}
		}
	}
}

func nodeKind(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "mapping"
	case yaml.SequenceNode:
		return "list"
	}
	return "value"
}

// decoder fills the schema from koanf's merged map: the one strict decoding step. Keys match
// the koanf tags of the schema's fields (embedded ",squash" structs flattened); a key the schema
// lacks is an unknown key, a value of the wrong shape a type error. Neither stops it: it records
// the problem, leaves the field zero and goes on, so one run reports everything.
type decoder struct {
	ps *problems
	// texts are the numbers' texts by key path (see yamlSource.texts).
	texts map[string]string
	// holes are the entries a value could not be taken for, failed the values themselves (see
	// fail).
	holes, failed []string
}

var textUnmarshalerType = reflect.TypeFor[encoding.TextUnmarshaler]()

// decode fills v from data and reports whether the value was taken. path is the key path of
// the value; hole is the entry a failure here makes a hole of, "" for the value itself.
func (d *decoder) decode(v reflect.Value, data any, path, hole string) bool {
	if _, bad := data.(badValue); bad {
		d.fail(path, hole, "")
		return false
	}
	if data == nil {
		return true // an explicit null (`max_wait:` with nothing after it) leaves the key unset
	}
	t := v.Type()
	if t.Kind() == reflect.Pointer {
		elem := reflect.New(t.Elem())
		ok := d.decode(elem.Elem(), data, path, hole)
		_, isMapping := data.(map[string]any)
		if ok || (t.Elem().Kind() == reflect.Struct && isMapping) {
			// A mapping with a bad key inside is still present (a rule's metadata source
			// stays a source); a scalar that failed stays unset.
			v.Set(elem)
		}
		return ok
	}
	if reflect.PointerTo(t).Implements(textUnmarshalerType) {
		return d.text(v, data, path, hole)
	}
	switch t.Kind() {
	case reflect.Struct:
		m, ok := data.(map[string]any)
		if !ok {
			return d.mismatch(v, data, path, hole)
		}
		d.fields(v, m, path)
		return true
	case reflect.Map:
		m, ok := data.(map[string]any)
		if !ok {
			return d.mismatch(v, data, path, hole)
		}
		out := reflect.MakeMapWithSize(t, len(m))
		elemHole := elementHole(t.Elem(), hole)
		for _, key := range sortedKeys(m) {
			e := reflect.New(t.Elem()).Elem()
			d.decode(e, m[key], joinPath(path, key), elemHole)
			// Kept even when it failed: the name is still defined, so references to it
			// (a rule's value, a default) are not reported as unknown as well.
			out.SetMapIndex(reflect.ValueOf(key).Convert(t.Key()), e)
		}
		v.Set(out)
		return true
	case reflect.Slice:
		l, ok := data.([]any)
		if !ok {
			return d.mismatch(v, data, path, hole)
		}
		out := reflect.MakeSlice(t, len(l), len(l))
		elemHole := elementHole(t.Elem(), hole)
		for i, item := range l {
			// Kept even when it failed, so later items keep the index the file gives them.
			d.decode(out.Index(i), item, path+"["+strconv.Itoa(i)+"]", elemHole)
		}
		v.Set(out)
		return true
	}
	return d.scalar(v, data, path, hole)
}

// elementHole is the hole a failed map value or list item leaves: an item that is a mapping of
// its own (a feature, a rule, a compartment family) is an entry in its own right; a scalar item
// belongs to the entry holding the list.
func elementHole(t reflect.Type, hole string) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() == reflect.Struct {
		return ""
	}
	return hole
}

// fields fills the struct v from the mapping m. Each field's failures make a hole of this
// struct (its validation looks at its keys together), except at the root, where each section
// is its own entry.
func (d *decoder) fields(v reflect.Value, m map[string]any, path string) {
	info := structInfoOf(v.Type())
	for _, key := range sortedKeys(m) {
		sub := joinPath(path, key)
		index, ok := info.fields[key]
		if !ok {
			d.ps.add(sub, "unknown key %q%s", key, suggest(key, info.keys))
			continue
		}
		d.decode(v.FieldByIndex(index), m[key], sub, path)
	}
}

func (d *decoder) text(v reflect.Value, data any, path, hole string) bool {
	var text string
	switch x := data.(type) {
	case string:
		text = x
	case int, int64, uint64, float64:
		if v.Type() == reflect.TypeFor[Concurrency]() {
			n, ok, inRange := toInt(x)
			if !ok || !inRange || n == math.MinInt64 {
				d.fail(path, hole, "expected an integer or adaptive, got %v", x)
				return false
			}
			v.SetInt(n)
			return true
		}
		if v.Type() == reflect.TypeFor[Amount]() {
			if t, ok := d.texts[path]; ok {
				text = t
			} else {
				text = fmt.Sprint(x)
			}
			break
		}
		if v.Type() != reflect.TypeFor[Size]() {
			d.fail(path, hole, "%v is not a duration (write it with a unit, like 100ms or 5s)", x)
			return false
		}
		text = fmt.Sprint(x)
	default:
		return d.mismatch(v, data, path, hole)
	}
	tmp := reflect.New(v.Type())
	if err := tmp.Interface().(encoding.TextUnmarshaler).UnmarshalText([]byte(text)); err != nil {
		d.fail(path, hole, "%v", err)
		return false
	}
	v.Set(tmp.Elem())
	return true
}

// scalar sets a string, boolean or number. Nothing is converted between kinds: the string "5"
// is not an integer, 5 is not a string, 1.5 is not an integer, and numbers must be finite.
func (d *decoder) scalar(v reflect.Value, data any, path, hole string) bool {
	switch v.Kind() {
	case reflect.String:
		s, ok := data.(string)
		if !ok {
			return d.mismatch(v, data, path, hole)
		}
		v.SetString(s)
	case reflect.Bool:
		b, ok := data.(bool)
		if !ok {
			return d.mismatch(v, data, path, hole)
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int64, reflect.Int32:
		n, ok, inRange := toInt(data)
		if !ok {
			return d.mismatch(v, data, path, hole)
		}
		if !inRange || v.OverflowInt(n) {
			d.fail(path, hole, "%v is out of range for an integer", data)
			return false
		}
		v.SetInt(n)
	case reflect.Float64, reflect.Float32:
		f, ok := toFloat(data)
		if !ok {
			return d.mismatch(v, data, path, hole)
		}
		if math.IsNaN(f) || math.IsInf(f, 0) {
			d.fail(path, hole, "expected a finite number, got %v", f)
			return false
		}
		v.SetFloat(f)
	default:
		return d.mismatch(v, data, path, hole)
	}
	return true
}

// toInt takes an integer, or a float with no fraction (1e3); inRange is false when it does not
// fit in an int64.
func toInt(data any) (n int64, ok, inRange bool) {
	switch x := data.(type) {
	case int:
		return int64(x), true, true
	case int64:
		return x, true, true
	case uint64:
		return int64(x), true, x <= math.MaxInt64
	case float64:
		if x != math.Trunc(x) {
			return 0, false, false
		}
		return int64(x), true, x >= math.MinInt64 && x < math.MaxInt64
	}
	return 0, false, false
}

func toFloat(data any) (float64, bool) {
	switch x := data.(type) {
	case int:
		return float64(x), true
	case int64:
		return float64(x), true
	case uint64:
		return float64(x), true
	case float64:
		return x, true
	}
	return 0, false
}

func (d *decoder) mismatch(v reflect.Value, data any, path, hole string) bool {
	d.fail(path, hole, "expected %s, got %s", kindName(v.Type()), describeValue(data))
	return false
}

// fail reports that the value at path could not be taken (unless format is "", when it was
// reported already) and marks a hole: the entry holding the value, or the value itself when it
// is an entry (a section, a map value or list item that is a mapping). The field stays zero, and
// validation problems at the hole or inside it are dropped: a family whose limits failed to
// decode is not also told it "needs limits_from or limits", a pool whose max_concurrent failed
// is not also told its capacity is below 1, and a breaker whose sliding_window_size failed is
// not measured against the default window. Only a check of one value alone (addOwn) still
// reports a sibling of the failed value, since it never read the zero. Problems outside the
// hole stay even when they read the hole's default; each names the value it used.
func (d *decoder) fail(path, hole, format string, args ...any) {
	if format != "" {
		d.ps.add(path, format, args...)
	}
	if hole == "" {
		hole = path
	}
	d.holes = append(d.holes, hole)
	d.failed = append(d.failed, path)
}

func kindName(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t {
	case reflect.TypeFor[Duration]():
		return "a duration"
	case reflect.TypeFor[Size]():
		return "a size"
	case reflect.TypeFor[Amount]():
		return "an amount"
	case reflect.TypeFor[Concurrency]():
		return "an integer or adaptive"
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
	default:
		return fmt.Sprintf("%v", x)
	}
}

// structInfo is what the decoder needs to know about a schema struct.
type structInfo struct {
	// fields maps koanf tag names to field index paths, flattening squashed embedded structs.
	fields map[string][]int
	// keys are the tag names in order, for suggestions.
	keys []string
}

var structInfos sync.Map // reflect.Type → *structInfo

func structInfoOf(t reflect.Type) *structInfo {
	if info, ok := structInfos.Load(t); ok {
		return info.(*structInfo)
	}
	info := &structInfo{fields: map[string][]int{}}
	var add func(t reflect.Type, prefix []int)
	add = func(t reflect.Type, prefix []int) {
		for i := range t.NumField() {
			f := t.Field(i)
			index := append(slices.Clone(prefix), i)
			tag := f.Tag.Get("koanf")
			if strings.Contains(tag, ",squash") {
				add(f.Type, index)
				continue
			}
			if tag == "" || tag == "-" {
				continue
			}
			info.fields[tag] = index
			info.keys = append(info.keys, tag)
		}
	}
	add(t, nil)
	sort.Strings(info.keys)
	actual, _ := structInfos.LoadOrStore(t, info)
	return actual.(*structInfo)
}

func joinPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// suggest offers the closest known key for a misspelt one.
func suggest(key string, known []string) string {
	best, bestD := "", 3
	for _, k := range known {
		if d := editDistance(key, k); d < bestD {
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
	env = slices.Clone(env)
	sort.Strings(env)
	for _, kv := range env {
		name, value, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(name, EnvPrefix) || !strings.Contains(name, "__") {
			continue
		}
		parts := strings.Split(strings.ToLower(strings.TrimPrefix(name, EnvPrefix)), "__")
		path := strings.Join(parts, ".")
		var scalar any
		if err := yaml.Unmarshal([]byte(value), &scalar); err != nil {
			scalar = value
		}
		switch scalar.(type) {
		case map[string]any, []any:
			ps.addEnv(path, name, "must be a single value, not a YAML %s", describeValue(scalar))
			continue
		case nil:
			scalar = value
		}
		if slices.Contains(parts, "") {
			ps.addEnv(path, name, "has an empty level between double underscores")
			continue
		}
		m := out
		for i, p := range parts {
			if i == len(parts)-1 {
				m[p] = scalar
				names[path] = name
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

// envValue returns the value of the variable name in env (os.Environ() form).
func envValue(env []string, name string) (string, bool) {
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == name {
			return v, true
		}
	}
	return "", false
}

// confmapProvider feeds a ready nested map to koanf.
type confmapProvider map[string]any

func (c confmapProvider) ReadBytes() ([]byte, error) {
	return nil, errors.New("confmap provider does not support ReadBytes")
}
func (c confmapProvider) Read() (map[string]any, error) { return c, nil }
