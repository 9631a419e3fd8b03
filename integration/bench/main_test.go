package bench

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"testing"

	"go.uber.org/goleak"
)

// TestMain lets the test binary act as a benchmark server child (StartProcess runs it with a
// child subcommand), and otherwise checks that no test leaves a goroutine behind.
func TestMain(m *testing.M) {
	if IsChild(os.Args[1:]) {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		err := RunChild(ctx, os.Args[1:], os.Stderr)
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}
