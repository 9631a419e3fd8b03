package mock

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Limits of a capacity schedule.
const (
	maxScheduleSteps    = 1024
	maxScheduleCapacity = 1 << 20
	maxScheduleOffset   = 7 * 24 * time.Hour
)

// CapacityStep sets the whole provider's capacity to Capacity from At on,
// At being simulated time since the schedule started.
type CapacityStep struct {
	At       time.Duration `json:"at"`
	Capacity int           `json:"capacity"`
}

// CapacitySchedule is a capacity that changes during a run: one step per
// change, the first at 0s, offsets strictly increasing. It models a provider
// whose real capacity moves under its clients (a brownout, a noisy neighbour
// taking part of the hardware): requests beyond the capacity in force wait in
// the same FIFO queue as under a fixed Options.Capacity. A lowered capacity
// revokes nothing: requests in service finish, and the queue moves again only
// once fewer than the new capacity are in service. A raised one lets the
// oldest waiters in at once.
//
// The text form, as ParseCapacitySchedule reads it and String writes it, is
// comma-separated capacity@offset steps: "10@0s,4@10s,10@25s" serves 10
// requests at once for the first 10 seconds, 4 until 25 s, then 10 again.
type CapacitySchedule []CapacityStep

// ParseCapacitySchedule reads the text form of a schedule (see
// CapacitySchedule). Every step is capacity@offset: a whole number of at least
// 1 (at most 1048576) and a Go duration (at most a week); the first offset is
// 0s and each next one is later than the one before. Spaces around steps are
// allowed; anything else is an error naming the step at fault.
func ParseCapacitySchedule(s string) (CapacitySchedule, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("capacity schedule is empty; want capacity@offset steps such as 10@0s,4@10s,10@25s")
	}
	parts := strings.Split(s, ",")
	if len(parts) > maxScheduleSteps {
		return nil, fmt.Errorf("capacity schedule has %d steps, at most %d are allowed", len(parts), maxScheduleSteps)
	}
	out := make(CapacitySchedule, 0, len(parts))
	for i, p := range parts {
		p = strings.TrimSpace(p)
		c, at, ok := strings.Cut(p, "@")
		if !ok {
			return nil, fmt.Errorf("capacity schedule step %d %q: want capacity@offset, such as 4@10s", i+1, p)
		}
		n, err := strconv.Atoi(c)
		if err != nil {
			return nil, fmt.Errorf("capacity schedule step %d %q: capacity %q is not a whole number", i+1, p, c)
		}
		d, err := time.ParseDuration(at)
		if err != nil {
			return nil, fmt.Errorf("capacity schedule step %d %q: offset %q is not a duration such as 10s or 1m30s", i+1, p, at)
		}
		out = append(out, CapacityStep{At: d, Capacity: n})
	}
	if err := out.validate(); err != nil {
		return nil, err
	}
	return out, nil
}

// validate reports the first nonsensical step of a non-empty schedule.
func (cs CapacitySchedule) validate() error {
	if len(cs) > maxScheduleSteps {
		return fmt.Errorf("capacity schedule has %d steps, at most %d are allowed", len(cs), maxScheduleSteps)
	}
	for i, st := range cs {
		switch {
		case st.Capacity < 1 || st.Capacity > maxScheduleCapacity:
			return fmt.Errorf("capacity schedule step %d: capacity %d must lie in [1, %d]", i+1, st.Capacity, maxScheduleCapacity)
		case i == 0 && st.At != 0:
			return fmt.Errorf("capacity schedule step 1: the first step must be at 0s, not %v (the capacity must be known from the start)", st.At)
		case st.At < 0 || st.At > maxScheduleOffset:
			return fmt.Errorf("capacity schedule step %d: offset %v must lie in [0s, %v]", i+1, st.At, maxScheduleOffset)
		case i > 0 && st.At <= cs[i-1].At:
			return fmt.Errorf("capacity schedule step %d: offset %v must be later than the previous step's %v", i+1, st.At, cs[i-1].At)
		}
	}
	return nil
}

// String returns the text form ParseCapacitySchedule reads.
func (cs CapacitySchedule) String() string {
	var b strings.Builder
	for i, st := range cs {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%d@%v", st.Capacity, st.At)
	}
	return b.String()
}

// At returns the capacity in force at offset d of the schedule (the first
// step's before 0s); 0 for an empty schedule.
func (cs CapacitySchedule) At(d time.Duration) int {
	c := 0
	for i, st := range cs {
		if i > 0 && st.At > d {
			break
		}
		c = st.Capacity
	}
	return c
}

// scheduler applies a CapacitySchedule to a pool with one timer per change.
// It is safe for concurrent use.
type scheduler struct {
	steps CapacitySchedule
	scale float64
	pool  *pool

	mu     sync.Mutex
	gen    uint64 // bumped by every start and stop; a timer of an older one does nothing
	timers []*time.Timer
}

// start (re)starts the schedule now: the first step's capacity applies at
// once and each later step after its offset × scale of real time.
func (sc *scheduler) start() {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	sc.stopLocked()
	gen := sc.gen
	sc.pool.setLimit(sc.steps[0].Capacity)
	for _, st := range sc.steps[1:] {
		c := st.Capacity
		sc.timers = append(sc.timers, time.AfterFunc(time.Duration(float64(st.At)*sc.scale), func() {
			sc.mu.Lock()
			defer sc.mu.Unlock()
			if sc.gen == gen {
				sc.pool.setLimit(c)
			}
		}))
	}
}

// stop cancels the changes still to come; the capacity in force stays.
func (sc *scheduler) stop() {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	sc.stopLocked()
}

func (sc *scheduler) stopLocked() {
	sc.gen++
	for _, t := range sc.timers {
		t.Stop()
	}
	sc.timers = nil
}
