package integration_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

const reloadPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    rules: [{header: x-llm-provider}]
features:
  chat: {max_concurrent: %d, tokens_per_minute: 100000000}
  default: {max_concurrent: 10}
providers:
  default: {breaker: std}
  spare: {breaker: std}
breakers:
  std: {sliding_window_size: 10, minimum_calls: 5, wait_in_open: 5s}
`

// TestReloadUnderLoad: 1000 requests in flight while the policy is reloaded 20 times —
// alternately unchanged, broken and with new limits. No request is lost or released twice, the
// in-flight accounting stays exact, refused reloads keep the running policy, and a breaker's
// operator-set state survives.
func TestReloadUnderLoad(t *testing.T) {
	path := writePolicy(t, fmt.Sprintf(reloadPolicy, 2000))
	s := start(t, harness.Options{PolicyPath: path, NoMock: true, Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=t"}})
	if err := s.App.Engine().ForceBreaker("spare", "DISABLED"); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	g := newGate()
	const n = 1000
	results := make(chan *envoysim.Result, n)
	for i := 0; i < n; i++ {
		go func() {
			r, err := s.Sim.RoundTrip(ctx, chatRequest("chat"), g)
			if err != nil {
				t.Error(err)
			}
			results <- r
		}()
		if i%100 == 99 {
			for j := 0; j < 100; j++ {
				<-g.arrived
			}
		}
	}
	chat := func() int64 { return compartment(t, s, "feature/chat").InFlight }
	if got := chat(); got != n {
		t.Fatalf("in flight %d before reloads", got)
	}
	gen := s.App.Engine().Snapshot().Gen()
	for i := 0; i < 20; i++ {
		var body string
		wantErr := false
		switch i % 3 {
		case 0:
			body = fmt.Sprintf(reloadPolicy, 2000)
		case 1:
			body = "features: [this is: not valid\n"
			wantErr = true
		case 2:
			body = fmt.Sprintf(reloadPolicy, 1500+i*50)
		}
		if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		err := s.App.Reload("test")
		if (err != nil) != wantErr {
			t.Fatalf("reload %d: err %v", i, err)
		}
		if !wantErr {
			gen++
		}
		if got := s.App.Engine().Snapshot().Gen(); got != gen {
			t.Fatalf("reload %d: generation %d, want %d", i, got, gen)
		}
		if got := chat(); got != n {
			t.Fatalf("reload %d: in flight %d, want %d", i, got, n)
		}
		// New traffic keeps flowing while reloads happen.
		extra := make(chan *envoysim.Result, 1)
		go func() {
			r, _ := s.Sim.RoundTrip(ctx, chatRequest("default"), envoysim.Respond(200, nil, "{}"))
			extra <- r
		}()
		if r := <-extra; r.Status != 200 {
			t.Fatalf("reload %d: new request %d", i, r.Status)
		}
	}
	for _, b := range s.App.Engine().Breakers() {
		if b.Name == "spare" && b.Snapshot.State.String() != "DISABLED" {
			t.Errorf("spare breaker %s after reloads, want the operator's DISABLED", b.Snapshot.State)
		}
	}
	for i := 0; i < n; i++ {
		g.release <- struct{}{}
	}
	for i := 0; i < n; i++ {
		if r := <-results; r.Status != 200 {
			t.Fatalf("a held request ended with %d", r.Status)
		}
	}
	waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
	if got := chat(); got != 0 {
		t.Errorf("in flight %d after all finished", got)
	}
	var metrics strings.Builder
	mfs, _ := s.App.Registry().Gather()
	for _, mf := range mfs {
		if mf.GetName() == "llm_bulkhead_config_reload_errors_total" {
			fmt.Fprint(&metrics, mf.GetMetric()[0].GetCounter().GetValue())
		}
	}
	if metrics.String() != "7" {
		t.Errorf("reload errors counted %q, want 7", metrics.String())
	}
}
