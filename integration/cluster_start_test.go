package integration_test

import (
	"fmt"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// firstBurstPolicy admits every request of a burst: any refusal or timeout is the cluster's.
// Envoy may extend its message timeout for a waiting request, as the example policy allows: a
// leased compartment whose leases Redis lost recovers for a few seconds, during which a
// request that needs its lease to grow waits.
const firstBurstPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat:
    max_concurrent: 500
    max_wait: 150ms
    tokens_per_minute: 100000000
    requests_per_minute: 1000000
  default: {max_concurrent: 10}
`

// TestClusterFirstBurst: a burst of concurrent requests sent as soon as a replica reports ready
// is admitted whole, as is the first burst after Redis restarted empty (its scripts and
// connections gone). The replica runs with the defaults a deployment has: cluster.timeout
// 20 ms and Envoy's 200 ms message timeout (which a waiting request may extend). A replica that sent its first admissions' scripts
// whole (NOSCRIPT) and opened a connection per admission on the request's path timed them out:
// 504s from Envoy and 503s.
func TestClusterFirstBurst(t *testing.T) {
	for _, adm := range clusterAdmissions {
		t.Run(adm, func(t *testing.T) { firstBurst(t, adm) })
	}
}

func firstBurst(t *testing.T, adm string) {
	rd := redistest.Standalone(t)
	y := fmt.Sprintf("cluster:\n  backend: redis\n  addresses: [%q]\n  key_prefix: burst\n  admission: %s\n", rd.Addr(), adm)
	r, err := harness.StartReplica(harness.ReplicaOptions{Name: "burst", PolicyPath: writePolicy(t, firstBurstPolicy+y),
		Env: []string{"LLM_BULKHEAD_CLUSTER__REPLICA_ID=burst"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("stopping: %v", err)
		}
		if n := r.Races(); n > 0 {
			t.Errorf("the replica reported %d data races:\n%s", n, r.Tail())
		} else if t.Failed() {
			t.Logf("replica log:\n%s", r.Tail())
		}
	})
	up := envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}},
		`{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}`)
	burst := func(when string) {
		t.Helper()
		const n = 64
		f := newFlight(n)
		for range n {
			f.send([]*harness.Replica{r}, 0, "chat", &envoysim.Request{Method: "POST", Path: "/v1/chat/completions",
				Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: "chat"}},
				Body:    []byte(`{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`)}, up)
		}
		got := map[string]int{}
		for _, o := range f.collect(t) {
			got[o.what()]++
		}
		if got["200"] != n {
			t.Errorf("%s: %v, want all %d admitted", when, got, n)
		}
	}
	burst("the first burst after start")

	resyncs := replicaMetric(t, r, "llm_bulkhead_cluster_resyncs_total")
	rd.Restart()
	clusterWait(t, "the replica to register again in the restarted Redis", func() bool {
		return replicaMetric(t, r, "llm_bulkhead_cluster_resyncs_total") > resyncs &&
			replicaMetric(t, r, "llm_bulkhead_cluster_available") == 1
	})
	burst("the first burst after Redis restarted empty")
}
