package extproc

import (
	"context"
	"log/slog"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/tap"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// Kinds of silence that end a stream (idleWatch.expired), indexing metrics.timedOut.
const (
	silenceNone = iota
	// silenceFirst: no message within server.first_message_timeout of the stream opening.
	silenceFirst
	// silenceIdle: no message for server.stream_idle_timeout after the last one.
	silenceIdle
	silenceKinds
)

var silenceNames = [silenceKinds]string{"", "first_message", "idle"}

// Values of idleWatch.act other than a sweep's stamp (which is positive).
const (
	// actOpened: the stream has sent nothing since it opened, and no sweep has seen it yet.
	actOpened int64 = 0
	// actFresh: the stream's last message was handled after the last sweep.
	actFresh int64 = -1
	// actBusy: a message is being handled (admission may be queueing): the stream is not silent.
	actBusy int64 = -2
)

// idleWatch is a stream's entry in its server's idleReaper.
type idleWatch struct {
	// act is the stream's activity as the reaper last saw it: actOpened, actFresh, actBusy, or a
	// sweep's stamp (nanoseconds since Server.epoch, plus one) from which the stream counts as
	// silent. The stream goroutine writes actBusy and actFresh; the reaper replaces actOpened and
	// actFresh with its stamp (compare-and-swap, so a message in between wins).
	act atomic.Int64
	// holding is set while the admitted request's ticket may be released by the reaper: from
	// admission until the stream settles. Whoever swaps it to false releases the ticket.
	holding atomic.Bool
	// released is set once the reaper has released the ticket.
	released atomic.Bool
	// expired is the silence (silenceFirst, silenceIdle) for which the reaper ended the stream
	// (never set for a stream it cannot end).
	expired atomic.Uint32

	// Guarded by idleReaper.mu.
	first, idle time.Duration
	// quiet: the stamp in act counts from the stream's opening, not from a message.
	quiet      bool
	listed     bool
	prev, next *processor
	// end ends the stream: its Recv and Send return at once. Nil when the stream was not opened
	// through a server with EndableStreams (it is then only released, not ended).
	end func()
}

// idleReaper ends streams that stay silent: one that sends no message for
// server.first_message_timeout after it opened, and one that gets no message for
// server.stream_idle_timeout after its last, whatever it has sent. An admitted request's
// admission is released first, as a cancel.
//
// Every open stream is listed; one goroutine walks the list a sixtieth of the shortest timeout
// apart (at least 10 ms, at most 10 s). A stream does not read the clock for it: each message
// only marks the stream busy while it is handled and fresh after, and the first sweep that
// finds it fresh stamps it with the sweep's time, so a stream is ended between one and two
// periods after its timeout. The goroutine starts with the first listed stream and ends after a
// whole period with nothing listed (not at once: a server taking one stream at a time would
// otherwise start a goroutine per stream), or when the server is closed. The watch costs two
// short lock holds per stream and two atomic stores per message, and no timer of its own. Safe
// for concurrent use.
type idleReaper struct {
	srv *Server

	mu      sync.Mutex
	head    *processor
	running bool
	closed  bool
	// idle is set by a sweep that found nothing listed; the next such sweep ends the goroutine.
	idle   bool
	period time.Duration
	// wake makes the goroutine look at once (the server closed).
	wake chan struct{}
	// wg counts the goroutine, for Close to wait for it.
	wg sync.WaitGroup
}

const (
	minIdlePeriod = 10 * time.Millisecond
	maxIdlePeriod = 10 * time.Second
)

// EndableStreams returns the gRPC server option that lets the server end a stream that stays
// silent (server.first_message_timeout, server.stream_idle_timeout): a stream's Recv only
// returns when its context ends, so each stream gets a context the server can cancel. Without
// it, a silent admitted request is still released, but its stream stays open until the client
// ends it. It installs the server's tap handle (grpc.InTapHandle), of which a gRPC server has
// one.
func EndableStreams() grpc.ServerOption { return grpc.InTapHandle(endableStream) }

// endable is the context a stream opened through EndableStreams carries: a cancellable
// context whose Err says DeadlineExceeded once the server ended the stream, so that gRPC,
// which writes the stream's status from its context's error as soon as Recv fails, ends it
// with DEADLINE_EXCEEDED (a stream Envoy ended says Canceled as before).
type endable struct {
	context.Context
	cancel context.CancelFunc
	ended  atomic.Bool
}

type endableKey struct{}

func (e *endable) Value(key any) any {
	if key == (endableKey{}) {
		return e
	}
	return e.Context.Value(key)
}

func (e *endable) Err() error {
	err := e.Context.Err()
	if err != nil && e.ended.Load() {
		return context.DeadlineExceeded
	}
	return err
}

// end ends the stream: Recv and Send return at once.
func (e *endable) end() {
	e.ended.Store(true)
	e.cancel()
}

func endableStream(ctx context.Context, _ *tap.Info) (context.Context, error) {
	ctx, cancel := context.WithCancel(ctx)
	return &endable{Context: ctx, cancel: cancel}, nil
}

// streamEnd returns the function that ends the stream of ctx, nil when it cannot be ended.
func streamEnd(ctx context.Context) func() {
	if e, ok := ctx.Value(endableKey{}).(*endable); ok {
		return e.end
	}
	return nil
}

// watch lists a new stream: it must send a message within first and then never be silent for
// idle.
func (p *processor) watch(first, idle time.Duration) {
	r := &p.srv.idle
	w := &p.idle
	w.act.Store(actOpened)
	end := streamEnd(p.ctx)
	period := min(max(min(first, idle)/60, minIdlePeriod), maxIdlePeriod)
	r.mu.Lock()
	defer r.mu.Unlock()
	w.first, w.idle, w.end, w.listed = first, idle, end, true
	w.next = r.head
	if r.head != nil {
		r.head.idle.prev = p
	}
	r.head = p
	r.idle = false
	if r.closed {
		return
	}
	if !r.running {
		r.running, r.period = true, period
		r.wg.Add(1)
		go r.run()
	} else {
		r.period = min(r.period, period)
	}
}

// busy marks the stream as handling a message: it is not silent, however long admission
// takes.
func (p *processor) busy() { p.idle.act.Store(actBusy) }

// heard marks the stream's message as handled: its silence counts from the next sweep.
func (p *processor) heard() { p.idle.act.Store(actFresh) }

// armIdle lets the reaper release the admitted request's ticket if the stream goes silent.
// Everything the release reads (the ticket, admittedAt, the request id) is written before.
func (p *processor) armIdle() { p.idle.holding.Store(true) }

// claimTicket takes the admitted request's ticket back from the reaper: true when the stream
// settles it itself, false when the reaper already released it.
func (p *processor) claimTicket() bool { return p.idle.holding.CompareAndSwap(true, false) }

// stopIdle takes the stream off the list before its goroutine leaves: once it returns, the
// reaper does not touch the stream any more.
func (p *processor) stopIdle() {
	r := &p.srv.idle
	r.mu.Lock()
	defer r.mu.Unlock()
	r.unlink(p)
}

// Close stops the idle watch's goroutine (streams still listed are no longer watched) and waits
// for it to end. Idempotent.
func (r *idleReaper) Close() {
	r.mu.Lock()
	r.closed = true
	if r.running {
		select {
		case r.wake <- struct{}{}:
		default:
		}
	}
	r.mu.Unlock()
	r.wg.Wait()
}

func (r *idleReaper) unlink(p *processor) {
	w := &p.idle
	if !w.listed {
		return
	}
	if w.prev != nil {
		w.prev.idle.next = w.next
	} else {
		r.head = w.next
	}
	if w.next != nil {
		w.next.idle.prev = w.prev
	}
	w.prev, w.next, w.listed, w.end = nil, nil, false, nil
}

// run walks the list until it is empty.
func (r *idleReaper) run() {
	defer r.wg.Done()
	t := time.NewTimer(r.periodNow())
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-r.wake:
		}
		if !r.sweep() {
			return
		}
		t.Reset(r.periodNow())
	}
}

func (r *idleReaper) periodNow() time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.period
}

// sweep stamps the streams active since the last sweep and ends those silent for their
// timeout. It reports false, and marks the reaper stopped, when the server closed or nothing
// was listed for a whole period. Ending happens under the lock, so a stream's stopIdle either
// comes first (the reaper leaves it alone) or waits for it.
func (r *idleReaper) sweep() bool {
	var ended [silenceKinds]int
	defer func() { r.srv.logSilent(ended) }()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		r.running = false
		return false
	}
	now := int64(r.srv.engine.Now().Sub(r.srv.epoch)) + 1
	for p := r.head; p != nil; {
		next := p.idle.next
		if why := r.check(p, now); why != silenceNone {
			r.unlink(p)
			if p.idle.expired.Load() != silenceNone {
				ended[why]++
			}
		}
		p = next
	}
	if r.head == nil {
		if r.idle {
			r.running = false
			return false
		}
		r.idle = true
	}
	return true
}

// check looks at one listed stream at now (a stamp), expiring it when it has been silent for
// its timeout; it returns the silence it expired the stream for.
func (r *idleReaper) check(p *processor, now int64) int {
	w := &p.idle
	switch act := w.act.Load(); act {
	case actBusy:
		return silenceNone
	case actOpened, actFresh:
		if w.act.CompareAndSwap(act, now) {
			w.quiet = act == actOpened
		}
		return silenceNone
	default:
		why, limit := silenceIdle, w.idle
		if w.quiet {
			why, limit = silenceFirst, w.first
		}
		if limit <= 0 || time.Duration(now-act) < limit {
			return silenceNone
		}
		p.expire(why)
		return why
	}
}

// expire ends a silent stream: the admitted request's ticket is released as a cancel, then
// the stream is ended (its Recv returns and Process says why, see endStatus). It runs on the
// reaper's goroutine and touches only the ticket (whose Done is safe from any goroutine and
// happens once), fields written before the ticket was armed, and the stream's context.
func (p *processor) expire(why int) {
	if p.claimTicket() {
		p.releaseIdle(why)
	}
	if p.idle.end == nil {
		return
	}
	p.idle.expired.Store(uint32(why))
	p.srv.metrics.timedOut[why].Inc()
	p.idle.end()
}

// logSilent logs, once a sweep, how many streams it ended for silence, by timeout (an admitted
// request's release also logs a line of its own).
func (s *Server) logSilent(ended [silenceKinds]int) {
	if ended[silenceFirst] == 0 && ended[silenceIdle] == 0 {
		return
	}
	s.log.LogAttrs(context.Background(), slog.LevelInfo, "ended ext_proc streams that went silent",
		slog.Int("first_message_timeout", ended[silenceFirst]), slog.Int("stream_idle_timeout", ended[silenceIdle]))
}

// releaseIdle releases a silent stream's admission as a cancel, on the reaper's goroutine.
func (p *processor) releaseIdle(why int) {
	p.idle.released.Store(true)
	p.srv.metrics.idleReleased.Inc()
	p.srv.log.Warn("no message on an admitted request's stream for server.stream_idle_timeout; released its admission",
		"request_id", p.req.id, "timeout", p.idle.idle.String(), "silence", silenceNames[why])
	defer func() {
		if r := recover(); r != nil {
			p.srv.metrics.panics.Inc()
			p.srv.log.Error("panic while releasing an idle request; its slots were released", "request_id", p.req.id,
				"panic", r, "stack", string(debug.Stack()))
		}
	}()
	now := p.srv.engine.Now()
	p.dec.ticket.Done(policy.Outcome{Cancelled: true, Duration: now.Sub(p.dec.admittedAt), At: now})
}
