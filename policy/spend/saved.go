package spend

import (
	"errors"
	"fmt"
	"time"
)

// MaxBudgetName bounds a budget's name in a saved window.
const MaxBudgetName = 4096

// MaxSavedMicros bounds an amount in a saved window: a billion units of currency, far beyond any
// budget.
const MaxSavedMicros = 1_000_000_000 * 1_000_000

// SavedWindow is one budget's current window as a state file keeps it.
type SavedWindow struct {
	// Budget names the budget (its compartment and period) as the ledger does.
	Budget string `json:"budget"`
	// Period is the window's calendar length: "hour", "day" or "month".
	Period string `json:"period"`
	// Start and End bound the window: [Start, End).
	Start time.Time `json:"start"`
	End   time.Time `json:"end"`
	// Settled is the spend settled in the window, in micro-units of the currency.
	Settled int64 `json:"settled_micros"`
	// InFlight is the spend reserved in the window by requests still running when the file was
	// written. It is restored as spent: after a crash their settlements never come, and their
	// reservation is the most they can have cost.
	InFlight int64 `json:"in_flight_micros"`
}

// SavedState is the spend of every budget's current window, in the policy's currency.
type SavedState struct {
	// Currency is the policy's currency when the state was saved; amounts in another currency
	// are not restored.
	Currency string        `json:"currency"`
	Windows  []SavedWindow `json:"windows"`
}

// ErrOtherCurrency is a saved state counted in another currency than the ledger's: its amounts
// would mean something else, and it is not restored.
var ErrOtherCurrency = errors.New("counted in another currency")

// Check reports what makes no sense in w: a name, period, bounds or amount a ledger never saves.
func (w *SavedWindow) Check() error {
	switch {
	case w.Budget == "" || len(w.Budget) > MaxBudgetName:
		return fmt.Errorf("budget name of %d bytes", len(w.Budget))
	case w.Period != "hour" && w.Period != "day" && w.Period != "month":
		return fmt.Errorf("period %q is not hour, day or month", w.Period)
	case !w.Start.Before(w.End):
		return fmt.Errorf("window ends (%s) before it starts (%s)", w.End.Format(time.RFC3339), w.Start.Format(time.RFC3339))
	case w.End.Sub(w.Start) > 31*24*time.Hour+time.Hour:
		return fmt.Errorf("window of %s is longer than a month", w.End.Sub(w.Start))
	case w.Settled < 0 || w.Settled > MaxSavedMicros || w.InFlight < 0 || w.InFlight > MaxSavedMicros:
		return fmt.Errorf("amount out of range (settled %d, in flight %d micro-units)", w.Settled, w.InFlight)
	}
	return nil
}
