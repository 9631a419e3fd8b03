package config

import "time"

// DefaultStateInterval is how often the state file is written by default.
const DefaultStateInterval = 10 * time.Second

// Bounds of state.interval.
const (
	minStateInterval = time.Second
	maxStateInterval = time.Hour
)

// Values of state.on_error.
const (
	// OnStateErrorEmpty starts every budget empty when the state file cannot be used.
	OnStateErrorEmpty = "empty"
	// OnStateErrorRefuse does not start when the state file cannot be used.
	OnStateErrorRefuse = "refuse"
)

// State sets where a single process keeps what its budgets counted across restarts.
type State struct {
	// File is the file that keeps, across restarts of a single process, every window its
	// budgets count: each compartment's tokens_per_minute, tokens_per_day and
	// requests_per_minute (what it counted in each of the 60 steps of the window, with their
	// place in time, so that a restart resumes the sliding window exactly and what aged out while
	// the process was down is gone) and the spend of every spend budget's current window. It is
	// written atomically (a temporary file in the same directory, synced and renamed over it)
	// every interval and once more at shutdown, after the streams drained, and read at start
	// (never by a reload: a running process replaces a damaged file at its next write). A
	// process killed without a shutdown loses at most one interval of charges and settlements;
	// requests in flight when it was written count as they were reserved (their settlement never
	// comes). Each restored window replaces what that window held, under the running policy: a
	// changed capacity applies to what was counted (a sum above a lowered capacity is debt that
	// ages out as it was charged), a window whose compartment or limit the policy no longer has
	// (a removed feature, a family keyed otherwise, a tenant its where no longer admits) is
	// dropped, and a tenant's windows wait for its next request, so a restart does not take the
	// places of max_instances. A missing file starts every budget empty (logged and counted as
	// missing); one that is unreadable, corrupt or of another version is logged at error level
	// and counted (llm_bulkhead_spend_state_restore_failures_total), and then, as on_error says,
	// kept aside as <file>.bad-<time> with every budget started empty, or the start refused. A
	// file whose spend is counted in another currency than the policy's restores its token and
	// request windows and no spend. A file of the spend-only format earlier versions wrote (with
	// spend.state_file) is read as well. The --state-file flag overrides it. Not allowed with a
	// cluster backend: Redis keeps every window there, shared by the replicas. Takes effect on
	// restart. Default empty: budgets are kept in memory only. Was spend.state_file, which is
	// still read.
	File string `koanf:"file" json:"file,omitempty"`
	// Interval is how often the state file is written while the process runs, from 1s to 1h:
	// the most a crash can lose of what budgets counted. Takes effect on restart. Default 10s.
	// Was spend.state_interval, which is still read.
	Interval Duration `koanf:"interval" json:"interval,omitempty"`
	// OnError says what a start does when the state file exists but cannot be used (it cannot be
	// read, it is cut short or corrupt, of another version, or its spend is counted in another
	// currency than the policy's): empty starts every budget it could not restore at zero (the
	// file is kept aside as <file>.bad-<time>, and the failure logged and counted), refuse does
	// not start: the process exits with status 2 naming the file and why, and leaves the file
	// where it is for an operator to mend, move or delete. A file that does not exist (the first
	// start) starts empty either way. Takes effect on restart: the file is read only at start,
	// never by a reload. Default empty. Was spend.on_state_error, which is still read.
	OnError string `koanf:"on_error" json:"on_error,omitempty"`
}

// SpendState sets how spend budgets treat a request whose worst case is more than a whole
// budget, and holds the names the state file's keys had when it kept spend only.
type SpendState struct {
	// StateFile is the former name of state.file, read when state.file is not set. Setting both
	// to different files is an error.
	StateFile string `koanf:"state_file" json:"state_file,omitempty"`
	// StateInterval is the former name of state.interval, read when state.interval is not set.
	// Setting both to different intervals is an error.
	StateInterval Duration `koanf:"state_interval" json:"state_interval,omitempty"`
	// OnStateError is the former name of state.on_error, read when state.on_error is not set.
	// Setting both to different values is an error.
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

// applyDefaults takes each key of the state file from its former name under spend when the
// state section does not set it, then fills the defaults.
func (s *State) applyDefaults(old SpendState) {
	s.File = orString(s.File, old.StateFile)
	orDuration(&s.Interval, old.StateInterval.D())
	orDuration(&s.Interval, DefaultStateInterval)
	s.OnError = orString(s.OnError, old.OnStateError)
	s.OnError = orString(s.OnError, OnStateErrorEmpty)
}

// state checks the state section, and that the former names under spend agree with it.
func (v *validator) state() {
	s, old := v.p.State, v.p.Spend
	if d := s.Interval.D(); d < minStateInterval || d > maxStateInterval {
		path := "state.interval"
		if old.StateInterval == s.Interval {
			path = "spend.state_interval"
		}
		v.add(path, "must be from %s to %s, got %s", minStateInterval, maxStateInterval, s.Interval)
	}
	onError := "state.on_error"
	if old.OnStateError == s.OnError {
		onError = "spend.on_state_error"
	}
	v.oneOf(onError, s.OnError, []string{OnStateErrorEmpty, OnStateErrorRefuse})
	if old.StateFile != "" && old.StateFile != s.File {
		v.add("spend.state_file", "is %q but state.file is %q: set state.file only (spend.state_file is its former name)", old.StateFile, s.File)
	}
	if old.StateInterval != 0 && old.StateInterval != s.Interval {
		v.add("spend.state_interval", "is %s but state.interval is %s: set state.interval only (spend.state_interval is its former name)", old.StateInterval, s.Interval)
	}
	if old.OnStateError != "" && old.OnStateError != s.OnError {
		v.add("spend.on_state_error", "is %q but state.on_error is %q: set state.on_error only (spend.on_state_error is its former name)", old.OnStateError, s.OnError)
	}
	if s.File != "" && v.p.Cluster.Enabled() {
		path := "state.file"
		if old.StateFile == s.File {
			path = "spend.state_file"
		}
		v.add(path, "is set but cluster.backend shares every budget through Redis, which keeps them: remove it")
	}
}
