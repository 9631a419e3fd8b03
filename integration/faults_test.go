package integration_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// Environment variables that replay or lengthen the fault suite.
const (
	faultSeedEnv   = "LLM_BULKHEAD_FAULT_SEED"
	faultRoundsEnv = "LLM_BULKHEAD_FAULT_ROUNDS"
)

// faultPolicy has a per-day budget on every feature, so nothing ages out during the run and each
// budget's use can be compared with what was settled; batch's is small, so it refuses, goes
// into debt and meets its debt bound. Breakers stay open, and upstream retry-after holds last,
// for tens of milliseconds, a small part of a round. Chat may wait longer than Envoy's message
// timeout (200 ms), so its queued requests get override_message_timeout.
const faultPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    rules: [{header: x-llm-provider}]
features:
  chat: {max_concurrent: %d, max_wait: 300ms, tokens_per_day: 100000000}
  batch: {max_concurrent: 4, max_wait: 0s, tokens_per_day: %d, max_debt: %v}
  default: {max_concurrent: 10, max_wait: 20ms, tokens_per_day: 100000000}
providers:
  default: {breaker: std, fallback: spare}
  spare: {breaker: std}
breakers:
  std: {sliding_window_size: 20, minimum_calls: 10, wait_in_open: 10ms, max_wait_in_open: 20ms, permitted_calls_in_half_open: 2}
`

// faultBatchBudgets are the batch budgets reloads choose from; faultMaxDebt is batch's max_debt.
var faultBatchBudgets = []int64{600, 900, 1500}

const faultMaxDebt = 0.5

// brokenPolicies are reloads that must be refused, each for a different reason, leaving the
// running policy in place.
var brokenPolicies = []string{
	"features: [this is: not valid\n",
	"features: {default: {max_concurrent: -1}}\n",
	"# every limit commented out\n",
	// A restart-only setting changed.
	strings.Replace(fmt.Sprintf(faultPolicy, 3, 600, faultMaxDebt), "allow_mode_override: true}", "allow_mode_override: true, max_request_body: 1048576}", 1),
}

const faultAdminToken = "fault-token"

// TestFaultRounds drives seeded rounds of requests through the simulator, the server and the
// mock LLM, each ending a random way (normally, Envoy resetting or half-closing the stream, the
// client leaving before the reply, while queued or mid-stream, the upstream failing before its
// headers, Envoy's message timer firing) with a random response shape (JSON or SSE usage of
// each API, 429/500/503 with and without retry-after, no usage, usage that is inconsistent,
// absurd or negative, a connection cut mid-body), while the policy is reloaded (valid and
// invalid files) and breakers are forced by an operator. After every round nothing is held or
// queued, every admission was released exactly once, every budget used exactly what was settled
// (within its debt bound), and no panic was recovered.
func TestFaultRounds(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv(faultSeedEnv); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("%s=%q: %v", faultSeedEnv, v, err)
		}
	}
	rounds := 10
	if testing.Short() {
		rounds = 3
	}
	if v := os.Getenv(faultRoundsEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("%s=%q: want a positive number", faultRoundsEnv, v)
		}
		rounds = n
	}
	t.Logf("seed %d (replay with %s=%d)", seed, faultSeedEnv, seed)
	rng := rand.New(rand.NewPCG(seed, 0x5eed))

	path := writePolicy(t, fmt.Sprintf(faultPolicy, 3, faultBatchBudgets[0], faultMaxDebt))
	s := start(t, harness.Options{PolicyPath: path, Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=" + faultAdminToken},
		Mock: mock.Options{TimeScale: 0.01, Seed: seed}})
	r := &faultRun{t: t, s: s, path: path, gen: s.App.Engine().Snapshot().Gen(), seen: map[string]int{}}
	for round := range rounds {
		// One seeded generator per round, drawn from the run's, so a round's plan does not
		// depend on how many draws earlier rounds made.
		r.round(round, rand.New(rand.NewPCG(rng.Uint64(), uint64(round))))
		if t.Failed() {
			t.Fatalf("round %d failed (seed %d)", round, seed)
		}
	}
	if got := s.App.Engine().Snapshot().Gen(); got != r.gen {
		t.Errorf("generation %d after the run, want %d (1 + the valid reloads)", got, r.gen)
	}
	if got := metricSum(t, s, "llm_bulkhead_config_reload_errors_total"); got != float64(r.refused) {
		t.Errorf("%v reload errors counted, want %d", got, r.refused)
	}
	t.Logf("what the requests met: %v", r.seen)
	if r.admitted == 0 || r.refusedRequests == 0 {
		t.Errorf("%d admitted, %d refused over the run: the mix did not exercise both", r.admitted, r.refusedRequests)
	}
}

// faultRun is the state of one TestFaultRounds run.
type faultRun struct {
	t    *testing.T
	s    *harness.Stack
	path string
	// gen is the policy generation the run expects; refused counts reloads that had to fail.
	gen     uint64
	refused int
	// admitted and refusedRequests count, over the run, the requests the server let through
	// and the ones it refused itself (from their dynamic metadata).
	admitted, refusedRequests int
	// seen counts what requests met, for the log: a run that stops exercising something shows.
	seen map[string]int
}

// faultCase is one planned request: drawn in the planning goroutine, run in its own.
type faultCase struct {
	feature, provider string
	api               apiCase
	stream            bool
	shape             string
	faults            envoysim.Headers
	ending            string
	graceful          bool
}

// String describes c in failure messages.
func (c faultCase) String() string {
	mode := "json"
	if c.stream {
		mode = "sse"
	}
	return fmt.Sprintf("%s/%s %s %s shape=%s ending=%s graceful=%v", c.feature, c.provider, c.api.name, mode, c.shape, c.ending, c.graceful)
}

// Response shapes the mock LLM is asked for (its fault headers).
var faultShapes = []struct {
	name    string
	headers envoysim.Headers
}{
	{"ok", nil},
	{"ok", nil},
	{"ok", nil},
	{"ok", nil},
	{"ok", nil},
	{"ok", nil},
	{"429", envoysim.Headers{{Key: mock.HeaderStatus, Value: "429"}}},
	{"429_retry_after", envoysim.Headers{{Key: mock.HeaderStatus, Value: "429"}, {Key: mock.HeaderRetryAfter, Value: "1"}}},
	{"500", envoysim.Headers{{Key: mock.HeaderStatus, Value: "500"}}},
	{"503", envoysim.Headers{{Key: mock.HeaderStatus, Value: "503"}}},
	{"503_retry_after", envoysim.Headers{{Key: mock.HeaderStatus, Value: "503"}, {Key: mock.HeaderRetryAfter, Value: "1"}}},
	{"no_usage", envoysim.Headers{{Key: mock.HeaderNoUsage, Value: "1"}}},
	{"total_below_prompt", envoysim.Headers{{Key: mock.HeaderReportPrompt, Value: "40"}, {Key: mock.HeaderReportCompletion, Value: "5"}, {Key: mock.HeaderReportTotal, Value: "3"}}},
	// Large enough to ground every budget, small enough to be read as numbers.
	{"absurd", envoysim.Headers{{Key: mock.HeaderReportPrompt, Value: "900000000000"}, {Key: mock.HeaderReportCompletion, Value: "800000000000"}}},
	{"absurd_total", envoysim.Headers{{Key: mock.HeaderReportTotal, Value: "500000000000"}}},
	// Beyond any count a reader believes.
	{"beyond_belief", envoysim.Headers{{Key: mock.HeaderReportPrompt, Value: "900000000000000"}, {Key: mock.HeaderReportTotal, Value: "9000000000000000000"}}},
	{"negative", envoysim.Headers{{Key: mock.HeaderReportPrompt, Value: "-50"}, {Key: mock.HeaderReportCompletion, Value: "-7"}, {Key: mock.HeaderReportTotal, Value: "-57"}}},
	{"cut_mid_body", envoysim.Headers{{Key: mock.HeaderDisconnectAfter, Value: "2"}}},
	// A 200 whose body then reports an error: overloaded (a failure) or a rate limit (a 429).
	{"stream_error_overloaded", envoysim.Headers{{Key: mock.HeaderStreamError, Value: "529"}}},
	{"stream_error_rate_limit", envoysim.Headers{{Key: mock.HeaderStreamError, Value: "429"}}},
	// Headers at once, the first token late.
	{"first_token_late", envoysim.Headers{{Key: mock.HeaderFirstTokenDelay, Value: "2s"}}},
}

// How a request ends.
var faultEndings = []string{
	"normal", "normal", "normal", "normal", "normal",
	"cancel_before_headers_reply", // the client leaves before the request-headers reply
	"cancel_after_body",           // the client leaves while the body is judged (or queued)
	"cancel_while_queued",         // the client leaves once the server asked Envoy to wait
	"cancel_mid_stream",           // the client leaves after the first body chunk it got
	"upstream_connect_failure",    // no response headers: connection refused
	"upstream_timeout",            // no response headers: the route timed out
	"message_timeout",             // Envoy's message timer fires on the server
}

// plan draws one request.
func plan(rng *rand.Rand) faultCase {
	shape := faultShapes[rng.IntN(len(faultShapes))]
	c := faultCase{
		feature:  []string{"chat", "batch", "default"}[rng.IntN(3)],
		provider: []string{"default", "spare"}[rng.IntN(2)],
		api:      apis[rng.IntN(len(apis))],
		shape:    shape.name,
		faults:   shape.headers,
		ending:   faultEndings[rng.IntN(len(faultEndings))],
		graceful: rng.IntN(2) == 0,
	}
	c.stream = c.api.stream && (rng.IntN(3) > 0 || c.api.onlyStream)
	return c
}

// request builds c's request for the stack's filter and the upstream it goes to.
func (c faultCase) request(s *harness.Stack) (*envoysim.Request, envoysim.Upstream) {
	h := envoysim.Headers{{Key: "content-type", Value: "application/json"},
		{Key: "x-llm-feature", Value: c.feature}, {Key: "x-llm-provider", Value: c.provider}}
	h = append(h, c.faults...)
	filter := s.Filter
	filter.GracefulClose = c.graceful
	req := &envoysim.Request{Method: "POST", Path: c.api.pathFor(c.stream), Headers: h, Body: []byte(c.api.body(c.stream)), Filter: &filter}
	var up envoysim.Upstream = s.Upstream
	switch c.ending {
	case "cancel_before_headers_reply":
		req.OnEvent = envoysim.CancelWhenSent(envoysim.KindRequestHeaders, 1)
	case "cancel_after_body":
		req.OnEvent = envoysim.CancelWhenSent(envoysim.KindRequestBody, 1)
	case "cancel_while_queued":
		req.OnEvent = func(e envoysim.Event) envoysim.Action {
			if e.Kind == envoysim.EventReceived && e.Received.GetOverrideMessageTimeout() != nil {
				return envoysim.Cancel
			}
			return envoysim.Proceed
		}
	case "cancel_mid_stream":
		req.OnEvent = envoysim.CancelAfterDownstreamChunks(1)
	case "upstream_connect_failure":
		up = envoysim.Failing(envoysim.ConnectFailure)
	case "upstream_timeout":
		up = envoysim.Failing(envoysim.UpstreamTimeout)
	case "message_timeout":
		// Shorter than any reply can take: the timer fires on the first message.
		req.MessageTimeout = time.Microsecond
	}
	return req, up
}

// round runs one round: requests in parallel, reloads and breaker changes among them, then the
// checks.
func (r *faultRun) round(round int, rng *rand.Rand) {
	t, s := r.t, r.s
	const requests, parallel = 60, 12
	var (
		wg  sync.WaitGroup
		mu  sync.Mutex
		sem = make(chan struct{}, parallel)
	)
	// Each round starts with closed breakers: a breaker an operator left forced open would
	// refuse everything after it.
	for _, name := range []string{"default", "spare"} {
		r.forceBreaker(name, "CLOSED")
	}
	for i := range requests {
		// Operator actions happen while earlier requests of the round are still running.
		switch rng.IntN(20) {
		case 0, 1:
			r.reload(rng)
		case 2:
			r.forceBreaker([]string{"default", "spare"}[rng.IntN(2)],
				[]string{"FORCED_OPEN", "CLOSED", "METRICS_ONLY", "DISABLED", "OPEN", "HALF_OPEN"}[rng.IntN(6)])
		}
		c := plan(rng)
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			req, up := c.request(s)
			res, err := s.Sim.RoundTrip(context.Background(), req, up)
			if err != nil {
				t.Errorf("round %d request %d (%v): %v", round, i, c, err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			r.checkResult(round, i, c, res)
		}()
	}
	wg.Wait()
	r.checkSettled(round)
}

// checkResult checks what one request's client and Envoy saw.
func (r *faultRun) checkResult(round, i int, c faultCase, res *envoysim.Result) {
	t := r.t
	for _, p := range res.Problems {
		// A message timer that fires before the reply makes the reply late; nothing else is
		// allowed: every other problem is the server breaking the protocol.
		if c.ending == "message_timeout" && (p.Kind == envoysim.ProblemTimeout || p.Kind == envoysim.ProblemLateReply) {
			continue
		}
		t.Errorf("round %d request %d (%v): protocol problem %v: %s", round, i, c, p.Kind, p.Detail)
	}
	md := res.DynamicMetadata["llm_bulkhead"].GetFields()
	decision := md["decision"].GetStringValue()
	switch decision {
	case "admitted", "rerouted":
		r.admitted++
	case "rejected":
		r.refusedRequests++
		decision += "/" + md["reason"].GetStringValue()
	case "":
		decision = "undecided"
	}
	r.seen["decision="+decision]++
	r.seen[fmt.Sprintf("status=%d", res.Status)]++
	r.seen["ending="+c.ending+"/"+res.Stream.String()]++
	if res.Reset {
		r.seen["client_saw_reset"]++
	}
	for _, rec := range res.Exchange {
		if rec.Received.GetOverrideMessageTimeout() != nil {
			r.seen["queued"]++
			break
		}
	}
	// Whatever a provider claims, one request never settles to more than it could have cost:
	// each part is clamped, at worst to estimation.max_tokens (10^6).
	if total := md["total_tokens"].GetNumberValue(); total < 0 || total > 2e6 {
		t.Errorf("round %d request %d (%v): settled to %v tokens", round, i, c, total)
	}
}

// checkSettled waits for the round's streams to end, then checks that nothing is held,
// admissions and releases match, budgets used what was settled, and nothing panicked.
func (r *faultRun) checkSettled(round int) {
	t, s := r.t, r.s
	// Streams release what they hold as they close, on the server's goroutines: wait for that
	// (the bound only guards against a leak), and on a leak go on to say what is held.
	deadline := time.Now().Add(10 * time.Second)
	for s.App.ExtProc().ActiveStreams() != 0 || s.App.Engine().InFlight() != 0 {
		if time.Now().After(deadline) {
			t.Errorf("round %d: %d streams open and %d requests in flight 10s after the last request ended",
				round, s.App.ExtProc().ActiveStreams(), s.App.Engine().InFlight())
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	var view struct {
		InFlight     int64                    `json:"in_flight"`
		Compartments []policy.CompartmentView `json:"compartments"`
	}
	if err := s.Get("/admin/compartments", &view); err != nil {
		t.Fatal(err)
	}
	if view.InFlight != 0 {
		t.Errorf("round %d: /admin/compartments in_flight %d", round, view.InFlight)
	}
	for _, c := range view.Compartments {
		if c.InFlight != 0 || c.Queued != 0 || c.InFlightTokens != 0 {
			t.Errorf("round %d: %s holds %d in flight (%d tokens), %d queued", round, c.Name, c.InFlight, c.InFlightTokens, c.Queued)
		}
	}

	admitted := metricSum(t, s, "llm_bulkhead_admitted_total")
	ended := metricSum(t, s, "llm_bulkhead_extproc_admitted_streams_ended_total")
	released := metricSum(t, s, "llm_bulkhead_extproc_admitted_streams_released_total")
	if admitted != ended || ended != released {
		t.Errorf("round %d: %v admitted by the policy, %v admitted streams ended, %v released", round, admitted, ended, released)
	}
	if p := metricSum(t, s, "llm_bulkhead_extproc_panics_total"); p != 0 {
		t.Errorf("round %d: %v panics recovered", round, p)
	}

	maxBudget := faultBatchBudgets[0]
	for _, b := range faultBatchBudgets {
		maxBudget = max(maxBudget, b)
	}
	for _, c := range view.Compartments {
		if c.Family != "feature" {
			continue
		}
		feature := c.Name[len("feature/"):]
		settled := metricSum(t, s, "llm_bulkhead_tokens_settled_total", "feature", feature)
		for _, b := range c.Budgets {
			if b.Kind != "tokens_per_day" {
				continue
			}
			used := float64(b.Used)
			if feature != "batch" {
				// Far from its bound, a budget charges exactly what was settled.
				if used != settled || b.Forgiven != 0 {
					t.Errorf("round %d: %s used %d (forgave %d), but %v were settled", round, c.Name, b.Used, b.Forgiven, settled)
				}
				continue
			}
			// At its debt bound a budget stops charging: it never charges more than was
			// settled, never goes past the bound, and what it did not charge is counted as
			// forgiven.
			bound := int64(float64(maxBudget) * (1 + faultMaxDebt))
			if used > settled || b.Used > bound || settled-used > float64(b.Forgiven) {
				t.Errorf("round %d: %s used %d (bound %d, forgave %d), but %v were settled", round, c.Name, b.Used, bound, b.Forgiven, settled)
			}
		}
	}
}

// reload rewrites the policy file, valid with new limits or broken, and reloads it.
func (r *faultRun) reload(rng *rand.Rand) {
	t, s := r.t, r.s
	broken := rng.IntN(3) == 0
	body := brokenPolicies[rng.IntN(len(brokenPolicies))]
	if !broken {
		body = fmt.Sprintf(faultPolicy, 1+rng.IntN(4), faultBatchBudgets[rng.IntN(len(faultBatchBudgets))], faultMaxDebt)
	}
	if err := os.WriteFile(r.path, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	err := s.App.Reload("fault suite")
	switch {
	case broken && err == nil:
		t.Errorf("a broken policy was accepted on reload:\n%s", body)
		r.gen++
	case broken:
		r.refused++
	case err != nil:
		t.Errorf("a valid policy was refused on reload: %v", err)
	default:
		r.gen++
	}
	if got := s.App.Engine().Snapshot().Gen(); got != r.gen {
		t.Errorf("generation %d after a reload, want %d", got, r.gen)
	}
}

// forceBreaker sets breaker name to state through the admin API, as an operator does.
func (r *faultRun) forceBreaker(name, state string) {
	t, s := r.t, r.s
	req, err := http.NewRequest("POST", s.AdminURL()+"/admin/breakers/"+name, bytes.NewBufferString(`{"state":"`+state+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+faultAdminToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	// Some moves are refused by design (CLOSED cannot go to HALF_OPEN without an opening).
	illegal := resp.StatusCode == http.StatusBadRequest && strings.Contains(string(body), "cannot move from")
	if resp.StatusCode != http.StatusOK && !illegal {
		t.Errorf("forcing breaker %s to %s: %s %s", name, state, resp.Status, body)
	}
}

// metricSum adds up every series of the metric family name whose labels include the given
// label name/value pairs; 0 when the family has no series yet.
func metricSum(t *testing.T, s *harness.Stack, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := s.App.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					if l.GetName() == labels[i] && l.GetValue() == labels[i+1] {
						found = true
					}
				}
				if !found {
					continue series
				}
			}
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			default:
				t.Fatalf("%s is neither a counter nor a gauge", name)
			}
		}
	}
	return sum
}
