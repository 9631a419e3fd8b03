package app

import (
	"errors"
	"fmt"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/statefile"
)

// statePath is the state file: the --state-file flag's, else the policy's state.file (or its
// former name, spend.state_file); empty keeps every budget in memory only.
func (a *App) statePath(p *config.Policy) string {
	if a.opts.StateFile != "" {
		return a.opts.StateFile
	}
	return p.State.File
}

// StateFileError is a state file that exists but cannot be used while the policy says
// state.on_error: refuse; the process exits with status 2 for it.
type StateFileError struct {
	// Path is the state file.
	Path string
	Err  *statefile.StateError
}

func (e *StateFileError) Error() string {
	return fmt.Sprintf("state file %s cannot be used (%v) and state.on_error is refuse: mend, move or delete it, or set on_error: empty to start with every budget it cannot restore empty", e.Path, e.Err)
}

func (e *StateFileError) Unwrap() error { return e.Err }

// openState restores every budget's windows from the state file, before any request is served,
// and prepares its interval writes. A file that cannot be used is logged and counted; then, as
// state.on_error says, it is kept aside and the budgets start empty, or New fails with a
// *StateFileError (a missing file starts empty either way: it is the first start).
func (a *App) openState(p *config.Policy) error {
	path := a.statePath(p)
	if path == "" {
		return nil
	}
	if p.Cluster.Enabled() {
		return &ConfigError{Err: errors.New("--state-file is set but cluster.backend shares every budget through Redis, which keeps them: remove the flag")}
	}
	now := time.Now
	if a.opts.Clock != nil {
		now = a.opts.Clock.Now
	}
	refuse := p.State.OnError == config.OnStateErrorRefuse
	a.state = statefile.NewPersister(statefile.PersistOptions{
		Path: path, Interval: p.State.Interval.D(), Source: a.engine, Now: now,
		Logger: a.log, Registerer: a.registry, Refuse: refuse,
	})
	var se *statefile.StateError
	if err := a.state.Restore(); refuse && errors.As(err, &se) && se.Reason != statefile.ReasonMissing {
		return &StateFileError{Path: path, Err: se}
	}
	return nil
}

// closeState writes the state a last time; call it once every stream has ended, so that the
// file holds every charge and settlement.
func (a *App) closeState() {
	if a.state == nil {
		return
	}
	if err := a.state.Close(); err != nil {
		a.log.Error("could not write the state file at shutdown: what budgets counted since its last write is lost",
			"file", a.statePath(a.current.Load()), "error", err.Error())
		return
	}
	a.log.Info("state file written", "file", a.statePath(a.current.Load()))
}

// stateFixed lists the state file's keys a reload changed that only a restart applies, by the
// name the new policy gives them.
func (a *App) stateFixed(p, cur *config.Policy) []string {
	name := func(key, former string, usesFormer bool) string {
		if usesFormer {
			return former
		}
		return key
	}
	var out []string
	if a.opts.StateFile == "" && p.State.File != cur.State.File {
		out = append(out, name("state.file", "spend.state_file", p.Spend.StateFile != ""))
	}
	if p.State.Interval != cur.State.Interval {
		out = append(out, name("state.interval", "spend.state_interval", p.Spend.StateInterval != 0))
	}
	if p.State.OnError != cur.State.OnError {
		out = append(out, name("state.on_error", "spend.on_state_error", p.Spend.OnStateError != ""))
	}
	return out
}
