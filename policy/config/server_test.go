package config_test

import (
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// TestServerLimitDefaults: a policy that says nothing about the server's stream limits gets
// bounded ones, not unlimited ones.
func TestServerLimitDefaults(t *testing.T) {
	p, err := config.Load("p.yaml", []byte("features:\n  default: {max_concurrent: 1}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := p.Server
	if s.MaxStreams != 20000 || s.MaxStreamsPerConnection != 5000 || s.KeepaliveTime.D() != 30*time.Second ||
		s.KeepaliveTimeout.D() != 10*time.Second || s.FirstMessageTimeout.D() != 10*time.Second ||
		s.StreamIdleTimeout.D() != 10*time.Minute || p.BufferedBodyBytes(0) != 256<<20 {
		t.Errorf("server defaults %+v", s)
	}
}

// TestBufferedBodyDefaultFollowsTheMemoryLimit: the default of 256 MiB took a process with the
// Helm chart's 512 MiB limit past it (40 concurrent 8 MiB bodies: 502–513 MB). Without a value
// in the policy, the bound is a quarter of the memory limit, between envoy.max_request_body and
// 256 MiB; a value in the policy is kept whatever the limit.
func TestBufferedBodyDefaultFollowsTheMemoryLimit(t *testing.T) {
	const MiB = 1 << 20
	for _, tc := range []struct {
		policy   string
		memLimit int64
		want     int64
	}{
		{"", 0, 256 * MiB},
		{"", 512 * MiB, 128 * MiB},
		{"", 2048 * MiB, 256 * MiB},
		{"", 16 * MiB, 8 * MiB},                                               // at least envoy.max_request_body
		{"envoy: {max_request_body: 32MiB}\n", 64 * MiB, 32 * MiB},            // ditto
		{"server: {max_buffered_body_bytes: 300MiB}\n", 512 * MiB, 300 * MiB}, // the policy's own
	} {
		p, err := config.Load("p.yaml", []byte(tc.policy+"features:\n  default: {max_concurrent: 1}\n"), nil)
		if err != nil {
			t.Fatal(err)
		}
		if got := p.BufferedBodyBytes(tc.memLimit); got != tc.want {
			t.Errorf("%q with a memory limit of %d MiB: %d MiB, want %d MiB", tc.policy, tc.memLimit/MiB, got/MiB, tc.want/MiB)
		}
	}
}
