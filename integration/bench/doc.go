// Package bench measures what llm-bulkhead costs on Envoy's side stream: it runs the server
// and a no-op ext_proc server (Noop) as separate processes, drives both with the same Envoy
// simulator load (a 1 KiB streamed chat request, response headers and three SSE chunks per
// stream, against an in-process upstream), and compares streams per second, per-stream
// latency, CPU per stream and memory with thousands of streams held open. It also profiles
// both servers under load and collects the hot-path Go benchmarks, and renders everything as
// a Markdown and JSON report (Run). integration/cmd/bench is its command line; `make bench`
// runs it.
//
// The measurements report; they never gate anything: the tests check the arithmetic and the
// parsers, not the numbers.
package bench
