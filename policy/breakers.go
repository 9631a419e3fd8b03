package policy

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// maxModelBreakers bounds per-model breakers of one provider: model names come from clients.
const maxModelBreakers = 256

// breakerSet is the breaker of one provider, or its per-model breakers.
type breakerSet struct {
	provider string
	settings config.BreakerSettings
	cfg      breaker.Config
	perModel bool
	single   *breaker.Breaker

	mu     sync.Mutex
	models map[string]*breaker.Breaker
	engine *Engine
}

// For returns the breaker guarding calls to model, creating a per-model breaker on first use.
func (bs *breakerSet) For(model string) *breaker.Breaker {
	if !bs.perModel {
		return bs.single
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if b := bs.models[model]; b != nil {
		return b
	}
	if len(bs.models) >= maxModelBreakers {
		// Beyond the bound, unknown models share the provider-wide breaker.
		return bs.single
	}
	b, err := bs.engine.newBreaker(bs.provider+"/"+model, bs.settings, bs.cfg)
	if err != nil {
		return bs.single
	}
	bs.models[strings.Clone(model)] = b
	return b
}

// all returns every breaker of the set, provider-wide first, then models by name.
func (bs *breakerSet) all() []*breaker.Breaker {
	out := []*breaker.Breaker{bs.single}
	bs.mu.Lock()
	names := make([]string, 0, len(bs.models))
	for n := range bs.models {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		out = append(out, bs.models[n])
	}
	bs.mu.Unlock()
	return out
}

func (e *Engine) newBreaker(name string, s config.BreakerSettings, c breaker.Config) (*breaker.Breaker, error) {
	initial, err := breaker.ParseState(s.State)
	if err != nil {
		return nil, err
	}
	return breaker.New(name, c, e.clock.Now(), breaker.WithListener(e.onBreakerEvent), breaker.WithInitialState(initial))
}

func (e *Engine) onBreakerEvent(ev breaker.Event) {
	e.metrics.breakerEvent(ev)
	if ev.Kind == breaker.EventThresholdExceeded {
		e.log.Warn("breaker threshold exceeded (metrics only, not opening)", "breaker", ev.Name, "state", ev.To.String(),
			"reason", string(ev.Reason), "failure_rate", ev.FailureRate, "slow_rate", ev.SlowRate)
		return
	}
	e.log.Warn("breaker state changed", "breaker", ev.Name, "from", ev.From.String(), "to", ev.To.String(),
		"reason", string(ev.Reason), "failure_rate", ev.FailureRate, "slow_rate", ev.SlowRate)
}

// buildBreakers gives every provider with a breaker its breaker set, carrying breakers (state and
// window) over from prev by provider name.
func (s *Snapshot) buildBreakers(prev *Snapshot) error {
	old := map[string]*breakerSet{}
	if prev != nil {
		for _, pr := range prev.providers {
			if pr.breakers != nil {
				old[pr.name] = pr.breakers
			}
		}
	}
	for _, pr := range s.providers {
		pc, ok := s.Policy.Providers[pr.name]
		if !ok || pc.Breaker == "" {
			continue
		}
		settings := s.Policy.ResolveBreaker(pc.Breaker)
		cfg, err := settings.Config()
		if err != nil {
			return fmt.Errorf("providers.%s.breaker (%s): %w", pr.name, pc.Breaker, err)
		}
		bs := &breakerSet{provider: pr.name, settings: settings, cfg: cfg, perModel: pc.BreakerPerModel, engine: s.engine, models: map[string]*breaker.Breaker{}}
		if o := old[pr.name]; o != nil {
			if err := o.single.Reconfigure(cfg, s.built); err != nil {
				return fmt.Errorf("providers.%s.breaker (%s): %w", pr.name, pc.Breaker, err)
			}
			bs.single = o.single
			if bs.perModel && o.perModel {
				o.mu.Lock()
				for m, b := range o.models {
					if b.Reconfigure(cfg, s.built) == nil {
						bs.models[m] = b
					}
				}
				o.mu.Unlock()
			}
		} else {
			b, err := s.engine.newBreaker(pr.name, settings, cfg)
			if err != nil {
				return fmt.Errorf("providers.%s.breaker (%s): %w", pr.name, pc.Breaker, err)
			}
			bs.single = b
		}
		pr.breakers = bs
	}
	return nil
}

// applyBreakerStates moves carried-over breakers to their configured start state when the
// configuration of that state changed (an operator's forced state survives unrelated reloads).
func (s *Snapshot) applyBreakerStates(prev *Snapshot) {
	if prev == nil {
		return
	}
	for _, pr := range s.providers {
		if pr.breakers == nil {
			continue
		}
		j, ok := prev.providerIdx[pr.name]
		if !ok || prev.providers[j].breakers == nil || prev.providers[j].breakers.settings.State == pr.breakers.settings.State {
			continue
		}
		to, err := breaker.ParseState(pr.breakers.settings.State)
		if err != nil {
			continue
		}
		for _, b := range pr.breakers.all() {
			if err := b.Transition(to, s.built); err != nil {
				s.engine.log.Error("cannot move breaker to configured state", "breaker", b.Name(), "state", to.String(), "err", err)
			}
		}
	}
}

// breakerOutcome judges a finished call for the breaker of its provider: which outcome to
// record, the duration compared with slow_call_duration, and how long an upstream retry-after
// asks the breaker to stay open (0 for none).
func breakerOutcome(s config.BreakerSettings, o Outcome) (breaker.Outcome, time.Duration, time.Duration) {
	d := o.TTFB
	if s.SlowCallMeasure == "total" || o.Status == 0 {
		d = o.Duration
	}
	if o.Cancelled {
		return breaker.Ignored, d, 0
	}
	if o.Status == 0 {
		if s.NoResponseAs == "ignore" {
			return breaker.Ignored, d, 0
		}
		return breaker.Failure, d, 0
	}
	var openFor time.Duration
	if s.HonorRetryAfter && (o.Status == 429 || o.Status == 503) && o.RetryAfter > 0 {
		openFor = o.RetryAfter
	}
	if o.Status == 429 {
		switch s.RateLimitedAs {
		case "failure":
			return breaker.Failure, d, openFor
		case "ignore":
			return breaker.Ignored, d, openFor
		}
		return breaker.Success, d, openFor
	}
	for _, p := range s.FailureStatuses {
		if config.StatusMatches(p, o.Status) {
			return breaker.Failure, d, openFor
		}
	}
	for _, p := range s.IgnoreStatuses {
		if config.StatusMatches(p, o.Status) {
			return breaker.Ignored, d, openFor
		}
	}
	return breaker.Success, d, openFor
}
