package mock

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"path"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Request headers that inject faults into one request. Each overrides the
// same field of the merged FaultRules, even when its value is zero, so a test
// can switch a run-wide fault off for a single request.
const (
	HeaderStatus          = "x-mockllm-status"            // respond with this HTTP status and the API's error body
	HeaderRetryAfter      = "x-mockllm-retry-after"       // integer seconds put in the retry-after response header
	HeaderDelayHeaders    = "x-mockllm-delay-headers"     // Go duration ("2s") or seconds ("0.5") before headers, scaled
	HeaderFirstTokenDelay = "x-mockllm-first-token-delay" // Go duration or seconds between the headers and the first token, scaled
	HeaderStreamError     = "x-mockllm-stream-error"      // status (400-599) of an error reported inside a 200 response
	HeaderDisconnectAfter = "x-mockllm-disconnect-after"  // close the connection after this many SSE events
	HeaderNoUsage         = "x-mockllm-no-usage"          // boolean: leave usage out of the response
	HeaderFailRate        = "x-mockllm-fail-rate"         // fraction in [0, 1] of requests that fail
	HeaderGzip            = "x-mockllm-gzip"              // boolean: gzip the body if accept-encoding allows it
	// Integers reported in usage instead of the real counts (see Fault.ReportPrompt); an empty
	// value reports the real count.
	HeaderReportPrompt     = "x-mockllm-report-prompt-tokens"
	HeaderReportCompletion = "x-mockllm-report-completion-tokens"
	HeaderReportTotal      = "x-mockllm-report-total-tokens"
)

// Limits that keep injected faults within what a test can sensibly mean.
const (
	maxRetryAfterSeconds = 24 * 60 * 60
	maxDelay             = time.Hour
)

// Duration is a time.Duration that reads and writes JSON as a Go duration
// string ("2s") and also reads a plain number of seconds, so fault rules can
// be written by hand. It is a plain value and safe for concurrent use.
type Duration time.Duration

// MarshalJSON writes d as a Go duration string.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON reads a Go duration string or a number of seconds.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		var secs json.Number
		if err := json.Unmarshal(b, &secs); err != nil {
			return fmt.Errorf("duration must be a string like \"2s\" or a number of seconds: %s", b)
		}
		s = secs.String()
	}
	v, err := parseDelay(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// parseDelay reads a non-negative Go duration or a decimal number of seconds.
func parseDelay(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	var d time.Duration
	if secs, err := strconv.ParseFloat(s, 64); err == nil {
		if math.IsNaN(secs) || math.IsInf(secs, 0) || secs < 0 || secs > maxDelay.Seconds() {
			return 0, fmt.Errorf("delay %q must lie in [0, %v]", s, maxDelay)
		}
		d = time.Duration(secs * float64(time.Second))
	} else {
		parsed, err := time.ParseDuration(s)
		if err != nil {
			return 0, fmt.Errorf("delay %q is neither a Go duration nor a number of seconds", s)
		}
		d = parsed
	}
	if d < 0 || d > maxDelay {
		return 0, fmt.Errorf("delay %q must lie in [0, %v]", s, maxDelay)
	}
	return d, nil
}

// Count is a token count a fault may set; the zero value sets nothing. In JSON it is a plain
// integer, left out (or null) when not set. It is a plain value and safe for concurrent use.
type Count struct {
	N   int64
	Set bool
}

// Of returns a set Count of n.
func Of(n int64) Count { return Count{N: n, Set: true} }

// MarshalJSON writes the count, or null when it is not set.
func (c Count) MarshalJSON() ([]byte, error) {
	if !c.Set {
		return []byte("null"), nil
	}
	return strconv.AppendInt(nil, c.N, 10), nil
}

// UnmarshalJSON reads an integer; null leaves the count unset.
func (c *Count) UnmarshalJSON(b []byte) error {
	if strings.TrimSpace(string(b)) == "null" {
		*c = Count{}
		return nil
	}
	var n int64
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("token count must be an integer: %s", b)
	}
	*c = Of(n)
	return nil
}

// Fault is a set of misbehaviours injected into one response. The zero value
// injects nothing. It is a plain value and safe for concurrent use.
type Fault struct {
	// Status, when FailRate is zero, makes every request fail with this status
	// (400–599) and an error body in the called API's format. When FailRate is
	// set, it is the status of the requests that fail (zero means 500).
	Status int `json:"status,omitempty"`
	// FailRate is the fraction of requests that fail, drawn from the seeded
	// random generator. Zero means "not a random fault".
	FailRate float64 `json:"fail_rate,omitempty"`
	// RetryAfter, when positive, is sent as the retry-after header (seconds).
	RetryAfter int `json:"retry_after,omitempty"`
	// DelayHeaders is waited (times the time scale) before the response
	// headers, on top of the latency model, while holding a capacity slot.
	DelayHeaders Duration `json:"delay_headers,omitempty"`
	// FirstTokenDelay sends the response headers at once (a stream also its
	// opening events, which carry no text) and holds the first token back
	// this long (times the time scale) on top of the latency model, as a
	// provider that answers 200 before its model has produced anything. A
	// JSON response sends its headers at once and its body after the
	// latency plus this delay.
	FirstTokenDelay Duration `json:"first_token_delay,omitempty"`
	// StreamError, when set, answers 200 and reports an error of this status
	// (400–599) inside the body, in the called API's format: a stream sends
	// it as an error event after its first content event (OpenAI, Azure and
	// Gemini: a chunk with an "error" object, the last element of Gemini's
	// JSON array; Anthropic and the Responses API: an "error" event; Bedrock:
	// an exception message such as throttlingException in the event stream)
	// and ends without usage; a JSON response is the API's error body with
	// status 200 (Bedrock's with x-amzn-errortype, though Bedrock itself never
	// answers so). 429 reports a rate limit, 503 and 529 an overloaded
	// provider, other 5xx a server error.
	StreamError int `json:"stream_error,omitempty"`
	// DisconnectAfter, when positive, closes the connection abruptly after at
	// most this many stream events (SSE events, JSON array elements or
	// event-stream messages) and never sends the final one ([DONE],
	// message_stop, response.completed, Gemini's last chunk and the array's
	// end, Bedrock's metadata). A JSON response is cut after half its body.
	DisconnectAfter int `json:"disconnect_after,omitempty"`
	// NoUsage leaves usage out of the response (and the usage chunk out of a
	// stream), as some OpenAI-compatible providers do.
	NoUsage bool `json:"no_usage,omitempty"`
	// Gzip compresses the response body when the request's accept-encoding
	// allows gzip.
	Gzip bool `json:"gzip,omitempty"`
	// ReportPrompt, ReportCompletion and ReportTotal, when set, replace the
	// counts the response's usage reports, to imitate providers whose usage
	// cannot be trusted: a total below the prompt, counts in the billions,
	// negative counts. The text generated, the latency and the
	// x-mockllm-*-tokens response headers keep the real counts. An unset
	// ReportTotal reports the reported prompt plus completion; Anthropic's
	// usage has no total and ignores it.
	ReportPrompt     Count `json:"report_prompt,omitzero"`
	ReportCompletion Count `json:"report_completion,omitzero"`
	ReportTotal      Count `json:"report_total,omitzero"`
}

// validate reports every out-of-range field of f.
func (f Fault) validate() error {
	var errs []error
	if f.Status != 0 && (f.Status < 400 || f.Status > 599) {
		errs = append(errs, fmt.Errorf("status %d must lie in [400, 599]", f.Status))
	}
	if math.IsNaN(f.FailRate) || f.FailRate < 0 || f.FailRate > 1 {
		errs = append(errs, fmt.Errorf("fail rate %v must lie in [0, 1]", f.FailRate))
	}
	if f.RetryAfter < 0 || f.RetryAfter > maxRetryAfterSeconds {
		errs = append(errs, fmt.Errorf("retry-after %d must lie in [0, %d] seconds", f.RetryAfter, maxRetryAfterSeconds))
	}
	if f.DelayHeaders < 0 || time.Duration(f.DelayHeaders) > maxDelay {
		errs = append(errs, fmt.Errorf("delay %v must lie in [0, %v]", time.Duration(f.DelayHeaders), maxDelay))
	}
	if f.FirstTokenDelay < 0 || time.Duration(f.FirstTokenDelay) > maxDelay {
		errs = append(errs, fmt.Errorf("first-token delay %v must lie in [0, %v]", time.Duration(f.FirstTokenDelay), maxDelay))
	}
	if f.StreamError != 0 && (f.StreamError < 400 || f.StreamError > 599) {
		errs = append(errs, fmt.Errorf("stream error status %d must lie in [400, 599]", f.StreamError))
	}
	if f.DisconnectAfter < 0 {
		errs = append(errs, fmt.Errorf("disconnect-after %d must not be negative", f.DisconnectAfter))
	}
	return errors.Join(errs...)
}

// overlay returns f with every non-zero field of g copied over it.
func (f Fault) overlay(g Fault) Fault {
	if g.Status != 0 {
		f.Status = g.Status
	}
	if g.FailRate != 0 {
		f.FailRate = g.FailRate
	}
	if g.RetryAfter != 0 {
		f.RetryAfter = g.RetryAfter
	}
	if g.DelayHeaders != 0 {
		f.DelayHeaders = g.DelayHeaders
	}
	if g.DisconnectAfter != 0 {
		f.DisconnectAfter = g.DisconnectAfter
	}
	if g.FirstTokenDelay != 0 {
		f.FirstTokenDelay = g.FirstTokenDelay
	}
	if g.StreamError != 0 {
		f.StreamError = g.StreamError
	}
	f.NoUsage = f.NoUsage || g.NoUsage
	f.Gzip = f.Gzip || g.Gzip
	for _, c := range []struct{ dst, src *Count }{
		{&f.ReportPrompt, &g.ReportPrompt}, {&f.ReportCompletion, &g.ReportCompletion}, {&f.ReportTotal, &g.ReportTotal},
	} {
		if c.src.Set {
			*c.dst = *c.src
		}
	}
	return f
}

// report returns what the usage object of a response with real usage u
// says under f.
func (f Fault) report(u usage) reportedUsage {
	r := reportedUsage{Prompt: u.Prompt, Completion: u.Completion, Cached: u.Cached, Reasoning: u.Reasoning}
	if f.ReportPrompt.Set {
		r.Prompt = f.ReportPrompt.N
	}
	if f.ReportCompletion.Set {
		r.Completion = f.ReportCompletion.N
	}
	r.Total = saturatingAdd(r.Prompt, r.Completion)
	if f.ReportTotal.Set {
		r.Total = f.ReportTotal.N
	}
	return r
}

// saturatingAdd is a + b, held at the int64 limits instead of wrapping, so
// two absurd counts add up to an absurd total rather than a negative one.
func saturatingAdd(a, b int64) int64 {
	s := a + b
	switch {
	case a > 0 && b > 0 && s < 0:
		return math.MaxInt64
	case a < 0 && b < 0 && s >= 0:
		return math.MinInt64
	}
	return s
}

// failStatus returns the status this request fails with, or 0 when it
// succeeds. roll is a uniform draw from [0, 1), taken for every request
// whether or not a rate is configured so the random sequence stays stable.
func (f Fault) failStatus(roll float64) int {
	if f.FailRate == 0 {
		return f.Status
	}
	if roll >= f.FailRate {
		return 0
	}
	if f.Status == 0 {
		return http.StatusInternalServerError
	}
	return f.Status
}

// FaultRule applies a Fault to the requests it matches. It is a plain value
// and safe for concurrent use.
type FaultRule struct {
	// Provider matches the x-llm-provider request header exactly. Empty
	// matches every request.
	Provider string `json:"provider,omitempty"`
	// Model is a path.Match glob ("gpt-4*") over the request body's model.
	// Empty matches every request.
	Model string `json:"model,omitempty"`
	Fault
}

// matches reports whether r applies to a request for provider and model.
func (r FaultRule) matches(provider, model string) bool {
	if r.Provider != "" && r.Provider != provider {
		return false
	}
	if r.Model == "" {
		return true
	}
	ok, err := path.Match(r.Model, model)
	return err == nil && ok
}

// validateRules reports every problem of every rule, each prefixed with the
// rule's position.
func validateRules(rules []FaultRule) error {
	var errs []error
	for i, r := range rules {
		// Models and providers arrive as JSON strings and header values, which
		// are valid UTF-8; a rule that is not could never match.
		if !utf8.ValidString(r.Provider) || !utf8.ValidString(r.Model) {
			errs = append(errs, fmt.Errorf("fault rule %d: provider and model must be valid UTF-8", i))
		}
		if r.Model != "" {
			if _, err := path.Match(r.Model, ""); err != nil {
				errs = append(errs, fmt.Errorf("fault rule %d: model glob %q: %w", i, r.Model, err))
			}
		}
		if err := r.validate(); err != nil {
			errs = append(errs, fmt.Errorf("fault rule %d: %w", i, err))
		}
	}
	return errors.Join(errs...)
}

// mergeRules overlays, in order, the faults of every rule matching provider
// and model, so later rules refine earlier ones.
func mergeRules(rules []FaultRule, provider, model string) Fault {
	var f Fault
	for _, r := range rules {
		if r.matches(provider, model) {
			f = f.overlay(r.Fault)
		}
	}
	return f
}

// faultRuleKeys are the keys ParseFaultRule understands, for its error text.
var faultRuleKeys = []string{"provider", "model", "status", "rate", "retry-after", "delay-headers", "first-token-delay", "stream-error",
	"disconnect-after", "no-usage", "gzip",
	"report-prompt", "report-completion", "report-total"}

// ParseFaultRule reads a rule written as comma-separated key=value pairs, the
// syntax of the -fail flag: provider, model (glob), status, rate (alias
// fail-rate), retry-after (seconds), delay-headers (alias delay; Go duration
// or seconds), first-token-delay (Go duration or seconds), stream-error (the
// status of an error reported inside a 200 response), disconnect-after
// (events), no-usage and gzip (booleans), and
// report-prompt, report-completion and report-total (integers reported in
// usage instead of the real counts). For example
// "provider=deepseek,rate=0.6,status=503". A key given twice, an
// unknown key or a value out of range is an error.
func ParseFaultRule(spec string) (FaultRule, error) {
	var r FaultRule
	if strings.TrimSpace(spec) == "" {
		return r, errors.New("empty fault rule")
	}
	seen := map[string]bool{}
	for part := range strings.SplitSeq(spec, ",") {
		key, value, ok := strings.Cut(part, "=")
		key = strings.ToLower(strings.TrimSpace(key))
		value = strings.TrimSpace(value)
		if !ok || key == "" {
			return r, fmt.Errorf("fault rule part %q is not key=value", part)
		}
		switch key {
		case "fail-rate":
			key = "rate"
		case "delay":
			key = "delay-headers"
		}
		if seen[key] {
			return r, fmt.Errorf("fault rule key %q given twice", key)
		}
		seen[key] = true
		var err error
		switch key {
		case "provider":
			r.Provider = value
		case "model":
			r.Model = value
		case "status":
			r.Status, err = strconv.Atoi(value)
		case "rate":
			r.FailRate, err = strconv.ParseFloat(value, 64)
		case "retry-after":
			r.RetryAfter, err = strconv.Atoi(value)
		case "delay-headers":
			var d time.Duration
			d, err = parseDelay(value)
			r.DelayHeaders = Duration(d)
		case "first-token-delay":
			var d time.Duration
			d, err = parseDelay(value)
			r.FirstTokenDelay = Duration(d)
		case "stream-error":
			r.StreamError, err = strconv.Atoi(value)
		case "disconnect-after":
			r.DisconnectAfter, err = strconv.Atoi(value)
		case "no-usage":
			r.NoUsage, err = strconv.ParseBool(value)
		case "gzip":
			r.Gzip, err = strconv.ParseBool(value)
		case "report-prompt":
			r.ReportPrompt, err = parseCount(value)
		case "report-completion":
			r.ReportCompletion, err = parseCount(value)
		case "report-total":
			r.ReportTotal, err = parseCount(value)
		default:
			return r, fmt.Errorf("unknown fault rule key %q (known: %s)", key, strings.Join(faultRuleKeys, ", "))
		}
		if err != nil {
			return r, fmt.Errorf("fault rule key %q: %w", key, err)
		}
	}
	if err := validateRules([]FaultRule{r}); err != nil {
		return r, err
	}
	return r, nil
}

// applyFaultHeaders overrides the fields of f whose fault header is present
// in h. A malformed header is an error naming the header, so a test that
// mistypes a value fails loudly instead of silently running without the fault.
func applyFaultHeaders(f Fault, h http.Header) (Fault, error) {
	var errs []error
	fail := func(name, v string, err error) {
		errs = append(errs, fmt.Errorf("header %s: %q: %w", name, v, err))
	}
	if v, ok := headerValue(h, HeaderStatus); ok {
		n, err := strconv.Atoi(v)
		switch {
		case err != nil:
			fail(HeaderStatus, v, err)
		case n != 0 && (n < 400 || n > 599):
			fail(HeaderStatus, v, errors.New("must be 0 or lie in [400, 599]"))
		default:
			f.Status = n
		}
	}
	if v, ok := headerValue(h, HeaderRetryAfter); ok {
		n, err := strconv.Atoi(v)
		switch {
		case err != nil:
			fail(HeaderRetryAfter, v, err)
		case n < 0 || n > maxRetryAfterSeconds:
			fail(HeaderRetryAfter, v, fmt.Errorf("must lie in [0, %d]", maxRetryAfterSeconds))
		default:
			f.RetryAfter = n
		}
	}
	if v, ok := headerValue(h, HeaderDelayHeaders); ok {
		d, err := parseDelay(v)
		if err != nil {
			fail(HeaderDelayHeaders, v, err)
		} else {
			f.DelayHeaders = Duration(d)
		}
	}
	if v, ok := headerValue(h, HeaderFirstTokenDelay); ok {
		d, err := parseDelay(v)
		if err != nil {
			fail(HeaderFirstTokenDelay, v, err)
		} else {
			f.FirstTokenDelay = Duration(d)
		}
	}
	if v, ok := headerValue(h, HeaderStreamError); ok {
		n, err := strconv.Atoi(v)
		switch {
		case err != nil:
			fail(HeaderStreamError, v, err)
		case n != 0 && (n < 400 || n > 599):
			fail(HeaderStreamError, v, errors.New("must be 0 or lie in [400, 599]"))
		default:
			f.StreamError = n
		}
	}
	if v, ok := headerValue(h, HeaderDisconnectAfter); ok {
		n, err := strconv.Atoi(v)
		switch {
		case err != nil:
			fail(HeaderDisconnectAfter, v, err)
		case n < 0:
			fail(HeaderDisconnectAfter, v, errors.New("must not be negative"))
		default:
			f.DisconnectAfter = n
		}
	}
	if v, ok := headerValue(h, HeaderNoUsage); ok {
		b, err := strconv.ParseBool(v)
		if err != nil {
			fail(HeaderNoUsage, v, err)
		} else {
			f.NoUsage = b
		}
	}
	if v, ok := headerValue(h, HeaderFailRate); ok {
		x, err := strconv.ParseFloat(v, 64)
		switch {
		case err != nil:
			fail(HeaderFailRate, v, err)
		case math.IsNaN(x) || x < 0 || x > 1:
			fail(HeaderFailRate, v, errors.New("must lie in [0, 1]"))
		default:
			f.FailRate = x
		}
	}
	if v, ok := headerValue(h, HeaderGzip); ok {
		b, err := strconv.ParseBool(v)
		if err != nil {
			fail(HeaderGzip, v, err)
		} else {
			f.Gzip = b
		}
	}
	for _, c := range []struct {
		name string
		dst  *Count
	}{{HeaderReportPrompt, &f.ReportPrompt}, {HeaderReportCompletion, &f.ReportCompletion}, {HeaderReportTotal, &f.ReportTotal}} {
		v, ok := headerValue(h, c.name)
		switch {
		case !ok:
		case v == "":
			*c.dst = Count{}
		default:
			n, err := parseCount(v)
			if err != nil {
				fail(c.name, v, err)
			} else {
				*c.dst = n
			}
		}
	}
	return f, errors.Join(errs...)
}

// parseCount reads a reported token count: any integer, negative ones
// included, since imitating a provider that reports nonsense is the point.
func parseCount(s string) (Count, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return Count{}, err
	}
	return Of(n), nil
}

// headerValue returns the trimmed first value of header name and whether it
// was sent at all.
func headerValue(h http.Header, name string) (string, bool) {
	vs := h.Values(name)
	if len(vs) == 0 {
		return "", false
	}
	return strings.TrimSpace(vs[0]), true
}

// acceptsGzip reports whether accept-encoding values allow a gzip body: gzip
// or * listed with a q-value above zero. An explicit gzip entry wins over *.
func acceptsGzip(values []string) bool {
	star := false
	for _, v := range values {
		for item := range strings.SplitSeq(v, ",") {
			name, params, _ := strings.Cut(item, ";")
			name = strings.ToLower(strings.TrimSpace(name))
			if name != "gzip" && name != "x-gzip" && name != "*" {
				continue
			}
			allowed := qAllows(params)
			if name == "*" {
				star = allowed
				continue
			}
			return allowed
		}
	}
	return star
}

// qAllows reports whether an accept-encoding item's parameters leave it
// acceptable, i.e. carry no q-value of zero. An unreadable q-value counts as
// a refusal, as RFC 9110 asks for a conservative reading.
func qAllows(params string) bool {
	for p := range strings.SplitSeq(params, ";") {
		k, v, ok := strings.Cut(p, "=")
		if !ok || !strings.EqualFold(strings.TrimSpace(k), "q") {
			continue
		}
		q, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		return err == nil && q > 0 && q <= 1
	}
	return true
}

// cloneRules returns a copy of rules that the caller may keep; never nil, so
// an empty rule set prints as [] rather than null.
func cloneRules(rules []FaultRule) []FaultRule {
	return append(make([]FaultRule, 0, len(rules)), rules...)
}
