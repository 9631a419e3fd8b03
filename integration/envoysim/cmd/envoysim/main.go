// Command envoysim serves an HTTP listener that behaves like Envoy with the
// ext_proc filter in front of one upstream, so requests can be tried
// against an ext_proc server without running Envoy:
//
//	envoysim -extproc 127.0.0.1:9002 -upstream http://127.0.0.1:8080 -listen 127.0.0.1:10000 \
//	    -request-body-mode BUFFERED -response-body-mode STREAMED
//	curl -N http://127.0.0.1:10000/v1/chat/completions -d '{"model":"m","stream":true}'
//
// -filter-config reads an Envoy ExternalProcessor filter config (YAML or
// JSON: the typed_config body of envoy.filters.http.ext_proc, with or without its
// "@type", or the output of `llm-bulkhead envoy-config`) instead of the
// mode flags. -cluster-config reads the ext_proc cluster the same way (an Envoy
// Cluster, or the output of `llm-bulkhead envoy-config`, whose clusters[0] is
// taken) instead of -extproc: a pipe address for a unix socket, and its TLS
// transport socket (CA, SAN match, SNI, client certificate for mutual TLS).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "envoysim:", err)
		os.Exit(1)
	}
}

// run parses args, serves until ctx is done, and reports the listening URL
// on out.
func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("envoysim", flag.ContinueOnError)
	extproc := fs.String("extproc", "127.0.0.1:9002", "gRPC address of the ext_proc server (host:port or unix:///path), plaintext")
	clusterConfig := fs.String("cluster-config", "", "Envoy cluster for the ext_proc server (YAML or JSON; envoy-config's output takes its first cluster); overrides -extproc")
	upstream := fs.String("upstream", "http://127.0.0.1:8080", "base URL of the upstream")
	listen := fs.String("listen", "127.0.0.1:10000", "HTTP listen address")
	filterConfig := fs.String("filter-config", "", "Envoy ExternalProcessor config file (YAML or JSON); overrides the mode flags")
	reqHdr := fs.String("request-header-mode", "SEND", "SEND or SKIP")
	respHdr := fs.String("response-header-mode", "SEND", "SEND or SKIP")
	reqBody := fs.String("request-body-mode", "NONE", "NONE, STREAMED, BUFFERED or BUFFERED_PARTIAL")
	respBody := fs.String("response-body-mode", "NONE", "NONE, STREAMED, BUFFERED or BUFFERED_PARTIAL")
	reqTrl := fs.String("request-trailer-mode", "SKIP", "SEND or SKIP")
	respTrl := fs.String("response-trailer-mode", "SKIP", "SEND or SKIP")
	msgTimeout := fs.Duration("message-timeout", envoysim.DefaultMessageTimeout, "message_timeout")
	maxMsgTimeout := fs.Duration("max-message-timeout", 0, "max_message_timeout (0: overrides ignored)")
	failOpen := fs.Bool("failure-mode-allow", false, "failure_mode_allow")
	allowOverride := fs.Bool("allow-mode-override", false, "allow_mode_override")
	statusOnError := fs.Int("status-on-error", envoysim.DefaultStatusOnError, "status_on_error")
	observability := fs.Bool("observability-mode", false, "observability_mode")
	bufferLimit := fs.Int("buffer-limit", envoysim.DefaultBufferLimit, "per_connection_buffer_limit_bytes")
	graceful := fs.Bool("graceful-close", false, "runtime flag ext_proc_graceful_grpc_close: half-close instead of reset")
	fwdNS := fs.String("forwarding-namespaces", "", "comma-separated metadata_options.forwarding_namespaces.untyped")
	recvNS := fs.String("receiving-namespaces", "", "comma-separated metadata_options.receiving_namespaces.untyped")
	reqAttrs := fs.String("request-attributes", "", "comma-separated request_attributes")
	respAttrs := fs.String("response-attributes", "", "comma-separated response_attributes")
	routeHeader := fs.String("route-header", "", "request header whose value selects an upstream from -routes")
	routes := fs.String("routes", "", "comma-separated value=baseURL pairs for -route-header")
	retries := fs.Int("retries", 0, "route retry_policy num_retries on reset, connect-failure, 503 and 429, as envoy/envoy.yaml (0: no retries)")
	upstreamFilter := fs.String("upstream-filter-config", "", "Envoy cluster whose upstream http_filters hold an ext_proc filter, run once per attempt (YAML or JSON, e.g. envoy/upstream.yaml)")
	if err := fs.Parse(args); err != nil {
		return err
	}

	var cfg envoysim.FilterConfig
	if *filterConfig != "" {
		c, err := loadFilterConfig(*filterConfig)
		if err != nil {
			return err
		}
		cfg = c
	} else {
		var errs []error
		parseH := func(s string) envoysim.HeaderMode {
			m, err := envoysim.ParseHeaderMode(s)
			errs = append(errs, err)
			return m
		}
		parseB := func(s string) envoysim.BodyMode {
			m, err := envoysim.ParseBodyMode(s)
			errs = append(errs, err)
			return m
		}
		cfg = envoysim.FilterConfig{
			Mode: envoysim.ProcessingMode{
				RequestHeader: parseH(*reqHdr), ResponseHeader: parseH(*respHdr),
				RequestBody: parseB(*reqBody), ResponseBody: parseB(*respBody),
				RequestTrailer: parseH(*reqTrl), ResponseTrailer: parseH(*respTrl),
			},
			MessageTimeout: *msgTimeout, MaxMessageTimeout: *maxMsgTimeout,
			FailureModeAllow: *failOpen, AllowModeOverride: *allowOverride,
			StatusOnError: *statusOnError, ObservabilityMode: *observability,
			ForwardingNamespaces: splitList(*fwdNS), ReceivingNamespaces: splitList(*recvNS),
			RequestAttributes: splitList(*reqAttrs), ResponseAttributes: splitList(*respAttrs),
		}
		if err := errors.Join(errs...); err != nil {
			return err
		}
	}
	cfg.BufferLimit = *bufferLimit
	cfg.GracefulClose = *graceful

	cluster := envoysim.Cluster{Target: *extproc}
	if *clusterConfig != "" {
		c, err := loadCluster(*clusterConfig)
		if err != nil {
			return err
		}
		cluster = c
	}
	sim, err := envoysim.NewCluster(cluster, cfg)
	if err != nil {
		return err
	}
	defer func() { _ = sim.Close() }()
	proxy, err := envoysim.NewProxy(sim, *upstream, cfg)
	if err != nil {
		return err
	}
	if *routeHeader != "" {
		proxy.Upstream().RouteHeader = *routeHeader
		proxy.Upstream().Routes = map[string]string{}
		for _, pair := range splitList(*routes) {
			k, v, ok := strings.Cut(pair, "=")
			if !ok {
				return fmt.Errorf("-routes entry %q: want value=baseURL", pair)
			}
			proxy.Upstream().Routes[k] = v
		}
	}
	if *upstreamFilter != "" {
		data, err := os.ReadFile(*upstreamFilter)
		if err != nil {
			return err
		}
		uc, err := envoysim.UpstreamFilterFromClusterYAML(data)
		if err != nil {
			return fmt.Errorf("-upstream-filter-config: %w", err)
		}
		if err := proxy.SetUpstreamFilter(uc); err != nil {
			return err
		}
	}
	if *retries > 0 {
		// envoy/envoy.yaml's retry_policy: 0.25 s back-off (Envoy's grows to 2 s, jittered), a
		// retry-after of up to 5 s honoured.
		proxy.SetRetry(envoysim.RetryPolicy{NumRetries: *retries, RetriableStatusCodes: []int{503, 429}, OnFailure: true,
			BackOff: 250 * time.Millisecond, MaxRetryAfter: 5 * time.Second})
	}
	srv, err := envoysim.ServeProxy(proxy, *listen)
	if err != nil {
		return err
	}
	security := "plaintext"
	if cluster.TLS != nil {
		security = "TLS"
	}
	fmt.Fprintf(out, "envoysim listening on %s (ext_proc %s over %s, upstream %s)\n", srv.URL, cluster.Target, security, *upstream)
	<-ctx.Done()
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = srv.Close(shutdown)
	proxy.Upstream().CloseIdleConnections()
	return err
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func loadFilterConfig(path string) (envoysim.FilterConfig, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return envoysim.FilterConfig{}, err
	}
	var v any
	if err := yaml.Unmarshal(raw, &v); err != nil {
		return envoysim.FilterConfig{}, fmt.Errorf("%s: %w", path, err)
	}
	v = extProcConfig(v)
	js, err := json.Marshal(v)
	if err != nil {
		return envoysim.FilterConfig{}, fmt.Errorf("%s: %w", path, err)
	}
	p := &extprocfilterv3.ExternalProcessor{}
	if err := protojson.Unmarshal(js, p); err != nil {
		return envoysim.FilterConfig{}, fmt.Errorf("%s: %w", path, err)
	}
	c, err := envoysim.FromProto(p)
	if err != nil {
		return envoysim.FilterConfig{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// extProcConfig accepts the ExternalProcessor message itself, a typed_config with its "@type",
// or a document with http_filters (as `llm-bulkhead envoy-config` prints), and returns the
// ExternalProcessor part.
func extProcConfig(v any) any {
	m, ok := v.(map[string]any)
	if !ok {
		return v
	}
	if filters, ok := m["http_filters"].([]any); ok {
		for _, f := range filters {
			fm, _ := f.(map[string]any)
			if fm["name"] == "envoy.filters.http.ext_proc" {
				return extProcConfig(fm["typed_config"])
			}
		}
	}
	if _, ok := m["@type"]; ok {
		c := make(map[string]any, len(m))
		for k, val := range m {
			if k != "@type" {
				c[k] = val
			}
		}
		return c
	}
	return m
}

// loadCluster reads an Envoy cluster, or the first cluster of a document with clusters (as
// `llm-bulkhead envoy-config` prints).
func loadCluster(path string) (envoysim.Cluster, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return envoysim.Cluster{}, err
	}
	var v any
	if err := yaml.Unmarshal(raw, &v); err != nil {
		return envoysim.Cluster{}, fmt.Errorf("%s: %w", path, err)
	}
	if m, ok := v.(map[string]any); ok {
		if list, ok := m["clusters"].([]any); ok {
			if len(list) == 0 {
				return envoysim.Cluster{}, fmt.Errorf("%s: clusters is empty", path)
			}
			v = list[0]
		}
	}
	one, err := yaml.Marshal(v)
	if err != nil {
		return envoysim.Cluster{}, fmt.Errorf("%s: %w", path, err)
	}
	c, err := envoysim.ClusterFromYAML(one)
	if err != nil {
		return envoysim.Cluster{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}
