package llmapi

import "strings"

// Dialect is the family of conventions an endpoint follows beyond its bodies: the shape of
// its error bodies, its status for overload, and the headers its SDKs read. It is a small
// value type and safe for concurrent use.
type Dialect uint8

// The dialects. DialectOpenAI is the zero value: OpenAI and the many servers compatible with it.
const (
	DialectOpenAI    Dialect = iota
	DialectAnthropic         // {"type":"error","error":{"type","message"}}, 529 when overloaded
	DialectAzure             // Azure OpenAI: {"error":{"code","message"}}, code "429" for rate limits
	DialectGemini            // Google: {"error":{"code","message","status"}}, status RESOURCE_EXHAUSTED
	DialectBedrock           // AWS: {"message"} with the exception's name in x-amzn-errortype
)

var dialectNames = [...]string{"openai", "anthropic", "azure", "gemini", "bedrock"}

// String returns the stable name of d.
func (d Dialect) String() string {
	if int(d) < len(dialectNames) {
		return dialectNames[d]
	}
	return "openai"
}

// Route is what a request's :path says about it.
type Route struct {
	API     API
	Dialect Dialect
	// Model is the model the path names, "" when the body names it: Gemini's
	// models/{model}, Bedrock's model/{modelId} (percent-decoded, so that an id the AWS SDKs
	// send as anthropic.claude-3-haiku-20240307-v1%3A0 reads as it is written) and Azure's
	// deployments/{deployment}, the name of the deployment (which a policy maps to its model).
	Model string
	// SSE: a Gemini streamGenerateContent with alt=sse, which answers in server-sent events
	// instead of a streamed JSON array.
	SSE bool
}

// APIFromPath maps a request :path to its API; it is ParsePath(path).API.
func APIFromPath(path string) API { return ParsePath(path).API }

// ParsePath reads a request :path. The query string is read only for Gemini's alt=sse, and a
// fragment is ignored. Any prefix before the part that names the endpoint is tolerated, so
// that gateways mounting providers under a prefix of their own still match:
//
//   - OpenAI: what follows the last "/v1/" must be exactly one of chat/completions,
//     completions, embeddings, responses, messages (Anthropic), audio/transcriptions,
//     audio/translations, audio/speech or images/generations (an optional trailing slash is
//     allowed), which keeps lookalikes such as /v1/threads/x/messages or /v1/responses/{id}
//     from being mistaken for generation calls. Under /openai/v1/ the dialect is Azure's.
//   - Azure OpenAI: /openai/deployments/{deployment}/ followed by one of the OpenAI endpoints
//     above but messages and responses, and /openai/responses.
//   - Gemini: the last segment is {model}:{method} after a models/ (or tunedModels/)
//     segment, as in /v1beta/models/{model}:generateContent and Vertex AI's
//     /v1/projects/{p}/locations/{l}/publishers/google/models/{model}:generateContent.
//   - Bedrock: /model/{modelId}/{converse, converse-stream, invoke,
//     invoke-with-response-stream}; the invoke methods are read as Anthropic messages when
//     the model id names an Anthropic model, and otherwise only their model and dialect are
//     known (API unknown).
//
// It does not allocate for a model name it has seen recently (see RequestFields) and is safe
// for concurrent use.
func ParsePath(path string) Route {
	query := ""
	if q := strings.IndexAny(path, "?#"); q >= 0 {
		if path[q] == '?' {
			query = path[q+1:]
			if h := strings.IndexByte(query, '#'); h >= 0 {
				query = query[:h]
			}
		}
		path = path[:q]
	}
	if r, ok := geminiRoute(path, query); ok {
		return r
	}
	if r, ok := bedrockRoute(path); ok {
		return r
	}
	if r, ok := azureDeploymentRoute(path); ok {
		return r
	}
	v := strings.LastIndex(path, "/v1/")
	if v < 0 {
		if strings.HasSuffix(trimSlash(path), "/openai/responses") {
			return Route{API: APIOpenAIResponses, Dialect: DialectAzure}
		}
		return Route{}
	}
	api := openAIEndpoint(trimSlash(path[v+3:]))
	r := Route{API: api}
	switch {
	case api == APIAnthropicMessages:
		r.Dialect = DialectAnthropic
	case api != APIUnknown && strings.HasSuffix(path[:v], "/openai"):
		r.Dialect = DialectAzure
	}
	return r
}

// trimSlash drops one trailing slash from a path longer than it.
func trimSlash(p string) string {
	if len(p) > 1 && p[len(p)-1] == '/' {
		return p[:len(p)-1]
	}
	return p
}

// openAIEndpoint maps what follows /v1 (or an Azure deployment) to its API.
func openAIEndpoint(rest string) API {
	switch rest {
	case "/chat/completions":
		return APIOpenAIChat
	case "/completions":
		return APIOpenAICompletions
	case "/embeddings":
		return APIOpenAIEmbeddings
	case "/responses":
		return APIOpenAIResponses
	case "/messages":
		return APIAnthropicMessages
	case "/audio/transcriptions":
		return APIOpenAITranscriptions
	case "/audio/translations":
		return APIOpenAITranslations
	case "/audio/speech":
		return APIOpenAISpeech
	case "/images/generations":
		return APIOpenAIImages
	}
	return APIUnknown
}

// azureDeploymentRoute reads /openai/deployments/{deployment}/{endpoint}.
func azureDeploymentRoute(path string) (Route, bool) {
	const marker = "/openai/deployments/"
	i := strings.LastIndex(path, marker)
	if i < 0 {
		return Route{}, false
	}
	rest := path[i+len(marker):]
	slash := strings.IndexByte(rest, '/')
	if slash <= 0 {
		return Route{}, false
	}
	api := openAIEndpoint(trimSlash(rest[slash:]))
	if api == APIUnknown || api == APIAnthropicMessages || api == APIOpenAIResponses {
		return Route{}, false
	}
	return Route{API: api, Dialect: DialectAzure, Model: pathModel(rest[:slash])}, true
}

// geminiRoute reads .../models/{model}:{method}.
func geminiRoute(path, query string) (Route, bool) {
	seg := path[strings.LastIndexByte(path, '/')+1:]
	colon := strings.LastIndexByte(seg, ':')
	if colon <= 0 {
		return Route{}, false
	}
	parent := path[:len(path)-len(seg)]
	if !strings.HasSuffix(parent, "/models/") && !strings.HasSuffix(parent, "/tunedModels/") {
		return Route{}, false
	}
	var api API
	switch seg[colon+1:] {
	case "generateContent":
		api = APIGeminiGenerate
	case "streamGenerateContent":
		api = APIGeminiStream
	case "countTokens":
		api = APIGeminiCountTokens
	case "embedContent":
		api = APIGeminiEmbed
	default:
		return Route{}, false
	}
	r := Route{API: api, Dialect: DialectGemini, Model: pathModel(seg[:colon])}
	r.SSE = api == APIGeminiStream && queryHas(query, "alt", "sse")
	return r, true
}

// queryHas reports whether the query string has key=value.
func queryHas(query, key, value string) bool {
	for query != "" {
		var kv string
		kv, query, _ = strings.Cut(query, "&")
		if k, v, ok := strings.Cut(kv, "="); ok && k == key && v == value {
			return true
		}
	}
	return false
}

// bedrockRoute reads .../model/{modelId}/{operation}.
func bedrockRoute(path string) (Route, bool) {
	const marker = "/model/"
	i := strings.LastIndex(path, marker)
	if i < 0 {
		return Route{}, false
	}
	id, op, ok := strings.Cut(path[i+len(marker):], "/")
	if !ok || id == "" {
		return Route{}, false
	}
	r := Route{Dialect: DialectBedrock, Model: pathModel(id)}
	anthropic := strings.Contains(r.Model, "anthropic")
	switch op {
	case "converse":
		r.API = APIBedrockConverse
	case "converse-stream":
		r.API = APIBedrockConverseStream
	case "invoke":
		if anthropic {
			r.API = APIBedrockInvoke
		}
	case "invoke-with-response-stream":
		if anthropic {
			r.API = APIBedrockInvokeStream
		}
	default:
		return Route{}, false
	}
	return r, true
}

// maxPathModel bounds a model name read from a path; a longer one is cut there.
const maxPathModel = 256

// pathModel returns a path segment percent-decoded (an invalid escape is kept as it is),
// interned.
func pathModel(seg string) string {
	if strings.IndexByte(seg, '%') < 0 {
		return intern(stringBytes(seg[:min(len(seg), maxPathModel)]))
	}
	var buf [maxPathModel]byte
	out := buf[:0]
	for i := 0; i < len(seg) && len(out) < len(buf); i++ {
		c := seg[i]
		if c == '%' && i+2 < len(seg) {
			if h, l := hexVal(seg[i+1]), hexVal(seg[i+2]); h >= 0 && l >= 0 {
				out = append(out, byte(h<<4|l))
				i += 2
				continue
			}
		}
		out = append(out, c)
	}
	return intern(out)
}
