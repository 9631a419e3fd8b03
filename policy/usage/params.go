package usage

import (
	"fmt"
	"net/url"
	"slices"
	"strconv"
)

// Bounds and defaults of a report's top.
const (
	DefaultTop = 20
	MaxTop     = 1000
)

// Scopes of an answer in cluster mode: the fleet's usage, or this replica's own.
const (
	ScopeFleet   = "fleet"
	ScopeReplica = "replica"
)

// Formats of an answer.
const (
	FormatJSON = "json"
	FormatCSV  = "csv"
)

// Params are the parameters of GET /admin/usage.
type Params struct {
	Query
	// Format is FormatJSON or FormatCSV.
	Format string
	// Scope is ScopeFleet, ScopeReplica, or "" when not given.
	Scope string
}

// paramNames are the parameters ParseParams reads.
var paramNames = []string{"by", "window", "top", "format", "scope"}

// ParseParams reads the query parameters of a usage request: by (tenant, model or
// tenant,model; default tenant), window (1h, 24h, 7d or month; default 24h), top (1 to MaxTop;
// default DefaultTop), format (json or csv; default json) and scope (fleet or replica: whose
// usage, in cluster mode; not given: the caller's default). An unknown parameter, one given
// twice, or a value none of these is an error that says what is allowed.
func ParseParams(v url.Values) (Params, error) {
	p := Params{Query: Query{By: ByTenant, Window: Day, Top: DefaultTop}, Format: FormatJSON}
	names := make([]string, 0, len(v))
	for name := range v {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if !slices.Contains(paramNames, name) {
			return Params{}, fmt.Errorf("unknown parameter %s: the parameters are by, window, top, format and scope", strconv.Quote(name))
		}
		if len(v[name]) != 1 {
			return Params{}, fmt.Errorf("parameter %s is given %d times: give it once", name, len(v[name]))
		}
	}
	if s, ok := first(v, "by"); ok {
		b, ok := ParseBy(s)
		if !ok {
			return Params{}, fmt.Errorf("by=%s: group by tenant, model or tenant,model", strconv.Quote(s))
		}
		p.By = b
	}
	if s, ok := first(v, "window"); ok {
		w, ok := ParseWindow(s)
		if !ok {
			return Params{}, fmt.Errorf("window=%s: the windows are 1h, 24h, 7d and month", strconv.Quote(s))
		}
		p.Window = w
	}
	if s, ok := first(v, "top"); ok {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > MaxTop {
			return Params{}, fmt.Errorf("top=%s: give a whole number from 1 to %d", strconv.Quote(s), MaxTop)
		}
		p.Top = n
	}
	if s, ok := first(v, "format"); ok {
		if s != FormatJSON && s != FormatCSV {
			return Params{}, fmt.Errorf("format=%s: the formats are json and csv", strconv.Quote(s))
		}
		p.Format = s
	}
	if s, ok := first(v, "scope"); ok {
		if s != ScopeFleet && s != ScopeReplica {
			return Params{}, fmt.Errorf("scope=%s: the scopes are fleet and replica", strconv.Quote(s))
		}
		p.Scope = s
	}
	return p, nil
}

func first(v url.Values, name string) (string, bool) {
	if s, ok := v[name]; ok {
		return s[0], true
	}
	return "", false
}

// ParseBy reads a grouping: tenant, model, or both joined by a comma in either order.
func ParseBy(s string) (By, bool) {
	switch s {
	case "tenant":
		return ByTenant, true
	case "model":
		return ByModel, true
	case "tenant,model", "model,tenant":
		return ByTenantModel, true
	}
	return 0, false
}

// ParseWindow reads 1h, 24h, 7d or month.
func ParseWindow(s string) (Window, bool) {
	i := slices.Index(windowNames[:], s)
	if i < 0 {
		return 0, false
	}
	return Window(i), true
}
