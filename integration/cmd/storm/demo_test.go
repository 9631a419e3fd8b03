package main

import (
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/storm"
)

func TestDemoIntroSaysWhatTheCountsMean(t *testing.T) {
	sc := storm.DefaultScenario()
	sc.Duration = 20 * time.Second
	got := demoIntro(sc, 10, 0.4)
	for _, want := range []string{
		"30 chat users of acme and globex send 2K-token chat requests; 5s in, acme's export sends 50 5K-token\n",
		"serves\n10 at a time, first come first served.",
		"the export waits that long and sends the summary again, until the run ends at 20s.",
		"A document is\ndone when its summary comes back, and given up when its retry-after would end after the run.",
		"refused\nsince the last line, first tries and retries alike,",
		"(2.5× real time)",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("intro lacks %q:\n%s", want, got)
		}
	}

	// The numbers follow the scenario, and a job that does not retry is described as such.
	sc.Chat = []storm.TenantShare{{Tenant: "initech", Users: 3}}
	sc.ChatTokens = storm.Tokens{Prompt: 700, Completion: 50}
	sc.BatchWorkers, sc.BatchPerWorker, sc.BatchTenant = 2, 3, "globex"
	sc.StormAt, sc.Duration, sc.BatchRetry = 2*time.Second, 15*time.Second, false
	got = demoIntro(sc, 0, 0.1)
	for _, want := range []string{
		"3 chat users of initech send 750-token chat requests; 2s in, globex's export sends 6 5K-token\n",
		"serves\nany number at a time",
		"The export drops a refused summary\n(--batch-retry=false)",
		"The run ends at 15s.",
		"(10.0× real time)",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("intro lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "sends the summary again") {
		t.Errorf("intro promises retries the job does not make:\n%s", got)
	}
}

func TestExplainRun(t *testing.T) {
	sc := storm.DefaultScenario()
	sc.Duration = 20 * time.Second
	const tf = "tier_feature/enterprise/batch_summarize"
	r := &storm.RunResult{
		Batch: []storm.Sample{
			{Outcome: storm.OutcomeOK, Attempts: 3},
			{Outcome: storm.OutcomeOK, Attempts: 1},
			{Outcome: storm.OutcomeRefused, Reason: "token_budget", Compartment: tf, RetryAfter: 55, Attempts: 2},
			{Outcome: storm.OutcomeRefused, Reason: "token_budget", Compartment: tf, RetryAfter: 52, Attempts: 1},
			{Outcome: storm.OutcomeError, Reason: "message_timeout", Attempts: 1},
		},
		RefusedBy: map[string]map[string]map[string]int{
			storm.FeatureBatch: {
				tf:                        {"token_budget": 3, "bulkhead_full": 1},
				"feature/batch_summarize": {"bulkhead_full": 1},
			},
			storm.FeatureChat: {"tier_feature/pro/chat": {"token_budget": 2}},
		},
		Engine: &storm.EngineCounts{
			Limits: map[string]storm.CompartmentLimits{
				tf:                        {MaxConcurrent: 4, MaxWait: "100ms", TokensPerMinute: 75000},
				"feature/batch_summarize": {MaxConcurrent: 5},
				"tier_feature/pro/chat":   {TokensPerMinute: 60000, RequestsPerMinute: 30},
			},
			Reroutes: []storm.Reroute{{Feature: storm.FeatureBatch, From: "deepseek", To: "local", Reason: "token_budget", Count: 5}},
		},
	}
	want := []string{
		"batch: 5 documents in 8 requests (3 retries after a refusal): 2 summarised",
		"chat refused by tier_feature/pro/chat (60 000 tokens a minute = 30 chat requests of 2 000 tokens; 30 requests a minute): token_budget 2",
		"batch refused by " + tf + " (4 at once; 75 000 tokens a minute = 15 documents of 5 000 tokens): token_budget 3, bulkhead_full 1",
		"batch refused by feature/batch_summarize (5 at once): bulkhead_full 1",
		"batch re-routed instead of refused (token_budget): 5 from deepseek to local",
		"2 documents given up: refused token_budget by " + tf + " with retry-after 52–55 s, after the run's end (20s)",
		"1 document failed (message_timeout)",
	}
	got := explainRun(r, sc)
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("explainRun =\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	// Without retries a refused document is dropped, not given up on a retry-after.
	sc.BatchRetry = false
	if got := endings(r.Batch[2:4], sc); len(got) != 1 || got[0] != "2 documents dropped after a refusal (token_budget by "+tf+")" {
		t.Errorf("endings without retries = %q", got)
	}
	// A run with no batch job and no refusals has nothing to explain.
	if got := explainRun(&storm.RunResult{}, sc); len(got) != 0 {
		t.Errorf("explainRun of a quiet run = %q", got)
	}
}

func TestWording(t *testing.T) {
	for _, tt := range []struct{ got, want string }{
		{plural(1, "document"), "1 document"},
		{plural(0, "document"), "0 documents"},
		{plural(2, "retry"), "2 retries"},
		{plural(1, "retry"), "1 retry"},
		{joinAnd(nil), ""},
		{joinAnd([]string{"a"}), "a"},
		{joinAnd([]string{"a", "b"}), "a and b"},
		{joinAnd([]string{"a", "b", "c"}), "a, b and c"},
		{kilo(2000), "2K"},
		{kilo(2500), "2500"},
		{kilo(0), "0"},
		{thousands(75000), "75 000"},
		{thousands(500), "500"},
		{thousands(1234567), "1 234 567"},
		{thousands(-1000), "-1 000"},
		{secondsRange(55, 55), "55 s"},
		{secondsRange(1, 2.5), "1–2.5 s"},
	} {
		if tt.got != tt.want {
			t.Errorf("got %q, want %q", tt.got, tt.want)
		}
	}
}
