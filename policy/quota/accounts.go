package quota

import (
	"slices"
	"strings"
	"sync"
)

// OtherAccount is the account the requests of accounts beyond a provider's max_accounts share.
const OtherAccount = "_other"

// Accounts is one provider's trackers, one per account (API key) its requests use, each
// following what the responses of that account's requests say. At most max accounts get a
// tracker of their own; the requests of any account beyond them share the tracker of
// OtherAccount (the values accounts take come from requests: they never grow the set without
// bound). Safe for concurrent use; finding the tracker of a known account does not allocate.
type Accounts struct {
	max int
	mu  sync.RWMutex
	by  map[string]*Tracker
	// other is OtherAccount's tracker, created with the first account beyond max.
	other *Tracker
}

// NewAccounts returns a provider's account trackers, at most max of them (at least 1) apart
// from OtherAccount's.
func NewAccounts(n int) *Accounts {
	return &Accounts{max: max(n, 1), by: map[string]*Tracker{}}
}

// Max returns how many accounts get a tracker of their own.
func (a *Accounts) Max() int { return a.max }

// Tracker returns the tracker of account name, creating it when the set has room; beyond it
// (other) the request shares OtherAccount's tracker, and first is true the first time a
// request does.
func (a *Accounts) Tracker(name string) (t *Tracker, other, first bool) {
	if name != OtherAccount {
		a.mu.RLock()
		t = a.by[name]
		a.mu.RUnlock()
		if t != nil {
			return t, false, false
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if t = a.by[name]; t != nil {
		return t, false, false
	}
	if name != OtherAccount && len(a.by) < a.max {
		t = &Tracker{}
		a.by[name] = t
		return t, false, false
	}
	if a.other == nil {
		a.other = &Tracker{}
		first = true
	}
	return a.other, true, first
}

// Account is one account's tracker, as Each lists it.
type Account struct {
	Name    string
	Tracker *Tracker
}

// Each returns every account that has a tracker, by name (OtherAccount's among them once an
// account beyond max has been seen).
func (a *Accounts) Each() []Account {
	a.mu.RLock()
	out := make([]Account, 0, len(a.by)+1)
	for name, t := range a.by {
		out = append(out, Account{name, t})
	}
	if a.other != nil {
		out = append(out, Account{OtherAccount, a.other})
	}
	a.mu.RUnlock()
	slices.SortFunc(out, func(x, y Account) int { return strings.Compare(x.Name, y.Name) })
	return out
}
