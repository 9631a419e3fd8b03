package cluster

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
	"github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

var usageReasons = []string{"token_budget", "rate_limit", "spend_budget"}

// usageClock is the clock the trackers of a test count by: an instant fixed near Redis's own
// (fleet tables expire by Redis's clock).
type usageClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *usageClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *usageClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// usageReplica opens a store and a tracker of table size size sharing through it; the flush
// loop runs rarely: the tests flush by hand.
func usageReplica(t testing.TB, o Options, clock *usageClock, size int) (*UsageStore, *usage.Tracker) {
	t.Helper()
	st := open(t, o)
	tr := usage.New(usageReasons)
	tr.Configure(usage.Settings{Enabled: true, TableSize: size}, clock.Now())
	u := NewUsageStore(st, tr, UsageOptions{Now: clock.Now, Interval: time.Hour})
	t.Cleanup(func() { u.Close(context.Background()) })
	return u, tr
}

func served(tr *usage.Tracker, now time.Time, tenant, model string, prompt, completion int64) {
	tr.Record(now, &usage.Event{Tenant: tenant, Model: model, Refusal: -1, Prompt: prompt, Completion: completion})
}

func fleetReport(t *testing.T, u *UsageStore, by usage.By, w usage.Window) usage.Report {
	t.Helper()
	r, err := u.Report(context.Background(), usage.Query{By: by, Window: w, Top: 1000})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func rowOf(r usage.Report, k usage.Key) (usage.Row, bool) {
	for _, row := range r.Rows {
		if row.Key == k {
			return row, true
		}
	}
	return usage.Row{}, false
}

// sameReport reports whether two answers have the same rows and totals.
func sameReport(a, b usage.Report) bool {
	if a.Total != b.Total || len(a.Rows) != len(b.Rows) || a.MaxOvercount != b.MaxOvercount {
		return false
	}
	for i := range a.Rows {
		if a.Rows[i] != b.Rows[i] {
			return false
		}
	}
	return true
}

// TestFleetUsageSumsReplicasAndSurvivesRestarts: what two replicas served is one answer, asked
// of either, in every window and grouping; after both restart (each sending what it counted as
// it stops), with trackers that start empty, the answer is the same.
func TestFleetUsageSumsReplicasAndSurvivesRestarts(t *testing.T) {
	rd := redistest.Standalone(t)
	clock := &usageClock{now: time.Now()}
	now := clock.Now()
	a, ta := usageReplica(t, options(rd.Addr(), "usage", "a"), clock, 50)
	b, tb := usageReplica(t, options(rd.Addr(), "usage", "b"), clock, 50)
	served(ta, now, "acme", "gpt-4o", 100, 20)
	served(ta, now, "acme", "gpt-4o", 50, 5)
	served(tb, now, "acme", "gpt-4o", 10, 1)
	served(tb, now, "globex", "claude", 300, 30)
	ta.Record(now, &usage.Event{Tenant: "globex", Model: "claude", Refusal: 1})
	if err := a.Flush(); err != nil {
		t.Fatal(err)
	}
	// b's counts reach Redis when it stops: as a replica restarting does.
	b.Close(context.Background())

	want := map[usage.By]map[usage.Key][2]uint64{ // requests, tokens
		usage.ByTenant:      {{Tenant: "acme"}: {3, 186}, {Tenant: "globex"}: {1, 330}},
		usage.ByModel:       {{Model: "gpt-4o"}: {3, 186}, {Model: "claude"}: {1, 330}},
		usage.ByTenantModel: {{Tenant: "acme", Model: "gpt-4o"}: {3, 186}, {Tenant: "globex", Model: "claude"}: {1, 330}},
	}
	before := map[string]usage.Report{}
	for _, by := range usage.Groupings() {
		for _, w := range []usage.Window{usage.Hour, usage.Day, usage.Week, usage.Month} {
			r := fleetReport(t, a, by, w)
			if r.Total.Requests != 4 || r.Total.Prompt+r.Total.Completion != 516 || r.Total.Refusals[1] != 1 {
				t.Fatalf("%s %s: fleet totals %+v", by, w, r.Total)
			}
			for k, n := range want[by] {
				row, ok := rowOf(r, k)
				if !ok || row.Counts.Requests != n[0] || row.Counts.Prompt+row.Counts.Completion != n[1] || row.Overcount != 0 {
					t.Fatalf("%s %s: row %+v: %+v, want %d requests and %d tokens", by, w, k, row, n[0], n[1])
				}
			}
			before[by.String()+w.String()] = r
		}
	}

	// When both replicas restart, with empty trackers
	a.Close(context.Background())
	a2, _ := usageReplica(t, options(rd.Addr(), "usage", "a"), clock, 50)
	_, _ = usageReplica(t, options(rd.Addr(), "usage", "b"), clock, 50)
	// Then the fleet's answer is unchanged
	for _, by := range usage.Groupings() {
		for _, w := range []usage.Window{usage.Hour, usage.Day, usage.Week, usage.Month} {
			if r := fleetReport(t, a2, by, w); !sameReport(r, before[by.String()+w.String()]) {
				t.Fatalf("%s %s after the restarts: %+v, before: %+v", by, w, r, before[by.String()+w.String()])
			}
		}
	}
}

// TestFleetUsageTablesExpireWithTheirBuckets: each fleet table expires when no window can ask
// for its bucket any more, a 5-minute bucket 2 hours after it ends, an hour 2 days after, a day
// 35 days after (the month's first day is asked for until the month ends).
func TestFleetUsageTablesExpireWithTheirBuckets(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	clock := &usageClock{now: time.Now()}
	a, ta := usageReplica(t, options(rd.Addr(), "expire", "a"), clock, 10)
	served(ta, clock.Now(), "acme", "m", 1, 1)
	if err := a.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, w := range []usage.Window{usage.Hour, usage.Day, usage.Week} {
		_, buckets := ta.FleetWindow(clock.Now(), w)
		b := buckets[len(buckets)-1]
		key := a.tableKey(usage.ByTenant, b)
		at, err := rc.PExpireTime(context.Background(), key).Result()
		if err != nil {
			t.Fatal(err)
		}
		if want := b.End.Add(usage.Keep(b.Level)); at != time.Duration(want.UnixMilli())*time.Millisecond {
			t.Errorf("%s expires at %d ms, want %s", key, at.Milliseconds(), want)
		}
	}
}

// TestFleetUsageDeltaWhoseAnswerWasLostCountsOnce: a delta Redis applied but whose answer never
// came back is sent again with its number, and counted once.
func TestFleetUsageDeltaWhoseAnswerWasLostCountsOnce(t *testing.T) {
	rd := redistest.Standalone(t)
	clock := &usageClock{now: time.Now()}
	a, ta := usageReplica(t, options(rd.Addr(), "lost", "a"), clock, 10)
	served(ta, clock.Now(), "acme", "m", 100, 10)
	// Given a delta that Redis applied, its answer lost (it stays queued)
	a.mu.Lock()
	for _, d := range ta.TakeDelta(clock.Now(), false) {
		a.last++
		a.queue = append(a.queue, usageOp{id: a.last, d: d})
	}
	if err := a.send(a.queue); err != nil {
		t.Fatal(err)
	}
	a.mu.Unlock()
	// When the next flush sends it again, with what was counted since
	served(ta, clock.Now(), "acme", "m", 1, 0)
	if err := a.Flush(); err != nil {
		t.Fatal(err)
	}
	// Then it counts once
	r := fleetReport(t, a, usage.ByTenant, usage.Day)
	if r.Total.Requests != 2 || r.Total.Prompt != 101 {
		t.Fatalf("fleet totals %+v, want 2 requests and 101 prompt tokens", r.Total)
	}
}

// TestFleetUsageFlushDuringOutageCountsOnce: a flush while Redis hangs fails (the write timeout)
// and keeps its delta; once Redis answers again the next flush sends it, and what was counted
// meanwhile, each once — whether or not Redis ran the first call when it woke.
func TestFleetUsageFlushDuringOutageCountsOnce(t *testing.T) {
	rd := redistest.Standalone(t)
	clock := &usageClock{now: time.Now()}
	o := options(rd.Addr(), "outage", "a")
	o.WriteTimeout = 300 * time.Millisecond
	a, ta := usageReplica(t, o, clock, 10)
	served(ta, clock.Now(), "acme", "m", 100, 10)
	if err := a.Flush(); err != nil { // the scripts are loaded
		t.Fatal(err)
	}
	served(ta, clock.Now(), "acme", "m", 20, 2)
	rd.Pause(0)
	if err := a.Flush(); err == nil {
		t.Fatal("a flush to a Redis that does not answer succeeded")
	}
	if a.Pending() == 0 {
		t.Fatal("the failed flush dropped its delta")
	}
	served(ta, clock.Now(), "globex", "m", 3, 0)
	rd.Resume()
	waitFor(t, "the store to be available again", a.st.Available)
	if err := a.Flush(); err != nil {
		t.Fatal(err)
	}
	r := fleetReport(t, a, usage.ByTenant, usage.Hour)
	if r.Total.Requests != 3 || r.Total.Prompt != 123 {
		t.Fatalf("fleet totals %+v, want 3 requests and 123 prompt tokens", r.Total)
	}
	if row, _ := rowOf(r, usage.Key{Tenant: "acme"}); row.Counts.Requests != 2 {
		t.Fatalf("acme's row %+v, want 2 requests", row)
	}
	// The day's bucket takes the same, once, at the first flush a minute after its last.
	clock.add(usage.DayEvery)
	if err := a.Flush(); err != nil {
		t.Fatal(err)
	}
	if r := fleetReport(t, a, usage.ByTenant, usage.Week); r.Total.Requests != 3 || r.Total.Prompt != 123 {
		t.Fatalf("fleet totals over the week %+v, want 3 requests and 123 prompt tokens", r.Total)
	}
}

// TestFleetUsageCorruptContentIsRepaired: a fleet table overwritten with a string, a row
// holding garbage, or this process's mark of the wrong type, is deleted (counted, logged) by the
// next flush or read, which then goes on: the fleet's answer counts what was added since.
func TestFleetUsageCorruptContentIsRepaired(t *testing.T) {
	for _, c := range []string{"string", "row", "rows above total", "mark"} {
		t.Run(c, func(t *testing.T) {
			rd := redistest.Standalone(t)
			rc := inspect(t, rd.Addr())
			clock := &usageClock{now: time.Now()}
			var logs syncbuf.Buffer
			o := options(rd.Addr(), "corrupt", "a")
			o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
			a, ta := usageReplica(t, o, clock, 10)
			served(ta, clock.Now(), "acme", "m", 100, 10)
			if err := a.Flush(); err != nil {
				t.Fatal(err)
			}
			_, buckets := ta.FleetWindow(clock.Now(), usage.Hour)
			key := a.tableKey(usage.ByTenant, buckets[len(buckets)-1])
			ctx := context.Background()
			var err error
			switch c {
			case "string":
				err = rc.Set(ctx, key, "garbage", 0).Err()
			case "row":
				err = rc.HSet(ctx, key, "4:acme", "lots").Err()
			case "rows above total":
				err = rc.HSet(ctx, key, "7:initech", "0,1000000,0,0,0,0").Err()
			case "mark":
				err = rc.Del(ctx, a.markKey).Err()
				if err == nil {
					err = rc.HSet(ctx, a.markKey, "x", "y").Err()
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			lost := lostCorrupt(a.st)
			served(ta, clock.Now(), "acme", "m", 1, 0)
			if err := a.Flush(); err != nil {
				t.Fatalf("flush over corrupt content: %v", err)
			}
			r := fleetReport(t, a, usage.ByTenant, usage.Hour)
			wantReq, wantPrompt := uint64(1), uint64(1)
			if c == "mark" {
				wantReq, wantPrompt = 2, 101
			}
			if r.Total.Requests != wantReq || r.Total.Prompt != wantPrompt {
				t.Fatalf("fleet totals %+v, want %d requests and %d prompt tokens", r.Total, wantReq, wantPrompt)
			}
			if row, ok := rowOf(r, usage.Key{Tenant: "initech"}); ok {
				t.Fatalf("a row written by hand is counted: %+v", row)
			}
			if lostCorrupt(a.st) <= lost {
				t.Error("the repair was not counted")
			}
			if !strings.Contains(logs.String(), "content no replica writes") {
				t.Errorf("the repair was not logged:\n%s", logs.String())
			}
		})
	}
	t.Run("read", func(t *testing.T) {
		rd := redistest.Standalone(t)
		rc := inspect(t, rd.Addr())
		clock := &usageClock{now: time.Now()}
		a, ta := usageReplica(t, options(rd.Addr(), "corrupt-read", "a"), clock, 10)
		served(ta, clock.Now(), "acme", "m", 100, 10)
		if err := a.Flush(); err != nil {
			t.Fatal(err)
		}
		_, buckets := ta.FleetWindow(clock.Now(), usage.Day)
		key := a.tableKey(usage.ByModel, buckets[len(buckets)-1])
		if err := rc.HSet(context.Background(), key, "N", "-5").Err(); err != nil {
			t.Fatal(err)
		}
		lost := lostCorrupt(a.st)
		r := fleetReport(t, a, usage.ByModel, usage.Day)
		if r.Total.Requests != 0 || len(r.Rows) != 0 {
			t.Fatalf("a corrupt table is answered: %+v", r)
		}
		if n, _ := rc.Exists(context.Background(), key).Result(); n != 0 || lostCorrupt(a.st) <= lost {
			t.Fatalf("the corrupt table was not deleted and counted (exists %d)", n)
		}
	})
}

// TestFleetUsageTablesStayBounded: two replicas serving 400 tenants × 10 models between them,
// five heavy pairs among them, flushed round after round: every fleet table keeps at most the
// table size of rows, the totals are exact, the heavy groups' rows exact, and every estimate
// within the answer's bound of the truth.
func TestFleetUsageTablesStayBounded(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	clock := &usageClock{now: time.Now()}
	const size = 20
	a, ta := usageReplica(t, options(rd.Addr(), "bounded", "a"), clock, size)
	b, tb := usageReplica(t, options(rd.Addr(), "bounded", "b"), clock, size)
	truth := map[usage.Key]uint64{} // by tenant and model: weight
	var total uint64
	for round := range 10 {
		for i := range 400 {
			tr := ta
			if i%2 == 1 {
				tr = tb
			}
			k := usage.Key{Tenant: fmt.Sprintf("t%03d", (i+round*7)%400), Model: fmt.Sprintf("m%d", i%10)}
			served(tr, clock.Now(), k.Tenant, k.Model, 3, 1)
			truth[k] += 5
			total += 5
		}
		for h := range 5 {
			k := usage.Key{Tenant: fmt.Sprintf("heavy%d", h), Model: "big"}
			served([]*usage.Tracker{ta, tb}[h%2], clock.Now(), k.Tenant, k.Model, 5000, 1000)
			truth[k] += 6001
			total += 6001
		}
		if err := a.Flush(); err != nil {
			t.Fatal(err)
		}
		if err := b.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	keys, err := rc.Keys(context.Background(), "{bounded}:u:*").Result()
	if err != nil || len(keys) == 0 {
		t.Fatalf("keys %v, %v", keys, err)
	}
	for _, k := range keys {
		if n := rc.HLen(context.Background(), k).Val(); n > size+2 {
			t.Errorf("%s holds %d fields, table size %d", k, n, size)
		}
	}
	r := fleetReport(t, a, usage.ByTenantModel, usage.Hour)
	if r.Total.Weight() != total {
		t.Fatalf("total weight %d, want %d", r.Total.Weight(), total)
	}
	for h := range 5 {
		k := usage.Key{Tenant: fmt.Sprintf("heavy%d", h), Model: "big"}
		row, ok := rowOf(r, k)
		if !ok || row.Counts.Weight() != truth[k] {
			t.Fatalf("heavy row %+v: %+v, want weight %d exactly", k, row, truth[k])
		}
	}
	for _, row := range r.Rows {
		if row.Weight < truth[row.Key] || row.Weight-truth[row.Key] > r.MaxOvercount || row.Weight-row.Overcount != row.Counts.Weight() {
			t.Fatalf("row %+v: true weight %d, bound %d", row, truth[row.Key], r.MaxOvercount)
		}
	}
	if r.MaxOvercount > 2*total/size {
		t.Errorf("overcount bound %d above 2N/size = %d", r.MaxOvercount, 2*total/size)
	}
}

// A flush is one call to Redis, whatever the tables and buckets it adds to: a fleet's replicas
// each flush every few seconds, and every call wakes Redis.
func TestAUsageFlushIsOneCall(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	clock := &usageClock{now: time.Now()}
	a, ta := usageReplica(t, options(rd.Addr(), "onecall", "a"), clock, 10)
	served(ta, clock.Now(), "acme", "gpt-4o", 100, 10)
	served(ta, clock.Now(), "globex", "claude", 50, 5)
	if err := rc.ConfigResetStat(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	if err := a.Flush(); err != nil {
		t.Fatal(err)
	}
	if calls, _ := scriptStats(t, rc); calls != 1 {
		t.Fatalf("a flush of three tables made %d script calls, want 1", calls)
	}
	for _, by := range []usage.By{usage.ByTenant, usage.ByModel, usage.ByTenantModel} {
		if r := fleetReport(t, a, by, usage.Hour); r.Total.Requests != 2 || r.Total.Prompt != 150 || len(r.Rows) != 2 {
			t.Errorf("fleet table by %v after one flush: %+v, want 2 requests, 150 prompt tokens in 2 rows", by, r)
		}
	}
}
