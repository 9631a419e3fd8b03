package app

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"net/http"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

type appMetrics struct {
	reloads      *prometheus.CounterVec
	reloadErrors prometheus.Counter
	lastReload   prometheus.Gauge
}

func newAppMetrics(reg prometheus.Registerer) *appMetrics {
	ns := policy.Namespace
	m := &appMetrics{
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "config_reloads_total",
			Help: "Policy reload attempts, by result (success, error)."}, []string{"result"}),
		reloadErrors: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "config_reload_errors_total",
			Help: "Policy reloads refused because the new file was invalid; the running policy stayed."}),
		lastReload: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "config_last_reload_success_timestamp_seconds",
			Help: "Unix time of the last successful policy load."}),
	}
	m.lastReload.SetToCurrentTime()
	reg.MustRegister(m.reloads, m.reloadErrors, m.lastReload)
	return m
}

// adminHandler serves the admin endpoints. GET endpoints are open (the listener is loopback by
// default); POST endpoints need the admin token.
func (a *App) adminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(a.registry, promhttp.HandlerOpts{Registry: a.registry}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		writeText(w, http.StatusOK, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if a.Ready() {
			writeText(w, http.StatusOK, "ready\n")
			return
		}
		if a.draining.Load() {
			writeText(w, http.StatusServiceUnavailable, "draining\n")
			return
		}
		writeText(w, http.StatusServiceUnavailable, "not ready\n")
	})
	mux.HandleFunc("GET /admin/compartments", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{
			"generation":   a.engine.Snapshot().Gen(),
			"in_flight":    a.engine.InFlight(),
			"compartments": a.engine.Compartments(),
		})
	})
	mux.HandleFunc("GET /admin/decisions", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"features": a.engine.Decisions()})
	})
	mux.HandleFunc("GET /admin/breakers", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"breakers": a.engine.Breakers()})
	})
	mux.HandleFunc("POST /admin/breakers/{name...}", a.forceBreaker)
	mux.HandleFunc("GET /admin/config", func(w http.ResponseWriter, r *http.Request) {
		// The addresses actually bound, not the policy's: flags override those, and port 0 in
		// either picks a free port. The copy is shallow; only its Server strings change.
		p := *a.current.Load()
		p.Server.GRPCAddr, p.Server.AdminAddr = a.GRPCAddr(), a.AdminAddr()
		writeJSON(w, http.StatusOK, map[string]any{
			"source":     a.policyName,
			"generation": a.engine.Snapshot().Gen(),
			"policy":     &p,
		})
	})
	mux.HandleFunc("GET /{$}", a.dashboard)
	return mux
}

// forceBreaker handles POST /admin/breakers/{name} with a JSON body {"state": "FORCED_OPEN"} (or
// DISABLED, METRICS_ONLY, CLOSED, OPEN, HALF_OPEN), authorised by "Authorization: Bearer <token>".
func (a *App) forceBreaker(w http.ResponseWriter, r *http.Request) {
	if !a.authorised(r) {
		writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "admin token required: set " + a.current.Load().Admin.TokenEnv + " on the server and send Authorization: Bearer <token>"})
		return
	}
	var body struct {
		State string `json:"state"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&body); err != nil || body.State == "" {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": `send a JSON body like {"state": "FORCED_OPEN"}`})
		return
	}
	name := r.PathValue("name")
	if err := a.engine.ForceBreaker(name, strings.ToUpper(body.State)); err != nil {
		status := http.StatusBadRequest
		if errors.Is(err, policy.ErrNoSuchBreaker) {
			status = http.StatusNotFound
		}
		writeJSON(w, status, map[string]string{"error": err.Error()})
		return
	}
	for _, b := range a.engine.Breakers() {
		if b.Name == name {
			writeJSON(w, http.StatusOK, b)
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]string{"breaker": name})
}

func (a *App) authorised(r *http.Request) bool {
	if a.adminToken == "" {
		return false
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(got), []byte(a.adminToken)) == 1
}

func writeText(w http.ResponseWriter, status int, s string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(s))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
