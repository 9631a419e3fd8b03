// Package envoysim is a test double of Envoy's HTTP ext_proc filter
// (Envoy 1.37 behaviour): it plays Envoy's side of the
// envoy.service.ext_proc.v3 protocol against a real gRPC ext_proc server,
// so the server can be tested end to end without an Envoy binary.
//
// It has three faces:
//
//   - Sim.RoundTrip runs one scripted HTTP request through the filter and an
//     Upstream, and returns a Result: what the client and the upstream saw,
//     every message exchanged, how the gRPC stream ended and any protocol
//     problem. Request.OnEvent hooks cancel at exact points (before a reply,
//     while queued, mid-SSE) without sleeps.
//   - Sim.OpenRaw gives an unscripted stream for protocol-edge tests.
//   - NewProxy/ServeProxy is an HTTP listener that behaves like Envoy in
//     front of one upstream, for real clients; cmd/envoysim wraps it.
//
// Usage:
//
//	sim, err := envoysim.New("127.0.0.1:9002", envoysim.FilterConfig{
//		Mode: envoysim.ProcessingMode{RequestBody: envoysim.BodyBuffered, ResponseBody: envoysim.BodyStreamed},
//	})
//	...
//	defer sim.Close()
//	res, err := sim.RoundTrip(ctx, &envoysim.Request{
//		Method: "POST", Path: "/v1/chat/completions", Body: []byte(`{"model":"m"}`),
//	}, envoysim.Respond(200, envoysim.H("content-type", "application/json"), `{"usage":{}}`))
//	// res.Status, res.Local, res.SentKinds(), res.Stream, res.CloseReason ...
//
// NewCluster reaches the server as Envoy's ext_proc cluster does: a host:port
// or a unix socket (a pipe address), plaintext or TLS with Envoy's
// verification rules (UpstreamTLS). ClusterFromYAML reads the cluster from the
// YAML Envoy loads, so `llm-bulkhead envoy-config`'s output can be run as it is.
//
// FilterConfig.RateLimit adds Envoy's global rate limit filter
// (envoy.filters.http.ratelimit) in front of the ext_proc filter: it calls a
// RateLimitService over gRPC on the request path, answers 429 when it says
// OVER_LIMIT, and charges the stream-done descriptors (hits_addend from the
// dynamic metadata the processor left) when the request is over. Its rules
// can be read from the same YAML Envoy loads (RateLimitFromVirtualHostYAML).
//
// Retrying plays the router's retry_policy behind the filter (retry_on reset, connect-failure,
// retriable status codes; num_retries; back-off and retry-after; x-envoy-attempt-count).
// UpstreamFilter puts an ext_proc filter in Envoy's upstream HTTP filter position (a cluster's
// HttpProtocolOptions http_filters, before upstream_codec): wrapped by Retrying, it runs once
// per attempt, so each attempt opens its own stream with the attempt's request headers (the
// client's x-request-id on every one) and then its response; an attempt that fails before
// response headers fails to the router and its stream is reset. FilterConfig.InitialMetadata
// is grpc_service.initial_metadata, sent when each stream opens. What is not modelled: hedging
// (parallel attempts), per_try_timeout, retry budgets and the jitter of the back-off.
//
// Where Envoy's source and the project's protocol notes differ, the
// simulator follows the source (ext_proc.cc, processor_state.cc,
// mutation_utils.cc); the differences are listed on the types and functions
// that implement them.
package envoysim
