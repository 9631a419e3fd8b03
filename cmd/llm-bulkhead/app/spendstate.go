package app

import (
	"errors"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// spendStatePath is the spend state file: the --spend-state flag's, else the policy's
// spend.state_file; empty keeps spend in memory only.
func (a *App) spendStatePath(p *config.Policy) string {
	if a.opts.SpendState != "" {
		return a.opts.SpendState
	}
	return p.Spend.StateFile
}

// openSpendState restores spend from the state file, before any request is served, and
// prepares its interval writes. A file that cannot be used is logged, counted and kept aside;
// spend then starts empty and the process serves.
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
	a.spendState = spend.NewPersister(spend.PersistOptions{
		Path: path, Interval: p.Spend.StateInterval.D(), Source: a.engine.Ledger(), Now: now,
		Logger: a.log, Registerer: a.registry,
	})
	_ = a.spendState.Restore()
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
	return out
}
