// Package testpki issues certificates for tests: a CA and the server and client certificates
// it signs (ECDSA P-256), as PEM, and writes them the way Kubernetes mounts a Secret.
package testpki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// serial numbers certificates in the order they are issued, so a test can tell them apart.
var serial atomic.Int64

// CA is a certificate authority.
type CA struct {
	Cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// PEM is the CA certificate, what a peer trusts.
	PEM []byte
}

// NewCA creates a self-signed CA named name, valid from an hour ago for a day.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(serial.Add(1)),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &CA{Cert: cert, key: key, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// Leaf is an issued certificate and its key, both PEM.
type Leaf struct {
	Cert   *x509.Certificate
	PEM    []byte
	KeyPEM []byte
}

// Server issues a server certificate for the DNS names and IP addresses in names, valid from an
// hour ago for a day.
func (ca *CA) Server(t testing.TB, names ...string) *Leaf {
	return ca.issue(t, x509.ExtKeyUsageServerAuth, time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour), names)
}

// ServerValid issues a server certificate like Server, valid from notBefore to notAfter: one
// that has expired, or is not valid yet.
func (ca *CA) ServerValid(t testing.TB, notBefore, notAfter time.Time, names ...string) *Leaf {
	return ca.issue(t, x509.ExtKeyUsageServerAuth, notBefore, notAfter, names)
}

// Client issues a client certificate named name, valid from an hour ago for a day.
func (ca *CA) Client(t testing.TB, name string) *Leaf {
	return ca.issue(t, x509.ExtKeyUsageClientAuth, time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour), []string{name})
}

func (ca *CA) issue(t testing.TB, usage x509.ExtKeyUsage, notBefore, notAfter time.Time, names []string) *Leaf {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial.Add(1)),
		Subject:      pkix.Name{CommonName: names[0]},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
	}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return &Leaf{Cert: cert, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder})}
}

// SecretDir is a directory laid out as the kubelet mounts a Secret or ConfigMap: each file
// name a symlink into ..data, ..data a symlink to a timestamped directory holding the files.
// Update swaps in a new timestamped directory the way the kubelet does.
type SecretDir struct {
	Dir      string
	t        testing.TB
	versions int
	current  string
}

// NewSecretDir creates the directory in dir with the files given (name → contents).
func NewSecretDir(t testing.TB, dir string, files map[string][]byte) *SecretDir {
	t.Helper()
	s := &SecretDir{Dir: dir, t: t}
	s.Update(files)
	for name := range files {
		if err := os.Symlink(filepath.Join("..data", name), filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

// Path returns the path of a file of the Secret, as a pod reads it.
func (s *SecretDir) Path(name string) string { return filepath.Join(s.Dir, name) }

// Update writes every file into a new timestamped directory, points ..data_tmp at it, renames
// ..data_tmp over ..data (the one atomic step) and removes the previous directory.
func (s *SecretDir) Update(files map[string][]byte) {
	t := s.t
	t.Helper()
	s.versions++
	version := "..2026_01_02_15_04_05." + time.Now().Format("150405.000000000") + "_" + big.NewInt(int64(s.versions)).String()
	if err := os.Mkdir(filepath.Join(s.Dir, version), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(s.Dir, version, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(version, filepath.Join(s.Dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(s.Dir, "..data_tmp"), filepath.Join(s.Dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if s.current != "" {
		if err := os.RemoveAll(filepath.Join(s.Dir, s.current)); err != nil {
			t.Fatal(err)
		}
	}
	s.current = version
}

// ShortTempDir returns a new directory with a short path, removed when the test ends: a unix
// socket's path must fit in 108 bytes, which t.TempDir's long names can pass.
func ShortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "lb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
