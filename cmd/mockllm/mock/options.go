package mock

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"time"
)

// Defaults applied to zero-valued fields of Options and LatencyModel; the
// mockllm command uses them as its flag defaults.
const (
	DefaultBaseLatency         = 200 * time.Millisecond
	DefaultTokensPerSecond     = 10000.0
	DefaultJitterMin           = 0.9
	DefaultJitterMax           = 1.3
	DefaultTTFBFraction        = 0.2
	DefaultCompletionTokens    = 256
	DefaultEmbeddingDimensions = 64
	DefaultRequestLogSize      = 256
	DefaultMaxLoggedBodyBytes  = 64 << 10
	DefaultMaxRequestBodyBytes = 16 << 20
	DefaultChunkTokens         = 1
)

// Limits past which a request or an option is refused rather than obeyed.
const (
	maxCompletionTokens    = 1 << 17
	maxEmbeddingDimensions = 4096
	maxRequestLogSize      = 1 << 20
	// maxTrackedLabels and maxTrackedProviders bound the counter maps and
	// provider pools keyed by client-chosen values; later values share the
	// overflowLabel entry.
	maxTrackedLabels    = 1024
	maxTrackedProviders = 64
	overflowLabel       = "other"
)

// LatencyModel decides how long the fake provider takes to answer one request:
//
//	latency = (Base + tokens/TokensPerSecond s) × uniform(JitterMin, JitterMax)
//
// where tokens is the request's prompt plus completion tokens. A streamed
// response sends its first byte after TTFBFraction of the latency and spreads
// the rest evenly over its chunks, so the last event leaves at the full latency
// (the part after the first byte stretched by DecodeSlowdown under load).
// The zero value is the storm experiment's model: (0.2 s + tokens/10000 s) ×
// uniform(0.9, 1.3) with the first byte at 20 %. Zero fields take those
// defaults, which is why a first byte at exactly 0 % cannot be asked for (use a
// tiny fraction instead).
//
// A LatencyModel is a plain value and safe for concurrent use.
type LatencyModel struct {
	// Base is the fixed part of every request's latency. Zero means 200 ms.
	Base time.Duration
	// TokensPerSecond is how fast the provider works through tokens. Zero means 10000.
	TokensPerSecond float64
	// JitterMin and JitterMax bound the uniform factor applied to the latency.
	// Both zero mean 0.9 and 1.3; otherwise 0 < JitterMin ≤ JitterMax is required.
	JitterMin float64
	JitterMax float64
	// TTFBFraction is the share of a streamed response's latency spent before
	// its first byte. Zero means 0.2; otherwise it must lie in (0, 1].
	TTFBFraction float64
	// DecodeSlowdown models a batching server whose decode step grows with
	// its batch: a request's time after its first byte (1 − TTFBFraction of
	// the latency; the gaps between streamed events) is multiplied by
	// 1 + DecodeSlowdown × (requests in service when it starts − 1), the
	// count including itself. The factor is fixed when the request starts;
	// requests joining or leaving later do not change it. Zero (the default)
	// keeps the pace of tokens independent of load. It must lie in [0, 10].
	DecodeSlowdown float64
}

// withDefaults returns m with every zero field replaced by its default.
func (m LatencyModel) withDefaults() LatencyModel {
	if m.Base == 0 {
		m.Base = DefaultBaseLatency
	}
	if m.TokensPerSecond == 0 {
		m.TokensPerSecond = DefaultTokensPerSecond
	}
	if m.JitterMin == 0 && m.JitterMax == 0 {
		m.JitterMin, m.JitterMax = DefaultJitterMin, DefaultJitterMax
	}
	if m.TTFBFraction == 0 {
		m.TTFBFraction = DefaultTTFBFraction
	}
	return m
}

// validate reports every nonsensical field of m (after defaults).
func (m LatencyModel) validate() error {
	var errs []error
	if m.Base < 0 {
		errs = append(errs, fmt.Errorf("latency base %v must not be negative", m.Base))
	}
	if !(m.TokensPerSecond > 0) || math.IsInf(m.TokensPerSecond, 0) {
		errs = append(errs, fmt.Errorf("tokens per second %v must be a positive finite number", m.TokensPerSecond))
	}
	if !(m.JitterMin > 0) || !(m.JitterMax >= m.JitterMin) || math.IsInf(m.JitterMax, 0) {
		errs = append(errs, fmt.Errorf("jitter range [%v, %v] must satisfy 0 < min ≤ max < +Inf", m.JitterMin, m.JitterMax))
	}
	if !(m.TTFBFraction > 0 && m.TTFBFraction <= 1) {
		errs = append(errs, fmt.Errorf("ttfb fraction %v must lie in (0, 1]", m.TTFBFraction))
	}
	if !(m.DecodeSlowdown >= 0 && m.DecodeSlowdown <= 10) {
		errs = append(errs, fmt.Errorf("decode slowdown %v must lie in [0, 10]", m.DecodeSlowdown))
	}
	return errors.Join(errs...)
}

// Latency returns the unscaled latency for a request of tokens tokens, given
// u, a uniform draw from [0, 1) that picks the jitter factor. Zero fields of m
// take their defaults. Passing the draw in keeps the model a pure function, so
// it can be checked against a table.
func (m LatencyModel) Latency(tokens int64, u float64) time.Duration {
	m = m.withDefaults()
	jitter := m.JitterMin + (m.JitterMax-m.JitterMin)*u
	seconds := (m.Base.Seconds() + float64(tokens)/m.TokensPerSecond) * jitter
	return time.Duration(math.Round(seconds * float64(time.Second)))
}

// Options configures a Server. Every field's zero value is usable and is
// documented on the field; New rejects values that make no sense.
type Options struct {
	// TimeScale multiplies every simulated delay (the latency model and the
	// x-mockllm-delay-headers fault), so tests can run the same traffic shape
	// a hundred times faster with 0.01. Zero means 1 (real time); negative is
	// an error.
	TimeScale float64
	// Seed seeds the random generator behind the jitter and fail-rate draws.
	// Every request draws exactly two numbers, so a sequential run with the
	// same seed sees the same latencies and failures. Zero is a valid seed.
	Seed uint64
	// Latency is the latency model; see LatencyModel for its zero value.
	Latency LatencyModel
	// Capacity is how many requests the whole fake provider processes at once;
	// the rest wait in FIFO order, which models a shared provider pool that
	// queues when overloaded. Zero means unlimited.
	//
	// The model behind it: a request's latency (LatencyModel) starts when it
	// gets a slot, so time spent in the queue adds to its time to first byte
	// and nothing else; the pace of its streamed tokens does not depend on
	// how many requests are in service (a server that batches up to its
	// capacity without slowing down, and queues the rest) unless
	// LatencyModel.DecodeSlowdown says so. Each response reports its wait in
	// x-mockllm-queue-wait.
	Capacity int
	// CapacitySchedule, when not empty, replaces Capacity with a capacity
	// that changes during the run (see CapacitySchedule); its offsets are
	// simulated time, so they follow TimeScale. The schedule starts when the
	// Server is made and starts again from its first step on every Reset.
	// Setting both Capacity and CapacitySchedule is an error.
	CapacitySchedule CapacitySchedule
	// ProviderCapacity limits concurrent requests per x-llm-provider header
	// value, on top of Capacity. Providers not listed are unlimited.
	ProviderCapacity map[string]int
	// Quotas gives providers (by x-llm-provider header value; "" for requests
	// without it) request and token rate limits, reported in every response's
	// rate-limit headers and enforced with 429 (see RequestQuota). Providers
	// not listed have none and send no such headers.
	Quotas map[string]RequestQuota
	// QuotaAccountHeader, when set, keeps each provider's quota per value of
	// this request header, as a provider keeps one per API key: every account
	// gets the provider's Quotas entry for itself (requests without the header
	// share the account ""; beyond 1024 accounts, later ones share "other").
	QuotaAccountHeader string
	// QuotaClock is the clock of the quotas' windows and of the resets their
	// headers announce (nil: the system clock), so that a test can step it
	// together with the proxy's clock.
	QuotaClock func() time.Time
	// DefaultCompletionTokens is the completion size when the request gives no
	// max_tokens, max_completion_tokens or max_output_tokens. Zero means 256.
	DefaultCompletionTokens int64
	// ChunkTokens is how many completion tokens each streamed content event
	// carries. Zero means 1, as the real APIs do.
	ChunkTokens int
	// EmbeddingDimensions is the vector length when the request gives no
	// dimensions. Zero means 64 (kept small so tests stay fast).
	EmbeddingDimensions int
	// ModelProviders, when not empty, makes the fake provider check that a
	// request reached a provider serving its model, as a real one would: a
	// request whose x-llm-provider names a provider listed here, for a model
	// whose first matching entry names another provider (or none), is answered
	// 404 model_not_found in the API's error format. Requests without the
	// header, or for providers not listed, are not checked. Empty (the default)
	// checks nothing; ExampleModelProviders is llm-bulkhead's example policy.
	ModelProviders []ModelProvider
	// Faults are applied to every matching request from the start; they can be
	// replaced at run time with Server.SetFaults or POST /mockllm/faults.
	Faults []FaultRule
	// RequestLogSize is how many of the most recent requests are kept for
	// Server.Requests and GET /mockllm/requests. Zero means 256.
	RequestLogSize int
	// MaxLoggedBodyBytes caps the body stored per logged request, so a test
	// sending 1 MiB bodies does not keep hundreds of megabytes alive. Zero
	// means 64 KiB.
	MaxLoggedBodyBytes int
	// MaxRequestBodyBytes is the largest request body accepted; larger ones get
	// 413 in the API's error format. Zero means 16 MiB.
	MaxRequestBodyBytes int64
	// Logger receives one debug line per request and warnings about failed
	// writes. Nil discards them.
	Logger *slog.Logger
}

// withDefaults returns o with every zero field replaced by its default.
func (o Options) withDefaults() Options {
	if o.TimeScale == 0 {
		o.TimeScale = 1
	}
	o.Latency = o.Latency.withDefaults()
	if o.DefaultCompletionTokens == 0 {
		o.DefaultCompletionTokens = DefaultCompletionTokens
	}
	if o.ChunkTokens == 0 {
		o.ChunkTokens = DefaultChunkTokens
	}
	if o.EmbeddingDimensions == 0 {
		o.EmbeddingDimensions = DefaultEmbeddingDimensions
	}
	if o.RequestLogSize == 0 {
		o.RequestLogSize = DefaultRequestLogSize
	}
	if o.MaxLoggedBodyBytes == 0 {
		o.MaxLoggedBodyBytes = DefaultMaxLoggedBodyBytes
	}
	if o.MaxRequestBodyBytes == 0 {
		o.MaxRequestBodyBytes = DefaultMaxRequestBodyBytes
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	o.ModelProviders = slices.Clone(o.ModelProviders)
	o.Quotas = maps.Clone(o.Quotas)
	o.CapacitySchedule = slices.Clone(o.CapacitySchedule)
	return o
}

// validate reports every nonsensical field of o (after defaults) at once.
func (o Options) validate() error {
	var errs []error
	if !(o.TimeScale > 0) || math.IsInf(o.TimeScale, 0) {
		errs = append(errs, fmt.Errorf("time scale %v must be a positive finite number", o.TimeScale))
	}
	if err := o.Latency.validate(); err != nil {
		errs = append(errs, err)
	}
	if o.Capacity < 0 {
		errs = append(errs, fmt.Errorf("capacity %d must not be negative", o.Capacity))
	}
	if len(o.CapacitySchedule) > 0 {
		if o.Capacity != 0 {
			errs = append(errs, fmt.Errorf("capacity %d and capacity schedule %s exclude each other", o.Capacity, o.CapacitySchedule))
		}
		if err := o.CapacitySchedule.validate(); err != nil {
			errs = append(errs, err)
		}
	}
	for name, c := range o.ProviderCapacity {
		if name == "" {
			errs = append(errs, errors.New("provider capacity needs a provider name"))
		}
		if c < 0 {
			errs = append(errs, fmt.Errorf("capacity %d of provider %q must not be negative", c, name))
		}
	}
	for name, q := range o.Quotas {
		if q.Limit < 0 || q.Tokens < 0 || q.Limit == 0 && q.Tokens == 0 || q.Window <= 0 {
			errs = append(errs, fmt.Errorf("quota of provider %q needs a request or token limit (neither negative) and a positive window, got %d requests and %d tokens per %s", name, q.Limit, q.Tokens, q.Window))
		}
	}
	if len(o.Quotas) > maxTrackedProviders {
		errs = append(errs, fmt.Errorf("at most %d providers may have a quota, got %d", maxTrackedProviders, len(o.Quotas)))
	}
	if len(o.ProviderCapacity) > maxTrackedProviders {
		errs = append(errs, fmt.Errorf("at most %d providers may have a capacity, got %d", maxTrackedProviders, len(o.ProviderCapacity)))
	}
	if o.DefaultCompletionTokens < 0 || o.DefaultCompletionTokens > maxCompletionTokens {
		errs = append(errs, fmt.Errorf("default completion tokens %d must lie in [1, %d]", o.DefaultCompletionTokens, maxCompletionTokens))
	}
	if o.ChunkTokens < 0 {
		errs = append(errs, fmt.Errorf("chunk tokens %d must not be negative", o.ChunkTokens))
	}
	if o.EmbeddingDimensions < 0 || o.EmbeddingDimensions > maxEmbeddingDimensions {
		errs = append(errs, fmt.Errorf("embedding dimensions %d must lie in [1, %d]", o.EmbeddingDimensions, maxEmbeddingDimensions))
	}
	if o.RequestLogSize < 0 || o.RequestLogSize > maxRequestLogSize {
		errs = append(errs, fmt.Errorf("request log size %d must lie in [1, %d]", o.RequestLogSize, maxRequestLogSize))
	}
	if o.MaxLoggedBodyBytes < 0 {
		errs = append(errs, fmt.Errorf("max logged body bytes %d must not be negative", o.MaxLoggedBodyBytes))
	}
	if o.MaxRequestBodyBytes < 0 {
		errs = append(errs, fmt.Errorf("max request body bytes %d must not be negative", o.MaxRequestBodyBytes))
	}
	if err := validateRules(o.Faults); err != nil {
		errs = append(errs, err)
	}
	if err := validateModelProviders(o.ModelProviders); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
