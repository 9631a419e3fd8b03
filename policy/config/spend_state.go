package config

import "time"

// DefaultSpendStateInterval is how often the spend state file is written by default.
const DefaultSpendStateInterval = 10 * time.Second

// Bounds of spend.state_interval.
const (
	minSpendStateInterval = time.Second
	maxSpendStateInterval = time.Hour
)

// SpendState sets where a single process keeps spend across restarts, and how spend budgets
// treat a request whose worst case is more than a whole budget.
type SpendState struct {
	// StateFile is the file that keeps the spend of every budget's current window across
	// restarts of a single process. It is written atomically (a temporary file in the same
	// directory, synced and renamed over it) every state_interval and once more at shutdown,
	// after the streams drained, and read at start. A process killed without a shutdown loses
	// at most the settlements of one state_interval; requests in flight when it was written are
	// restored as spent at their reservation (their settlement never comes). A file that is
	// missing, unreadable, corrupt or of another version or currency is kept aside as
	// <file>.bad-<time>, logged at error level and counted
	// (llm_bulkhead_spend_state_restore_failures_total), and spend starts empty. The
	// --spend-state flag overrides it. Not allowed with a cluster backend: Redis keeps spend
	// there. Takes effect on restart. Default empty: spend is kept in memory only.
	StateFile string `koanf:"state_file" json:"state_file,omitempty"`
	// StateInterval is how often the state file is written while the process runs, from 1s to
	// 1h: the most settled spend a crash can lose. Takes effect on restart. Default 10s.
	StateInterval Duration `koanf:"state_interval" json:"state_interval,omitempty"`
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
}

// spendState checks the spend section.
func (v *validator) spendState() {
	s := v.p.Spend
	if d := s.StateInterval.D(); d < minSpendStateInterval || d > maxSpendStateInterval {
		v.add("spend.state_interval", "must be from %s to %s, got %s", minSpendStateInterval, maxSpendStateInterval, s.StateInterval)
	}
	if s.StateFile != "" && v.p.Cluster.Enabled() {
		v.add("spend.state_file", "is set but cluster.backend shares spend through Redis, which keeps it: remove state_file")
	}
}
