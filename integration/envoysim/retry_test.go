package envoysim

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"
)

// TestRetryingReplaysTheBodyAndStopsWhereEnvoyDoes: every attempt gets the whole body; a
// connect failure and a retriable status are retried, a retry-after within MaxRetryAfter is
// waited, a status outside the list and the last attempt's answer come back as they are.
func TestRetryingReplaysTheBodyAndStopsWhereEnvoyDoes(t *testing.T) {
	type answer struct {
		status int
		header Headers
	}
	tests := []struct {
		name     string
		answers  []answer // 0: connect failure
		wantLast int
		wantN    int
		minWait  time.Duration
	}{
		{"503 then 200", []answer{{status: 503}, {status: 200}}, 200, 2, 0},
		{"connect failure then 200", []answer{{status: 0}, {status: 200}}, 200, 2, 0},
		{"429 waits its retry-after", []answer{{status: 429, header: Headers{{Key: "retry-after", Value: "1"}}}, {status: 200}}, 200, 2, time.Second},
		{"500 is not retried", []answer{{status: 500}, {status: 200}}, 500, 1, 0},
		{"retries run out", []answer{{status: 503}, {status: 503}, {status: 503}, {status: 200}}, 503, 3, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			n := 0
			up := UpstreamFunc(func(ctx context.Context, req *UpstreamRequest) (*UpstreamResponse, error) {
				b, _ := io.ReadAll(req.Body)
				if string(b) != "the body" {
					t.Errorf("attempt %d got body %q", n+1, b)
				}
				a := tc.answers[n]
				n++
				if a.status == 0 {
					return nil, &UpstreamError{Kind: ConnectFailure}
				}
				return &UpstreamResponse{Status: a.status, Headers: a.header}, nil
			})
			r := Retrying(up, RetryPolicy{NumRetries: 2, RetriableStatusCodes: []int{503, 429}, OnFailure: true,
				BackOff: time.Millisecond, MaxRetryAfter: 2 * time.Second})
			start := time.Now()
			resp, err := r.Serve(context.Background(), &UpstreamRequest{Body: strings.NewReader("the body")})
			if err != nil || resp.Status != tc.wantLast || n != tc.wantN {
				t.Fatalf("got %v %v after %d attempts, want %d after %d", resp, err, n, tc.wantLast, tc.wantN)
			}
			if waited := time.Since(start); waited < tc.minWait {
				t.Errorf("waited %v, want at least %v", waited, tc.minWait)
			}
		})
	}
}
