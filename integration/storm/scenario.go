package storm

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
)

// Feature names the scenario sends in x-llm-feature; they match the example policies.
const (
	FeatureChat  = "chat"
	FeatureBatch = "batch_summarize"
)

// Request headers the scenario sets.
const (
	headerFeature = "x-llm-feature"
	headerTenant  = "x-tenant-id"
)

// TenantShare gives Users of the chat users to one tenant.
type TenantShare struct {
	Tenant string `json:"tenant"`
	Users  int    `json:"users"`
}

// Tokens sizes one request: Prompt tokens of text (Prompt×4 bytes, the estimate's and mockllm's
// bytes-per-token) and Completion tokens asked for with max_tokens, which mockllm generates.
type Tokens struct {
	Prompt     int `json:"prompt"`
	Completion int `json:"completion"`
}

// Total is the request's size in mockllm's latency model.
func (t Tokens) Total() int { return t.Prompt + t.Completion }

// Scenario is the traffic of one run, in simulated time. DefaultScenario returns the
// batch-export storm; a Scenario is a plain value.
type Scenario struct {
	// Duration is how long chat users keep sending and the batch job keeps retrying. It must be
	// shorter than a minute (see the package documentation on budgets).
	Duration time.Duration `json:"duration"`
	// Chat lists the chat users per tenant.
	Chat []TenantShare `json:"chat"`
	// ChatTokens sizes every chat request.
	ChatTokens Tokens `json:"chat_tokens"`
	// ThinkMin and ThinkMax bound a chat user's uniform pause between the end of one request and
	// the start of the next. A user's first request comes after a uniform pause in [0, ThinkMax).
	ThinkMin time.Duration `json:"think_min"`
	ThinkMax time.Duration `json:"think_max"`
	// ChatTimeout is how long a chat user waits for an answer; a request that fails in any way
	// (timeout, refusal, error) counts at this latency in the chat percentiles: a user who got
	// no answer waited at least that long.
	ChatTimeout time.Duration `json:"chat_timeout"`
	// Storm turns the batch job on; StormAt is when it starts.
	Storm   bool          `json:"storm"`
	StormAt time.Duration `json:"storm_at"`
	// BatchWorkers workers each summarise BatchPerWorker documents, one request per document,
	// for tenant BatchTenant.
	BatchWorkers   int    `json:"batch_workers"`
	BatchPerWorker int    `json:"batch_per_worker"`
	BatchTenant    string `json:"batch_tenant"`
	// BatchWorkerConcurrency is how many of its documents a worker has in flight at once: equal
	// to BatchPerWorker, every document is sent at once (50 concurrent requests by default, close
	// to the incident's 60); 1 makes each worker sequential (at most BatchWorkers in flight).
	BatchWorkerConcurrency int `json:"batch_worker_concurrency"`
	// BatchSteady makes the batch job a steady load instead of a burst: from StormAt until
	// Duration each of the BatchWorkers workers sends one document after another (a refused one
	// again after its retry-after), so that BatchWorkers requests want service at all times. The
	// workers start evenly spread over the first second. BatchPerWorker and
	// BatchWorkerConcurrency are not used.
	BatchSteady bool `json:"batch_steady,omitempty"`
	// BatchTokens sizes every batch request.
	BatchTokens Tokens `json:"batch_tokens"`
	// BatchRetry makes the batch job honour refusals: it waits the retry-after it was given and
	// sends the document again, until Duration. Without it a refused document is dropped.
	BatchRetry bool `json:"batch_retry"`
	// Model is the model of every request; the example policies map it to a provider.
	Model string `json:"model"`
	// Stream asks for streamed answers (SSE), as chat clients do; a request's latency is still
	// the time to its last byte.
	Stream bool `json:"stream,omitempty"`
	// ChunkTokens is how many completion tokens each streamed event carries (mockllm's
	// ChunkTokens; 0 means 1, as the real APIs do).
	ChunkTokens int `json:"chunk_tokens,omitempty"`
	// Brownout, when not empty, is the upstream's capacity during a run of a configuration with
	// Brownout set: a mockllm capacity schedule started when the run starts. Configurations
	// without it run at the schedule's first capacity throughout, and Options.Capacity is not
	// used.
	Brownout mock.CapacitySchedule `json:"brownout,omitempty"`
	// QuotaProvider, when not empty, is the provider whose account has ProviderQuota during a
	// run of a configuration with ProviderQuota set: mockllm refuses with 429 what the quota
	// cannot cover and says what is left in the API's rate-limit headers. Its Window is
	// simulated time.
	QuotaProvider string            `json:"quota_provider,omitempty"`
	ProviderQuota mock.RequestQuota `json:"-"`
}

// QuotaScenario returns the provider quota: the brownout's chat users (30, streamed 2K-token
// requests, 4–12 s pauses) and a steady batch load of 8 sequential workers sending streamed
// 5K-token documents, for 40 s, on deepseek, whose account allows 120 requests and 300 000
// tokens a 20-second window, counted from the window's first request: the load (≈ 30 000
// tokens a second) uses the tokens up about 10 s into each window, and the window that starts
// at 20 s has them all again.
func QuotaScenario() Scenario {
	sc := BrownoutScenario()
	sc.Brownout = nil
	sc.BatchWorkers = 8
	sc.QuotaProvider = "deepseek"
	sc.ProviderQuota = mock.RequestQuota{Limit: 120, Tokens: 300_000, Window: 20 * time.Second}
	return sc
}

// QuotaString writes the scenario's provider quota as "240 requests and 600000 tokens per 20s".
func (s Scenario) QuotaString() string {
	q := s.ProviderQuota
	var parts []string
	if q.Limit > 0 {
		parts = append(parts, fmt.Sprintf("%d requests", q.Limit))
	}
	if q.Tokens > 0 {
		parts = append(parts, fmt.Sprintf("%d tokens", q.Tokens))
	}
	return strings.Join(parts, " and ") + " per " + q.Window.String()
}

// BrownoutScenario returns the provider brownout: 30 chat users (22 of acme, 8 of globex)
// sending streamed 2K-token requests with 4–12 s pauses, and a steady batch load of 12
// sequential workers sending streamed 5K-token documents, for 40 s, all on one provider whose
// capacity is 10 until 10 s, 4 until 25 s and 10 again after.
func BrownoutScenario() Scenario {
	return Scenario{
		Duration:    40 * time.Second,
		Chat:        []TenantShare{{Tenant: "acme", Users: 22}, {Tenant: "globex", Users: 8}},
		ChatTokens:  Tokens{Prompt: 1500, Completion: 500},
		ThinkMin:    4 * time.Second,
		ThinkMax:    12 * time.Second,
		ChatTimeout: 30 * time.Second,
		Storm:       true,
		StormAt:     0,
		BatchSteady: true,
		// Twelve workers want more than the healthy capacity of 10, so a limit of 10 is always
		// used in full and a lower one shows as lost throughput.
		BatchWorkers:           12,
		BatchPerWorker:         1,
		BatchWorkerConcurrency: 1,
		BatchTenant:            "acme",
		BatchTokens:            Tokens{Prompt: 4000, Completion: 1000},
		BatchRetry:             true,
		Model:                  "deepseek-chat",
		Stream:                 true,
		// Twenty tokens an event keep the proxy's work per stream (one message per event) small
		// enough for a time-scaled run on two cores, and the gap between events (≈ 14 ms for a
		// chat answer, 12 ms for a document) well above the clock's and the scheduler's noise.
		ChunkTokens: 20,
		Brownout:    mock.CapacitySchedule{{At: 0, Capacity: 10}, {At: 10 * time.Second, Capacity: 4}, {At: 25 * time.Second, Capacity: 10}},
	}
}

// DefaultScenario returns the batch-export storm: 30 chat users (22 of enterprise tenant acme, 8
// of pro tenant globex) sending 2K-token requests with 7–21 s pauses for 30 s, and from 5 s on
// acme's export: 10 workers × 5 documents of 5K tokens, all sent at once (50 in flight), which
// honours refusals' retry-after.
func DefaultScenario() Scenario {
	return Scenario{
		Duration:               30 * time.Second,
		Chat:                   []TenantShare{{Tenant: "acme", Users: 22}, {Tenant: "globex", Users: 8}},
		ChatTokens:             Tokens{Prompt: 1500, Completion: 500},
		ThinkMin:               7 * time.Second,
		ThinkMax:               21 * time.Second,
		ChatTimeout:            30 * time.Second,
		Storm:                  true,
		StormAt:                5 * time.Second,
		BatchWorkers:           10,
		BatchPerWorker:         5,
		BatchTenant:            "acme",
		BatchWorkerConcurrency: 5,
		BatchTokens:            Tokens{Prompt: 4000, Completion: 1000},
		BatchRetry:             true,
		Model:                  "deepseek-chat",
	}
}

// MarshalJSON writes the durations as Go duration strings ("30s") rather than nanoseconds.
func (s Scenario) MarshalJSON() ([]byte, error) {
	type plain Scenario
	quota := ""
	if s.QuotaProvider != "" {
		quota = s.QuotaString()
	}
	return json.Marshal(struct {
		plain
		Duration    string `json:"duration"`
		ThinkMin    string `json:"think_min"`
		ThinkMax    string `json:"think_max"`
		ChatTimeout string `json:"chat_timeout"`
		StormAt     string `json:"storm_at"`
		Brownout    string `json:"brownout,omitempty"`
		Quota       string `json:"provider_quota,omitempty"`
	}{plain(s), s.Duration.String(), s.ThinkMin.String(), s.ThinkMax.String(), s.ChatTimeout.String(), s.StormAt.String(), s.Brownout.String(), quota})
}

// ChatUsers is the number of chat users.
func (s Scenario) ChatUsers() int {
	n := 0
	for _, t := range s.Chat {
		n += t.Users
	}
	return n
}

// BatchDocuments is the number of documents the batch job summarises (0 without a storm, and
// for a steady load, which has no fixed number).
func (s Scenario) BatchDocuments() int {
	if !s.Storm || s.BatchSteady {
		return 0
	}
	return s.BatchWorkers * s.BatchPerWorker
}

// Phase is a stretch of a run with one upstream capacity.
type Phase struct {
	// From and To bound the phase in simulated seconds since the run began.
	From float64 `json:"from"`
	To   float64 `json:"to"`
	// Capacity is the upstream's capacity during the phase.
	Capacity int `json:"capacity"`
	// Healthy is true when the capacity is the schedule's first (the provider's normal).
	Healthy bool `json:"healthy"`
}

// Phases cuts the run into the brownout schedule's steps, up to Duration (nil without a
// brownout).
func (s Scenario) Phases() []Phase {
	var out []Phase
	for i, st := range s.Brownout {
		if st.At >= s.Duration {
			break
		}
		to := s.Duration
		if i+1 < len(s.Brownout) && s.Brownout[i+1].At < to {
			to = s.Brownout[i+1].At
		}
		out = append(out, Phase{From: st.At.Seconds(), To: to.Seconds(), Capacity: st.Capacity, Healthy: st.Capacity == s.Brownout[0].Capacity})
	}
	return out
}

// Validate reports every nonsensical field at once.
func (s Scenario) Validate() error {
	var errs []error
	if s.Duration <= 0 || s.Duration >= time.Minute {
		errs = append(errs, fmt.Errorf("duration %v must be positive and shorter than a minute (token budgets count per minute and cannot be time-scaled)", s.Duration))
	}
	if len(s.Chat) == 0 {
		errs = append(errs, errors.New("at least one chat tenant is needed"))
	}
	for _, t := range s.Chat {
		if t.Tenant == "" || t.Users <= 0 {
			errs = append(errs, fmt.Errorf("chat tenant %q with %d users: need a name and at least one user", t.Tenant, t.Users))
		}
	}
	if s.ChatTokens.Prompt <= 0 || s.ChatTokens.Completion <= 0 || s.BatchTokens.Prompt <= 0 || s.BatchTokens.Completion <= 0 {
		errs = append(errs, errors.New("prompt and completion tokens must be positive"))
	}
	if s.ThinkMin < 0 || s.ThinkMax <= s.ThinkMin {
		errs = append(errs, fmt.Errorf("think time range [%v, %v) is empty", s.ThinkMin, s.ThinkMax))
	}
	if s.ChatTimeout <= 0 {
		errs = append(errs, fmt.Errorf("chat timeout %v must be positive", s.ChatTimeout))
	}
	if s.Storm {
		if s.StormAt < 0 || s.StormAt >= s.Duration {
			errs = append(errs, fmt.Errorf("storm start %v must lie within the run's %v", s.StormAt, s.Duration))
		}
		switch {
		case s.BatchSteady && s.BatchWorkers <= 0:
			errs = append(errs, fmt.Errorf("%d batch workers: must be positive", s.BatchWorkers))
		case s.BatchSteady:
		case s.BatchWorkers <= 0 || s.BatchPerWorker <= 0:
			errs = append(errs, fmt.Errorf("%d batch workers × %d documents: both must be positive", s.BatchWorkers, s.BatchPerWorker))
		case s.BatchWorkerConcurrency <= 0 || s.BatchWorkerConcurrency > s.BatchPerWorker:
			errs = append(errs, fmt.Errorf("batch worker concurrency %d must lie in [1, %d]", s.BatchWorkerConcurrency, s.BatchPerWorker))
		}
		if s.BatchTenant == "" {
			errs = append(errs, errors.New("the batch job needs a tenant"))
		}
	}
	if s.Model == "" {
		errs = append(errs, errors.New("a model is needed"))
	}
	if s.ChunkTokens < 0 {
		errs = append(errs, fmt.Errorf("chunk tokens %d must not be negative", s.ChunkTokens))
	}
	if len(s.Brownout) > 0 {
		if _, err := mock.ParseCapacitySchedule(s.Brownout.String()); err != nil {
			errs = append(errs, fmt.Errorf("brownout: %w", err))
		} else if len(s.Phases()) < 2 {
			errs = append(errs, fmt.Errorf("brownout %s changes nothing within the run's %v", s.Brownout, s.Duration))
		}
	}
	if s.QuotaProvider != "" {
		if q := s.ProviderQuota; q.Limit < 0 || q.Tokens < 0 || q.Limit == 0 && q.Tokens == 0 || q.Window <= 0 {
			errs = append(errs, fmt.Errorf("provider quota %s: needs a request or token limit (neither negative) and a positive window", s.QuotaString()))
		}
	}
	return errors.Join(errs...)
}

// words is the vocabulary of generated prompts; every word with its space is 4 to 9 bytes.
var words = strings.Fields("the storm filled our shared pool while chat users waited behind a " +
	"batch export of three thousand documents summary report incident bulkhead compartment " +
	"token budget latency queue tenant enterprise provider breaker refusal retry")

// PromptText returns exactly tokens×4 bytes of plain ASCII words, different for different
// seeds, so that prompt bytes / 4 (the server's estimate and mockllm's count) is tokens.
func PromptText(tokens int, seed uint64) string {
	n := tokens * 4
	if n <= 0 {
		return ""
	}
	var b strings.Builder
	b.Grow(n)
	x := seed*0x9e3779b97f4a7c15 + 1
	for b.Len() < n {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		w := words[x%uint64(len(words))]
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(w)
	}
	return b.String()[:n]
}

// chatBody is an OpenAI chat/completions request body.
type chatBody struct {
	Model         string         `json:"model"`
	MaxTokens     int            `json:"max_tokens"`
	User          string         `json:"user,omitempty"`
	Stream        bool           `json:"stream,omitempty"`
	StreamOptions *streamOptions `json:"stream_options,omitempty"`
	Messages      []chatMessage  `json:"messages"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// RequestBody returns an OpenAI chat/completions body for model with a user message of t.Prompt
// tokens and max_tokens t.Completion.
func RequestBody(model, user string, t Tokens, seed uint64) ([]byte, error) {
	return requestBody(model, user, t, seed, false)
}

// requestBody is RequestBody; stream asks for SSE with usage in the last event.
func requestBody(model, user string, t Tokens, seed uint64, stream bool) ([]byte, error) {
	b := chatBody{
		Model: model, MaxTokens: t.Completion, User: user,
		Messages: []chatMessage{{Role: "user", Content: PromptText(t.Prompt, seed)}},
	}
	if stream {
		b.Stream, b.StreamOptions = true, &streamOptions{IncludeUsage: true}
	}
	return json.Marshal(b)
}
