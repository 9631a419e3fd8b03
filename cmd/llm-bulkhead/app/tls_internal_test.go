package app

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/integration/testpki"
)

func writeFile(t *testing.T, dir, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestTLSFilesRefusedWithTheirName: every way the files can be wrong is an error that names
// the file to fix.
func TestTLSFilesRefusedWithTheirName(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "ca")
	leaf := ca.Server(t, "llm-bulkhead")
	other := ca.Server(t, "other")
	cert := writeFile(t, dir, "tls.crt", leaf.PEM)
	key := writeFile(t, dir, "tls.key", leaf.KeyPEM)
	otherKey := writeFile(t, dir, "other.key", other.KeyPEM)
	caFile := writeFile(t, dir, "ca.crt", ca.PEM)
	garbage := writeFile(t, dir, "garbage.pem", []byte("not a certificate\n"))
	badDER := writeFile(t, dir, "bad-der.pem", []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"))
	missing := filepath.Join(dir, "missing.crt")
	// A directory where the key should be: unreadable whoever runs the test (root reads files
	// without permission).
	unreadable := filepath.Join(dir, "unreadable.key")
	if err := os.Mkdir(unreadable, 0o755); err != nil {
		t.Fatal(err)
	}

	for name, c := range map[string]struct {
		files TLSFiles
		want  []string
	}{
		"key without cert":   {TLSFiles{Key: key}, []string{"--tls-cert", "server.tls_cert"}},
		"cert without key":   {TLSFiles{Cert: cert}, []string{"--tls-key", "server.tls_key"}},
		"CA without cert":    {TLSFiles{ClientCA: caFile}, []string{"mutual TLS needs --tls-cert"}},
		"missing cert":       {TLSFiles{Cert: missing, Key: key}, []string{missing, "no such file"}},
		"cert not PEM":       {TLSFiles{Cert: garbage, Key: key}, []string{garbage, "no PEM certificate"}},
		"cert bad DER":       {TLSFiles{Cert: badDER, Key: key}, []string{badDER, "certificate 1"}},
		"key not PEM":        {TLSFiles{Cert: cert, Key: garbage}, []string{garbage, cert}},
		"key of another":     {TLSFiles{Cert: cert, Key: otherKey}, []string{otherKey, "does not match", cert}},
		"CA not PEM":         {TLSFiles{Cert: cert, Key: key, ClientCA: garbage}, []string{garbage, "no PEM certificate"}},
		"key unreadable":     {TLSFiles{Cert: cert, Key: unreadable}, []string{unreadable, "is a directory"}},
		"CA file is missing": {TLSFiles{Cert: cert, Key: key, ClientCA: missing}, []string{missing}},
	} {
		t.Run(name, func(t *testing.T) {
			err := c.files.check()
			if err == nil {
				_, err = loadTLSMaterial(c.files)
			}
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%q lacks %q", err, w)
				}
			}
		})
	}
	m, err := loadTLSMaterial(TLSFiles{Cert: cert, Key: key, ClientCA: caFile})
	if err != nil || m.clientCA != 1 || m.leaf.SerialNumber.Cmp(leaf.Cert.SerialNumber) != 0 {
		t.Fatalf("valid files: %v", err)
	}
}

// TestTLSBrokenRotationKeepsTheCertificate: a rotation caught half-way (a new certificate with
// the old key) is refused, logged and counted once however often it is read; the certificate
// in use stays until a consistent pair arrives.
func TestTLSBrokenRotationKeepsTheCertificate(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "ca")
	first, second := ca.Server(t, "one"), ca.Server(t, "two")
	cert := writeFile(t, dir, "tls.crt", first.PEM)
	key := writeFile(t, dir, "tls.key", first.KeyPEM)
	var logs bytes.Buffer
	reg := prometheus.NewRegistry()
	lt, err := newListenerTLS(TLSFiles{Cert: cert, Key: key}, slog.New(slog.NewJSONHandler(&logs, nil)), reg, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	serial := func() int64 { return lt.cur.Load().leaf.SerialNumber.Int64() }
	count := func(result string) float64 { return gathered(t, reg, "llm_bulkhead_tls_reloads_total", result) }

	if lt.reload("test") || count("success")+count("error") != 0 {
		t.Fatal("unchanged files counted as a reload")
	}
	writeFile(t, dir, "tls.crt", second.PEM) // the key is not there yet
	for range 3 {
		if lt.reload("test") {
			t.Fatal("a certificate with the wrong key was swapped in")
		}
	}
	if serial() != first.Cert.SerialNumber.Int64() || count("error") != 1 {
		t.Fatalf("serial %d, errors %v: want the first certificate kept and one error", serial(), count("error"))
	}
	if !strings.Contains(logs.String(), "TLS files refused") || !strings.Contains(logs.String(), key) {
		t.Errorf("the refusal is not logged with the file: %s", logs.String())
	}
	writeFile(t, dir, "tls.key", second.KeyPEM)
	if !lt.reload("test") || serial() != second.Cert.SerialNumber.Int64() || count("success") != 1 {
		t.Fatalf("the completed rotation was not taken: serial %d, successes %v", serial(), count("success"))
	}
	if got := gathered(t, reg, "llm_bulkhead_tls_certificate_expiry_timestamp_seconds", ""); got != float64(second.Cert.NotAfter.Unix()) {
		t.Errorf("expiry gauge %v, want %d", got, second.Cert.NotAfter.Unix())
	}
	// A file that disappears is refused too, once.
	os.Remove(key)
	lt.reload("test")
	lt.reload("test")
	if count("error") != 2 || serial() != second.Cert.SerialNumber.Int64() {
		t.Fatalf("a missing key: errors %v, serial %d", count("error"), serial())
	}
}

// gathered returns the value of metric name (with the given result label, if any) in reg; -1
// when it is not there.
func gathered(t *testing.T, reg *prometheus.Registry, name, result string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if result != "" && (len(m.GetLabel()) != 1 || m.GetLabel()[0].GetValue() != result) {
				continue
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return -1
}

// TestTLSRotationKeepsAValidCertificate: a rotation to a certificate that has expired, or is not
// valid yet, keeps the certificate in use — clients would refuse the new one — and is counted
// and logged once; a certificate not valid yet is taken once it is, without another change.
func TestTLSRotationKeepsAValidCertificate(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "ca")
	now := time.Now()
	current := ca.ServerValid(t, now.Add(-time.Hour), now.Add(2*time.Hour), "current")
	expired := ca.ServerValid(t, now.Add(-48*time.Hour), now.Add(-24*time.Hour), "expired")
	early := ca.ServerValid(t, now.Add(30*time.Minute), now.Add(90*24*time.Hour), "early")
	cert := writeFile(t, dir, "tls.crt", current.PEM)
	key := writeFile(t, dir, "tls.key", current.KeyPEM)
	var logs bytes.Buffer
	reg := prometheus.NewRegistry()
	clock := now
	lt, err := newListenerTLS(TLSFiles{Cert: cert, Key: key}, slog.New(slog.NewJSONHandler(&logs, nil)), reg, func() time.Time { return clock })
	if err != nil {
		t.Fatal(err)
	}
	serial := func() int64 { return lt.cur.Load().leaf.SerialNumber.Int64() }
	count := func(result string) float64 { return gathered(t, reg, "llm_bulkhead_tls_reloads_total", result) }
	rotate := func(l *testpki.Leaf) {
		writeFile(t, dir, "tls.crt", l.PEM)
		writeFile(t, dir, "tls.key", l.KeyPEM)
	}

	// Given a rotation to an expired certificate
	rotate(expired)
	for range 3 {
		if lt.reload("test") {
			t.Fatal("an expired certificate was swapped in")
		}
	}
	// then the current one stays, and the refusal is counted and logged once, with the file.
	if serial() != current.Cert.SerialNumber.Int64() || count("error") != 1 || count("success") != 0 {
		t.Fatalf("serial %d, errors %v, successes %v", serial(), count("error"), count("success"))
	}
	if got := logs.String(); strings.Count(got, "TLS files refused") != 1 || !strings.Contains(got, cert+": the certificate expired at") {
		t.Errorf("log:\n%s", got)
	}
	if got := gathered(t, reg, "llm_bulkhead_tls_certificate_expiry_timestamp_seconds", ""); got != float64(current.Cert.NotAfter.Unix()) {
		t.Errorf("expiry gauge %v, want the certificate in use's %d", got, current.Cert.NotAfter.Unix())
	}

	// Given a rotation to a certificate valid only from half an hour on
	rotate(early)
	if lt.reload("test") || serial() != current.Cert.SerialNumber.Int64() || count("error") != 2 {
		t.Fatalf("a certificate not valid yet: serial %d, errors %v", serial(), count("error"))
	}
	if !strings.Contains(logs.String(), "the certificate is not valid before") {
		t.Errorf("log:\n%s", logs.String())
	}
	clock = now.Add(29 * time.Minute)
	if lt.reload("periodic check") || count("error") != 2 {
		t.Fatalf("still not valid: taken, or counted again (errors %v)", count("error"))
	}
	// then once it is valid, the periodic check takes it, though the files did not change.
	clock = now.Add(31 * time.Minute)
	if !lt.reload("periodic check") || serial() != early.Cert.SerialNumber.Int64() || count("success") != 1 {
		t.Fatalf("the certificate now valid was not taken: serial %d, successes %v", serial(), count("success"))
	}

	// A valid certificate in use is not replaced by one that expired meanwhile.
	clock = now.Add(3 * time.Hour)
	rotate(current)
	if lt.reload("test") || serial() != early.Cert.SerialNumber.Int64() {
		t.Fatalf("serial %d after a rotation to a certificate expired by now", serial())
	}
}
