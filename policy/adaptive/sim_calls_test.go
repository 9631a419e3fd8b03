package adaptive

// The simulation's calls into the controller, each with what the process's stall meter reads
// at the time.

// begin starts r, admitted now.
func (x *sim) begin(r *simReq) Handle {
	r.stalled = x.stalled(x.now)
	return x.ctl.Start(x.now, r.stalled, r.prompt, true)
}

// first reports r's first token, handled now.
func (x *sim) first(r *simReq) int64 {
	stalled := x.stalled(x.now)
	return x.ctl.Observe(x.now, stalled, Sample{Admitted: r.admitted, TTFB: x.now.Sub(r.admitted), PromptTokens: r.prompt,
		Saturated: r.saturated, Handle: r.handle, Stalled: stalled - r.stalled})
}

// end reports the end of a request.
func (x *sim) end(s Sample) int64 { return x.ctl.Observe(x.now, x.stalled(x.now), s) }

// finish finishes r.
func (x *sim) finish(r *simReq) int64 { return x.ctl.Finish(x.now, x.stalled(x.now), r.handle) }
