// Package config defines the llm-bulkhead policy file: its schema, strict loading (unknown keys and
// wrong types are errors naming file, line and key path), environment overrides, template
// inheritance and validation that reports every problem at once.
//
// The zero value of every field is documented on the field; Load fills defaults before validation,
// so code reading a loaded Policy never has to guess.
//
// The package is a leaf: it imports the standard library, the decoding libraries and small value
// packages (money, glob, files, and breaker for the breaker's own rules), never the runtime, a
// Redis client or Prometheus (TestConfigIsALeaf), so that validating a policy links neither.
// What the runtime builds from a policy (price tables, compartments, the cluster) is built on the
// runtime's side.
package config

// This file is the policy's schema: each field's comment is the reference docs/policy.md is
// generated from, so its length is the documentation's.

import (
	"encoding/json"

	"github.com/llm-bulkhead/llm-bulkhead/policy/apikey"
)

// Policy is the whole policy file. A loaded Policy is immutable: reload builds a new one.
type Policy struct {
	// Server holds listener and process settings.
	Server Server `koanf:"server" json:"server,omitempty"`
	// Admin holds the admin HTTP listener's settings.
	Admin Admin `koanf:"admin" json:"admin,omitempty"`
	// Envoy declares the ext_proc filter settings the policy relies on. They are not sent to
	// Envoy (Envoy's own config is); they let validation check that waits fit Envoy's timeouts and
	// let `llm-bulkhead envoy-config` print a matching filter.
	Envoy Envoy `koanf:"envoy" json:"envoy,omitempty"`
	// Classification holds the ordered rules that give every request its dimensions. A value a
	// rule reads is trimmed of white space (CR and LF at its ends included). A value that still
	// holds a control character (NUL, CR, LF, tab, DEL, U+0080–U+009F), bytes that are not UTF-8,
	// or more than 256 bytes is skipped as if the rule had read nothing — the next rule or the
	// default decides — and counted in llm_bulkhead_classify_errors_total{reason="invalid_tenant"}
	// (invalid_feature, invalid_tier, invalid_provider, invalid_model), with a warning logged at
	// most once a minute that names the rule and the problem, never the value. So whatever a
	// trusted source holds, the headers, Envoy metadata, log lines and metric labels made from a
	// request's dimensions are valid. Defaults, path rule values, map entries and tenant ids in
	// the policy are checked the same way when it loads.
	Classification Classification `koanf:"classification" json:"classification,omitempty"`
	// Tenants is the tenant directory: tenant → tier, with optional per-tenant limit overrides.
	Tenants Tenants `koanf:"tenants" json:"tenants,omitempty"`
	// Models maps model names (globs, first match wins) to providers and estimation settings.
	// A request's model is the one its API names: the body's model for OpenAI's
	// /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/audio/speech and
	// /v1/images/generations and for Anthropic's /v1/messages; the path's for Google Gemini
	// (models/{model}:generateContent, :streamGenerateContent, :countTokens, :embedContent, as
	// gemini-2.5-flash), AWS Bedrock (model/{modelId}/converse, /converse-stream, /invoke,
	// /invoke-with-response-stream, the id as written, as
	// anthropic.claude-3-5-haiku-20241022-v1:0) and Azure OpenAI's deployments
	// (/openai/deployments/{deployment}/...; the deployment's name); an audio upload's model is
	// a form field that is never read (name it with a classification.model rule).
	Models []ModelRule `koanf:"models" json:"models,omitempty"`
	// Estimation sets how token use is estimated before a response reports it.
	Estimation Estimation `koanf:"estimation" json:"estimation,omitempty"`
	// Currency is the code of the currency that prices and spend budgets are written in, e.g.
	// USD or EUR (three capital letters); amounts are never converted. Default USD.
	Currency string `koanf:"currency" json:"currency,omitempty"`
	// Prices lists what models cost, for spend budgets (spend_per_hour, spend_per_day,
	// spend_per_month): the first entry whose match fits the model wins; an entry with match
	// default prices models no other entry matches. Amounts are exact decimals of the currency
	// per million tokens; costs are counted in millionths of the currency unit and a request's
	// cost is rounded up once, to the next millionth. Nothing is fetched from the network: the
	// prices are what you write. A request reserves its worst case before it runs, its
	// estimated prompt tokens × input_per_mtok + max_tokens (or the default max tokens) × the
	// choices the API returns (n; prompts × max(n, best_of) for batched completions) ×
	// output_per_mtok, in every spend budget of its compartments (all or nothing), and settles
	// after at the usage the response reports, priced by the model that answered (the model
	// field of the response): prompt tokens served from a cache at cached_input_per_mtok,
	// reasoning tokens at reasoning_per_mtok; a request that never reached the provider is
	// refunded. Worked example, with `{match: "deepseek-*", input_per_mtok: 0.27,
	// output_per_mtok: 1.10, cached_input_per_mtok: 0.07}` (tokens × a price per million tokens
	// is a cost in millionths): a request with about 2000 prompt tokens and max_tokens 1000
	// reserves 2000 × 0.27 + 1000 × 1.10 = 1640 millionths, $0.00164;
	// its response reports 2000 prompt tokens of which 1500 cached and 400 completion tokens, so
	// it settles at 500 × 0.27 + 1500 × 0.07 + 400 × 1.10 = 135 + 105 + 440 = 680 millionths,
	// $0.00068, and a tenant with spend_per_day 1.00 has $0.99932 left that day. Models billed
	// otherwise than by the token add per_second (audio transcription and translation billed by
	// duration: the seconds the response's usage reports, else, as for a response in the text,
	// srt or vtt format, which reports none, the upload's worst-case length, its bytes at 2000 a
	// second, the lowest bitrate speech codecs use), per_request (every request the provider
	// served: speech, or a fee on top of tokens) and per_image (each image an
	// /v1/images/generations request asks for with n), reserved and settled with the tokens.
	// When a spend budget applies, every model the models list and the providers' models maps
	// name must be priced (by an entry or the default); a model nobody named that no entry
	// prices is charged at the highest price of each kind in the list. Default empty.
	Prices []PriceRule `koanf:"prices" json:"prices,omitempty"`
	// TimeZone is the IANA time zone (e.g. Europe/Berlin, America/New_York) whose calendar the
	// windows of spend budgets follow: an hour is a clock hour, a day runs from midnight to
	// midnight (23 or 25 hours when the clocks change) and a month from the 1st to the 1st.
	// The zone database is built in. Changing it (by a reload, or a restart with a state file
	// or Redis) carries what each budget's current window had counted into the window the new
	// zone makes current, which may have started earlier or later: a new zone never gives back
	// what was spent, changing back counts nothing twice, and the reload's log line lists the
	// change. Default UTC.
	TimeZone string `koanf:"time_zone" json:"time_zone,omitempty"`
	// Spend sets whether a single request may overrun a spend budget (allow_single_overrun).
	// It also holds the former names of the state file's keys (state_file, state_interval,
	// on_state_error), from when the file kept spend only; state.file and the rest replace them.
	Spend SpendState `koanf:"spend" json:"spend,omitempty"`
	// State sets how what the budgets count outlives the process. A single process keeps every
	// window — tokens_per_minute, tokens_per_day, requests_per_minute and the spend of spend
	// budgets — in one state file (file): read once at start before any request is served,
	// written atomically every interval and once more at shutdown after the streams drained, so
	// that a restart with SIGTERM continues exactly where it stopped and a crash (SIGKILL, OOM)
	// loses at most one interval of what was counted. The file holds only what still counts (a
	// charge that has aged out of its window, an ended spend window, is not restored); each
	// restored window replaces what that window held, so restoring never counts anything twice;
	// what requests in flight when it was written reserved is restored as spent (their
	// settlement never comes after a crash; their reservation is the most they can have cost). A
	// policy reload keeps every window (a compartment is known by its name, a spend budget by its
	// compartment and period). With a cluster backend Redis keeps every window instead, shared by
	// every replica, and no file is written (docs/cluster.md). Default memory only: every budget
	// starts empty at every start. It also says what a start does with a state file it cannot use
	// (on_error).
	State State `koanf:"state" json:"state,omitempty"`
	// Body sets how request bodies are read and rewritten.
	Body Body `koanf:"body" json:"body,omitempty"`
	// Templates are named limit sets that features, tiers, providers and tenants inherit from.
	Templates map[string]Limits `koanf:"templates" json:"templates,omitempty"`
	// Features is the set of features; a request's feature is always one of these names.
	Features map[string]Feature `koanf:"features" json:"features,omitempty"`
	// Tiers is the set of tenant tiers with each tier's limit template.
	Tiers map[string]Limits `koanf:"tiers" json:"tiers,omitempty"`
	// Providers is the set of upstream providers with their limits, breaker and fallback.
	Providers map[string]Provider `koanf:"providers" json:"providers,omitempty"`
	// Breakers are named circuit-breaker settings that providers refer to.
	Breakers map[string]Breaker `koanf:"breakers" json:"breakers,omitempty"`
	// Compartments lists the bulkhead families every request passes through, in order.
	Compartments []Family `koanf:"compartments" json:"compartments,omitempty"`
	// Pools let compartments share capacity with guaranteed shares and borrowing.
	Pools []Pool `koanf:"pools" json:"pools,omitempty"`
	// Responses sets which headers are added to responses for admitted requests.
	Responses Responses `koanf:"responses" json:"responses,omitempty"`
	// Refusals sets what refused requests tell their clients (rate-limit headers, when to say
	// not to retry).
	Refusals Refusals `koanf:"refusals" json:"refusals,omitempty"`
	// AllowEmpty accepts a policy that limits nothing (no concurrency, token or request limit in
	// any compartment and no breaker). Default false: such a policy is refused, so that an empty
	// or truncated file cannot silently turn every limit off.
	AllowEmpty bool `koanf:"allow_empty" json:"allow_empty,omitempty"`
	// QuotaEndpoint lets a client ask how much of its limits is left before it starts a big job:
	// a GET of its path is answered by llm-bulkhead itself, never forwarded. Default off.
	QuotaEndpoint QuotaEndpoint `koanf:"quota_endpoint" json:"quota_endpoint,omitempty"`
	// Cluster shares limits across replicas through Redis. Default off.
	Cluster Cluster `koanf:"cluster" json:"cluster,omitempty"`
	// Tracing exports an OpenTelemetry span per request (docs/tracing.md). Default off.
	Tracing Tracing `koanf:"tracing" json:"tracing,omitempty"`
	// Usage counts tokens (prompt, completion, cached), requests, refusals by reason and spend
	// by tenant, by model and by both, for GET /admin/usage and the dashboard, over the last
	// hour, 24 hours, 7 days and the calendar month (in time_zone), in bounded memory: fixed-size
	// tables per bucket of time that keep the groups using the most exactly and say, row by row,
	// how much may be overcounted (docs/operations.md). A single process keeps them in the state
	// file (state.file) across restarts; in cluster mode each replica adds what it counted to
	// the fleet's tables in Redis every 5 seconds (and as it stops), which survive any replica's
	// restart.
	// Requests refused before they were classified (bad_request, server_busy) have no tenant and
	// are not counted. Default on.
	Usage Usage `koanf:"usage" json:"usage,omitempty"`
}

// Server holds listener and process settings. Command-line flags given explicitly win over these.
type Server struct {
	// GRPCAddr is the ext_proc gRPC listen address: host:port, or unix:///absolute/path (or
	// unix:relative/path) for a unix domain socket, created with mode 0660; a stale socket file
	// left by a crash is replaced, and the file is removed on shutdown. Default "127.0.0.1:9002".
	GRPCAddr string `koanf:"grpc_addr" json:"grpc_addr,omitempty"`
	// TLSCert is the ext_proc listener's certificate chain (PEM), with TLSKey: the listener then
	// speaks TLS only. Both files are read again when they change on disk (a cert-manager or
	// Kubernetes Secret rotation included); new connections get the new certificate, open ones
	// keep theirs. The --tls-cert flag overrides it.
	TLSCert string `koanf:"tls_cert" json:"tls_cert,omitempty"`
	// TLSKey is the private key (PEM) of TLSCert. Both or neither. The --tls-key flag overrides it.
	TLSKey string `koanf:"tls_key" json:"tls_key,omitempty"`
	// TLSClientCA is a PEM bundle of the CAs that sign Envoy's client certificates: with it, the
	// listener requires mutual TLS and refuses a client without a certificate signed by one of
	// them. Needs TLSCert. Reloaded like the certificate. The --tls-client-ca flag overrides it.
	TLSClientCA string `koanf:"tls_client_ca" json:"tls_client_ca,omitempty"`
	// AdminAddr is the admin HTTP listen address (/metrics, /healthz, /readyz, /admin/…, the
	// dashboard). Default "127.0.0.1:9090". Empty after defaults means the same default.
	AdminAddr string `koanf:"admin_addr" json:"admin_addr,omitempty"`
	// DrainGrace is how long in-flight streams may run after SIGTERM before the server stops.
	// Default 15s.
	DrainGrace Duration `koanf:"drain_grace" json:"drain_grace,omitempty"`
	// LogLevel is debug, info, warn or error. Default info.
	LogLevel string `koanf:"log_level" json:"log_level,omitempty"`
	// MaxStreams bounds the ext_proc streams open at once over all of Envoy's connections: every
	// open stream costs memory, even an idle one. A stream beyond it is refused at once with gRPC
	// RESOURCE_EXHAUSTED, which Envoy handles as its failure_mode_allow and status_on_error say.
	// Takes effect on restart. Default 20000.
	MaxStreams int `koanf:"max_streams" json:"max_streams,omitempty"`
	// MaxStreamsPerConnection bounds the streams one connection may have open at once, announced
	// to the client as HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS, so that one connection cannot take
	// all of max_streams. Envoy opens one stream per HTTP request on a few connections (at least
	// one per worker thread) and, unless its cluster's http2_protocol_options set
	// max_concurrent_streams (llm-bulkhead envoy-config sets it to this value), does not open
	// another connection when a connection is full: the streams past the bound wait inside
	// Envoy and time out. Keep it above the requests one Envoy worker has in flight at its peak.
	// At most max_streams. Takes effect on restart. Default 5000, or max_streams when that is
	// lower.
	MaxStreamsPerConnection int `koanf:"max_streams_per_connection" json:"max_streams_per_connection,omitempty"`
	// KeepaliveTime is how long a connection from Envoy may stay silent before the server pings
	// it, so that a dead Envoy (or a dropped network path) is noticed and its streams release
	// what they hold. At least 1s. Envoy may ping the server no more often than every 5s.
	// Takes effect on restart. Default 30s.
	KeepaliveTime Duration `koanf:"keepalive_time" json:"keepalive_time,omitempty"`
	// KeepaliveTimeout is how long the server waits for the answer to its ping before it closes
	// the connection. Takes effect on restart. Default 10s.
	KeepaliveTimeout Duration `koanf:"keepalive_timeout" json:"keepalive_timeout,omitempty"`
	// FirstMessageTimeout is how long a stream may stay open without sending its first message.
	// Envoy opens a stream with its first message, so a stream that stays silent is not Envoy's:
	// the server ends it with gRPC DEADLINE_EXCEEDED. Streams are checked every sixtieth of the
	// shorter of this and stream_idle_timeout (10ms to 10s apart), so a stream may outlive
	// either timeout by up to two of those periods. Default 10s.
	FirstMessageTimeout Duration `koanf:"first_message_timeout" json:"first_message_timeout,omitempty"`
	// StreamIdleTimeout is how long any stream may go without a message from Envoy, whatever it
	// has sent, once it has sent one (time spent deciding, a queue's wait included, does not
	// count). The server then ends the stream with gRPC DEADLINE_EXCEEDED, an admitted request's
	// admission released first as a cancel (the breaker ignores it); Envoy, if it is still
	// there, answers the request as its failure_mode_allow and status_on_error say. It must be
	// longer than any route timeout and stream_idle_timeout in Envoy, or a slow
	// response loses its slot while it is still running. Default 10m.
	StreamIdleTimeout Duration `koanf:"stream_idle_timeout" json:"stream_idle_timeout,omitempty"`
	// MaxBufferedBodyBytes bounds the request-body bytes all streams hold at once, from
	// receiving a buffered body until the reply that may carry it (rewritten) is handed to gRPC
	// (queueing for a slot included). A body that would pass the bound is refused with 503
	// (Anthropic: 529), reason server_busy. At least envoy.max_request_body. Default: a quarter
	// of the process's memory limit — GOMEMLIMIT, else the memory limit of its cgroup (a
	// container's limit) — at most 256MiB and at least envoy.max_request_body; 256MiB when no
	// limit is set. A body is counted as it arrives, before the server copies it out of gRPC's
	// receive buffers: one refused for the bound is never copied. A kept body costs about twice
	// its size while it arrives (gRPC's receive buffers, then the server's one copy), so a
	// quarter leaves half the limit for the rest.
	MaxBufferedBodyBytes Size `koanf:"max_buffered_body_bytes" json:"max_buffered_body_bytes,omitempty"`
}

// Admin holds the admin listener's settings.
type Admin struct {
	// TokenEnv names the environment variable holding the admin bearer token. POST endpoints
	// always require it; on an admin address beyond loopback, GET /admin/* and the dashboard
	// require it too (/metrics, /healthz and /readyz stay open). Default
	// "LLM_BULKHEAD_ADMIN_TOKEN". When the variable is empty, POST endpoints are refused, and an
	// admin address beyond loopback is refused at start unless --admin-insecure is given.
	TokenEnv string `koanf:"token_env" json:"token_env,omitempty"`
	// TenantLabel adds a tenant label to per-compartment metrics of tenant-keyed compartments.
	// Default false: tenants are unbounded and would explode metric cardinality.
	TenantLabel bool `koanf:"tenant_label" json:"tenant_label,omitempty"`
}

// Envoy declares the ext_proc filter settings the policy relies on.
type Envoy struct {
	// RequestBodyMode is the filter's request_body_mode: NONE, BUFFERED, STREAMED or
	// BUFFERED_PARTIAL. Default BUFFERED (needed for body-based classification and estimates).
	RequestBodyMode string `koanf:"request_body_mode" json:"request_body_mode,omitempty"`
	// ResponseBodyMode is the filter's response_body_mode. Default STREAMED (usage is read as the
	// response passes, without delaying it).
	ResponseBodyMode string `koanf:"response_body_mode" json:"response_body_mode,omitempty"`
	// MessageTimeout is the filter's message_timeout. Default 200ms.
	MessageTimeout Duration `koanf:"message_timeout" json:"message_timeout,omitempty"`
	// MaxMessageTimeout is the filter's max_message_timeout: the longest override the server may
	// ask for while a request waits in a queue. Default 0 (no overrides: every max_wait must then
	// fit in message_timeout).
	MaxMessageTimeout Duration `koanf:"max_message_timeout" json:"max_message_timeout,omitempty"`
	// FailureModeAllow is the filter's failure_mode_allow. Default false.
	FailureModeAllow bool `koanf:"failure_mode_allow" json:"failure_mode_allow,omitempty"`
	// AllowModeOverride is the filter's allow_mode_override. When true the server skips request
	// bodies it does not need and response bodies it need not read. Default false.
	AllowModeOverride bool `koanf:"allow_mode_override" json:"allow_mode_override,omitempty"`
	// MetadataNamespace is the dynamic metadata namespace the server writes (must be listed in the
	// filter's metadata_options.receiving_namespaces). Default "llm_bulkhead".
	MetadataNamespace string `koanf:"metadata_namespace" json:"metadata_namespace,omitempty"`
	// MaxRequestBody is the largest request body the server accepts in one message (Envoy's buffer
	// limit for the route); it sizes the gRPC receive limit. Default 8MiB.
	MaxRequestBody Size `koanf:"max_request_body" json:"max_request_body,omitempty"`
	// UpstreamFilter says llm-bulkhead also runs as Envoy's upstream ext_proc filter, on the
	// provider clusters (HttpProtocolOptions http_filters, before upstream_codec): one stream
	// per attempt of the router, retries included, each marked by the gRPC initial metadata
	// `x-llm-bulkhead-filter: upstream` (grpc_service.initial_metadata). Such a stream admits
	// nothing, charges no budget, never waits and changes nothing: it reads the attempt's
	// status, time to response headers and rate-limit headers, so that every attempt the
	// router retried counts in the provider's breaker and quota, while admission, budgets and
	// settlement stay once per client request, on this (downstream) filter. Attempts are
	// matched to their request by x-request-id, the same on every attempt. Configure the
	// upstream filter with failure_mode_allow: true. Default false: streams marked upstream
	// pass through unread. See docs/envoy.md, "Per-attempt outcomes".
	UpstreamFilter bool `koanf:"upstream_filter" json:"upstream_filter,omitempty"`
}

// Classification holds one ordered rule list per dimension.
type Classification struct {
	// Feature rules. Values must name an entry of features; anything else falls to the default.
	Feature Dimension `koanf:"feature" json:"feature,omitempty"`
	// Tenant rules. Only trusted sources count (metadata, attributes, headers and api_key rules
	// marked trusted).
	Tenant Dimension `koanf:"tenant" json:"tenant,omitempty"`
	// Tier rules. Only trusted sources count; usually `tenant_directory: true`.
	Tier Dimension `koanf:"tier" json:"tier,omitempty"`
	// Provider rules. Values must name an entry of providers.
	Provider Dimension `koanf:"provider" json:"provider,omitempty"`
	// Model rules. Any value a classification value may be is kept (models are open-ended); it
	// is used for estimation, the model map and provider model maps. A compartment family keyed
	// by model is keyed by the `models` glob the value matches (or other), never by the value
	// itself.
	Model Dimension `koanf:"model" json:"model,omitempty"`
	// Priority gives a request its own place in the queues it waits in: rules read a value as
	// for the other dimensions (header and body rules need trusted: true, or a client could
	// jump the queue by sending a header), and levels turn it into a priority that replaces its
	// compartments' priority while it waits (higher waits less). A request no rule gives a
	// listed value queues at its compartments' priority. Example: rules [{header:
	// x-llm-priority, trusted: true}], levels {interactive: 10, batch: 1}.
	Priority PriorityRules `koanf:"priority" json:"priority,omitempty"`
}

// PriorityRules classify a request's own queue priority.
type PriorityRules struct {
	// Rules are tried in order; the first value levels lists wins. Values are trimmed and
	// lower-cased, then mapped (map), like a feature's.
	Rules []Rule `koanf:"rules" json:"rules,omitempty"`
	// Levels maps a value to the priority a request with it waits at, e.g. {interactive: 10,
	// batch: 1}, on the scale of the limits' priority (higher first).
	Levels map[string]int64 `koanf:"levels" json:"levels,omitempty"`
}

// Dimension is an ordered rule list: the first rule that yields a value wins, else Default.
type Dimension struct {
	// Default is the value when no rule matches. Defaults: feature "default", tenant "anonymous",
	// tier tenants.default_tier, provider "default" (which providers must then list when it lists
	// any), model "unknown".
	Default string `koanf:"default" json:"default,omitempty"`
	// Rules are tried in order.
	Rules []Rule `koanf:"rules" json:"rules,omitempty"`
	// CaseSensitive keeps values as they are; by default values are trimmed and lower-cased
	// (tenant ids are trimmed only).
	CaseSensitive bool `koanf:"case_sensitive" json:"case_sensitive,omitempty"`
}

// Rule is one classification source. Exactly one source key is set.
type Rule struct {
	// Header reads a request header (lower-case name). With api_key, it names the header the
	// key is read from instead of authorization and x-api-key.
	Header string `koanf:"header" json:"header,omitempty"`
	// APIKey gives the tenant whose API key the request presents (tenant rules only): the key is
	// read from `authorization: Bearer …`, else from x-api-key (Anthropic's header), or from the
	// header named by header (its value as is, or after "Bearer "), hashed with SHA-256 and
	// looked up in the keys of tenants.directory (key_sha256) and tenants.keys_file. A known key
	// gives its tenant, whatever later rules or headers such as x-tenant-id say; an unknown or
	// missing key is handled as tenants.unknown_key says. Like a header rule, it needs trusted:
	// true. The key itself is never logged, counted, traced, written to Envoy's metadata, shown
	// by the admin API or sent back in an error: only the tenant it gives.
	APIKey bool `koanf:"api_key" json:"api_key,omitempty"`
	// StripClientKey (with api_key) removes the header the key is read from (authorization and
	// x-api-key, or the header named by header) from an admitted request before it goes
	// upstream, so that Envoy can set the provider's own key (a request_headers_to_add of the
	// route, after the ext_proc filter). Default false: the client's key goes upstream as sent.
	StripClientKey bool `koanf:"strip_client_key" json:"strip_client_key,omitempty"`
	// PathPrefix matches the request :path (query excluded) by prefix; Value is assigned.
	PathPrefix string `koanf:"path_prefix" json:"path_prefix,omitempty"`
	// PathRegex matches the :path by a regular expression; Value is assigned ($1… expand groups).
	PathRegex string `koanf:"path_regex" json:"path_regex,omitempty"`
	// Body reads a JSON body field by dotted path, e.g. "metadata.feature" or "user". "model"
	// is the model the path names when it names one, with or without a body: Gemini's
	// models/{model}, Bedrock's model/{modelId} and Azure OpenAI's deployment (map deployment
	// names to models with Map).
	Body string `koanf:"body" json:"body,omitempty"`
	// Metadata reads Envoy dynamic metadata forwarded in metadata_context.
	Metadata *MetadataRef `koanf:"metadata" json:"metadata,omitempty"`
	// Attribute reads an ext_proc request attribute such as "source.address" or "xds.route_name".
	Attribute string `koanf:"attribute" json:"attribute,omitempty"`
	// TenantDirectory takes the tier of the request's tenant from the tenant directory (tier only).
	TenantDirectory bool `koanf:"tenant_directory" json:"tenant_directory,omitempty"`
	// ModelMap takes the provider of the request's model from models (provider only).
	ModelMap bool `koanf:"model_map" json:"model_map,omitempty"`
	// Value is assigned when a path rule matches. For header, body, metadata and attribute rules it
	// may be empty (the read value is used).
	Value string `koanf:"value" json:"value,omitempty"`
	// Map translates read values (after normalisation) to dimension values; unmapped values pass
	// through unchanged.
	Map map[string]string `koanf:"map" json:"map,omitempty"`
	// Trusted marks a header, body or api_key rule as trusted for tenant, tier and priority.
	// Client-supplied headers are untrusted by default: a free tenant must not claim enterprise,
	// nor a batch job interactive, by sending a header.
	Trusted bool `koanf:"trusted" json:"trusted,omitempty"`
}

// MetadataRef names a value in Envoy dynamic metadata.
type MetadataRef struct {
	// Namespace is the filter namespace, e.g. "envoy.filters.http.jwt_authn".
	Namespace string `koanf:"namespace" json:"namespace,omitempty"`
	// Key is a dotted path inside the namespace's struct, e.g. "jwt_payload.tenant".
	Key string `koanf:"key" json:"key,omitempty"`
}

// Tenants is the tenant directory.
type Tenants struct {
	// DefaultTier is the tier of tenants not in the directory. Default: the tier named "free" if it
	// exists, else required when tiers exist.
	DefaultTier string `koanf:"default_tier" json:"default_tier,omitempty"`
	// Directory lists known tenants.
	Directory []Tenant `koanf:"directory" json:"directory,omitempty"`
	// KeysFile is a file of API keys for api_key tenant rules, for more keys than the directory
	// should hold: one key per line, the SHA-256 of the key in hexadecimal, white space, and the
	// tenant id (without white space); blank lines and lines starting with # are skipped. Make
	// a line with `printf %s "$KEY" | sha256sum | cut -d' ' -f1`. Every policy load and reload
	// reads it again, and the server watches it like the policy file (with --watch, or SIGHUP):
	// a Kubernetes Secret mounted as a file is picked up when the Secret changes. A line that
	// cannot be read is an error naming the file and the line: at start the server does not
	// start, on a reload the running policy and its keys stay. A key may also be in the
	// directory only for the same tenant. At most 64 MiB (about 800 000 keys); 100 000 keys load
	// in a fraction of a second and keep about 4 MiB. A relative path is relative to the
	// working directory. Which file only changes on restart. Default: none.
	KeysFile string `koanf:"keys_file" json:"keys_file,omitempty"`
	// UnknownKey says what an api_key rule does with a request whose key is unknown or
	// missing: default (the rule gives nothing: later rules, then classification.tenant.default
	// decide) or reject (a request that reaches an api_key rule is refused unless that rule or
	// a later api_key rule finds its key: with 401 in the error format of the API called,
	// reason unknown_key, counted in llm_bulkhead_rejected_total{reason="unknown_key"}). A
	// request whose tenant an earlier rule gives (a JWT claim) never reaches it. Default
	// default.
	UnknownKey string `koanf:"unknown_key" json:"unknown_key,omitempty"`

	// keys are the keys of KeysFile, read by Load.
	keys *apikey.Table
}

// Unknown key answers (Tenants.UnknownKey).
const (
	UnknownKeyDefault = "default"
	UnknownKeyReject  = "reject"
)

// KeysFromFile returns the keys read from tenants.keys_file (nil without one).
func (t *Tenants) KeysFromFile() *apikey.Table { return t.keys }

// Tenant is one tenant directory entry.
type Tenant struct {
	// ID is the tenant id as classification yields it.
	ID string `koanf:"id" json:"id,omitempty"`
	// Tier is the tenant's tier (a key of tiers).
	Tier string `koanf:"tier" json:"tier,omitempty"`
	// Limits override the tier template for this tenant's own compartments.
	Limits *Limits `koanf:"limits" json:"limits,omitempty"`
	// KeySHA256 lists the SHA-256 (64 hexadecimal digits) of each API key of the tenant, for
	// api_key tenant rules. The admin API shows only their first 8 digits.
	KeySHA256 KeyHashes `koanf:"key_sha256" json:"key_sha256,omitempty"`
}

// KeyHashes are API key hashes in hexadecimal. They encode to JSON as their first 8 digits
// and an ellipsis: enough to tell them apart, not to copy them elsewhere.
type KeyHashes []string

// MarshalJSON writes each hash's prefix.
func (k KeyHashes) MarshalJSON() ([]byte, error) {
	out := make([]string, len(k))
	for i, h := range k {
		out[i] = h[:min(len(h), 8)] + "…"
	}
	return json.Marshal(out)
}

// ModelRule maps a model glob to a provider and estimation overrides.
type ModelRule struct {
	// Match is a glob over the model name: `*` matches any run of characters, `?` one.
	Match string `koanf:"match" json:"match,omitempty"`
	// Provider is the provider of matching models (a key of providers). Optional.
	Provider string `koanf:"provider" json:"provider,omitempty"`
	// BytesPerToken overrides estimation.bytes_per_token for matching models.
	BytesPerToken float64 `koanf:"bytes_per_token" json:"bytes_per_token,omitempty"`
	// DefaultMaxTokens overrides estimation.default_max_tokens for matching models.
	DefaultMaxTokens int64 `koanf:"default_max_tokens" json:"default_max_tokens,omitempty"`
	// ContextTokens is the model's context window (prompt and output together). Reported usage
	// above it is not believed: it is settled at this bound and counted in
	// llm_bulkhead_usage_clamped_total. Default 0: estimation.max_tokens bounds it instead.
	ContextTokens int64 `koanf:"context_tokens" json:"context_tokens,omitempty"`
}

// Estimation sets how a request's token use is estimated before the response reports it.
type Estimation struct {
	// BytesPerToken is the starting prompt ratio: prompt tokens ≈ text bytes / BytesPerToken.
	// Default 4.
	BytesPerToken float64 `koanf:"bytes_per_token" json:"bytes_per_token,omitempty"`
	// DefaultMaxTokens is the expected output when a request sets no max_tokens. Default 1024.
	DefaultMaxTokens int64 `koanf:"default_max_tokens" json:"default_max_tokens,omitempty"`
	// ImageTokens is the cost of one image part. Default 765.
	ImageTokens int64 `koanf:"image_tokens" json:"image_tokens,omitempty"`
	// AudioTokens is the cost of one audio part. Default 1000.
	AudioTokens int64 `koanf:"audio_tokens" json:"audio_tokens,omitempty"`
	// FileTokens is the cost of one file or document part. Default 2000.
	FileTokens int64 `koanf:"file_tokens" json:"file_tokens,omitempty"`
	// Learn adjusts the per-model bytes-per-token ratio from settled usage. Default true.
	Learn *bool `koanf:"learn" json:"learn,omitempty"`
	// LearnWeight is the EWMA weight of one observation, in (0,1]. Default 0.05.
	LearnWeight float64 `koanf:"learn_weight" json:"learn_weight,omitempty"`
	// MinBytesPerToken and MaxBytesPerToken bound the learned ratio. Defaults 1 and 12.
	MinBytesPerToken float64 `koanf:"min_bytes_per_token" json:"min_bytes_per_token,omitempty"`
	// MaxBytesPerToken is the upper bound of the learned ratio. Default 12.
	MaxBytesPerToken float64 `koanf:"max_bytes_per_token" json:"max_bytes_per_token,omitempty"`
	// MaxTokens caps any single estimate (absurd max_tokens values are clamped). Default 1000000.
	MaxTokens int64 `koanf:"max_tokens" json:"max_tokens,omitempty"`
}

// Body sets how request bodies are read and rewritten.
type Body struct {
	// InjectIncludeUsage adds stream_options.include_usage=true to streamed OpenAI chat and
	// completions requests that lack it, so the response reports usage. Default true.
	InjectIncludeUsage *bool `koanf:"inject_include_usage" json:"inject_include_usage,omitempty"`
	// StripAcceptEncoding removes accept-encoding from upstream requests whose response must be
	// read, so usage is never hidden by compression. Default true.
	StripAcceptEncoding *bool `koanf:"strip_accept_encoding" json:"strip_accept_encoding,omitempty"`
	// RequireValidJSON lists path prefixes where a body that is not a valid JSON object is refused
	// with 400 bad_request. Elsewhere such requests are classified from headers and defaults and
	// admitted. Default empty.
	RequireValidJSON []string `koanf:"require_valid_json" json:"require_valid_json,omitempty"`
}

// Limits is a limit set. Every field is optional; unset fields inherit from Template (and its
// bases), then take the documented default.
type Limits struct {
	// Template names an entry of templates to inherit from. Templates may name a template of
	// their own (inheritance chains; cycles are refused).
	Template string `koanf:"template" json:"template,omitempty"`
	// MaxConcurrent is the most requests in flight at once, or adaptive: a limit learned from
	// the provider's latency, within the bounds of adaptive (docs/adaptive.md). Default 0 = no
	// concurrency limit.
	MaxConcurrent *Concurrency `koanf:"max_concurrent" json:"max_concurrent,omitempty"`
	// Adaptive tunes an adaptive limit (max_concurrent: adaptive). Default: every key's default.
	Adaptive *Adaptive `koanf:"adaptive" json:"adaptive,omitempty"`
	// MaxInflightTokens is the most estimated tokens in flight at once, held until each stream
	// ends. Default 0 = no limit. A single request larger than the limit is admitted only into an
	// empty compartment.
	MaxInflightTokens *int64 `koanf:"max_inflight_tokens" json:"max_inflight_tokens,omitempty"`
	// MaxWait is how long a request may queue for a slot. Default 0 = refuse at once when full.
	MaxWait *Duration `koanf:"max_wait" json:"max_wait,omitempty"`
	// QueueDepth bounds the queue. Default 10 × max_concurrent (10 × adaptive.max when
	// adaptive; 64 when max_concurrent is 0).
	QueueDepth *int64 `koanf:"queue_depth" json:"queue_depth,omitempty"`
	// Priority orders waiters in a shared pool: higher first. Default 0.
	Priority *int64 `koanf:"priority" json:"priority,omitempty"`
	// Mode is enforce or shadow (count what would be refused, refuse nothing). Default enforce.
	Mode *string `koanf:"mode" json:"mode,omitempty"`
	// TokensPerMinute is a token budget refilled smoothly over a minute. Default 0 = none.
	TokensPerMinute *int64 `koanf:"tokens_per_minute" json:"tokens_per_minute,omitempty"`
	// TokensPerDay is a token budget refilled smoothly over a day. Default 0 = none.
	TokensPerDay *int64 `koanf:"tokens_per_day" json:"tokens_per_day,omitempty"`
	// RequestsPerMinute is a request rate refilled smoothly over a minute. Default 0 = none.
	RequestsPerMinute *int64 `koanf:"requests_per_minute" json:"requests_per_minute,omitempty"`
	// MaxDebt bounds how far settlement may push a token budget below zero, as a fraction of its
	// capacity. Default 1 (one full window of debt).
	MaxDebt *float64 `koanf:"max_debt" json:"max_debt,omitempty"`
	// SpendPerHour is a spend budget in money (the policy's currency, e.g. 1.00) for each clock
	// hour of time_zone. A request is refused with 429, reason spend_budget, when its
	// worst-case cost does not fit what is left (see prices), until the hour ends; a request
	// whose worst case is more than the whole budget is refused even in an untouched window,
	// unless spend.allow_single_overrun. Tiers' spend budgets scale by ratio in tier × feature
	// compartments like every limit. Default 0 = none.
	SpendPerHour *Amount `koanf:"spend_per_hour" json:"spend_per_hour,omitempty"`
	// SpendPerDay is a spend budget in money for each calendar day of time_zone, like
	// spend_per_hour. Default 0 = none.
	SpendPerDay *Amount `koanf:"spend_per_day" json:"spend_per_day,omitempty"`
	// SpendPerMonth is a spend budget in money for each calendar month of time_zone (it resets
	// on the 1st), like spend_per_hour. Default 0 = none.
	SpendPerMonth *Amount `koanf:"spend_per_month" json:"spend_per_month,omitempty"`
}

// PriceRule is what the models matching a glob cost, per million tokens.
type PriceRule struct {
	// Match is a glob over the model name (`*` any run of characters, `?` one), matched like
	// the models list (ignoring case unless classification.model.case_sensitive), or default:
	// the price of models no other entry matches (at most one such entry).
	Match string `koanf:"match" json:"match,omitempty"`
	// InputPerMtok is the price of a million prompt tokens. Required unless the entry sets
	// per_second, per_request or per_image (then default 0).
	InputPerMtok *Amount `koanf:"input_per_mtok" json:"input_per_mtok,omitempty"`
	// OutputPerMtok is the price of a million completion tokens. Required unless the entry sets
	// per_second, per_request or per_image (then default 0).
	OutputPerMtok *Amount `koanf:"output_per_mtok" json:"output_per_mtok,omitempty"`
	// CachedInputPerMtok is the price of a million prompt tokens served from a prompt cache.
	// Default input_per_mtok.
	CachedInputPerMtok *Amount `koanf:"cached_input_per_mtok" json:"cached_input_per_mtok,omitempty"`
	// ReasoningPerMtok is the price of a million reasoning tokens (part of the completion).
	// Default output_per_mtok.
	ReasoningPerMtok *Amount `koanf:"reasoning_per_mtok" json:"reasoning_per_mtok,omitempty"`
	// PerSecond is the price of one second of audio, for models billed by duration (whisper-1:
	// 0.0001 is $0.006 a minute), charged for the seconds of /v1/audio/transcriptions and
	// /v1/audio/translations. An upload's model is a form field, which is never read: name it
	// with a classification.model rule (a header, or a path_prefix with a value). Default 0.
	PerSecond *Amount `koanf:"per_second" json:"per_second,omitempty"`
	// PerRequest is the price of each request the provider served (a 2xx response), on top of
	// any tokens: speech, or a per-call fee. Default 0.
	PerRequest *Amount `koanf:"per_request" json:"per_request,omitempty"`
	// PerImage is the price of each image an /v1/images/generations request asks for (its n,
	// default 1), charged when the provider served it. Default 0.
	PerImage *Amount `koanf:"per_image" json:"per_image,omitempty"`
}

// DefaultPrice is the match of the price entry that prices models no other entry matches.
const DefaultPrice = "default"

// Feature is one feature: its own compartment limits plus feature-wide settings.
type Feature struct {
	// Limits of the feature's compartment (a `feature` family with `limits: feature`).
	Limits `koanf:",squash"`
	// Ratio is the feature's share of a tier template when a family scales by feature
	// (the example policies' tier × feature compartments): limits × ratio, never below 1. Default 1.
	Ratio *float64 `koanf:"ratio" json:"ratio,omitempty"`
	// Degrade re-routes instead of refusing when this feature's request is refused for budget or
	// capacity and the target can take it.
	Degrade *Degrade `koanf:"degrade" json:"degrade,omitempty"`
}

// Degrade is where a refused request goes instead.
type Degrade struct {
	// Provider is the provider to re-route to (a key of providers).
	Provider string `koanf:"provider" json:"provider,omitempty"`
	// On lists refusal reasons that trigger the re-route: token_budget, rate_limit,
	// bulkhead_full, spend_budget (the re-routed request is priced at the model it is sent as,
	// and must fit the same spend budgets). Default [token_budget, spend_budget].
	On []string `koanf:"on" json:"on,omitempty"`
}

// Provider is one upstream provider.
type Provider struct {
	// Limits of the provider's compartment (a `provider` family with `limits: provider`).
	Limits `koanf:",squash"`
	// Breaker names an entry of breakers. Default none (no breaker).
	Breaker string `koanf:"breaker" json:"breaker,omitempty"`
	// BreakerPerModel keeps one breaker per model glob of the `models` list that can name this
	// provider's models (e.g. provider/deepseek-r*), instead of one per provider. Models that
	// match no glob share the provider-wide breaker: model names come from clients, so they never
	// create breakers or metric series themselves.
	BreakerPerModel bool `koanf:"breaker_per_model" json:"breaker_per_model,omitempty"`
	// Fallback is the provider to re-route to while this provider's breaker is open, or while
	// its quota cannot cover a request (quota.mode enforce).
	Fallback string `koanf:"fallback" json:"fallback,omitempty"`
	// Quota follows what the provider's responses say is left of the account's rate limits
	// (OpenAI's and Azure's x-ratelimit-*, Anthropic's anthropic-ratelimit-* headers), so that
	// a request the provider would refuse with 429 is not sent.
	Quota ProviderQuota `koanf:"quota" json:"quota,omitempty"`
	// Models says which model to send this provider when a request is re-routed to it (a
	// breaker's fallback or a feature's degrade rule): the first entry, in file order, whose
	// match fits the request's model gives the model the body is rewritten to. A list rather
	// than a mapping because order decides and model names contain dots. A re-route to a
	// provider that has models but no entry for the request's model does not happen (the
	// request gets the refusal it had): a model is never sent unchanged to a provider that may
	// not serve it. Without models, re-routed requests keep their model, which validation
	// allows only when the `models` list assigns no models to the providers they come from.
	// Rewriting needs the buffered body (envoy.request_body_mode BUFFERED).
	Models []ModelMapping `koanf:"models" json:"models,omitempty"`
}

// ProviderQuota is how admission uses a provider's rate-limit headers.
type ProviderQuota struct {
	// Mode: off ignores the headers; shadow tracks them and counts the requests the quota could
	// not cover (llm_bulkhead_provider_quota_short_total) without changing any decision;
	// enforce re-routes such a request along fallback (with the model rewrite) or refuses it
	// with 429, reason provider_quota, retry-after the provider's reset. Requests in flight
	// count against what is left (held at their estimate until a response says how much is
	// left counting them; at their real use once answered without saying). Default off.
	Mode string `koanf:"mode" json:"mode,omitempty"`
	// Reserve is the share of each quota's limit kept for the requests of the highest priority
	// the policy gives (limits' and classification.priority's): the others find the quota short
	// while less than that is left, so interactive traffic keeps the last of it. 0 to 0.9.
	// Default 0.
	Reserve float64 `koanf:"reserve" json:"reserve,omitempty"`
	// Account says which of the provider's accounts (API keys) a request uses, for a provider
	// the platform reaches with several keys (one per team, or a pool), each with rate limits
	// of its own: each account's quota is then tracked apart, from the responses of its own
	// requests, and a request is admitted against its account's quota. The source is a
	// request header or Envoy metadata, read as classification rules read them; a request
	// re-routed to a fallback uses the fallback's account source. Default none: one account
	// for the provider.
	Account *QuotaAccount `koanf:"account" json:"account,omitempty"`
	// MaxAccounts bounds the accounts tracked apart (account values come from requests): the
	// requests of any account beyond the first max_accounts seen share one quota, shown as
	// account _other (logged once). 1 to 4096; default 64. Only with account.
	MaxAccounts int `koanf:"max_accounts" json:"max_accounts,omitempty"`
}

// QuotaAccount names where a request's provider account is read. Exactly one of header and
// metadata is set. The value is trimmed and must be an identity like a tenant id (at most
// 256 bytes of UTF-8, no control characters); a request whose value is missing or not one
// uses Default.
type QuotaAccount struct {
	// Header reads a request header (lower-case name), e.g. one the route sets with the
	// upstream key it chooses. Needs trusted: true, as a tenant header does: a client must not
	// spend another account's quota by sending the header.
	Header string `koanf:"header" json:"header,omitempty"`
	// Metadata reads Envoy dynamic metadata forwarded in metadata_context.
	Metadata *MetadataRef `koanf:"metadata" json:"metadata,omitempty"`
	// Trusted marks a header as set (or stripped from the client's request) by Envoy.
	Trusted bool `koanf:"trusted" json:"trusted,omitempty"`
	// Default is the account of requests the source gives no value. Default "default".
	Default string `koanf:"default" json:"default,omitempty"`
}

// ModelMapping maps a model glob to the model a provider is sent instead.
type ModelMapping struct {
	// Match is a glob over the request's model (as classification gives it): `*` matches any
	// run of characters, `?` one.
	Match string `koanf:"match" json:"match,omitempty"`
	// Model is the model name sent in the rewritten body, e.g. qwen-plus for match
	// deepseek-chat; "*" alone sends the request's model unchanged (the provider serves the
	// same names).
	Model string `koanf:"model" json:"model,omitempty"`
}

// Breaker is a circuit breaker setting, Resilience4j style. Unset fields inherit from Base, then
// take Resilience4j's defaults.
type Breaker struct {
	// Base names another entry of breakers to inherit from.
	Base string `koanf:"base" json:"base,omitempty"`
	// SlidingWindowType is COUNT_BASED or TIME_BASED. Default COUNT_BASED.
	SlidingWindowType *string `koanf:"sliding_window_type" json:"sliding_window_type,omitempty"`
	// SlidingWindowSize is calls (COUNT_BASED) or seconds (TIME_BASED). Default 100.
	SlidingWindowSize *int `koanf:"sliding_window_size" json:"sliding_window_size,omitempty"`
	// MinimumCalls is the fewest calls before rates are evaluated. Default 100.
	MinimumCalls *int `koanf:"minimum_calls" json:"minimum_calls,omitempty"`
	// FailureRateThreshold is a percentage in (0,100]. Default 50.
	FailureRateThreshold *float64 `koanf:"failure_rate_threshold" json:"failure_rate_threshold,omitempty"`
	// SlowCallRateThreshold is a percentage in (0,100]. Default 100.
	SlowCallRateThreshold *float64 `koanf:"slow_call_rate_threshold" json:"slow_call_rate_threshold,omitempty"`
	// SlowCallDuration is the time above which a call is slow. Default 60s.
	SlowCallDuration *Duration `koanf:"slow_call_duration" json:"slow_call_duration,omitempty"`
	// SlowCallMeasure is ttfb or total. ttfb is the time from admission to the first token: the
	// first response body chunk with generated content (in a stream, the first event with
	// generated text; in a JSON body, its first byte), not the response headers, which many
	// providers send before the model has produced anything. A response whose body is not read
	// (an error status, or a response body mode of NONE) is measured at its headers, and a read
	// body that ends without any content at its end. total is admission to the end of the
	// response. Default ttfb: a long streamed answer is not a slow provider.
	SlowCallMeasure *string `koanf:"slow_call_measure" json:"slow_call_measure,omitempty"`
	// WaitInOpen is how long the breaker stays OPEN. Default 60s.
	WaitInOpen *Duration `koanf:"wait_in_open" json:"wait_in_open,omitempty"`
	// WaitInOpenMultiplier grows the wait on consecutive openings. Default 1 (no growth).
	WaitInOpenMultiplier *float64 `koanf:"wait_in_open_multiplier" json:"wait_in_open_multiplier,omitempty"`
	// MaxWaitInOpen caps the grown wait, and how long an upstream retry-after may hold the breaker
	// OPEN (or hold a tenant back, see retry_after_scope). Default 0: the grown wait is capped at
	// 10 × wait_in_open, and a retry-after hold at wait_in_open.
	MaxWaitInOpen *Duration `koanf:"max_wait_in_open" json:"max_wait_in_open,omitempty"`
	// PermittedCallsInHalfOpen is the number of probe calls. Default 10.
	PermittedCallsInHalfOpen *int `koanf:"permitted_calls_in_half_open" json:"permitted_calls_in_half_open,omitempty"`
	// MaxWaitInHalfOpen reopens the breaker when probes do not finish in time. Default 0 = wait.
	MaxWaitInHalfOpen *Duration `koanf:"max_wait_in_half_open" json:"max_wait_in_half_open,omitempty"`
	// State starts the breaker in CLOSED, DISABLED, METRICS_ONLY or FORCED_OPEN. Default CLOSED.
	State *string `koanf:"state" json:"state,omitempty"`
	// Record lists what counts as a failure, like Resilience4j's record predicate: status codes
	// ("503") or classes ("5xx", "4xx"), timeout (the stream ended after admission without
	// response headers) and stream_error (a 2xx response whose body reported a server error: an
	// error event in a stream, or a JSON body with a top-level error object). The statuses listed
	// replace the failure statuses (default ["5xx"]); a list without any status keeps them.
	// timeout and stream_error are failures unless listed in ignore. A status neither recorded
	// nor ignored counts as a success. 429, and a rate-limit error inside a 2xx response, go by
	// rate_limited_as (listing 429 is refused); a client error inside a 2xx response
	// (invalid_request_error, …) is judged as a 400. Exclusive with failure_statuses (its older
	// name for the statuses) and, for timeout, with no_response_as. Example: [5xx, timeout,
	// stream_error].
	Record []string `koanf:"record" json:"record,omitempty"`
	// Ignore lists what records nothing, in record's terms. The statuses listed replace the
	// ignored statuses (default ["4xx"]: client errors say nothing about the provider); a list
	// without any status keeps them. A status both recorded and ignored is a failure (across
	// base entries; within one entry it is an error). Exclusive with ignore_statuses (its older
	// name for the statuses) and, for timeout, with no_response_as.
	Ignore []string `koanf:"ignore" json:"ignore,omitempty"`
	// FailureStatuses is the older name of record's statuses. Default ["5xx"].
	FailureStatuses []string `koanf:"failure_statuses" json:"failure_statuses,omitempty"`
	// IgnoreStatuses is the older name of ignore's statuses. Default ["4xx"]. 429 is handled by
	// RateLimitedAs.
	IgnoreStatuses []string `koanf:"ignore_statuses" json:"ignore_statuses,omitempty"`
	// RateLimitedAs is how an upstream 429 counts: neutral (recorded as success, not a failure),
	// failure, or ignore. Default neutral.
	RateLimitedAs *string `koanf:"rate_limited_as" json:"rate_limited_as,omitempty"`
	// HonorRetryAfter holds calls back for an upstream 429/503 retry-after, never longer than
	// max_wait_in_open (or wait_in_open when that is unset). Default true.
	HonorRetryAfter *bool `koanf:"honor_retry_after" json:"honor_retry_after,omitempty"`
	// RetryAfterScope is whom an upstream 429's retry-after holds back: tenant (only the tenant
	// whose request got the 429 is refused with rate_limit until it passes; a per-key limit at
	// the provider must not ground every tenant) or provider (the breaker opens for everyone).
	// A 503's retry-after always opens the breaker. Default tenant.
	RetryAfterScope *string `koanf:"retry_after_scope" json:"retry_after_scope,omitempty"`
	// NoResponseAs is how a stream that ended after admission without response headers counts:
	// failure or ignore; the older form of timeout in record or ignore. Default failure.
	NoResponseAs *string `koanf:"no_response_as" json:"no_response_as,omitempty"`
}

// Family is a compartment family: one compartment per distinct value of its key dimensions.
type Family struct {
	// Name is the family name; instances are named "<name>/<value>[/<value>…]".
	Name string `koanf:"name" json:"name,omitempty"`
	// Key lists the dimensions (feature, tenant, tier, provider, model) whose values key an
	// instance. Model keys by the first glob of the `models` list that matches the request's
	// model, and by "other" for models no glob matches (no such instance when a glob is "*"):
	// a client's model name never creates a compartment or a metric series. E.g. `key: [tenant,
	// model]` with `limits: {max_concurrent: 5}` lets each tenant run 5 requests at once per
	// model glob (tenant_model/acme/gpt-4o*), and `key: [model]` with tokens_per_minute gives
	// each model glob a budget of its own.
	Key []string `koanf:"key" json:"key,omitempty"`
	// LimitsFrom names the dimension whose entries give each instance's limits: feature, tier,
	// provider or tenant (the tenant's tier template with the tenant's own overrides). Exclusive
	// with Limits.
	LimitsFrom string `koanf:"limits_from" json:"limits_from,omitempty"`
	// Limits gives the same limits to every instance. Exclusive with LimitsFrom.
	Limits *Limits `koanf:"limits" json:"limits,omitempty"`
	// ScaleBy names a dimension whose entry's ratio scales every count limit (only feature).
	ScaleBy string `koanf:"scale_by" json:"scale_by,omitempty"`
	// Where restricts the family to requests whose dimensions have one of the listed values.
	// Values of model are globs of the `models` list, or other.
	Where map[string][]string `koanf:"where" json:"where,omitempty"`
	// Mode overrides every instance's mode (enforce or shadow). Default: each limit set's own.
	Mode string `koanf:"mode" json:"mode,omitempty"`
	// MaxInstances bounds instances of a family keyed by tenant; the least recently used idle
	// instance is evicted first (idle: no request holds it and its budget windows are empty).
	// While all are busy, new tenants share the family's overflow compartment, `<name>/_overflow`,
	// which has the default tier's limits. Default 10000.
	MaxInstances int `koanf:"max_instances" json:"max_instances,omitempty"`
	// IdleTTL evicts tenant-keyed instances idle this long. Default 10m.
	IdleTTL Duration `koanf:"idle_ttl" json:"idle_ttl,omitempty"`
}

// Pool lets compartments share capacity: each member always has its guaranteed share and may
// borrow idle capacity up to its max; borrowed capacity is never preempted, and it is not
// lent again while a member below its guarantee is waiting.
type Pool struct {
	// Name of the pool.
	Name string `koanf:"name" json:"name,omitempty"`
	// MaxConcurrent is the pool's capacity.
	MaxConcurrent int64 `koanf:"max_concurrent" json:"max_concurrent,omitempty"`
	// Members are compartment instances, named "<family>/<value>".
	Members []PoolMember `koanf:"members" json:"members,omitempty"`
}

// PoolMember is one compartment's place in a pool.
type PoolMember struct {
	// Compartment is the instance name, e.g. "feature/chat".
	Compartment string `koanf:"compartment" json:"compartment,omitempty"`
	// Guaranteed is the capacity the member can always use (once borrowed capacity returns).
	Guaranteed int64 `koanf:"guaranteed" json:"guaranteed,omitempty"`
	// Max is the most the member may hold, borrowing included. Default: the pool's capacity.
	Max int64 `koanf:"max" json:"max,omitempty"`
}

// Responses sets headers added to admitted responses.
type Responses struct {
	// CompartmentHeader adds x-bulkhead-compartment to responses. Default false.
	CompartmentHeader bool `koanf:"compartment_header" json:"compartment_header,omitempty"`
	// RateLimitHeaders adds x-ratelimit-remaining-tokens and x-ratelimit-reset-tokens for the
	// tightest token budget of the request's compartments. Default false.
	RateLimitHeaders bool `koanf:"ratelimit_headers" json:"ratelimit_headers,omitempty"`
}

// QuotaEndpoint is the path clients ask their remaining limits at. The caller is classified
// exactly as its LLM requests are (its tenant from the same trusted sources, its feature from
// the same rules, e.g. x-llm-feature), and the answer is JSON about its own compartments: for
// a compartment keyed by tenant, its limits, what is left of each token and request window and
// spend budget with their reset times, and its requests in flight; for a compartment other
// tenants share, its limits only (what others use is not theirs to see).
type QuotaEndpoint struct {
	// Enabled answers GET requests for Path. Default false.
	Enabled bool `koanf:"enabled" json:"enabled,omitempty"`
	// Path is the request path (query ignored) answered. Default /v1/bulkhead/quota.
	Path string `koanf:"path" json:"path,omitempty"`
}

// Cluster makes every replica enforce one shared policy: token budgets, request rates and
// concurrency are kept in Redis, so that "20 concurrent chat requests" means 20 across the whole
// fleet, not 20 per replica. Off by default (backend empty): each process enforces the policy
// alone.
type Cluster struct {
	// Backend is "redis" to share limits, or empty (or "none") to keep them per process.
	// Default empty.
	Backend string `koanf:"backend" json:"backend,omitempty"`
	// Addresses lists host:port pairs: the server (standalone), the sentinels (sentinel) or some
	// cluster nodes (cluster). Required with a backend.
	Addresses []string `koanf:"addresses" json:"addresses,omitempty"`
	// Mode is standalone, sentinel or cluster. Default standalone.
	Mode string `koanf:"mode" json:"mode,omitempty"`
	// MasterName is the sentinel master set's name. Required in sentinel mode, refused otherwise.
	MasterName string `koanf:"master_name" json:"master_name,omitempty"`
	// Username is the Redis ACL user. Default empty (the default user).
	Username string `koanf:"username" json:"username,omitempty"`
	// PasswordEnv names the environment variable holding the Redis password (never the password
	// itself: policy files end up in config maps and logs). Default empty (no password).
	PasswordEnv string `koanf:"password_env" json:"password_env,omitempty"`
	// TLS configures TLS to Redis. Default off.
	TLS ClusterTLS `koanf:"tls" json:"tls,omitempty"`
	// KeyPrefix starts every Redis key and channel name, in a hash tag so that every key lives
	// in one Redis Cluster slot (each admission is one atomic script). Replicas enforcing one
	// policy must share it; different deployments sharing a Redis must not.
	// Default "llm-bulkhead".
	KeyPrefix string `koanf:"key_prefix" json:"key_prefix,omitempty"`
	// ReplicaID names this replica among the others; leases held on it belong to it, and must
	// be unique among live replicas.
	// Default "<hostname>-<pid>".
	ReplicaID string `koanf:"replica_id" json:"replica_id,omitempty"`
	// Timeout is the longest an admission waits for Redis. Beyond it the request asks again for
	// what is left of its max_wait (refused with cluster_unavailable when none is left, or at once
	// with on_unavailable closed); three in a row make the replica follow on_unavailable.
	// Default 20ms.
	Timeout Duration `koanf:"timeout" json:"timeout,omitempty"`
	// DialTimeout bounds connecting to Redis. Default 1s.
	DialTimeout Duration `koanf:"dial_timeout" json:"dial_timeout,omitempty"`
	// WriteTimeout bounds the calls off the admission path: settlements, heartbeats, resyncs.
	// Default 1s.
	WriteTimeout Duration `koanf:"write_timeout" json:"write_timeout,omitempty"`
	// LeaseTTL is how long a replica's concurrency leases outlive its last heartbeat: the slots
	// of a replica that died without saying so come back after this long. Between 1s and 1h.
	// Default 10s.
	LeaseTTL Duration `koanf:"lease_ttl" json:"lease_ttl,omitempty"`
	// Heartbeat is how often a replica renews its leases (all of them in one call) and learns
	// the live membership. At most lease_ttl / 2. Default lease_ttl / 4.
	Heartbeat Duration `koanf:"heartbeat" json:"heartbeat,omitempty"`
	// SettleInterval is how long settlements and releases may wait to be sent together in one
	// call. Default 2ms.
	SettleInterval Duration `koanf:"settle_interval" json:"settle_interval,omitempty"`
	// MaxPendingSettlements bounds settlements queued while Redis is unreachable; beyond it the
	// oldest are dropped (counted), and the replica's leases are rewritten from its own state when
	// Redis is back. Default 100000.
	MaxPendingSettlements int `koanf:"max_pending_settlements" json:"max_pending_settlements,omitempty"`
	// Admission is where an admission's limits are counted. "leased": each replica holds, per
	// compartment it uses, a lease of the compartment's limits (slots, in-flight tokens, chunks
	// of its windows) granted from Redis by demand, and admits against it with no call to Redis
	// on the request's path; a lease is reported every lease_interval while its use changes,
	// and renewed every 25th (at least twice within the lease ttl) while it is steady.
	// "exact": every admission
	// runs one atomic script in Redis (a round trip per request, one Redis slot for the whole
	// fleet). Default leased.
	Admission string `koanf:"admission" json:"admission,omitempty"`
	// LeaseInterval is how often a replica reports, per compartment it uses while its use
	// changes, what it holds and wants, and receives its new lease (leased admission; a replica
	// whose requests wait for its lease reports at once, a steady lease every 25th interval,
	// at least twice within the lease ttl). Between 10ms and lease_ttl / 4. Default 200ms.
	LeaseInterval Duration `koanf:"lease_interval" json:"lease_interval,omitempty"`
	// OnUnavailable is what admission does while Redis is slow or gone: "local" enforces this
	// replica's part of each limit in this process (budgets and rates divided by the live
	// replicas last seen, at least 1; concurrency the slots Redis counted for it, or with leased
	// admission the lease it last granted it, plus an equal part of the room free), "closed"
	// refuses with 503, reason cluster_unavailable. Default local.
	OnUnavailable string `koanf:"on_unavailable" json:"on_unavailable,omitempty"`
	// ExpectedReplicas is how many replicas the deployment runs: while a replica enforces its
	// part of the limits alone, it divides them by at least this many, from its first request
	// (before it has reached Redis and seen the others). Between 1 and 1000; default 0 (not
	// set: a replica that has never reached Redis enforces the whole limits).
	ExpectedReplicas int `koanf:"expected_replicas" json:"expected_replicas,omitempty"`
}

// ClusterTLS configures TLS to Redis.
type ClusterTLS struct {
	// Enabled turns TLS on. Default false.
	Enabled bool `koanf:"enabled" json:"enabled,omitempty"`
	// CAFile is a PEM bundle of the CAs to trust. Default the system roots.
	CAFile string `koanf:"ca_file" json:"ca_file,omitempty"`
	// CertFile is a client certificate (PEM) for mutual TLS, with KeyFile. Both or neither.
	CertFile string `koanf:"cert_file" json:"cert_file,omitempty"`
	// KeyFile is the client certificate's private key (PEM), with CertFile. Both or neither.
	KeyFile string `koanf:"key_file" json:"key_file,omitempty"`
	// ServerName overrides the name checked in the server's certificate. Default the address's host.
	ServerName string `koanf:"server_name" json:"server_name,omitempty"`
	// InsecureSkipVerify accepts any server certificate (tests only). Default false.
	InsecureSkipVerify bool `koanf:"insecure_skip_verify" json:"insecure_skip_verify,omitempty"`
}
