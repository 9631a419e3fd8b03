package app

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// TLSFiles name the ext_proc listener's TLS material: the certificate chain and its key (both
// PEM), and for mutual TLS the CAs that sign clients' certificates. Cert empty means no TLS.
type TLSFiles struct {
	Cert, Key, ClientCA string
}

// check reports a combination that cannot work, naming both the flag and the policy key.
func (f TLSFiles) check() error {
	switch {
	case f.Cert == "" && f.Key != "":
		return errors.New("a TLS key without a certificate: set --tls-cert (server.tls_cert) too, or neither")
	case f.Cert != "" && f.Key == "":
		return errors.New("a TLS certificate without its key: set --tls-key (server.tls_key) too, or neither")
	case f.ClientCA != "" && f.Cert == "":
		return errors.New("a client CA without a certificate: mutual TLS needs --tls-cert and --tls-key (server.tls_cert, server.tls_key)")
	}
	return nil
}

// tlsMaterial is one consistent reading of the files: what every handshake until the next
// successful reload uses.
type tlsMaterial struct {
	config   *tls.Config
	leaf     *x509.Certificate
	clientCA int // certificates in the client CA bundle; 0 without mutual TLS
	sum      [sha256.Size]byte
}

// readTLSFiles reads the files and hashes their contents, so that a reading equal to the one in
// use changes nothing.
func readTLSFiles(f TLSFiles) (cert, key, ca []byte, sum [sha256.Size]byte, err error) {
	h := sha256.New()
	read := func(path string) ([]byte, error) {
		if path == "" {
			return nil, nil
		}
		b, err := files.Read(path, files.MaxPEM)
		if err != nil {
			return nil, err
		}
		// Length-prefixed, so that bytes moving from one file to the next change the sum.
		_ = binary.Write(h, binary.BigEndian, uint64(len(b)))
		h.Write(b)
		return b, nil
	}
	if cert, err = read(f.Cert); err != nil {
		return
	}
	if key, err = read(f.Key); err != nil {
		return
	}
	if ca, err = read(f.ClientCA); err != nil {
		return
	}
	copy(sum[:], h.Sum(nil))
	return
}

// loadTLSMaterial reads and checks the files: every certificate parses, the key matches the
// certificate, and the client CA bundle holds at least one certificate. Errors name the file.
func loadTLSMaterial(f TLSFiles) (*tlsMaterial, error) {
	certPEM, keyPEM, caPEM, sum, err := readTLSFiles(f)
	if err != nil {
		return nil, err
	}
	chain, err := parseCertificates(f.Cert, certPEM)
	if err != nil {
		return nil, err
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w (the key for the certificate in %s)", f.Key, err, f.Cert)
	}
	m := &tlsMaterial{leaf: chain[0], sum: sum, config: &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{pair},
	}}
	if f.ClientCA != "" {
		cas, err := parseCertificates(f.ClientCA, caPEM)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		for _, c := range cas {
			pool.AddCert(c)
		}
		m.clientCA = len(cas)
		m.config.ClientCAs = pool
		m.config.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return m, nil
}

// parseCertificates decodes every CERTIFICATE block of a PEM file; anything else in it (a key
// in a combined file, comments) is skipped.
func parseCertificates(path string, b []byte) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	for len(b) > 0 {
		var block *pem.Block
		block, b = pem.Decode(b)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%s: certificate %d: %w", path, len(certs)+1, err)
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, fmt.Errorf("%s: no PEM certificate in the file", path)
	}
	return certs, nil
}

// tlsPollInterval is how often the files are read again whatever the file watch reports: a
// safety net for filesystems and mounts that send no events, so that a renewed certificate is
// never missed until the old one expires.
const tlsPollInterval = 30 * time.Second

type tlsMetrics struct {
	reloads *prometheus.CounterVec
	expiry  prometheus.Gauge
}

// listenerTLS serves the ext_proc listener's TLS material and swaps in a new reading when the
// files change: new handshakes use the new certificate and client CAs, connections already open
// keep theirs. A reading that fails (a half-written file, a certificate and key that do not
// match, a bad PEM, a certificate that has expired or is not valid yet) is refused, logged and
// counted, and the material in use stays. Safe for concurrent use.
type listenerTLS struct {
	files   TLSFiles
	log     *slog.Logger
	metrics tlsMetrics
	now     func() time.Time

	cur atomic.Pointer[tlsMaterial]

	mu sync.Mutex // serializes reloads
	// refused is the sum of the last reading refused (or of its error), which is not read
	// again until the files change; refusedUntil, when set, is when it may be taken after all
	// (the NotBefore of a certificate that was not valid yet).
	refused      [sha256.Size]byte
	refusedUntil time.Time

	watchers []*watcher
	stop     chan struct{}
	wg       sync.WaitGroup
	stopOnce sync.Once
}

// newListenerTLS reads the files once; an error there stops the server from starting. now tells
// the time certificates are judged at.
func newListenerTLS(f TLSFiles, log *slog.Logger, reg prometheus.Registerer, now func() time.Time) (*listenerTLS, error) {
	m, err := loadTLSMaterial(f)
	if err != nil {
		return nil, err
	}
	ns := observe.Namespace
	t := &listenerTLS{files: f, log: log, now: now, stop: make(chan struct{}), metrics: tlsMetrics{
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "tls_reloads_total",
			Help: "Readings of the ext_proc listener's changed TLS files, by result (success, error: broken, or a certificate expired or not valid yet); on error the material in use stayed."}, []string{"result"}),
		expiry: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "tls_certificate_expiry_timestamp_seconds",
			Help: "Unix time at which the ext_proc listener's certificate in use expires."}),
	}}
	t.metrics.reloads.WithLabelValues("success")
	t.metrics.reloads.WithLabelValues("error")
	reg.MustRegister(t.metrics.reloads, t.metrics.expiry)
	t.use(m)
	return t, nil
}

func (t *listenerTLS) use(m *tlsMaterial) {
	t.cur.Store(m)
	t.metrics.expiry.Set(float64(m.leaf.NotAfter.Unix()))
	if err := checkValidity(t.files.Cert, m.leaf, t.now()); err != nil {
		t.log.Error("the ext_proc listener's certificate is not valid now: clients will refuse it", "err", err,
			"not_before", m.leaf.NotBefore, "not_after", m.leaf.NotAfter)
	}
}

// checkValidity refuses a certificate that has expired or is not valid yet at now, as a client
// verifying it would. Only the leaf is judged: a chain may carry an expired cross-signed
// certificate that clients skip.
func checkValidity(path string, leaf *x509.Certificate, now time.Time) error {
	switch {
	case now.Before(leaf.NotBefore):
		return fmt.Errorf("%s: the certificate is not valid before %s (now %s)", path, leaf.NotBefore.UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339))
	case now.After(leaf.NotAfter):
		return fmt.Errorf("%s: the certificate expired at %s (now %s)", path, leaf.NotAfter.UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339))
	}
	return nil
}

// credentials are the gRPC server's transport credentials: every handshake takes the material
// in use at that moment.
func (t *listenerTLS) credentials() credentials.TransportCredentials {
	return credentials.NewTLS(&tls.Config{
		MinVersion: tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return t.cur.Load().config, nil
		},
	})
}

// mutual reports whether the listener requires client certificates.
func (t *listenerTLS) mutual() bool { return t.files.ClientCA != "" }

// reload reads the files again and swaps the new material in when their contents changed and
// are valid. It reports whether the material in use changed.
func (t *listenerTLS) reload(why string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, _, _, sum, err := readTLSFiles(t.files)
	if err == nil && sum == t.cur.Load().sum {
		return false
	}
	// The same broken contents (or the same missing file) are reported once, not on every
	// event and poll until they are fixed; a certificate that was not valid yet is read again
	// once it is.
	seen := sum
	if err != nil {
		seen = sha256.Sum256([]byte(err.Error()))
	}
	now := t.now()
	if seen == t.refused && (t.refusedUntil.IsZero() || now.Before(t.refusedUntil)) {
		return false
	}
	var m *tlsMaterial
	if err == nil {
		m, err = loadTLSMaterial(t.files)
	}
	var until time.Time
	if err == nil {
		// A rotation to a certificate clients would refuse keeps the one in use.
		if err = checkValidity(t.files.Cert, m.leaf, now); err != nil && now.Before(m.leaf.NotBefore) {
			until = m.leaf.NotBefore
		}
	}
	if err != nil {
		if seen != t.refused {
			t.metrics.reloads.WithLabelValues("error").Inc()
			t.log.Error("TLS files refused; the listener keeps the certificate in use", "why", why,
				"err", err, "cert", t.files.Cert, "not_after", t.cur.Load().leaf.NotAfter)
		}
		t.refused, t.refusedUntil = seen, until
		return false
	}
	t.refused, t.refusedUntil = [sha256.Size]byte{}, time.Time{}
	t.use(m)
	t.metrics.reloads.WithLabelValues("success").Inc()
	t.log.Info("TLS files reloaded; new connections use them", "why", why, "cert", t.files.Cert,
		"subject", m.leaf.Subject.String(), "not_after", m.leaf.NotAfter, "client_cas", m.clientCA)
	return true
}

// watch reloads when a file changes: promptly through a watch on each file's directory (which
// sees a Kubernetes Secret's ..data symlink swap), and every interval whatever the watch says.
func (t *listenerTLS) watch(interval time.Duration) {
	seen := map[string]bool{}
	for _, path := range []string{t.files.Cert, t.files.Key, t.files.ClientCA} {
		if path == "" || seen[path] {
			continue
		}
		seen[path] = true
		w, err := newWatcher(path, 250*time.Millisecond, t.log, func() { t.reload("file changed") })
		if err != nil {
			t.log.Warn("cannot watch a TLS file; it is still read again periodically", "file", path, "every", interval.String(), "err", err)
			continue
		}
		t.watchers = append(t.watchers, w)
	}
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-t.stop:
				return
			case <-tick.C:
				t.reload("periodic check")
			}
		}
	}()
}

// close stops watching.
func (t *listenerTLS) close() {
	t.stopOnce.Do(func() {
		close(t.stop)
		for _, w := range t.watchers {
			w.Close()
		}
		t.wg.Wait()
	})
}

// CheckListenerTLS reads the TLS files the policy names for the ext_proc listener, as the
// server does at start: nil when the policy sets none or they form a certificate, its key and
// (for mutual TLS) a client CA bundle.
func CheckListenerTLS(p *config.Policy) error {
	f := TLSFiles{Cert: p.Server.TLSCert, Key: p.Server.TLSKey, ClientCA: p.Server.TLSClientCA}
	if err := f.check(); err != nil || f.Cert == "" {
		return err
	}
	_, err := loadTLSMaterial(f)
	return err
}
