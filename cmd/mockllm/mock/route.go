package mock

import (
	"net/http"
	"net/url"
	"strings"
)

// dialect is the family of conventions a call follows beyond its bodies: the shape of its
// error bodies and the headers that come with them.
type dialect uint8

const (
	dialectOpenAI    dialect = iota // {"error":{"message","type","param","code"}}
	dialectAnthropic                // {"type":"error","error":{"type","message"}}
	dialectAzure                    // {"error":{"code","message"}}, code "429" for rate limits
	dialectGemini                   // {"error":{"code","message","status"}}
	dialectBedrock                  // {"message"} with the exception's name in x-amzn-errortype
)

// route is what a request's URL says about the call: the endpoint, the dialect of its
// errors, the model the path names ("" when the body names it) and, for Gemini's
// streamGenerateContent, whether it streams server-sent events (alt=sse) or a JSON array.
type route struct {
	api     api
	dialect dialect
	model   string
	sse     bool
	// label names the path in Stats.ByPath, with the model left out
	// ("/v1beta/models/{model}:generateContent"), so that counters do not grow per model.
	label string
}

// routeOf maps a request URL to the endpoint serving it:
//
//	/v1/{chat/completions,completions,embeddings,responses,messages}   OpenAI, Anthropic
//	/openai/v1/{chat/completions,completions,embeddings,responses}     Azure OpenAI v1
//	/openai/deployments/{deployment}/{chat/completions,completions,embeddings}?api-version=…
//	/v1beta/models/{model}:{generateContent,streamGenerateContent,countTokens,embedContent}
//	    (also under /v1/; streamGenerateContent with ?alt=sse streams SSE, else a JSON array)
//	/model/{modelId}/{converse,converse-stream,invoke,invoke-with-response-stream}
//
// A Bedrock model id may arrive percent-encoded (%3A for ':', %2F inside an ARN), as the AWS
// SDKs send it. It reports false for any other path.
func routeOf(u *url.URL) (route, bool) {
	p := u.Path
	if a, ok := apiByPath[p]; ok {
		d := dialectOpenAI
		if a == apiMessages {
			d = dialectAnthropic
		}
		return route{api: a, dialect: d, label: p}, true
	}
	if rest, ok := strings.CutPrefix(p, "/openai"); ok {
		if a, ok := apiByPath[rest]; ok && a != apiMessages {
			return route{api: a, dialect: dialectAzure, label: p}, true
		}
		if rest, ok := strings.CutPrefix(rest, "/deployments/"); ok {
			deployment, endpoint, ok := strings.Cut(rest, "/")
			a, known := apiByPath["/v1/"+endpoint]
			if ok && deployment != "" && known && (a == apiChat || a == apiCompletions || a == apiEmbeddings) {
				return route{api: a, dialect: dialectAzure, model: deployment, label: "/openai/deployments/{deployment}/" + endpoint}, true
			}
		}
		return route{}, false
	}
	for _, prefix := range []string{"/v1beta/models/", "/v1/models/"} {
		if rest, ok := strings.CutPrefix(p, prefix); ok {
			return geminiRoute(rest, prefix, u.Query())
		}
	}
	if rest, ok := strings.CutPrefix(u.EscapedPath(), "/model/"); ok {
		return bedrockRoute(rest)
	}
	return route{}, false
}

// geminiRoute reads {model}:{method}.
func geminiRoute(rest, prefix string, q url.Values) (route, bool) {
	model, method, ok := strings.Cut(rest, ":")
	if !ok || model == "" || strings.Contains(model, "/") {
		return route{}, false
	}
	r := route{dialect: dialectGemini, model: model, label: prefix + "{model}:" + method}
	switch method {
	case "generateContent":
		r.api = apiGeminiGenerate
	case "streamGenerateContent":
		r.api, r.sse = apiGeminiStream, q.Get("alt") == "sse"
	case "countTokens":
		r.api = apiGeminiCountTokens
	case "embedContent":
		r.api = apiGeminiEmbed
	default:
		return route{}, false
	}
	return r, true
}

// bedrockRoute reads {modelId}/{operation} from the escaped path.
func bedrockRoute(rest string) (route, bool) {
	id, op, ok := strings.Cut(rest, "/")
	if !ok || id == "" {
		return route{}, false
	}
	model, err := url.PathUnescape(id)
	if err != nil {
		return route{}, false
	}
	r := route{dialect: dialectBedrock, model: model, label: "/model/{modelId}/" + op}
	switch op {
	case "converse":
		r.api = apiConverse
	case "converse-stream":
		r.api = apiConverseStream
	case "invoke":
		r.api = apiInvoke
	case "invoke-with-response-stream":
		r.api = apiInvokeStream
	default:
		return route{}, false
	}
	return r, true
}

// missingAPIVersion reports a call to an Azure deployment path without the api-version
// query parameter, which Azure OpenAI answers with 404.
func missingAPIVersion(rt route, r *http.Request) bool {
	return rt.dialect == dialectAzure && rt.model != "" && r.URL.Query().Get("api-version") == ""
}
