package extproc

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// logSink collects JSON log lines.
type logSink struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (s *logSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

// take returns the lines written since the last call.
func (s *logSink) take(t *testing.T) []map[string]any {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(s.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		out = append(out, m)
	}
	s.buf.Reset()
	return out
}

func newTestRefusalLog() (*refusalLog, *logSink) {
	sink := &logSink{}
	return newRefusalLog(slog.New(slog.NewJSONHandler(sink, nil))), sink
}

// TestRefusalLogBoundsAStorm: 2 000 refusals in one compartment within an interval cost five
// lines and one "suppressed 1995" line when the interval ends; another compartment's refusals
// are logged all the same; the next interval counts afresh; a quiet interval ends the goroutine.
func TestRefusalLogBoundsAStorm(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l, sink := newTestRefusalLog()
		defer l.Close()
		allowed := 0
		for range 2000 {
			if l.allow(policy.ReasonTokenBudget, "feature/batch_summarize") {
				allowed++
			}
		}
		for i := range 3 {
			if !l.allow(policy.ReasonBulkheadFull, "feature/chat") {
				t.Errorf("chat refusal %d held back by another compartment's storm", i)
			}
		}
		if allowed != refusalLinesPerKey {
			t.Errorf("%d of 2000 refusals let through in one interval, want %d", allowed, refusalLinesPerKey)
		}
		if lines := sink.take(t); len(lines) != 0 {
			t.Fatalf("summary before the interval ended: %v", lines)
		}

		synctest.Wait()
		time.Sleep(refusalLogInterval)
		synctest.Wait()
		lines := sink.take(t)
		if len(lines) != 1 {
			t.Fatalf("lines at the end of the interval: %v", lines)
		}
		if m := lines[0]; m["level"] != "INFO" || m["reason"] != "token_budget" || m["compartment"] != "feature/batch_summarize" ||
			m["suppressed"] != float64(2000-refusalLinesPerKey) || m["interval"] != "1s" {
			t.Errorf("summary %v", m)
		}

		// A new interval lets lines through again, and reports nothing held back.
		if !l.allow(policy.ReasonTokenBudget, "feature/batch_summarize") {
			t.Error("the next interval did not count afresh")
		}
		time.Sleep(refusalLogInterval)
		synctest.Wait()
		if lines := sink.take(t); len(lines) != 0 {
			t.Errorf("lines for an interval that held nothing back: %v", lines)
		}
		// An interval without refusals ends the goroutine.
		time.Sleep(refusalLogInterval)
		synctest.Wait()
		l.mu.Lock()
		running := l.running
		l.mu.Unlock()
		if running {
			t.Error("the goroutine still runs after a quiet interval")
		}
		// And the next refusal starts it again.
		for range refusalLinesPerKey + 2 {
			l.allow(policy.ReasonRateLimit, "tenant/acme")
		}
		time.Sleep(refusalLogInterval)
		synctest.Wait()
		if lines := sink.take(t); len(lines) != 1 || lines[0]["suppressed"] != float64(2) {
			t.Errorf("after a restart: %v", lines)
		}
	})
}

// TestRefusalLogBoundsLinesOverAllCompartments: refusals spread over 100 compartments are held
// to refusalLinesTotal lines an interval, and their summary to refusalSummariesMax lines plus
// one for the rest, the largest first; every refusal is accounted for.
func TestRefusalLogBoundsLinesOverAllCompartments(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l, sink := newTestRefusalLog()
		defer l.Close()
		allowed := 0
		for c := range 100 {
			for range 10 {
				if l.allow(policy.ReasonTokenBudget, "tenant/t"+strings.Repeat("x", c)) {
					allowed++
				}
			}
		}
		if allowed != refusalLinesTotal {
			t.Errorf("%d lines let through, want %d", allowed, refusalLinesTotal)
		}
		time.Sleep(refusalLogInterval)
		synctest.Wait()
		lines := sink.take(t)
		if len(lines) != refusalSummariesMax+1 {
			t.Fatalf("%d summary lines, want %d", len(lines), refusalSummariesMax+1)
		}
		var total float64
		for i, m := range lines {
			total += m["suppressed"].(float64)
			if i < refusalSummariesMax && m["suppressed"] != float64(10) {
				t.Errorf("summary %d is not among the largest: %v", i, m)
			}
		}
		last := lines[refusalSummariesMax]
		if last["pairs"] != float64(100-refusalSummariesMax) || last["compartment"] != nil {
			t.Errorf("the rest: %v", last)
		}
		if total != float64(1000-refusalLinesTotal) {
			t.Errorf("summaries account for %v refusals, want %d", total, 1000-refusalLinesTotal)
		}
	})
}

// TestRefusalLogCloseReportsWhatIsHeld: closing reports the refusals held back so far and
// stops the goroutine at once (synctest fails the test if it were left running).
func TestRefusalLogCloseReportsWhatIsHeld(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l, sink := newTestRefusalLog()
		for range refusalLinesPerKey + 4 {
			l.allow(policy.ReasonCircuitOpen, "provider/deepseek")
		}
		l.Close()
		l.Close()
		lines := sink.take(t)
		if len(lines) != 1 || lines[0]["suppressed"] != float64(4) || lines[0]["compartment"] != "provider/deepseek" {
			t.Errorf("at close: %v", lines)
		}
	})
}
