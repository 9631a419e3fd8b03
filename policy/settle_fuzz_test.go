package policy_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// settleFuzzPolicy has per-day budgets (nothing ages out during a run, so what was charged can
// be compared with what was settled) and a breaker that sees every outcome.
const settleFuzzPolicy = `
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  provider:
    rules: [{header: x-llm-provider}]
features:
  default: {max_concurrent: 4, tokens_per_day: 200000, max_debt: 0.5}
tiers:
  free: {tokens_per_day: 150000}
providers:
  deepseek: {breaker: std}
  default: {}
breakers:
  std: {sliding_window_size: 4, minimum_calls: 2, wait_in_open: 1s}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant, max_instances: 3}
`

// FuzzSettlement drives admissions and settlements in any order with any usage numbers a
// response could claim (negative, huge, inconsistent), any status, cancels and double releases.
// Whatever happens: nothing panics, a settlement is never negative nor above what its request
// could cost, every slot comes back, and each budget holds exactly what was settled into it
// (less what the debt bound forgave).
func FuzzSettlement(f *testing.F) {
	f.Add([]byte{0, 10, 20, 1, 0, 200, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2})
	f.Add([]byte{0, 255, 255, 0, 0, 0, 1, 4, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 3, 1})
	f.Add([]byte{0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 2, 0, 0, 2, 0, 1, 0, 3, 1, 1})
	f.Fuzz(func(t *testing.T, data []byte) {
		e, clk := engine(t, settleFuzzPolicy)
		next := func() byte {
			if len(data) == 0 {
				return 0
			}
			b := data[0]
			data = data[1:]
			return b
		}
		num := func() int64 {
			var b [8]byte
			for i := range b {
				b[i] = next()
			}
			return int64(binary.LittleEndian.Uint64(b[:]))
		}
		var held []*policy.Ticket
		var settledTotal int64
		for steps := 0; len(data) > 0 && steps < 64; steps++ {
			switch next() % 4 {
			case 0: // admit a request
				s := e.Snapshot()
				in := input{headers: map[string]string{"x-tenant-id": fmt.Sprint(next() % 5)}}
				if next()%2 == 0 {
					in.headers["x-llm-provider"] = "deepseek"
				}
				size := policy.RequestSize{Scanned: next()%4 != 0, BodyBytes: int64(next()) * 64, PromptBytes: int64(next()) * 32,
					Images: int(next() % 3), Files: int(next() % 2), MaxTokens: int64(next()) * 16, HasMaxTokens: next()%2 == 0, N: int64(next() % 4)}
				tk := &policy.Ticket{}
				r := policy.Request{Dims: s.Classify(in), Estimate: s.Estimate("m", size), PromptBytes: size.PromptBytes}
				if d := e.Admit(context.Background(), s, &r, tk, nil); d.Verdict == policy.Admit {
					held = append(held, tk)
				} else if tk.Admitted() {
					t.Fatalf("refused (%s) but the ticket is admitted", d.Reason)
				}
			case 1: // settle one with whatever the response claimed
				if len(held) == 0 {
					continue
				}
				i := int(next()) % len(held)
				tk := held[i]
				o := policy.Outcome{Status: []int{0, 200, 200, 429, 500, 503}[next()%6], Cancelled: next()%3 == 0,
					TTFB: time.Duration(next()) * time.Millisecond, RetryAfter: time.Duration(num())}
				if o.Status == 200 {
					o.StreamError = policy.StreamError(next() % 4) // an error reported inside the 200, or none
				}
				o.Usage = policy.Usage{Prompt: num(), Completion: num(), Total: num(), Cached: num(), Reasoning: num(),
					Known: next()%2 == 0, PromptKnown: next()%2 == 0, ContentBytes: num()}
				st := tk.Done(o)
				if st.Prompt < 0 || st.Completion < 0 || st.Total != st.Prompt+st.Completion {
					t.Fatalf("settled %+v for %+v", st, o)
				}
				settledTotal += st.Total
				if again := tk.Done(o); again != (policy.Settled{}) {
					t.Fatalf("second Done settled again: %+v", again)
				}
				held = append(held[:i], held[i+1:]...)
			case 2: // time passes (less than a day: per-day budgets keep everything)
				clk.Advance(time.Duration(next()) * time.Second)
			case 3: // a settlement preview never exceeds the request's bounds
				if len(held) == 0 {
					continue
				}
				tk := held[int(next())%len(held)]
				st := tk.Settle(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: num(), Completion: num(), Total: num(), Known: true}})
				if st.Prompt < 0 || st.Completion < 0 || st.Total != st.Prompt+st.Completion {
					t.Fatalf("preview %+v", st)
				}
			}
		}
		for _, tk := range held {
			st := tk.Done(policy.Outcome{Status: 200, Cancelled: true})
			settledTotal += st.Total
		}
		if n := e.InFlight(); n != 0 {
			t.Fatalf("%d still in flight", n)
		}
		for _, c := range e.Compartments() {
			if c.InFlight != 0 || c.Queued != 0 || c.InFlightTokens != 0 {
				t.Fatalf("compartment %s not back to zero: %+v", c.Name, c)
			}
			for _, b := range c.Budgets {
				if b.Used < 0 {
					t.Fatalf("%s %s used %d", c.Name, b.Kind, b.Used)
				}
			}
		}
		// feature/default sees every admitted request: its per-day window holds exactly what was
		// settled, less what the debt bound forgave.
		for _, c := range e.Compartments() {
			if c.Name != "feature/default" {
				continue
			}
			b := c.Budgets[0]
			if b.Used+b.Forgiven != settledTotal || b.Used > b.Capacity*3/2 {
				t.Fatalf("feature/default used %d + forgiven %d, settled %d (capacity %d, debt 0.5)", b.Used, b.Forgiven, settledTotal, b.Capacity)
			}
		}
	})
}
