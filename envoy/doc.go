// Package envoy holds the Envoy configuration shipped with llm-bulkhead: a complete bootstrap
// (envoy.yaml, used by examples/docker-compose.yaml), the trusted-identity filter chain
// (identity.yaml), charging settled token use to Envoy's rate limit service (ratelimit.yaml),
// and a provider cluster with llm-bulkhead as its per-attempt (upstream) ext_proc filter
// (upstream.yaml). Its tests parse them with Envoy's own protos (go-control-plane), check the
// ext_proc filters against the example policy, and read them into the Envoy simulator's filter
// settings, so the configuration users deploy is the one the tests exercise.
package envoy

import _ "embed"

// Bootstrap is envoy.yaml.
//
//go:embed envoy.yaml
var Bootstrap []byte

// Identity is identity.yaml.
//
//go:embed identity.yaml
var Identity []byte

// RateLimit is ratelimit.yaml.
//
//go:embed ratelimit.yaml
var RateLimit []byte

// Upstream is upstream.yaml: a provider cluster with llm-bulkhead as its upstream (per-attempt)
// ext_proc filter.
//
//go:embed upstream.yaml
var Upstream []byte
