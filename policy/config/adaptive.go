package config

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// Concurrency is max_concurrent: a number of requests, or the word adaptive for a limit learned
// from the provider's latency (see Adaptive).
type Concurrency int64

// AdaptiveConcurrency is the value of `max_concurrent: adaptive`. No number decodes to it.
const AdaptiveConcurrency Concurrency = math.MinInt64

// IsAdaptive reports whether the value is `adaptive`.
func (c Concurrency) IsAdaptive() bool { return c == AdaptiveConcurrency }

// String writes the value as a policy file would.
func (c Concurrency) String() string {
	if c.IsAdaptive() {
		return "adaptive"
	}
	return strconv.FormatInt(int64(c), 10)
}

// UnmarshalText parses an integer or the word adaptive.
func (c *Concurrency) UnmarshalText(b []byte) error {
	s := strings.TrimSpace(string(b))
	if s == "adaptive" {
		*c = AdaptiveConcurrency
		return nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n == math.MinInt64 {
		return fmt.Errorf("expected an integer or adaptive, got the string %q", s)
	}
	*c = Concurrency(n)
	return nil
}

// MarshalJSON writes a number, or the string "adaptive".
func (c Concurrency) MarshalJSON() ([]byte, error) {
	if c.IsAdaptive() {
		return []byte(`"adaptive"`), nil
	}
	return json.Marshal(int64(c))
}

// Adaptive tunes a limit set's adaptive concurrency limit (`max_concurrent: adaptive`): the limit
// moves between min and max, learned from each completed request's time to first token
// (compared per prompt size with a no-load baseline), its inter-token latency when it streams,
// and upstream 429, 503 and timeouts. The algorithm is described in docs/adaptive.md. An adaptive
// block is inherited whole from a template; feature ratios (scale_by) do not scale it. Each
// replica learns its own limit (in cluster mode too: the limit is not shared through Redis).
type Adaptive struct {
	// Min is the lowest the limit goes. At least 1. Default 1.
	Min *int64 `koanf:"min" json:"min,omitempty"`
	// Max is the highest the limit goes. Default 10 × initial.
	Max *int64 `koanf:"max" json:"max,omitempty"`
	// Initial is the limit before anything is learned (a reload that keeps the adaptive
	// settings keeps the learned limit instead). Default 10, brought within [min, max].
	Initial *int64 `koanf:"initial" json:"initial,omitempty"`
	// Tolerance is how many times its no-load baseline the median time to first token per
	// prompt size, or the median inter-token latency, may be before the limit shrinks; more than
	// 1, at most 10. Default 1.5.
	Tolerance *float64 `koanf:"tolerance" json:"tolerance,omitempty"`
	// Interval is how often the limit is recomputed from what requests showed since (at least 5
	// first tokens or answers; fewer wait for the next interval). From 10ms to 1m. Default 1s.
	Interval *Duration `koanf:"interval" json:"interval,omitempty"`
	// RemeasureInterval is how often the no-load baselines are measured again: the limit is
	// held at min until 5 requests admitted at that level have their first token, and their
	// medians reset the baselines, so that a baseline can rise when the provider really became
	// slower. At least 10 intervals. Default 5m.
	RemeasureInterval *Duration `koanf:"remeasure_interval" json:"remeasure_interval,omitempty"`
}

// AdaptiveLimit is a resolved adaptive setting. The zero value means a fixed limit.
type AdaptiveLimit struct {
	Min, Max, Initial int64
	Tolerance         float64
	Interval          time.Duration
	RemeasureInterval time.Duration
}

// On reports whether the limit is adaptive.
func (a AdaptiveLimit) On() bool { return a.Max > 0 }

// Adaptive defaults.
const (
	defaultAdaptiveInitial   = 10
	defaultAdaptiveTolerance = 1.5
	defaultAdaptiveInterval  = time.Second
	defaultAdaptiveRemeasure = 5 * time.Minute
)

// resolveAdaptive applies the documented defaults to a (possibly nil) adaptive block.
func resolveAdaptive(a *Adaptive) AdaptiveLimit {
	if a == nil {
		a = &Adaptive{}
	}
	r := AdaptiveLimit{
		Min:               max(deref(a.Min), 1),
		Tolerance:         defaultAdaptiveTolerance,
		Interval:          defaultAdaptiveInterval,
		RemeasureInterval: defaultAdaptiveRemeasure,
	}
	if a.Tolerance != nil {
		r.Tolerance = *a.Tolerance
	}
	if a.Interval != nil {
		r.Interval = a.Interval.D()
	}
	if a.RemeasureInterval != nil {
		r.RemeasureInterval = a.RemeasureInterval.D()
	}
	if a.Initial != nil {
		r.Initial = *a.Initial
	} else {
		r.Initial = max(r.Min, defaultAdaptiveInitial)
		if a.Max != nil {
			r.Initial = min(r.Initial, *a.Max)
		}
	}
	if a.Max != nil {
		r.Max = *a.Max
	} else {
		r.Max = 10 * r.Initial
	}
	r.Max = max(r.Max, r.Min, 1)
	r.Initial = min(max(r.Initial, r.Min), r.Max)
	return r
}

// adaptive checks the adaptive keys of the limit set at path; merged is the set with its
// template chain applied.
func (v *validator) adaptive(path string, l, merged Limits, template bool) {
	a := l.Adaptive
	if a == nil {
		return
	}
	// An inherited block is fine (a template may offer adaptive settings that a set overrides
	// with a fixed limit); a set's own block that nothing reads is refused.
	if adaptive := merged.MaxConcurrent != nil && merged.MaxConcurrent.IsAdaptive(); !adaptive && !template {
		v.add(path+".adaptive", "adaptive settings take effect only with max_concurrent: adaptive")
	}
	p := path + ".adaptive."
	if a.Min != nil && *a.Min < 1 {
		v.own(p+"min", "must be at least 1, got %d", *a.Min)
	}
	if a.Max != nil && *a.Max < 1 {
		v.own(p+"max", "must be at least 1, got %d", *a.Max)
	}
	if a.Initial != nil && *a.Initial < 1 {
		v.own(p+"initial", "must be at least 1, got %d", *a.Initial)
	}
	lo := max(deref(a.Min), 1)
	if a.Max != nil && *a.Max >= 1 && *a.Max < lo {
		v.add(p+"max", "%d is below min %d", *a.Max, lo)
	}
	if a.Initial != nil && *a.Initial >= 1 {
		if *a.Initial < lo {
			v.add(p+"initial", "%d is below min %d", *a.Initial, lo)
		} else if a.Max != nil && *a.Initial > *a.Max {
			v.add(p+"initial", "%d is above max %d", *a.Initial, *a.Max)
		}
	}
	if a.Tolerance != nil && (*a.Tolerance <= 1 || *a.Tolerance > 10) {
		v.own(p+"tolerance", "must be more than 1 and at most 10, got %g", *a.Tolerance)
	}
	if a.Interval != nil && (a.Interval.D() < 10*time.Millisecond || a.Interval.D() > time.Minute) {
		v.own(p+"interval", "must be from 10ms to 1m, got %s", a.Interval)
	}
	if a.RemeasureInterval != nil {
		interval := defaultAdaptiveInterval
		if a.Interval != nil {
			interval = a.Interval.D()
		}
		if a.RemeasureInterval.D() < 10*interval {
			v.add(p+"remeasure_interval", "%s is shorter than 10 intervals (%s)", a.RemeasureInterval, 10*interval)
		}
	}
}
