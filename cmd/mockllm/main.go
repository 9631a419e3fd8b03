// Command mockllm runs a fake LLM provider speaking the OpenAI, Anthropic,
// Azure OpenAI, Gemini and Bedrock APIs, with a latency model, a queueing
// capacity and injectable faults, for demos, experiments and end-to-end tests
// of llm-bulkhead. See package mock for the
// endpoints and the token accounting.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
)

// config is everything the command line decides.
type config struct {
	listen   string
	grace    time.Duration
	logLevel slog.Level
	opts     mock.Options
}

// parseFlags reads args (without the program name). Help goes to out.
func parseFlags(args []string, out io.Writer) (config, error) {
	cfg := config{opts: mock.Options{ProviderCapacity: map[string]int{}}}
	fs := flag.NewFlagSet("mockllm", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprintf(out, `Usage: mockllm [flags]

A fake LLM provider. Endpoints: POST /v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/responses, /v1/messages (JSON and SSE), GET /v1/models;
Azure OpenAI: POST /openai/v1/{chat/completions,completions,embeddings,
responses}, /openai/deployments/{deployment}/{chat/completions,completions,
embeddings}?api-version=...; Gemini: POST /v1beta/models/{model}:
generateContent, :streamGenerateContent (alt=sse: SSE, else a JSON array),
:countTokens, :embedContent; Bedrock: POST /model/{modelId}/converse,
/converse-stream (AWS event stream), /invoke and /invoke-with-response-stream
(Anthropic models). Errors come in each API's own shape. Admin: GET
/mockllm/requests,
GET /mockllm/stats, GET|POST /mockllm/faults, POST /mockllm/capacity
({"capacity": N}: the capacity from now on), POST /mockllm/reset,
GET /mockllm/healthz.

Per-request headers: x-mockllm-status, x-mockllm-retry-after,
x-mockllm-delay-headers, x-mockllm-first-token-delay,
x-mockllm-stream-error, x-mockllm-disconnect-after, x-mockllm-no-usage,
x-mockllm-fail-rate, x-mockllm-gzip, x-mockllm-completion-tokens,
x-mockllm-cached-tokens, x-mockllm-reasoning-tokens,
x-mockllm-report-prompt-tokens, x-mockllm-report-completion-tokens,
x-mockllm-report-total-tokens. Response headers: x-mockllm-prompt-tokens,
x-mockllm-completion-tokens, x-mockllm-request-id, x-mockllm-queue-wait
(simulated seconds the request queued for a capacity slot).

Capacity: requests beyond -capacity (or the capacity -capacity-schedule has
in force) wait in one FIFO queue; the wait adds to their time to first byte,
and the pace of streamed tokens does not change with load unless
-decode-slowdown says so.

Flags:
`)
		fs.PrintDefaults()
	}
	fs.StringVar(&cfg.listen, "listen", "127.0.0.1:8080", "address to listen on (host:port; port 0 picks a free one)")
	fs.DurationVar(&cfg.grace, "grace", 10*time.Second, "on SIGINT/SIGTERM, how long requests in progress may run before their connections are closed")
	fs.TextVar(&cfg.logLevel, "log-level", slog.LevelInfo, "log level: DEBUG (one line per request), INFO, WARN or ERROR")
	fs.Float64Var(&cfg.opts.TimeScale, "time-scale", 1, "multiplies every simulated delay; 0.01 runs 100x faster")
	fs.Uint64Var(&cfg.opts.Seed, "seed", 1, "seed of the random jitter and fail-rate draws (same seed and request order, same run)")
	fs.IntVar(&cfg.opts.Capacity, "capacity", 0, "requests processed at once by the whole provider; others wait FIFO (0: unlimited)")
	fs.Func("capacity-schedule", "`capacity@offset,...`: a capacity that changes during the run, e.g. 10@0s,4@10s,10@25s (10 at once, 4 from 10 s, 10 again from 25 s; simulated time since start, restarted by POST /mockllm/reset; first step at 0s, offsets increasing; excludes -capacity)", func(v string) error {
		sc, err := mock.ParseCapacitySchedule(v)
		if err != nil {
			return err
		}
		cfg.opts.CapacitySchedule = sc
		return nil
	})
	fs.Func("provider-capacity", "`name=N`: requests processed at once for x-llm-provider value name, on top of -capacity (repeatable)", func(v string) error {
		name, n, ok := strings.Cut(v, "=")
		if !ok || name == "" {
			return errors.New("want name=N")
		}
		c, err := strconv.Atoi(n)
		if err != nil {
			return err
		}
		cfg.opts.ProviderCapacity[name] = c
		return nil
	})
	fs.Func("provider-quota", "`name=N[,Ttokens]/window`: x-llm-provider value name may send N requests and T tokens (prompt + max_tokens) per window (simulated time, e.g. deepseek=60,90000tokens/1m; either limit alone: deepseek=60/1m, deepseek=90000tokens/1m); its responses say what is left in x-ratelimit-* (anthropic-ratelimit-* for /v1/messages) headers and requests beyond it get 429 (repeatable)", func(v string) error {
		name, q, err := parseProviderQuota(v)
		if err != nil {
			return err
		}
		if cfg.opts.Quotas == nil {
			cfg.opts.Quotas = map[string]mock.RequestQuota{}
		}
		cfg.opts.Quotas[name] = q
		return nil
	})
	fs.StringVar(&cfg.opts.QuotaAccountHeader, "quota-account-header", "", "keep each -provider-quota per value of this request header (one account per value, as per API key), each account with the provider's limits")
	fs.Int64Var(&cfg.opts.DefaultCompletionTokens, "default-completion-tokens", mock.DefaultCompletionTokens, "completion tokens when the request gives no max_tokens/max_completion_tokens/max_output_tokens")
	fs.DurationVar(&cfg.opts.Latency.Base, "base-latency", mock.DefaultBaseLatency, "fixed part of each request's latency")
	fs.Float64Var(&cfg.opts.Latency.TokensPerSecond, "tokens-per-second", mock.DefaultTokensPerSecond, "latency grows by tokens/this seconds (tokens = prompt + completion)")
	fs.Float64Var(&cfg.opts.Latency.JitterMin, "jitter-min", mock.DefaultJitterMin, "lower bound of the uniform factor applied to each latency")
	fs.Float64Var(&cfg.opts.Latency.JitterMax, "jitter-max", mock.DefaultJitterMax, "upper bound of the uniform factor applied to each latency")
	fs.Float64Var(&cfg.opts.Latency.TTFBFraction, "ttfb-fraction", mock.DefaultTTFBFraction, "share of a stream's latency before its first byte; the rest is spread over the chunks")
	fs.Float64Var(&cfg.opts.Latency.DecodeSlowdown, "decode-slowdown", 0, "stretch a request's time after its first byte by this fraction per other request in service when it starts (a batching server's decode slowing with its batch; 0: pace independent of load)")
	fs.IntVar(&cfg.opts.ChunkTokens, "chunk-tokens", mock.DefaultChunkTokens, "completion tokens per streamed content event")
	fs.IntVar(&cfg.opts.EmbeddingDimensions, "embedding-dimensions", mock.DefaultEmbeddingDimensions, "embedding vector length when the request gives no dimensions")
	fs.IntVar(&cfg.opts.RequestLogSize, "request-log", mock.DefaultRequestLogSize, "how many recent requests GET /mockllm/requests keeps")
	var checkModels bool
	fs.BoolVar(&checkModels, "check-model-provider", false, "answer 404 model_not_found when x-llm-provider names a provider that does not serve the body's model, per llm-bulkhead's example policy (deepseek-* on deepseek, qwen-* on qwen, gemini-* on gemini, *anthropic.claude-* and *amazon.nova-* on bedrock, anything else on local) unless -model-provider rules are given")
	fs.Func("model-provider", "`glob=provider`: the provider serving the models glob matches, for the model check (repeatable; the first matching rule wins; implies -check-model-provider)", func(v string) error {
		glob, provider, ok := strings.Cut(v, "=")
		if !ok || glob == "" || provider == "" {
			return errors.New("want glob=provider")
		}
		cfg.opts.ModelProviders = append(cfg.opts.ModelProviders, mock.ModelProvider{Match: glob, Provider: provider})
		return nil
	})
	fs.Func("fail", "fault `rule` for the whole run, e.g. provider=deepseek,rate=0.6,status=503; keys: provider, model (glob), status, rate, retry-after, delay-headers, first-token-delay, stream-error, disconnect-after, no-usage, gzip, report-prompt, report-completion, report-total (repeatable; later rules refine earlier ones)", func(v string) error {
		r, err := mock.ParseFaultRule(v)
		if err != nil {
			return err
		}
		cfg.opts.Faults = append(cfg.opts.Faults, r)
		return nil
	})
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	if checkModels && len(cfg.opts.ModelProviders) == 0 {
		cfg.opts.ModelProviders = mock.ExampleModelProviders
	}
	if cfg.grace < 0 {
		return cfg, fmt.Errorf("-grace %v must not be negative", cfg.grace)
	}
	if cfg.opts.Capacity != 0 && len(cfg.opts.CapacitySchedule) > 0 {
		return cfg, errors.New("-capacity and -capacity-schedule exclude each other: give the fixed capacity as a one-step schedule (N@0s) or drop one")
	}
	return cfg, nil
}

// run serves until ctx ends. ready, when not nil, is told the address
// listened on.
func run(ctx context.Context, args []string, stderr io.Writer, ready func(net.Addr)) error {
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: cfg.logLevel}))
	cfg.opts.Logger = logger
	srv, err := mock.New(cfg.opts)
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		return err
	}
	logger.Info("mockllm listening", "addr", l.Addr().String(), "time_scale", cfg.opts.TimeScale,
		"seed", cfg.opts.Seed, "capacity", cfg.opts.Capacity, "capacity_schedule", cfg.opts.CapacitySchedule.String(),
		"fault_rules", len(cfg.opts.Faults))
	if ready != nil {
		ready(l.Addr())
	}
	err = srv.Run(ctx, l, cfg.grace)
	logger.Info("mockllm stopped", "err", err)
	return err
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stderr, nil)
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
	default:
		fmt.Fprintln(os.Stderr, "mockllm:", err)
		stop()
		os.Exit(1)
	}
}

// parseProviderQuota reads -provider-quota's name=N[,Ttokens]/window.
func parseProviderQuota(v string) (string, mock.RequestQuota, error) {
	const want = "want name=N[,Ttokens]/window, e.g. deepseek=60,90000tokens/1m"
	name, spec, ok := strings.Cut(v, "=")
	limits, window, ok2 := strings.Cut(spec, "/")
	if !ok || !ok2 || name == "" || limits == "" {
		return "", mock.RequestQuota{}, errors.New(want)
	}
	var q mock.RequestQuota
	for _, l := range strings.Split(limits, ",") {
		if n, isTokens := strings.CutSuffix(l, "tokens"); isTokens {
			t, err := strconv.ParseInt(n, 10, 64)
			if err != nil || q.Tokens != 0 {
				return "", q, fmt.Errorf("token limit %q: %s", l, want)
			}
			q.Tokens = t
			continue
		}
		r, err := strconv.Atoi(l)
		if err != nil || q.Limit != 0 {
			return "", q, fmt.Errorf("request limit %q: %s", l, want)
		}
		q.Limit = r
	}
	w, err := time.ParseDuration(window)
	if err != nil {
		return "", q, err
	}
	q.Window = w
	return name, q, nil
}
