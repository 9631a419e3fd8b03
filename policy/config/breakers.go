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
	StreamErrorAs            string // failure or ignore
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
	v := verdictsOf(b)
	seen := map[string]bool{name: true}
	for cur := b.Base; cur != "" && !seen[cur]; {
		seen[cur] = true
		base, ok := p.Breakers[cur]
		if !ok {
			break
		}
		fillBreaker(&b, base)
		v.fill(verdictsOf(base))
		cur = base.Base
	}
	s := finishBreaker(b)
	v.apply(&s)
	return s
}

// verdicts is what one breaker entry says about which calls fail and which are ignored, with
// record and ignore and their older forms (failure_statuses, ignore_statuses, no_response_as)
// read into one shape. nil means the entry does not say.
type verdicts struct {
	failure, ignore         []string // statuses
	noResponse, streamError *string  // failure or ignore
}

// Verdict tokens of record and ignore besides statuses.
const (
	verdictTimeout     = "timeout"
	verdictStreamError = "stream_error"
)

func verdictsOf(b Breaker) verdicts {
	v := verdicts{failure: b.FailureStatuses, ignore: b.IgnoreStatuses, noResponse: b.NoResponseAs}
	read := func(items []string, as string, statuses *[]string) {
		for _, it := range items {
			switch it {
			case verdictTimeout:
				v.noResponse = &as
			case verdictStreamError:
				v.streamError = &as
			default:
				*statuses = append(slices.Clip(*statuses), it)
			}
		}
	}
	read(b.Record, "failure", &v.failure)
	read(b.Ignore, "ignore", &v.ignore)
	return v
}

// fill takes what v does not say from a base entry's verdicts.
func (v *verdicts) fill(base verdicts) {
	if v.failure == nil {
		v.failure = base.failure
	}
	if v.ignore == nil {
		v.ignore = base.ignore
	}
	setIfNil(&v.noResponse, base.noResponse)
	setIfNil(&v.streamError, base.streamError)
}

// apply sets the resolved verdicts, with their defaults, on s.
func (v verdicts) apply(s *BreakerSettings) {
	s.FailureStatuses, s.IgnoreStatuses = v.failure, v.ignore
	if s.FailureStatuses == nil {
		s.FailureStatuses = []string{"5xx"}
	}
	if s.IgnoreStatuses == nil {
		s.IgnoreStatuses = []string{"4xx"}
	}
	s.NoResponseAs, s.StreamErrorAs = "failure", "failure"
	if v.noResponse != nil {
		s.NoResponseAs = *v.noResponse
	}
	if v.streamError != nil {
		s.StreamErrorAs = *v.streamError
	}
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
	validateVerdicts(v, path, b)
}

// validateVerdicts checks record and ignore, and that no entry says the same thing twice: with a
// new key and its older form, or as both a failure and ignored.
func validateVerdicts(v *validator, path string, b Breaker) {
	for _, l := range []struct {
		key   string
		items []string
	}{{"record", b.Record}, {"ignore", b.Ignore}} {
		for i, it := range l.items {
			switch {
			case it != verdictTimeout && it != verdictStreamError && !validStatusPattern(it):
				v.add(path+"."+l.key+"["+strconv.Itoa(i)+"]", "%q is not a status code (100-599), a class (4xx, 5xx), timeout or stream_error", it)
			case it == "429":
				v.add(path+"."+l.key+"["+strconv.Itoa(i)+"]", "429 is judged by rate_limited_as, not by %s", l.key)
			}
		}
	}
	if b.Record != nil && b.FailureStatuses != nil {
		v.add(path+".failure_statuses", "failure_statuses is the older name of record's statuses: list them in record only")
	}
	if b.Ignore != nil && b.IgnoreStatuses != nil {
		v.add(path+".ignore_statuses", "ignore_statuses is the older name of ignore's statuses: list them in ignore only")
	}
	if b.NoResponseAs != nil && (slices.Contains(b.Record, verdictTimeout) || slices.Contains(b.Ignore, verdictTimeout)) {
		v.add(path+".no_response_as", "no_response_as is the older form of timeout in record or ignore: use one")
	}
	ignoreKey := ".ignore"
	if b.IgnoreStatuses != nil {
		ignoreKey = ".ignore_statuses"
	}
	vs := verdictsOf(b)
	if b.FailureStatuses != nil || b.Record != nil {
		for _, st := range vs.failure {
			if slices.Contains(vs.ignore, st) && (b.IgnoreStatuses != nil || b.Ignore != nil) {
				v.add(path+ignoreKey, "%s is listed both as failure and ignored", st)
			}
		}
	}
	for _, it := range []string{verdictTimeout, verdictStreamError} {
		if slices.Contains(b.Record, it) && slices.Contains(b.Ignore, it) {
			v.add(path+".ignore", "%s is listed both as failure and ignored", it)
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
