package bench

import (
	"errors"
	"io"
	"slices"
	"strings"

	"golang.org/x/exp/trace"
)

// Exchanges is where a gRPC server's time goes between a message arriving and its reply being
// written, read from a runtime execution trace of the server. An exchange starts when the
// connection's reader goroutine, blocked reading the connection, is woken because bytes
// arrived, and ends with the last write of the connection before the next arrival: at one
// stream at a time that is one message of Envoy's and its reply. Times are µs after the
// arrival, p50 over the exchanges (Mean is the mean of Written).
//
// What is left of the wall time per exchange after Written is the other side's: the proxy
// reading the reply, acting on it and sending the next message, and the kernel between them.
type Exchanges struct {
	Count int `json:"count"`
	// WallPerExchange is the trace's length divided by Count.
	WallPerExchange float64 `json:"wall_per_exchange_us"`
	// Woken: the stream's goroutine, blocked receiving, starts running (the hand-off from the
	// reader goroutine). Handled: it blocks receiving again (the message handled and the reply
	// queued for writing). Written: the writer goroutine's write of the reply returns.
	Woken   float64 `json:"woken_us"`
	Handled float64 `json:"handled_us"`
	Written float64 `json:"written_us"`
	Mean    float64 `json:"written_mean_us"`
}

// Frames that tell the server's goroutines apart in the trace (gRPC's HTTP/2 server
// transport; a client in the same process has goroutines of its own types).
const (
	readerFrame = "(*http2Server).HandleStreams"
	streamFrame = "(*serverStream).RecvMsg"
	writerFrame = "NewServerTransport"
	writeFrame  = "(*conn).Write"
)

// errNoExchanges reports a trace without a single complete exchange.
var errNoExchanges = errors.New("the trace holds no exchange of a gRPC server")

// ReadExchanges reads a runtime execution trace (runtime/trace, /debug/pprof/trace) of a
// process serving gRPC and summarises its exchanges.
func ReadExchanges(r io.Reader) (Exchanges, error) {
	tr, err := trace.NewReader(r)
	if err != nil {
		return Exchanges{}, err
	}
	type mark struct {
		t    trace.Time
		kind markKind
	}
	var (
		marks       []mark
		readerWaits = map[trace.GoID]bool{} // reader goroutines blocked reading
		streamWaits = map[trace.GoID]bool{} // stream goroutines blocked receiving
		streamWoken = map[trace.GoID]bool{} // … made runnable, not yet running
		writing     = map[trace.GoID]bool{} // writer goroutines in a write system call
		first, last trace.Time
	)
	for {
		ev, err := tr.ReadEvent()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return Exchanges{}, err
		}
		if first == 0 {
			first = ev.Time()
		}
		last = ev.Time()
		if ev.Kind() != trace.EventStateTransition {
			continue
		}
		st := ev.StateTransition()
		if st.Resource.Kind != trace.ResourceGoroutine {
			continue
		}
		g := st.Resource.Goroutine()
		from, to := st.Goroutine()
		switch {
		case from == trace.GoRunning && to == trace.GoWaiting:
			readerWaits[g] = hasFrame(st.Stack, readerFrame)
			streamWaits[g] = hasFrame(st.Stack, streamFrame)
			if streamWaits[g] {
				marks = append(marks, mark{ev.Time(), markHandled})
			}
		case from == trace.GoWaiting && to == trace.GoRunnable:
			if readerWaits[g] {
				readerWaits[g] = false
				marks = append(marks, mark{ev.Time(), markArrived})
			}
			if streamWaits[g] {
				streamWaits[g], streamWoken[g] = false, true
			}
		case from == trace.GoRunnable && to == trace.GoRunning:
			if streamWoken[g] {
				streamWoken[g] = false
				marks = append(marks, mark{ev.Time(), markWoken})
			}
		case from == trace.GoRunning && to == trace.GoSyscall:
			writing[g] = hasFrame(st.Stack, writerFrame) && hasFrame(st.Stack, writeFrame)
		case from == trace.GoSyscall:
			if writing[g] {
				writing[g] = false
				marks = append(marks, mark{ev.Time(), markWritten})
			}
		}
	}
	// An exchange runs from its first arrival (bytes may arrive in several reads) to the last
	// write before an arrival that follows a write.
	var woken, handled, written []float64
	start := trace.Time(-1)
	var wake, handle, write trace.Time
	end := func() {
		written = append(written, us(write-start))
		if wake > start {
			woken = append(woken, us(wake-start))
		}
		if handle > start {
			handled = append(handled, us(handle-start))
		}
	}
	for _, m := range marks {
		switch m.kind {
		case markArrived:
			if start >= 0 && write > start {
				end()
				start = -1
			}
			if start < 0 {
				start, wake, handle = m.t, 0, 0
			}
		case markWoken:
			if start >= 0 && wake == 0 {
				wake = m.t
			}
		case markHandled:
			if start >= 0 {
				handle = m.t
			}
		case markWritten:
			write = m.t
		}
	}
	if len(written) == 0 {
		return Exchanges{}, errNoExchanges
	}
	x := Exchanges{
		Count:           len(written),
		WallPerExchange: us(last-first) / float64(len(written)),
		Woken:           median(woken),
		Handled:         median(handled),
		Written:         median(written),
	}
	for _, v := range written {
		x.Mean += v / float64(len(written))
	}
	return x, nil
}

type markKind uint8

const (
	markArrived markKind = iota
	markWoken
	markHandled
	markWritten
)

func hasFrame(s trace.Stack, name string) bool {
	for f := range s.Frames() {
		if strings.Contains(f.Func, name) {
			return true
		}
	}
	return false
}

func us(d trace.Time) float64 { return float64(d) / 1e3 }

// median is the middle value of v (0 for none); v is sorted in place.
func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	slices.Sort(v)
	return v[len(v)/2]
}
