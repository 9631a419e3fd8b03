package cluster

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a test leaves a goroutine behind: a Store runs its heartbeat,
// settlement and subscription loops, and its Redis client its own, until Close.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
