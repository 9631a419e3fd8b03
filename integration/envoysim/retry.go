package envoysim

import (
	"bytes"
	"context"
	"errors"
	"io"
	"slices"
	"strconv"
	"time"
)

// RetryPolicy is the part of a route's retry_policy that Envoy's router applies behind the
// ext_proc filter, as Retrying plays it: retry_on reset,connect-failure,retriable-status-codes,
// num_retries, a fixed back-off (Envoy's is jittered and exponential; the simulator waits the
// base interval) and rate_limited_retry_back_off on retry-after (in seconds).
type RetryPolicy struct {
	// NumRetries is the most retries after the first attempt.
	NumRetries int
	// RetriableStatusCodes are retried while retries remain (retriable-status-codes).
	RetriableStatusCodes []int
	// OnFailure retries an attempt that failed before response headers (reset, connect-failure).
	OnFailure bool
	// BackOff is waited before each retry.
	BackOff time.Duration
	// MaxRetryAfter bounds a retry-after the router waits instead of BackOff
	// (rate_limited_retry_back_off.max_interval); a longer one is not honoured and BackOff applies.
	MaxRetryAfter time.Duration
	// IncludeAttemptCount sets x-envoy-attempt-count on every attempt (1 for the first), as the
	// virtual host's include_request_attempt_count does.
	IncludeAttemptCount bool
	// OnAttempt, when set, is called after every attempt with its status (0 for a failure before
	// headers) and whether the router retries it.
	OnAttempt func(status int, retried bool)
}

// Retrying returns an Upstream that retries like Envoy's router with policy p: the request
// body is buffered, and a retriable answer is dropped and the request sent again. Only the last
// attempt's response (or failure) comes back to the filter, which is where ext_proc sits as a
// downstream HTTP filter: the processor never sees the attempts that were retried. Wrap up in
// UpstreamFilter to put an ext_proc filter in the upstream (per-attempt) position as well: the
// router calls up once per attempt, so every attempt runs that filter anew.
func Retrying(up Upstream, p RetryPolicy) Upstream {
	return UpstreamFunc(func(ctx context.Context, req *UpstreamRequest) (*UpstreamResponse, error) {
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return nil, err
		}
		trailers := req.Trailers()
		for attempt := 0; ; attempt++ {
			r := *req
			r.Headers = req.Headers.Clone()
			if p.IncludeAttemptCount {
				r.Headers.Set("x-envoy-attempt-count", strconv.Itoa(attempt+1))
			}
			r.Body = bytes.NewReader(body)
			r.trailers = func() Headers { return trailers }
			resp, err := up.Serve(ctx, &r)
			last := attempt >= p.NumRetries || ctx.Err() != nil
			status := 0
			retriable := false
			wait := p.BackOff
			switch {
			case err != nil:
				var ue *UpstreamError
				retriable = p.OnFailure && (!errors.As(err, &ue) || ue.Kind == ConnectFailure)
			default:
				status = resp.Status
				retriable = slices.Contains(p.RetriableStatusCodes, status)
				if s, e := strconv.Atoi(resp.Headers.Get("retry-after")); e == nil && s >= 0 {
					if ra := time.Duration(s) * time.Second; ra <= p.MaxRetryAfter {
						wait = ra
					}
				}
			}
			if p.OnAttempt != nil {
				p.OnAttempt(status, retriable && !last)
			}
			if !retriable || last {
				return resp, err
			}
			if resp != nil {
				if c, ok := resp.Body.(io.Closer); ok {
					_ = c.Close()
				}
			}
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return resp, err
			case <-t.C:
			}
		}
	})
}
