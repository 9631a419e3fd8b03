package cluster

import (
	"context"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// leasedReplica opens a store on addr under prefix and returns a ledger keeping its sums there
// with leased admission, and the leaser. Its rounds run every 20 ms and when asked for, each under
// the lock returned, which a test holds to act between two rounds.
func leasedReplica(t testing.TB, addr, prefix, id string, timeout time.Duration) (*spend.Ledger, *Leaser, *Store, *sync.Mutex) {
	t.Helper()
	o := options(addr, prefix, id)
	o.Timeout, o.LeaseTTL, o.Heartbeat = timeout, 5*time.Second, time.Second
	s, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	l := newLeaser(s, LeaseOptions{Interval: 20 * time.Millisecond}, true)
	var drive sync.Mutex
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-l.kick:
			case <-tick.C:
			}
			drive.Lock()
			l.Round()
			drive.Unlock()
		}
	}()
	t.Cleanup(func() {
		close(stop)
		<-stopped
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		l.Close(ctx)
		_ = s.Close(ctx)
	})
	deadline := time.Now().Add(10 * time.Second)
	for !s.Available() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: Redis not available", id)
		}
		time.Sleep(5 * time.Millisecond)
	}
	ss := NewSpendStore(s)
	ss.UseLeases(l)
	led := spend.NewLedger(ss)
	_, _ = led.Configure(spend.Settings{Currency: "USD", Calendar: spend.NewCalendar(time.UTC)}, time.Now())
	return led, l, s, &drive
}

// spendHash returns a spend window's fields as Redis holds them, as integers.
func spendHash(t *testing.T, addr, prefix string, led *spend.Ledger, b spend.Budget) map[string]int64 {
	t.Helper()
	key := "{" + prefix + "}:sp:" + led.Window(b, time.Now()).ID.Key()
	h, err := inspect(t, addr).HGetAll(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for k, v := range h {
		if n, err := strconv.ParseInt(v, 10, 64); err == nil {
			out[k] = n
		}
	}
	return out
}

// TestLeasedSpendNeverAboveBudget: three replicas reserve random worst cases from their chunks
// of one $10 hourly budget, many requests at once on each, and settle each at a random real cost
// no higher. What the fleet holds (settled plus reserved in flight) never exceeds the $10 at any
// admission, and once everything has settled Redis counts every micro-dollar spent, exactly, and
// nothing reserved.
func TestLeasedSpendNeverAboveBudget(t *testing.T) {
	rd := redistest.Standalone(t)
	const limit = 10_000_000
	budget := spend.Budget{Name: "feature/chat", Period: spend.Hour, Limit: limit}
	if now := time.Now(); now.Add(time.Minute).Hour() != now.Hour() {
		t.Skip("too close to the end of the hour: the hourly window would reset during the test")
	}
	var leds []*spend.Ledger
	for i := range 3 {
		led, _, _, _ := leasedReplica(t, rd.Addr(), "never", "r"+strconv.Itoa(i), time.Second)
		leds = append(leds, led)
	}
	var held, spent, admitted atomic.Int64
	var maxHeld atomic.Int64
	var wg sync.WaitGroup
	for i, led := range leds {
		for g := range 8 {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(i), uint64(g)))
				refusals := 0
				for refusals < 3 {
					amount := spend.Micros(100_000 + rng.Int64N(900_000))
					r, rf, ok := reserveIn(t, led, budget, amount)
					if !ok {
						if rf.Unavailable || rf.Budget != budget {
							t.Errorf("refusal %+v", rf)
							return
						}
						refusals++
						continue
					}
					admitted.Add(1)
					h := held.Add(int64(amount))
					for {
						m := maxHeld.Load()
						if h <= m || maxHeld.CompareAndSwap(m, h) {
							break
						}
					}
					time.Sleep(time.Duration(rng.Int64N(3)) * time.Millisecond)
					cost := rng.Int64N(int64(amount) + 1)
					// Take the request off before settling: the settlement gives room back.
					held.Add(cost - int64(amount))
					spent.Add(cost)
					r.Settle(spend.Micros(cost), time.Now())
				}
			})
		}
	}
	wg.Wait()
	if m := maxHeld.Load(); m > limit {
		t.Fatalf("the fleet held %d micro-dollars (spent and reserved) at once, over the %d budget", m, limit)
	}
	waitFor(t, "Redis to count what was spent", func() bool {
		h := spendHash(t, rd.Addr(), "never", leds[0], budget)
		return h["s"] == spent.Load() && h["r"] == 0
	})
	h := spendHash(t, rd.Addr(), "never", leds[0], budget)
	t.Logf("%d admitted, $%.2f spent, %d unused in chunks", admitted.Load(), float64(spent.Load())/1e6, h["k"])
	if h["s"]+h["k"] > limit {
		t.Errorf("Redis counts %d spent and %d in chunks: over the %d budget", h["s"], h["k"], limit)
	}
}

// warmLeasedSpend reserves and settles small requests on led until this replica's chunk of
// b's window holds at least want unused.
func warmLeasedSpend(t *testing.T, led *spend.Ledger, l *Leaser, b spend.Budget, want int64) {
	t.Helper()
	waitFor(t, "a chunk of the window", func() bool {
		for range 20 {
			r, rf, ok := reserveIn(t, led, b, 10_000)
			if !ok {
				t.Fatalf("refused while warming up: %+v", rf)
			}
			r.Settle(10_000, time.Now())
		}
		for _, s := range l.SpendLeases() {
			if s.Unused >= want {
				return true
			}
		}
		return false
	})
}

// spendUnused is what the replica's chunks hold unused.
func spendUnused(l *Leaser) int64 {
	var n int64
	for _, s := range l.SpendLeases() {
		n += s.Unused
	}
	return n
}

// spendLocally reserves and settles n requests of cost each on led, which must all be admitted
// from the replica's chunk.
func spendLocally(t *testing.T, led *spend.Ledger, b spend.Budget, n int, cost spend.Micros) {
	t.Helper()
	for i := range n {
		r, rf, ok := reserveIn(t, led, b, cost)
		if !ok {
			t.Fatalf("request %d refused without Redis: %+v", i, rf)
		}
		r.Settle(cost, time.Now())
	}
	if fb := led.FellBack(); fb != 0 {
		t.Fatalf("%d reservations decided outside the chunk: the test must spend from it", fb)
	}
}

// TestLeasedSpendOutageAddedBackOnce: a replica spends from its chunk of a spend window while
// Redis is stopped (SIGSTOP: its reports go unanswered, and may run once Redis continues), or
// killed and restarted empty. Once Redis answers again, what the replica spent meanwhile is in the
// fleet's window, exactly once.
func TestLeasedSpendOutageAddedBackOnce(t *testing.T) {
	budget := spend.Budget{Name: "feature/chat", Period: spend.Day, Limit: 100_000_000}
	if now := time.Now().UTC(); now.Add(time.Minute).Day() != now.Day() {
		t.Skip("too close to midnight UTC: the daily window would reset during the test")
	}
	for _, tc := range []struct {
		name string
		// restart: Redis is killed and restarted empty; else stopped and continued.
		restart bool
	}{{"stopped", false}, {"restarted empty", true}} {
		t.Run(tc.name, func(t *testing.T) {
			rd := redistest.Standalone(t)
			prefix := "outage-" + strconv.FormatBool(tc.restart)
			led, l, st, drive := leasedReplica(t, rd.Addr(), prefix, "a", 100*time.Millisecond)
			// Between two rounds: what Redis counts, and what this replica spent that it does
			// not count yet, as Redis stops.
			var before int64
			for {
				warmLeasedSpend(t, led, l, budget, 200_000)
				drive.Lock()
				if spendUnused(l) >= 100_000 {
					break
				}
				drive.Unlock()
			}
			before = spendHash(t, rd.Addr(), prefix, led, budget)["s"] + l.SpendLeasedPending()
			if tc.restart {
				rd.Kill()
				before = l.SpendLeasedPending()
			} else {
				rd.Pause(0)
			}
			drive.Unlock()
			// Reports time out (or fail) meanwhile; the replica spends from its chunk.
			spendLocally(t, led, budget, 5, 10_000)
			waitFor(t, "the replica to notice Redis is gone", func() bool { return !st.Available() })
			spendLocally(t, led, budget, 5, 10_000)
			if tc.restart {
				rd.Restart()
			} else {
				rd.Resume()
			}
			const outage = 10 * 10_000
			waitFor(t, "the outage's spend in Redis", func() bool {
				return st.Available() && l.SpendLeasedPending() == 0 && spendHash(t, rd.Addr(), prefix, led, budget)["s"] == before+outage
			})
			// Later rounds (and any report Redis ran late) add nothing more.
			next := l.Next()
			l.Kick()
			<-next
			next = l.Next()
			l.Kick()
			<-next
			if s := spendHash(t, rd.Addr(), prefix, led, budget)["s"]; s != before+outage {
				t.Fatalf("Redis counts %d spent, want %d: the outage's %d counted %s", s, before+outage, outage,
					map[bool]string{true: "more than once", false: "partly"}[s > before+outage])
			}
		})
	}
}

// TestLeasedSpendReportSentTwiceCountsOnce: a round of spend reports whose answer is lost (Redis
// ran it) is sent again with its number: what it adds counts once.
func TestLeasedSpendReportSentTwiceCountsOnce(t *testing.T) {
	rd := redistest.Standalone(t)
	budget := spend.Budget{Name: "feature/chat", Period: spend.Day, Limit: 100_000_000}
	if now := time.Now().UTC(); now.Add(time.Minute).Day() != now.Day() {
		t.Skip("too close to midnight UTC: the daily window would reset during the test")
	}
	led, l, _, drive := leasedReplica(t, rd.Addr(), "twice", "a", time.Second)
	warmLeasedSpend(t, led, l, budget, 100_000)
	waitFor(t, "the warm-up's spend in Redis", func() bool { return l.SpendLeasedPending() == 0 })
	before := spendHash(t, rd.Addr(), "twice", led, budget)["s"]
	// Build and send a round by hand between two of the loop's.
	drive.Lock()
	spendLocally(t, led, budget, 1, 40_000)
	sp := l.spend
	sp.mu.Lock()
	for _, a := range sp.wins {
		a.urgent = true
	}
	sp.mu.Unlock()
	r := sp.build(l.o.Now(), false)
	if r == nil {
		t.Fatal("nothing to report")
	}
	if err := sp.script.Run(context.Background(), l.st.client, r.keys, r.args...).Err(); err != nil {
		t.Fatal(err)
	}
	// Its answer is lost: the report is sent again at the next round.
	sp.failed(r)
	drive.Unlock()
	next := l.Next()
	l.Kick()
	<-next
	waitFor(t, "the report sent again", func() bool {
		sp.mu.Lock()
		defer sp.mu.Unlock()
		return sp.resend == nil
	})
	if s := spendHash(t, rd.Addr(), "twice", led, budget)["s"]; s != before+40_000 {
		t.Fatalf("Redis counts %d spent, want %d: a report sent twice counted %d", s, before+40_000, s-before)
	}
}

// redisCalls returns the commands Redis has run, from INFO commandstats (the INFO calls
// themselves left out; commands a script runs count), and the scripts among them.
func redisCalls(b *testing.B, addr string) (cmds, scripts int64) {
	b.Helper()
	rc := redis.NewClient(&redis.Options{Addr: addr})
	defer rc.Close()
	info, err := rc.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
		if !ok || name == "cmdstat_info" {
			continue
		}
		calls, _, _ := strings.Cut(rest, ",")
		v, _ := strconv.ParseInt(calls, 10, 64)
		cmds += v
		if name == "cmdstat_evalsha" || name == "cmdstat_eval" {
			scripts += v
		}
	}
	return cmds, scripts
}

// BenchmarkSpendReserveSettle: a spend-budgeted request's reservation and settlement, 64 at
// once on one replica, with exact admission (every reservation a script in Redis, settlements
// batched) and leased admission (reserved from the replica's chunks, reported every
// lease_interval). It reports the Redis commands each request costs (redis-cmds/op), every
// command Redis ran meanwhile counted (heartbeats, settlement batches, lease rounds, and the
// commands their scripts run), and the scripts among them (redis-scripts/op: round trips).
func BenchmarkSpendReserveSettle(b *testing.B) {
	rd := redistest.Standalone(b)
	budget := spend.Budget{Name: "feature/chat", Period: spend.Month, Limit: 1_000_000_000_000}
	for _, mode := range []string{"exact", "leased"} {
		b.Run(mode, func(b *testing.B) {
			o := options(rd.Addr(), "bench-"+mode, "a")
			o.Timeout, o.LeaseTTL, o.Heartbeat = 200*time.Millisecond, 10*time.Second, 2500*time.Millisecond
			st, err := Open(o)
			if err != nil {
				b.Fatal(err)
			}
			ss := NewSpendStore(st)
			var l *Leaser
			if mode == "leased" {
				l = NewLeaser(st, LeaseOptions{Interval: 200 * time.Millisecond})
				ss.UseLeases(l)
			}
			defer func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				if l != nil {
					l.Close(ctx)
				}
				_ = st.Close(ctx)
			}()
			for !st.Available() {
				time.Sleep(5 * time.Millisecond)
			}
			led := spend.NewLedger(ss)
			_, _ = led.Configure(spend.Settings{Currency: "USD", Calendar: spend.NewCalendar(time.UTC)}, time.Now())
			one := func() {
				r := &spend.Reservation{}
				r.Reset(time.Now())
				r.Add(budget)
				if _, ok := led.Reserve(context.Background(), r, 20_000, time.Now()); !ok {
					b.Error("refused")
					return
				}
				r.Settle(15_000, time.Now())
			}
			// Warm up: the replica's chunk follows its pace.
			for range 2000 {
				one()
			}
			cmds, scripts := redisCalls(b, rd.Addr())
			b.SetParallelism(32)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					one()
				}
			})
			b.StopTimer()
			cmds2, scripts2 := redisCalls(b, rd.Addr())
			b.ReportMetric(float64(cmds2-cmds)/float64(b.N), "redis-cmds/op")
			b.ReportMetric(float64(scripts2-scripts)/float64(b.N), "redis-scripts/op")
		})
	}
}

// TestLeasedSpendTightWindowGivesChunksBack: replica a holds an unused chunk of a $10 window;
// replica b asks for all that is really left (the budget less what a spent). That does not fit
// beside a's chunk: the window turns tight, a gives its chunk back at once, and b is admitted,
// as exact admission would admit it.
func TestLeasedSpendTightWindowGivesChunksBack(t *testing.T) {
	rd := redistest.Standalone(t)
	budget := spend.Budget{Name: "feature/chat", Period: spend.Day, Limit: 10_000_000}
	if now := time.Now().UTC(); now.Add(time.Minute).Day() != now.Day() {
		t.Skip("too close to midnight UTC: the daily window would reset during the test")
	}
	a, la, _, _ := leasedReplica(t, rd.Addr(), "tight", "a", time.Second)
	b, lb, _, _ := leasedReplica(t, rd.Addr(), "tight", "b", time.Second)
	var spentA int64
	waitFor(t, "a chunk of at least $2 on a", func() bool {
		for range 10 {
			r, rf, ok := reserveIn(t, a, budget, 50_000)
			if !ok {
				t.Fatalf("refused while warming up: %+v", rf)
			}
			r.Settle(50_000, time.Now())
			spentA += 50_000
		}
		return spendUnused(la) >= 2_000_000
	})
	if spentA > 6_000_000 {
		t.Fatalf("a spent $%.2f warming up: too much for the test", float64(spentA)/1e6)
	}
	amount := budget.Limit - spend.Micros(spentA) - 10_000
	r, rf, ok := reserveIn(t, b, budget, amount)
	if !ok {
		t.Fatalf("b's $%.2f refused with $%.2f really left (a holds $%.2f unused): %+v",
			float64(amount)/1e6, float64(budget.Limit-spend.Micros(spentA))/1e6, float64(spendUnused(la))/1e6, rf)
	}
	r.Release(time.Now())
	for _, s := range lb.SpendLeases() {
		if !s.Tight {
			t.Errorf("b's part of %s is not tight", s.Window)
		}
	}
}

// TestLeasedSpendWholeBudget: a worst case larger than the whole budget is refused without a
// call to Redis (the window is not even made), unless a single overrun is allowed: then it runs
// in the untouched window, and nothing more does, on any replica.
func TestLeasedSpendWholeBudget(t *testing.T) {
	rd := redistest.Standalone(t)
	budget := spend.Budget{Name: "feature/chat", Period: spend.Day, Limit: 1_000_000}
	if now := time.Now().UTC(); now.Add(time.Minute).Day() != now.Day() {
		t.Skip("too close to midnight UTC: the daily window would reset during the test")
	}
	a, _, _, _ := leasedReplica(t, rd.Addr(), "whole", "a", time.Second)
	b, _, _, _ := leasedReplica(t, rd.Addr(), "whole", "b", time.Second)
	if _, rf, ok := reserveIn(t, a, budget, 5_000_000); ok || rf.Budget != budget {
		t.Fatalf("$5 against a $1 budget: admitted %v, refusal %+v", ok, rf)
	}
	if h := spendHash(t, rd.Addr(), "whole", a, budget); len(h) != 0 {
		t.Fatalf("the refusal made the window in Redis: %v", h)
	}
	for _, led := range []*spend.Ledger{a, b} {
		_, _ = led.Configure(spend.Settings{Currency: "USD", Calendar: spend.NewCalendar(time.UTC), AllowSingleOverrun: true}, time.Now())
	}
	// The round that grows a's chunk to the whole window may not end within cluster.timeout on
	// a loaded machine: the request is then refused (Redis unavailable for it), nothing held,
	// and asks again.
	var r *spend.Reservation
	waitFor(t, "a single overrun admitted in an untouched window", func() bool {
		res, rf, ok := reserveIn(t, a, budget, 5_000_000)
		if !ok && (rf.Spent != 0 || rf.Reserved != 0) {
			t.Fatalf("a single overrun allowed: $5 refused in an untouched window: %+v", rf)
		}
		r = res
		return ok
	})
	for _, led := range []*spend.Ledger{a, b} {
		if _, _, ok := reserveIn(t, led, budget, 1); ok {
			t.Fatal("admitted beside a single overrun")
		}
	}
	r.Settle(4_000_000, time.Now())
	waitFor(t, "the overrun's cost in Redis", func() bool {
		h := spendHash(t, rd.Addr(), "whole", a, budget)
		return h["s"] == 4_000_000 && h["r"] == 0
	})
}

// TestLeasedSpendSlowRoundIsUnavailableNotSpent: a request whose chunk is short asks for a round
// of reports; when Redis answers none within cluster.timeout (here: paused), that says nothing
// about the window's room. The request is not refused for the budget (whose retry-after would be
// the window's end, an hour away) but as Redis being unavailable, which the policy's
// on_unavailable decides; nothing is held.
func TestLeasedSpendSlowRoundIsUnavailableNotSpent(t *testing.T) {
	rd := redistest.Standalone(t)
	budget := spend.Budget{Name: "feature/chat", Period: spend.Hour, Limit: 10_000_000}
	if now := time.Now().UTC(); now.Add(time.Minute).Hour() != now.Hour() {
		t.Skip("too close to the hour: the window would reset during the test")
	}
	led, l, _, _ := leasedReplica(t, rd.Addr(), "slow", "a", 200*time.Millisecond)
	// A first request makes the window's lease and its rounds.
	reserveSoon(t, led, budget, 1_000, "a first request admitted").Settle(1_000, time.Now())
	waitFor(t, "a round answered", l.Answering)
	rd.Pause(2 * time.Second)
	defer rd.Resume()
	_, rf, ok := reserveIn(t, led, budget, 9_000_000)
	if ok || !rf.Unavailable || rf.Budget == budget {
		t.Fatalf("$9 of $10 while Redis answers no round: admitted %v, refusal %+v; want unavailable", ok, rf)
	}
	if u := spendUnused(l); u != 0 {
		t.Fatalf("%d held after the refusal", u)
	}
}

// TestLeasedSpendChunkKeptForTheRequestWaitingOnIt: a request short of a chunk asks for a round,
// which grants it the whole window. A round that starts before the request looks again (the
// next tick, on a loaded machine) keeps that chunk for it instead of giving it back at the
// window's pace, which no request has set yet: the request takes it while that round is out,
// where it used to find the chunk gone and the window's room, its own grant taken out, too
// small, and was refused for the budget.
func TestLeasedSpendChunkKeptForTheRequestWaitingOnIt(t *testing.T) {
	rd := redistest.Standalone(t)
	_, l, _, drive := leasedReplica(t, rd.Addr(), "keep", "a", time.Second)
	drive.Lock() // the rounds are this test's to run
	defer drive.Unlock()
	ws := []SpendWindow{{Key: "feature/chat|hour|1", Limit: 10_000_000, End: time.Now().Add(time.Hour)}}
	sp := l.spend
	if _, short := sp.take(ws, 10_000_000, time.Now(), false); short == 0 {
		t.Fatal("a chunk before any round")
	}
	sp.needFor(ws, 1, 10_000_000)
	l.Round() // answered: the window granted for the request
	// The next tick's round is built, and not answered yet, when the request looks again.
	if r := sp.build(l.o.Now(), false); r == nil {
		t.Fatal("the window waited on is not reported")
	}
	if over, short := sp.take(ws, 10_000_000, time.Now(), true); over != 0 || short != 0 {
		t.Fatalf("the request that asked for the chunk: over %b, short %b; want it taken", over, short)
	}
	sp.unneed(ws, 1, 10_000_000)
}

// TestLeasedTokensAddedBackOnce: tokens a replica counted in its own window while its lease could
// not be used are added to the fleet's window at its next report; a report whose answer was lost
// (Redis ran it) is sent again under its number, and the tokens count once.
func TestLeasedTokensAddedBackOnce(t *testing.T) {
	srv := redistest.Standalone(t)
	f := newFleet(t, srv.Addr(), "addback", 1, 5*time.Second)
	l := f.leasers[0]
	lim := LeaseLimits{Windows: []Window{{Name: "feature/chat", Kind: "tpm", Length: time.Minute, Capacity: 10_000, Debt: 10_000}}}
	ls := l.Lease("feature/chat", lim, nil)
	f.round()
	if left, _, ok := ls.Remaining(0); !ok || left != 10_000 {
		t.Fatalf("before: %d left (known %v), want the whole 10000", left, ok)
	}
	ls.AddBack(0, 700)
	ls.mu.Lock()
	r := ls.build(f.clock.Now(), false)
	ls.mu.Unlock()
	if err := l.script.Run(context.Background(), l.st.client, r.keys, r.args...).Err(); err != nil {
		t.Fatal(err)
	}
	// Its answer is lost: the next round sends it again.
	ls.mu.Lock()
	ls.failed(r)
	ls.mu.Unlock()
	f.round()
	if left, _, _ := ls.Remaining(0); left != 10_000-700 {
		t.Fatalf("after the report sent twice: %d left, want %d (the 700 counted once)", left, 10_000-700)
	}
}

// TestLeasedZoneChangeCarriesSpendNotReportedYet: spend a leased replica settled in its chunks
// reaches Redis at its next report. A change of time_zone right after it carries that spend
// into the new zone's window too, instead of leaving it to land in the old zone's window, where
// the new one would not count it.
func TestLeasedZoneChangeCarriesSpendNotReportedYet(t *testing.T) {
	_, ktmCal := zoneCalendars(t)
	rd := redistest.Standalone(t)
	a, _, _, _ := leasedReplica(t, rd.Addr(), "carry", "a", time.Second)
	day := spend.Budget{Name: "tenant/acme", Period: spend.Day, Limit: 10_000_000}
	admitted := 0
	for range 8 {
		reserveSoon(t, a, day, 1_000_000, "a $1 reservation").Settle(1_000_000, time.Now())
		admitted++
	}
	// At once, before a report: the zone changes.
	if _, err := a.Configure(spend.Settings{Currency: "USD", Calendar: ktmCal}, time.Now()); err != nil {
		t.Fatal(err)
	}
	// Once the reports since have landed, the Kathmandu window counts the $8, no more, no less.
	var u spend.Usage
	var ok bool
	waitFor(t, "the $8 to reach the Kathmandu window", func() bool {
		u, ok = a.Store().Get(a.Window(day, time.Now()).ID, time.Now())
		return ok && u.Spent+u.Reserved >= 8_000_000
	})
	if u.Spent+u.Reserved != 8_000_000 {
		t.Errorf("the Kathmandu window counts %+v, want the $8 spent", u)
	}
}
