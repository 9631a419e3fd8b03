package llmapi

import "strings"

// Field returns the value at a dotted path (such as "metadata.feature",
// "user" or "model") of a JSON object body, for classification rules. Each
// segment names an object member; keys containing dots cannot be addressed.
// Strings come back unquoted and unescaped, numbers and booleans in their
// JSON text. It returns false when the path is empty or absent, when the value
// is null, an object or an array, or when the body is not valid JSON.
// Duplicate keys resolve as in encoding/json: the last one wins.
//
// The whole body is validated once and the objects along the path are walked
// again; short results are interned (see RequestFields), so repeated values
// do not allocate. Field is safe for concurrent use.
func Field(body []byte, path string) (string, bool) {
	if path == "" {
		return "", false
	}
	var sk skipper
	start := skipWS(body, 0)
	end, ok := sk.skip(body, start, 0)
	if !ok || skipWS(body, end) != len(body) {
		return "", false
	}
	v := start
	var kb keyBuf
	for more := true; more; {
		var seg string
		seg, path, more = strings.Cut(path, ".")
		if body[v] != '{' {
			return "", false
		}
		found := -1
		it := openObject(body, v)
		for {
			key, esc, val, more := it.next()
			if !more {
				break
			}
			if k, ok := decodeKey(&kb, key, esc); ok && string(k) == seg {
				found = val
			} else if !ok && len(seg) > len(kb) && string(unescape(nil, key)) == seg {
				found = val
			}
			it.i, _ = sk.skip(body, val, 0)
		}
		if found < 0 {
			return "", false
		}
		v = found
	}
	switch c := body[v]; c {
	case '"':
		end, _, esc, _ := scanString(body, v+1)
		return internRaw(body[v+1:end-1], esc), true
	case 't':
		return "true", true
	case 'f':
		return "false", true
	case 'n', '{', '[':
		return "", false
	}
	n, _ := scanNumber(body, v)
	return intern(body[v:n.end]), true
}
