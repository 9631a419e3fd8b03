package app

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// Cluster states reported by GET /admin/cluster.
const (
	// clusterOff: no cluster section; every limit is enforced per process.
	clusterOff = "off"
	// clusterShared: limits are shared across replicas through Redis.
	clusterShared = "shared"
	// clusterResyncing: Redis answers, but may not yet count every replica's slots (after an
	// outage or a loss of the shared state): this replica keeps to its part of each
	// concurrency limit until every replica has rewritten its slots.
	clusterResyncing = "resyncing"
	// clusterLocal: Redis is unavailable and this replica enforces its share of every limit.
	clusterLocal = "local"
	// clusterRefusing: Redis is unavailable and admissions are refused (on_unavailable closed).
	clusterRefusing = "refusing"
)

// clusterView is GET /admin/cluster with a cluster: the store's own view (replica, Redis, leases,
// membership) and what admission does now.
type clusterView struct {
	cluster.Info
	// State is shared, resyncing, local or refusing.
	State string `json:"state"`
	// OnUnavailable is cluster.on_unavailable: local or closed.
	OnUnavailable string `json:"on_unavailable"`
	// Share is what every limit is divided by here: 1 while shared, the live replicas last seen
	// while Redis is unavailable with on_unavailable local.
	Share int `json:"share"`
	// Admission is cluster.admission: leased or exact.
	Admission string `json:"admission"`
	// Leases are this replica's leases of its compartments' limits (leased admission).
	Leases []cluster.LeaseInfo `json:"leases,omitempty"`
	// SpendLeases are this replica's chunks of spend windows (leased admission).
	SpendLeases []spendLeaseJSON `json:"spend_leases,omitempty"`
}

// spendLeaseJSON is this replica's chunk of one spend window, in the policy's currency: unused,
// reserved by its requests in flight, and settled here but not yet reported to Redis.
type spendLeaseJSON struct {
	Window   string      `json:"window"`
	Unused   json.Number `json:"unused"`
	InFlight json.Number `json:"in_flight"`
	Pending  json.Number `json:"pending"`
	Tight    bool        `json:"tight,omitempty"`
}

// clusterInfo handles GET /admin/cluster: whether limits are shared across replicas, through
// which Redis, with which replicas, and what this replica enforces while Redis is unavailable.
// Without a cluster it answers {"mode": "off", "state": "off", "share": 1}.
func (a *App) clusterInfo(w http.ResponseWriter, r *http.Request) {
	st := a.engine.Cluster()
	if st == nil {
		writeJSON(w, http.StatusOK, map[string]any{"mode": clusterOff, "state": clusterOff, "share": 1})
		return
	}
	v := clusterView{Info: st.Info(r.Context()), OnUnavailable: a.engine.ClusterOnUnavailable(), Share: a.engine.ClusterShare(),
		Admission: a.engine.ClusterAdmission(), Leases: a.engine.ClusterLeases()}
	for _, s := range a.engine.ClusterSpendLeases() {
		v.SpendLeases = append(v.SpendLeases, spendLeaseJSON{Window: s.Window, Unused: amount(spend.Micros(s.Unused)),
			InFlight: amount(spend.Micros(s.InFlight)), Pending: amount(spend.Micros(s.Pending)), Tight: s.Tight})
	}
	switch {
	case v.Available && v.Synced:
		v.State = clusterShared
	case v.Available:
		v.State = clusterResyncing
	case v.OnUnavailable == config.OnUnavailableClosed:
		v.State = clusterRefusing
	default:
		v.State = clusterLocal
	}
	writeJSON(w, http.StatusOK, v)
}

// startLimits says what a replica that has not reached Redis enforces meanwhile, for its log.
func startLimits(c config.Cluster) string {
	switch {
	case c.OnUnavailable == config.OnUnavailableClosed:
		return "none: every request is refused with cluster_unavailable"
	case c.ExpectedReplicas > 1:
		return fmt.Sprintf("each limit divided by cluster.expected_replicas (%d)", c.ExpectedReplicas)
	default:
		return "the whole limits (it knows no other replica yet: set cluster.expected_replicas to divide them)"
	}
}
