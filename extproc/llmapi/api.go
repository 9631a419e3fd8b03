package llmapi

import "strings"

// API identifies the wire protocol of an endpoint. It is a small value type and
// safe for concurrent use.
type API uint8

// The APIs this package understands. APIUnknown is the zero value.
const (
	APIUnknown           API = iota
	APIOpenAIChat            // /v1/chat/completions
	APIOpenAICompletions     // /v1/completions
	APIOpenAIEmbeddings      // /v1/embeddings
	APIOpenAIResponses       // /v1/responses
	APIAnthropicMessages     // /v1/messages
)

// String returns the stable name of a, used in metrics labels and logs. It is
// safe for concurrent use.
func (a API) String() string {
	switch a {
	case APIOpenAIChat:
		return "openai.chat"
	case APIOpenAICompletions:
		return "openai.completions"
	case APIOpenAIEmbeddings:
		return "openai.embeddings"
	case APIOpenAIResponses:
		return "openai.responses"
	case APIAnthropicMessages:
		return "anthropic.messages"
	default:
		return "unknown"
	}
}

// Anthropic reports whether a speaks Anthropic's protocol, which decides the
// shape of error bodies and of usage. It is safe for concurrent use.
func (a API) Anthropic() bool { return a == APIAnthropicMessages }

// APIFromPath maps a request :path to its API. The query string and fragment
// are ignored, and any prefix before the last "/v1/" is tolerated so that
// gateways mounting providers under /openai or /api still match; what follows
// "/v1" must be exactly one of the known endpoints (an optional trailing slash
// is allowed), which keeps lookalikes such as /v1/threads/x/messages or
// /v1/responses/{id} from being mistaken for generation calls. It does not
// allocate and is safe for concurrent use.
func APIFromPath(path string) API {
	if q := strings.IndexAny(path, "?#"); q >= 0 {
		path = path[:q]
	}
	v := strings.LastIndex(path, "/v1/")
	if v < 0 {
		return APIUnknown
	}
	rest := path[v+3:]
	if len(rest) > 1 && rest[len(rest)-1] == '/' {
		rest = rest[:len(rest)-1]
	}
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
	}
	return APIUnknown
}
