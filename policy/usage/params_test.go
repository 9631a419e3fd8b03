package usage

import (
	"net/url"
	"strings"
	"testing"
)

func TestParseParams(t *testing.T) {
	good := []struct {
		query string
		want  Params
	}{
		{"", Params{Query: Query{By: ByTenant, Window: Day, Top: DefaultTop}, Format: FormatJSON}},
		{"by=model&window=1h&top=5&format=csv", Params{Query: Query{By: ByModel, Window: Hour, Top: 5}, Format: FormatCSV}},
		{"by=tenant,model&window=7d&top=1000", Params{Query: Query{By: ByTenantModel, Window: Week, Top: 1000}, Format: FormatJSON}},
		{"by=model%2Ctenant&window=month&top=1", Params{Query: Query{By: ByTenantModel, Window: Month, Top: 1}, Format: FormatJSON}},
		{"scope=fleet", Params{Query: Query{By: ByTenant, Window: Day, Top: DefaultTop}, Format: FormatJSON, Scope: ScopeFleet}},
		{"scope=replica&by=model", Params{Query: Query{By: ByModel, Window: Day, Top: DefaultTop}, Format: FormatJSON, Scope: ScopeReplica}},
	}
	for _, g := range good {
		v, err := url.ParseQuery(g.query)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ParseParams(v)
		if err != nil || got != g.want {
			t.Errorf("%q: %+v, %v; want %+v", g.query, got, err, g.want)
		}
	}
	bad := []struct{ query, want string }{
		{"by=feature", `by="feature": group by tenant, model or tenant,model`},
		{"by=Tenant", `by="Tenant"`},
		{"by=tenant,tenant", `by="tenant,tenant"`},
		{"window=2h", `window="2h": the windows are 1h, 24h, 7d and month`},
		{"window=", `window="": the windows are`},
		{"top=0", `top="0": give a whole number from 1 to 1000`},
		{"top=1001", `top="1001"`},
		{"top=-3", `top="-3"`},
		{"top=ten", `top="ten"`},
		{"format=xml", `format="xml": the formats are json and csv`},
		{"scope=process", `scope="process": the scopes are fleet and replica`},
		{"window=1h&window=24h", "parameter window is given 2 times: give it once"},
		{"tenant=acme", `unknown parameter "tenant": the parameters are by, window, top, format and scope`},
	}
	for _, b := range bad {
		v, _ := url.ParseQuery(b.query)
		if _, err := ParseParams(v); err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("%q: %v, want an error saying %q", b.query, err, b.want)
		}
	}
}

// FuzzParseParams: any query string is either refused with an error or read into parameters
// that name a grouping, a window, a top within bounds and a format.
func FuzzParseParams(f *testing.F) {
	for _, q := range []string{"", "by=tenant,model&window=7d&top=3&format=csv", "top=99999999999999999999", "by=%00", "window=1h&window=1h", "x=1"} {
		f.Add(q)
	}
	f.Fuzz(func(t *testing.T, q string) {
		v, err := url.ParseQuery(q)
		if err != nil {
			return
		}
		p, err := ParseParams(v)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("an empty error")
			}
			return
		}
		if p.By >= numBy || p.Window >= numWindows || p.Top < 1 || p.Top > MaxTop || (p.Format != FormatJSON && p.Format != FormatCSV) {
			t.Fatalf("%q read as %+v", q, p)
		}
	})
}
