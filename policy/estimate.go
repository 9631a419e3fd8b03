package policy

import (
	"math"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// RequestSize is what a body scan found about a request's size.
type RequestSize struct {
	// Scanned is false when there was no (valid) body: the estimate is then the default output
	// alone.
	Scanned bool
	// BodyBytes is the size of the whole request body. No tokenizer makes more text tokens than
	// bytes, so it bounds what a response may claim the prompt cost.
	BodyBytes    int64
	PromptBytes  int64
	Images       int
	Audio        int
	Files        int
	MaxTokens    int64
	HasMaxTokens bool
	// N is the number of choices the API generates and bills for the request (1 when absent):
	// for a batched completions request, prompts × max(n, best_of). Each may use the whole
	// output limit.
	N int64
	// Prompts is the number of prompts of a batched request (0 or 1: one), each read in a
	// context window of its own.
	Prompts int64
	// NoOutput: the API generates no tokens (embeddings): nothing is reserved for output, and a
	// response claiming completion tokens is not believed.
	NoOutput bool
	// AudioMillis is the most audio an upload to be transcribed can hold, in milliseconds, and
	// OutputImages the images an image generation asks for: reserved at a per_second and a
	// per_image price (see Estimate).
	AudioMillis, OutputImages int64
}

// Estimate is a request's token estimate before the response reports its real use.
type Estimate struct {
	// Prompt is the estimated input tokens (text by bytes per token, plus media items).
	Prompt int64
	// Media is the part of Prompt that images, audio and files account for.
	Media int64
	// Output is the requested or default output tokens times N (the choices).
	Output int64
	// Total is Prompt + Output, capped by estimation.max_tokens.
	Total int64
	// BytesPerToken is the ratio used for the prompt text.
	BytesPerToken float64
	// MaxPrompt and MaxCompletion are the most the request can cost when Bounded: reported
	// usage above them is not believed (see Ticket.Settle). Snapshot.Estimate always bounds;
	// an Estimate made by hand is unbounded unless it says so.
	MaxPrompt, MaxCompletion int64
	Bounded                  bool
	// AudioMillis and OutputImages are RequestSize's: the audio and the images a request is
	// reserved for at the prices per second and per image; a response that reports no seconds
	// settles at AudioMillis.
	AudioMillis, OutputImages int64
}

// promptOverhead is what a chat template, tool definitions' framing and special tokens may add
// to a prompt beyond one token per body byte.
const promptOverhead = 1024

// maxChoices bounds the choices (and prompts) a request is estimated and bounded for; no API
// accepts as many.
const maxChoices = 1 << 20

// perChoice returns tokens × n for n choices (or prompts) of at most tokens each, saturating at
// maxReported so that no sum of estimates or bounds can overflow.
func perChoice(tokens, n int64) int64 {
	n = min(max(n, 1), maxChoices)
	if tokens <= 0 {
		return 0
	}
	if tokens > maxReported/n {
		return maxReported
	}
	return tokens * n
}

// mediaCeiling is how many times its estimated cost one image or audio part may really cost
// (high-resolution images, long clips): the bound on reported usage, not the estimate.
const mediaCeiling = 4

type estimationSettings struct {
	bpt, weight, minB, maxB            float64
	defMax, image, audio, file, maxTok int64
	learn                              bool
}

func newEstimationSettings(e config.Estimation) estimationSettings {
	return estimationSettings{
		bpt: e.BytesPerToken, weight: e.LearnWeight, minB: e.MinBytesPerToken, maxB: e.MaxBytesPerToken,
		defMax: e.DefaultMaxTokens, image: e.ImageTokens, audio: e.AudioTokens, file: e.FileTokens,
		maxTok: e.MaxTokens, learn: config.Bool(e.Learn),
	}
}

// estimator keeps the learned bytes-per-token ratio of each model. It outlives reloads.
// Safe for concurrent use.
type estimator struct {
	mu     sync.RWMutex
	ratios map[string]*atomic.Uint64 // float64 bits
}

// maxLearnedModels bounds the learned table: model names come from clients.
const maxLearnedModels = 1024

func newEstimator() *estimator { return &estimator{ratios: map[string]*atomic.Uint64{}} }

func (e *estimator) ratio(model string) (float64, bool) {
	e.mu.RLock()
	r := e.ratios[model]
	e.mu.RUnlock()
	if r == nil {
		return 0, false
	}
	return math.Float64frombits(r.Load()), true
}

// learn folds one observation (bytes per real prompt token) into model's ratio.
func (e *estimator) learn(model string, observed, start float64, st estimationSettings) {
	observed = min(max(observed, st.minB), st.maxB)
	e.mu.RLock()
	r := e.ratios[model]
	e.mu.RUnlock()
	if r == nil {
		e.mu.Lock()
		if r = e.ratios[model]; r == nil {
			if len(e.ratios) >= maxLearnedModels {
				e.mu.Unlock()
				return
			}
			r = &atomic.Uint64{}
			r.Store(math.Float64bits(start))
			e.ratios[strings.Clone(model)] = r
		}
		e.mu.Unlock()
	}
	for {
		old := r.Load()
		cur := math.Float64frombits(old)
		next := cur + st.weight*(observed-cur)
		next = min(max(next, st.minB), st.maxB)
		if r.CompareAndSwap(old, math.Float64bits(next)) {
			return
		}
	}
}

// startRatio is a model's configured bytes per token before any learning.
func (s *Snapshot) startRatio(model string) float64 {
	return s.ruleRatio(s.classifier.modelRuleFor(model))
}

// ruleRatio is the configured bytes per token of a model whose rule is mr (nil: none).
func (s *Snapshot) ruleRatio(mr *modelRule) float64 {
	if mr != nil && mr.bpt > 0 {
		return mr.bpt
	}
	return s.estimation.bpt
}

// Estimate computes the token estimate of a request for model with size rs: prompt tokens from
// text bytes (at the model's learned or configured ratio) and media items, plus requested output
// (max_tokens, else the model's or the policy's default) times N.
func (s *Snapshot) Estimate(model string, rs RequestSize) Estimate {
	st := &s.estimation
	// The model's rule, looked up once: ratio, default output and context all come from it.
	mr := s.classifier.modelRuleFor(model)
	bpt, ok := s.engine.est.ratio(model)
	if !ok || !st.learn {
		bpt = s.ruleRatio(mr)
	}
	var est Estimate
	est.BytesPerToken = bpt
	if rs.Scanned {
		est.Media = int64(rs.Images)*st.image + int64(rs.Audio)*st.audio + int64(rs.Files)*st.file
		est.Prompt = int64(math.Ceil(float64(rs.PromptBytes)/bpt)) + est.Media
	}
	out := rs.MaxTokens
	if !rs.HasMaxTokens || out <= 0 {
		out = st.defMax
		if mr != nil && mr.maxOut > 0 {
			out = mr.maxOut
		}
	}
	if rs.NoOutput {
		out = 0
	}
	est.Output = perChoice(min(out, st.maxTok), rs.N)
	est.Total = min(est.Prompt+est.Output, st.maxTok)
	est.Prompt = min(est.Prompt, est.Total)
	est.MaxPrompt, est.MaxCompletion = s.usageCeiling(mr, rs)
	est.Bounded = true
	est.AudioMillis, est.OutputImages = max(rs.AudioMillis, 0), max(rs.OutputImages, 0)
	return est
}

// usageCeiling bounds what a response may claim a request cost: the prompt by the body's size
// (plus generous room for media and template tokens) unless it refers to files the body does
// not contain, and by the model's context window (or estimation.max_tokens when the policy does
// not give one) once per prompt of a batch; the completion by max_tokens, or else the context
// window, once per choice. mr is the model's rule (nil: none).
func (s *Snapshot) usageCeiling(mr *modelRule, rs RequestSize) (prompt, completion int64) {
	st := &s.estimation
	ctx := st.maxTok
	if mr != nil && mr.context > 0 {
		ctx = mr.context
	}
	prompt = perChoice(ctx, rs.Prompts)
	if rs.Scanned && rs.BodyBytes > 0 && rs.Files == 0 {
		media := mediaCeiling * (int64(rs.Images)*st.image + int64(rs.Audio)*st.audio)
		prompt = min(rs.BodyBytes+media+promptOverhead, prompt)
	}
	switch {
	case rs.NoOutput:
		completion = 0
	case rs.HasMaxTokens && rs.MaxTokens > 0:
		completion = perChoice(min(rs.MaxTokens, ctx), rs.N)
	default:
		completion = perChoice(ctx, rs.N)
	}
	return max(prompt, 1), completion
}
