package extproc

import (
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// idleWatch is a stream's entry in its server's idleReaper.
type idleWatch struct {
	// last is when the stream last received a message, in nanoseconds since Server.epoch.
	last atomic.Int64
	// released is set once the reaper has released the ticket.
	released atomic.Bool

	// Guarded by idleReaper.mu.
	timeout    time.Duration
	listed     bool
	prev, next *processor
}

// idleReaper releases admitted requests whose streams have gone silent for
// server.stream_idle_timeout. Admitted streams are listed; one goroutine walks the list a
// sixtieth of the shortest timeout apart (at least 10 ms, at most 10 s) and releases those
// idle for their timeout. The goroutine starts with the first listed stream and ends after a
// whole period with nothing listed (not at once: a server taking one stream at a time would
// otherwise start a goroutine per stream), or when the server is closed. A stream only stores
// the time of each message, so the watch costs two short lock holds per admitted stream and no
// timer of its own. Safe for concurrent use.
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

// touch records that the stream received a message at now (since the server's epoch), the
// time handle reads for the message anyway. Only a listed stream reads it.
func (p *processor) touch(now time.Duration) {
	if p.idle.timeout > 0 {
		p.idle.last.Store(int64(now))
	}
}

// armIdle lists an admitted request for the idle watch.
func (p *processor) armIdle(timeout time.Duration) {
	if timeout <= 0 {
		return
	}
	r := &p.srv.idle
	w := &p.idle
	w.last.Store(int64(p.dec.admittedAt.Sub(p.srv.epoch)))
	period := min(max(timeout/60, minIdlePeriod), maxIdlePeriod)
	r.mu.Lock()
	defer r.mu.Unlock()
	w.timeout, w.listed = timeout, true
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

// stopIdle takes the stream off the list before its goroutine settles or leaves: once it
// returns, the reaper will not release the ticket.
func (p *processor) stopIdle() {
	if p.idle.timeout == 0 {
		return
	}
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
	w.prev, w.next, w.listed = nil, nil, false
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

// sweep releases the listed streams idle for their timeout. It reports false, and marks the
// reaper stopped, when the server closed or nothing was listed for a whole period. Releasing
// happens under the lock, so a stream's stopIdle either comes first (the stream settles itself)
// or waits for the release.
func (r *idleReaper) sweep() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		r.running = false
		return false
	}
	now := r.srv.engine.Now().Sub(r.srv.epoch)
	for p := r.head; p != nil; {
		next := p.idle.next
		if now-time.Duration(p.idle.last.Load()) >= p.idle.timeout {
			r.unlink(p)
			p.releaseIdle()
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

// releaseIdle releases a silent stream's admission as a cancel. It runs on the reaper's
// goroutine and touches only the ticket (whose Done is safe from any goroutine and happens
// once) and fields written before the stream was listed.
func (p *processor) releaseIdle() {
	p.idle.released.Store(true)
	p.srv.metrics.idleReleased.Inc()
	p.srv.log.Warn("no message on an admitted request's stream for server.stream_idle_timeout; released its admission",
		"request_id", p.req.id, "timeout", p.idle.timeout.String())
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
