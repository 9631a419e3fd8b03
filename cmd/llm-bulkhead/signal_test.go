package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
)

// TestSignalDuringStartStops: SIGTERM used to be caught and then ignored until the start was
// over, which a blocked start never was. A signal during the start ends serve at once.
func TestSignalDuringStartStops(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{})
	returned := make(chan struct{})
	newApp = func(app.Options) (*app.App, error) {
		defer close(returned)
		close(entered)
		<-release
		return nil, context.Canceled
	}
	t.Cleanup(func() { newApp = app.New })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	errOut := &syncbuf.Buffer{}
	go func() {
		done <- run(ctx, []string{"serve", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"}, []string{}, &bytes.Buffer{}, errOut, nil)
	}()
	<-entered
	cancel() // SIGTERM while the start is blocked
	select {
	case code := <-done:
		if code != 0 || !strings.Contains(errOut.String(), "before it started") {
			t.Errorf("exit %d, stderr %q; want 0 and a line saying it stopped before it started", code, errOut.String())
		}
	case <-time.After(20 * time.Second):
		t.Error("serve still starting 20s after SIGTERM")
	}
	close(release)
	<-returned
}
