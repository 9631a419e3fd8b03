// Package apikey maps API keys to tenants without keeping the keys: a table holds the SHA-256
// of each key and the tenant it belongs to, is read from the policy's tenant directory and from
// a keys file of `sha256-hex tenant-id` lines, and is looked up by the hash of the key a request
// presents. A key is hashed as soon as it is read and never stored, logged or compared itself;
// the last comparison of a lookup, of the stored hash with the presented one, takes the same
// time whatever the bytes (crypto/subtle).
//
// It imports only the standard library. Imported by: policy/config (the keys file and the
// directory's key hashes) and package policy (the lookup of a request's key).
package apikey

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"unicode"
)

// Hash is the SHA-256 of an API key.
type Hash [sha256.Size]byte

// stackKey is the longest key Sum hashes without allocating (far longer than any provider's
// keys, which are under 200 bytes).
const stackKey = 512

// Sum returns the SHA-256 of key. It does not allocate for keys up to 512 bytes.
func Sum(key string) Hash {
	var buf [stackKey]byte
	if len(key) <= len(buf) {
		n := copy(buf[:], key)
		return sha256.Sum256(buf[:n])
	}
	return sha256.Sum256([]byte(key))
}

// ParseHash reads a hash written as 64 hexadecimal digits (either case).
func ParseHash(s string) (Hash, error) { return parseHash([]byte(s)) }

func parseHash(s []byte) (Hash, error) {
	var h Hash
	if len(s) != 2*len(h) {
		return h, fmt.Errorf("a SHA-256 is 64 hexadecimal digits, this is %d characters", len(s))
	}
	if _, err := hex.Decode(h[:], s); err != nil {
		return h, errors.New("a SHA-256 is 64 hexadecimal digits, this has other characters")
	}
	return h, nil
}

// Prefix is the hash's first 4 bytes in hexadecimal: enough to tell keys apart in a message,
// useless for finding the key or the hash.
func (h Hash) Prefix() string { return hex.EncodeToString(h[:4]) }

// Table maps key hashes to tenants. A Table is immutable once built; the zero value and nil
// are empty tables. Safe for concurrent use.
type Table struct {
	// entries are sorted by hash.
	entries []entry
	// tenants are the distinct tenant ids, indexed by entry.tenant.
	tenants []string
}

// entry is one key: its hash, its tenant (an index into Table.tenants) and the line (or list
// position) it came from, for messages.
type entry struct {
	hash   Hash
	tenant uint32
	line   uint32
}

// Len returns the number of keys.
func (t *Table) Len() int {
	if t == nil {
		return 0
	}
	return len(t.entries)
}

// Tenants returns the number of distinct tenants the keys belong to.
func (t *Table) Tenants() int {
	if t == nil {
		return 0
	}
	return len(t.tenants)
}

// Lookup returns the tenant of the key whose hash is h. It does not allocate. The search orders
// entries by their first 8 bytes; the hashes found there are compared in constant time.
func (t *Table) Lookup(h Hash) (tenant string, ok bool) {
	if t == nil {
		return "", false
	}
	want := binary.BigEndian.Uint64(h[:8])
	e := t.entries
	lo, hi := 0, len(e)
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if binary.BigEndian.Uint64(e[mid].hash[:8]) < want {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	found := -1
	for i := lo; i < len(e) && binary.BigEndian.Uint64(e[i].hash[:8]) == want; i++ {
		if subtle.ConstantTimeCompare(e[i].hash[:], h[:]) == 1 {
			found = i
		}
	}
	if found < 0 {
		return "", false
	}
	return t.tenants[e[found].tenant], true
}

// Builder collects keys for a Table. The zero value is ready to use.
type Builder struct {
	entries []entry
	tenants []string
	index   map[string]uint32
}

// Add records that the key hashed h belongs to tenant; line says where it was written (a line
// of a file, a position in a list), for Table's errors.
func (b *Builder) Add(h Hash, tenant string, line int) {
	_ = b.add(h, []byte(tenant), line, nil)
}

// add is Add for a tenant id in bytes, checked by check (when not nil) the first time it is
// seen. Each distinct id is stored once.
func (b *Builder) add(h Hash, tenant []byte, line int, check func(string) error) error {
	if b.index == nil {
		b.index = map[string]uint32{}
	}
	i, ok := b.index[string(tenant)]
	if !ok {
		id := string(tenant)
		if check != nil {
			if err := check(id); err != nil {
				return err
			}
		}
		i = uint32(len(b.tenants))
		b.tenants = append(b.tenants, id)
		b.index[id] = i
	}
	b.entries = append(b.entries, entry{hash: h, tenant: i, line: uint32(line)})
	return nil
}

// Grow makes room for n more keys.
func (b *Builder) Grow(n int) { b.entries = slices.Grow(b.entries, n) }

// DuplicateError is a key hash given to two tenants.
type DuplicateError struct {
	// Line is where the second one is written, First where the first one is.
	Line, First int
	// Tenant and FirstTenant are the tenants they give the key to.
	Tenant, FirstTenant string
	// Prefix is the hash's prefix (Hash.Prefix).
	Prefix string
}

func (e *DuplicateError) Error() string {
	return fmt.Sprintf("key %s… belongs to tenant %q already (line %d): a key has one tenant", e.Prefix, e.FirstTenant, e.First)
}

// Table sorts the keys and returns them as a Table, or a *DuplicateError when a hash is given
// to two different tenants (a hash given twice to one tenant is kept once). The Builder must not
// be used again.
func (b *Builder) Table() (*Table, error) {
	e := b.entries
	slices.SortFunc(e, func(x, y entry) int {
		if c := bytes.Compare(x.hash[:], y.hash[:]); c != 0 {
			return c
		}
		return int(x.line) - int(y.line)
	})
	out := e[:0]
	for i := range e {
		if n := len(out); n > 0 && out[n-1].hash == e[i].hash {
			if out[n-1].tenant != e[i].tenant {
				first, second := out[n-1], e[i]
				if second.line < first.line {
					first, second = second, first
				}
				return nil, &DuplicateError{Line: int(second.line), First: int(first.line), Tenant: b.tenants[second.tenant],
					FirstTenant: b.tenants[first.tenant], Prefix: e[i].hash.Prefix()}
			}
			continue
		}
		out = append(out, e[i])
	}
	t := &Table{entries: slices.Clip(out), tenants: b.tenants}
	*b = Builder{}
	return t, nil
}

// LineError is a keys file line that cannot be read.
type LineError struct {
	// Line is the 1-based line number.
	Line int
	// Err says what is wrong.
	Err error
}

func (e *LineError) Error() string { return fmt.Sprintf("line %d: %v", e.Line, e.Err) }
func (e *LineError) Unwrap() error { return e.Err }

// Parse reads a keys file: one key per line, its SHA-256 in hexadecimal, white space, and the
// tenant id (which checkTenant, when not nil, must accept). Blank lines and lines starting with
// # are skipped; a line may end in CR LF. The error is a *LineError naming the first line that
// cannot be read; it never holds a line's text, which may be a key written by mistake.
func Parse(data []byte, checkTenant func(string) error) (*Table, error) {
	var b Builder
	b.Grow(bytes.Count(data, []byte{'\n'}) + 1)
	for n := 1; len(data) > 0; n++ {
		var line []byte
		line, data, _ = bytes.Cut(data, []byte{'\n'})
		line = bytes.TrimSpace(line)
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		hexHash, tenant, ok := cutField(line)
		if !ok {
			return nil, &LineError{Line: n, Err: errors.New("want `sha256-hex tenant-id`, this line has one field")}
		}
		h, err := parseHash(hexHash)
		if err != nil {
			return nil, &LineError{Line: n, Err: err}
		}
		if _, _, more := cutField(tenant); more {
			return nil, &LineError{Line: n, Err: errors.New("want `sha256-hex tenant-id`, this line has more than two fields (a tenant id with white space cannot be in a keys file)")}
		}
		if err := b.add(h, tenant, n, checkTenant); err != nil {
			return nil, &LineError{Line: n, Err: fmt.Errorf("the tenant id cannot be a tenant: %w", err)}
		}
	}
	t, err := b.Table()
	if err != nil {
		var d *DuplicateError
		if errors.As(err, &d) {
			return nil, &LineError{Line: d.Line, Err: err}
		}
		return nil, err
	}
	return t, nil
}

// cutField splits line, trimmed, at its first run of white space (any: a CR inside a line
// separates fields too, rather than ending up in a tenant id).
func cutField(line []byte) (field, rest []byte, ok bool) {
	i := bytes.IndexFunc(line, unicode.IsSpace)
	if i < 0 {
		return line, nil, false
	}
	return line[:i], bytes.TrimLeftFunc(line[i:], unicode.IsSpace), true
}
