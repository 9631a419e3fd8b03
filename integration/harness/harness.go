// Package harness starts a whole llm-bulkhead stack in one process — the mock LLM, the server
// and the Envoy simulator configured from the same filter settings `llm-bulkhead envoy-config`
// prints — for end-to-end tests, the demo and the storm experiment.
package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	yaml "go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/envoy"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// Options configure a Stack.
type Options struct {
	// PolicyPath is the policy file the server runs; empty runs the built-in example policy.
	PolicyPath string
	// Env is the server's environment (LLM_BULKHEAD_ overrides, admin token).
	Env []string
	// Watch makes the server reload PolicyPath when it changes.
	Watch bool
	// Filter adjusts the simulator's filter settings after they were derived from the policy.
	Filter func(*envoysim.FilterConfig)
	// Mock configures the mock LLM; NoMock runs without one (tests bring their own upstream).
	Mock   mock.Options
	NoMock bool
	// CheckModels makes the mock LLM answer 404 model_not_found to a request whose provider does
	// not serve its model, by the policy's models list (unless Mock.ModelProviders says
	// otherwise): a re-route that sent a model unchanged to another provider fails.
	CheckModels bool
	// Clock is the server's clock (nil: the system clock).
	Clock policy.Clock
	// Logs receives the server's JSON logs (nil: discarded).
	Logs io.Writer
}

// Stack is a running mock LLM, llm-bulkhead server and Envoy simulator.
type Stack struct {
	App     *app.App
	Sim     *envoysim.Sim
	Filter  envoysim.FilterConfig
	Mock    *mock.Server
	MockURL string
	// Upstream forwards admitted requests to the mock LLM.
	Upstream *envoysim.HTTPUpstream

	mockCancel context.CancelFunc
	mockDone   chan error
	proxy      *envoysim.ProxyServer
}

// Start starts a stack on loopback ports chosen by the kernel.
func Start(o Options) (*Stack, error) {
	s := &Stack{}
	ok := false
	defer func() {
		if !ok {
			s.Close()
		}
	}()
	env := o.Env
	if env == nil {
		env = []string{}
	}
	if !o.NoMock {
		if o.CheckModels && len(o.Mock.ModelProviders) == 0 {
			p, _, err := app.LoadPolicy(o.PolicyPath, env)
			if err != nil {
				return nil, err
			}
			for _, m := range p.Models {
				if m.Provider != "" {
					o.Mock.ModelProviders = append(o.Mock.ModelProviders, mock.ModelProvider{Match: m.Match, Provider: m.Provider})
				}
			}
		}
		m, err := mock.New(o.Mock)
		if err != nil {
			return nil, fmt.Errorf("mockllm: %w", err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ctx, cancel := context.WithCancel(context.Background())
		s.Mock, s.MockURL, s.mockCancel, s.mockDone = m, "http://"+ln.Addr().String(), cancel, make(chan error, 1)
		go func() { s.mockDone <- m.Run(ctx, ln, time.Second) }()
	}
	logs := o.Logs
	if logs == nil {
		logs = io.Discard
	}
	a, err := app.New(app.Options{ConfigPath: o.PolicyPath, GRPCAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0",
		Env: env, LogOutput: logs, Clock: o.Clock, Watch: o.Watch})
	if err != nil {
		return nil, err
	}
	if err := a.Start(); err != nil {
		return nil, err
	}
	s.App = a
	p, _, err := app.LoadPolicy(o.PolicyPath, env)
	if err != nil {
		return nil, err
	}
	if s.Filter, err = FilterFromPolicy(p); err != nil {
		return nil, err
	}
	if o.Filter != nil {
		o.Filter(&s.Filter)
	}
	if s.Sim, err = envoysim.New(a.GRPCAddr(), s.Filter); err != nil {
		return nil, err
	}
	if s.MockURL != "" {
		if s.Upstream, err = envoysim.NewHTTPUpstream(s.MockURL); err != nil {
			return nil, err
		}
	}
	ok = true
	return s, nil
}

// FilterFromPolicy derives the simulator's filter settings from the ext_proc filter that
// `llm-bulkhead envoy-config` prints for p, so tests run the configuration users deploy.
func FilterFromPolicy(p *config.Policy) (envoysim.FilterConfig, error) {
	out, err := app.EnvoyConfig(p, "llm_bulkhead", "127.0.0.1:9002")
	if err != nil {
		return envoysim.FilterConfig{}, err
	}
	var doc struct {
		HTTPFilters []struct {
			TypedConfig map[string]any `yaml:"typed_config"`
		} `yaml:"http_filters"`
	}
	if err := yaml.Unmarshal(out, &doc); err != nil {
		return envoysim.FilterConfig{}, err
	}
	if len(doc.HTTPFilters) == 0 {
		return envoysim.FilterConfig{}, errors.New("envoy-config printed no filter")
	}
	tc := doc.HTTPFilters[0].TypedConfig
	delete(tc, "@type")
	js, err := json.Marshal(tc)
	if err != nil {
		return envoysim.FilterConfig{}, err
	}
	var ep extprocfilterv3.ExternalProcessor
	if err := (protojson.UnmarshalOptions{DiscardUnknown: false}).Unmarshal(js, &ep); err != nil {
		return envoysim.FilterConfig{}, err
	}
	fc, err := envoysim.FromProto(&ep)
	if err != nil {
		return envoysim.FilterConfig{}, err
	}
	// Envoy routes that carry LLM bodies need a buffer as large as the policy allows.
	fc.BufferLimit = int(p.Envoy.MaxRequestBody)
	return fc, nil
}

// UpstreamFilter reads the upstream (per-attempt) ext_proc filter of envoy/upstream.yaml's
// provider cluster into the simulator's filter settings, as Envoy loads it.
func UpstreamFilter() (envoysim.FilterConfig, error) {
	return envoysim.UpstreamFilterFromClusterYAML(envoy.Upstream)
}

// Do runs one request through the simulator to the mock LLM.
func (s *Stack) Do(ctx context.Context, req *envoysim.Request) (*envoysim.Result, error) {
	return s.Sim.RoundTrip(ctx, req, s.Upstream)
}

// ProxyURL serves the simulator's HTTP face (started on first use) and returns its base URL,
// for real HTTP clients and SDKs.
func (s *Stack) ProxyURL() (string, error) {
	if s.proxy == nil {
		p, err := envoysim.NewProxy(s.Sim, s.MockURL, s.Filter)
		if err != nil {
			return "", err
		}
		if s.proxy, err = envoysim.ServeProxy(p, "127.0.0.1:0"); err != nil {
			return "", err
		}
	}
	return s.proxy.URL, nil
}

// AdminURL is the server's admin base URL.
func (s *Stack) AdminURL() string { return "http://" + s.App.AdminAddr() }

// Get fetches an admin path and decodes its JSON into v.
func (s *Stack) Get(path string, v any) error {
	resp, err := http.Get(s.AdminURL() + path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

// Scrape returns the server's /metrics, in the Prometheus text format.
func (s *Stack) Scrape() (string, error) {
	resp, err := http.Get(s.AdminURL() + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
	return string(b), err
}

// Close stops everything, draining the server.
func (s *Stack) Close() {
	if s.proxy != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = s.proxy.Close(ctx)
		cancel()
	}
	if s.Sim != nil {
		_ = s.Sim.Close()
	}
	if s.Upstream != nil {
		s.Upstream.CloseIdleConnections()
	}
	if s.App != nil {
		s.App.Shutdown(context.Background())
	}
	if s.mockCancel != nil {
		s.mockCancel()
		<-s.mockDone
	}
}
