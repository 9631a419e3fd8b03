package bulkhead

// SetCheckTake installs a function run under the scheduler's lock after every grant.
func (s *Scheduler) SetCheckTake(f func(set []*Compartment)) { s.checkTake = f }

// InFlightLocked reads c's in-flight count; only call it from a SetCheckTake function.
func (c *Compartment) InFlightLocked() int64 { return c.inflight }

// LimitLocked reads c's concurrency limit (the pool member max for pool members); only call it
// from a SetCheckTake function.
func (c *Compartment) LimitLocked() int64 {
	if c.member != nil {
		return c.member.max
	}
	return c.maxConcurrent()
}

// PoolInFlightLocked reads the in-flight count of c's pool; only from a SetCheckTake function.
func (c *Compartment) PoolInFlightLocked() (int64, int64) {
	if c.member == nil {
		return 0, 0
	}
	return c.member.pool.inflight, c.member.pool.capacity
}
