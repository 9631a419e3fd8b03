package policy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

const refusalLimitsPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 10, tokens_per_minute: 1000, requests_per_minute: 3}
  default: {max_concurrent: 10}
`

// TestRefusalCarriesTheRefusingWindow: a token_budget refusal reports the token window that
// refused (limit, what is left, when it is all back) and no request window; a rate_limit
// refusal the request window and no token window; a concurrency refusal neither.
func TestRefusalCarriesTheRefusingWindow(t *testing.T) {
	e, clk := engine(t, refusalLimitsPolicy)
	chat := feature("chat")
	t0 := clk.Now()
	d, tk := admit(t, e, chat, 600)
	if d.Verdict != policy.Admit {
		t.Fatalf("first: %+v", d)
	}
	chatDone(tk, 600)
	clk.Advance(10 * time.Second)
	d, _ = admit(t, e, chat, 600)
	if d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("second: %+v", d)
	}
	// The 600 tokens charged 10 s ago age out 60 s after their one-second slot began.
	wantReset := t0.Truncate(time.Second).Add(time.Minute).Sub(clk.Now())
	if l := d.Limits; !l.HasTokens || l.HasRequests || l.Tokens != (policy.RateWindow{Limit: 1000, Remaining: 400, Reset: wantReset}) {
		t.Errorf("token refusal limits %+v, want tokens 1000/400/%s only", l, wantReset)
	}
	for i := range 2 {
		d, tk := admit(t, e, chat, 10)
		if d.Verdict != policy.Admit {
			t.Fatalf("small %d: %+v", i, d)
		}
		chatDone(tk, 10)
	}
	d, _ = admit(t, e, chat, 10)
	if d.Reason != policy.ReasonRateLimit {
		t.Fatalf("fourth request: %+v", d)
	}
	// The window is full again when the newest request charged (just now) ages out.
	wantReset = clk.Now().Truncate(time.Second).Add(time.Minute).Sub(clk.Now())
	if l := d.Limits; !l.HasRequests || l.HasTokens || l.Requests != (policy.RateWindow{Limit: 3, Remaining: 0, Reset: wantReset}) {
		t.Errorf("rate refusal limits %+v, want requests 3/0/%s only", l, wantReset)
	}
}

// TestRefusalLimitsInDebtSayNothingLeft: a window pushed into debt by settlement reports 0
// remaining, never a negative number.
func TestRefusalLimitsInDebtSayNothingLeft(t *testing.T) {
	e, _ := engine(t, refusalLimitsPolicy)
	d, tk := admit(t, e, feature("chat"), 100)
	if d.Verdict != policy.Admit {
		t.Fatal(d)
	}
	chatDone(tk, 1100) // 100 over the budget
	d, _ = admit(t, e, feature("chat"), 10)
	if d.Reason != policy.ReasonTokenBudget || d.Limits.Tokens.Remaining != 0 || d.Limits.Tokens.Limit != 1000 {
		t.Errorf("%+v", d)
	}
}

// TestSharedRefusalCarriesTheRefusingWindow: in cluster mode the refusing window's numbers
// come from Redis, across replicas.
func TestSharedRefusalCarriesTheRefusingWindow(t *testing.T) {
	forModes(t, sharedRefusalCarriesTheRefusingWindow)
}

func sharedRefusalCarriesTheRefusingWindow(t *testing.T, mode string) {
	rd := redistest.Standalone(t)
	yaml := strings.Replace(sharedPolicy, "tokens_per_minute: 1000}", "tokens_per_minute: 1000, requests_per_minute: 2}", 1) + modeSection(t, mode)
	a := sharedEngineFrom(t, yaml, rd.Addr(), "a", "refusal")
	b := sharedEngineFrom(t, yaml, rd.Addr(), "b", "refusal")
	chat := feature("chat")
	d, tk := admit(t, a, chat, 600)
	if d.Verdict != policy.Admit {
		t.Fatalf("a: %+v", d)
	}
	chatDone(tk, 600)
	// The settlement reaches Redis in the background; until it does, the estimate counts, and
	// it is the same 600.
	d, _ = admit(t, b, chat, 600)
	if mode == "leased" {
		// The second request of the 2 a minute can sit unused in a's lease for up to about a
		// second (docs/cluster.md, "How exact it is"): until it comes back, b is refused by the
		// request window, which takes nothing.
		waitFor(t, "b's refusal to come from the token window", func() bool {
			if d.Reason == policy.ReasonRateLimit {
				d, _ = admit(t, b, chat, 600)
			}
			return d.Reason != policy.ReasonRateLimit
		})
	}
	if d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("b: %+v", d)
	}
	l := d.Limits
	// Leased: as the refusing replica last saw the window, less what another replica's chunks
	// hold unused (at most twice the window's even pace over a chunk's life, 17 tokens here).
	lo := int64(400)
	if mode == "leased" {
		lo = 400 - 17
	}
	if !l.HasTokens || l.HasRequests || l.Tokens.Limit != 1000 || l.Tokens.Remaining > 400 || l.Tokens.Remaining < lo ||
		l.Tokens.Reset <= 0 || l.Tokens.Reset > time.Minute {
		t.Errorf("shared token refusal limits %+v, want tokens 1000/%d to 400/(0,1m]", l, lo)
	}
	// b's refused request took a request of the 2 a minute and gave it back: exact at once,
	// leased with b's next report (a window of a few requests a minute is leased one request at
	// a time, and what comes back goes back to Redis at once).
	waitFor(t, "a to be admitted again", func() bool {
		d, tk = admit(t, a, chat, 10)
		if mode == "exact" && d.Verdict != policy.Admit {
			t.Fatalf("a again: %+v", d)
		}
		return d.Verdict == policy.Admit
	})
	chatDone(tk, 10)
	d, _ = admit(t, b, chat, 10)
	if d.Reason != policy.ReasonRateLimit {
		t.Fatalf("b again: %+v", d)
	}
	l = d.Limits
	if !l.HasRequests || l.HasTokens || l.Requests.Limit != 2 || l.Requests.Remaining != 0 || l.Requests.Reset <= 0 || l.Requests.Reset > time.Minute {
		t.Errorf("shared rate refusal limits %+v, want requests 2/0/(0,1m]", l)
	}
}

// sharedEngineFrom is sharedEngine with a policy of the test's own.
func sharedEngineFrom(t *testing.T, yaml, addr, id, prefix string) *policy.Engine {
	t.Helper()
	p, err := config.Load("shared.yaml", []byte(fmt.Sprintf(yaml, addr, id, prefix, "local")), nil)
	if err != nil {
		t.Fatalf("policy:\n%v", err)
	}
	e, err := policy.NewEngine(p, policy.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Cluster: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	waitFor(t, "the shared state to be available to "+id, func() bool { return e.Cluster().Available() })
	return e
}
