package policy

import (
	"fmt"
	"sort"
	"strings"
)

// Diff summarises what a reload changed, by compartment instance name, and the policy-wide
// settings of spend budgets that changed (time_zone, currency, spend.allow_single_overrun).
type Diff struct {
	Added, Removed, Changed []string
	// Settings describes each policy-wide setting that changed, e.g. "time_zone UTC →
	// Asia/Kathmandu (spend carried into 2 windows of the new zone)".
	Settings []string
}

// String formats the diff as one log-friendly line.
func (d Diff) String() string {
	part := func(label string, names []string) string {
		if len(names) == 0 {
			return label + ": none"
		}
		return label + ": " + strings.Join(names, ", ")
	}
	out := part("added", d.Added) + "; " + part("removed", d.Removed) + "; " + part("changed", d.Changed)
	if len(d.Settings) > 0 {
		out += "; " + part("settings", d.Settings)
	}
	return out
}

// diffSnapshots says what changed from prev to next.
func diffSnapshots(prev, next *Snapshot) Diff {
	var d Diff
	if prev == nil {
		for _, in := range next.staticInstances() {
			d.Added = append(d.Added, in.name)
		}
		return d
	}
	old := map[string]*instance{}
	for _, in := range prev.staticInstances() {
		old[in.name] = in
	}
	for _, in := range next.staticInstances() {
		o, ok := old[in.name]
		switch {
		case !ok:
			d.Added = append(d.Added, in.name)
		case o.limits != in.limits:
			d.Changed = append(d.Changed, in.name)
		}
		delete(old, in.name)
	}
	for name := range old {
		d.Removed = append(d.Removed, name)
	}
	sort.Strings(d.Removed)
	d.Settings = settingsDiff(prev, next)
	return d
}

// settingsDiff describes the policy-wide spend settings next changed from prev.
func settingsDiff(prev, next *Snapshot) []string {
	a, b := prev.policy, next.policy
	var out []string
	if a.TimeZone != b.TimeZone {
		what := fmt.Sprintf("time_zone %s → %s", a.TimeZone, b.TimeZone)
		switch {
		case !b.AnySpendLimits():
		case next.spendCarryErr != nil:
			what += " (the spend of the current windows is carried into the new zone's once the spend store answers)"
		default:
			// Another replica may have carried the shared windows already: none changed then.
			what += fmt.Sprintf(" (spend of the current windows carried into the new zone's: %d windows changed)", next.spendCarried)
		}
		out = append(out, what)
	}
	if a.Currency != b.Currency {
		out = append(out, fmt.Sprintf("currency %s → %s (amounts already counted are kept as they are)", a.Currency, b.Currency))
	}
	if a.Spend.AllowSingleOverrun != b.Spend.AllowSingleOverrun {
		out = append(out, fmt.Sprintf("spend.allow_single_overrun %t → %t", a.Spend.AllowSingleOverrun, b.Spend.AllowSingleOverrun))
	}
	return out
}
