package config

import "time"

// DefaultSpendStateInterval is how often the spend state file is written by default.
const DefaultSpendStateInterval = 10 * time.Second

// Bounds of spend.state_interval.
const (
	minSpendStateInterval = time.Second
	maxSpendStateInterval = time.Hour
)

// Values of spend.on_state_error.
const (
	// OnStateErrorEmpty starts spend budgets empty when the state file cannot be used.
	OnStateErrorEmpty = "empty"
	// OnStateErrorRefuse does not start when the state file cannot be used.
	OnStateErrorRefuse = "refuse"
)

// SpendState sets where a single process keeps spend across restarts, and how spend budgets
// treat a request whose worst case is more than a whole budget.
type SpendState struct {
	// StateFile is the file that keeps the spend of every budget's current window across
	// restarts of a single process. It is written atomically (a temporary file in the same
	// directory, synced and renamed over it) every state_interval and once more at shutdown,
	// after the streams drained, and read at start (never by a reload: a running process
	// replaces a damaged file at its next write). A process killed without a shutdown loses at
	// most the settlements of one state_interval; requests in flight when it was written are
	// restored as spent at their reservation (their settlement never comes). A missing file
	// starts spend empty (logged and counted as missing); one that is unreadable, corrupt or of
	// another version or currency is logged at error level and counted
	// (llm_bulkhead_spend_state_restore_failures_total), and then, as on_state_error says, kept
	// aside as <file>.bad-<time> with spend started empty, or the start refused. The
	// --spend-state flag overrides it. Not allowed with a cluster backend: Redis keeps spend
	// there. Takes effect on restart. Default empty: spend is kept in memory only.
	StateFile string `koanf:"state_file" json:"state_file,omitempty"`
	// StateInterval is how often the state file is written while the process runs, from 1s to
	// 1h: the most settled spend a crash can lose. Takes effect on restart. Default 10s.
	StateInterval Duration `koanf:"state_interval" json:"state_interval,omitempty"`
	// OnStateError says what a start does when the state file exists but cannot be used (it
	// cannot be read, it is cut short or corrupt, of another version, or counted in another
	// currency than the policy's): empty starts every spend budget at zero (the file is kept
	// aside as <file>.bad-<time>, and the failure logged and counted), refuse does not start:
	// the process exits with status 2 naming the file and why, and leaves the file where it is
	// for an operator to mend, move or delete. A file that does not exist (the first start)
	// starts empty either way. Takes effect on restart: the file is read only at start, never
	// by a reload. Default empty.
	OnStateError string `koanf:"on_state_error" json:"on_state_error,omitempty"`
	// AllowSingleOverrun lets one request whose worst-case cost is more than a whole spend
	// budget run in a window in which nothing has been spent or reserved yet (it may then spend
	// up to its worst case, beyond the limit; everything after it is refused until the window
	// resets). Without it such a request is refused with spend_budget like any request whose
	// worst case does not fit what is left: no single request ever overruns a budget. It
	// applies to every spend budget (hour, day and month, in one process and in cluster mode).
	// Default false.
	AllowSingleOverrun bool `koanf:"allow_single_overrun" json:"allow_single_overrun,omitempty"`
}

func (s *SpendState) applyDefaults() {
	orDuration(&s.StateInterval, DefaultSpendStateInterval)
	s.OnStateError = orString(s.OnStateError, OnStateErrorEmpty)
}

// spendState checks the spend section.
func (v *validator) spendState() {
	s := v.p.Spend
	if d := s.StateInterval.D(); d < minSpendStateInterval || d > maxSpendStateInterval {
		v.add("spend.state_interval", "must be from %s to %s, got %s", minSpendStateInterval, maxSpendStateInterval, s.StateInterval)
	}
	v.oneOf("spend.on_state_error", s.OnStateError, []string{OnStateErrorEmpty, OnStateErrorRefuse})
	if s.StateFile != "" && v.p.Cluster.Enabled() {
		v.add("spend.state_file", "is set but cluster.backend shares spend through Redis, which keeps it: remove state_file")
	}
}
