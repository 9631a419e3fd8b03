package app

import (
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
	"github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

// otherGroup names the row that sums every group not in the top rows.
const otherGroup = "_other"

// usageCountsJSON are the counts of a row or of the totals in GET /admin/usage. Spend is an
// exact decimal in the policy's currency, as in /admin/spend.
type usageCountsJSON struct {
	Requests         uint64            `json:"requests"`
	PromptTokens     uint64            `json:"prompt_tokens"`
	CompletionTokens uint64            `json:"completion_tokens"`
	CachedTokens     uint64            `json:"cached_tokens"`
	Tokens           uint64            `json:"tokens"`
	Spend            json.Number       `json:"spend"`
	Refused          uint64            `json:"refused"`
	Refusals         map[string]uint64 `json:"refusals"`
}

// usageRowJSON is one group in GET /admin/usage: its tenant, its model or both (as the report
// groups), its counts, and how much of its weight may be other groups' (overcount).
type usageRowJSON struct {
	Tenant *string `json:"tenant,omitempty"`
	Model  *string `json:"model,omitempty"`
	usageCountsJSON
	Overcount uint64 `json:"overcount"`
	// Other marks the row of every group not in the top rows; Groups is how many groups with a
	// row in the window's tables it sums (more may have had none).
	Other  bool `json:"other,omitempty"`
	Groups int  `json:"groups,omitempty"`
}

// usageJSON is GET /admin/usage.
type usageJSON struct {
	By     string `json:"by"`
	Window string `json:"window"`
	From   string `json:"from"`
	To     string `json:"to"`
	// Scope says whose usage it is: this process's ("process"), or in cluster mode the fleet's
	// ("fleet", read from Redis) or, asked with scope=replica, this replica's ("replica").
	// ReplicaID is the replica that answered, in cluster mode.
	Scope     string `json:"scope"`
	ReplicaID string `json:"replica_id,omitempty"`
	Currency  string `json:"currency"`
	TableSize int    `json:"table_size"`
	Top       int    `json:"top"`
	// MaxOvercount bounds every row's overcount.
	MaxOvercount uint64          `json:"max_overcount"`
	Totals       usageCountsJSON `json:"totals"`
	Rows         []usageRowJSON  `json:"rows"`
}

func usageCounts(c *usage.Counts, reasons []string) usageCountsJSON {
	out := usageCountsJSON{Requests: c.Requests, PromptTokens: c.Prompt, CompletionTokens: c.Completion, CachedTokens: c.Cached,
		Tokens: c.Prompt + c.Completion, Spend: amount(c.Spend), Refused: c.RefusalsTotal(), Refusals: map[string]uint64{}}
	for i, name := range reasons {
		if n := c.Refusals[i]; n > 0 {
			out.Refusals[name] = n
		}
	}
	return out
}

// usageInfo serves GET /admin/usage?by=tenant|model|tenant,model&window=1h|24h|7d|month&top=N
// &format=json|csv&scope=fleet|replica: in cluster mode the fleet's usage (from Redis) unless
// scope=replica asks for this replica's own; the top groups of the window by weight with their tokens, requests,
// refusals by reason and spend, the rest summed as _other, and the window's totals.
func (a *App) usageInfo(w http.ResponseWriter, r *http.Request) {
	params, err := usage.ParseParams(r.URL.Query())
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
		return
	}
	tr := a.engine.Usage()
	now := a.engine.Now()
	st := a.engine.Cluster()
	scope := "process"
	var (
		rep usage.Report
		ok  bool
	)
	switch {
	case st == nil && params.Scope != "":
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "scope=" + params.Scope + " applies in cluster mode: this process counts alone"})
		return
	case st != nil && params.Scope != usage.ScopeReplica:
		scope = usage.ScopeFleet
		var err error
		rep, _, err = a.engine.FleetUsage(r.Context(), params.Query)
		switch {
		case errors.Is(err, cluster.ErrUsageOff):
		case err != nil:
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "the fleet's usage cannot be read from Redis (" + err.Error() +
				"): ask with scope=replica for what this replica counted"})
			return
		default:
			ok = true
			now = rep.To
		}
	default:
		if st != nil {
			scope = usage.ScopeReplica
		}
		rep, ok = tr.Report(now, params.Query)
	}
	if !ok {
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "usage is not counted: the policy sets usage.enabled: false"})
		return
	}
	if params.Format == usage.FormatCSV {
		a.usageCSV(w, rep, tr.Reasons())
		return
	}
	reasons := tr.Reasons()
	out := usageJSON{By: rep.By.String(), Window: rep.Window.String(), From: rep.From.UTC().Format(time.RFC3339), To: now.UTC().Format(time.RFC3339),
		Scope: scope, Currency: a.current.Load().Currency, TableSize: rep.TableSize, Top: params.Top, MaxOvercount: rep.MaxOvercount,
		Totals: usageCounts(&rep.Total, reasons), Rows: make([]usageRowJSON, 0, len(rep.Rows)+1)}
	if st != nil {
		out.ReplicaID = st.ReplicaID()
	}
	named := func(by usage.By, k usage.Key) usageRowJSON {
		var row usageRowJSON
		if by != usage.ByModel {
			row.Tenant = &k.Tenant
		}
		if by != usage.ByTenant {
			row.Model = &k.Model
		}
		return row
	}
	for i := range rep.Rows {
		row := named(rep.By, rep.Rows[i].Key)
		row.usageCountsJSON = usageCounts(&rep.Rows[i].Counts, reasons)
		row.Overcount = rep.Rows[i].Overcount
		out.Rows = append(out.Rows, row)
	}
	if rep.OtherGroups > 0 || !rep.Other.IsZero() {
		row := named(rep.By, usage.Key{Tenant: otherGroup, Model: otherGroup})
		row.usageCountsJSON = usageCounts(&rep.Other, reasons)
		row.Other, row.Groups = true, rep.OtherGroups
		out.Rows = append(out.Rows, row)
	}
	writeJSON(w, http.StatusOK, out)
}

// usageCSV writes a report as CSV: a header, a line per row, then _other. A name that a
// spreadsheet would read as a formula (starting with =, +, -, @, a tab or a carriage return)
// is written after a single quote: a model name is whatever a client sent.
func (a *App) usageCSV(w http.ResponseWriter, rep usage.Report, reasons []string) {
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Disposition", fmt.Sprintf(`attachment; filename="usage-%s-by-%s.csv"`, rep.Window, strings.ReplaceAll(rep.By.String(), ",", "-")))
	w.WriteHeader(http.StatusOK)
	cw := csv.NewWriter(w)
	var head []string
	if rep.By != usage.ByModel {
		head = append(head, "tenant")
	}
	if rep.By != usage.ByTenant {
		head = append(head, "model")
	}
	head = append(head, "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "tokens", "spend", "refused")
	for _, r := range reasons {
		head = append(head, "refused_"+r)
	}
	head = append(head, "overcount")
	_ = cw.Write(head)
	line := func(k usage.Key, c *usage.Counts, overcount uint64) {
		var rec []string
		if rep.By != usage.ByModel {
			rec = append(rec, csvSafe(k.Tenant))
		}
		if rep.By != usage.ByTenant {
			rec = append(rec, csvSafe(k.Model))
		}
		u := func(n uint64) string { return strconv.FormatUint(n, 10) }
		rec = append(rec, u(c.Requests), u(c.Prompt), u(c.Completion), u(c.Cached), u(c.Prompt+c.Completion), c.Spend.String(), u(c.RefusalsTotal()))
		for i := range reasons {
			rec = append(rec, u(c.Refusals[i]))
		}
		_ = cw.Write(append(rec, u(overcount)))
	}
	for i := range rep.Rows {
		line(rep.Rows[i].Key, &rep.Rows[i].Counts, rep.Rows[i].Overcount)
	}
	if rep.OtherGroups > 0 || !rep.Other.IsZero() {
		line(usage.Key{Tenant: otherGroup, Model: otherGroup}, &rep.Other, 0)
	}
	cw.Flush()
}

// csvSafe keeps a spreadsheet from reading s as a formula.
func csvSafe(s string) string {
	if s != "" && strings.ContainsRune("=+-@\t\r", rune(s[0])) {
		return "'" + s
	}
	return s
}
