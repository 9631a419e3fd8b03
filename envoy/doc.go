// Package envoy holds the Envoy configuration shipped with llm-bulkhead: a complete bootstrap
// (envoy.yaml, used by examples/docker-compose.yaml) and the trusted-identity filter chain
// (identity.yaml) and charging settled token use to Envoy's rate limit service
// (ratelimit.yaml). Its tests parse both with Envoy's own protos (go-control-plane), check the
// ext_proc filter against the example policy, and read it into the Envoy simulator's filter
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
