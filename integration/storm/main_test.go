package storm

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a goroutine outlives the tests: every run starts a stack,
// users, workers and a sampler, and must stop them all.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Pooled HTTP connections of the simulator's upstream client wind down asynchronously
		// after CloseIdleConnections.
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
	)
}
