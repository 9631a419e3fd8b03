package mock

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Google's SDK imports OpenCensus, whose package init starts a worker that lives as
		// long as the process.
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"))
}
