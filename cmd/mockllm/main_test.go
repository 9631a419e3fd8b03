package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
	policyconfig "github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestExampleModelTableIsThePolicys: -check-model-provider's table is the example policy's
// models list, so the demo's mock serves each provider the models the policy sends it.
func TestExampleModelTableIsThePolicys(t *testing.T) {
	p, err := policyconfig.Load("policy.yaml", examples.DefaultPolicy, nil)
	if err != nil {
		t.Fatal(err)
	}
	var table []mock.ModelProvider
	for _, m := range p.Models {
		if m.Provider != "" {
			table = append(table, mock.ModelProvider{Match: m.Match, Provider: m.Provider})
		}
	}
	if !slices.Equal(table, mock.ExampleModelProviders) {
		t.Errorf("mock.ExampleModelProviders is\n%+v\nexamples/policy.yaml maps\n%+v", mock.ExampleModelProviders, table)
	}
}

func TestParseFlags(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		check   func(t *testing.T, c config)
		wantErr string
	}{
		{
			name: "defaults",
			check: func(t *testing.T, c config) {
				if c.listen != "127.0.0.1:8080" || c.grace != 10*time.Second || c.opts.TimeScale != 1 || c.opts.Seed != 1 ||
					c.opts.Capacity != 0 || c.opts.DefaultCompletionTokens != 256 || c.opts.Latency.Base != 200*time.Millisecond ||
					c.opts.Latency.TTFBFraction != 0.2 || len(c.opts.Faults) != 0 {
					t.Fatalf("defaults = %+v", c)
				}
			},
		},
		{
			name: "everything set",
			args: []string{
				"-listen", "127.0.0.1:0", "-grace", "3s", "-log-level", "debug", "-time-scale", "0.01", "-seed", "9",
				"-capacity", "8", "-provider-capacity", "deepseek=2", "-provider-capacity", "openai=5",
				"-default-completion-tokens", "64", "-base-latency", "50ms", "-tokens-per-second", "2000",
				"-jitter-min", "1", "-jitter-max", "1", "-ttfb-fraction", "0.5", "-decode-slowdown", "0.25", "-chunk-tokens", "4",
				"-embedding-dimensions", "16", "-request-log", "10", "-provider-quota", "deepseek=60/1m", "-provider-quota", "qwen=30,90000tokens/10s", "-provider-quota", "kimi=5000tokens/1s",
				"-fail", "provider=deepseek,rate=0.6,status=503", "-fail", "model=gpt-4*,no-usage=1",
			},
			check: func(t *testing.T, c config) {
				o := c.opts
				if c.listen != "127.0.0.1:0" || c.grace != 3*time.Second || c.logLevel.String() != "DEBUG" || o.TimeScale != 0.01 ||
					o.Seed != 9 || o.Capacity != 8 || o.ProviderCapacity["deepseek"] != 2 || o.ProviderCapacity["openai"] != 5 ||
					o.DefaultCompletionTokens != 64 || o.Latency.Base != 50*time.Millisecond || o.Latency.TokensPerSecond != 2000 ||
					o.Latency.JitterMin != 1 || o.Latency.JitterMax != 1 || o.Latency.TTFBFraction != 0.5 || o.Latency.DecodeSlowdown != 0.25 || o.ChunkTokens != 4 ||
					o.EmbeddingDimensions != 16 || o.RequestLogSize != 10 || o.Quotas["deepseek"] != (mock.RequestQuota{Limit: 60, Window: time.Minute}) ||
					o.Quotas["qwen"] != (mock.RequestQuota{Limit: 30, Tokens: 90000, Window: 10 * time.Second}) || o.Quotas["kimi"] != (mock.RequestQuota{Tokens: 5000, Window: time.Second}) {
					t.Fatalf("config = %+v", c)
				}
				want := []mock.FaultRule{
					{Provider: "deepseek", Fault: mock.Fault{FailRate: 0.6, Status: 503}},
					{Model: "gpt-4*", Fault: mock.Fault{NoUsage: true}},
				}
				if len(o.Faults) != 2 || o.Faults[0] != want[0] || o.Faults[1] != want[1] {
					t.Fatalf("faults = %+v, want %+v", o.Faults, want)
				}
			},
		},
		{
			name: "model check with the example's table",
			args: []string{"-check-model-provider"},
			check: func(t *testing.T, c config) {
				if !slices.Equal(c.opts.ModelProviders, mock.ExampleModelProviders) {
					t.Fatalf("model providers = %+v", c.opts.ModelProviders)
				}
			},
		},
		{
			name: "model check with rules in order",
			args: []string{"-model-provider", "gpt-4*=openai", "-model-provider", "*=local", "-check-model-provider"},
			check: func(t *testing.T, c config) {
				want := []mock.ModelProvider{{Match: "gpt-4*", Provider: "openai"}, {Match: "*", Provider: "local"}}
				if len(c.opts.ModelProviders) != 2 || c.opts.ModelProviders[0] != want[0] || c.opts.ModelProviders[1] != want[1] {
					t.Fatalf("model providers = %+v, want %+v", c.opts.ModelProviders, want)
				}
			},
		},
		{
			name: "capacity schedule",
			args: []string{"-capacity-schedule", "10@0s,4@10s,10@25s"},
			check: func(t *testing.T, c config) {
				want := mock.CapacitySchedule{{At: 0, Capacity: 10}, {At: 10 * time.Second, Capacity: 4}, {At: 25 * time.Second, Capacity: 10}}
				if c.opts.Capacity != 0 || c.opts.CapacitySchedule.String() != want.String() {
					t.Fatalf("capacity %d, schedule %v; want %v", c.opts.Capacity, c.opts.CapacitySchedule, want)
				}
			},
		},
		{name: "bad capacity schedule", args: []string{"-capacity-schedule", "10@0s,4@10s,5@5s"}, wantErr: "step 3: offset 5s must be later"},
		{name: "capacity and schedule", args: []string{"-capacity", "3", "-capacity-schedule", "10@0s"}, wantErr: "exclude each other"},
		{name: "bad model provider", args: []string{"-model-provider", "gpt-4*"}, wantErr: "glob=provider"},
		{name: "bad fault rule", args: []string{"-fail", "provider=x,colour=red"}, wantErr: "colour"},
		{name: "provider quota without a window", args: []string{"-provider-quota", "deepseek=60"}, wantErr: "name=N[,Ttokens]/window"},
		{name: "provider quota with two request limits", args: []string{"-provider-quota", "deepseek=60,70/1m"}, wantErr: "request limit \"70\""},
		{name: "provider quota with a word for tokens", args: []string{"-provider-quota", "deepseek=manytokens/1m"}, wantErr: "token limit"},
		{name: "bad provider capacity", args: []string{"-provider-capacity", "deepseek"}, wantErr: "name=N"},
		{name: "provider capacity not a number", args: []string{"-provider-capacity", "deepseek=two"}, wantErr: "invalid"},
		{name: "stray argument", args: []string{"serve"}, wantErr: "unexpected arguments"},
		{name: "negative grace", args: []string{"-grace", "-1s"}, wantErr: "grace"},
		{name: "help", args: []string{"-h"}, wantErr: flag.ErrHelp.Error()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := parseFlags(tt.args, io.Discard)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parseFlags error = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("parseFlags: %v", err)
			}
			tt.check(t, c)
		})
	}
}

func TestHelpDocumentsEveryFlag(t *testing.T) {
	var out bytes.Buffer
	if _, err := parseFlags([]string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("-h returned %v", err)
	}
	for _, name := range []string{
		"listen", "grace", "log-level", "time-scale", "seed", "capacity", "capacity-schedule", "provider-capacity", "default-completion-tokens",
		"base-latency", "tokens-per-second", "jitter-min", "jitter-max", "ttfb-fraction", "decode-slowdown", "chunk-tokens",
		"embedding-dimensions", "request-log", "check-model-provider", "model-provider", "fail", mock.HeaderStatus, mock.HeaderDisconnectAfter, mock.HeaderQueueWait, "/mockllm/faults", "/mockllm/capacity",
	} {
		if !strings.Contains(out.String(), name) {
			t.Errorf("help does not mention %q", name)
		}
	}
}

func TestRunServesUntilCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	logs := &syncbuf.Buffer{}
	addrs := make(chan net.Addr, 1)
	ran := make(chan error, 1)
	go func() {
		ran <- run(ctx, []string{"-listen", "127.0.0.1:0", "-time-scale", "0.001", "-fail", "provider=broken,status=503"}, logs,
			func(a net.Addr) { addrs <- a })
	}()
	var addr net.Addr
	select {
	case addr = <-addrs:
	case err := <-ran:
		t.Fatalf("run ended before listening: %v", err)
	}
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	tests := []struct {
		name       string
		provider   string
		wantStatus int
	}{
		{name: "healthy provider", provider: "fine", wantStatus: 200},
		{name: "provider broken by -fail", provider: "broken", wantStatus: 503},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequest(http.MethodPost, "http://"+addr.String()+"/v1/chat/completions",
				strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set(mock.ProviderHeader, tt.provider)
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tt.wantStatus {
				t.Fatalf("status %d, want %d", resp.StatusCode, tt.wantStatus)
			}
		})
	}
	cancel()
	if err := <-ran; err != nil {
		t.Fatalf("run after cancel: %v", err)
	}
	for _, want := range []string{`"msg":"mockllm listening"`, `"addr":"` + addr.String(), `"msg":"mockllm stopped"`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("logs lack %s:\n%s", want, logs)
		}
	}
}

func TestRunFailsFast(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{name: "invalid options", args: []string{"-listen", "127.0.0.1:0", "-capacity", "-1", "-ttfb-fraction", "2"}, wantErr: "ttfb fraction"},
		{name: "unusable address", args: []string{"-listen", "127.0.0.1:notaport"}, wantErr: "notaport"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := run(context.Background(), tt.args, io.Discard, nil)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("run error = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}

// FuzzParseProviderQuota: -provider-quota's value never panics the parser, and what it
// accepts reads back the same when written in the flag's form.
func FuzzParseProviderQuota(f *testing.F) {
	for _, s := range []string{"deepseek=60/1m", "qwen=30,90000tokens/10s", "kimi=5000tokens/1s", "x=/1m", "=1/1s", "a=1,2/1s", "a=tokens/1s", "a=1/"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		name, q, err := parseProviderQuota(v)
		if err != nil {
			return
		}
		if name == "" {
			t.Fatalf("%q: accepted without a name", v)
		}
		var limits []string
		if q.Limit != 0 {
			limits = append(limits, strconv.Itoa(q.Limit))
		}
		if q.Tokens != 0 {
			limits = append(limits, strconv.FormatInt(q.Tokens, 10)+"tokens")
		}
		if len(limits) == 0 {
			return // all zero: New refuses it
		}
		again := name + "=" + strings.Join(limits, ",") + "/" + q.Window.String()
		name2, q2, err := parseProviderQuota(again)
		if err != nil || name2 != name || q2 != q {
			t.Fatalf("%q read as %s %+v; written %q reads %s %+v, %v", v, name, q, again, name2, q2, err)
		}
	})
}
