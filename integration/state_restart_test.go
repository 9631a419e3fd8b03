package integration_test

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy/statefile"
)

// spendStatePolicy prices deepseek at $1 000 per million tokens ($0.001 a token) and gives the
// chat feature $100 a day, kept in the state file at path, written every second.
const spendStatePolicy = `
envoy: {max_message_timeout: 30s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    default: deepseek
    rules: [{model_map: true}]
  model:
    rules: [{body: model}]
models:
  - {match: "deepseek-*", provider: deepseek}
prices:
  - {match: "deepseek-*", input_per_mtok: 1000, output_per_mtok: 1000}
features:
  chat:
    max_concurrent: 20
    spend_per_day: 100.00
  default: {max_concurrent: 10}
providers:
  deepseek: {}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
spend:
  state_file: %s
  state_interval: 1s
`

// pricedChat is a chat request whose response reports 100 prompt and 50 completion tokens:
// it settles at exactly $0.15.
func pricedChat() *envoysim.Request {
	body := fmt.Sprintf(`{"model":"deepseek-chat","max_tokens":100,"messages":[{"role":"user","content":"%s"}]}`, strings.Repeat("a", 400))
	return &envoysim.Request{
		Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: "chat"},
			{Key: mock.HeaderCompletionTokens, Value: "5"},
			{Key: mock.HeaderReportPrompt, Value: "100"}, {Key: mock.HeaderReportCompletion, Value: "50"},
			{Key: mock.HeaderReportTotal, Value: "150"}},
		Body: []byte(body),
	}
}

const chatCost = 0.15

// spendProcess is one llm-bulkhead process of the restart test.
type spendProcess struct {
	t    *testing.T
	r    *harness.Replica
	up   envoysim.Upstream
	name string
}

func startSpendProcess(t *testing.T, name, policy string, up envoysim.Upstream) *spendProcess {
	t.Helper()
	r, err := harness.StartReplica(harness.ReplicaOptions{Name: name, PolicyPath: policy,
		Filter: func(f *envoysim.FilterConfig) { f.MessageTimeout = 30 * time.Second }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("stopping %s: %v", name, err)
		}
		if n := r.Races(); n > 0 {
			t.Errorf("%s reported %d data races:\n%s", name, n, r.Tail())
		} else if t.Failed() {
			t.Logf("%s, last log lines:\n%s", name, r.Tail())
		}
	})
	return &spendProcess{t: t, r: r, up: up, name: name}
}

// spend sends n priced chat requests, each answered 200.
func (p *spendProcess) spend(n int) {
	p.t.Helper()
	for range n {
		res, err := p.r.Do(context.Background(), pricedChat(), p.up)
		if err != nil || res.Status != 200 {
			p.t.Fatalf("%s: %v %v", p.name, res, err)
		}
	}
}

// used is chat's spend this day as the process reports it (nothing is in flight).
func (p *spendProcess) used() float64 {
	p.t.Helper()
	return replicaMetric(p.t, p.r, "llm_bulkhead_spend_budget_used", "compartment", "feature/chat", "period", "day")
}

// saved waits until the state file holds what the process counts (a write or an unchanged
// check after the last settlement) and returns what it holds.
func (p *spendProcess) saved(path string) float64 {
	p.t.Helper()
	want := p.used()
	var got float64
	clusterWait(p.t, fmt.Sprintf("the state file to hold $%.2f", want), func() bool {
		st, err := statefile.Read(path)
		if err != nil {
			return false
		}
		got = 0
		for _, w := range st.Spend {
			if w.Budget == "feature/chat" && w.Period == "day" {
				got = float64(w.Settled+w.InFlight) / 1e6
			}
		}
		return near(got, want)
	})
	return got
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

// TestSpendSurvivesRestart: spend counted by one process is there when the next starts on the
// same state file. After SIGTERM exactly (the file is written once the streams drained); after
// SIGKILL up to the settlements of the last state_interval, exactly when the last write came
// after the last settlement, and with a request that was in flight counted at its reservation.
func TestSpendSurvivesRestart(t *testing.T) {
	if now := time.Now().UTC(); now.Add(2*time.Minute).Day() != now.Day() {
		// The budget is per UTC day: a test running over midnight would see it reset.
		t.Skip("too close to midnight UTC: chat's daily spend budget would reset during the test")
	}
	up := startMockLLM(t, mock.Options{TimeScale: 0.01})
	dir := t.TempDir()
	state := filepath.Join(dir, "spend.json")
	policy := writePolicy(t, fmt.Sprintf(spendStatePolicy, state))

	// The first start finds no file: spend starts empty, and says so.
	p := startSpendProcess(t, "first", policy, up)
	if v := replicaMetric(t, p.r, "llm_bulkhead_spend_state_restore_failures_total", "reason", "missing"); v != 1 {
		t.Fatalf("restore failures (missing) on a first start: %v", v)
	}
	p.spend(4)
	if got := p.used(); !near(got, 4*chatCost) {
		t.Fatalf("after 4 requests chat used $%v, want $%.2f", got, 4*chatCost)
	}

	// SIGTERM: the next process continues exactly where this one stopped.
	if err := p.r.Stop(20 * time.Second); err != nil {
		t.Fatal(err)
	}
	p = startSpendProcess(t, "after SIGTERM", policy, up)
	if got := p.used(); !near(got, 4*chatCost) {
		t.Fatalf("after SIGTERM and restart chat used $%v, want $%.2f", got, 4*chatCost)
	}
	if v := replicaMetric(t, p.r, "llm_bulkhead_spend_state_restored_windows", "kind", "spend"); v != 1 {
		t.Errorf("restored windows %v, want 1", v)
	}
	p.spend(3)

	// SIGKILL after the interval wrote the last settlement: nothing is lost.
	want := p.saved(state)
	if !near(want, 7*chatCost) {
		t.Fatalf("state file holds $%v, want $%.2f", want, 7*chatCost)
	}
	p.r.Kill()
	p = startSpendProcess(t, "after SIGKILL", policy, up)
	if got := p.used(); !near(got, 7*chatCost) {
		t.Fatalf("after SIGKILL and restart chat used $%v, want $%.2f", got, 7*chatCost)
	}

	// SIGKILL right after more requests: at most what was settled since the last write is lost.
	before := p.used()
	p.spend(2)
	p.r.Kill()
	p = startSpendProcess(t, "after a second SIGKILL", policy, up)
	got := p.used()
	if got < before-1e-9 || got > before+2*chatCost+1e-9 {
		t.Fatalf("after SIGKILL mid-interval chat used $%v: want between $%.2f (the last write) and $%.2f", got, before, before+2*chatCost)
	}
	// Restoring never double-counts: the restored spend is what the file held, whatever
	// restarted how often.
	if st, err := statefile.Read(state); err == nil {
		for _, w := range st.Spend {
			if w.Budget == "feature/chat" && float64(w.Settled+w.InFlight)/1e6 > before+2*chatCost+1e-9 {
				t.Errorf("state file holds $%v for chat, more than was ever spent", float64(w.Settled+w.InFlight)/1e6)
			}
		}
	}

	// A request in flight when the process is killed: the file holds its reservation, and the
	// next process counts it as spent (its settlement never comes; the reservation is the most
	// it can have cost).
	before = p.used()
	g := newGate()
	done := make(chan struct{})
	go func() {
		_, _ = p.r.Do(context.Background(), pricedChat(), g)
		close(done)
	}()
	<-g.arrived
	inFlight := p.saved(state)
	reserved := inFlight - before
	if reserved <= chatCost {
		t.Fatalf("state file holds $%v with a request in flight, $%v before it: want its reservation (its worst case, above $%.2f) in it",
			inFlight, before, chatCost)
	}
	p.r.Kill()
	g.release <- struct{}{}
	<-done
	p = startSpendProcess(t, "after SIGKILL with a request in flight", policy, up)
	if got := p.used(); !near(got, inFlight) {
		t.Fatalf("after SIGKILL with a request in flight chat used $%v, want $%v (its reservation counted as spent)", got, inFlight)
	}
}

// TestSpendCorruptStateFile: a damaged state file does not stop the process: it starts with
// empty spend budgets, logs why at error level, counts it, and keeps the file aside.
func TestSpendCorruptStateFile(t *testing.T) {
	up := startMockLLM(t, mock.Options{TimeScale: 0.01})
	dir := t.TempDir()
	state := filepath.Join(dir, "spend.json")
	policy := writePolicy(t, fmt.Sprintf(spendStatePolicy, state))
	p := startSpendProcess(t, "first", policy, up)
	p.spend(2)
	if err := p.r.Stop(20 * time.Second); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(state)
	if err != nil {
		t.Fatal(err)
	}
	// A full disk, a bad copy: the file is cut short.
	if err := os.WriteFile(state, data[:len(data)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	p = startSpendProcess(t, "on a truncated file", policy, up)
	if got := p.used(); got != 0 {
		t.Errorf("chat used $%v after a corrupt state file, want an empty budget", got)
	}
	if v := replicaMetric(t, p.r, "llm_bulkhead_spend_state_restore_failures_total", "reason", "corrupt"); v != 1 {
		t.Errorf("restore failures (corrupt): %v", v)
	}
	if !strings.Contains(p.r.Tail(), `"level":"ERROR","msg":"state not restored: every budget starts empty`) || !strings.Contains(p.r.Tail(), state) {
		t.Errorf("no error line naming the file:\n%s", p.r.Tail())
	}
	aside, _ := filepath.Glob(state + ".bad-*")
	if len(aside) != 1 {
		t.Fatalf("the corrupt file was not kept aside: %v", aside)
	}
	if kept, _ := os.ReadFile(aside[0]); string(kept) != string(data[:len(data)/2]) {
		t.Error("the file kept aside is not the corrupt file")
	}
	// And the process serves and counts spend again.
	p.spend(1)
	if got := p.used(); !near(got, chatCost) {
		t.Errorf("chat used $%v after one request, want $%.2f", got, chatCost)
	}
}

// tokenStatePolicy gives every tenant 900 tokens a day in a compartment of its own, kept in the
// state file at path, written every second.
const tokenStatePolicy = `
envoy: {max_message_timeout: 30s}
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  provider:
    default: deepseek
    rules: [{model_map: true}]
  model:
    rules: [{body: model}]
models:
  - {match: "deepseek-*", provider: deepseek}
tiers:
  free: {max_concurrent: 20, tokens_per_day: 900}
providers:
  deepseek: {}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant, max_instances: 100}
state:
  file: %s
  interval: 1s
`

// tenantChat is pricedChat for tenant: 150 tokens once settled.
func tenantChat(tenant string) *envoysim.Request {
	r := pricedChat()
	r.Headers = append(r.Headers, envoysim.Header{Key: "x-tenant-id", Value: tenant})
	return r
}

// tokensToday is what tenant's compartment counts of its tokens_per_day in p.
func (p *spendProcess) tokensToday(tenant string) int64 {
	p.t.Helper()
	c := mustCompartment(p.t, p.r, "tenant/"+tenant)
	for _, b := range c.Budgets {
		if b.Kind == "tokens_per_day" {
			return b.Used
		}
	}
	p.t.Fatalf("%s: tenant/%s has no tokens_per_day", p.name, tenant)
	return 0
}

// do sends tenant's chat request and returns the result.
func (p *spendProcess) do(tenant string) *envoysim.Result {
	p.t.Helper()
	res, err := p.r.Do(context.Background(), tenantChat(tenant), p.up)
	if err != nil {
		p.t.Fatalf("%s: %v", p.name, err)
	}
	return res
}

// TestTokenBudgetSurvivesRestart: the tokens a tenant used of its tokens_per_day still count
// after the process restarts on the same state file — after SIGTERM exactly, after SIGKILL as of
// the file's last write — so the request that would have been refused before the restart is
// refused after it, while a tenant the file does not know has its whole budget.
func TestTokenBudgetSurvivesRestart(t *testing.T) {
	up := startMockLLM(t, mock.Options{TimeScale: 0.01})
	state := filepath.Join(t.TempDir(), "state.json")
	policy := writePolicy(t, fmt.Sprintf(tokenStatePolicy, state))

	p := startSpendProcess(t, "first", policy, up)
	for i := range 5 {
		if res := p.do("acme"); res.Status != 200 {
			t.Fatalf("acme's request %d: %d %s", i+1, res.Status, header(res, "x-bulkhead-reason"))
		}
	}
	if got := p.tokensToday("acme"); got != 5*150 {
		t.Fatalf("acme used %d tokens today, want 750", got)
	}
	// 750 of 900 used: the next request's estimate does not fit.
	if res := p.do("acme"); res.Status != 429 || header(res, "x-bulkhead-reason") != "token_budget" {
		t.Fatalf("acme's 6th request before the restart: %d %s, want 429 token_budget", res.Status, header(res, "x-bulkhead-reason"))
	}

	if err := p.r.Stop(20 * time.Second); err != nil {
		t.Fatal(err)
	}
	p = startSpendProcess(t, "after SIGTERM", policy, up)
	if v := replicaMetric(t, p.r, "llm_bulkhead_spend_state_restored_windows", "kind", "tokens_per_day"); v != 1 {
		t.Errorf("restored tokens_per_day windows %v, want acme's", v)
	}
	if res := p.do("acme"); res.Status != 429 || header(res, "x-bulkhead-reason") != "token_budget" || header(res, "x-bulkhead-compartment") != "tenant/acme" {
		t.Fatalf("acme after the restart: %d %s in %s, want 429 token_budget in tenant/acme (750 of 900 tokens used today)",
			res.Status, header(res, "x-bulkhead-reason"), header(res, "x-bulkhead-compartment"))
	}
	if got := p.tokensToday("acme"); got != 750 {
		t.Fatalf("acme used %d tokens today after the restart, want 750", got)
	}
	if res := p.do("initech"); res.Status != 200 {
		t.Fatalf("initech, unknown to the state file: %d %s", res.Status, header(res, "x-bulkhead-reason"))
	}

	// SIGKILL once the interval wrote initech's tokens: they count after the restart too.
	clusterWait(t, "the state file to hold initech's 150 tokens", func() bool {
		st, err := statefile.Read(state)
		if err != nil {
			return false
		}
		for _, w := range st.Windows {
			if slices.Equal(w.Values, []string{"initech"}) && w.Kind == statefile.KindTokensPerDay {
				return len(w.Slots) > 0 && w.Slots[len(w.Slots)-1].Amount == 150
			}
		}
		return false
	})
	p.r.Kill()
	p = startSpendProcess(t, "after SIGKILL", policy, up)
	if res := p.do("initech"); res.Status != 200 {
		t.Fatalf("initech after SIGKILL: %d %s", res.Status, header(res, "x-bulkhead-reason"))
	}
	if got := p.tokensToday("initech"); got != 300 {
		t.Fatalf("initech used %d tokens today after SIGKILL and one more request, want 300", got)
	}
	if res := p.do("acme"); res.Status != 429 || header(res, "x-bulkhead-reason") != "token_budget" {
		t.Fatalf("acme after two restarts: %d %s, want 429 token_budget", res.Status, header(res, "x-bulkhead-reason"))
	}
}
