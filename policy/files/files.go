// Package files reads the files llm-bulkhead is pointed at — the policy, TLS certificates and
// keys, the state file, the container's memory limit — so that no path can hold or exhaust
// the process: only a regular file is read, never more than a bound, and opening it never
// waits. A path naming /dev/zero, a FIFO with no writer, a directory or a device is refused
// at once with an error that says what it is; a file above the bound is refused without
// reading further than one byte past it.
package files

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
)

// Bounds on what each kind of file may hold. Far above what a real one does, far below what
// would hurt the process.
const (
	// MaxPolicy bounds a policy file (a tenant directory of tens of thousands of entries is a
	// few MiB).
	MaxPolicy = 16 << 20
	// MaxKeys bounds a file of API key hashes (tenants.keys_file): about 800 000 keys.
	MaxKeys = 64 << 20
	// MaxPEM bounds a certificate chain, a key or a CA bundle (a public CA bundle is about
	// 200 KiB).
	MaxPEM = 4 << 20
	// MaxSmall bounds a one-line system file such as a cgroup's memory limit.
	MaxSmall = 4 << 10
)

// ErrNotRegular is the error of a path that is not a regular file: a FIFO, a socket, a device
// (/dev/zero) or a directory.
var ErrNotRegular = errors.New("not a regular file")

// ErrTooLarge is the error of a file larger than the bound it is read with.
var ErrTooLarge = errors.New("file too large")

// Read returns the contents of the regular file at path, at most limit bytes. It refuses a
// path that is not a regular file (errors.Is ErrNotRegular) before reading anything, and a
// file above limit (errors.Is ErrTooLarge). Errors are *fs.PathError naming path, as
// os.ReadFile's are. Symbolic links are followed. Safe for concurrent use.
func Read(path string, limit int64) ([]byte, error) {
	f, err := open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, &fs.PathError{Op: "read", Path: path, Err: fmt.Errorf("%w (%s)", ErrNotRegular, kind(fi.Mode()))}
	}
	if fi.Size() > limit {
		return nil, tooLarge(path, limit)
	}
	// The size is a hint only: the file may grow while it is read.
	b := make([]byte, 0, fi.Size()+1)
	for {
		n, err := f.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if int64(len(b)) > limit {
			return nil, tooLarge(path, limit)
		}
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return nil, &fs.PathError{Op: "read", Path: path, Err: err}
		}
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
	}
}

func tooLarge(path string, limit int64) error {
	return &fs.PathError{Op: "read", Path: path, Err: fmt.Errorf("%w: more than %d bytes", ErrTooLarge, limit)}
}

// kind names a file mode that is not a regular file.
func kind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "is a directory"
	case m&fs.ModeNamedPipe != 0:
		return "is a FIFO"
	case m&fs.ModeSocket != 0:
		return "is a socket"
	case m&fs.ModeCharDevice != 0:
		return "is a character device"
	case m&fs.ModeDevice != 0:
		return "is a device"
	}
	return "has mode " + m.String()
}

// open opens path for reading without waiting: opening a FIFO otherwise blocks until a
// writer comes.
func open(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_RDONLY|nonBlocking, 0)
}

// KeyPair is tls.LoadX509KeyPair with both files read by Read (MaxPEM each).
func KeyPair(certFile, keyFile string) (tls.Certificate, error) {
	cert, err := Read(certFile, MaxPEM)
	if err != nil {
		return tls.Certificate{}, err
	}
	key, err := Read(keyFile, MaxPEM)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.X509KeyPair(cert, key)
}
