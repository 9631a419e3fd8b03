// Command llm-bulkhead is an Envoy ext_proc server that keeps one feature, tenant or provider
// of an LLM gateway from taking the capacity of the others.
//
// Usage:
//
//	llm-bulkhead [serve] [--config FILE] [--grpc-addr ADDR] [--admin-addr ADDR] [--admin-insecure] [--log-level LEVEL] [--watch=true]
//	llm-bulkhead validate --config FILE [--explain]
//	llm-bulkhead envoy-config [--config FILE]
//	llm-bulkhead version
//
// Without --config the server runs the policy built into the binary (examples/policy.yaml).
// An admin address that is not loopback needs the admin token (LLM_BULKHEAD_ADMIN_TOKEN), which
// then guards /admin/* and the dashboard too, or --admin-insecure to serve it without one.
// Exit status: 0 on success and after a graceful shutdown, 2 for an invalid policy or bad
// usage (an unguarded admin address included), 1 when the server cannot run (e.g. an address
// in use).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// version is set at build time with -ldflags "-X main.version=…"; otherwise the module version.
var version = ""

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	os.Exit(run(ctx, os.Args[1:], os.Environ(), os.Stdout, os.Stderr, hup))
}

// run is main without the process: it returns the exit status.
func run(ctx context.Context, args, env []string, stdout, stderr io.Writer, hup <-chan os.Signal) int {
	cmd := "serve"
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "serve":
		return serve(ctx, args, env, stderr, hup)
	case "validate":
		return validate(args, env, stdout, stderr)
	case "envoy-config":
		return envoyConfig(args, env, stdout, stderr)
	case "version":
		fmt.Fprintln(stdout, "llm-bulkhead", versionString())
		return 0
	case "help", "-h", "--help":
		usage(stdout)
		return 0
	}
	fmt.Fprintf(stderr, "llm-bulkhead: unknown command %q\n\n", cmd)
	usage(stderr)
	return 2
}

func usage(w io.Writer) {
	fmt.Fprint(w, `llm-bulkhead — bulkheads, token budgets and circuit breakers for LLM traffic, as an Envoy ext_proc server.

Commands:
  serve         run the server (the default command)
  validate      check a policy file and print every problem (or a summary with --explain)
  envoy-config  print the Envoy ext_proc filter and cluster matching a policy
  version       print the version

Run "llm-bulkhead <command> -h" for a command's flags.
`)
}

func versionString() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "(devel)"
}

func serve(ctx context.Context, args, env []string, stderr io.Writer, hup <-chan os.Signal) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o app.Options
	fs.StringVar(&o.ConfigPath, "config", "", "policy file (default: the built-in examples/policy.yaml)")
	fs.StringVar(&o.GRPCAddr, "grpc-addr", "", "ext_proc gRPC listen address (default: the policy's server.grpc_addr, 127.0.0.1:9002)")
	fs.StringVar(&o.AdminAddr, "admin-addr", "", "admin HTTP listen address (default: the policy's server.admin_addr, 127.0.0.1:9090)")
	fs.BoolVar(&o.AdminInsecure, "admin-insecure", false, "serve a non-loopback admin address without an admin token, to anyone who can connect (logs a warning)")
	fs.StringVar(&o.LogLevel, "log-level", "", "debug, info, warn or error (default: the policy's server.log_level, info)")
	fs.BoolVar(&o.Watch, "watch", true, "reload the policy file when it changes (SIGHUP always reloads)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "serve: unexpected arguments %q\n", fs.Args())
		return 2
	}
	o.Env = env
	o.LogOutput = stderr
	a, err := app.New(o)
	if err != nil {
		var ce *app.ConfigError
		if errors.As(err, &ce) {
			fmt.Fprintln(stderr, "llm-bulkhead: invalid policy, not starting:")
			fmt.Fprintln(stderr, err)
			return 2
		}
		var exposed *app.ExposedAdminError
		if errors.As(err, &exposed) {
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

func validate(args, env []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("validate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("config", "", "policy file to check (default: the built-in policy)")
	explain := fs.Bool("explain", false, "print the effective policy: every compartment with its resolved limits")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() == 1 && *path == "" {
		*path = fs.Arg(0)
	} else if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "validate: unexpected arguments %q\n", fs.Args())
		return 2
	}
	p, name, err := app.LoadPolicy(*path, env)
	if err != nil {
		var problems config.Errors
		if errors.As(err, &problems) {
			fmt.Fprintf(stderr, "%s: %d problem(s):\n", name, len(problems))
			for _, pr := range problems {
				fmt.Fprintln(stderr, "  "+pr.String())
			}
		} else {
			fmt.Fprintln(stderr, err)
		}
		return 2
	}
	sum, err := app.Summarize(p)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 2
	}
	fmt.Fprintf(stdout, "%s: OK — %s\n", name, sum.Line())
	if *explain {
		sum.Explain(stdout)
	}
	return 0
}

func envoyConfig(args, env []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("envoy-config", flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("config", "", "policy file (default: the built-in policy)")
	cluster := fs.String("cluster", "llm_bulkhead", "name of the Envoy cluster that reaches this server")
	addr := fs.String("address", "", "address Envoy uses to reach this server (default: the policy's server.grpc_addr)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	p, name, err := app.LoadPolicy(*path, env)
	if err != nil {
		fmt.Fprintf(stderr, "%s:\n%v\n", name, err)
		return 2
	}
	out, err := app.EnvoyConfig(p, *cluster, *addr)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	_, _ = stdout.Write(out)
	return 0
}
