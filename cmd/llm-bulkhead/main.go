// Command llm-bulkhead is an Envoy ext_proc server that keeps one feature, tenant or provider
// of an LLM gateway from taking the capacity of the others.
//
// Usage:
//
//	llm-bulkhead [serve] [--config FILE] [--grpc-addr ADDR] [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--admin-addr ADDR] [--admin-insecure] [--admin-allowed-hosts NAMES] [--log-level LEVEL] [--watch=true] [--state-file FILE] [--gc-heap-floor SIZE]
//	llm-bulkhead validate [--config FILE] [--explain] [FILE]
//	llm-bulkhead envoy-config [--config FILE] [--cluster NAME] [--address ADDR] [--tls-ca FILE] [--tls-client-cert FILE --tls-client-key FILE] [--tls-server-name NAME]
//	llm-bulkhead health [--addr ADDR] [--service NAME] [--timeout DURATION] [--tls-ca FILE] [--tls-client-cert FILE --tls-client-key FILE] [--tls-server-name NAME]
//	llm-bulkhead version (or --version)
//	llm-bulkhead help [COMMAND] (or -h; every command takes -h)
//
// ADDR is host:port, or unix:///path for a unix domain socket.
// Without --config the server runs the policy built into the binary (examples/policy.yaml).
// An admin address that is not loopback needs the admin token (LLM_BULKHEAD_ADMIN_TOKEN), which
// then guards /admin/* and the dashboard too, or --admin-insecure to serve it without one.
// Exit status: 0 on success and after a graceful shutdown (a signal during the start
// included), 2 for an invalid policy or bad usage (an unguarded admin address, a file that is
// not a regular one or is too large, and a state file that cannot be used with
// state.on_error: refuse included), 1 when the server cannot run (e.g. an address
// in use). health exits 0 only when the server answers SERVING, 1 otherwise, 2 for bad usage.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// version is set at build time with -ldflags "-X main.version=…" (make build stamps git describe);
// otherwise the module version from the Go build record.
var version = ""

func main() {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	os.Exit(run(context.Background(), os.Args[1:], os.Environ(), os.Stdout, os.Stderr, hup))
}

// newApp builds the server; tests replace it.
var newApp = app.New

// command is one subcommand: its synopsis and one line about it for the help, and what runs it.
type command struct {
	name, synopsis, summary string
	run                     func(c *command, ctx context.Context, args, env []string, stdout, stderr io.Writer, hup <-chan os.Signal) int
}

// commands in the order the help lists them.
var commands []*command

func init() {
	commands = []*command{
		{"serve", "[--config FILE] [--grpc-addr ADDR] [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--admin-addr ADDR] [--admin-insecure] [--admin-allowed-hosts NAMES] [--log-level LEVEL] [--watch=BOOL] [--state-file FILE] [--gc-heap-floor SIZE]",
			"run the ext_proc server and the admin listener (the default command)", serve},
		{"validate", "[--config FILE] [--explain] [FILE]",
			"check a policy file and print every problem, or a summary of the effective policy", validate},
		{"envoy-config", "[--config FILE] [--cluster NAME] [--address ADDR] [--tls-ca FILE] [--tls-client-cert FILE --tls-client-key FILE] [--tls-server-name NAME]",
			"print the Envoy ext_proc filter and cluster matching a policy", envoyConfig},
		{"health", "[--addr ADDR] [--service NAME] [--timeout DURATION] [--tls-ca FILE] [--tls-client-cert FILE --tls-client-key FILE] [--tls-server-name NAME]",
			"ask a running server's gRPC health service; exit 0 only when it is SERVING", healthCheck},
		{"version", "", "print the version, commit, Go version, build tags and platform", printVersion},
		{"help", "[COMMAND]", "list the commands, or describe one", help},
	}
}

func lookup(name string) *command {
	for _, c := range commands {
		if c.name == name {
			return c
		}
	}
	return nil
}

// run is main without the process: it returns the exit status.
func run(ctx context.Context, args, env []string, stdout, stderr io.Writer, hup <-chan os.Signal) int {
	name := "serve"
	if len(args) > 0 {
		switch args[0] {
		case "-h", "-help", "--help":
			usage(stdout)
			return 0
		case "-version", "--version":
			name, args = "version", args[1:]
		default:
			if len(args[0]) > 0 && args[0][0] != '-' {
				name, args = args[0], args[1:]
			}
		}
	}
	c := lookup(name)
	if c == nil {
		fmt.Fprintf(stderr, "llm-bulkhead: unknown command %q\n\n", name)
		usage(stderr)
		return 2
	}
	return c.run(c, ctx, args, env, stdout, stderr, hup)
}

func usage(w io.Writer) {
	fmt.Fprint(w, `llm-bulkhead — bulkheads, token budgets and circuit breakers for LLM traffic, as an Envoy ext_proc server.

Usage: llm-bulkhead [command] [flags]

Commands:
`)
	for _, c := range commands {
		fmt.Fprintf(w, "  %-13s %s\n", c.name, c.summary)
	}
	fmt.Fprint(w, `
Without a command, llm-bulkhead serves. "llm-bulkhead help <command>" or "llm-bulkhead <command> -h"
describes a command and its flags; "llm-bulkhead --version" prints the version.
`)
}

// usage prints a command's synopsis, what it does and its flags.
func (c *command) usage(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: %s\n\n%s.\n", strings.TrimSpace("llm-bulkhead "+c.name+" "+c.synopsis), upperFirst(c.summary))
	if fs == nil {
		return
	}
	has := false
	fs.VisitAll(func(*flag.Flag) { has = true })
	if has {
		fmt.Fprintln(w, "\nFlags:")
		fs.SetOutput(w)
		fs.PrintDefaults()
	}
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// flags returns the command's flag set; define its flags, then call parse.
func (c *command) flags() *flag.FlagSet {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// parse parses args. ok is false when the command should end with status code: 0 after -h
// (usage on stdout), 2 after a bad flag (the problem and the usage on stderr).
func (c *command) parse(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (code int, ok bool) {
	err := fs.Parse(args)
	switch {
	case err == nil:
		return 0, true
	case errors.Is(err, flag.ErrHelp):
		c.usage(stdout, fs)
		return 0, false
	}
	fmt.Fprintf(stderr, "llm-bulkhead %s: %v\n\n", c.name, err)
	c.usage(stderr, fs)
	return 2, false
}

func buildInfo() app.BuildInfo { return app.ReadBuildInfo(version) }

func printVersion(c *command, _ context.Context, args, _ []string, stdout, stderr io.Writer, _ <-chan os.Signal) int {
	fs := c.flags()
	if code, ok := c.parse(fs, args, stdout, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "llm-bulkhead version: unexpected arguments %q\n", fs.Args())
		return 2
	}
	fmt.Fprint(stdout, buildInfo())
	return 0
}

func help(c *command, _ context.Context, args, _ []string, stdout, stderr io.Writer, _ <-chan os.Signal) int {
	if len(args) == 1 && (args[0] == "-h" || args[0] == "-help" || args[0] == "--help") {
		c.usage(stdout, nil)
		return 0
	}
	switch len(args) {
	case 0:
		usage(stdout)
		return 0
	case 1:
		target := lookup(args[0])
		if target == nil {
			fmt.Fprintf(stderr, "llm-bulkhead help: unknown command %q\n\n", args[0])
			usage(stderr)
			return 2
		}
		// A command's flags are defined where it runs: ask it for its own help.
		return target.run(target, context.Background(), []string{"-h"}, nil, stdout, stderr, nil)
	}
	fmt.Fprintf(stderr, "llm-bulkhead help: unexpected arguments %q\n", args[1:])
	return 2
}

func serve(c *command, ctx context.Context, args, env []string, stdout, stderr io.Writer, hup <-chan os.Signal) int {
	// SIGTERM and SIGINT are caught before any work that could wait (reading files, reaching
	// Redis): the first one drains a running server, or abandons a start still under way; after
	// it, the default action is back, so a second one ends the process at once. Other commands
	// leave both signals to their default action.
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	context.AfterFunc(ctx, stop)
	fs := c.flags()
	var o app.Options
	fs.StringVar(&o.ConfigPath, "config", "", "policy file (default: the built-in examples/policy.yaml)")
	fs.StringVar(&o.GRPCAddr, "grpc-addr", "", "ext_proc gRPC listen address, host:port or unix:///path (default: the policy's server.grpc_addr, 127.0.0.1:9002)")
	fs.StringVar(&o.TLS.Cert, "tls-cert", "", "ext_proc listener's certificate chain (PEM), reloaded when it changes; the listener then speaks TLS only (default: the policy's server.tls_cert)")
	fs.StringVar(&o.TLS.Key, "tls-key", "", "private key (PEM) of --tls-cert (default: the policy's server.tls_key)")
	fs.StringVar(&o.TLS.ClientCA, "tls-client-ca", "", "CAs (PEM) that sign Envoy's client certificates: require mutual TLS (default: the policy's server.tls_client_ca)")
	fs.StringVar(&o.AdminAddr, "admin-addr", "", "admin HTTP listen address (default: the policy's server.admin_addr, 127.0.0.1:9090)")
	fs.BoolVar(&o.AdminInsecure, "admin-insecure", false, "serve a non-loopback admin address without an admin token, to anyone who can connect (logs a warning)")
	fs.Func("admin-allowed-hosts", "comma-separated host names besides localhost and IP addresses for which /admin/* and the dashboard answer requests without the admin token, any port (others get 403: a web page cannot read them through DNS rebinding)", func(s string) error {
		hosts, err := app.ParseAdminHosts(s)
		o.AdminAllowedHosts = append(o.AdminAllowedHosts, hosts...)
		return err
	})
	fs.StringVar(&o.LogLevel, "log-level", "", "debug, info, warn or error (default: the policy's server.log_level, info)")
	fs.BoolVar(&o.Watch, "watch", true, "reload the policy file when it changes (SIGHUP always reloads)")
	fs.StringVar(&o.StateFile, "state-file", "", "file keeping every budget's windows (tokens, requests, spend) across restarts of a single process (default: the policy's state.file; none: memory only)")
	var formerState string
	fs.StringVar(&formerState, "spend-state", "", "former name of --state-file, still read")
	floor := app.DefaultHeapFloor
	fs.TextVar(&floor, "gc-heap-floor", app.DefaultHeapFloor, "heap the garbage collector counts as live before it starts a cycle (512KiB, 32MiB…; 0: Go's default pacing); fewer collections per stream, up to about this much more memory held")
	if code, ok := c.parse(fs, args, stdout, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "serve: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if formerState != "" {
		if o.StateFile != "" && o.StateFile != formerState {
			fmt.Fprintf(stderr, "serve: --spend-state %s and --state-file %s name different files: give --state-file only (--spend-state is its former name)\n", formerState, o.StateFile)
			return 2
		}
		o.StateFile = formerState
	}
	ballast := app.HeapFloor(floor)
	defer runtime.KeepAlive(ballast)
	// Without GOMEMLIMIT, the Go runtime learns the container's memory limit.
	app.LimitGoMemory()
	o.Env = env
	o.LogOutput = stderr
	o.Build = buildInfo()
	a, started, err := start(ctx, o)
	if !started {
		fmt.Fprintln(stderr, "llm-bulkhead: stopped by a signal before it started")
		return 0
	}
	if err != nil {
		var ce *app.ConfigError
		if errors.As(err, &ce) {
			fmt.Fprint(stderr, "llm-bulkhead: invalid policy, not starting: ")
			printProblems(stderr, o.ConfigPath, ce.Err)
			return 2
		}
		var exposed *app.ExposedAdminError
		var listener *app.ListenerError
		var state *app.StateFileError
		if errors.As(err, &exposed) || errors.As(err, &listener) || errors.As(err, &state) {
			fmt.Fprintln(stderr, "llm-bulkhead: not starting:", err)
			return 2
		}
		fmt.Fprintln(stderr, "llm-bulkhead:", err)
		return 1
	}
	if err := a.Run(ctx, hup); err != nil {
		fmt.Fprintln(stderr, "llm-bulkhead:", err)
		return 1
	}
	return 0
}

// start builds the server with newApp, unless ctx ends first: then started is false and the
// start is abandoned (the process is about to exit; nothing was served yet).
func start(ctx context.Context, o app.Options) (a *app.App, started bool, err error) {
	type result struct {
		a   *app.App
		err error
	}
	done := make(chan result, 1)
	go func() {
		a, err := newApp(o)
		done <- result{a, err}
	}()
	select {
	case r := <-done:
		return r.a, true, r.err
	case <-ctx.Done():
		return nil, false, nil
	}
}

func validate(c *command, _ context.Context, args, env []string, stdout, stderr io.Writer, _ <-chan os.Signal) int {
	fs := c.flags()
	path := fs.String("config", "", "policy file to check (default: the built-in policy)")
	explain := fs.Bool("explain", false, "print the effective policy: classification, every compartment with its resolved limits, pools, degrade rules, fallbacks and breakers")
	if code, ok := c.parse(fs, args, stdout, stderr); !ok {
		return code
	}
	if fs.NArg() == 1 && *path == "" {
		*path = fs.Arg(0)
	} else if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "validate: unexpected arguments %q\n", fs.Args())
		return 2
	}
	p, name, err := app.LoadPolicy(*path, env)
	if err != nil {
		printProblems(stderr, name, err)
		return 2
	}
	sum, err := app.Summarize(p)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 2
	}
	if err := app.CheckListenerTLS(p); err != nil {
		fmt.Fprintf(stderr, "%s: server TLS: %v\n", name, err)
		return 2
	}
	fmt.Fprintf(stdout, "%s: OK — %s\n", name, sum.Line())
	for _, w := range sum.Warnings() {
		fmt.Fprintf(stderr, "%s: warning: %s\n", name, w)
	}
	if *explain {
		sum.Explain(stdout)
	}
	return 0
}

// printProblems writes a policy that failed to load: with a count and one problem a line (each
// names its file, line and key path) when they are config.Errors, else the error as it is.
func printProblems(w io.Writer, name string, err error) {
	var problems config.Errors
	if !errors.As(err, &problems) {
		fmt.Fprintln(w, err)
		return
	}
	if name == "" {
		name = examples.DefaultPolicyName
	}
	fmt.Fprintf(w, "%s: %d problem(s):\n", name, len(problems))
	for _, pr := range problems {
		fmt.Fprintln(w, "  "+pr.String())
	}
}

func envoyConfig(c *command, _ context.Context, args, env []string, stdout, stderr io.Writer, _ <-chan os.Signal) int {
	fs := c.flags()
	path := fs.String("config", "", "policy file (default: the built-in policy)")
	cluster := fs.String("cluster", "llm_bulkhead", "name of the Envoy cluster that reaches this server")
	addr := fs.String("address", "", "address Envoy uses to reach this server, host:port or unix:///path (default: the policy's server.grpc_addr)")
	var ec app.EnvoyCluster
	fs.StringVar(&ec.CA, "tls-ca", "", "CA bundle (PEM) with which Envoy verifies the server's certificate, as a path on Envoy's machine; needed when the server speaks TLS")
	fs.StringVar(&ec.ClientCert, "tls-client-cert", "", "Envoy's client certificate (PEM) for mutual TLS, as a path on Envoy's machine; needed when the policy sets server.tls_client_ca")
	fs.StringVar(&ec.ClientKey, "tls-client-key", "", "private key (PEM) of --tls-client-cert, as a path on Envoy's machine")
	fs.StringVar(&ec.ServerName, "tls-server-name", "", "SNI Envoy sends and the DNS name it requires in the server's certificate (default: the host of --address)")
	if code, ok := c.parse(fs, args, stdout, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "envoy-config: unexpected arguments %q\n", fs.Args())
		return 2
	}
	p, name, err := app.LoadPolicy(*path, env)
	if err != nil {
		fmt.Fprintf(stderr, "%s:\n%v\n", name, err)
		return 2
	}
	ec.Name, ec.Address = *cluster, *addr
	out, err := app.EnvoyConfigFor(p, ec)
	if err != nil {
		fmt.Fprintln(stderr, "llm-bulkhead envoy-config:", err)
		return 2
	}
	_, _ = stdout.Write(out)
	return 0
}
