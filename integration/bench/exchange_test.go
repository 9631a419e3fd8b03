package bench

import (
	"bytes"
	"context"
	"errors"
	"runtime/trace"
	"testing"
	"time"
)

func TestReadExchangesOfAServer(t *testing.T) {
	// Given a gRPC server on a loopback port and a trace of it serving streams one at a time
	sim := newSim(t, serve(t, Noop{}))
	req := chatRequest(t)
	var buf bytes.Buffer
	if err := trace.Start(&buf); err != nil {
		t.Fatal(err)
	}
	const streams = 50
	for range streams {
		res, err := sim.RoundTrip(context.Background(), req, SSEUpstream())
		if err == nil {
			err = Check(res, false)
		}
		if err != nil {
			trace.Stop()
			t.Fatal(err)
		}
	}
	trace.Stop()
	// When the trace is read
	x, err := ReadExchanges(&buf)
	if err != nil {
		t.Fatal(err)
	}
	// Then the exchanges are the streams' messages, and the marks come in their order. Not
	// exactly one per message: a reader already running when bytes arrive merges two, and the
	// stream's opening, its trailers and flow-control frames can make more, as the scheduling
	// of a loaded machine has them.
	t.Logf("%+v", x)
	if x.Count < streams*StreamMessages/2 || x.Count > streams*StreamMessages*2 {
		t.Errorf("%d exchanges for %d streams of %d messages", x.Count, streams, StreamMessages)
	}
	if !(x.Woken > 0 && x.Handled >= x.Woken && x.Written > 0 && x.Mean > 0 && x.WallPerExchange > 0) {
		t.Errorf("marks out of order: %+v", x)
	}
}

// idleTrace returns a trace of this process doing nothing for a millisecond.
func idleTrace(tb testing.TB) []byte {
	tb.Helper()
	var buf bytes.Buffer
	if err := trace.Start(&buf); err != nil {
		tb.Fatal(err)
	}
	time.Sleep(time.Millisecond)
	trace.Stop()
	return buf.Bytes()
}

func TestReadExchangesWithoutAServer(t *testing.T) {
	if _, err := ReadExchanges(bytes.NewReader(idleTrace(t))); !errors.Is(err, errNoExchanges) {
		t.Errorf("err = %v, want %v", err, errNoExchanges)
	}
	if _, err := ReadExchanges(bytes.NewReader([]byte("not a trace"))); err == nil {
		t.Error("a file that is not a trace was read")
	}
}

// FuzzReadExchanges feeds ReadExchanges damaged traces: it returns an error or a summary whose
// times are not negative, and never panics.
func FuzzReadExchanges(f *testing.F) {
	idle := idleTrace(f)
	f.Add(idle)
	f.Add(idle[:len(idle)/2])
	f.Fuzz(func(t *testing.T, b []byte) {
		x, err := ReadExchanges(bytes.NewReader(b))
		if err == nil && (x.Count <= 0 || x.Woken < 0 || x.Handled < 0 || x.Written < 0) {
			t.Fatalf("summary of a damaged trace: %+v", x)
		}
	})
}
