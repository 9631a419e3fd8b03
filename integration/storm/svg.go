package storm

import (
	"fmt"
	"html"
	"math"
	"strings"
)

// chartColors are distinguishable on white and in grey print (Okabe–Ito).
var chartColors = []string{"#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442"}

// Chart geometry in SVG user units.
const (
	chartW, chartH                 = 960.0, 460.0
	plotL, plotR, plotT, plotB     = 70.0, 400.0, 40.0, 60.0
	legendLineLen, legendRowHeight = 24.0, 20.0
)

// Series is one line of a percentile chart: a label and its sample, sorted ascending.
type Series struct {
	Label  string
	Values []float64
}

// SVG renders the chat latency distribution of every configuration, all its runs pooled, as a
// latency-by-percentile chart, with the design target (TargetRatio × the baseline's P99) marked.
func (r *Report) SVG() []byte {
	var series []Series
	for _, cs := range r.Configurations {
		series = append(series, Series{Label: cs.Label, Values: r.chatLatencies(cs.Name)})
	}
	mark := 0.0
	if b := r.Config(r.BaselineName()); b != nil && b.ChatP99.N > 0 {
		mark = b.ChatP99.Median * TargetRatio
	}
	title := fmt.Sprintf("Chat latency by percentile, %d runs per configuration pooled; failures counted at %v", r.Repeat, r.Scenario.ChatTimeout)
	return PercentileChart(title, series, mark, fmt.Sprintf("%.1f × baseline P99", TargetRatio))
}

// percentileTicks are the x-axis labels: the axis runs in "nines", -log10(1 − q), so the tail
// gets as much room as the body, as HdrHistogram's percentile plots do.
var percentileTicks = []struct {
	q     float64
	label string
}{{0, "0%"}, {0.5, "50%"}, {0.9, "90%"}, {0.99, "99%"}, {0.999, "99.9%"}}

// nines maps a quantile in [0, 1) to the chart's x coordinate before scaling.
func nines(q float64) float64 { return -math.Log10(1 - q) }

// PercentileChart renders each series' latency (seconds, y, logarithmic) against its
// percentile (x, in nines) as a step line: the value at percentile q is the ⌊q·n⌋-th smallest.
// A positive mark draws a dashed horizontal line labelled markLabel. The SVG is self-contained
// and needs no scripts or fonts beyond a generic sans-serif.
func PercentileChart(title string, series []Series, mark float64, markLabel string) []byte {
	lo, hi := math.Inf(1), math.Inf(-1)
	maxN := 0
	for _, s := range series {
		if len(s.Values) == 0 {
			continue
		}
		lo = math.Min(lo, s.Values[0])
		hi = math.Max(hi, s.Values[len(s.Values)-1])
		maxN = max(maxN, len(s.Values))
	}
	if mark > 0 {
		lo, hi = math.Min(lo, mark), math.Max(hi, mark)
	}
	if math.IsInf(lo, 0) || lo <= 0 {
		lo, hi = 0.1, 10
	}
	ymin := math.Pow(10, math.Floor(math.Log10(lo)))
	ymax := math.Pow(10, math.Ceil(math.Log10(hi)))
	if ymax <= ymin {
		ymax = ymin * 10
	}
	// The x axis reaches the sample's last step, between 99% and 99.9%.
	xmax := math.Min(math.Max(math.Log10(float64(max(maxN, 1))), 2), 3)
	pw, ph := chartW-plotL-plotR, chartH-plotT-plotB
	x := func(q float64) float64 { return plotL + math.Min(nines(q), xmax)/xmax*pw }
	y := func(v float64) float64 {
		v = math.Min(math.Max(v, ymin), ymax)
		return plotT + (1-(math.Log10(v)-math.Log10(ymin))/(math.Log10(ymax)-math.Log10(ymin)))*ph
	}

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif" font-size="12">`+"\n",
		chartW, chartH, chartW, chartH)
	b.WriteString(`<rect width="100%" height="100%" fill="#ffffff"/>` + "\n")
	fmt.Fprintf(&b, `<text x="%.1f" y="22" font-size="14" font-weight="bold">%s</text>`+"\n", plotL, html.EscapeString(title))

	for _, t := range percentileTicks {
		if nines(t.q) > xmax+1e-9 {
			break
		}
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#dddddd"/>`+"\n", x(t.q), plotT, x(t.q), plotT+ph)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", x(t.q), plotT+ph+16, t.label)
	}
	for d := ymin; d <= ymax*1.0001; d *= 10 {
		for _, m := range []float64{1, 2, 5} {
			v := d * m
			if v > ymax*1.0001 {
				break
			}
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#dddddd"/>`+"\n", plotL, y(v), plotL+pw, y(v))
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end">%s</text>`+"\n", plotL-6, y(v)+4, tickLabel(v))
		}
	}
	fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="#333333"/>`+"\n", plotL, plotT, pw, ph)
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">percentile</text>`+"\n", plotL+pw/2, chartH-18)
	fmt.Fprintf(&b, `<text x="18" y="%.1f" text-anchor="middle" transform="rotate(-90 18 %.1f)">latency (simulated seconds, log scale)</text>`+"\n", plotT+ph/2, plotT+ph/2)
	if mark > 0 {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#555555" stroke-dasharray="5 4"/>`+"\n", plotL, y(mark), plotL+pw, y(mark))
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" fill="#555555">%s</text>`+"\n", plotL+4, y(mark)-4, html.EscapeString(markLabel))
	}

	for i, s := range series {
		color := chartColors[i%len(chartColors)]
		if n := len(s.Values); n > 0 {
			var pts strings.Builder
			for j, v := range s.Values {
				// The j-th smallest value holds from percentile j/n to (j+1)/n.
				end := float64(j+1) / float64(n)
				if j == n-1 {
					end = float64(j) / float64(n)
				}
				if j > 0 {
					pts.WriteByte(' ')
				}
				fmt.Fprintf(&pts, "%.1f,%.1f %.1f,%.1f", x(float64(j)/float64(n)), y(v), x(end), y(v))
			}
			fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", color, pts.String())
		}
		ly := plotT + 10 + float64(i)*legendRowHeight
		lx := chartW - plotR + 16
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="2"/>`+"\n", lx, ly, lx+legendLineLen, ly, color)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f">%s</text>`+"\n", lx+legendLineLen+6, ly+4, html.EscapeString(legendLabel(s)))
	}
	b.WriteString("</svg>\n")
	return []byte(b.String())
}

// legendLabel is a series label with its sample size, shortened to fit the legend.
func legendLabel(s Series) string {
	l := s.Label
	if r := []rune(l); len(r) > 40 {
		l = string(r[:39]) + "…"
	}
	return fmt.Sprintf("%s (n=%d)", l, len(s.Values))
}

// tickLabel formats an axis value without trailing zeros.
func tickLabel(v float64) string {
	s := strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.3f", v), "0"), ".")
	return s + " s"
}

// TimeSeries is one line of a time chart: points (At in simulated seconds, Value), in time
// order, drawn as steps; Dashed draws it dashed.
type TimeSeries struct {
	Label  string
	Points []TimePoint
	Dashed bool
}

// TimePoint is one sample of a TimeSeries.
type TimePoint struct{ At, Value float64 }

// TraceSVG renders how the brownout played out: the upstream's capacity, and from the first
// run of the adaptive and the static-10 configurations the proxy's provider limit and the
// requests queued at the provider and in llm-bulkhead, over the run's simulated time.
func (r *Report) TraceSVG() []byte {
	first := func(name string) *RunResult {
		for _, run := range r.Runs {
			if run.Configuration == name && len(run.Trace) > 0 {
				return run
			}
		}
		return nil
	}
	pick := func(run *RunResult, f func(TracePoint) float64) []TimePoint {
		out := make([]TimePoint, len(run.Trace))
		for i, tp := range run.Trace {
			out[i] = TimePoint{At: tp.At, Value: f(tp)}
		}
		return out
	}
	var series []TimeSeries
	var capacity []TimePoint
	for _, p := range r.Scenario.Phases() {
		capacity = append(capacity, TimePoint{p.From, float64(p.Capacity)}, TimePoint{p.To, float64(p.Capacity)})
	}
	series = append(series, TimeSeries{Label: "provider capacity", Points: capacity})
	if run := first(ConfigAdaptive); run != nil {
		series = append(series,
			TimeSeries{Label: "adaptive: limit", Points: pick(run, func(tp TracePoint) float64 { return float64(tp.Limit) })},
			TimeSeries{Label: "adaptive: queued at the provider", Points: pick(run, func(tp TracePoint) float64 { return float64(tp.UpstreamQueued) })},
			TimeSeries{Label: "adaptive: queued in llm-bulkhead", Points: pick(run, func(tp TracePoint) float64 { return float64(tp.Queued) })},
		)
	}
	if run := first(ConfigStatic10); run != nil {
		series = append(series,
			TimeSeries{Label: "static 10: queued at the provider", Points: pick(run, func(tp TracePoint) float64 { return float64(tp.UpstreamQueued) }), Dashed: true},
			TimeSeries{Label: "static 10: queued in llm-bulkhead", Points: pick(run, func(tp TracePoint) float64 { return float64(tp.Queued) }), Dashed: true},
		)
	}
	title := fmt.Sprintf("Provider brownout %s: limit and queues over the first run (time scale %v)", r.Scenario.Brownout, r.TimeScale)
	return TimeChart(title, "requests", r.Scenario.Duration.Seconds(), series)
}

// TimeChart renders series against simulated time from 0 to until seconds on a linear y axis
// starting at 0, labelled yLabel. The SVG is self-contained like PercentileChart's.
func TimeChart(title, yLabel string, until float64, series []TimeSeries) []byte {
	top := 1.0
	for _, s := range series {
		for _, p := range s.Points {
			top = math.Max(top, p.Value)
		}
	}
	step := niceStep(top / 6)
	ymax := math.Ceil(top/step) * step
	if until <= 0 {
		until = 1
	}
	pw, ph := chartW-plotL-plotR, chartH-plotT-plotB
	x := func(t float64) float64 { return plotL + math.Min(math.Max(t, 0), until)/until*pw }
	y := func(v float64) float64 { return plotT + (1-math.Min(math.Max(v, 0), ymax)/ymax)*ph }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif" font-size="12">`+"\n",
		chartW, chartH, chartW, chartH)
	b.WriteString(`<rect width="100%" height="100%" fill="#ffffff"/>` + "\n")
	fmt.Fprintf(&b, `<text x="%.1f" y="22" font-size="14" font-weight="bold">%s</text>`+"\n", plotL, html.EscapeString(title))
	tstep := niceStep(until / 8)
	for t := 0.0; t <= until+1e-9; t += tstep {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#dddddd"/>`+"\n", x(t), plotT, x(t), plotT+ph)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s s</text>`+"\n", x(t), plotT+ph+16, trimFloat(t))
	}
	for v := 0.0; v <= ymax+1e-9; v += step {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#dddddd"/>`+"\n", plotL, y(v), plotL+pw, y(v))
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end">%s</text>`+"\n", plotL-6, y(v)+4, trimFloat(v))
	}
	fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="#333333"/>`+"\n", plotL, plotT, pw, ph)
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">simulated time since the run began</text>`+"\n", plotL+pw/2, chartH-18)
	fmt.Fprintf(&b, `<text x="18" y="%.1f" text-anchor="middle" transform="rotate(-90 18 %.1f)">%s</text>`+"\n", plotT+ph/2, plotT+ph/2, html.EscapeString(yLabel))
	for i, s := range series {
		color := chartColors[i%len(chartColors)]
		dash := ""
		if s.Dashed {
			dash = ` stroke-dasharray="6 4"`
		}
		if len(s.Points) > 0 {
			var pts strings.Builder
			for j, p := range s.Points {
				if j > 0 {
					// A step: hold the previous value until this sample.
					fmt.Fprintf(&pts, " %.1f,%.1f ", x(p.At), y(s.Points[j-1].Value))
				}
				fmt.Fprintf(&pts, "%.1f,%.1f", x(p.At), y(p.Value))
			}
			fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>`+"\n", color, dash, pts.String())
		}
		ly := plotT + 10 + float64(i)*legendRowHeight
		lx := chartW - plotR + 16
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="2"%s/>`+"\n", lx, ly, lx+legendLineLen, ly, color, dash)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f">%s</text>`+"\n", lx+legendLineLen+6, ly+4, html.EscapeString(s.Label))
	}
	b.WriteString("</svg>\n")
	return []byte(b.String())
}

// niceStep returns the smallest of 1, 2 or 5 times a power of ten that is at least v (v > 0).
func niceStep(v float64) float64 {
	if !(v > 0) || math.IsInf(v, 0) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}
