package mock

import (
	"encoding/json"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestParseFaultRule(t *testing.T) {
	tests := []struct {
		name    string
		spec    string
		want    FaultRule
		wantErr string
	}{
		{
			name: "provider fail rate",
			spec: "provider=deepseek,rate=0.6,status=503",
			want: FaultRule{Provider: "deepseek", Fault: Fault{Status: 503, FailRate: 0.6}},
		},
		{
			name: "every key with aliases and spaces",
			spec: " model = gpt-4* , fail-rate=0.1, retry-after=7,delay=1.5,disconnect-after=3,no-usage=true,gzip=1,status=429",
			want: FaultRule{Model: "gpt-4*", Fault: Fault{Status: 429, FailRate: 0.1, RetryAfter: 7, DelayHeaders: Duration(1500 * time.Millisecond), DisconnectAfter: 3, NoUsage: true, Gzip: true}},
		},
		{
			name: "reported usage, negative and absurd counts included",
			spec: "report-prompt=-5,report-completion=9000000000000000000,report-total=0",
			want: FaultRule{Fault: Fault{ReportPrompt: Of(-5), ReportCompletion: Of(9e18), ReportTotal: Of(0)}},
		},
		{name: "reported count not an integer", spec: "report-total=1.5", wantErr: "report-total"},
		{
			name: "go duration delay",
			spec: "delay-headers=250ms",
			want: FaultRule{Fault: Fault{DelayHeaders: Duration(250 * time.Millisecond)}},
		},
		{
			name: "first-token delay and stream error",
			spec: "provider=slow,first-token-delay=20s,stream-error=529",
			want: FaultRule{Provider: "slow", Fault: Fault{FirstTokenDelay: Duration(20 * time.Second), StreamError: 529}},
		},
		{name: "stream error out of range", spec: "stream-error=200", wantErr: "stream error status"},
		{name: "first-token delay negative", spec: "first-token-delay=-1s", wantErr: "first-token-delay"},
		{name: "empty", spec: " ", wantErr: "empty"},
		{name: "not key value", spec: "provider", wantErr: "key=value"},
		{name: "unknown key", spec: "colour=red", wantErr: "unknown fault rule key"},
		{name: "key twice through alias", spec: "rate=0.1,fail-rate=0.2", wantErr: "twice"},
		{name: "status not a number", spec: "status=five", wantErr: "status"},
		{name: "status out of range", spec: "status=200", wantErr: "[400, 599]"},
		{name: "rate above one", spec: "rate=1.5", wantErr: "fail rate"},
		{name: "negative delay", spec: "delay=-1s", wantErr: "delay"},
		{name: "bad glob", spec: "model=[", wantErr: "glob"},
		{name: "bad bool", spec: "gzip=maybe", wantErr: "gzip"},
		{name: "negative disconnect", spec: "disconnect-after=-2", wantErr: "disconnect-after"},
		// Found by FuzzParseFaultRule: such a rule could never match and did
		// not survive the JSON round trip of GET /mockllm/faults.
		{name: "model not UTF-8", spec: "model=\xff", wantErr: "UTF-8"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseFaultRule(tt.spec)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("ParseFaultRule(%q) error = %v, want one containing %q", tt.spec, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseFaultRule(%q): %v", tt.spec, err)
			}
			if got != tt.want {
				t.Fatalf("ParseFaultRule(%q) = %+v, want %+v", tt.spec, got, tt.want)
			}
		})
	}
}

func TestFaultRuleJSON(t *testing.T) {
	tests := []struct {
		name    string
		json    string
		want    FaultRule
		wantErr bool
	}{
		{name: "duration string", json: `{"provider":"p","status":503,"delay_headers":"2s"}`, want: FaultRule{Provider: "p", Fault: Fault{Status: 503, DelayHeaders: Duration(2 * time.Second)}}},
		{name: "duration seconds", json: `{"delay_headers":0.25}`, want: FaultRule{Fault: Fault{DelayHeaders: Duration(250 * time.Millisecond)}}},
		{name: "reported counts", json: `{"report_prompt":0,"report_total":-3,"report_completion":null}`, want: FaultRule{Fault: Fault{ReportPrompt: Of(0), ReportTotal: Of(-3)}}},
		{name: "reported count garbage", json: `{"report_prompt":"many"}`, wantErr: true},
		{name: "duration garbage", json: `{"delay_headers":true}`, wantErr: true},
		{name: "duration negative", json: `{"delay_headers":"-1s"}`, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got FaultRule
			err := json.Unmarshal([]byte(tt.json), &got)
			if (err != nil) != tt.wantErr {
				t.Fatalf("Unmarshal error = %v, want error %v", err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			if got != tt.want {
				t.Fatalf("Unmarshal = %+v, want %+v", got, tt.want)
			}
			// Round trip: what GET /mockllm/faults prints can be POSTed back.
			b, err := json.Marshal(got)
			if err != nil {
				t.Fatal(err)
			}
			var again FaultRule
			if err := json.Unmarshal(b, &again); err != nil || again != got {
				t.Fatalf("round trip of %s = %+v, %v; want %+v", b, again, err, got)
			}
		})
	}
}

func TestApplyFaultHeaders(t *testing.T) {
	base := Fault{Status: 503, NoUsage: true, DisconnectAfter: 4}
	tests := []struct {
		name    string
		headers map[string]string
		want    Fault
		wantErr string
	}{
		{name: "no headers keep the rules", want: base},
		{
			name:    "headers override, zero included",
			headers: map[string]string{HeaderStatus: "0", HeaderNoUsage: "false", HeaderDisconnectAfter: "0", HeaderRetryAfter: "7", HeaderDelayHeaders: "2s", HeaderFailRate: "0.25", HeaderGzip: "1"},
			want:    Fault{RetryAfter: 7, DelayHeaders: Duration(2 * time.Second), FailRate: 0.25, Gzip: true},
		},
		{name: "delay in seconds", headers: map[string]string{HeaderDelayHeaders: "0.5"}, want: Fault{Status: 503, NoUsage: true, DisconnectAfter: 4, DelayHeaders: Duration(500 * time.Millisecond)}},
		{
			name:    "first-token delay and stream error",
			headers: map[string]string{HeaderFirstTokenDelay: "1.5", HeaderStreamError: "429"},
			want:    Fault{Status: 503, NoUsage: true, DisconnectAfter: 4, FirstTokenDelay: Duration(1500 * time.Millisecond), StreamError: 429},
		},
		{name: "stream error out of range", headers: map[string]string{HeaderStreamError: "600"}, wantErr: HeaderStreamError},
		{name: "first-token delay not a duration", headers: map[string]string{HeaderFirstTokenDelay: "soon"}, wantErr: HeaderFirstTokenDelay},
		{name: "status out of range", headers: map[string]string{HeaderStatus: "302"}, wantErr: HeaderStatus},
		{name: "fail rate NaN", headers: map[string]string{HeaderFailRate: "NaN"}, wantErr: HeaderFailRate},
		{name: "retry-after negative", headers: map[string]string{HeaderRetryAfter: "-1"}, wantErr: HeaderRetryAfter},
		{name: "delay garbage", headers: map[string]string{HeaderDelayHeaders: "soon"}, wantErr: HeaderDelayHeaders},
		{name: "delay too long", headers: map[string]string{HeaderDelayHeaders: "2h"}, wantErr: HeaderDelayHeaders},
		{name: "disconnect garbage", headers: map[string]string{HeaderDisconnectAfter: "x"}, wantErr: HeaderDisconnectAfter},
		{name: "bool garbage", headers: map[string]string{HeaderNoUsage: "perhaps"}, wantErr: HeaderNoUsage},
		{name: "gzip garbage", headers: map[string]string{HeaderGzip: "yes please"}, wantErr: HeaderGzip},
		{
			name:    "reported usage",
			headers: map[string]string{HeaderReportPrompt: "100", HeaderReportTotal: "-1"},
			want:    Fault{Status: 503, NoUsage: true, DisconnectAfter: 4, ReportPrompt: Of(100), ReportTotal: Of(-1)},
		},
		{name: "reported count garbage", headers: map[string]string{HeaderReportCompletion: "lots"}, wantErr: HeaderReportCompletion},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			for k, v := range tt.headers {
				h.Set(k, v)
			}
			got, err := applyFaultHeaders(base, h)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("applyFaultHeaders error = %v, want one naming %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("applyFaultHeaders: %v", err)
			}
			if got != tt.want {
				t.Fatalf("applyFaultHeaders = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestMergeRules(t *testing.T) {
	rules := []FaultRule{
		{Fault: Fault{RetryAfter: 1}},
		{Provider: "deepseek", Fault: Fault{Status: 503, FailRate: 0.6}},
		{Model: "gpt-4*", Fault: Fault{NoUsage: true, RetryAfter: 9}},
	}
	tests := []struct {
		name     string
		provider string
		model    string
		want     Fault
	}{
		{name: "only the catch-all", provider: "openai", model: "claude", want: Fault{RetryAfter: 1}},
		{name: "provider rule", provider: "deepseek", model: "deepseek-chat", want: Fault{RetryAfter: 1, Status: 503, FailRate: 0.6}},
		{name: "model glob refines", provider: "openai", model: "gpt-4o", want: Fault{RetryAfter: 9, NoUsage: true}},
		{name: "all three in order", provider: "deepseek", model: "gpt-4.1", want: Fault{RetryAfter: 9, Status: 503, FailRate: 0.6, NoUsage: true}},
		{name: "glob does not cross slashes", provider: "", model: "gpt-4/x", want: Fault{RetryAfter: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := mergeRules(rules, tt.provider, tt.model); got != tt.want {
				t.Fatalf("mergeRules = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// TestReportedUsageFault: report counts replace the reported ones, later rules refine earlier
// ones, an empty header switches a rule's count off for one request, and the total follows the
// reported parts unless set, without wrapping around.
func TestReportedUsageFault(t *testing.T) {
	real := usage{Prompt: 10, Completion: 20, Cached: 4, Reasoning: 2}
	rules := []FaultRule{{Fault: Fault{ReportPrompt: Of(1), ReportTotal: Of(3)}}, {Model: "big*", Fault: Fault{ReportPrompt: Of(7)}}}
	tests := []struct {
		name    string
		model   string
		headers map[string]string
		want    reportedUsage
	}{
		{name: "rules", model: "small", want: reportedUsage{Prompt: 1, Completion: 20, Total: 3, Cached: 4, Reasoning: 2}},
		{name: "a later rule refines", model: "big-1", want: reportedUsage{Prompt: 7, Completion: 20, Total: 3, Cached: 4, Reasoning: 2}},
		{name: "empty header reports the real count", model: "small", headers: map[string]string{HeaderReportTotal: "", HeaderReportPrompt: ""},
			want: reportedUsage{Prompt: 10, Completion: 20, Total: 30, Cached: 4, Reasoning: 2}},
		{name: "absurd parts saturate the total", model: "small",
			headers: map[string]string{HeaderReportPrompt: "9000000000000000000", HeaderReportCompletion: "9000000000000000000", HeaderReportTotal: ""},
			want:    reportedUsage{Prompt: 9e18, Completion: 9e18, Total: math.MaxInt64, Cached: 4, Reasoning: 2}},
		{name: "negative parts saturate too", model: "small",
			headers: map[string]string{HeaderReportPrompt: "-9000000000000000000", HeaderReportCompletion: "-9000000000000000000", HeaderReportTotal: ""},
			want:    reportedUsage{Prompt: -9e18, Completion: -9e18, Total: math.MinInt64, Cached: 4, Reasoning: 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			for k, v := range tt.headers {
				h.Set(k, v)
			}
			f, err := applyFaultHeaders(mergeRules(rules, "", tt.model), h)
			if err != nil {
				t.Fatal(err)
			}
			if got := f.report(real); got != tt.want {
				t.Fatalf("report = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestFailStatus(t *testing.T) {
	tests := []struct {
		name  string
		fault Fault
		roll  float64
		want  int
	}{
		{name: "no fault", fault: Fault{}, roll: 0, want: 0},
		{name: "fixed status", fault: Fault{Status: 429}, roll: 0.99, want: 429},
		{name: "rate hit defaults to 500", fault: Fault{FailRate: 0.6}, roll: 0.59, want: 500},
		{name: "rate miss", fault: Fault{FailRate: 0.6}, roll: 0.6, want: 0},
		{name: "rate hit with status", fault: Fault{FailRate: 0.6, Status: 503}, roll: 0.1, want: 503},
		{name: "rate miss with status", fault: Fault{FailRate: 0.6, Status: 503}, roll: 0.7, want: 0},
		{name: "rate one always fails", fault: Fault{FailRate: 1}, roll: 0.999999, want: 500},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.fault.failStatus(tt.roll); got != tt.want {
				t.Fatalf("failStatus(%v) = %d, want %d", tt.roll, got, tt.want)
			}
		})
	}
}

func TestAcceptsGzip(t *testing.T) {
	tests := []struct {
		name   string
		values []string
		want   bool
	}{
		{name: "absent", values: nil, want: false},
		{name: "gzip", values: []string{"gzip"}, want: true},
		{name: "list", values: []string{"br, gzip;q=0.5"}, want: true},
		{name: "upper case", values: []string{"GZIP"}, want: true},
		{name: "x-gzip", values: []string{"x-gzip"}, want: true},
		{name: "refused", values: []string{"gzip;q=0"}, want: false},
		{name: "refused with spaces", values: []string{"gzip; q=0.0"}, want: false},
		{name: "star", values: []string{"*"}, want: true},
		{name: "explicit gzip refusal beats star", values: []string{"*, gzip;q=0"}, want: false},
		{name: "star refused", values: []string{"*;q=0"}, want: false},
		{name: "identity only", values: []string{"identity"}, want: false},
		{name: "bad q", values: []string{"gzip;q=lots"}, want: false},
		{name: "second header line", values: []string{"br", "gzip"}, want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := acceptsGzip(tt.values); got != tt.want {
				t.Fatalf("acceptsGzip(%q) = %v, want %v", tt.values, got, tt.want)
			}
		})
	}
}

func FuzzParseFaultRule(f *testing.F) {
	for _, s := range []string{
		"provider=deepseek,rate=0.6,status=503",
		"model=gpt-4*,no-usage=1,gzip=true",
		"delay=2s,retry-after=7,disconnect-after=3",
		"status=,=,",
		"model=[",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		r, err := ParseFaultRule(spec)
		if err != nil {
			return
		}
		if err := validateRules([]FaultRule{r}); err != nil {
			t.Fatalf("ParseFaultRule(%q) accepted an invalid rule: %v", spec, err)
		}
		b, err := json.Marshal(r)
		if err != nil {
			t.Fatalf("marshal %+v: %v", r, err)
		}
		var again FaultRule
		if err := json.Unmarshal(b, &again); err != nil {
			t.Fatalf("a parsed rule does not survive JSON: %s: %v", b, err)
		}
		if again != r {
			t.Fatalf("JSON round trip changed %+v into %+v", r, again)
		}
	})
}

func FuzzApplyFaultHeaders(f *testing.F) {
	f.Add("503", "7", "2s", "3", "1", "0.5", "true")
	f.Add("", "", "", "", "", "", "")
	f.Add("999", "-1", "1e308", "-3", "x", "NaN", "2")
	f.Fuzz(func(t *testing.T, status, retry, delay, disconnect, noUsage, rate, gz string) {
		h := http.Header{}
		for name, v := range map[string]string{
			HeaderStatus: status, HeaderRetryAfter: retry, HeaderDelayHeaders: delay,
			HeaderDisconnectAfter: disconnect, HeaderNoUsage: noUsage, HeaderFailRate: rate, HeaderGzip: gz,
		} {
			if v != "" {
				h.Set(name, v)
			}
		}
		got, err := applyFaultHeaders(Fault{}, h)
		if err != nil {
			return
		}
		if err := got.validate(); err != nil {
			t.Fatalf("headers %v produced an invalid fault %+v: %v", h, got, err)
		}
	})
}

func FuzzAcceptsGzip(f *testing.F) {
	for _, s := range []string{"gzip", "gzip;q=0", "*, gzip;q=0", "br;q=1, *;q=0.1", ";;,=,q="} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		got := acceptsGzip([]string{v})
		// Adding an explicit refusal at the end never turns a "no" into a "yes".
		if !got && acceptsGzip([]string{v + ", gzip;q=0"}) {
			t.Fatalf("refusing gzip after %q made it acceptable", v)
		}
	})
}
