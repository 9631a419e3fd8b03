package statefile

import (
	"bytes"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Source is what a Persister saves and restores: every budget's windows.
type Source interface {
	// SaveState returns, at now, every window with something in it that counts, with the
	// policy's currency.
	SaveState(now time.Time) State
	// RestoreState replaces (never adds to) what each window of st counts in the running
	// policy, at now, and returns how many windows of each kind it restored. Windows whose
	// compartment or budget the policy no longer has are dropped. Spend in another currency is
	// refused with a *StateError of ReasonCurrency and restores no spend; the token budgets and
	// request rates are restored all the same.
	RestoreState(st State, now time.Time) (Restored, error)
}

// Restored counts the windows restored, by kind (Kinds).
type Restored map[string]int

// PersistOptions configure a Persister.
type PersistOptions struct {
	// Path is the state file.
	Path string
	// Interval is how often the state is written while running; at most this long of
	// charges and settlements is lost when the process is killed.
	Interval time.Duration
	Source   Source
	// Refuse makes Restore leave a file it cannot use where it is, for a caller that will not
	// start without it (state.on_error: refuse); otherwise the file is kept aside and every
	// budget starts empty.
	Refuse bool
	// Now defaults to time.Now.
	Now        func() time.Time
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Persister keeps a Source in a state file: restored once at start, written every interval and
// once more at Close. Safe for concurrent use.
type Persister struct {
	o   PersistOptions
	met *persistMetrics

	mu sync.Mutex // serialises writes
	// last is what the file holds, to skip writes that would change nothing.
	last    []byte
	failing bool

	startOnce sync.Once
	stop      chan struct{}
	done      chan struct{}
	closed    bool
}

type persistMetrics struct {
	failures *prometheus.CounterVec
	restored *prometheus.GaugeVec
	writes   *prometheus.CounterVec
	saved    prometheus.Gauge
}

// NewPersister returns a Persister; nothing is read or written until Restore, Start or Save.
func NewPersister(o PersistOptions) *Persister {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	// The metrics keep the names they had when the file held spend only: dashboards and alerts
	// on them keep working, and they now cover every window of the file.
	m := &persistMetrics{
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "llm_bulkhead", Name: "spend_state_restore_failures_total",
			Help: "Starts at which the state file could not be restored, so that budgets started empty, by reason: missing, unreadable, corrupt, version, currency (spend budgets only)."},
			[]string{"reason"}),
		restored: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "llm_bulkhead", Name: "spend_state_restored_windows",
			Help: "Windows restored from the state file at start, by kind: tokens_per_minute, tokens_per_day, requests_per_minute, spend."},
			[]string{"kind"}),
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "llm_bulkhead", Name: "spend_state_writes_total",
			Help: "Writes of the state file by result: ok, unchanged (the file already held the state) or error."},
			[]string{"result"}),
		saved: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "llm_bulkhead", Name: "spend_state_saved_timestamp_seconds",
			Help: "When the state file last held the budgets' state (written, or found unchanged), in Unix seconds."}),
	}
	for _, r := range Reasons {
		m.failures.WithLabelValues(r)
	}
	for _, k := range Kinds {
		m.restored.WithLabelValues(k)
	}
	for _, r := range []string{"ok", "unchanged", "error"} {
		m.writes.WithLabelValues(r)
	}
	if o.Registerer != nil {
		o.Registerer.MustRegister(m.failures, m.restored, m.writes, m.saved)
	}
	return &Persister{o: o, met: m, stop: make(chan struct{}), done: make(chan struct{})}
}

// Restore reads the state file into the Source. When the file is missing, unreadable, corrupt,
// or of another version, Restore logs it at error level with the file and the reason, counts it
// and returns the *StateError; the Source is left as it was (empty at start). When only its
// spend is in another currency, the rest is restored and the *StateError says so. Unless the
// options say Refuse, it renames a file it could not use (whole or in part) aside (to
// <path>.bad-<time>, so that nothing is lost and the next write does not replace it); with
// Refuse it leaves the file for the caller, which will not start, to report. It never panics on
// any content.
func (p *Persister) Restore() error {
	now := p.o.Now()
	st, err := Read(p.o.Path)
	var n Restored
	if err == nil {
		n, err = p.o.Source.RestoreState(st, now)
	}
	for _, k := range Kinds {
		p.met.restored.WithLabelValues(k).Set(float64(n[k]))
	}
	if err == nil {
		p.o.Logger.Info("budgets restored from the state file", "file", p.o.Path, "windows_restored", total(n),
			"windows_in_file", len(st.Windows)+len(st.Spend))
		return nil
	}
	var se *StateError
	if !errors.As(err, &se) {
		se = &StateError{Reason: ReasonCorrupt, Err: err}
	}
	p.met.failures.WithLabelValues(se.Reason).Inc()
	attrs := []any{"file", p.o.Path, "reason", se.Reason, "error", se.Err.Error()}
	if p.o.Refuse && se.Reason != ReasonMissing {
		p.o.Logger.Error("state file cannot be used: not starting (state.on_error: refuse); mend, move or delete it", attrs...)
		return se
	}
	if se.Reason != ReasonMissing {
		if aside, aerr := keepAside(p.o.Path, now); aerr != nil {
			attrs = append(attrs, "kept_aside_error", aerr.Error())
		} else {
			attrs = append(attrs, "kept_as", aside)
		}
	}
	if se.Reason == ReasonCurrency {
		attrs = append(attrs, "windows_restored", total(n))
		p.o.Logger.Error("spend not restored from the state file: every spend budget starts empty; token budgets and request rates were restored", attrs...)
		return se
	}
	p.o.Logger.Error("state not restored: every budget starts empty", attrs...)
	return se
}

func total(n Restored) int {
	t := 0
	for _, v := range n {
		t += v
	}
	return t
}

// Start writes the state every interval until Close.
func (p *Persister) Start() {
	p.startOnce.Do(func() { go p.loop() })
}

func (p *Persister) loop() {
	defer close(p.done)
	t := time.NewTicker(p.o.Interval)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			_ = p.Save()
		}
	}
}

// Save writes the Source's state now, unless the file already holds it.
func (p *Persister) Save() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.o.Now()
	data, err := Encode(p.o.Source.SaveState(now))
	if err == nil && p.last != nil && bytes.Equal(data, p.last) {
		p.met.writes.WithLabelValues("unchanged").Inc()
		p.met.saved.Set(float64(now.UnixNano()) / 1e9)
		return nil
	}
	if err == nil {
		err = writeAtomic(p.o.Path, data)
	}
	if err != nil {
		p.met.writes.WithLabelValues("error").Inc()
		if !p.failing {
			p.o.Logger.Error("cannot write the state file: what budgets counted since its last write is lost if the process stops now",
				"file", p.o.Path, "error", err.Error())
		}
		p.failing = true
		return err
	}
	if p.failing {
		p.o.Logger.Info("state file written again", "file", p.o.Path)
	}
	p.failing = false
	p.last = data
	p.met.writes.WithLabelValues("ok").Inc()
	p.met.saved.Set(float64(now.UnixNano()) / 1e9)
	return nil
}

// Close stops the interval writes and writes the state a last time; call it once nothing can
// reserve or settle any more (after the streams drained), so that the file is exact.
func (p *Persister) Close() error {
	p.mu.Lock()
	closed := p.closed
	p.closed = true
	p.mu.Unlock()
	if closed {
		return nil
	}
	close(p.stop)
	// Not started: nothing to wait for.
	p.startOnce.Do(func() { close(p.done) })
	<-p.done
	return p.Save()
}
