package app

import (
	"fmt"
	"io"
	"strings"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// explainCluster prints the cluster section: whether limits are shared across replicas, through
// what, and which state stays in each process.
func explainCluster(w io.Writer, c config.Cluster) {
	if !c.Enabled() {
		fmt.Fprintln(w, "\ncluster: off (every limit is enforced per process)")
		return
	}
	mode := c.Mode
	if c.Mode == config.ClusterSentinel {
		mode += fmt.Sprintf(" (master %s)", c.MasterName)
	}
	fmt.Fprintf(w, "\ncluster: backend %s, mode %s\n", c.Backend, mode)
	line := func(key, format string, args ...any) {
		fmt.Fprintf(w, "  %-15s %s\n", key+":", fmt.Sprintf(format, args...))
	}
	line("addresses", "%s", strings.Join(c.Addresses, ", "))
	auth := "no password"
	if c.PasswordEnv != "" {
		auth = "password from $" + c.PasswordEnv
	}
	if c.Username != "" {
		auth = "user " + c.Username + ", " + auth
	}
	tls := "off"
	if c.TLS.Enabled {
		tls = "on"
		if c.TLS.CertFile != "" {
			tls += " (client certificate)"
		}
		if c.TLS.InsecureSkipVerify {
			tls += " (server certificate NOT verified)"
		}
	}
	line("connection", "%s, tls %s, dial_timeout %s, write_timeout %s", auth, tls, c.DialTimeout, c.WriteTimeout)
	line("key prefix", "%s", c.KeyPrefix)
	line("replica id", "%s", c.ReplicaID)
	switch c.Admission {
	case config.AdmissionLeased:
		line("admission", "leased: each replica admits against its lease of every compartment's limits and chunks of its token, rate and spend windows, renewed every %s (lease_interval); no call to Redis on a request's path unless a lease runs short", c.LeaseInterval)
		line("timeout", "%s (the longest a request waits for its lease to grow, and a report for Redis)", c.Timeout)
	default:
		line("admission", "exact: every admission runs one script in Redis")
		line("timeout", "%s (the longest an admission waits for Redis)", c.Timeout)
	}
	unavailable := c.OnUnavailable
	switch c.OnUnavailable {
	case config.OnUnavailableLocal:
		unavailable += " (this replica's part of each limit, enforced in this process: budgets and rates divided by the live replicas last seen, concurrency the slots Redis counted for it plus an equal part of the room free)"
	case config.OnUnavailableClosed:
		unavailable += " (requests refused with 503, reason cluster_unavailable)"
	}
	line("on_unavailable", "%s", unavailable)
	if c.ExpectedReplicas > 0 {
		line("replicas", "at least %d expected (every limit is divided by at least this many while a replica enforces its part, from the start)", c.ExpectedReplicas)
	} else {
		line("replicas", "expected_replicas not set (a replica that has not reached Redis yet enforces the whole limits)")
	}
	line("leases", "lease_ttl %s, heartbeat %s (a replica that stops heartbeating frees its slots after lease_ttl)", c.LeaseTTL, c.Heartbeat)
	line("settlements", "sent every %s, at most %d queued while Redis is unreachable", c.SettleInterval, c.MaxPendingSettlements)
	if c.Admission == config.AdmissionLeased {
		line("shared", "token budgets, request rates, spend, concurrency, learned (adaptive) limits (across every replica with this key prefix)")
	} else {
		line("shared", "token budgets, request rates, spend, concurrency (across every replica with this key prefix); learned (adaptive) limits stay per replica")
	}
	line("per replica", "breakers, learned estimates, queues")
}
