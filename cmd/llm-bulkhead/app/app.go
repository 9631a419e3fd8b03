// Package app assembles the llm-bulkhead server: policy loading and reloading, the policy
// engine, the ext_proc gRPC service with gRPC health (over TCP or a unix socket, plaintext, TLS or
// mutual TLS with certificates reloaded as they rotate), and the admin HTTP listener. The
// llm-bulkhead command runs it; tests and the demo programs start it in-process.
package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/internal/throttle"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
	"github.com/llm-bulkhead/llm-bulkhead/policy/statefile"
)

// Options configure an App. Zero values take the policy's settings.
type Options struct {
	// ConfigPath is the policy file; empty runs the embedded examples/policy.yaml.
	ConfigPath string
	// GRPCAddr and AdminAddr override the policy's server.grpc_addr and server.admin_addr.
	GRPCAddr  string
	AdminAddr string
	// TLS overrides the policy's server.tls_cert, server.tls_key and server.tls_client_ca, each
	// field that is set on its own.
	TLS TLSFiles
	// AdminInsecure serves an admin address that is not loopback without an admin token. Without
	// it, New refuses such an address with an *ExposedAdminError unless the token is set.
	AdminInsecure bool
	// AdminAllowedHosts are host names, besides localhost and IP addresses, for which the admin
	// listener serves /admin/* and the dashboard to requests without the admin token (any port;
	// ParseAdminHosts reads the flag). Requests for any other Host are refused with 403, so that
	// a web page cannot read them through DNS rebinding.
	AdminAllowedHosts []string
	// LogLevel overrides the policy's server.log_level.
	LogLevel string
	// Env is the environment for LLM_BULKHEAD_ overrides and the admin token; nil uses
	// os.Environ().
	Env []string
	// LogOutput receives JSON logs; nil means os.Stderr.
	LogOutput io.Writer
	// Clock defaults to the system clock. The engine, the state file and the check of the
	// ext_proc listener's certificates (one not valid now is not rotated in) read it.
	Clock policy.Clock
	// Watch reloads the policy file when it changes on disk (and on SIGHUP, see Run).
	Watch bool
	// StateFile overrides the policy's state.file (the --state-file flag).
	StateFile string
	// Build describes the binary for llm_bulkhead_build_info and the start log line; the zero
	// value reads it from the Go build record (ReadBuildInfo("")).
	Build BuildInfo
	// MemoryLimit is the process's memory limit in bytes, which sizes the default of
	// server.max_buffered_body_bytes. 0 finds it: GOMEMLIMIT, else the process's memory cgroup's
	// limit. Negative: no limit.
	MemoryLimit int64
}

// App is a running llm-bulkhead server. Safe for concurrent use.
type App struct {
	opts     Options
	log      *slog.Logger
	level    *slog.LevelVar
	registry *prometheus.Registry
	engine   *policy.Engine
	// engineMetrics are the engine's metrics and decision counts (its Recorder).
	engineMetrics *observe.Metrics
	extproc       *extproc.Server
	grpc          *grpc.Server
	grpcOpts      []grpc.ServerOption
	health        *health.Server
	admin         *http.Server
	grpcLn        net.Listener
	adminLn       net.Listener
	metrics       *appMetrics

	policyName string
	draining   atomic.Bool
	ready      atomic.Bool
	reloadMu   sync.Mutex
	current    atomic.Pointer[config.Policy]
	adminToken string
	// guardReads makes the admin GET endpoints other than /metrics, /healthz and /readyz require
	// the token: set when the admin listener is reachable beyond this machine.
	guardReads bool
	// adminUnguarded is a listener beyond loopback with nothing guarding it (--admin-insecure).
	adminUnguarded bool
	// adminHosts are Options.AdminAllowedHosts, normalised; hostRefused lets a request for
	// another Host be logged once a minute.
	adminHosts  map[string]bool
	hostRefused throttle.Gate

	serveErr chan error
	stopOnce sync.Once
	watcher  *watcher
	// keysWatcher reloads the policy when tenants.keys_file changes; nil without one.
	keysWatcher *watcher
	// tracing exports requests' spans; nil when the policy does not trace.
	tracing *tracingPipeline
	// state keeps every budget's windows in the state file; nil without one.
	state *statefile.Persister
	// tls is the ext_proc listener's TLS material; nil for plaintext.
	tls *listenerTLS
	// memLimit is the memory limit the server sized its defaults from (0: none), found in
	// memLimitFrom (GOMEMLIMIT, cgroup, option or none).
	memLimit     int64
	memLimitFrom string
}

// ListenerError is an ext_proc listener that cannot be set up as configured: a malformed
// address, or TLS files that are missing, unreadable or do not form a certificate and its key.
// The process exits with status 2 for it.
type ListenerError struct{ Err error }

func (e *ListenerError) Error() string { return "ext_proc listener: " + e.Err.Error() }
func (e *ListenerError) Unwrap() error { return e.Err }

// ConfigError is a policy that cannot be loaded; the process exits with status 2 for it.
type ConfigError struct{ Err error }

func (e *ConfigError) Error() string { return e.Err.Error() }
func (e *ConfigError) Unwrap() error { return e.Err }

// LoadPolicy loads the policy at path (the embedded default when path is empty) with env
// overrides.
func LoadPolicy(path string, env []string) (*config.Policy, string, error) {
	if path == "" {
		p, err := config.Load(examples.DefaultPolicyName, examples.DefaultPolicy, env)
		return p, examples.DefaultPolicyName, err
	}
	p, err := config.LoadFile(path, env)
	return p, path, err
}

// New loads the policy and builds the server without listening yet.
func New(o Options) (*App, error) {
	if o.Env == nil {
		o.Env = os.Environ()
	}
	if o.LogOutput == nil {
		o.LogOutput = os.Stderr
	}
	if o.Clock == nil {
		o.Clock = policy.SystemClock{}
	}
	a := &App{opts: o, level: new(slog.LevelVar), registry: prometheus.NewRegistry(), serveErr: make(chan error, 2),
		adminHosts: map[string]bool{}}
	for _, h := range o.AdminAllowedHosts {
		a.adminHosts[normalHost(h)] = true
	}
	a.log = slog.New(slog.NewJSONHandler(o.LogOutput, &slog.HandlerOptions{Level: a.level}))

	p, name, err := LoadPolicy(o.ConfigPath, o.Env)
	if err != nil {
		return nil, &ConfigError{Err: err}
	}
	a.policyName = name
	if err := a.setLevel(p); err != nil {
		return nil, &ConfigError{Err: err}
	}
	a.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	a.metrics = newAppMetrics(a.registry)
	if o.Build == (BuildInfo{}) {
		a.opts.Build = ReadBuildInfo("")
	}
	registerBuildInfo(a.registry, a.opts.Build)
	switch {
	case o.MemoryLimit == 0:
		a.memLimit, a.memLimitFrom = memoryLimit()
	case o.MemoryLimit > 0:
		a.memLimit, a.memLimitFrom = o.MemoryLimit, "option"
	default:
		a.memLimitFrom = "none"
	}
	engMetrics := observe.NewMetrics(a.log)
	eng, err := policy.NewEngine(p, policy.Options{Clock: o.Clock, Recorder: engMetrics, Logger: a.log, Cluster: true})
	if err != nil {
		return nil, &ConfigError{Err: fmt.Errorf("%s: %w", name, err)}
	}
	a.registry.MustRegister(engMetrics.Collectors(eng)...)
	a.engine, a.engineMetrics = eng, engMetrics
	a.current.Store(p)
	if err := a.openState(p); err != nil {
		_ = eng.Close(context.Background())
		return nil, err
	}
	a.adminToken = lookupEnv(o.Env, p.Admin.TokenEnv)
	if _, adminAddr := a.listenAddrs(p); !isLoopback(adminAddr) {
		switch {
		case a.adminToken != "":
			a.guardReads = true
		case o.AdminInsecure:
			a.adminUnguarded = true
		default:
			_ = eng.Close(context.Background())
			return nil, &ExposedAdminError{Addr: adminAddr, TokenEnv: p.Admin.TokenEnv}
		}
	}
	tracing, err := a.startTracing(p)
	if err != nil {
		_ = eng.Close(context.Background())
		return nil, err
	}
	fail := func(err error) (*App, error) {
		if a.extproc != nil {
			a.extproc.Close()
		}
		a.stopTracing(context.Background())
		_ = eng.Close(context.Background())
		return nil, &ListenerError{Err: err}
	}
	grpcAddr, _ := a.listenAddrs(p)
	if _, _, err := config.SplitListenAddr(grpcAddr); err != nil {
		return fail(err)
	}
	files := a.tlsFiles(p)
	if err := files.check(); err != nil {
		return fail(err)
	}
	a.extproc = extproc.NewServer(eng, extproc.Options{Logger: a.log, Tracing: tracing, MemoryLimit: a.memLimit})
	a.registry.MustRegister(a.extproc.Collectors()...)
	gopts := grpcOptions(p, a.extproc)
	if files.Cert != "" {
		if a.tls, err = newListenerTLS(files, a.log, a.registry, o.Clock.Now); err != nil {
			return fail(err)
		}
		gopts = append(gopts, grpc.Creds(a.tls.credentials()))
	}

	// The gRPC server is made by Start: it starts its stream workers as soon as it exists.
	a.grpcOpts = gopts
	a.health = health.NewServer()
	a.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	a.health.SetServingStatus(extprocv3.ExternalProcessor_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_NOT_SERVING)
	a.admin = &http.Server{Handler: a.adminHandler(), ReadHeaderTimeout: 10 * time.Second}
	return a, nil
}

// keepaliveMinTime is the shortest interval at which Envoy may ping the server: a client that
// pings more often is sent GOAWAY (too_many_pings). Envoy's connection_keepalive interval on the
// llm_bulkhead cluster must not be shorter.
const keepaliveMinTime = 5 * time.Second

// grpcOptions are the gRPC server's settings from the policy, for serving srv; they apply until
// restart.
func grpcOptions(p *config.Policy, srv *extproc.Server) []grpc.ServerOption {
	// Envoy sends a buffered body in one message; leave room for headers and metadata.
	maxMsg := int(p.Envoy.MaxRequestBody) + 1<<20
	s := p.Server
	return []grpc.ServerOption{
		// The server's codec counts each buffered request body against
		// server.max_buffered_body_bytes before copying it out of gRPC's receive buffers.
		grpc.MaxRecvMsgSize(maxMsg), grpc.MaxSendMsgSize(maxMsg), srv.ServerOption(),
		// Streams that go silent are ended, not only released.
		extproc.EndableStreams(),
		// The ext_proc service refuses streams past server.max_streams over all connections;
		// each connection may hold server.max_streams_per_connection of them, so that one
		// connection cannot take them all. gRPC announces the bound in the connection's HTTP/2
		// settings and refuses a stream beyond it (REFUSED_STREAM).
		grpc.MaxConcurrentStreams(uint32(s.MaxStreamsPerConnection)),
		// Pings from Envoy (even between requests) are welcome, just not a flood of them.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: keepaliveMinTime, PermitWithoutStream: true}),
		// Pings from the server find a dead Envoy connection, whose streams then end and release
		// what their requests hold.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: s.KeepaliveTime.D(), Timeout: s.KeepaliveTimeout.D()}),
		// Streams run on goroutines kept between streams: a fresh goroutine per stream starts
		// with a small stack and grows it (a copy of the whole stack each time) on the way down
		// to admission, which cost more per stream than admission itself. Streams past the pool
		// get a fresh goroutine as before.
		grpc.NumStreamWorkers(uint32(min(streamWorkers, s.MaxStreams))),
	}
}

// streamWorkers is how many goroutines serve streams and are kept between them. An idle worker
// waits its turn behind all the others, and the garbage collector shrinks the stack of one that
// waited through a collection, so a larger pool gives back less: 64 keeps the stack growths out
// of the profile at 8 concurrent streams, where 256 did not.
const streamWorkers = 64

func (a *App) setLevel(p *config.Policy) error {
	lv := p.Server.LogLevel
	if a.opts.LogLevel != "" {
		lv = a.opts.LogLevel
	}
	var l slog.Level
	if err := l.UnmarshalText([]byte(lv)); err != nil {
		return fmt.Errorf("log level %q is not one of debug, info, warn, error", lv)
	}
	a.level.Set(l)
	return nil
}

func lookupEnv(env []string, name string) string {
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok && k == name {
			return v
		}
	}
	return ""
}

// tlsFiles returns the listener's TLS files: each flag where given, else the policy's key.
func (a *App) tlsFiles(p *config.Policy) TLSFiles {
	f := TLSFiles{Cert: p.Server.TLSCert, Key: p.Server.TLSKey, ClientCA: p.Server.TLSClientCA}
	if a.opts.TLS.Cert != "" {
		f.Cert = a.opts.TLS.Cert
	}
	if a.opts.TLS.Key != "" {
		f.Key = a.opts.TLS.Key
	}
	if a.opts.TLS.ClientCA != "" {
		f.ClientCA = a.opts.TLS.ClientCA
	}
	return f
}

// tlsMode names the listener's security for the start log line: plaintext, tls or mutual_tls.
func (a *App) tlsMode() string {
	switch {
	case a.tls == nil:
		return "plaintext"
	case a.tls.mutual():
		return "mutual_tls"
	}
	return "tls"
}

// Engine returns the policy engine.
func (a *App) Engine() *policy.Engine { return a.engine }

// Decisions returns the engine's admissions and refusals per feature of the live policy since
// the process started.
func (a *App) Decisions() []observe.FeatureDecisions {
	return a.engineMetrics.Decisions(a.engine.Snapshot())
}

// ExtProc returns the ext_proc service.
func (a *App) ExtProc() *extproc.Server { return a.extproc }

// Registry returns the Prometheus registry served at /metrics.
func (a *App) Registry() *prometheus.Registry { return a.registry }

// Logger returns the server's logger.
func (a *App) Logger() *slog.Logger { return a.log }

// GRPCAddr returns the ext_proc listen address once Start has run: host:port, or unix:///path
// for a unix socket (both usable as gRPC targets).
func (a *App) GRPCAddr() string { return listenerAddr(a.grpcLn) }

// AdminAddr returns the admin listen address once Start has run.
func (a *App) AdminAddr() string { return a.adminLn.Addr().String() }

// listenAddrs returns the addresses to listen on: the flags' where given, else the policy's.
func (a *App) listenAddrs(p *config.Policy) (grpcAddr, adminAddr string) {
	grpcAddr, adminAddr = p.Server.GRPCAddr, p.Server.AdminAddr
	if a.opts.GRPCAddr != "" {
		grpcAddr = a.opts.GRPCAddr
	}
	if a.opts.AdminAddr != "" {
		adminAddr = a.opts.AdminAddr
	}
	return grpcAddr, adminAddr
}

// Start listens on both addresses and serves in the background.
func (a *App) Start() error {
	grpcAddr, adminAddr := a.listenAddrs(a.current.Load())
	var err error
	if a.grpcLn, err = listenGRPC(grpcAddr); err != nil {
		return fmt.Errorf("ext_proc listener: %w", err)
	}
	if a.adminLn, err = net.Listen("tcp", adminAddr); err != nil {
		a.grpcLn.Close()
		return fmt.Errorf("admin listener: %w", err)
	}
	a.grpc = grpc.NewServer(a.grpcOpts...)
	extprocv3.RegisterExternalProcessorServer(a.grpc, a.extproc)
	healthpb.RegisterHealthServer(a.grpc, a.health)
	go func() { a.serveErr <- a.grpc.Serve(a.grpcLn) }()
	go func() {
		if err := a.admin.Serve(a.adminLn); !errors.Is(err, http.ErrServerClosed) {
			a.serveErr <- err
		}
	}()
	if a.opts.Watch && a.opts.ConfigPath != "" {
		w, err := newWatcher(a.opts.ConfigPath, 250*time.Millisecond, a.log, func() { a.Reload("file changed") })
		if err != nil {
			a.log.Error("cannot watch the policy file; reload with SIGHUP instead", "file", a.opts.ConfigPath, "err", err)
		} else {
			a.watcher = w
		}
		if keys := a.current.Load().Tenants.KeysFile; keys != "" {
			// A reload reads the keys again with the policy: a new key is taken, a file with a
			// line that cannot be read keeps the running policy and its keys.
			w, err := newWatcher(keys, 250*time.Millisecond, a.log, func() { a.Reload("keys file changed") })
			if err != nil {
				a.log.Error("cannot watch the keys file; reload with SIGHUP instead", "file", keys, "err", err)
			} else {
				a.keysWatcher = w
			}
		}
	}
	if a.tls != nil {
		a.tls.watch(tlsPollInterval)
	}
	if a.state != nil {
		a.state.Start()
	}
	if st := a.engine.Cluster(); st != nil {
		// Give the first registration in Redis a moment, so that the first requests share
		// limits; if Redis is not there yet, serve as cluster.on_unavailable says meanwhile.
		c := a.current.Load().Cluster
		ctx, cancel := context.WithTimeout(context.Background(), c.DialTimeout.D()+c.WriteTimeout.D())
		if err := st.WaitRegistration(ctx); err != nil {
			a.log.Warn("Redis is not reachable yet: admissions follow cluster.on_unavailable until it is; retrying with backoff",
				"error", err, "hint", cluster.Hint(err), "on_unavailable", c.OnUnavailable, "addresses", c.Addresses, "limits", startLimits(c))
		}
		cancel()
	}
	a.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	a.health.SetServingStatus(extprocv3.ExternalProcessor_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	a.ready.Store(true)
	if a.adminUnguarded {
		a.log.Warn("the admin listener is reachable beyond this machine and has no token (--admin-insecure): "+
			"anyone who can connect reads the policy, compartments and breakers", "admin_addr", a.AdminAddr())
	}
	if w := NoLimitsWarning(a.current.Load()); w != "" {
		a.log.Warn(w, "policy", a.policyName)
	}
	a.log.Info("llm-bulkhead listening", "version", a.opts.Build.Version, "commit", a.opts.Build.CommitString(),
		"grpc_addr", a.GRPCAddr(), "grpc_tls", a.tlsMode(), "admin_addr", a.AdminAddr(),
		"policy", a.policyName, "generation", a.engine.Snapshot().Gen(),
		"compartments", len(a.engine.Compartments()), "fast_marshal", extproc.FastMarshal(),
		"max_buffered_body_bytes", a.extproc.Settings().MaxBufferedBodyBytes, "memory_limit", a.memLimit, "memory_limit_from", a.memLimitFrom,
		"go_memory_limit", goMemoryLimit())
	return nil
}

// Errors reports a listener that stopped serving unexpectedly.
func (a *App) Errors() <-chan error { return a.serveErr }

// Ready reports whether the server takes traffic: a policy is loaded and it is not draining.
// It never depends on breaker state.
func (a *App) Ready() bool { return a.ready.Load() && !a.draining.Load() }

// Reload re-reads the policy file and swaps the new policy in if it is valid; otherwise the
// running policy stays and every problem is logged and counted.
func (a *App) Reload(why string) error {
	a.reloadMu.Lock()
	defer a.reloadMu.Unlock()
	refuse := func(err error) error {
		a.metrics.reloads.WithLabelValues("error").Inc()
		a.metrics.reloadErrors.Inc()
		var problems config.Errors
		if errors.As(err, &problems) {
			// One line per problem, in the order validate prints them, each saying how many
			// there are, so that a log search for one finds the rest.
			for _, pr := range problems {
				a.log.Error("policy reload refused; keeping the running policy", "why", why, "problems", len(problems), "problem", pr.String())
			}
		} else {
			a.log.Error("policy reload refused; keeping the running policy", "why", why, "err", err)
		}
		return err
	}
	p, name, err := LoadPolicy(a.opts.ConfigPath, a.opts.Env)
	if err == nil {
		err = a.checkFixed(p)
	}
	if err != nil {
		return refuse(err)
	}
	diff, err := a.engine.Apply(p)
	if err != nil {
		return refuse(err)
	}
	a.current.Store(p)
	if err := a.setLevel(p); err != nil {
		a.log.Error("log level unchanged", "err", err)
	}
	a.metrics.reloads.WithLabelValues("success").Inc()
	a.metrics.lastReload.SetToCurrentTime()
	attrs := []any{"why", why, "policy", name, "generation", a.engine.Snapshot().Gen(), "diff", diff.String()}
	if f := p.Tenants.KeysFile; f != "" {
		attrs = append(attrs, "keys_file", f, "keys_from_file", p.Tenants.KeysFromFile().Len())
	}
	a.log.Info("policy reloaded", attrs...)
	return nil
}

// checkFixed refuses reloads that change settings only a restart can apply.
func (a *App) checkFixed(p *config.Policy) error {
	cur := a.current.Load()
	var problems []string
	if a.opts.GRPCAddr == "" && p.Server.GRPCAddr != cur.Server.GRPCAddr {
		problems = append(problems, "server.grpc_addr")
	}
	if a.opts.AdminAddr == "" && p.Server.AdminAddr != cur.Server.AdminAddr {
		problems = append(problems, "server.admin_addr")
	}
	for _, k := range []struct{ key, flag, now, was string }{
		{"server.tls_cert", a.opts.TLS.Cert, p.Server.TLSCert, cur.Server.TLSCert},
		{"server.tls_key", a.opts.TLS.Key, p.Server.TLSKey, cur.Server.TLSKey},
		{"server.tls_client_ca", a.opts.TLS.ClientCA, p.Server.TLSClientCA, cur.Server.TLSClientCA},
	} {
		// The files' contents are reloaded when they change; which files, only on restart.
		if k.flag == "" && k.now != k.was {
			problems = append(problems, k.key)
		}
	}
	if p.Tenants.KeysFile != cur.Tenants.KeysFile {
		// Its contents are read on every reload; which file is watched, only on restart.
		problems = append(problems, "tenants.keys_file")
	}
	if p.Envoy.MaxRequestBody != cur.Envoy.MaxRequestBody {
		problems = append(problems, "envoy.max_request_body")
	}
	if p.Server.MaxStreams != cur.Server.MaxStreams {
		problems = append(problems, "server.max_streams")
	}
	if p.Server.MaxStreamsPerConnection != cur.Server.MaxStreamsPerConnection {
		problems = append(problems, "server.max_streams_per_connection")
	}
	if p.Server.KeepaliveTime != cur.Server.KeepaliveTime {
		problems = append(problems, "server.keepalive_time")
	}
	if p.Server.KeepaliveTimeout != cur.Server.KeepaliveTimeout {
		problems = append(problems, "server.keepalive_timeout")
	}
	problems = append(problems, a.stateFixed(p, cur)...)
	if !reflect.DeepEqual(p.Cluster, cur.Cluster) {
		problems = append(problems, "cluster")
	}
	if !reflect.DeepEqual(p.Tracing, cur.Tracing) {
		problems = append(problems, "tracing")
	}
	if len(problems) > 0 {
		return fmt.Errorf("%s changed: these take effect only on restart", strings.Join(problems, ", "))
	}
	return nil
}

// Shutdown drains: it reports not ready (gRPC health NOT_SERVING, /readyz 503), stops accepting
// new streams, lets in-flight streams finish for up to the policy's drain_grace (or until ctx
// ends), then cuts the rest (their requests release what they hold) and closes the admin
// listener.
func (a *App) Shutdown(ctx context.Context) {
	a.stopOnce.Do(func() {
		a.draining.Store(true)
		a.health.Shutdown()
		if a.watcher != nil {
			a.watcher.Close()
		}
		if a.keysWatcher != nil {
			a.keysWatcher.Close()
		}
		if a.tls != nil {
			a.tls.close()
		}
		grace := a.current.Load().Server.DrainGrace.D()
		a.log.Info("draining", "in_flight", a.engine.InFlight(), "streams", a.extproc.ActiveStreams(), "grace", grace.String())
		done := make(chan struct{})
		go func() {
			if a.grpc != nil {
				a.grpc.GracefulStop()
			}
			close(done)
		}()
		timer := time.NewTimer(grace)
		defer timer.Stop()
		select {
		case <-done:
		case <-timer.C:
			a.log.Warn("drain grace over; closing the remaining streams", "streams", a.extproc.ActiveStreams())
			a.grpc.Stop()
			<-done
		case <-ctx.Done():
			if a.grpc != nil {
				a.grpc.Stop()
			}
			<-done
		}
		a.extproc.Close()
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		// Every stream has ended: give this replica's shared slots back at once.
		if err := a.engine.Close(shut); err != nil {
			a.log.Warn("could not give this replica's shared slots back; they free when its leases expire", "error", err)
		}
		a.closeState()
		a.stopTracing(shut)
		if err := a.admin.Shutdown(shut); err != nil {
			a.admin.Close()
		}
		a.log.Info("stopped", "in_flight", a.engine.InFlight())
	})
}

// Run starts the server and serves until ctx ends (SIGTERM or SIGINT in the command), then
// drains and returns. Each value received on reload (SIGHUP in the command) reloads the policy.
func (a *App) Run(ctx context.Context, reload <-chan os.Signal) error {
	if err := a.Start(); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			a.Shutdown(context.Background())
			return nil
		case <-reload:
			_ = a.Reload("SIGHUP")
		case err := <-a.serveErr:
			a.log.Error("a listener stopped serving", "err", err)
			a.Shutdown(context.Background())
			return err
		}
	}
}
