package integration_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// findChromium returns headless Chromium's path (skipping the test without it, as tool does).
func findChromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return tool(t, "chromium")
}

// renderDashboard loads the dashboard at url in headless Chromium and returns the DOM its script
// drew.
func renderDashboard(t *testing.T, chromium, url string) string {
	t.Helper()
	args := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--user-data-dir=" + t.TempDir(),
		"--virtual-time-budget=3000", "--dump-dom", url}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, chromium, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	dom, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium: %v\n%s", err, stderr.String())
	}
	return string(dom)
}

// TestDashboard renders the admin dashboard in headless Chromium and checks that its script
// drew the live state: compartments, breakers, features, the ready status and the cluster panel.
func TestDashboard(t *testing.T) {
	chromium := findChromium(t)
	s := start(t, harness.Options{Mock: mock.Options{TimeScale: 0.001}})
	// Some traffic, and one refusal, so the page has something to show.
	g := newGate()
	for i := 0; i < 3; i++ {
		go func() {
			req := batchRequest("acme", 100, 10)
			_, _ = s.Sim.RoundTrip(context.Background(), req, g)
		}()
	}
	for i := 0; i < 3; i++ {
		<-g.arrived
	}
	defer func() {
		for i := 0; i < 3; i++ {
			g.release <- struct{}{}
		}
	}()
	if r, err := s.Do(context.Background(), chatRequest("chat")); err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	forced := chatRequest("chat")
	forced.Headers = append(forced.Headers, envoysim.Header{Key: "x-llm-provider", Value: "qwen"})
	if err := s.App.Engine().ForceBreaker("qwen", "FORCED_OPEN"); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.Do(context.Background(), forced); r.Status != 503 {
		t.Fatalf("forced-open provider answered %d", r.Status)
	}

	html := renderDashboard(t, chromium, s.AdminURL()+"/")
	for _, want := range []string{
		`data-compartment="feature/chat"`, `data-compartment="tier_feature/enterprise/batch_summarize"`,
		`data-compartment="provider/deepseek"`, `data-breaker="qwen"`, `class="state FORCED_OPEN"`,
		`data-feature="chat"`, `circuit_open 1`, `<b id="status" class="ok">ready</b>`,
		`data-cluster="off"`, `cluster: off`,
	} {
		if !strings.Contains(html, want) {
			t.Errorf("rendered dashboard lacks %s", want)
		}
	}
	// The batch compartment shows its three requests in flight.
	if !regexp.MustCompile(`data-compartment="feature/batch_summarize".*?3 / 5`).MatchString(html) {
		t.Error("feature/batch_summarize does not show 3 / 5 in flight")
	}
	if t.Failed() {
		t.Logf("DOM:\n%s", html)
	}
}

// dashboardClusterPolicy writes the example policy with a cluster section sharing its limits
// through the Redis at addr, as replica id, and returns its path.
func dashboardClusterPolicy(t *testing.T, addr, id, admission string) string {
	t.Helper()
	base, err := os.ReadFile("../examples/policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), id+".yaml")
	section := fmt.Sprintf("\ncluster:\n  backend: redis\n  addresses: [%q]\n  replica_id: %s\n  key_prefix: dashboard\n"+
		"  timeout: 500ms\n  lease_ttl: 2s\n  heartbeat: 100ms\n  admission: %s\n", addr, id, admission)
	if err := os.WriteFile(path, append(base, section...), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestDashboardCluster: with limits shared through Redis, the dashboard says so, names the live
// replicas and shows what another replica holds (exact admission) or this replica's lease
// (leased); once Redis is gone it shows the share this replica enforces.
func TestDashboardCluster(t *testing.T) {
	for _, adm := range clusterAdmissions {
		t.Run(adm, func(t *testing.T) { dashboardCluster(t, adm) })
	}
}

func dashboardCluster(t *testing.T, adm string) {
	chromium := findChromium(t)
	rd := redistest.Standalone(t)
	s := start(t, harness.Options{PolicyPath: dashboardClusterPolicy(t, rd.Addr(), "dash-a", adm), Mock: mock.Options{TimeScale: 0.001}})
	other := start(t, harness.Options{PolicyPath: dashboardClusterPolicy(t, rd.Addr(), "dash-b", adm), Mock: mock.Options{TimeScale: 0.001}})
	leased := adm == "leased"
	// Given the other replica holds a chat request
	g := newGate()
	go func() { _, _ = other.Sim.RoundTrip(context.Background(), chatRequest("chat"), g) }()
	<-g.arrived
	released := false
	release := func() {
		if !released {
			released = true
			g.release <- struct{}{}
		}
	}
	defer release()
	// And this replica served one (so it follows feature/chat's shared count)
	if r, err := s.Do(context.Background(), chatRequest("chat")); err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	e := s.App.Engine()
	// Both replicas live, this one's request done and the other's counted here
	waitFor(t, func() bool {
		if e.Cluster().Live() != 2 {
			return false
		}
		for _, c := range e.Compartments() {
			if c.Name == "feature/chat" {
				if leased {
					// A leased replica does not follow what the others hold: it holds a lease.
					return c.InFlight == 0 && c.Lease != nil && !c.Lease.Part
				}
				return c.InFlight == 0 && c.RemoteInFlight == 1
			}
		}
		return false
	})
	// Then the dashboard shows limits shared by two replicas, and the other's request in chat
	// (exact) or this replica's lease of chat's 20 slots (leased)
	html := renderDashboard(t, chromium, s.AdminURL()+"/")
	for _, want := range []string{`data-cluster="shared"`, "shared via Redis — 2 replicas live", `data-replica="dash-a"`, `data-replica="dash-b"`} {
		if !strings.Contains(html, want) {
			t.Errorf("rendered dashboard lacks %s", want)
		}
	}
	chatHeld := "0+1 / 20"
	if leased {
		chatHeld = "0 / 20"
		if !regexp.MustCompile(`data-compartment="feature/chat".*?data-lease="\d+">lease \d+<`).MatchString(html) {
			t.Error("feature/chat does not show this replica's lease")
		}
	}
	if !regexp.MustCompile(`data-compartment="feature/chat".*?` + regexp.QuoteMeta(chatHeld)).MatchString(html) {
		t.Errorf("feature/chat does not show %s", chatHeld)
	}
	if t.Failed() {
		t.Fatalf("DOM:\n%s", html)
	}
	// On a phone the strip and the other replica's share fit, and the legend says what the
	// striped part of the bar is.
	b := startBrowser(t)
	b.viewport(390, 844)
	b.navigate(s.AdminURL() + "/")
	b.waitUntil(15*time.Second, "the shared cluster", `document.getElementById("cluster").dataset.cluster === "shared"`+
		` && document.querySelector('[data-compartment="feature/chat"] .held')?.textContent === "`+chatHeld+`"`)
	var l layout
	b.eval(layoutProbe+`(["feature/chat"])`, &l)
	b.screenshot("dashboard-cluster-390.png")
	if l.ScrollWidth > l.ClientWidth {
		t.Errorf("the page is %v px wide in a %v px viewport", l.ScrollWidth, l.ClientWidth)
	}
	for _, p := range l.Problems {
		t.Errorf("layout: %s", p)
	}
	if c := l.Rows["feature/chat"]; !leased && (c.BarFilled < 0.04 || c.BarFilled > 0.06) {
		t.Errorf("feature/chat (1 of 20, on the other replica): bar %.2f full", c.BarFilled)
	} else if leased && c.BarFilled > 0.01 {
		t.Errorf("feature/chat (none here): bar %.2f full", c.BarFilled)
	}
	if (!leased && !strings.Contains(strings.Join(l.LegendKinds, " "), "remote")) || len(l.LegendMiss) > 0 {
		t.Errorf("legend: drawn %v, without an entry %v", l.LegendKinds, l.LegendMiss)
	}

	// When Redis is gone
	release()
	rd.Kill()
	// Then this replica enforces its share
	waitFor(t, func() bool { return !e.Cluster().Available() && e.ClusterShare() == 2 })
	// And the dashboard says so
	html = renderDashboard(t, chromium, s.AdminURL()+"/")
	for _, want := range []string{`data-cluster="local"`, "Redis unavailable — enforcing 1/2 share locally", "on_unavailable local"} {
		if !strings.Contains(html, want) {
			t.Errorf("rendered dashboard lacks %s", want)
		}
	}
	if t.Failed() {
		t.Logf("DOM:\n%s", html)
	}
}

// layoutProbe measures the dashboard as drawn. It returns every element that reaches past the
// viewport (outside a box that scrolls on its own), cuts its content off or truncates text, the
// number of columns, and, for the compartments named in names, what their name, numbers and
// concurrency bar show.
const layoutProbe = `((names) => {
  // clientWidth is the viewport less a vertical scroll bar: what the page may use.
  const vw = document.documentElement.clientWidth;
  const out = {innerWidth: window.innerWidth, clientWidth: vw, scrollWidth: document.documentElement.scrollWidth, problems: [], rows: {}};
  const scrolls = e => { for (let p = e.parentElement; p; p = p.parentElement) { const o = getComputedStyle(p).overflowX; if (o === "auto" || o === "scroll") return true; } return false; };
  const label = e => {
    let s = e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") + (typeof e.className === "string" && e.className.trim() ? "." + e.className.trim().split(/\s+/).join(".") : "");
    const row = e.closest("[data-compartment]");
    return row ? s + " of " + row.dataset.compartment : s;
  };
  for (const e of document.body.querySelectorAll("*")) {
    if (e.closest("svg") && e.tagName.toLowerCase() !== "svg") continue;
    const r = e.getBoundingClientRect(), cs = getComputedStyle(e);
    if (r.width === 0 && r.height === 0) continue;
    if (scrolls(e)) continue;
    if (r.right > vw + 0.5 || r.left < -0.5) out.problems.push(label(e) + " spans " + r.left.toFixed(0) + " to " + r.right.toFixed(0) + " px of a " + vw + " px viewport");
    if (e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1 && cs.overflowX !== "auto" && cs.overflowX !== "scroll") out.problems.push(label(e) + " has content " + e.scrollWidth + " px wide in a " + e.clientWidth + " px box");
    if (cs.textOverflow === "ellipsis") out.problems.push(label(e) + " truncates its text with an ellipsis");
  }
  out.columns = new Set([...document.querySelector("main").children].map(c => Math.round(c.getBoundingClientRect().left))).size;
  for (const n of names) {
    const row = document.querySelector('[data-compartment="' + CSS.escape(n) + '"]');
    if (!row) continue;
    const name = row.querySelector(".name"), bar = row.querySelector('[data-bar="concurrency"]');
    const tops = new Set();
    let text = "";
    for (const k of name.childNodes) {
      if (k.nodeType !== Node.TEXT_NODE) continue;
      text += k.textContent;
      const range = document.createRange();
      range.selectNodeContents(k);
      for (const r of range.getClientRects()) if (r.width > 0) tops.add(Math.round(r.top));
    }
    const nr = name.getBoundingClientRect(), br = bar.getBoundingClientRect();
    let filled = 0;
    for (const f of bar.children) if (f.tagName.toLowerCase() === "i") filled += f.getBoundingClientRect().width;
    const note = name.querySelector(".note");
    out.rows[n] = {title: name.title, text, lines: tops.size, nameRight: nr.right, nameFits: name.scrollWidth <= name.clientWidth,
      nums: row.querySelector(".nums .held").textContent, barFilled: br.width > 0 ? filled / br.width : -1,
      barText: bar.textContent, unlimited: bar.hasAttribute("data-unlimited"),
      note: note ? note.textContent : "", noteVisible: note ? note.getBoundingClientRect().height > 0 : false,
      badgeTitle: [...name.querySelectorAll(".badge")].map(b => b.title).join(" ")};
  }
  // Every kind of bar drawn has a visible legend entry.
  const kinds = new Set([...document.querySelectorAll("[data-compartment] [data-bar]")].map(b => b.dataset.bar));
  if (document.querySelector("[data-compartment] [data-unlimited]")) kinds.add("unlimited");
  if (document.querySelector("[data-compartment] i.remote")) kinds.add("remote");
  out.legendMissing = [...kinds].filter(k => ![...document.querySelectorAll('#bar-legend [data-legend="' + k + '"]')].some(e => !e.hidden && e.getBoundingClientRect().width > 0));
  out.legendKinds = [...kinds];
  // The chart's time axis: labels inside the chart's width, left to right, not overlapping.
  const chart = document.getElementById("chart").getBoundingClientRect();
  const ticks = [...document.querySelectorAll("#chart-axis > *")].map(t => ({text: t.textContent, r: t.getBoundingClientRect()}));
  out.axis = ticks.map(t => t.text);
  out.axisOrdered = ticks.length > 0 && ticks.every((t, i) => t.r.width > 0 && t.r.left >= chart.left - 0.5 && t.r.right <= chart.right + 0.5 &&
    (i === 0 || t.r.left >= ticks[i - 1].r.right));
  return out;
})`

type layout struct {
	InnerWidth  float64  `json:"innerWidth"`
	ClientWidth float64  `json:"clientWidth"`
	ScrollWidth float64  `json:"scrollWidth"`
	Problems    []string `json:"problems"`
	Columns     int      `json:"columns"`
	LegendMiss  []string `json:"legendMissing"`
	LegendKinds []string `json:"legendKinds"`
	Axis        []string `json:"axis"`
	AxisOrdered bool     `json:"axisOrdered"`
	Rows        map[string]struct {
		Title       string  `json:"title"`
		Text        string  `json:"text"`
		Lines       int     `json:"lines"`
		NameRight   float64 `json:"nameRight"`
		NameFits    bool    `json:"nameFits"`
		Nums        string  `json:"nums"`
		BarFilled   float64 `json:"barFilled"`
		BarText     string  `json:"barText"`
		Unlimited   bool    `json:"unlimited"`
		Note        string  `json:"note"`
		NoteVisible bool    `json:"noteVisible"`
		BadgeTitle  string  `json:"badgeTitle"`
	} `json:"rows"`
}

// onPhone opens the dashboard at url in a browser 390 px wide, waits until ready (a script
// expression) says what it waits for is drawn, saves a screenshot named shot, and fails t for
// anything that reaches past the screen or is cut off. It returns the browser.
func onPhone(t *testing.T, url, what, ready, shot string) *browser {
	t.Helper()
	b := startBrowser(t)
	b.viewport(390, 844)
	b.navigate(url)
	b.waitUntil(15*time.Second, what, ready)
	var l layout
	b.eval(layoutProbe+`([])`, &l)
	b.screenshot(shot)
	if l.ScrollWidth > l.ClientWidth {
		t.Errorf("the page is %v px wide in a %v px viewport", l.ScrollWidth, l.ClientWidth)
	}
	for _, p := range l.Problems {
		t.Errorf("layout: %s", p)
	}
	return b
}

// jsString quotes s for a script.
func jsString(s string) string { return fmt.Sprintf("%q", s) }

// TestDashboardLayout loads the dashboard in headless Chromium at a desktop and a phone width
// and checks what an operator sees: nothing reaches past the screen or is cut off, one column on
// a phone, a long tenant's compartment name whole (wrapping, and in its title), a compartment
// without a concurrency limit drawn as such rather than as a full bar, a legend for every kind of
// bar, the overflow compartment explained, a time axis under the chart, and numbers that follow
// the server. Screenshots of both widths are saved (see browser.screenshot).
func TestDashboardLayout(t *testing.T) {
	b := startBrowser(t)
	s := start(t, harness.Options{Mock: mock.Options{TimeScale: 0.001}})
	ctx := context.Background()
	// acme holds three batch requests: 3 of feature/batch_summarize's 5, and 3 in
	// paid_batch/batch_summarize, which has a token budget but no concurrency limit.
	g := newGate()
	for i := 0; i < 3; i++ {
		go func() { _, _ = s.Sim.RoundTrip(ctx, batchRequest("acme", 100, 10), g) }()
	}
	for i := 0; i < 3; i++ {
		<-g.arrived
	}
	released := false
	release := func() {
		if !released {
			released = true
			for i := 0; i < 3; i++ {
				g.release <- struct{}{}
			}
		}
	}
	defer release()
	// A tenant with a long id gets a compartment with a long name.
	const longTenant = "northwind-traders-research-and-development-division-eu-west-1-nightly-summaries"
	long := "tenant/" + longTenant
	chat := chatRequest("chat")
	chat.Headers = append(chat.Headers, envoysim.Header{Key: "x-tenant-id", Value: longTenant})
	if r, err := s.Do(ctx, chat); err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	const (
		batch     = "feature/batch_summarize"
		unlimited = "paid_batch/batch_summarize"
		overflow  = "tenant/_overflow"
	)
	names := jsString(long) + "," + jsString(batch) + "," + jsString(unlimited) + "," + jsString(overflow)

	for _, size := range []struct {
		width, height, columns int
	}{{1280, 900, 2}, {390, 844, 1}} {
		b.viewport(size.width, size.height)
		b.navigate(s.AdminURL() + "/")
		b.waitUntil(15*time.Second, "the held batch requests and a chart", `document.querySelector('[data-compartment="`+batch+`"] .held')?.textContent === "3 / 5" && document.querySelectorAll("#chart-axis > *").length > 0`)
		var l layout
		b.eval(layoutProbe+"(["+names+"])", &l)
		b.screenshot(fmt.Sprintf("dashboard-%d.png", size.width))
		t.Run(fmt.Sprint(size.width), func(t *testing.T) {
			if l.InnerWidth != float64(size.width) {
				t.Fatalf("viewport is %v px wide, want %d", l.InnerWidth, size.width)
			}
			if l.ScrollWidth > l.ClientWidth || l.ScrollWidth > l.InnerWidth {
				t.Errorf("the page is %v px wide in a %v px viewport (%v px beside the scroll bar): it scrolls sideways", l.ScrollWidth, l.InnerWidth, l.ClientWidth)
			}
			for _, p := range l.Problems {
				t.Errorf("layout: %s", p)
			}
			if l.Columns != size.columns {
				t.Errorf("%d columns, want %d", l.Columns, size.columns)
			}
			// The long name is whole: in its title, in the text, and inside its box.
			n, ok := l.Rows[long]
			if !ok {
				t.Fatalf("no row for %s", long)
			}
			if n.Title != long || n.Text != long || !n.NameFits || n.NameRight > l.ClientWidth {
				t.Errorf("long name: title %q, text %q, fits %v, right edge %v px", n.Title, n.Text, n.NameFits, n.NameRight)
			}
			if size.width < 700 && n.Lines < 2 {
				t.Errorf("long name on %d line(s) at %d px: it cannot fit on one, so it must wrap", n.Lines, size.width)
			}
			// A compartment with a limit fills its bar in proportion; one without shows no fill.
			if c := l.Rows[batch]; c.Unlimited || c.BarFilled < 0.55 || c.BarFilled > 0.65 {
				t.Errorf("%s (3 of 5): bar %.2f full, unlimited %v", batch, c.BarFilled, c.Unlimited)
			}
			if c := l.Rows[unlimited]; !c.Unlimited || c.BarFilled != 0 || c.Nums != "3 / ∞" || !strings.Contains(c.BarText, "no limit") {
				t.Errorf("%s (3, no limit): bar %.2f full, unlimited %v, text %q, numbers %q", unlimited, c.BarFilled, c.Unlimited, c.BarText, c.Nums)
			}
			if len(l.LegendMiss) > 0 {
				t.Errorf("bars without a visible legend entry: %v (drawn: %v)", l.LegendMiss, l.LegendKinds)
			}
			for _, k := range []string{"concurrency", "unlimited", "tokens_per_minute"} {
				if !strings.Contains(strings.Join(l.LegendKinds, " "), k) {
					t.Errorf("the page draws no %s bar (drawn: %v)", k, l.LegendKinds)
				}
			}
			o := l.Rows[overflow]
			if !o.NoteVisible || !strings.Contains(o.Note, "new tenants") || !strings.Contains(o.Note, "10,000") ||
				!strings.Contains(o.BadgeTitle, "max_instances") || !strings.Contains(o.Title, "default tier") {
				t.Errorf("%s is not explained: note %q (visible %v), badge %q, title %q", overflow, o.Note, o.NoteVisible, o.BadgeTitle, o.Title)
			}
			if len(l.Axis) < 3 || l.Axis[len(l.Axis)-1] != "now" || !strings.HasPrefix(l.Axis[0], "-") || !l.AxisOrdered {
				t.Errorf("time axis %q (in order inside the chart: %v)", l.Axis, l.AxisOrdered)
			}
		})
	}

	// Live: the page follows the server without a reload.
	var admitted string
	b.eval(`document.querySelector('[data-feature="chat"] td:nth-child(2)').textContent`, &admitted)
	for i := 0; i < 2; i++ {
		if r, err := s.Do(ctx, chatRequest("chat")); err != nil || r.Status != 200 {
			t.Fatalf("%v %v", r, err)
		}
	}
	release()
	// And a refusal: qwen forced open refuses a request for it.
	if err := s.App.Engine().ForceBreaker("qwen", "FORCED_OPEN"); err != nil {
		t.Fatal(err)
	}
	forced := chatRequest("chat")
	forced.Headers = append(forced.Headers, envoysim.Header{Key: "x-llm-provider", Value: "qwen"})
	if r, _ := s.Do(ctx, forced); r == nil || r.Status != 503 {
		t.Fatalf("forced-open provider answered %v", r)
	}
	want := fmt.Sprint(mustAtoi(t, admitted) + 2)
	b.waitUntil(15*time.Second, "chat admitted "+want+", nothing in flight and batch at 0 / 5",
		`document.querySelector('[data-feature="chat"] td:nth-child(2)').textContent === `+jsString(want)+
			` && document.getElementById("inflight").textContent === "0"`+
			` && document.querySelector('[data-compartment="`+batch+`"] .held').textContent === "0 / 5"`)
	// The chart draws the refusal (its scale leaves zero) and the breaker shows its state.
	b.waitUntil(15*time.Second, "the refusal on the chart",
		`document.querySelectorAll("#chart polygon").length > 0 && document.getElementById("chart-ymax").textContent !== "max 0.0/s"`+
			` && document.querySelector('[data-breaker="qwen"] .state').textContent === "FORCED_OPEN"`)
	b.screenshot("dashboard-390-after.png")
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	var n int
	if _, err := fmt.Sscan(s, &n); err != nil {
		t.Fatalf("%q is not a number: %v", s, err)
	}
	return n
}
