package breaker

import "testing"

// TestUnlimitedOnlyWherePermitsLimitNothing: a call made without asking (a proxy's own retry)
// gets a permit in CLOSED and METRICS_ONLY, which Record then counts; in every other state it
// gets none, and nothing is counted as not permitted — the breaker refused nothing.
func TestUnlimitedOnlyWherePermitsLimitNothing(t *testing.T) {
	for _, st := range []State{Closed, MetricsOnly, Open, HalfOpen, ForcedOpen, Disabled} {
		b, err := New("b", Defaults(), t0)
		if err != nil {
			t.Fatal(err)
		}
		// As an operator moves it (HALF_OPEN is reached from OPEN).
		path := map[State][]State{MetricsOnly: {MetricsOnly}, Open: {Open}, HalfOpen: {Open, HalfOpen},
			ForcedOpen: {ForcedOpen}, Disabled: {Disabled}}[st]
		for _, to := range path {
			if err := b.Transition(to, t0); err != nil {
				t.Fatal(err)
			}
		}
		p, ok := b.Unlimited()
		if want := st == Closed || st == MetricsOnly; ok != want {
			t.Errorf("%s: permit %v, want %v", st, ok, want)
		}
		if ok {
			b.Record(p, Failure, 0, t0)
			if c := b.Counts(); c.Failure != 1 {
				t.Errorf("%s: the unlimited call's failure was not recorded: %+v", st, c)
			}
		}
		if c := b.Counts(); c.NotPermitted != 0 {
			t.Errorf("%s: %d calls counted as not permitted", st, c.NotPermitted)
		}
	}
}
