package config

import (
	"errors"
	"slices"
	"strconv"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
)

// BreakerSettings is a breaker entry with its base chain and Resilience4j's defaults applied.
type BreakerSettings struct {
	SlidingWindowType        string // COUNT_BASED or TIME_BASED
	SlidingWindowSize        int
	MinimumCalls             int
	FailureRateThreshold     float64
	SlowCallRateThreshold    float64
	SlowCallDuration         time.Duration
	SlowCallMeasure          string // ttfb or total
	WaitInOpen               time.Duration
	WaitInOpenMultiplier     float64
	MaxWaitInOpen            time.Duration
	PermittedCallsInHalfOpen int
	MaxWaitInHalfOpen        time.Duration
	State                    string
	FailureStatuses          []string
	IgnoreStatuses           []string
	RateLimitedAs            string // neutral, failure or ignore
	HonorRetryAfter          bool
	RetryAfterScope          string // tenant or provider
	NoResponseAs             string // failure or ignore
}

// RetryAfterCap is the longest an upstream retry-after may hold calls back.
func (s BreakerSettings) RetryAfterCap() time.Duration {
	if s.MaxWaitInOpen > 0 {
		return s.MaxWaitInOpen
	}
	return s.WaitInOpen
}

// ResolveBreaker applies the base chain of breakers[name] and the defaults.
func (p *Policy) ResolveBreaker(name string) BreakerSettings {
	b := p.Breakers[name]
	seen := map[string]bool{name: true}
	for cur := b.Base; cur != "" && !seen[cur]; {
		seen[cur] = true
		base, ok := p.Breakers[cur]
		if !ok {
			break
		}
		fillBreaker(&b, base)
		cur = base.Base
	}
	return finishBreaker(b)
}

func fillBreaker(dst *Breaker, src Breaker) {
	setIfNil(&dst.SlidingWindowType, src.SlidingWindowType)
	setIfNil(&dst.SlidingWindowSize, src.SlidingWindowSize)
	setIfNil(&dst.MinimumCalls, src.MinimumCalls)
	setIfNil(&dst.FailureRateThreshold, src.FailureRateThreshold)
	setIfNil(&dst.SlowCallRateThreshold, src.SlowCallRateThreshold)
	setIfNil(&dst.SlowCallDuration, src.SlowCallDuration)
	setIfNil(&dst.SlowCallMeasure, src.SlowCallMeasure)
	setIfNil(&dst.WaitInOpen, src.WaitInOpen)
	setIfNil(&dst.WaitInOpenMultiplier, src.WaitInOpenMultiplier)
	setIfNil(&dst.MaxWaitInOpen, src.MaxWaitInOpen)
	setIfNil(&dst.PermittedCallsInHalfOpen, src.PermittedCallsInHalfOpen)
	setIfNil(&dst.MaxWaitInHalfOpen, src.MaxWaitInHalfOpen)
	setIfNil(&dst.State, src.State)
	setIfNil(&dst.RateLimitedAs, src.RateLimitedAs)
	setIfNil(&dst.HonorRetryAfter, src.HonorRetryAfter)
	setIfNil(&dst.RetryAfterScope, src.RetryAfterScope)
	setIfNil(&dst.NoResponseAs, src.NoResponseAs)
	if dst.FailureStatuses == nil {
		dst.FailureStatuses = src.FailureStatuses
	}
	if dst.IgnoreStatuses == nil {
		dst.IgnoreStatuses = src.IgnoreStatuses
	}
}

func finishBreaker(b Breaker) BreakerSettings {
	or := func(s *string, def string) string {
		if s == nil {
			return def
		}
		return *s
	}
	orI := func(v *int, def int) int {
		if v == nil {
			return def
		}
		return *v
	}
	orF := func(v *float64, def float64) float64 {
		if v == nil {
			return def
		}
		return *v
	}
	orD := func(v *Duration, def time.Duration) time.Duration {
		if v == nil {
			return def
		}
		return v.D()
	}
	s := BreakerSettings{
		SlidingWindowType:        or(b.SlidingWindowType, "COUNT_BASED"),
		SlidingWindowSize:        orI(b.SlidingWindowSize, 100),
		MinimumCalls:             orI(b.MinimumCalls, 100),
		FailureRateThreshold:     orF(b.FailureRateThreshold, 50),
		SlowCallRateThreshold:    orF(b.SlowCallRateThreshold, 100),
		SlowCallDuration:         orD(b.SlowCallDuration, 60*time.Second),
		SlowCallMeasure:          or(b.SlowCallMeasure, "ttfb"),
		WaitInOpen:               orD(b.WaitInOpen, 60*time.Second),
		WaitInOpenMultiplier:     orF(b.WaitInOpenMultiplier, 1),
		MaxWaitInOpen:            orD(b.MaxWaitInOpen, 0),
		PermittedCallsInHalfOpen: orI(b.PermittedCallsInHalfOpen, 10),
		MaxWaitInHalfOpen:        orD(b.MaxWaitInHalfOpen, 0),
		State:                    or(b.State, "CLOSED"),
		FailureStatuses:          b.FailureStatuses,
		IgnoreStatuses:           b.IgnoreStatuses,
		RateLimitedAs:            or(b.RateLimitedAs, "neutral"),
		HonorRetryAfter:          b.HonorRetryAfter == nil || *b.HonorRetryAfter,
		RetryAfterScope:          or(b.RetryAfterScope, "tenant"),
		NoResponseAs:             or(b.NoResponseAs, "failure"),
	}
	if s.FailureStatuses == nil {
		s.FailureStatuses = []string{"5xx"}
	}
	if s.IgnoreStatuses == nil {
		s.IgnoreStatuses = []string{"4xx"}
	}
	return s
}

// validateBreaker checks the values of one breaker entry that can be checked without the
// breaker's own rules (those run on the resolved settings in the policy build).
func validateBreaker(v *validator, path string, b Breaker) {
	if b.SlidingWindowType != nil {
		v.oneOf(path+".sliding_window_type", *b.SlidingWindowType, []string{"COUNT_BASED", "TIME_BASED"})
	}
	if b.SlowCallMeasure != nil {
		v.oneOf(path+".slow_call_measure", *b.SlowCallMeasure, []string{"ttfb", "total"})
	}
	if b.State != nil {
		v.oneOf(path+".state", *b.State, []string{"CLOSED", "DISABLED", "METRICS_ONLY", "FORCED_OPEN"})
	}
	if b.RateLimitedAs != nil {
		v.oneOf(path+".rate_limited_as", *b.RateLimitedAs, []string{"neutral", "failure", "ignore"})
	}
	if b.RetryAfterScope != nil {
		v.oneOf(path+".retry_after_scope", *b.RetryAfterScope, []string{"tenant", "provider"})
	}
	if b.NoResponseAs != nil {
		v.oneOf(path+".no_response_as", *b.NoResponseAs, []string{"failure", "ignore"})
	}
	for i, st := range b.FailureStatuses {
		if !validStatusPattern(st) {
			v.add(path+".failure_statuses["+strconv.Itoa(i)+"]", "%q is not a status code (100-599) or class (4xx, 5xx)", st)
		}
	}
	for i, st := range b.IgnoreStatuses {
		if !validStatusPattern(st) {
			v.add(path+".ignore_statuses["+strconv.Itoa(i)+"]", "%q is not a status code (100-599) or class (4xx, 5xx)", st)
		}
	}
	if !v.breakerChainBroken(path) {
		breakerRules(v, path, path[len("breakers."):])
	}
	if b.FailureStatuses != nil && b.IgnoreStatuses != nil {
		for _, st := range b.FailureStatuses {
			if slices.Contains(b.IgnoreStatuses, st) {
				v.add(path+".ignore_statuses", "%s is listed both as failure and ignored", st)
			}
		}
	}
}

// StatusMatches reports whether an HTTP status matches a pattern such as "503" or "5xx".
func StatusMatches(pattern string, status int) bool {
	if len(pattern) != 3 {
		return false
	}
	if pattern[1:] == "xx" {
		return status/100 == int(pattern[0]-'0')
	}
	return strconv.Itoa(status) == pattern
}

func validStatusPattern(s string) bool {
	if len(s) != 3 || s[0] < '1' || s[0] > '5' {
		return false
	}
	if s[1:] == "xx" {
		return true
	}
	return s[1] >= '0' && s[1] <= '9' && s[2] >= '0' && s[2] <= '9'
}

// Config converts resolved settings into the breaker package's Config and validates it with
// the breaker's own rules (Resilience4j's classic misconfigurations are refused there).
func (s BreakerSettings) Config() (breaker.Config, error) {
	c := breaker.Defaults()
	wt, err := breaker.ParseWindowType(s.SlidingWindowType)
	if err != nil {
		return c, err
	}
	c.WindowType = wt
	c.WindowSize = s.SlidingWindowSize
	c.MinimumCalls = s.MinimumCalls
	c.FailureRateThreshold = s.FailureRateThreshold
	c.SlowCallRateThreshold = s.SlowCallRateThreshold
	c.SlowCallDuration = s.SlowCallDuration
	c.WaitInOpen = s.WaitInOpen
	c.WaitInOpenMultiplier = s.WaitInOpenMultiplier
	c.MaxWaitInOpen = s.MaxWaitInOpen
	c.PermittedCallsInHalfOpen = s.PermittedCallsInHalfOpen
	c.MaxWaitInHalfOpen = s.MaxWaitInHalfOpen
	// OPEN moves to HALF_OPEN by itself when the wait is over: an operator reading the state
	// should not see OPEN long after the breaker would let probes through.
	c.AutomaticTransition = true
	return c, c.Validate()
}

// breakerRules runs the breaker's own validation on the resolved entry and reports each
// problem at its key.
func breakerRules(v *validator, path, name string) {
	_, err := v.p.ResolveBreaker(name).Config()
	if err == nil {
		return
	}
	var fes breaker.ConfigErrors
	if errors.As(err, &fes) {
		for _, fe := range fes {
			v.add(path+"."+fe.Key, "%s", fe.Msg)
		}
		return
	}
	v.add(path, "%v", err)
}
