package statefile

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a test leaves a goroutine behind (a Persister writes from one).
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
