package config

import (
	"errors"
	"fmt"
	"strings"

	"github.com/llm-bulkhead/llm-bulkhead/policy/apikey"
	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
)

// readKeys reads tenants.keys_file into the policy, recording a problem that names the file and
// its line when it cannot be read, or when it gives a key of the directory to another tenant.
func readKeys(ps *problems, p *Policy) {
	t := &p.Tenants
	if t.KeysFile == "" {
		return
	}
	fileProblem := func(line int, format string, args ...any) {
		ps.list = append(ps.list, Problem{File: t.KeysFile, Line: line, Path: "tenants.keys_file", Msg: fmt.Sprintf(format, args...)})
		ps.meta = append(ps.meta, problemMeta{})
	}
	data, err := files.Read(t.KeysFile, files.MaxKeys)
	if err != nil {
		fileProblem(0, "cannot read the keys file: %v", errors.Unwrap(err))
		return
	}
	keys, err := apikey.Parse(data, CheckIdentity)
	if err != nil {
		var le *apikey.LineError
		if errors.As(err, &le) {
			fileProblem(le.Line, "%v", le.Err)
		} else {
			fileProblem(0, "%v", err)
		}
		return
	}
	for i, tn := range t.Directory {
		for j, hx := range tn.KeySHA256 {
			h, err := apikey.ParseHash(strings.TrimSpace(hx))
			if err != nil {
				continue // validation said so
			}
			if other, ok := keys.Lookup(h); ok && other != tn.ID {
				ps.add(fmt.Sprintf("tenants.directory[%d].key_sha256[%d]", i, j),
					"key %s… belongs to tenant %q in the keys file %s: a key has one tenant", h.Prefix(), other, t.KeysFile)
			}
		}
	}
	t.keys = keys
}
