package apikey_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/apikey"
)

// FuzzParse: whatever a keys file holds, Parse returns a table or a *LineError naming a line
// of the file, never panics; every line it accepted finds its tenant, and an error never
// repeats a line's text beyond what the file's first field could be.
func FuzzParse(f *testing.F) {
	f.Add([]byte(hexSum("a") + " acme\n# c\n\n" + hexSum("b") + "\tglobex\r\n"))
	f.Add([]byte(hexSum("a") + " acme\n" + hexSum("a") + " globex\n"))
	f.Add([]byte("sk-secret acme extra\n"))
	f.Add([]byte(strings.Repeat("0", 64) + " \xff\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		tab, err := apikey.Parse(data, nil)
		lines := bytes.Count(data, []byte{'\n'}) + 1
		if err != nil {
			var le *apikey.LineError
			if !errors.As(err, &le) || le.Line < 1 || le.Line > lines {
				t.Fatalf("error %v does not name one of the %d lines", err, lines)
			}
			return
		}
		for n, line := range bytes.Split(data, []byte{'\n'}) {
			line = bytes.TrimSpace(line)
			if len(line) == 0 || line[0] == '#' {
				continue
			}
			fields := bytes.Fields(line)
			if len(fields) != 2 {
				t.Fatalf("line %d accepted with %d fields", n+1, len(fields))
			}
			h, err := apikey.ParseHash(string(fields[0]))
			if err != nil {
				t.Fatalf("line %d accepted with hash %q: %v", n+1, fields[0], err)
			}
			if got, ok := tab.Lookup(h); !ok || got != string(fields[1]) {
				t.Fatalf("line %d: lookup gives %q %v, want %q", n+1, got, ok, fields[1])
			}
		}
	})
}
