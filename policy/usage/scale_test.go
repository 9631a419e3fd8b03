package usage

import (
	"fmt"
	"runtime"
	"testing"
	"time"
)

// TestTenThousandTenantsFiftyModels: 72 hours of traffic from 10 000 tenants × 50 models
// through tables of the default size. Ten heavy tenants each send 10 000-token requests to a
// model of their own, tenant i at a steady rate proportional to 11−i, and every pair of the
// other 9 990 tenants × 50 models sends one 100-token request. In every window, by tenant, by
// model and by both, the top 10 are exactly the heavy ones in order, each row within its
// overcount of the truth, and the tracker's memory stays within MaxBytes for the table size
// and the rows' names (heap measured with runtime.MemStats).
func TestTenThousandTenantsFiftyModels(t *testing.T) {
	if testing.Short() {
		t.Skip("825 000 events")
	}
	const (
		size     = DefaultTableSize
		tenants  = 10000
		models   = 50
		heavy    = 10
		light    = (tenants - heavy) * models
		duration = 72 * time.Hour
		// Every heavy tenant sends (11−i) × perUnit requests over the duration.
		perUnit = 5000
	)
	tenantName := func(i int) string { return fmt.Sprintf("t-%05d", i) }
	modelName := func(i int) string { return fmt.Sprintf("m-%02d", i) }
	// 8-byte names (the allocation size of "t-01234" and of "m-12"): at most 16 bytes a row.
	const nameBytes = 16

	start := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	tr := newTracker(t, size, nil, start)

	var heavySent [heavy]int64 // requests sent by each heavy tenant
	var modelLight [models]int64
	lightSent := 0
	step := time.Second
	steps := int(duration / step)
	var due [heavy]float64
	for s := range steps {
		now := start.Add(time.Duration(s) * step)
		for i := range heavy {
			due[i] += float64((11-i)*perUnit) / float64(steps)
			for due[i] >= 1 {
				due[i]--
				heavySent[i]++
				tr.Record(now, &Event{Tenant: tenantName(i), Model: modelName(i), Refusal: -1, Prompt: 8000, Completion: 1999, Cached: 4000, Spend: 1000})
			}
		}
		// The light pairs, in an order that spreads each tenant's models over the days.
		for lightSent < light*(s+1)/steps {
			p := lightSent * 7919 % light
			tenant, model := heavy+p/models, p%models
			tr.Record(now, &Event{Tenant: tenantName(tenant), Model: modelName(model), Refusal: -1, Prompt: 80, Completion: 19, Spend: 1})
			modelLight[model]++
			lightSent++
		}
	}
	end := start.Add(duration)

	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	used := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	st := tr.Stats()
	var tables int
	for _, by := range Groupings() {
		if st.Tables[by] > TablesPerGroup || st.Rows[by] > st.Tables[by]*size {
			t.Errorf("by %s: %d tables, %d rows", by, st.Tables[by], st.Rows[by])
		}
		tables += st.Tables[by]
	}
	// The bound of the tables held (every one full), and the bound of a tracker whose every
	// table of every level is full.
	held := int64(tables)*(TableBytes+size*(EntryBytes+nameBytes)) + int64(numBy)*size*LiveIndexBytes
	t.Logf("heap %.1f MiB for %d tables (%d rows); bound of the tables held %.1f MiB, MaxBytes %.1f MiB",
		float64(used)/(1<<20), tables, st.Rows[ByTenant]+st.Rows[ByModel]+st.Rows[ByTenantModel], float64(held)/(1<<20), float64(MaxBytes(size, nameBytes))/(1<<20))
	if used > held || used > MaxBytes(size, nameBytes) {
		t.Errorf("the tracker takes %d bytes, above the bound %d of its %d tables (MaxBytes %d)", used, held, tables, MaxBytes(size, nameBytes))
	}
	if st.Evictions[ByTenantModel] == 0 {
		t.Fatal("the tables never filled")
	}

	// True weights: a heavy request weighs 10 000, a light one 100.
	weight := func(by By, i int) uint64 {
		w := uint64(heavySent[i]) * 10000
		if by == ByModel {
			w += uint64(modelLight[i]) * 100
		}
		return w
	}
	key := func(by By, i int) Key {
		switch by {
		case ByTenant:
			return Key{Tenant: tenantName(i)}
		case ByModel:
			return Key{Model: modelName(i)}
		}
		return Key{Tenant: tenantName(i), Model: modelName(i)}
	}
	for _, w := range []Window{Hour, Day, Week, Month} {
		for _, by := range Groupings() {
			r := report(t, tr, end, by, w, 10)
			if len(r.Rows) != 10 {
				t.Fatalf("%s by %s: %d rows", w, by, len(r.Rows))
			}
			for i, row := range r.Rows {
				if row.Key != key(by, i) {
					t.Errorf("%s by %s: row %d is %+v, want %+v", w, by, i, row.Key, key(by, i))
					continue
				}
				if w == Week || w == Month {
					// These windows hold all the traffic: the rows are checked against it.
					if tw := weight(by, i); row.Weight < tw || row.Weight-row.Overcount > tw {
						t.Errorf("%s by %s: %v weighs %d (overcount %d), truly %d", w, by, row.Key, row.Weight, row.Overcount, tw)
					}
				}
			}
			if w == Month && r.Total.Requests != uint64(lightSent)+uint64(sum(heavySent[:])) {
				t.Errorf("month total %d requests, sent %d", r.Total.Requests, lightSent+int(sum(heavySent[:])))
			}
		}
	}
	runtime.KeepAlive(tr)
}

func sum(v []int64) int64 {
	var n int64
	for _, x := range v {
		n += x
	}
	return n
}
