package integration_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// TestDashboardAdaptive: the dashboard shows an adaptive compartment's learned limit moving:
// a badge on its row, a line per compartment in the chart, and the table's numbers, which
// follow the server as a busy provider brings the limit down from 16.
func TestDashboardAdaptive(t *testing.T) {
	b := startBrowser(t)
	latency := mock.LatencyModel{Base: 300 * time.Millisecond, JitterMin: 0.95, JitterMax: 1.05}
	s := start(t, harness.Options{PolicyPath: writePolicy(t, adaptivePolicy(16)), Mock: mock.Options{Capacity: 4, Latency: latency}})
	b.viewport(1280, 900)
	b.navigate(s.AdminURL() + "/")
	const row = `document.querySelector('[data-adaptive="provider/openai"]')`
	b.waitUntil(15*time.Second, "the adaptive limit at its initial 16",
		`!document.getElementById("adaptive-section").hidden && `+row+`.querySelector(".limit").textContent === "16"`+
			` && document.querySelector('[data-compartment="provider/openai"] .badge.adaptive') !== null`)
	if !load(t, s, 24, func(v policy.CompartmentView) bool { return v.Adaptive.Limit <= 8 }) {
		t.Fatalf("the limit did not come down: %+v", *adaptiveState(t, s).Adaptive)
	}
	want := adaptiveState(t, s).Adaptive.Limit
	b.waitUntil(15*time.Second, "the learned limit and its line",
		row+`.querySelector(".limit").textContent === `+jsString(fmt.Sprint(want))+
			` && document.querySelector('[data-compartment="provider/openai"] .held').textContent.endsWith(`+jsString("/ "+fmt.Sprint(want))+`)`+
			` && document.querySelector('#adaptive-chart polyline[data-limit="provider/openai"]').getAttribute("points").split(" ").length >= 3`)
	b.screenshot("dashboard-adaptive.png")
}
