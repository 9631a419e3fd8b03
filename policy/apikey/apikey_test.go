package apikey_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/apikey"
)

func hexSum(key string) string {
	h := sha256.Sum256([]byte(key))
	return hex.EncodeToString(h[:])
}

func TestSumIsSHA256AndDoesNotAllocate(t *testing.T) {
	for _, key := range []string{"", "sk-live-abc", strings.Repeat("k", 512), strings.Repeat("k", 513)} {
		if got, want := apikey.Sum(key), apikey.Hash(sha256.Sum256([]byte(key))); got != want {
			t.Errorf("Sum(%d bytes) is not the key's SHA-256", len(key))
		}
	}
	key := "sk-proj-" + strings.Repeat("x", 150)
	if n := testing.AllocsPerRun(100, func() { _ = apikey.Sum(key) }); n != 0 {
		t.Errorf("Sum allocates %v times", n)
	}
}

func TestParseAndLookup(t *testing.T) {
	file := "# keys of the platform\n" +
		hexSum("key-acme-1") + " acme\r\n" +
		"\n" +
		strings.ToUpper(hexSum("key-acme-2")) + "\tacme\n" +
		"  " + hexSum("key-globex") + "   globex  \n" +
		hexSum("key-globex") + " globex\n" // the same key twice for one tenant is one key
	tab, err := apikey.Parse([]byte(file), nil)
	if err != nil {
		t.Fatal(err)
	}
	if tab.Len() != 3 || tab.Tenants() != 2 {
		t.Errorf("%d keys of %d tenants, want 3 of 2", tab.Len(), tab.Tenants())
	}
	for key, want := range map[string]string{"key-acme-1": "acme", "key-acme-2": "acme", "key-globex": "globex"} {
		if got, ok := tab.Lookup(apikey.Sum(key)); !ok || got != want {
			t.Errorf("%s: %q %v, want %q", key, got, ok, want)
		}
	}
	for _, key := range []string{"key-acme-3", "", "key-globe"} {
		if got, ok := tab.Lookup(apikey.Sum(key)); ok {
			t.Errorf("unknown key %q found, tenant %q", key, got)
		}
	}
	var empty *apikey.Table
	if _, ok := empty.Lookup(apikey.Sum("x")); ok || empty.Len() != 0 {
		t.Error("a nil table holds keys")
	}
	h := apikey.Sum("key-acme-1")
	if n := testing.AllocsPerRun(100, func() { _, _ = tab.Lookup(h) }); n != 0 {
		t.Errorf("Lookup allocates %v times", n)
	}
}

// TestLookupSharedPrefixes: keys whose hashes share the first 8 bytes (the part the search
// orders by) are still told apart by the whole hash.
func TestLookupSharedPrefixes(t *testing.T) {
	var b apikey.Builder
	var hs []apikey.Hash
	for i := range 5 {
		var h apikey.Hash
		copy(h[:8], "samepfx!")
		h[31] = byte(i * 2)
		hs = append(hs, h)
		b.Add(h, fmt.Sprintf("t%d", i), i+1)
	}
	tab, err := b.Table()
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range hs {
		if got, ok := tab.Lookup(h); !ok || got != fmt.Sprintf("t%d", i) {
			t.Errorf("hash %d: %q %v", i, got, ok)
		}
		miss := h
		miss[31]++
		if got, ok := tab.Lookup(miss); ok {
			t.Errorf("a hash differing in its last byte found tenant %q", got)
		}
	}
}

func TestParseErrorsNameTheLineNeverItsText(t *testing.T) {
	good := hexSum("k1") + " acme\n"
	for _, tc := range []struct {
		name, file string
		line       int
		want       string
	}{
		{"one field", good + "sk-live-secret-key\n", 2, "one field"},
		{"a key instead of its hash", good + "sk-live-secret-key acme\n", 2, "64 hexadecimal digits"},
		{"not hexadecimal", good + strings.Repeat("g", 64) + " acme\n", 2, "other characters"},
		{"three fields", "#\n" + hexSum("k2") + " acme extra\n", 2, "more than two fields"},
		{"a key given to two tenants", good + "\n" + hexSum("k1") + " globex\n", 3, `belongs to tenant "acme" already (line 1)`},
		{"a tenant the policy refuses", hexSum("k2") + " bad\u0001id\n", 1, "cannot be a tenant: control"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := apikey.Parse([]byte(tc.file), func(id string) error {
				if strings.ContainsRune(id, 1) {
					return errors.New("control character")
				}
				return nil
			})
			var le *apikey.LineError
			if !errors.As(err, &le) || le.Line != tc.line || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%v, want line %d: …%s", err, tc.line, tc.want)
			}
			if strings.Contains(err.Error(), "sk-live") || strings.Contains(err.Error(), "extra") {
				t.Errorf("the error repeats the line: %v", err)
			}
		})
	}
}

// keysFile writes n keys of n/10 tenants in the keys file format.
func keysFile(n int) []byte {
	var b bytes.Buffer
	b.Grow(n * 80)
	for i := range n {
		h := sha256.Sum256(fmt.Appendf(nil, "sk-test-%d", i))
		fmt.Fprintf(&b, "%x tenant-%d\n", h, i/10)
	}
	return b.Bytes()
}

// retained is the heap a table of 100 000 keys keeps, in bytes.
func retained(t testing.TB, data []byte) (*apikey.Table, uint64) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	tab, err := apikey.Parse(data, nil)
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(data) // counted in both
	if after.HeapAlloc < before.HeapAlloc {
		t.Fatalf("the heap shrank from %d to %d bytes while a table was loaded", before.HeapAlloc, after.HeapAlloc)
	}
	return tab, after.HeapAlloc - before.HeapAlloc
}

// TestHundredThousandKeysFitInTwentyMiB: the table of 100 000 keys (of 10 000 tenants) keeps
// less than 20 MiB once loaded (BenchmarkParse100k reports the time and the bytes).
func TestHundredThousandKeysFitInTwentyMiB(t *testing.T) {
	data := keysFile(100_000)
	tab, kept := retained(t, data)
	if tab.Len() != 100_000 || tab.Tenants() != 10_000 {
		t.Fatalf("%d keys of %d tenants", tab.Len(), tab.Tenants())
	}
	if kept > 20<<20 {
		t.Errorf("the table keeps %.1f MiB, more than 20", float64(kept)/(1<<20))
	}
	if got, ok := tab.Lookup(apikey.Sum("sk-test-99999")); !ok || got != "tenant-9999" {
		t.Errorf("last key: %q %v", got, ok)
	}
	runtime.KeepAlive(tab)
}

// BenchmarkParse100k loads a keys file of 100 000 keys; it reports the heap the table keeps
// (MiB/table) besides the time and the garbage of loading it.
func BenchmarkParse100k(b *testing.B) {
	data := keysFile(100_000)
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := apikey.Parse(data, nil); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	tab, kept := retained(b, data)
	b.ReportMetric(float64(kept)/(1<<20), "MiB/table")
	runtime.KeepAlive(tab)
}

func BenchmarkLookup100k(b *testing.B) {
	tab, err := apikey.Parse(keysFile(100_000), nil)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if _, ok := tab.Lookup(apikey.Sum("sk-test-4242")); !ok {
			b.Fatal("not found")
		}
	}
}
