package observe

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/adaptive"
)

var (
	descAdaptiveLimit = prometheus.NewDesc(Namespace+"_adaptive_limit",
		"The concurrency limit an adaptive compartment has learned (in force, or reported only in shadow mode).", []string{"compartment", "family"}, nil)
	descAdaptiveBaseline = prometheus.NewDesc(Namespace+"_adaptive_baseline_seconds",
		"An adaptive compartment's no-load baseline, by signal: ttfb (time to first token of an empty prompt: TTFB / (1 + prompt tokens / 1000)) or inter_token (time between streamed tokens).", []string{"compartment", "signal"}, nil)
	descAdaptiveSignal = prometheus.NewDesc(Namespace+"_adaptive_signal_seconds",
		"An adaptive compartment's last window median, by signal (ttfb normalised like the baseline, inter_token).", []string{"compartment", "signal"}, nil)
	descAdaptiveRatio = prometheus.NewDesc(Namespace+"_adaptive_latency_ratio",
		"An adaptive compartment's last window: its larger signal over that signal's baseline; above the tolerance the limit shrinks.", []string{"compartment"}, nil)
	descAdaptiveBackoffs = prometheus.NewDesc(Namespace+"_adaptive_backoffs_total",
		"Times an adaptive compartment's limit was cut, by cause: latency (a signal beyond tolerance) or upstream (429, 503, 529 or no response).", []string{"compartment", "cause"}, nil)
	descAdaptiveIncreases = prometheus.NewDesc(Namespace+"_adaptive_increases_total",
		"Times an adaptive compartment's limit grew (saturated with latency within tolerance).", []string{"compartment"}, nil)
	descAdaptiveRemeasuring = prometheus.NewDesc(Namespace+"_adaptive_remeasuring",
		"1 while an adaptive compartment holds its limit at min to measure its baselines again.", []string{"compartment"}, nil)
	descProcessStall = prometheus.NewDesc(Namespace+"_process_stall_seconds_total",
		"Time this process could not run (CPU throttling, a loaded machine, a long GC pause), measured while some compartment has an adaptive limit, which discounts it.", nil, nil)
	adaptiveDescs = []*prometheus.Desc{descAdaptiveLimit, descAdaptiveBaseline, descAdaptiveSignal, descAdaptiveRatio,
		descAdaptiveBackoffs, descAdaptiveIncreases, descAdaptiveRemeasuring, descProcessStall}
)

// collectAdaptive emits the metrics of c's adaptive limit, if it has one.
func collectAdaptive(ch chan<- prometheus.Metric, c *policy.CompartmentState) {
	if c.Adaptive == nil {
		return
	}
	st, name := c.Adaptive, c.Name
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge(descAdaptiveLimit, float64(st.Limit), name, c.Family)
	gauge(descAdaptiveBaseline, st.BaselineTTFB.Seconds(), name, "ttfb")
	gauge(descAdaptiveBaseline, st.BaselineInterToken.Seconds(), name, "inter_token")
	gauge(descAdaptiveSignal, st.TTFB.Seconds(), name, "ttfb")
	gauge(descAdaptiveSignal, st.InterToken.Seconds(), name, "inter_token")
	gauge(descAdaptiveRatio, st.Ratio, name)
	counter(descAdaptiveBackoffs, float64(st.Decreases[adaptive.CauseLatency]), name, "latency")
	counter(descAdaptiveBackoffs, float64(st.Decreases[adaptive.CauseUpstream]), name, "upstream")
	counter(descAdaptiveIncreases, float64(st.Increases), name)
	remeasuring := 0.0
	if st.Remeasuring {
		remeasuring = 1
	}
	gauge(descAdaptiveRemeasuring, remeasuring, name)
}
