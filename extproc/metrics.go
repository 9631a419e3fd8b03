package extproc

import (
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// Message kinds, indexing the per-kind latency histograms.
const (
	msgRequestHeaders = iota
	msgRequestBody
	msgRequestTrailers
	msgResponseHeaders
	msgResponseBody
	msgResponseTrailers
	msgKinds
)

var msgNames = [msgKinds]string{"request_headers", "request_body", "request_trailers", "response_headers", "response_body", "response_trailers"}

// Protocol violations: messages Envoy never sends in that order. A small fixed set, so the
// metric's label stays bounded whatever a client sends.
const (
	violRepeatedRequestHeaders = iota
	violRepeatedResponseHeaders
	violRepeatedTrailers
	violRequestAfterResponse
	violOutOfOrder
	violUnknownMessage
	violKinds
)

var violNames = [violKinds]string{"repeated_request_headers", "repeated_response_headers", "repeated_trailers",
	"request_after_response", "out_of_order", "unknown_message"}

// metrics are the adapter's own metrics: streams, per-message handling time, panics.
type metrics struct {
	// all lists every collector, for Server.Collectors; the server registers none itself.
	all         []prometheus.Collector
	streams     prometheus.Counter
	passthrough prometheus.Counter
	panics      prometheus.Counter
	overrides   prometheus.Counter
	endedEarly  *prometheus.CounterVec
	handle      [msgKinds]prometheus.Observer

	// admissionsEnded and admissionsReleased count, as each stream ends, the admitted ones and
	// those whose admission was back by then: a difference is an admission that leaked.
	admissionsEnded    prometheus.Counter
	admissionsReleased prometheus.Counter

	protocolErrors [violKinds]prometheus.Counter
	// Per-attempt outcomes (envoy.upstream_filter): streams of the upstream filter, retried
	// attempts the breaker recorded or left out, attempt streams no admitted request matched,
	// and admitted requests whose attempts could not be followed.
	attemptStreams, attemptsRecorded, attemptsNotRecorded, attemptsUnmatched, attemptsUntracked prometheus.Counter
	// refusedMaxStreams counts streams refused because server.max_streams were open.
	refusedMaxStreams prometheus.Counter
	idleReleased      prometheus.Counter
	bodiesRefused     prometheus.Counter
	// timedOut counts streams ended for silence, by silence (silenceFirst, silenceIdle; the
	// silenceNone entry is nil).
	timedOut [silenceKinds]prometheus.Counter

	// Upstream latency and status class per provider; series are made for a provider on its
	// first response, and providers are configured names only.
	upHeaders, upFirstToken, upTotal *prometheus.HistogramVec
	upResponses                      *prometheus.CounterVec
	upMu                             sync.RWMutex
	up                               map[string]*upstreamObs
}

// Status classes of upstream responses, labelling llm_bulkhead_upstream_responses_total.
const (
	class2xx = iota
	class4xx
	class5xx
	classOther
	classNone
	numClasses
)

var classNames = [numClasses]string{"2xx", "4xx", "5xx", "other", "none"}

// upstreamObs are one provider's upstream series.
type upstreamObs struct {
	headers, firstToken, total prometheus.Observer
	responses                  [numClasses]prometheus.Counter
}

// upstream returns provider's series, making them on first use.
func (m *metrics) upstream(provider string) *upstreamObs {
	m.upMu.RLock()
	u := m.up[provider]
	m.upMu.RUnlock()
	if u != nil {
		return u
	}
	m.upMu.Lock()
	defer m.upMu.Unlock()
	if u = m.up[provider]; u != nil {
		return u
	}
	provider = strings.Clone(provider)
	u = &upstreamObs{headers: m.upHeaders.WithLabelValues(provider), firstToken: m.upFirstToken.WithLabelValues(provider),
		total: m.upTotal.WithLabelValues(provider)}
	for i, n := range classNames {
		u.responses[i] = m.upResponses.WithLabelValues(provider, n)
	}
	m.up[provider] = u
	return u
}

// observeUpstream records what one admitted call to provider showed: its latencies when the
// provider answered, and its status class ("none" when the stream ended without response
// headers). A call released as a cancel before any response is not counted.
func (m *metrics) observeUpstream(provider string, o policy.Outcome, firstToken bool) {
	if o.Status == 0 && o.Cancelled {
		return
	}
	u := m.upstream(provider)
	c := classNone
	switch {
	case o.Status == 0:
	case o.Status >= 200 && o.Status < 300:
		c = class2xx
	case o.Status >= 400 && o.Status < 500:
		c = class4xx
	case o.Status >= 500 && o.Status < 600:
		c = class5xx
	default:
		c = classOther
	}
	u.responses[c].Inc()
	if o.Status == 0 {
		return
	}
	u.headers.Observe(o.Headers.Seconds())
	if firstToken {
		u.firstToken.Observe(o.TTFB.Seconds())
	}
	u.total.Observe(o.Duration.Seconds())
}

func newMetrics(s *Server) *metrics {
	ns := observe.Namespace
	m := &metrics{
		streams: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_streams_total",
			Help: "ext_proc streams opened by Envoy (one per HTTP request)."}),
		passthrough: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_passthrough_streams_total",
			Help: "Streams let through untouched because their first message was not request headers."}),
		panics: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_panics_total",
			Help: "Panics recovered while handling a message; the request continued without the processor."}),
		overrides: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_message_timeout_overrides_total",
			Help: "override_message_timeout replies sent to keep Envoy waiting for a queued request."}),
		endedEarly: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "extproc_streams_ended_early_total",
			Help: "Admitted requests whose stream ended before the last expected message, by how (reset, half_close, error, send_failed)."}, []string{"how"}),
		admissionsEnded: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_admitted_streams_ended_total",
			Help: "Streams whose request was admitted, counted when the stream ends."}),
		admissionsReleased: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_admitted_streams_released_total",
			Help: "Admitted streams whose admission was released by the time the stream ended; below extproc_admitted_streams_ended_total only if one leaked."}),
	}
	hist := prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "extproc_message_duration_seconds",
		Help:    "Time to handle one ext_proc message, by message type (queueing for a slot included).",
		Buckets: []float64{5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2, 0.1, 1, 10}}, []string{"type"})
	for i, n := range msgNames {
		m.handle[i] = hist.WithLabelValues(n)
	}
	active := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: ns, Name: "extproc_streams_active",
		Help: "ext_proc streams open now."}, func() float64 { return float64(s.ActiveStreams()) })
	protocol := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "extproc_protocol_errors_total",
		Help: "Streams ended with INVALID_ARGUMENT because a message came out of Envoy's order, by kind."}, []string{"kind"})
	for i, n := range violNames {
		m.protocolErrors[i] = protocol.WithLabelValues(n)
	}
	refused := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "extproc_streams_refused_total",
		Help: "Streams refused with RESOURCE_EXHAUSTED as they opened, by reason (max_streams)."}, []string{"reason"})
	m.refusedMaxStreams = refused.WithLabelValues("max_streams")
	m.idleReleased = prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_streams_idle_released_total",
		Help: "Admitted requests released as cancelled because their stream received no message for server.stream_idle_timeout."})
	timedOut := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "extproc_streams_timed_out_total",
		Help: "Streams the server ended because they went silent, by timeout: first_message (server.first_message_timeout), idle (server.stream_idle_timeout)."}, []string{"timeout"})
	for i := silenceFirst; i < silenceKinds; i++ {
		m.timedOut[i] = timedOut.WithLabelValues(silenceNames[i])
	}
	m.bodiesRefused = prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_bodies_refused_total",
		Help: "Requests refused with server_busy because holding their body would pass server.max_buffered_body_bytes."})
	buffered := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: ns, Name: "extproc_buffered_body_bytes",
		Help: "Request-body bytes held now: from a body's arrival until its request is decided and the reply that carries it is written."}, func() float64 { return float64(s.buffered.Load()) })
	attemptStreams := prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_attempt_streams_total",
		Help: "Streams of the upstream ext_proc filter (gRPC metadata x-llm-bulkhead-filter: upstream): one per attempt Envoy's router makes."})
	m.attemptStreams = attemptStreams
	attempts := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "extproc_attempts_total",
		Help: "Attempts seen by the upstream ext_proc filter that the router retried (the last attempt's outcome is its request's), by result: recorded (in the provider's breaker), not_recorded (the breaker was not closed or has none, or the status is one it ignores), unmatched (an attempt stream whose x-request-id no admitted request has)."},
		[]string{"result"})
	m.attemptsRecorded, m.attemptsNotRecorded = attempts.WithLabelValues("recorded"), attempts.WithLabelValues("not_recorded")
	m.attemptsUnmatched = attempts.WithLabelValues("unmatched")
	untracked := prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "extproc_attempts_untracked_requests_total",
		Help: "Admitted requests whose attempts could not be followed with envoy.upstream_filter on: no x-request-id, one another request in flight has, or too many requests in flight."})
	m.attemptsUntracked = untracked
	latency := []float64{0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300}
	m.upHeaders = prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "upstream_headers_seconds",
		Help: "Time from admission to the provider's response headers, by provider.", Buckets: latency}, []string{"provider"})
	m.upFirstToken = prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "upstream_first_token_seconds",
		Help: "Time from admission to the first response body chunk with generated content, by provider.", Buckets: latency}, []string{"provider"})
	m.upTotal = prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "upstream_duration_seconds",
		Help: "Time from admission to the end of the response, by provider.", Buckets: latency}, []string{"provider"})
	m.upResponses = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "upstream_responses_total",
		Help: "Admitted calls by provider and response status class (2xx, 4xx, 5xx, other, none: no response headers)."}, []string{"provider", "class"})
	m.up = map[string]*upstreamObs{}
	m.all = []prometheus.Collector{m.upHeaders, m.upFirstToken, m.upTotal, m.upResponses,
		m.streams, m.passthrough, m.panics, m.overrides, m.endedEarly, m.admissionsEnded, m.admissionsReleased, hist, active,
		protocol, refused, m.idleReleased, m.bodiesRefused, buffered, timedOut, attemptStreams, attempts, untracked}
	return m
}

// Collectors returns the server's metrics, for the process's registry.
func (s *Server) Collectors() []prometheus.Collector { return s.metrics.all }

func (m *metrics) observe(kind int, d time.Duration) { m.handle[kind].Observe(d.Seconds()) }

func endName(e end) string {
	switch e {
	case endReset:
		return "reset"
	case endHalfClosed:
		return "half_close"
	case endSendFailed:
		return "send_failed"
	}
	return "error"
}
