package cluster

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
)

// The shared windows (the arithmetic in luaCommon, as luaAdmit and luaSettle use it) must count
// what budget.Window counts in one process: the same admissions and refusals, the same sums, and
// the same waits. These tests run the real admission and settlement scripts on a real Redis, with
// one change: they read the instant from their last argument instead of Redis TIME, so that a
// sequence can visit window boundaries, long gaps and steps back in time at will. The reference
// runs the same sequence at the same instants.
//
// Durations compare within a tolerance. Redis keeps milliseconds: the instant a script sees is
// the reference's instant with its sub-millisecond part dropped, so a shared wait is the
// reference's rounded up to the millisecond (longer by less than 1 ms). When time steps back,
// the reference stands at the latest instant it saw and the shared window at the start of the
// latest slot it wrote (or now, if later): its wait may then be longer by up to how far time
// stepped back. The shared window does not move its clock when it refuses, refunds or is read
// (that would cost a write on the refusal path), while the reference moves its clock on every
// call; after a step back into an earlier slot the two would then stand in different slots, so
// sequences step back only where both stand in the same slot (the step is shortened otherwise).

const (
	// diffBase is the first instant (ms) of every sequence: a boundary of every slot length used.
	diffBase int64 = 1_699_999_200_000
	diffTag        = "{diff}"
	diffMe         = "me"
	// diffMaxOps bounds the operations of one sequence.
	diffMaxOps = 64
)

var (
	// Slot lengths (ms) of one-minute, 90-second, one-hour and one-day windows. Keys expire in
	// Redis time 61 slots after their last write, so a slot is never short enough for a key to
	// expire while a sequence runs.
	diffSlots = [4]int64{1000, 1500, 60_000, 1_440_000}
	// Debt bounds, as fractions of the capacity.
	diffDebts = [4]float64{0, 0.1, 0.5, 1}
	// Sub-millisecond parts (ns) of the reference's instants.
	diffJitter = [4]int64{0, 1, 500_000, 999_999}
)

// atInstant turns an admission or settlement script into one that reads the instant from its
// last argument instead of Redis TIME, and replies {its own reply, {remaining, reset ms}} where
// the pair is the state of window KEYS[5] after it, read with the capacity and slot length given
// in the two arguments before the instant. The script runs on common instead of luaCommon.
func atInstant(common, script string) string {
	body, ok := strings.CutPrefix(script, luaCommon)
	if !ok || strings.Count(body, "local now = nowms()") != 1 {
		panic("the script does not start with luaCommon and read the time once")
	}
	body = strings.Replace(body, "local now = nowms()", "local now = tonumber(ARGV[#ARGV])", 1)
	return common + "local function op()\n" + body + `
end
local r = op()
local w = wload(KEYS[5], tonumber(ARGV[#ARGV - 1]), tonumber(ARGV[#ARGV]))
return {r, {tonumber(ARGV[#ARGV - 2]) - w.sum, wreset(w)}}
`
}

// luaWindowState reads window KEYS[1] without writing it. ARGV: capacity, slot length (ms),
// instant (ms; empty for Redis TIME). Returns {remaining, reset ms}.
var luaWindowState = luaCommon + `
local now = nowms()
if ARGV[3] ~= '' then now = tonumber(ARGV[3]) end
local w = wload(KEYS[1], tonumber(ARGV[2]), now)
return {tonumber(ARGV[1]) - w.sum, wreset(w)}
`

var (
	admitAt     = redis.NewScript(atInstant(luaCommon, luaAdmit))
	settleAt    = redis.NewScript(atInstant(luaCommon, luaSettle))
	windowState = redis.NewScript(luaWindowState)
)

// sharedWindows runs sequences against one Redis.
type sharedWindows struct {
	rc   *redis.Client
	keys []string // replicas, leases, compartments, seq
	// ids numbers windows and leases, unique across the sequences run against one Redis.
	ids atomic.Int64
	// legacy, when set, tells for each operation whether the scripts of the earlier window
	// layout run it instead of the current ones.
	legacy func() bool
}

// scripts returns the admission, settlement and state scripts for the next operation.
func (h *sharedWindows) scripts() (admit, settle, state *redis.Script) {
	if h.legacy != nil && h.legacy() {
		return legacyAdmitAt, legacySettleAt, legacyWindowState
	}
	return admitAt, settleAt, windowState
}

func newSharedWindows(tb testing.TB, addr string) *sharedWindows {
	tb.Helper()
	rc := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	tb.Cleanup(func() { _ = rc.Close() })
	h := &sharedWindows{rc: rc, keys: []string{diffTag + ":r", diffTag + ":l:" + diffMe, diffTag + ":rc:" + diffMe, diffTag + ":seq"}}
	// The admission script wants its replica registered at the instant it is told: far ahead.
	if err := rc.ZAdd(context.Background(), h.keys[0], redis.Z{Score: 1e15, Member: diffMe}).Err(); err != nil {
		tb.Fatal(err)
	}
	return h
}

// call runs a script made by atInstant and returns its reply and the window's state after it.
func (h *sharedWindows) call(t testing.TB, s *redis.Script, keys []string, args ...any) (any, [2]int64) {
	t.Helper()
	v, err := s.Run(context.Background(), h.rc, keys, args...).Slice()
	if err != nil || len(v) != 2 {
		t.Fatalf("script: %v %v", v, err)
	}
	return v[0], pair(t, v[1])
}

func pair(t testing.TB, v any) [2]int64 {
	t.Helper()
	s, ok := v.([]any)
	if !ok || len(s) != 2 {
		t.Fatalf("want {remaining, reset}, got %v", v)
	}
	return [2]int64{s[0].(int64), s[1].(int64)}
}

func ints(t testing.TB, v any) []int64 {
	t.Helper()
	s, ok := v.([]any)
	if !ok {
		t.Fatalf("want an array, got %v", v)
	}
	out := make([]int64, len(s))
	for i, e := range s {
		out[i] = e.(int64)
	}
	return out
}

// diffOp is one operation of a sequence, encoded in three bytes.
type diffOp struct {
	// kind: 0-2 reserve, 3 take (a shadow reservation), 4 settle, 5 refund, 6 read the state,
	// 7 settle again a lease already settled (a retried batch).
	kind byte
	// step moves the instant: 0 stay, 1 +1 ms, 2 to the next slot boundary, 3 to 1 ms before it,
	// 4 + p/64 of a slot, 5 + p%70 whole slots, 6 + the last wait a refusal gave (or a gap
	// longer than the window), 7 back by p/32 of a slot and 1 ms.
	step byte
	// jitter picks the sub-millisecond part of the reference's instant.
	jitter byte
	// a scales amounts: a × capacity / 128 (up to twice the capacity). p picks a lease or a
	// step's length.
	a, p byte
}

func (o diffOp) bytes() []byte { return []byte{o.kind | o.step<<3 | o.jitter<<6, o.a, o.p} }

// diffSeq encodes a sequence: capacity-1, slot length and debt choice, start offset, then ops.
func diffSeq(capMinus1, slotAndDebt, start byte, ops ...diffOp) []byte {
	b := []byte{capMinus1, slotAndDebt, start}
	for _, o := range ops {
		b = append(b, o.bytes()...)
	}
	return b
}

// run decodes data into a sequence and runs it on both implementations, failing at the first
// difference with the sequence so far.
func (h *sharedWindows) run(t testing.TB, data []byte) {
	t.Helper()
	if len(data) < 3 {
		return
	}
	capacity := int64(data[0]) + 1
	sl := diffSlots[data[1]%4]
	frac := diffDebts[(data[1]>>2)%4]
	debt := int64(float64(capacity) * frac) // as budget.New computes it
	slNs := sl * int64(time.Millisecond)
	ref := budget.New(capacity, time.Duration(60*sl)*time.Millisecond, frac, time.Unix(0, 0))
	key := fmt.Sprintf("%s:w:%d", diffTag, h.ids.Add(1))
	keys := append(h.keys[:4:4], key)
	channel := diffTag + ":free"

	type held struct {
		c     budget.Charge
		lease string
	}
	var (
		open, settled []held
		ms            = diffBase + int64(data[2])*sl/256
		latest        int64      // the latest instant (ns) the reference saw
		written       int64 = -1 // the latest slot the shared window wrote (as the scripts do)
		lastWait      int64      // the last refusal's wait (ms)
		hist          strings.Builder
	)
	defer func() {
		ctx := context.Background()
		_ = h.rc.Del(ctx, key).Err()
		for _, o := range open {
			_ = h.rc.HDel(ctx, h.keys[1], o.lease).Err()
		}
	}()
	fmt.Fprintf(&hist, "capacity %d, debt %d, slot %d ms, window %d ms\n", capacity, debt, sl, 60*sl)
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("%s  → "+format, append([]any{hist.String()}, args...)...)
	}
	ops := data[3:]
	for i := 0; i+3 <= len(ops) && i < 3*diffMaxOps; i += 3 {
		k, a, p := ops[i], ops[i+1], ops[i+2]
		kind := k & 7
		switch (k >> 3) & 7 {
		case 1:
			ms++
		case 2:
			ms = (ms/sl + 1) * sl
		case 3:
			ms = (ms/sl+1)*sl - 1
		case 4:
			ms += int64(p) * sl / 64
		case 5:
			ms += int64(p%70) * sl
		case 6:
			if lastWait > 0 {
				ms += lastWait
				lastWait = 0
			} else {
				ms += 60*sl + int64(p)*sl/16
			}
		case 7:
			ms -= int64(p)*sl/32 + 1
		}
		now := ms*int64(time.Millisecond) + diffJitter[k>>6]
		if last := latest / slNs; now < latest && now/slNs != last && written != last {
			// A step back into an earlier slot where the shared window's clock stands earlier
			// than the reference's: shorten it to the start of the reference's slot.
			now = last * slNs
			ms = now / int64(time.Millisecond)
		}
		// Both now stand at the reference's slot; a shared duration exceeds the reference's by
		// at least 0 and less than tol.
		eff := max(latest, now)
		tol := time.Duration(eff-now) + time.Millisecond
		latest = eff
		cur := eff / slNs
		at := time.Unix(0, now)
		duration := func(what string, shared int64, want time.Duration) {
			t.Helper()
			if d := time.Duration(shared)*time.Millisecond - want; d < 0 || d >= tol {
				fail("%s: shared %d ms, reference %v (tolerance [0, %v))", what, shared, want, tol)
			}
		}
		n := int64(a) * capacity / 128
		admitScript, settleScript, stateScript := h.scripts()
		var st [2]int64
		switch {
		case kind <= 3:
			shadow := kind == 3
			lease := strconv.FormatInt(h.ids.Add(1), 10)
			var before int64
			if shadow {
				before = ref.State(at).Used
				fmt.Fprintf(&hist, "take %d at %d ms%+dns (slot %d)", n, ms, now-ms*int64(time.Millisecond), cur)
			} else {
				fmt.Fprintf(&hist, "reserve %d at %d ms%+dns (slot %d)", n, ms, now-ms*int64(time.Millisecond), cur)
			}
			var reply any
			reply, st = h.call(t, admitScript, keys, diffMe, lease, channel, 0, 1, 5, capacity, debt, sl, n, b01(shadow), capacity, sl, ms)
			r := ints(t, reply)
			var (
				c    budget.Charge
				ok   = true
				wait time.Duration
			)
			if shadow {
				c = ref.Take(n, at)
			} else {
				c, ok, wait = ref.Reserve(n, at)
			}
			switch {
			case r[0] == 0 && ok:
				fmt.Fprintf(&hist, ": admitted, took %d\n", c.Amount())
				want := ref.State(at)
				if r[4] != want.Remaining {
					fail("remaining in the admission's reply: shared %d, reference %d", r[4], want.Remaining)
				}
				duration("reset in the admission's reply", r[5], want.ResetIn)
				wantShadowed := int64(0)
				if shadow && before+min(n, capacity) > capacity {
					wantShadowed = 1
				}
				if r[6] != wantShadowed {
					fail("shadowed: shared %d, want %d", r[6], wantShadowed)
				}
				open = append(open, held{c: c, lease: lease})
				written = cur
			case r[0] == 1 && !ok:
				fmt.Fprintf(&hist, ": refused, wait %d ms (reference %v)\n", r[2], wait)
				duration("wait", r[2], wait)
				lastWait = r[2]
			default:
				fail("shared reply %v, reference admitted=%v wait=%v", r, ok, wait)
			}
		case (kind == 4 || kind == 5) && len(open) > 0:
			j := int(p) % len(open)
			o := open[j]
			open = append(open[:j], open[j+1:]...)
			if kind == 5 {
				n = 0
				ref.Refund(o.c, at)
				fmt.Fprintf(&hist, "refund lease %s (took %d) at %d ms (slot %d)\n", o.lease, o.c.Amount(), ms, cur)
			} else {
				ref.Settle(o.c, n, at)
				fmt.Fprintf(&hist, "settle lease %s (took %d) to %d at %d ms (slot %d)\n", o.lease, o.c.Amount(), n, ms, cur)
			}
			var reply any
			reply, st = h.call(t, settleScript, keys, diffMe, channel, 1, o.lease, n, 0, 1, 5, 1, capacity, debt, sl, capacity, sl, ms)
			if reply.(int64) != 1 {
				fail("settled %v leases, want 1", reply)
			}
			if n > o.c.Amount() {
				written = cur
			}
			settled = append(settled, o)
		case kind == 7 && len(settled) > 0:
			o := settled[int(p)%len(settled)]
			fmt.Fprintf(&hist, "settle lease %s again, to %d, at %d ms (slot %d)\n", o.lease, n, ms, cur)
			var reply any
			reply, st = h.call(t, settleScript, keys, diffMe, channel, 1, o.lease, n, 0, 1, 5, 1, capacity, debt, sl, capacity, sl, ms)
			if reply.(int64) != 0 {
				fail("settled %v leases, want 0: a lease settles once", reply)
			}
		default:
			fmt.Fprintf(&hist, "read at %d ms (slot %d)\n", ms, cur)
			v, err := stateScript.Run(context.Background(), h.rc, []string{key}, capacity, sl, ms).Slice()
			if err != nil {
				t.Fatal(err)
			}
			st = pair(t, v)
		}
		want := ref.State(at)
		if st[0] != want.Remaining {
			fail("remaining: shared %d, reference %d (used %d)", st[0], want.Remaining, want.Used)
		}
		duration("reset", st[1], want.ResetIn)
	}
}

// diffScenarios are sequences aimed at the edges; they seed the fuzz target too.
func diffScenarios() map[string][]byte {
	const (
		reserve, take, settle, refund, read, again                     byte = 0, 3, 4, 5, 6, 7
		stay, ms1, boundary, beforeBoundary, part, slots, waited, back byte = 0, 1, 2, 3, 4, 5, 6, 7
	)
	o := func(kind, step, a, p byte) diffOp { return diffOp{kind: kind, step: step, a: a, p: p} }
	return map[string][]byte{
		// Capacity 100, one-minute window: fill it, get refused, come back exactly when told.
		"refused until exactly the wait": diffSeq(99, 0, 0,
			o(reserve, part, 77, 10), o(reserve, part, 64, 30), o(reserve, ms1, 64, 0),
			o(reserve, waited, 64, 0), o(reserve, stay, 20, 0), o(reserve, waited, 20, 0)),
		// The slot charged first leaves the window on the boundary 60 slots later, not 1 ms before.
		"a charge ages out exactly at its boundary": diffSeq(9, 0, 128,
			o(reserve, stay, 128, 0), o(reserve, slots, 1, 59), o(reserve, beforeBoundary, 1, 0),
			o(reserve, ms1, 1, 0), o(read, slots, 0, 59), o(read, boundary, 0, 0)),
		// More than the capacity is admitted into an empty window only, and not twice.
		"over capacity": diffSeq(49, 0, 0,
			o(reserve, stay, 255, 0), o(reserve, ms1, 200, 0), o(settle, part, 255, 0),
			o(reserve, waited, 200, 0), o(reserve, slots, 128, 61), o(reserve, stay, 0, 0)),
		// Settlement charges the excess up to the debt bound (half the capacity), which delays
		// later admissions; zero-sized reservations are refused while in debt.
		"debt bound": diffSeq(99, 2<<2, 0,
			o(reserve, stay, 64, 0), o(reserve, part, 64, 5), o(settle, part, 255, 0),
			o(settle, part, 255, 0), o(reserve, ms1, 0, 0), o(reserve, waited, 0, 0),
			o(take, stay, 255, 0), o(read, slots, 0, 30)),
		// Refunds go to the slot charged, and not once it left the window.
		"refunds": diffSeq(99, 1, 0,
			o(reserve, stay, 100, 0), o(reserve, slots, 20, 10), o(refund, slots, 0, 0),
			o(reserve, slots, 100, 55), o(settle, slots, 0, 0), o(reserve, ms1, 128, 0),
			o(again, stay, 0, 0), o(again, part, 255, 1)),
		// A gap longer than the window forgets everything; a gap of exactly the window too.
		"gaps": diffSeq(19, 3, 200,
			o(reserve, stay, 128, 0), o(read, waited, 0, 3), o(reserve, stay, 128, 0),
			o(reserve, slots, 64, 60), o(reserve, slots, 64, 69), o(settle, stay, 0, 0)),
		// Time stepping back: within a slot, and into earlier slots after a write and after a
		// refusal.
		"time going backwards": diffSeq(29, 0, 60,
			o(reserve, part, 128, 40), o(reserve, back, 64, 10), o(reserve, back, 64, 64),
			o(reserve, slots, 128, 3), o(reserve, back, 10, 255), o(settle, back, 255, 0),
			o(read, back, 0, 128), o(reserve, boundary, 30, 0), o(refund, back, 0, 1)),
		// Shadow reservations are charged even when they do not fit, up to the debt bound.
		"shadow": diffSeq(9, 3<<2, 0,
			o(take, stay, 255, 0), o(take, ms1, 255, 0), o(reserve, ms1, 13, 0),
			o(take, slots, 128, 59), o(reserve, ms1, 13, 0)),
	}
}

// sub-millisecond instants: the jitter bits of every op set.
func withJitter(b []byte, j byte) []byte {
	b = append([]byte(nil), b...)
	for i := 3; i+3 <= len(b); i += 3 {
		b[i] = b[i]&0x3f | j<<6
	}
	return b
}

func TestSharedWindowMatchesReference(t *testing.T) {
	rd := redistest.Standalone(t)
	h := newSharedWindows(t, rd.Addr())
	for name, seq := range diffScenarios() {
		t.Run(name, func(t *testing.T) {
			for j := range byte(4) {
				h.run(t, withJitter(seq, j))
			}
		})
	}
	t.Run("random", func(t *testing.T) {
		rng := rand.New(rand.NewPCG(1, 2))
		for range 300 {
			b := make([]byte, 3+3*(8+rng.IntN(diffMaxOps-8)))
			for i := range b {
				b[i] = byte(rng.UintN(256))
			}
			// Mostly small capacities and steps, so that windows fill and slots age out.
			b[0] %= 32
			for i := 3; i+3 <= len(b); i += 3 {
				if rng.IntN(3) > 0 {
					b[i] = b[i]&^(7<<3) | byte(rng.IntN(6))<<3 // fewer long gaps and steps back
				}
			}
			h.run(t, b)
			if t.Failed() {
				return
			}
		}
	})
}

func FuzzSharedWindowMatchesReference(f *testing.F) {
	// One Redis per fuzzing process, shared by the inputs it runs.
	rd := redistest.Standalone(f)
	h := newSharedWindows(f, rd.Addr())
	for _, seq := range diffScenarios() {
		f.Add(seq)
	}
	f.Fuzz(func(t *testing.T, data []byte) { h.run(t, data) })
}
