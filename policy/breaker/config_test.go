package breaker

import (
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func TestDefaultsAreResilience4js(t *testing.T) {
	want := Config{
		WindowType: CountBased, WindowSize: 100, MinimumCalls: 100,
		FailureRateThreshold: 50, SlowCallRateThreshold: 100, SlowCallDuration: time.Minute,
		WaitInOpen: time.Minute, WaitInOpenMultiplier: 1, PermittedCallsInHalfOpen: 10,
	}
	if got := Defaults(); got != want {
		t.Fatalf("Defaults() = %+v, want %+v", got, want)
	}
	if err := Defaults().Validate(); err != nil {
		t.Fatalf("Defaults().Validate() = %v", err)
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name    string
		change  func(c *Config)
		wantKey string
		wantMsg string // a fragment of the message that says why
	}{
		{"unknown window type", func(c *Config) { c.WindowType = 7 }, "sliding_window_type", "must be COUNT_BASED or TIME_BASED"},
		{"empty window", func(c *Config) { c.WindowSize = 0; c.MinimumCalls = 1 }, "sliding_window_size", "could never open"},
		{"huge count window", func(c *Config) { c.WindowSize = MaxCountWindow + 1 }, "sliding_window_size", "at most 100000"},
		{"huge time window", func(c *Config) { c.WindowType = TimeBased; c.WindowSize = 3601 }, "sliding_window_size", "at most 3600 (one hour)"},
		{"no minimum calls", func(c *Config) { c.MinimumCalls = 0 }, "minimum_calls", "rates computed from no calls mean nothing"},
		{"minimum above a count window", func(c *Config) { c.WindowSize = 10; c.MinimumCalls = 11 }, "minimum_calls", "the breaker could never open"},
		{"failure threshold zero", func(c *Config) { c.FailureRateThreshold = 0 }, "failure_rate_threshold", "even without failures"},
		{"failure threshold above 100", func(c *Config) { c.FailureRateThreshold = 100.5 }, "failure_rate_threshold", "could never reach it"},
		{"failure threshold NaN", func(c *Config) { c.FailureRateThreshold = math.NaN() }, "failure_rate_threshold", "greater than 0 and at most 100"},
		{"slow threshold negative", func(c *Config) { c.SlowCallRateThreshold = -1 }, "slow_call_rate_threshold", "even without slow calls"},
		{"slow threshold above 100", func(c *Config) { c.SlowCallRateThreshold = 101 }, "slow_call_rate_threshold", "slow calls could never open the breaker"},
		{"slow duration zero", func(c *Config) { c.SlowCallDuration = 0 }, "slow_call_duration", "every call would be slow"},
		{"wait in open below 1ms", func(c *Config) { c.WaitInOpen = 999 * time.Microsecond }, "wait_in_open", "never sheds any load"},
		{"multiplier below 1", func(c *Config) { c.WaitInOpenMultiplier = 0.5 }, "wait_in_open_multiplier", "probe a failing provider ever faster"},
		{"multiplier zero", func(c *Config) { c.WaitInOpenMultiplier = 0 }, "wait_in_open_multiplier", "at least 1"},
		{"multiplier infinite", func(c *Config) { c.WaitInOpenMultiplier = math.Inf(1) }, "wait_in_open_multiplier", "finite"},
		{"negative max wait in open", func(c *Config) { c.MaxWaitInOpen = -time.Second }, "max_wait_in_open", "must not be negative"},
		{"max wait in open below the wait", func(c *Config) { c.MaxWaitInOpen = 30 * time.Second }, "max_wait_in_open", "would cut even the first wait"},
		{"no probes", func(c *Config) { c.PermittedCallsInHalfOpen = 0 }, "permitted_calls_in_half_open", "never close again"},
		{"too many probes", func(c *Config) { c.PermittedCallsInHalfOpen = MaxCountWindow + 1 }, "permitted_calls_in_half_open", "no longer a cautious test"},
		{"negative half open limit", func(c *Config) { c.MaxWaitInHalfOpen = -1 }, "max_wait_in_half_open", "must not be negative"},
		{"half open limit below 1ms", func(c *Config) { c.MaxWaitInHalfOpen = time.Microsecond }, "max_wait_in_half_open", "no probe can answer that fast"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := Defaults()
			tc.change(&c)
			err := c.Validate()
			var ce ConfigErrors
			if !errors.As(err, &ce) {
				t.Fatalf("Validate() = %v, want ConfigErrors", err)
			}
			if len(ce) != 1 || ce[0].Key != tc.wantKey || !strings.Contains(ce[0].Msg, tc.wantMsg) {
				t.Fatalf("Validate() = %q, want one %s problem mentioning %q", err, tc.wantKey, tc.wantMsg)
			}
			if !strings.HasPrefix(err.Error(), tc.wantKey+": ") {
				t.Fatalf("Error() = %q, want it to start with the key", err)
			}
		})
	}
}

func TestValidateAccepts(t *testing.T) {
	tests := []struct {
		name   string
		change func(c *Config)
	}{
		{"minimum equal to a count window", func(c *Config) { c.WindowSize = 10; c.MinimumCalls = 10 }},
		{"time window minimum above its seconds", func(c *Config) { c.WindowType = TimeBased; c.WindowSize = 10; c.MinimumCalls = 500 }},
		{"slow rate threshold of 100", func(c *Config) { c.SlowCallRateThreshold = 100 }},
		{"failure rate threshold of 100", func(c *Config) { c.FailureRateThreshold = 100 }},
		{"fractional thresholds", func(c *Config) { c.FailureRateThreshold = 0.5; c.SlowCallRateThreshold = 99.9 }},
		{"growth with an explicit cap", func(c *Config) { c.WaitInOpenMultiplier = 2; c.MaxWaitInOpen = 10 * time.Minute }},
		{"growth with the default cap", func(c *Config) { c.WaitInOpenMultiplier = 1.5 }},
		{"cap equal to the wait", func(c *Config) { c.MaxWaitInOpen = c.WaitInOpen }},
		{"half open limit of 1ms", func(c *Config) { c.MaxWaitInHalfOpen = time.Millisecond }},
		{"largest windows", func(c *Config) { c.WindowSize = MaxCountWindow; c.PermittedCallsInHalfOpen = MaxCountWindow }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := Defaults()
			tc.change(&c)
			if err := c.Validate(); err != nil {
				t.Fatalf("Validate() = %v, want nil", err)
			}
		})
	}
}

func TestValidateReportsEveryProblem(t *testing.T) {
	err := Config{}.Validate()
	var ce ConfigErrors
	if !errors.As(err, &ce) {
		t.Fatalf("Validate() = %v, want ConfigErrors", err)
	}
	var keys []string
	for _, fe := range ce {
		keys = append(keys, fe.Key)
	}
	want := []string{"sliding_window_size", "minimum_calls", "failure_rate_threshold", "slow_call_rate_threshold",
		"slow_call_duration", "wait_in_open", "wait_in_open_multiplier", "permitted_calls_in_half_open"}
	if !equalStrings(keys, want) {
		t.Fatalf("keys = %q, want %q", keys, want)
	}
	if lines := strings.Split(err.Error(), "\n"); len(lines) != len(want) {
		t.Fatalf("Error() has %d lines, want %d", len(lines), len(want))
	}
	var fe FieldError
	if !errors.As(err, &fe) || fe.Key != "sliding_window_size" {
		t.Fatalf("errors.As(FieldError) = %+v, want the first problem", fe)
	}
}

func TestParseAndText(t *testing.T) {
	states := []struct {
		in   string
		want State
	}{
		{"CLOSED", Closed}, {"OPEN", Open}, {"HALF_OPEN", HalfOpen}, {"DISABLED", Disabled},
		{"FORCED_OPEN", ForcedOpen}, {"METRICS_ONLY", MetricsOnly}, {"forced_open", ForcedOpen}, {"Half_Open", HalfOpen},
	}
	for _, tc := range states {
		t.Run("state "+tc.in, func(t *testing.T) {
			got, err := ParseState(tc.in)
			if err != nil || got != tc.want {
				t.Fatalf("ParseState(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
			}
			var u State
			if err := u.UnmarshalText([]byte(tc.in)); err != nil || u != tc.want {
				t.Fatalf("UnmarshalText(%q) = %v, %v", tc.in, u, err)
			}
			if txt, err := got.MarshalText(); err != nil || !strings.EqualFold(string(txt), tc.in) {
				t.Fatalf("MarshalText = %q, %v", txt, err)
			}
		})
	}
	windows := []struct {
		in   string
		want WindowType
	}{{"COUNT_BASED", CountBased}, {"TIME_BASED", TimeBased}, {"time_based", TimeBased}}
	for _, tc := range windows {
		t.Run("window "+tc.in, func(t *testing.T) {
			got, err := ParseWindowType(tc.in)
			if err != nil || got != tc.want {
				t.Fatalf("ParseWindowType(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
			}
			var u WindowType
			if err := u.UnmarshalText([]byte(tc.in)); err != nil || u != tc.want {
				t.Fatalf("UnmarshalText(%q) = %v, %v", tc.in, u, err)
			}
			if txt, err := got.MarshalText(); err != nil || !strings.EqualFold(string(txt), tc.in) {
				t.Fatalf("MarshalText = %q, %v", txt, err)
			}
		})
	}
	bad := []struct {
		name string
		err  error
	}{
		{"unknown state", func() error { _, err := ParseState("AJAR"); return err }()},
		{"unknown window", func() error { _, err := ParseWindowType("SIZE_BASED"); return err }()},
		{"unmarshal unknown state", new(State).UnmarshalText([]byte("AJAR"))},
		{"unmarshal unknown window", new(WindowType).UnmarshalText([]byte(""))},
		{"marshal invalid state", func() error { _, err := State(9).MarshalText(); return err }()},
		{"marshal invalid window", func() error { _, err := WindowType(9).MarshalText(); return err }()},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			if tc.err == nil {
				t.Fatal("want an error")
			}
		})
	}
	strs := []struct{ got, want string }{
		{State(9).String(), "State(9)"}, {WindowType(9).String(), "WindowType(9)"},
		{Success.String(), "success"}, {Failure.String(), "failure"}, {Ignored.String(), "ignored"},
		{Outcome(0).String(), "Outcome(0)"}, {EventTransition.String(), "transition"},
		{EventThresholdExceeded.String(), "threshold_exceeded"},
	}
	for _, tc := range strs {
		t.Run("string "+tc.want, func(t *testing.T) {
			if tc.got != tc.want {
				t.Fatalf("String() = %q, want %q", tc.got, tc.want)
			}
		})
	}
}

func TestSnapshotJSON(t *testing.T) {
	b, err := New("openai", Defaults(), t0)
	if err != nil {
		t.Fatal(err)
	}
	out, err := json.Marshal(b.Snapshot(t0))
	if err != nil {
		t.Fatal(err)
	}
	for _, frag := range []string{`"name":"openai"`, `"state":"CLOSED"`, `"failure_rate":-1`} {
		if !strings.Contains(string(out), frag) {
			t.Fatalf("JSON %s lacks %s", out, frag)
		}
	}
}
