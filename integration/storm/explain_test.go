package storm

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

func TestCompartmentLimits(t *testing.T) {
	views := []policy.CompartmentView{
		{Name: "feature/batch_summarize", MaxConcurrent: 5, MaxWait: "40ms"},
		{Name: "tier_feature/enterprise/batch_summarize", MaxConcurrent: 4, MaxWait: "3.2s", Budgets: []policy.BudgetView{
			{Kind: "tokens_per_minute", Capacity: 75000, Used: 75000},
			{Kind: "tokens_per_day", Capacity: 1000000},
			{Kind: "requests_per_minute", Capacity: 60},
		}},
		{Name: "tenant/acme", MaxConcurrent: 30, MaxWait: "3.2s"},
	}
	refusedBy := map[string]map[string]map[string]int{
		FeatureBatch: {"tier_feature/enterprise/batch_summarize": {"token_budget": 35}, "feature/batch_summarize": {"bulkhead_full": 2}},
	}
	got := compartmentLimits(views, refusedBy, 0.4)
	want := map[string]CompartmentLimits{
		"feature/batch_summarize": {MaxConcurrent: 5, MaxWait: "100ms"},
		"tier_feature/enterprise/batch_summarize": {MaxConcurrent: 4, MaxWait: "8s", TokensPerMinute: 75000,
			TokensPerDay: 1000000, RequestsPerMinute: 60},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("compartmentLimits =\n%+v\nwant\n%+v", got, want)
	}
	if got := compartmentLimits(views, nil, 1); got != nil {
		t.Errorf("no refusals, limits %+v", got)
	}
}

func TestRefusalsRecordTheirCompartment(t *testing.T) {
	r := &run{scale: 0.5, refusals: map[string]map[string]int{}, refusedBy: map[string]map[string]map[string]int{},
		errs: map[string]map[string]int{}, answered: map[string]int{}, tick: map[string]*FeatureTick{}}
	refusal := &envoysim.Result{Status: 429, Local: envoysim.LocalImmediate, Headers: envoysim.Headers{
		{Key: "x-bulkhead-reason", Value: "token_budget"},
		{Key: "x-bulkhead-compartment", Value: "tier_feature/enterprise/batch_summarize"},
		{Key: "retry-after", Value: "55"},
	}}
	s := r.sampleOf(refusal, time.Time{}, nil, "acme")
	if s.Outcome != OutcomeRefused || s.Compartment != "tier_feature/enterprise/batch_summarize" || s.RetryAfter != 55 {
		t.Fatalf("sample %+v", s)
	}
	r.record(FeatureBatch, s, false)
	r.record(FeatureBatch, s, false)
	if n := r.refusedBy[FeatureBatch]["tier_feature/enterprise/batch_summarize"]["token_budget"]; n != 2 || r.refusals[FeatureBatch]["token_budget"] != 2 {
		t.Errorf("refusedBy %v, refusals %v", r.refusedBy, r.refusals)
	}
	// An answer names no compartment and no wait, even when the response carries the headers.
	ok := r.sampleOf(&envoysim.Result{Status: 200, Headers: envoysim.Headers{{Key: "x-bulkhead-compartment", Value: "feature/chat"}}}, time.Time{}, nil, "acme")
	if ok.Compartment != "" || ok.RetryAfter != 0 {
		t.Errorf("answer sample %+v", ok)
	}
	// A refusal without a retry-after records none, though the job still waits a second.
	bare := &envoysim.Result{Status: 503, Local: envoysim.LocalImmediate, Headers: envoysim.Headers{{Key: "x-bulkhead-reason", Value: "bulkhead_full"}}}
	if s := r.sampleOf(bare, time.Time{}, nil, "acme"); s.RetryAfter != 0 || retryAfter(bare) != time.Second {
		t.Errorf("bare refusal %+v, retry %v", s, retryAfter(bare))
	}
}

func TestSettingCountsRuns(t *testing.T) {
	rep := fakeReport()
	if got := rep.Setting(); !strings.HasPrefix(got, "2 runs per configuration") || !strings.Contains(got, "random seed 1;") {
		t.Errorf("Setting = %q", got)
	}
	rep.Repeat = 1
	if got := rep.Setting(); !strings.HasPrefix(got, "1 run per configuration") {
		t.Errorf("Setting = %q", got)
	}
}
