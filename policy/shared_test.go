package policy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// Engines sharing one Redis, as replicas would.

const sharedPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 3, max_wait: 5s, tokens_per_minute: 1000}
  default: {max_concurrent: 10}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
cluster:
  backend: redis
  addresses: [%q]
  replica_id: %s
  key_prefix: %s
  timeout: 500ms
  lease_ttl: 60s
  heartbeat: 30s
  on_unavailable: %s
`

// sharedEngine starts an engine that shares its limits through the Redis at addr. Its
// heartbeat is slow (30 s), so that only publications can wake waiters in a test; fastBeat
// makes it 250 ms (lease_ttl 2 s) for tests that follow the membership.
func sharedEngine(t *testing.T, addr, id, prefix, onUnavailable, mode string, fastBeat ...bool) *policy.Engine {
	t.Helper()
	yaml := fmt.Sprintf(sharedPolicy, addr, id, prefix, onUnavailable) + modeSection(t, mode)
	if len(fastBeat) > 0 && fastBeat[0] {
		yaml = strings.Replace(yaml, "lease_ttl: 60s\n  heartbeat: 30s", "lease_ttl: 2s\n  heartbeat: 250ms", 1)
	}
	e := clusterEngine(t, yaml)
	waitFor(t, "the shared state to be available to "+id, func() bool { return e.Cluster().Available() })
	return e
}

// clusterEngine starts an engine in cluster mode running the policy yaml, closed when the
// test ends.
func clusterEngine(t *testing.T, yaml string) *policy.Engine {
	t.Helper()
	p, err := config.Load("shared.yaml", []byte(yaml), nil)
	if err != nil {
		t.Fatalf("policy:\n%v", err)
	}
	e, err := policy.NewEngine(p, policy.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Cluster: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	return e
}

// waitFor polls cond until it holds (or fails the test after 10 s: a bound for a broken
// build, not a timing assertion).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// admitWaiting asks e to admit in, giving up (as a client would) after wait; an admission is
// released at once.
func admitWaiting(e *policy.Engine, in input, tokens int64, wait time.Duration) policy.Decision {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	s := e.Snapshot()
	r := policy.Request{Dims: s.Classify(in), Estimate: policy.Estimate{Total: tokens, Prompt: tokens / 2, Output: tokens - tokens/2}}
	tk := &policy.Ticket{}
	d := e.Admit(ctx, s, &r, tk, nil)
	if d.Verdict == policy.Admit {
		chatDone(tk, tokens)
	}
	return d
}

func chatDone(tk *policy.Ticket, tokens int64) {
	tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: tokens / 2, Completion: tokens - tokens/2, Known: true}})
}

func TestSharedConcurrencyHoldsAcrossEngines(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		rd := redistest.Standalone(t)
		a := sharedEngine(t, rd.Addr(), "a", "conc", "local", mode)
		b := sharedEngine(t, rd.Addr(), "b", "conc", "local", mode)
		chatReq := input{headers: map[string]string{"x-llm-feature": "chat"}}
		// Given chat's 3 slots are taken, two on a and one on b
		var held []*policy.Ticket
		for i, e := range []*policy.Engine{a, a, b} {
			d, tk := admit(t, e, chatReq, 10)
			if d.Verdict != policy.Admit {
				t.Fatalf("request %d: %+v", i, d)
			}
			held = append(held, tk)
		}
		// When b is asked for a fourth and the client gives up before a slot frees
		d := admitWaiting(b, chatReq, 10, 200*time.Millisecond)
		// Then it was not admitted: a's two slots count on b
		if d.Verdict == policy.Admit {
			t.Fatalf("a fourth request was admitted with 3 slots held across replicas")
		}
		// And a waiter on b is woken when a slot frees on a
		got := make(chan policy.Decision, 1)
		go func() {
			d, tk := admit(t, b, chatReq, 10)
			got <- d
			if d.Verdict == policy.Admit {
				chatDone(tk, 10)
			}
		}()
		waitFor(t, "the waiter to queue on b", func() bool { return b.Compartments()[0].Queued == 1 })
		chatDone(held[0], 10)
		if d := <-got; d.Verdict != policy.Admit {
			t.Fatalf("waiter on b after a released: %+v", d)
		}
		for _, tk := range held[1:] {
			chatDone(tk, 10)
		}
	})
}

func TestSharedTokenBudgetAcrossEngines(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		rd := redistest.Standalone(t)
		a := sharedEngine(t, rd.Addr(), "a", "budget", "local", mode)
		b := sharedEngine(t, rd.Addr(), "b", "budget", "local", mode)
		chat := feature("chat")
		// Given a reserved 600 of chat's 1000 tokens a minute
		d, tk := admit(t, a, chat, 600)
		if d.Verdict != policy.Admit {
			t.Fatalf("a: %+v", d)
		}
		// Then b cannot reserve another 600
		if d, _ := admit(t, b, chat, 600); d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget || d.RetryAfter <= 0 {
			t.Fatalf("b: %+v, want token_budget with a retry-after", d)
		}
		// When a's request turns out to cost 100 tokens
		chatDone(tk, 100)
		// Then the refund reaches b
		waitFor(t, "the settlement to reach Redis", func() bool {
			d, tk := admit(t, b, chat, 600)
			if d.Verdict == policy.Admit {
				chatDone(tk, 600)
				return true
			}
			return false
		})
		// Exact: a is admitted at once. Leased: a's chunk may be short of 200 tokens and its
		// growth (one call to Redis within cluster.timeout) may not be answered in time on a
		// loaded machine; a asks again, as a client told to retry would.
		remaining := int64(-1)
		ask := func() bool {
			if d, tk := admit(t, a, chat, 200); d.Verdict == policy.Admit {
				remaining, _, _ = tk.Remaining(a.Now())
				chatDone(tk, 200)
				return true
			}
			return false
		}
		if mode == "exact" {
			ask()
		} else {
			waitFor(t, "a's lease to grow to 200 tokens", ask)
		}
		// Exact: the shared window's own number. Leased: what the window had at this replica's
		// last report, with its own chunks: short of the exact number by what other replicas'
		// chunks hold unused (at most twice the window's even pace over a chunk's life, 17
		// tokens here, each).
		if lo := int64(100 - 2*17); remaining > 100 || (mode == "exact" && remaining != 100) || remaining < lo {
			t.Errorf("remaining after 100 + 600 + 200 of 1000 tokens: %d, want 100 (leased: %d to 100)", remaining, lo)
		}
	})
}

func TestSharedStateUnavailableFallsBackToTheShare(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		rd := redistest.Standalone(t)
		a := sharedEngine(t, rd.Addr(), "a", "down", "local", mode)
		_ = sharedEngine(t, rd.Addr(), "b", "down", "local", mode)
		c := sharedEngine(t, rd.Addr(), "c", "down-closed", "closed", mode)
		chat := feature("chat")
		waitFor(t, "a to see both replicas", func() bool {
			d, tk := admit(t, a, chat, 1) // any admission refreshes nothing; the heartbeat sets live
			if d.Verdict == policy.Admit {
				chatDone(tk, 1)
			}
			return a.Cluster().Live() >= 1
		})
		rd.Kill()
		// When Redis is gone, a enforces its share locally and c (closed) refuses.
		waitFor(t, "a to notice Redis is gone", func() bool {
			d, tk := admit(t, a, chat, 1)
			if d.Verdict == policy.Admit {
				chatDone(tk, 1)
			}
			return !a.Cluster().Available()
		})
		d, tk := admit(t, a, chat, 1)
		if d.Verdict != policy.Admit {
			t.Fatalf("a without Redis: %+v", d)
		}
		chatDone(tk, 1)
		waitFor(t, "c to refuse with cluster_unavailable", func() bool {
			d, tk := admit(t, c, chat, 1)
			if d.Verdict == policy.Admit {
				chatDone(tk, 1)
			}
			return d.Reason == policy.ReasonClusterUnavailable
		})
		// And both come back by themselves when Redis does.
		rd.Restart()
		waitFor(t, "a and c to share again", func() bool { return a.Cluster().Available() && c.Cluster().Available() })
		if d, tk := admit(t, c, chat, 1); d.Verdict != policy.Admit {
			t.Fatalf("c after Redis came back: %+v", d)
		} else {
			chatDone(tk, 1)
		}
	})
}

func TestSharedLimitsFollowEachReplicasPolicyAfterReload(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		rd := redistest.Standalone(t)
		a := sharedEngine(t, rd.Addr(), "a", "reload", "local", mode)
		b := sharedEngine(t, rd.Addr(), "b", "reload", "local", mode)
		chat := feature("chat")
		// Given a reloads a policy that halves chat's token budget (b still runs the old one)
		lower := strings.Replace(fmt.Sprintf(sharedPolicy, rd.Addr(), "a", "reload", "local")+modeSection(t, mode), "tokens_per_minute: 1000", "tokens_per_minute: 500", 1)
		p, err := config.Load("shared.yaml", []byte(lower), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.Apply(p); err != nil {
			t.Fatal(err)
		}
		// When b spends 400 tokens
		d, tk := admit(t, b, chat, 400)
		if d.Verdict != policy.Admit {
			t.Fatalf("b: %+v", d)
		}
		chatDone(tk, 400)
		// Then both replicas read the same shared window, each with its own limit: a (500) refuses
		// 200 more, b (1000) admits them.
		waitFor(t, "b's settlement", func() bool {
			return a.Cluster().Info(context.Background()).Pending == 0 && b.Cluster().Info(context.Background()).Pending == 0
		})
		if d, _ := admit(t, a, chat, 200); d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget {
			t.Fatalf("a with the halved budget: %+v, want token_budget", d)
		}
		if d, tk := admit(t, b, chat, 200); d.Verdict != policy.Admit {
			t.Fatalf("b with the old budget: %+v", d)
		} else {
			chatDone(tk, 200)
		}
	})
}

func TestRequestsAdmittedDuringAnOutageCountOnceRedisIsBack(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		rd := redistest.Standalone(t)
		a := sharedEngine(t, rd.Addr(), "a", "outage", "local", mode, true)
		b := sharedEngine(t, rd.Addr(), "b", "outage", "local", mode, true)
		chat := feature("chat")
		waitFor(t, "a to see two live replicas", func() bool { return a.Cluster().Live() == 2 })
		rd.Kill()
		// Given a admitted a request on its own while Redis was gone (its share: 3 / 2 = 1 slot)
		var held *policy.Ticket
		waitFor(t, "a to admit without Redis", func() bool {
			d, tk := admit(t, a, chat, 10)
			if d.Verdict == policy.Admit && !a.Cluster().Available() {
				held = tk
				return true
			}
			if d.Verdict == policy.Admit {
				chatDone(tk, 10)
			}
			return false
		})
		waitFor(t, "a to enforce its share", func() bool { return a.Compartments()[0].MaxConcurrent == 1 })
		if d := admitWaiting(a, chat, 10, 100*time.Millisecond); d.Verdict == policy.Admit {
			t.Fatalf("a admitted a second request beyond its share of 1")
		}
		// When Redis is back
		rd.Restart()
		waitFor(t, "both to share again", func() bool { return a.Cluster().Available() && b.Cluster().Available() })
		waitFor(t, "a's full limits", func() bool { return a.Compartments()[0].MaxConcurrent == 3 })
		// Then a's request holds one of the 3 shared slots: b gets 2, not 3
		var bs []*policy.Ticket
		for i := 0; i < 3; i++ {
			d, tk := admit(t, b, input{headers: map[string]string{"x-llm-feature": "chat"}}, 10)
			if d.Verdict == policy.Admit {
				bs = append(bs, tk)
			}
			if len(bs) == 2 {
				break
			}
		}
		d := admitWaiting(b, chat, 10, 100*time.Millisecond)
		if len(bs) != 2 || d.Verdict == policy.Admit {
			t.Fatalf("b admitted %d + %v with a's outage request in flight, want 2 and a refusal", len(bs), d.Verdict == policy.Admit)
		}
		// And its release frees the slot once, everywhere
		chatDone(held, 10)
		waitFor(t, "b to get the slot a released", func() bool {
			d, tk := admit(t, b, chat, 10)
			if d.Verdict == policy.Admit {
				bs = append(bs, tk)
				return true
			}
			return false
		})
		for _, tk := range bs {
			chatDone(tk, 10)
		}
		waitFor(t, "every slot back in Redis", func() bool {
			out, err := rd.Do("HGETALL", "{outage}:c:feature/chat")
			return err == nil && !strings.Contains(out, "n:")
		})
		if n := a.Cluster().Info(context.Background()).Leases + b.Cluster().Info(context.Background()).Leases; n != 0 {
			t.Errorf("%d leases still held after every request ended", n)
		}
	})
}

// BenchmarkAdmitDoneShared is BenchmarkAdmitDone through a Redis shared by the engine (one
// admission script per request, settlements batched), from parallel goroutines. It starts its
// own redis-server, or uses the one at LLM_BULKHEAD_BENCH_REDIS (host:port).
func BenchmarkAdmitDoneShared(b *testing.B) {
	addr := os.Getenv("LLM_BULKHEAD_BENCH_REDIS")
	if addr == "" {
		addr = redistest.Standalone(b).Addr()
	}
	yaml := strings.Replace(fmt.Sprintf(sharedPolicy, addr, "bench", "bench", "local"),
		"chat: {max_concurrent: 3, max_wait: 5s, tokens_per_minute: 1000}",
		"chat: {max_concurrent: 100000, max_wait: 5s, tokens_per_minute: 1000000000000}", 1)
	p, err := config.Load("shared.yaml", []byte(yaml), nil)
	if err != nil {
		b.Fatal(err)
	}
	e, err := policy.NewEngine(p, policy.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Cluster: true})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	e.Cluster().WaitAvailable(ctx)
	cancel()
	s := e.Snapshot()
	dims := s.Classify(feature("chat"))
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		var tk policy.Ticket
		r := policy.Request{Dims: dims, Estimate: policy.Estimate{Prompt: 500, Output: 500, Total: 1000}}
		for pb.Next() {
			if d := e.Admit(context.Background(), s, &r, &tk, nil); d.Verdict != policy.Admit {
				b.Fatalf("%+v", d)
			}
			tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 400, Completion: 400, Known: true}})
		}
	})
}

// forModes runs f as a subtest for every cluster admission mode.
func forModes(t *testing.T, f func(t *testing.T, mode string)) {
	for _, mode := range clusterModes {
		t.Run(mode, func(t *testing.T) { f(t, mode) })
	}
}
