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
	if s.MaxStreams != 20000 || s.KeepaliveTime.D() != 30*time.Second || s.KeepaliveTimeout.D() != 10*time.Second ||
		s.StreamIdleTimeout.D() != 10*time.Minute || s.MaxBufferedBodyBytes != 256<<20 {
		t.Errorf("server defaults %+v", s)
	}
}
