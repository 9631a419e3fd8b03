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
	Remaining   json.Number `json:"remaining"`
}

// spendInfo serves GET /admin/spend: every spend budget's current window (limit, settled
// spend, reservations in flight, what is left and when it resets).
func (a *App) spendInfo(w http.ResponseWriter, _ *http.Request) {
	now := a.engine.Now()
	v := a.engine.Snapshot().Spend(now)
	budgets := make([]spendBudgetJSON, 0, len(v.Budgets))
	for _, b := range v.Budgets {
		budgets = append(budgets, spendBudgetJSON{
			Budget: b.Budget, Period: b.Period,
			WindowStart: b.Start.Format(time.RFC3339), WindowEnd: b.End.Format(time.RFC3339),
			ResetIn:  int64(math.Ceil(max(b.End.Sub(now), 0).Seconds())),
			Limit:    amount(b.Limit),
			Spent:    amount(b.Spent),
			Reserved: amount(b.Reserved), Remaining: amount(b.Limit - b.Spent - b.Reserved),
		})
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"currency":  v.Currency,
		"time_zone": v.TimeZone,
		"now":       now.Format(time.RFC3339),
		"budgets":   budgets,
	})
}

func amount(m spend.Micros) json.Number { return json.Number(m.String()) }
