package app

import (
	_ "embed"
	"net/http"
)

//go:embed dashboard.html
var dashboardHTML []byte

// dashboard serves the live HTML dashboard: compartments as bars, breakers, refusals over time,
// spend budgets, the top tenants and models of a usage window, and whether limits are shared
// across replicas (cluster mode). The page polls the admin JSON
// endpoints; it needs nothing from outside the listener.
func (a *App) dashboard(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Security-Policy", "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'")
	_, _ = w.Write(dashboardHTML)
}
