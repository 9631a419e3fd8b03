package app

import (
	"encoding/json"
	"math"
	"net/http"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// spendBudgetJSON is one spend budget's current window in GET /admin/spend. Amounts are exact
// decimals in the policy's currency.
type spendBudgetJSON struct {
	Budget      string      `json:"budget"`
	Period      string      `json:"period"`
	WindowStart string      `json:"window_start"`
	WindowEnd   string      `json:"window_end"`
	ResetIn     int64       `json:"reset_in_seconds"`
	Limit       json.Number `json:"limit"`
	Spent       json.Number `json:"spent"`
	Reserved    json.Number `json:"reserved"`
	// Leased is, with leased cluster admission, what replicas' chunks of the window hold unused.
	Leased    json.Number `json:"leased,omitempty"`
	Remaining json.Number `json:"remaining"`
	// Local is set in cluster mode: what this replica counted on its own while Redis did not
	// answer.
	Local *spendLocalJSON `json:"local,omitempty"`
}

// spendLocalJSON is what one replica counted in a shared budget's window in its own memory
// because Redis did not answer in time: limit is what it may count so now (its share of what
// Redis last showed left), spent and reserved what it counted, pending what of it Redis has not
// applied yet (included in the budget's spent and reserved).
type spendLocalJSON struct {
	Limit    json.Number `json:"limit"`
	Spent    json.Number `json:"spent"`
	Reserved json.Number `json:"reserved"`
	Pending  json.Number `json:"pending"`
}

// spendInfo serves GET /admin/spend: every spend budget's current window (limit, settled
// spend, reservations in flight, what is left and when it resets) and, in cluster mode, what
// this replica counted in it on its own.
func (a *App) spendInfo(w http.ResponseWriter, _ *http.Request) {
	now := a.engine.Now()
	v := a.engine.Snapshot().Spend(now)
	budgets := make([]spendBudgetJSON, 0, len(v.Budgets))
	for _, b := range v.Budgets {
		j := spendBudgetJSON{
			Budget: b.Budget, Period: b.Period,
			WindowStart: b.Start.Format(time.RFC3339), WindowEnd: b.End.Format(time.RFC3339),
			ResetIn:  int64(math.Ceil(max(b.End.Sub(now), 0).Seconds())),
			Limit:    amount(b.Limit),
			Spent:    amount(b.Spent),
			Reserved: amount(b.Reserved), Remaining: amount(b.Limit - b.Spent - b.Reserved - b.Leased),
		}
		if b.Leased != 0 {
			j.Leased = amount(b.Leased)
		}
		if b.Shared {
			j.Local = &spendLocalJSON{Limit: amount(b.LocalLimit), Spent: amount(b.Local.Spent), Reserved: amount(b.Local.Reserved),
				Pending: amount(b.Local.Pending.Reserved + b.Local.Pending.Settled)}
		}
		budgets = append(budgets, j)
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"currency":  v.Currency,
		"time_zone": v.TimeZone,
		"now":       now.Format(time.RFC3339),
		"budgets":   budgets,
	})
}

func amount(m spend.Micros) json.Number { return json.Number(m.String()) }
