package policy_test

import (
	"fmt"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// TestOverflowView: only a tenant-keyed family's overflow compartment carries the overflow view,
// counting the tenant compartments its family tracks against max_instances.
func TestOverflowView(t *testing.T) {
	e, _ := engine(t, `
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
tiers:
  free: {max_concurrent: 1}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant, max_instances: 3, idle_ttl: 1m}
`)
	overflow := func() (policy.CompartmentView, int) {
		var out policy.CompartmentView
		n := 0
		for _, c := range e.Compartments() {
			if c.Overflow != nil {
				out = c
				n++
			}
		}
		return out, n
	}
	for i, want := range []int{0, 1, 2, 3, 3} {
		c, n := overflow()
		if n != 1 || c.Name != "tenant/_overflow" || c.Overflow.Tracked != want || c.Overflow.MaxInstances != 3 {
			t.Fatalf("after %d tenants: %d overflow views, %s %+v; want tenant/_overflow tracking %d of 3", i, n, c.Name, c.Overflow, want)
		}
		// Each tenant keeps its slot, so none can be evicted: the fourth shares the overflow.
		admit(t, e, input{headers: map[string]string{"x-tenant-id": fmt.Sprint("t", i)}}, 1)
	}
	// A tenant literally named _overflow gets its own compartment, not the overflow's view.
	e2, _ := engine(t, `
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
tiers:
  free: {max_concurrent: 1}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant}
`)
	admit(t, e2, input{headers: map[string]string{"x-tenant-id": "_overflow"}}, 1)
	views := 0
	for _, c := range e2.Compartments() {
		if c.Overflow != nil {
			views++
			if c.InFlight != 0 {
				t.Errorf("the overflow view went to the tenant named _overflow: %+v", c)
			}
		}
	}
	if views != 1 {
		t.Errorf("%d overflow views, want 1", views)
	}
}
