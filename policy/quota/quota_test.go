package quota

import (
	"errors"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 12, 7, 10, 0, 0, 0, time.UTC)

func read(t *testing.T, now time.Time, kv ...string) Reading {
	t.Helper()
	var r Reading
	for i := 0; i+1 < len(kv); i += 2 {
		if known, err := ParseHeader(kv[i], kv[i+1], now, &r); !known || err != nil {
			t.Fatalf("%s: %q: known %v, %v", kv[i], kv[i+1], known, err)
		}
	}
	return r
}

func TestParseOpenAIHeaders(t *testing.T) {
	r := read(t, t0,
		"x-ratelimit-limit-requests", "60",
		"x-ratelimit-remaining-requests", "59",
		"x-ratelimit-reset-requests", "1s",
		"x-ratelimit-limit-tokens", "150000",
		"x-ratelimit-remaining-tokens", "149984",
		"x-ratelimit-reset-tokens", "6m0s")
	if w := r.Windows[Requests]; w.Limit != 60 || w.Remaining != 59 || !w.Reset.Equal(t0.Add(time.Second)) || w.Has != HasLimit|HasRemaining|HasReset {
		t.Errorf("requests %+v", w)
	}
	if w := r.Windows[Tokens]; w.Limit != 150000 || w.Remaining != 149984 || !w.Reset.Equal(t0.Add(6*time.Minute)) {
		t.Errorf("tokens %+v", w)
	}
	for v, want := range map[string]time.Duration{"1.5s": 1500 * time.Millisecond, "20ms": 20 * time.Millisecond, "2m59.56s": 2*time.Minute + 59560*time.Millisecond, "7": 7 * time.Second, "0.25": 250 * time.Millisecond} {
		r := read(t, t0, "x-ratelimit-reset-tokens", v)
		if got := r.Windows[Tokens].Reset.Sub(t0); got != want {
			t.Errorf("reset %q: %s, want %s", v, got, want)
		}
	}
}

func TestParseAnthropicHeaders(t *testing.T) {
	r := read(t, t0,
		"anthropic-ratelimit-requests-limit", "50",
		"anthropic-ratelimit-requests-remaining", "49",
		"anthropic-ratelimit-requests-reset", "2026-12-07T10:00:01Z",
		"anthropic-ratelimit-input-tokens-limit", "40000",
		"anthropic-ratelimit-input-tokens-remaining", "39000",
		"anthropic-ratelimit-input-tokens-reset", "2026-12-07T10:00:02.5Z",
		"anthropic-ratelimit-output-tokens-remaining", "7000",
		"anthropic-ratelimit-tokens-remaining", "46000",
		"anthropic-ratelimit-tokens-reset", "2026-12-07T09:59:00Z") // past: now
	if w := r.Windows[Requests]; w.Limit != 50 || w.Remaining != 49 || !w.Reset.Equal(t0.Add(time.Second)) {
		t.Errorf("requests %+v", w)
	}
	if w := r.Windows[InputTokens]; w.Remaining != 39000 || !w.Reset.Equal(t0.Add(2500*time.Millisecond)) {
		t.Errorf("input tokens %+v", w)
	}
	if w := r.Windows[OutputTokens]; w.Remaining != 7000 || w.Has != HasRemaining {
		t.Errorf("output tokens %+v", w)
	}
	if w := r.Windows[Tokens]; !w.Reset.Equal(t0) {
		t.Errorf("a reset in the past: %+v, want now", w)
	}
}

func TestParseRejectsWhatCannotBeTrue(t *testing.T) {
	for _, tc := range []struct {
		name, value string
		want        error
	}{
		{"x-ratelimit-remaining-requests", "many", ErrMalformed},
		{"x-ratelimit-remaining-requests", "-1", ErrAbsurd},
		{"x-ratelimit-limit-tokens", "99999999999999999", ErrAbsurd},
		{"x-ratelimit-limit-tokens", "1.5", ErrMalformed},
		{"x-ratelimit-reset-tokens", "", ErrMalformed},
		{"x-ratelimit-reset-tokens", "soon", ErrMalformed},
		{"x-ratelimit-reset-tokens", "-3s", ErrMalformed},
		{"x-ratelimit-reset-tokens", "9000h", ErrAbsurd},
		{"x-ratelimit-reset-tokens", "1e9", ErrAbsurd},
		{"x-ratelimit-reset-tokens", "NaN", ErrMalformed},
		{"anthropic-ratelimit-requests-reset", "2027-12-07T10:00:00Z", ErrAbsurd},
		{"anthropic-ratelimit-requests-reset", "2026-13-07T10:00:00Z", ErrMalformed},
	} {
		var r Reading
		known, err := ParseHeader(tc.name, tc.value, t0, &r)
		if !known || !errors.Is(err, tc.want) {
			t.Errorf("%s: %q: known %v, %v, want %v", tc.name, tc.value, known, err, tc.want)
		}
		if !r.Empty() {
			t.Errorf("%s: %q changed the reading: %+v", tc.name, tc.value, r)
		}
	}
	for _, name := range []string{"x-ratelimit-limit", "x-ratelimit-used-requests", "x-ratelimit-limit-images", "anthropic-ratelimit-tokens", "anthropic-ratelimit-images-limit", "retry-after", "x-request-id"} {
		var r Reading
		if known, err := ParseHeader(name, "5", t0, &r); known || err != nil {
			t.Errorf("%s: known %v, %v; want an unknown header", name, known, err)
		}
	}
}

// TestTrackerKeepsABurstWithinTheQuota: with 3 requests left, 3 requests are admitted before
// any answers, the 4th is refused until a response says more are left or the reset passes;
// tokens likewise, and the reserve is kept for the highest priority.
func TestTrackerKeepsABurstWithinTheQuota(t *testing.T) {
	var tr Tracker
	need := Need{Prompt: 100, Completion: 400}
	// Unknown quotas refuse nothing.
	first, _, ok := tr.Reserve(need, 0, false, t0)
	if !ok {
		t.Fatal("an unknown quota refused a request")
	}
	// Its response is the first reading.
	tr.Observe(&first, &Reading{Windows: [numKinds]Window{
		Requests: {Limit: 10, Remaining: 3, Reset: t0.Add(2 * time.Second), Has: HasLimit | HasRemaining | HasReset},
		Tokens:   {Limit: 100000, Remaining: 90000, Reset: t0.Add(time.Minute), Has: HasLimit | HasRemaining | HasReset},
	}}, t0)
	var held []Reservation
	for i := range 3 {
		res, _, ok := tr.Reserve(need, 0, false, t0)
		if !ok {
			t.Fatalf("request %d of the 3 left refused", i+1)
		}
		held = append(held, res)
	}
	_, v, ok := tr.Reserve(need, 0, false, t0)
	if ok || v.Kind != Requests || v.Left != 0 || v.ResetIn != 2*time.Second {
		t.Fatalf("the 4th request: ok %v, %+v; want refused on requests, reset in 2s", ok, v)
	}
	// The first response says 5 are left now (the provider counted it and one more): the 4th
	// fits again, counting the two still in flight.
	tr.Observe(&held[0], &Reading{Windows: [numKinds]Window{Requests: {Remaining: 5, Has: HasRemaining}}}, t0.Add(100*time.Millisecond))
	for i := range 3 {
		if _, _, ok := tr.Reserve(need, 0, false, t0.Add(100*time.Millisecond)); !ok {
			t.Fatalf("request %d after the reading refused (5 left, 2 in flight)", i+1)
		}
	}
	if _, _, ok := tr.Reserve(need, 0, false, t0.Add(100*time.Millisecond)); ok {
		t.Fatal("a 6th request admitted against 5 left")
	}
	// The reading kept the reset: at it the quota is full again, and the answer to a request
	// sent at the reset instant is of the new window.
	atReset, _, ok := tr.Reserve(need, 0, false, t0.Add(2*time.Second))
	if !ok {
		t.Fatal("refused after the reset")
	}
	tr.Observe(&atReset, &Reading{Windows: [numKinds]Window{Requests: {Remaining: 9, Has: HasRemaining}}}, t0.Add(2100*time.Millisecond))
	if st := tr.States(t0.Add(2100 * time.Millisecond)); st[0].Remaining != 9 {
		t.Fatalf("the answer to a request sent at the reset: %+v, want 9 left", st)
	}

	// Tokens: 1 000 left, a reserve of 10 % of 100 000 for the top priority.
	var tt Tracker
	tt.Observe(&Reservation{}, &Reading{Windows: [numKinds]Window{Tokens: {Limit: 100000, Remaining: 10500, Has: HasLimit | HasRemaining}}}, t0)
	if _, v, ok := tt.Reserve(Need{Prompt: 100, Completion: 500}, 0.1, false, t0); ok || v.Kind != Tokens || v.Left != 500 {
		t.Fatalf("600 tokens below the reserve: ok %v %+v; want refused with 500 left", ok, v)
	}
	res, _, ok := tt.Reserve(Need{Prompt: 100, Completion: 500}, 0.1, true, t0)
	if !ok {
		t.Fatal("the top priority could not use the reserve")
	}
	// The request ends without a reading: it holds its real use (300) instead of its estimate
	// (600) until a reading counts it.
	tt.Settle(&res, Need{Prompt: 100, Completion: 200}, t0)
	if st := tt.States(t0); len(st) != 1 || st[0].Remaining != 10500 || st[0].Pending != 300 {
		t.Fatalf("after settling: %+v, want 10500 left and 300 held", st)
	}
	// Settling twice, or releasing after, changes nothing.
	tt.Settle(&res, Need{Prompt: 100, Completion: 200}, t0)
	tt.Release(&res)
	if st := tt.States(t0); st[0].Remaining != 10500 || st[0].Pending != 300 {
		t.Fatalf("a second settle changed the quota: %+v", st)
	}
	// The reading of a request sent after counts it.
	next, _, ok := tt.Reserve(Need{Prompt: 10, Completion: 10}, 0.1, true, t0)
	if !ok {
		t.Fatal("refused with 10 200 left")
	}
	tt.Observe(&next, &Reading{Windows: [numKinds]Window{Tokens: {Remaining: 10180, Has: HasRemaining}}}, t0)
	if st := tt.States(t0); st[0].Remaining != 10180 || st[0].Pending != 0 {
		t.Fatalf("after the next reading: %+v, want 10180 left and nothing held", st)
	}
}

// provider is a provider account with a request quota for the interleaving tests: it counts
// each request as it receives it and stamps the reading its answer will carry then.
type provider struct {
	used, limit int64
	readings    map[string]int64
}

// TestTrackerNeverOvershootsWhateverTheOrderOfAnswers plays interleavings of admissions
// (+X admitted, -X refused), the provider receiving a request (pX: refused there when its
// quota is used up, which is what the tracker must never let happen), its answer saying what
// is left (oX) and a request ending without a reading (sX). deepseek has 5 requests a window;
// a first answer said 3 are left. Answers arrive in any order: one that comes after the answer
// of a request sent later tells less than the tracker already knows.
func TestTrackerNeverOvershootsWhateverTheOrderOfAnswers(t *testing.T) {
	for _, tc := range []struct{ name, steps string }{
		// The burst's answers arrive out of order: B's says 1 is left, then A's, sent
		// earlier, says 2; the provider has counted all three.
		{"answers out of order", "+A +B +C -D pA pB pC oB -D oA -D oC -D"},
		{"answers in order", "+A +B +C -D pA pB pC oA -D oB -D oC -D"},
		{"answers in reverse order", "+A +B +C pA pB pC oC -D oB -D oA -D"},
		// A's answer tells 2 left while B, sent after, is in flight and received by the
		// provider: B holds until its own answer.
		{"one at a time", "+A pA oA +B pB oB +C -D pC oC -D"},
		{"an answer with others in flight", "+A pA +B oA +C -D pB pC oC -D oB -D"},
		// B's answer, arriving first, was read before A reached the provider: A's later
		// answer is not taken (B's tells more, 2 left) but A was not counted in B's: A goes on
		// holding, which leaves the 1 the provider has.
		{"a stale answer that the newer one did not count", "+A +B pB oB pA oA +C -D pC oC -D"},
		{"a request ends without reading", "+A pA sA +B +C -D pB oB -D pC oC -D"},
		// The reading of a request sent after A ended counts A: it stops holding.
		{"a hold ends with a later reading", "+A pA sA +B pB oB +C -D pC oC -D"},
		// The provider receives the burst in the reverse of the order it was sent in, and
		// A's answer (0 left) arrives first: C's, sent after A but received before it, says 2
		// and is taken, yet does not count A, which holds again.
		{"readings in the reverse of the order sent", "+A +B +C pC pB pA oA -D oC -D oB -D"},
		{"a reading that does not count the one it replaces", "+A +B pB pA oA oB +C -D pC oC -D"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var tr Tracker
			p := provider{used: 2, limit: 5, readings: map[string]int64{}}
			reset := t0.Add(time.Hour)
			reading := func(left int64) *Reading {
				return &Reading{Windows: [numKinds]Window{Requests: {Limit: p.limit, Remaining: left, Reset: reset, Has: HasLimit | HasRemaining | HasReset}}}
			}
			first, _, _ := tr.Reserve(Need{}, 0, false, t0)
			tr.Observe(&first, reading(3), t0)
			held := map[string]*Reservation{}
			for i, step := range strings.Fields(tc.steps) {
				now := t0.Add(time.Duration(i+1) * time.Millisecond)
				x := step[1:]
				switch step[0] {
				case '+', '-':
					res, v, ok := tr.Reserve(Need{Prompt: 1}, 0, false, now)
					if want := step[0] == '+'; ok != want {
						t.Fatalf("step %d %s: admitted %v (verdict %+v), states %+v", i, step, ok, v, tr.States(now))
					}
					held[x] = &res
				case 'p':
					if p.used >= p.limit {
						t.Fatalf("step %d %s: the provider refused %s: its quota is used up", i, step, x)
					}
					p.used++
					p.readings[x] = p.limit - p.used
				case 'o':
					tr.Observe(held[x], reading(p.readings[x]), now)
				case 's':
					tr.Settle(held[x], Need{Prompt: 1}, now)
				}
			}
			if st := tr.States(t0); len(st) != 1 || st[0].Pending < 0 {
				t.Fatalf("states %+v", st)
			}
		})
	}
}

// TestTrackerForgetsAQuotaWithoutLimitAtItsReset: a reading with remaining and reset but no
// limit cannot say how full the quota is after the reset: the quota is unknown again.
func TestTrackerForgetsAQuotaWithoutLimitAtItsReset(t *testing.T) {
	var tr Tracker
	tr.Observe(&Reservation{}, &Reading{Windows: [numKinds]Window{Requests: {Remaining: 0, Reset: t0.Add(time.Second), Has: HasRemaining | HasReset}}}, t0)
	if _, _, ok := tr.Reserve(Need{}, 0, false, t0); ok {
		t.Fatal("admitted with 0 requests left")
	}
	if _, _, ok := tr.Reserve(Need{}, 0, false, t0.Add(time.Second)); !ok {
		t.Fatal("refused after the reset")
	}
	if st := tr.States(t0.Add(time.Second)); len(st) != 0 {
		t.Fatalf("states %+v after the reset of a quota without limit", st)
	}
}

func FuzzParseHeader(f *testing.F) {
	for _, s := range [][2]string{
		{"x-ratelimit-remaining-tokens", "149984"}, {"x-ratelimit-reset-tokens", "6m0s"}, {"x-ratelimit-reset-requests", "1.5s"},
		{"anthropic-ratelimit-requests-reset", "2026-12-07T10:00:01Z"}, {"anthropic-ratelimit-input-tokens-limit", "40000"},
		{"x-ratelimit-reset-tokens", "1e3"}, {"x-ratelimit-limit-requests", "-0"},
	} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, name, value string) {
		var r Reading
		known, err := ParseHeader(name, value, t0, &r)
		if !known && (err != nil || !r.Empty()) {
			t.Fatalf("an unknown header %q changed the reading or failed: %v", name, err)
		}
		if err != nil && !r.Empty() {
			t.Fatalf("%q: %q failed (%v) but changed the reading", name, value, err)
		}
		for _, w := range r.Windows {
			if w.Limit < 0 || w.Limit > MaxAmount || w.Remaining < 0 || w.Remaining > MaxAmount {
				t.Fatalf("%q: %q read as %+v", name, value, w)
			}
			if !w.Reset.IsZero() && (w.Reset.Before(t0) || w.Reset.Sub(t0) > MaxReset) {
				t.Fatalf("%q: %q reset at %s", name, value, w.Reset)
			}
		}
	})
}

// TestTrackerMergesTheFleet: a later reading from another replica replaces this one's, an
// earlier one or one whose reset has passed does not, and the other replicas' requests in
// flight count against the quota until they are forgotten.
func TestTrackerMergesTheFleet(t *testing.T) {
	var tr Tracker
	res, _, _ := tr.Reserve(Need{Prompt: 10}, 0, false, t0)
	r := read(t, t0, "x-ratelimit-limit-requests", "10", "x-ratelimit-remaining-requests", "5", "x-ratelimit-reset-requests", "1m")
	tr.Observe(&res, &r, t0)
	if s := tr.Share(t0)[Requests]; !s.At.Equal(t0) || s.Remaining != 5 || s.Limit != 10 || !s.Reset.Equal(t0.Add(time.Minute)) || s.Pending != 0 {
		t.Fatalf("shared %+v", s)
	}

	var fleet [NumKinds]Shared
	// An earlier reading changes nothing; the others' 3 requests in flight count.
	fleet[Requests] = Shared{At: t0.Add(-time.Second), Limit: 10, Remaining: 9, Reset: t0.Add(time.Minute), Pending: 3}
	tr.Merge(fleet, t0.Add(time.Second))
	if _, v, ok := tr.Reserve(Need{}, 0, false, t0.Add(time.Second)); !ok {
		t.Fatalf("5 left, 3 held elsewhere: refused %+v", v)
	}
	if _, v, ok := tr.Reserve(Need{}, 0, false, t0.Add(time.Second)); !ok {
		t.Fatalf("5 left, 3 held elsewhere, 1 here: refused %+v", v)
	}
	if _, v, ok := tr.Reserve(Need{}, 0, false, t0.Add(time.Second)); ok || v.Kind != Requests || v.Left != 0 {
		t.Fatalf("5 left, 3 held elsewhere, 2 here: admitted (verdict %+v)", v)
	}
	// A later reading replaces this one's: 8 left.
	fleet[Requests] = Shared{At: t0.Add(2 * time.Second), Limit: 10, Remaining: 8, Reset: t0.Add(time.Minute), Pending: 3}
	tr.Merge(fleet, t0.Add(2*time.Second))
	if st := tr.States(t0.Add(2 * time.Second)); len(st) != 1 || st[0].Remaining != 8 || st[0].Remote != 3 || st[0].Pending != 2 {
		t.Fatalf("after a later reading: %+v", st)
	}
	// A reading whose reset has passed is the past: the quota is full again.
	fleet[Requests] = Shared{At: t0.Add(3 * time.Second), Limit: 10, Remaining: 0, Reset: t0.Add(3 * time.Second), Pending: 0}
	tr.Merge(fleet, t0.Add(2*time.Minute))
	if st := tr.States(t0.Add(2 * time.Minute)); len(st) != 1 || st[0].Remaining != 10 {
		t.Fatalf("after the reset: %+v", st)
	}
	// Forgotten: the others' holdings no longer count.
	fleet[Requests] = Shared{Pending: 7}
	tr.Merge(fleet, t0.Add(2*time.Minute))
	tr.ForgetRemote()
	if st := tr.States(t0.Add(2 * time.Minute)); st[0].Remote != 0 {
		t.Fatalf("after ForgetRemote: %+v", st)
	}
}

// TestTrackerFleetNeverOvershoots: two replicas share a provider's quota through a store that
// keeps the latest reading and sums the holds (as the cluster's Redis script does). Each
// replica sends one request; the provider counts A's and then B's, but A's answer (2 left)
// reaches its replica after B's (1 left) reached the other: the fleet must keep B's reading,
// of the request sent later, and let exactly one more request through.
func TestTrackerFleetNeverOvershoots(t *testing.T) {
	var a, b Tracker
	var store [NumKinds]Shared
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	sync := func(now time.Time) {
		trs := []*Tracker{&a, &b}
		var held [2][NumKinds]int64
		for i, tr := range trs {
			for k, s := range tr.Share(now) {
				if s.At.After(store[k].At) {
					store[k] = s
				}
				held[i][k] = s.Pending
			}
		}
		for i, tr := range trs {
			fleet := store
			for k := range fleet {
				fleet[k].Pending = held[1-i][k]
			}
			tr.Merge(fleet, now)
		}
	}
	reading := func(left int64) *Reading {
		return &Reading{Windows: [numKinds]Window{Requests: {Limit: 5, Remaining: left, Reset: t0.Add(time.Hour), Has: HasLimit | HasRemaining | HasReset}}}
	}
	first, _, _ := a.Reserve(Need{}, 0, false, at(0))
	a.Observe(&first, reading(3), at(0))
	sync(at(1))
	resA, _, okA := a.Reserve(Need{}, 0, false, at(2))
	sync(at(3))
	resB, _, okB := b.Reserve(Need{}, 0, false, at(4))
	if !okA || !okB {
		t.Fatalf("3 left: admitted %v on a, %v on b", okA, okB)
	}
	sync(at(5))
	// The provider counts A (2 left) then B (1 left); B's answer arrives first.
	b.Observe(&resB, reading(1), at(6))
	a.Observe(&resA, reading(2), at(7))
	sync(at(8))
	// The provider has 1 left. A's answer arrived after B was sent: B's reading, kept by the
	// fleet, may or may not count A (the provider may have received them in either order), so
	// A holds again until a reading known to count it. No replica may see more than 1 left,
	// and the fleet admits at most 1 more.
	for name, tr := range map[string]*Tracker{"a": &a, "b": &b} {
		if st := tr.States(at(8)); len(st) != 1 || st[0].Remaining-st[0].Pending-st[0].Remote > 1 {
			t.Errorf("%s: %+v, want at most 1 left", name, st)
		}
	}
	admitted := 0
	for i, tr := range []*Tracker{&a, &b, &a, &b} {
		if _, _, ok := tr.Reserve(Need{}, 0, false, at(9+2*i)); ok {
			admitted++
		}
		sync(at(10 + 2*i))
	}
	if admitted > 1 {
		t.Fatalf("the fleet admitted %d requests with 1 left", admitted)
	}
}

// TestTrackerTakesEachRetriedAttemptsReading: a request Envoy's router sends three times (two
// attempts retried) takes one request of the quota per attempt. Each attempt's reading is
// placed by when the attempt was sent (Sent) and taken, and the quota never shows more than
// the provider has; the request's own hold ends with its last response.
func TestTrackerTakesEachRetriedAttemptsReading(t *testing.T) {
	var tr Tracker
	reading := func(left int64) *Reading {
		return &Reading{Windows: [numKinds]Window{Requests: {Limit: 10, Remaining: left, Reset: t0.Add(time.Hour), Has: HasLimit | HasRemaining | HasReset}}}
	}
	first, _, _ := tr.Reserve(Need{}, 0, false, t0)
	tr.Observe(&first, reading(5), t0)
	res, _, ok := tr.Reserve(Need{}, 0, false, t0)
	if !ok {
		t.Fatal("refused with 5 left")
	}
	for _, left := range []int64{4, 3, 2} {
		sent := tr.Sent(t0)
		tr.Observe(&sent, reading(left), t0)
		st := tr.States(t0)
		if len(st) != 1 || st[0].Remaining != left || st[0].Remaining-st[0].Pending > left {
			t.Fatalf("after the attempt the provider answered with %d left: %+v", left, st)
		}
	}
	tr.Observe(&res, reading(2), t0)
	if st := tr.States(t0); len(st) != 1 || st[0].Remaining != 2 || st[0].Remaining-st[0].Pending > 2 {
		t.Fatalf("after the request's last response: %+v", st)
	}
}
