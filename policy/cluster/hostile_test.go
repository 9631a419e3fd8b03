package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
)

// What Redis holds is never taken on trust: content no replica writes (a count set by hand, a
// flood of members, a key of the wrong type, a window's sum gone negative) neither blocks the
// fleet for good nor mints capacity, and every replica says what it found.

// admissionModes are the cluster admission modes the store's tests run in: today every
// admission runs one script in Redis ("exact").
var admissionModes = []string{"exact"}

// forModes runs f once per admission mode.
func forModes(t *testing.T, f func(t *testing.T, mode string)) {
	for _, mode := range admissionModes {
		t.Run(mode, func(t *testing.T) { f(t, mode) })
	}
}

// TestHostileCountIsRewrittenByItsReplica: a replica's count in a compartment set by hand to a
// million (or to something that is not a count at all) blocks the compartment only until that
// replica's next heartbeat, which finds Redis counting what it does not hold and rewrites its
// slots: the other replica then admits, and the replica's own slot still counts.
func TestHostileCountIsRewrittenByItsReplica(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		for _, bad := range []string{"1000000", "many", "-3"} {
			t.Run(bad, func(t *testing.T) {
				rd := redistest.Standalone(t)
				rc := inspect(t, rd.Addr())
				prefix := "hostile-" + mode
				a := open(t, options(rd.Addr(), prefix, "a"))
				b := open(t, options(rd.Addr(), prefix, "b"))
				sl := Slot{Name: "c", Max: 3}
				// Given b holds one of c's 3 slots
				wantStatus(t, admit(t, b, &Admission{Slots: []Slot{sl}}), Admitted, 0)
				// When b's count is set by hand
				if err := rc.HSet(context.Background(), b.slotKey("c"), "n:b", bad).Err(); err != nil {
					t.Fatal(err)
				}
				// Then b's heartbeat rewrites it, and a gets the two other slots, not a third
				waitFor(t, "b to rewrite its count", func() bool { return held(t, rc, b, "c")["n:b"] == "1" })
				waitFor(t, "b to be available", b.Available)
				wantStatus(t, admit(t, a, &Admission{Slots: []Slot{sl}}), Admitted, 0)
				wantStatus(t, admit(t, a, &Admission{Slots: []Slot{sl}}), Admitted, 0)
				wantStatus(t, admit(t, a, &Admission{Slots: []Slot{sl}}), RefusedSlot, 0)
			})
		}
	})
}

// TestHostileCountWhereTheReplicaHoldsNothing: a count set by hand for a live replica in a
// compartment where it holds nothing is noticed by the heartbeat of a replica with requests
// waiting there, which has that replica check it: the count goes, and the compartment admits.
func TestHostileCountWhereTheReplicaHoldsNothing(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		rd := redistest.Standalone(t)
		rc := inspect(t, rd.Addr())
		prefix := "orphan-" + mode
		oa := options(rd.Addr(), prefix, "a")
		oa.Watched = func() []string { return []string{"d"} } // requests wait on d here
		a := open(t, oa)
		b := open(t, options(rd.Addr(), prefix, "b"))
		if err := rc.HSet(context.Background(), b.slotKey("d"), "n:b", 1000000).Err(); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the count nobody holds to go", func() bool { return len(held(t, rc, b, "d")) == 0 })
		wantStatus(t, admit(t, a, &Admission{Slots: []Slot{{Name: "d", Max: 1}}}), Admitted, 0)
	})
}

// TestMembershipFloodIsBounded: 200 000 members that no replica registered (some for an hour,
// some for ever) neither slow the admission (its script never reads the membership), nor shrink
// the share every replica would enforce alone, nor stay registered further ahead than any lease
// lasts; the replica says what it found.
func TestMembershipFloodIsBounded(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		rd := redistest.Standalone(t)
		rc := inspect(t, rd.Addr())
		prefix := "flood-" + mode
		// Heartbeats are run by hand below.
		oa, ob := options(rd.Addr(), prefix, "a"), options(rd.Addr(), prefix, "b")
		oa.Heartbeat, ob.Heartbeat = time.Hour, time.Hour
		var logs syncbuf.Buffer
		oa.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		a := open(t, oa)
		open(t, ob)
		ctx := context.Background()
		if _, err := a.beat(); err != nil || a.Live() != 2 {
			t.Fatalf("a sees %d live replicas (%v), want 2", a.Live(), err)
		}
		now, err := rc.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		for batch := range 20 {
			zs := make([]redis.Z, 0, 10000)
			for i := range 10000 {
				score := float64(now.Add(59 * time.Minute).UnixMilli())
				if batch%4 == 0 {
					score = 1e15 // registered until the year 33658
				}
				zs = append(zs, redis.Z{Score: score, Member: fmt.Sprintf("fake-%d-%d", batch, i)})
			}
			if err := rc.ZAdd(ctx, a.keys.replicas, zs...).Err(); err != nil {
				t.Fatal(err)
			}
		}
		// The admission script looks up only the replicas holding slots where it admits.
		counted := func() int64 {
			info, err := rc.Info(ctx, "commandstats").Result()
			if err != nil {
				t.Fatal(err)
			}
			var n int64
			for _, line := range strings.Split(info, "\n") {
				for _, cmd := range []string{"zrangebyscore", "zrange", "zcount", "zcard"} {
					if rest, ok := strings.CutPrefix(line, "cmdstat_"+cmd+":calls="); ok {
						v, _ := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
						n += v
					}
				}
			}
			return n
		}
		before := counted()
		for range 10 {
			id := a.NextLease()
			wantStatus(t, admit(t, a, &Admission{Lease: id, Slots: []Slot{{Name: "c", Max: 100}}}), Admitted, 0)
			a.Settle(id, 0, nil)
		}
		waitFor(t, "the releases to be sent", func() bool { return pending(a) == 0 })
		if after := counted(); after != before {
			t.Errorf("10 admissions and their releases read the membership %d times", after-before)
		}
		// a's heartbeat removes the members registered for ever, and takes the 150 000 others
		// for corrupt content: a's share stays that of two replicas.
		if _, err := a.beat(); err != nil {
			t.Fatal(err)
		}
		if n, _ := rc.ZCard(ctx, a.keys.replicas).Result(); n != 150002 {
			t.Errorf("%d members after the heartbeat, want the 150 000 registered for an hour and a and b", n)
		}
		if a.Live() != 2 {
			t.Errorf("a counts %d live replicas, want 2", a.Live())
		}
		if e := a.LastError(); e == nil || !strings.Contains(e.Message, "more than 1000 live members") {
			t.Errorf("last error %+v, want the membership's", e)
		}
		// It is logged, once however many heartbeats find it.
		if _, err := a.beat(); err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(logs.String(), "more than 1000 live members"); n != 1 {
			t.Errorf("the flood is logged %d times over two heartbeats, want once:\n%s", n, logs.String())
		}
		// And the membership in the admin view is bounded too.
		if in := a.Info(ctx); len(in.Replicas) != MaxReplicas || in.ReplicasRegistered != 150002 {
			t.Errorf("admin view lists %d of %d members, want %d of 150002", len(in.Replicas), in.ReplicasRegistered, MaxReplicas)
		}
	})
}

// TestWrongTypeIsRepairedAndReported: a string written over a compartment's hash makes the
// admission fail with WRONGTYPE; the replica reports it as what it is (not a timeout), deletes
// the key (every replica then rewrites its slots) and admits again, without flapping.
func TestWrongTypeIsRepairedAndReported(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		rd := redistest.Standalone(t)
		rc := inspect(t, rd.Addr())
		prefix := "wrongtype-" + mode
		var logs syncbuf.Buffer
		oa := options(rd.Addr(), prefix, "a")
		oa.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		a := open(t, oa)
		b := open(t, options(rd.Addr(), prefix, "b"))
		sl := Slot{Name: "x", Max: 2}
		// Given b holds one of x's 2 slots
		wantStatus(t, admit(t, b, &Admission{Slots: []Slot{sl}}), Admitted, 0)
		// When a string is written over x's hash
		if err := rc.Set(context.Background(), a.slotKey("x"), "garbage", 0).Err(); err != nil {
			t.Fatal(err)
		}
		var r Result
		err := a.Admit(context.Background(), &Admission{Lease: a.NextLease(), Slots: []Slot{sl}}, &r)
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "WRONGTYPE") {
			t.Fatalf("admission over a string: %v, want ErrUnavailable with WRONGTYPE", err)
		}
		// Then the key is repaired, b's slot is counted again, and a admits the other slot only
		waitFor(t, "a to be available", a.Available)
		waitFor(t, "b to rewrite its slot", func() bool { return held(t, rc, b, "x")["n:b"] == "1" })
		resyncs := testutilCount(a)
		wantStatus(t, admit(t, a, &Admission{Slots: []Slot{sl}}), Admitted, 0)
		wantStatus(t, admit(t, a, &Admission{Slots: []Slot{sl}}), RefusedSlot, 0)
		for range 20 {
			wantStatus(t, admit(t, a, &Admission{Slots: []Slot{{Name: "y", Max: 100}}}), Admitted, 0)
		}
		if n := testutilCount(a) - resyncs; n != 0 {
			t.Errorf("a rewrote its slots %d more times after the repair", n)
		}
		out := logs.String()
		if !strings.Contains(out, "WRONGTYPE") || !strings.Contains(out, "corrupt content") || strings.Contains(out, "in time") {
			t.Errorf("a's log does not say what happened:\n%s", out)
		}
		if e := a.LastError(); e == nil || !strings.Contains(e.Message, "WRONGTYPE") || e.Op != "admit" {
			t.Errorf("last error %+v, want the admission's WRONGTYPE", e)
		}
	})
}

// testutilCount returns how many times s rewrote its slots.
func testutilCount(s *Store) int {
	var m dto.Metric
	if err := s.met.resyncs.Write(&m); err != nil {
		panic(err)
	}
	return int(m.GetCounter().GetValue())
}

// TestCorruptWindowMintsNothing: a window's running sum set negative (or to something that is
// not a count) is not believed: the window is read whole, and admits what its slots leave room
// for, no more. A clock set far ahead does not freeze the window.
func TestCorruptWindowMintsNothing(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		for _, c := range []struct{ field, value string }{{"-1", "-100000"}, {"-1", "lots"}, {"L", "99999999999"}} {
			t.Run(c.field+"="+c.value, func(t *testing.T) {
				rd := redistest.Standalone(t)
				rc := inspect(t, rd.Addr())
				a := open(t, options(rd.Addr(), "window-"+mode, "a"))
				w := tokens // 1000 a minute
				wantStatus(t, admit(t, a, &Admission{Windows: []Window{withAmount(w, 900)}}), Admitted, 0)
				if err := rc.HSet(context.Background(), a.windowKey(&w), c.field, c.value).Err(); err != nil {
					t.Fatal(err)
				}
				wantStatus(t, admit(t, a, &Admission{Windows: []Window{withAmount(w, 200)}}), RefusedWindow, 0)
				if got := used(t, rc, a, w); got != 900 {
					t.Errorf("used %d, want 900", got)
				}
				wantStatus(t, admit(t, a, &Admission{Windows: []Window{withAmount(w, 100)}}), Admitted, 0)
				wantStatus(t, admit(t, a, &Admission{Windows: []Window{withAmount(w, 1)}}), RefusedWindow, 0)
				// The window's clock is Redis's again: what it charged ages out within the minute.
				ctx := context.Background()
				now, err := rc.Time(ctx).Result()
				if err != nil {
					t.Fatal(err)
				}
				clock, err := rc.HGet(ctx, a.windowKey(&w), "L").Int64()
				if slot := now.UnixMilli() / slotMillis(w.Length); err != nil || clock > slot {
					t.Errorf("the window's clock stands at slot %d (%v), Redis's at %d", clock, err, slot)
				}
			})
		}
	})
}

// FuzzPublication: whatever a publication holds (anyone who can publish on the channel can
// write it), apply hands on only compartments of this deployment with counts that can be, and
// never panics.
func FuzzPublication(f *testing.F) {
	for _, seed := range []string{
		"12\n{p}:c:feature/chat\t3\t30\n{p}:c:tenant/a\t0\t0",
		"e\t1712345678123456\t2",
		"e\t\t1",
		"e\t1\t-5",
		"x\n{p}:c:a\t1\t1",
		"7\n{p}:c:a\t-1\t5\n{q}:c:b\t1\t1\n{p}:c:c\t1",
		"",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, payload string) {
		s := &Store{tag: "{p}", beatNow: make(chan struct{}, 1), o: Options{OnCounts: func(name string, seq, slots, tokens int64) {
			if slots < 0 || tokens < 0 {
				t.Fatalf("%q: counts %d, %d handed on", payload, slots, tokens)
			}
			if strings.ContainsAny(name, "\n\t") {
				t.Fatalf("%q: compartment %q handed on", payload, name)
			}
		}}}
		s.met = newMetrics()
		s.apply(payload)
	})
}

// FuzzCorruptWindow: whatever a window's hash holds, the sum the scripts read is never negative
// and never less than the slots in the window that hold a count (content no script writes is
// not believed: it can hold a window back, never give it room).
func FuzzCorruptWindow(f *testing.F) {
	rd := redistest.Standalone(f)
	rc := redis.NewClient(&redis.Options{Addr: rd.Addr(), MaxRetries: -1})
	f.Cleanup(func() { _ = rc.Close() })
	f.Add([]byte("L\x00-1\x01-2\x02"), []byte{5, 200, 7})
	f.Add([]byte("-1lots"), []byte{1, 2, 3, 4})
	f.Add([]byte("L99999999999"), []byte{9})
	var n int
	f.Fuzz(func(t *testing.T, fields, values []byte) {
		const slotlen, capacity = 1000, 1_000_000
		at := diffBase / slotlen
		n++
		key := fmt.Sprintf("{fuzz}:w:%d", n)
		ctx := context.Background()
		defer rc.Del(ctx, key)
		// Fields: the window's own ("L", sum "-1", newest "-2") and slots around the current
		// one; values: counts, garbage, negatives.
		names := []string{"L", "-1", "-2"}
		for d := -65; d <= 5; d++ {
			names = append(names, strconv.FormatInt(at+int64(d), 10))
		}
		set := map[string]string{}
		for i, b := range fields {
			name := names[int(b)%len(names)]
			var v string
			if i < len(values) {
				switch x := int64(values[i]); x % 6 {
				case 0:
					v = "garbage"
				case 1:
					v = strconv.FormatInt(-x, 10)
				case 2:
					v = strconv.FormatInt(at+x, 10) // a clock, or a slot number
				case 3:
					v = strconv.FormatInt(at+100*x, 10) // a clock far ahead
				default:
					v = strconv.FormatInt(x, 10)
				}
			} else {
				v = "1"
			}
			set[name] = v
		}
		for name, v := range set {
			if err := rc.HSet(ctx, key, name, v).Err(); err != nil {
				t.Fatal(err)
			}
		}
		// The window stands at Redis's slot, or at its clock when that is ahead by 1024 slots at
		// most (time never runs backwards for a window): it holds the slots before that.
		base := at
		if l, err := strconv.ParseInt(set["L"], 10, 64); err == nil && l > at && l <= at+1024 {
			base = l
		}
		var valid int64
		for name, v := range set {
			if s, err := strconv.ParseInt(name, 10, 64); err == nil && s > base-60 && s <= base {
				if c, err := strconv.ParseInt(v, 10, 64); err == nil && c > 0 {
					valid += c
				}
			}
		}
		res, err := windowState.Run(ctx, rc, []string{key}, capacity, slotlen, at*slotlen).Int64Slice()
		if err != nil {
			t.Fatalf("fields %v: %v", set, err)
		}
		sum := capacity - res[0]
		count := func(name string) (int64, bool) {
			v, ok := set[name]
			if !ok {
				return 0, false
			}
			c, err := strconv.ParseInt(v, 10, 64)
			return c, err == nil && c >= 0
		}
		l, lok := count("L")
		cur, curOK := count(strconv.FormatInt(max(at, l), 10))
		if _, has := set[strconv.FormatInt(max(at, l), 10)]; !has {
			cur, curOK = 0, true
		}
		sumv, sumOK := count("-1")
		_, newestOK := count("-2")
		if _, has := set["-2"]; !has {
			newestOK = true
		}
		_, hasL := set["L"]
		_, hasSum := set["-1"]
		_, hasNewest := set["-2"]
		_, hasCur := set[strconv.FormatInt(at, 10)]
		if !hasL && !hasSum && !hasNewest && !hasCur {
			// Slots without any of the fields every write sets were never charged by a script:
			// the window is new.
			valid = 0
		} else if lok && l <= at+60 && sumOK && newestOK && curOK && sumv >= cur {
			// Plausible fields are believed (the scripts read only those): the window counts at
			// least its current slot.
			valid = cur
			if l > at {
				// A clock ahead within a window stands: the slots counted are those before it.
				valid = 0
			}
		}
		if sum < 0 || sum < valid {
			t.Fatalf("fields %v: the window counts %d, its slots hold %d", set, sum, valid)
		}
	})
}

// FuzzCorruptLeaseEntry: whatever another replica's entry in a compartment's lease hash holds, a
// report still answers, grants no more than what the entries that can be leave of the limit,
// and drops the entry unless it is one a replica could have written: "r:<id>" →
// "<slots>|<tokens>|<slots wanted>|<tokens wanted>|<expiry ms>|<incarnation>:<count>|…", counts
// of at most 1e15, an expiry neither past nor beyond the longest lease ttl, 512 bytes at most. A
// window's chunk is never more than the window's room.
func FuzzCorruptLeaseEntry(f *testing.F) {
	rd := redistest.Standalone(f)
	rc := redis.NewClient(&redis.Options{Addr: rd.Addr(), MaxRetries: -1})
	f.Cleanup(func() { _ = rc.Close() })
	sc := redis.NewScript(luaLease)
	for _, seed := range [][2]string{
		{"r:x", "4|0|4|0|+60000|1:1|tpm=300"},
		{"r:x", "4|0|4|0|+60000|1:1|tpm=300,rpm=2"},
		{"r:x", "9|0|9|0|+60000|1:1|tpm=9999999999999999"},
		{"r:x", "2000000000000000|0|1|0|+60000|1:1|"},
		{"r:x", "4|0|4|0|-5|1:1|"},
		{"r:x", "4|0|4|0|+60000|1:1"},
		{"r:x", "4|0|4|0|+60000|1:1|tpm5=|=7|tpm"},
		{"r:", "4|0|4|0|+60000|1:1|"},
		{"x", "4|0|4|0|+60000|1:1|"},
		{"r:me", "900|0|900|0|+60000|1:1|tpm=1"},
		{"born", "-1"},
	} {
		f.Add(seed[0], seed[1])
	}
	const limit, room = 10, 1000
	var n int
	f.Fuzz(func(t *testing.T, field, value string) {
		ctx := context.Background()
		n++
		keys := []string{fmt.Sprintf("{fuzzl|c%d}:ls", n), fmt.Sprintf("{fuzzl|c%d}:w:tpm:60000", n)}
		defer rc.Del(ctx, keys...)
		now, err := rc.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		ms := now.UnixMilli()
		// "+d" and "-d" in the value stand for an expiry d ms from now.
		value = relativeExpiry.ReplaceAllStringFunc(value, func(m string) string {
			d, _ := strconv.ParseInt(m[1:], 10, 64)
			if m[0] == '-' {
				d = -d
			}
			return strconv.FormatInt(ms+d, 10)
		})
		ok := fmt.Sprintf("3|0|3|0|%d|1:1|tpm=100", ms+60000)
		if err := rc.HSet(ctx, keys[0], "born", ms-3600000, "r:ok", ok, field, value).Err(); err != nil {
			t.Fatal(err)
		}
		res, err := sc.Run(ctx, rc, keys, "me", 10000, "0", 2000, "1:1", limit, 0, 0, limit,
			0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, "", "c", "0:0", "",
			"tpm", room, 0, 1000, 500, 0, 0, 0, 0).Slice()
		if err != nil {
			t.Fatalf("%q → %q: %v", field, value, err)
		}
		// What the others hold, by what a replica can have written.
		others := int64(3)
		if field == "r:ok" {
			others = 0
		}
		valid, slots, ambiguous := leaseEntry(field, value, ms)
		if valid && field != "r:me" {
			others += min(slots, limit)
		}
		if field == "born" {
			others = 3
		}
		if g := res[1].(int64); !ambiguous && g > max(limit-others, 0) {
			t.Fatalf("%q → %q: granted %d slots, the others hold %d of %d", field, value, g, others, limit)
		}
		if g := res[13].(int64); g < 0 || g > room {
			t.Fatalf("%q → %q: a chunk of %d of a window with room for %d", field, value, g, room)
		}
		if _, err := rc.HGet(ctx, keys[0], field).Result(); err == nil && strings.HasPrefix(field, "r:") &&
			field != "r:me" && field != "r:ok" && !valid && !ambiguous {
			t.Fatalf("%q → %q: an entry no replica writes is kept", field, value)
		}
	})
}

// TestLeaseEntryLongerThanAnyReplicaWritesIsDropped: an entry shaped as a replica's but longer
// than any replica writes (what it wants of windows padded to 100 000 bytes) is dropped by the
// next report, as an entry that cannot be: matching such entries, a thousand of them, would
// hold Redis for seconds.
func TestLeaseEntryLongerThanAnyReplicaWritesIsDropped(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	ctx := context.Background()
	keys := []string{"{long|c}:ls", "{long|c}:w:tpm:60000"}
	now, err := rc.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	long := fmt.Sprintf("4|0|4|0|%d|1:1|", now.Add(time.Minute).UnixMilli()) + strings.Repeat("1", 100_000) + "!"
	rc.HSet(ctx, keys[0], "born", now.Add(-time.Hour).UnixMilli(), "r:long", long)
	res, err := redis.NewScript(luaLease).Run(ctx, rc, keys, "me", 10000, "0", 2000, "1:1", 10, 0, 0, 10,
		0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, "", "c", "0:0", "", "tpm", 1000, 0, 1000, 500, 0, 0, 0, 0).Slice()
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := rc.HExists(ctx, keys[0], "r:long").Result(); n {
		t.Fatal("the 100 000-byte entry is kept")
	}
	if res[1] != int64(10) {
		t.Fatalf("granted %d of 10 slots, the long entry's 4 counted as held", res[1])
	}
}

// relativeExpiry matches the expiries of FuzzCorruptLeaseEntry's seeds, given from now.
var relativeExpiry = regexp.MustCompile(`[+-][0-9]{1,9}\b`)

// leaseEntry reads another replica's entry as the lease script must: valid, the slots leased to
// it, and ambiguous when its expiry is so near a bound that the script's clock decides.
func leaseEntry(field, value string, now int64) (valid bool, slots int64, ambiguous bool) {
	m := leaseEntryForm.FindStringSubmatch(value)
	if !strings.HasPrefix(field, "r:") || len(field) < 3 || len(value) > 512 || m == nil {
		return false, 0, false
	}
	var n [5]int64
	for i := range n {
		v, err := strconv.ParseFloat(m[i+1], 64)
		if err != nil || v > 1e15 {
			return false, 0, false
		}
		n[i] = int64(v)
	}
	lo, hi := now, now+maxLeaseTTL.Milliseconds()+1000
	x := n[4]
	if x > lo-5000 && x < lo+5000 || x > hi-5000 && x < hi+5000 {
		return false, 0, true
	}
	return x >= lo && x <= hi, n[0], false
}

// leaseEntryForm is a replica's entry as the lease script reads it.
var leaseEntryForm = regexp.MustCompile(`^([0-9]+)\|([0-9]+)\|([0-9]+)\|([0-9]+)\|([0-9]+)\|[0-9]+:[0-9]+\|`)

// TestLeaseHashOverwrittenIsRepairedAndReported: a string written over a compartment's lease
// hash is deleted by the next report, which rewrites this replica's lease in the same call; the
// repair is counted, logged and shown as the last error, not passed over in silence.
func TestLeaseHashOverwrittenIsRepairedAndReported(t *testing.T) {
	rd := redistest.Standalone(t)
	rc := inspect(t, rd.Addr())
	var logs syncbuf.Buffer
	o := options(rd.Addr(), "lhash", "a")
	o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	s := open(t, o)
	l := newLeaser(s, LeaseOptions{Interval: fleetInterval}, true)
	t.Cleanup(func() { l.Close(context.Background()) })
	if err := l.refreshEpoch(context.Background()); err != nil {
		t.Fatal(err)
	}
	ls := l.Lease("feature/chat", LeaseLimits{MaxConcurrent: 4}, nil)
	l.Round()
	if err := rc.Set(context.Background(), ls.key, "garbage", 0).Err(); err != nil {
		t.Fatal(err)
	}
	before := lostCorrupt(s)
	ls.Need(0) // a request waits: the lease reports at this round
	l.Round()
	ls.Unneed(0)
	if typ, _ := rc.Type(context.Background(), ls.key).Result(); typ != "hash" {
		t.Errorf("the lease key is a %s after the report, want the rewritten hash", typ)
	}
	if n := lostCorrupt(s) - before; n != 1 {
		t.Errorf("state_lost_total{cause=corrupt} rose by %v, want 1", n)
	}
	if e := s.LastError(); e == nil || e.Op != "lease" || !strings.Contains(e.Message, "no replica writes") {
		t.Errorf("last error %+v, want the lease repair", e)
	}
	if !strings.Contains(logs.String(), "no replica writes") {
		t.Errorf("the repair is not logged:\n%s", logs.String())
	}
}

// lostCorrupt returns how many times s found corrupt content in Redis.
func lostCorrupt(s *Store) float64 {
	var m dto.Metric
	if err := s.met.lost.WithLabelValues(causeCorrupt).Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

// FuzzGrownPublication: whatever a publication on the lease channel holds, grownOf accepts only
// "g\t<number>\t<slots>\t<tokens>\t<compartment>" with counts that can be, and what it accepts
// it reads back as written.
func FuzzGrownPublication(f *testing.F) {
	for _, seed := range []string{
		"g\t3\t12\t4000\tfeature/chat",
		"g\t1\t0\t0\ttenant/a\tb",
		"g\t-1\t2\t2\tfeature/chat",
		"g\t1\t2\tfeature/chat",
		"g\t99999999999999999999\t1\t1\tx",
		"feature/chat\nr1",
		"sp:{p}:sp:day",
		"",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, payload string) {
		name, s, ok := grownOf(payload)
		if !ok {
			return
		}
		if s.seq < 0 || s.slots < 0 || s.tokens < 0 {
			t.Fatalf("%q: read %+v", payload, s)
		}
		if again := fmt.Sprintf("g\t%d\t%d\t%d\t%s", s.seq, s.slots, s.tokens, name); !strings.HasPrefix(payload, "g\t") || len(again) > len(payload) {
			t.Fatalf("%q read as %q %+v", payload, name, s)
		}
	})
}
