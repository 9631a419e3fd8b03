package app

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

type appMetrics struct {
	reloads      *prometheus.CounterVec
	reloadErrors prometheus.Counter
	lastReload   prometheus.Gauge
}

func newAppMetrics(reg prometheus.Registerer) *appMetrics {
	ns := observe.Namespace
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

// ExposedAdminError refuses an admin address reachable beyond this machine when no admin token
// is set and --admin-insecure was not given: /admin/config and the dashboard would show the
// policy, its tenants and limits to anyone who can connect. The process exits with status 2.
type ExposedAdminError struct {
	// Addr is the admin address as configured; TokenEnv names the token's environment variable.
	Addr, TokenEnv string
}

func (e *ExposedAdminError) Error() string {
	return fmt.Sprintf("admin address %s is not loopback and %s is empty: set %s to a secret "+
		"(then /admin/* and the dashboard need Authorization: Bearer <token>; /metrics, /healthz and /readyz stay open), "+
		"or pass --admin-insecure to serve it without a token, or listen on 127.0.0.1", e.Addr, e.TokenEnv, e.TokenEnv)
}

// isLoopback reports whether a listener on addr (host:port) is reachable only from this
// machine: 127.0.0.0/8, ::1 or localhost. An empty host, 0.0.0.0 and :: listen on every
// interface; any other name may resolve to one that is reachable.
func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		// Not host:port at all: listening fails with a clearer message than ours.
		return true
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	host, _, _ = strings.Cut(host, "%") // an IPv6 zone names the interface, not the address
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// adminHandler serves the admin endpoints. POST endpoints always need the admin token. GET
// endpoints are open on a loopback listener, for requests whose Host is one of the listener's
// names; on one reachable beyond this machine with a token set, /admin/* and the dashboard need
// it too, while /metrics, /healthz and /readyz stay open, whatever the Host, for Prometheus and
// the kubelet's probes, which do not carry it.
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
	mux.HandleFunc("GET /admin/compartments", a.guardRead(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{
			"generation":   a.engine.Snapshot().Gen(),
			"in_flight":    a.engine.InFlight(),
			"compartments": a.engine.Compartments(),
		})
	}))
	mux.HandleFunc("GET /admin/decisions", a.guardRead(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"features": a.Decisions()})
	}))
	mux.HandleFunc("GET /admin/breakers", a.guardRead(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"breakers": a.engine.Breakers()})
	}))
	mux.HandleFunc("GET /admin/quotas", a.guardRead(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"providers": a.engine.ProviderQuotas()})
	}))
	mux.HandleFunc("POST /admin/breakers/{name...}", a.forceBreaker)
	// Breaker names contain slashes (per-model breakers such as deepseek/deepseek-r*), and a
	// wildcard must end a pattern, so the /events suffix is cut here.
	mux.HandleFunc("GET /admin/breakers/{path...}", a.guardRead(a.breakerEvents))
	mux.HandleFunc("GET /admin/cluster", a.guardRead(a.clusterInfo))
	mux.HandleFunc("GET /admin/spend", a.guardRead(a.spendInfo))
	mux.HandleFunc("GET /admin/usage", a.guardRead(a.usageInfo))
	mux.HandleFunc("GET /admin/config", a.guardRead(func(w http.ResponseWriter, r *http.Request) {
		// The addresses actually bound, not the policy's: flags override those, and port 0 in
		// either picks a free port. The copy is shallow; only its Server strings change.
		p := *a.current.Load()
		p.Server.GRPCAddr, p.Server.AdminAddr = a.GRPCAddr(), a.AdminAddr()
		writeJSON(w, http.StatusOK, map[string]any{
			"source":     a.policyName,
			"generation": a.engine.Snapshot().Gen(),
			"policy":     &p,
		})
	}))
	mux.HandleFunc("GET /{$}", a.guardRead(a.dashboard))
	return mux
}

// guardRead guards a GET endpoint: a request with the admin token is served; without it, the
// request is refused when the listener is reachable beyond this machine (see adminHandler), or
// when its Host is not one of the listener's names (adminhost.go).
func (a *App) guardRead(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !a.authorised(r) {
			if a.guardReads {
				a.unauthorised(w)
				return
			}
			if !a.hostAllowed(r.Host) {
				a.refuseHost(w, r)
				return
			}
		}
		h(w, r)
	}
}

// forceBreaker handles POST /admin/breakers/{name} with a JSON body {"state": "FORCED_OPEN"} (or
// DISABLED, METRICS_ONLY, CLOSED, OPEN, HALF_OPEN), authorised by "Authorization: Bearer <token>".
func (a *App) forceBreaker(w http.ResponseWriter, r *http.Request) {
	if !a.authorised(r) {
		a.unauthorised(w)
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

// breakerEvents handles GET /admin/breakers/{name}/events: the breaker's last transitions and
// threshold breaches with the calls recorded before each.
func (a *App) breakerEvents(w http.ResponseWriter, r *http.Request) {
	name, ok := strings.CutSuffix(r.PathValue("path"), "/events")
	if !ok || name == "" {
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "GET /admin/breakers/{name}/events lists a breaker's events; GET /admin/breakers lists the breakers"})
		return
	}
	events, err := a.engine.BreakerEvents(name)
	if err != nil {
		writeJSON(w, http.StatusNotFound, map[string]string{"error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"breaker": name, "history_size": breaker.HistorySize, "recent_calls": breaker.RecentCalls, "events": events})
}

func (a *App) unauthorised(w http.ResponseWriter) {
	w.Header().Set("WWW-Authenticate", `Bearer realm="llm-bulkhead admin"`)
	writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "admin token required: set " + a.current.Load().Admin.TokenEnv + " on the server and send Authorization: Bearer <token>"})
}

// authorised reports whether r carries the admin token, compared in constant time.
func (a *App) authorised(r *http.Request) bool {
	if a.adminToken == "" {
		return false
	}
	got, ok := bearerToken(r.Header.Get("Authorization"))
	return ok && subtle.ConstantTimeCompare([]byte(got), []byte(a.adminToken)) == 1
}

// bearerToken returns the credentials of an Authorization header value of the Bearer scheme.
// Scheme names are case-insensitive and one or more spaces follow them (RFC 7235 §2.1), so
// "bearer t" and "BEARER  t" carry the token t as "Bearer t" does.
func bearerToken(h string) (string, bool) {
	scheme, token, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimLeft(token, " ")
	return token, token != ""
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
