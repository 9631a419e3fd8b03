package envoysim

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// procStream is the simulator's side of one Process stream. Envoy never
// blocks its worker on the side stream, so sends go through a queue drained
// by a sender goroutine, and a receiver goroutine turns replies into events
// for the filter loop. Once the filter loop is gone, replies are kept in
// late so the recorded exchange stays complete.
type procStream struct {
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc

	mu        sync.Mutex
	queue     []*extprocv3.ProcessingRequest
	closeSend bool
	wake      chan struct{}

	events   chan<- event
	loopDone <-chan struct{}

	late     []Record
	recvErr  error // final Recv error: io.EOF for OK, a status error otherwise
	recvDone chan struct{}
	sendDone chan struct{}
}

func openStream(client extprocv3.ExternalProcessorClient, initial Headers, events chan<- event, loopDone <-chan struct{}) (*procStream, error) {
	ctx, cancel := context.WithCancel(context.Background())
	for _, h := range initial {
		ctx = metadata.AppendToOutgoingContext(ctx, h.Key, h.Value)
	}
	st, err := client.Process(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	s := &procStream{
		stream: st, cancel: cancel, wake: make(chan struct{}, 1),
		events: events, loopDone: loopDone,
		recvDone: make(chan struct{}), sendDone: make(chan struct{}),
	}
	go s.sendLoop()
	go s.recvLoop()
	return s, nil
}

func (s *procStream) send(m *extprocv3.ProcessingRequest) {
	s.mu.Lock()
	if !s.closeSend {
		s.queue = append(s.queue, m)
	}
	s.mu.Unlock()
	s.poke()
}

// halfClose asks the sender to CloseSend after the queued messages.
func (s *procStream) halfClose() {
	s.mu.Lock()
	s.closeSend = true
	s.mu.Unlock()
	s.poke()
}

func (s *procStream) reset() { s.cancel() }

func (s *procStream) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *procStream) sendLoop() {
	defer close(s.sendDone)
	for {
		s.mu.Lock()
		q := s.queue
		s.queue = nil
		closing := s.closeSend
		s.mu.Unlock()
		for _, m := range q {
			if err := s.stream.Send(m); err != nil {
				// The receiver sees the stream's real status; nothing more
				// can be sent.
				return
			}
		}
		if closing {
			s.mu.Lock()
			empty := len(s.queue) == 0
			s.mu.Unlock()
			if empty {
				_ = s.stream.CloseSend()
				return
			}
			continue
		}
		select {
		case <-s.wake:
		case <-s.stream.Context().Done():
			return
		}
	}
}

func (s *procStream) recvLoop() {
	defer close(s.recvDone)
	for {
		resp, err := s.stream.Recv()
		at := time.Now()
		if err != nil {
			s.mu.Lock()
			s.recvErr = err
			s.mu.Unlock()
			select {
			case s.events <- event{kind: evStreamEnd, err: err, at: at}:
			case <-s.loopDone:
			}
			return
		}
		select {
		case s.events <- event{kind: evReply, reply: resp, at: at}:
		case <-s.loopDone:
			s.mu.Lock()
			s.late = append(s.late, Record{At: at, Received: resp, Ignored: true})
			s.mu.Unlock()
		}
	}
}

// finalErr returns the error Recv ended with, once it has.
func (s *procStream) finalErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.recvErr
}

func (s *procStream) lateRecords() []Record {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Record(nil), s.late...)
}

// streamCode maps a Recv error to the gRPC code the client side saw.
func streamCode(err error) codes.Code {
	if err == nil || errors.Is(err, io.EOF) {
		return codes.OK
	}
	return status.Code(err)
}
