package breaker

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a test leaves a goroutine behind; the concurrency tests start
// thousands.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
