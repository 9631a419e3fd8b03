package cluster

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are what the store counts: its calls to Redis, its state and leased admission's
// waits and reports. The store registers none of them: whoever runs it registers Collectors.
type metrics struct {
	all       []prometheus.Collector
	latency   *prometheus.HistogramVec
	errors    *prometheus.CounterVec
	available prometheus.Gauge
	live      prometheus.Gauge
	leases    prometheus.Gauge
	queue     prometheus.Gauge
	dropped   prometheus.Counter
	resyncs   prometheus.Counter
	updates   prometheus.Counter
	// clockOffset is Redis's clock minus this replica's, as last measured.
	clockOffset prometheus.Gauge
	synced      prometheus.Gauge
	lost        *prometheus.CounterVec
	// onError, when set, hears of every failed call.
	onError func(op string, err error)
	// leaseWaits and leaseReports are leased admission's (registered in either mode, so that a
	// dashboard finds them).
	leaseWaits   *prometheus.CounterVec
	leaseReports [whyCount]prometheus.Counter
}

const ns = "llm_bulkhead"

func newMetrics() *metrics {
	m := &metrics{
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "cluster_redis_seconds",
			Help:    "Round-trip time of calls to Redis, by operation (admit, peek, settle, heartbeat, resync, leave, repair, spend_reserve, spend_settle, spend_add, spend_carry, lease, quota, usage_flush, usage_read).",
			Buckets: []float64{.0002, .0005, .001, .002, .005, .01, .02, .05, .1, .25, 1}}, []string{"op"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "cluster_redis_errors_total",
			Help: "Calls to Redis that failed or timed out, by operation."}, []string{"op"}),
		available: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "cluster_available",
			Help: "1 while limits are shared through Redis, 0 while admissions follow cluster.on_unavailable."}),
		live: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "cluster_live_replicas",
			Help: "Replicas with live leases, as last seen in Redis."}),
		leases: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "cluster_leases",
			Help: "Admitted requests this replica holds shared slots and reservations for."}),
		queue: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "cluster_settlement_queue",
			Help: "Settlements and releases waiting to be sent to Redis."}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "cluster_settlements_dropped_total",
			Help: "Settlements dropped because too many were queued while Redis was unreachable."}),
		resyncs: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "cluster_resyncs_total",
			Help: "Times this replica (re)registered and rewrote its leases in Redis (at start, and after Redis lost them)."}),
		updates: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "cluster_count_updates_total",
			Help: "Published slot totals received from Redis (each can wake requests queued here)."}),
		clockOffset: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "cluster_clock_offset_seconds",
			Help: "Redis's clock minus this replica's, measured at each spend reservation (spend windows are chosen by the replica's clock)."}),
		synced: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "cluster_synced",
			Help: "1 while Redis counts every replica's slots and the shared counts alone decide; 0 while this replica keeps to its part of each limit (cut off from Redis, or until every replica has rewritten its slots after an outage or a loss of the shared state)."}),
		lost: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "cluster_state_lost_total",
			Help: "Times this replica found its shared state gone or wrong and rewrote it, by cause: lost (Redis lost the whole state), expired (this replica's registration expired), replaced (the state was replaced by another), corrupt (content no replica writes: repaired)."},
			[]string{"cause"}),
	}
	m.leaseWaits = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "cluster_lease_waits_total",
		Help: "Requests that waited for this replica's lease to grow (leased admission), by what they lacked: slot (concurrency or in-flight tokens), window (a request-rate or token chunk) or spend (a spend window's chunk)."},
		[]string{"kind"})
	m.leaseWaits.WithLabelValues("slot")
	m.leaseWaits.WithLabelValues("window")
	m.leaseWaits.WithLabelValues("spend")
	reports := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "cluster_lease_reports_total",
		Help: "Lease reports sent to Redis (leased admission), by reason: renew (steady, every 25th lease_interval, at least twice within the lease ttl, or early, with another compartment's report), changed (its requests fill the lease, or queue), contended (another replica wants more than it holds, or the compartment recovers), window (a window's chunks run low, or something to give back to or charge to a tight window), short (a request here found the lease short), heard_short (another replica is short), drained (a request held above a shrunk lease ended), resend (the last report got no answer), other (limits set or changed, lease closed, learned limit cut), spend (the round's report of the spend windows in use)."},
		[]string{"reason"})
	for w := whyRenew; w < whyCount; w++ {
		m.leaseReports[w] = reports.WithLabelValues(w.String())
	}
	m.all = []prometheus.Collector{m.latency, m.errors, m.available, m.live, m.leases, m.queue, m.dropped, m.resyncs, m.updates, m.clockOffset, m.synced, m.lost,
		m.leaseWaits, reports}
	for _, c := range []string{causeLost, causeExpired, causeReplaced, causeCorrupt} {
		m.lost.WithLabelValues(c)
	}
	m.live.Set(1)
	return m
}

func (m *metrics) observe(op string, start time.Time, err error) {
	m.latency.WithLabelValues(op).Observe(time.Since(start).Seconds())
	if err != nil {
		m.errors.WithLabelValues(op).Inc()
		if m.onError != nil {
			m.onError(op, err)
		}
	}
}

// Collectors returns the store's metrics, for the process's registry.
func (s *Store) Collectors() []prometheus.Collector { return s.met.all }
