package app

import (
	"errors"
	"fmt"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/statefile"
)

// spendStatePath is the spend state file: the --spend-state flag's, else the policy's
// spend.state_file; empty keeps spend in memory only.
func (a *App) spendStatePath(p *config.Policy) string {
	if a.opts.SpendState != "" {
		return a.opts.SpendState
	}
	return p.Spend.StateFile
}

// SpendStateError is a spend state file that exists but cannot be used while the policy says
// spend.on_state_error: refuse; the process exits with status 2 for it.
type SpendStateError struct {
	// Path is the state file.
	Path string
	Err  *statefile.StateError
}

func (e *SpendStateError) Error() string {
	return fmt.Sprintf("spend state file %s cannot be used (%v) and spend.on_state_error is refuse: mend, move or delete it, or set on_state_error: empty to start with every spend budget empty", e.Path, e.Err)
}

func (e *SpendStateError) Unwrap() error { return e.Err }

// openSpendState restores spend from the state file, before any request is served, and
// prepares its interval writes. A file that cannot be used is logged and counted; then, as
// spend.on_state_error says, it is kept aside and spend starts empty, or New fails with a
// *SpendStateError (a missing file starts empty either way: it is the first start).
func (a *App) openSpendState(p *config.Policy) error {
	path := a.spendStatePath(p)
	if path == "" {
		return nil
	}
	if p.Cluster.Enabled() {
		return &ConfigError{Err: errors.New("--spend-state is set but cluster.backend shares spend through Redis, which keeps it: remove the flag")}
	}
	now := time.Now
	if a.opts.Clock != nil {
		now = a.opts.Clock.Now
	}
	refuse := p.Spend.OnStateError == config.OnStateErrorRefuse
	a.spendState = statefile.NewPersister(statefile.PersistOptions{
		Path: path, Interval: p.Spend.StateInterval.D(), Source: a.engine, Now: now,
		Logger: a.log, Registerer: a.registry, Refuse: refuse,
	})
	var se *statefile.StateError
	if err := a.spendState.Restore(); refuse && errors.As(err, &se) && se.Reason != statefile.ReasonMissing {
		return &SpendStateError{Path: path, Err: se}
	}
	return nil
}

// closeSpendState writes the spend state a last time; call it once every stream has ended, so
// that the file holds every settlement.
func (a *App) closeSpendState() {
	if a.spendState == nil {
		return
	}
	if err := a.spendState.Close(); err != nil {
		a.log.Error("could not write the spend state file at shutdown: spend settled since its last write is lost",
			"file", a.spendStatePath(a.current.Load()), "error", err.Error())
		return
	}
	a.log.Info("spend state written", "file", a.spendStatePath(a.current.Load()))
}

// spendStateFixed lists the spend keys a reload changed that only a restart applies.
func (a *App) spendStateFixed(p, cur *config.Policy) []string {
	var out []string
	if a.opts.SpendState == "" && p.Spend.StateFile != cur.Spend.StateFile {
		out = append(out, "spend.state_file")
	}
	if p.Spend.StateInterval != cur.Spend.StateInterval {
		out = append(out, "spend.state_interval")
	}
	if p.Spend.OnStateError != cur.Spend.OnStateError {
		out = append(out, "spend.on_state_error")
	}
	return out
}
