package mock

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path"
	"unicode/utf8"
)

// ModelProvider says which provider serves the models a glob matches, for
// Options.ModelProviders.
type ModelProvider struct {
	// Match is a path.Match glob ("deepseek-*") over the request body's model,
	// as fault rules use.
	Match string `json:"match"`
	// Provider is the x-llm-provider value of the provider serving them.
	Provider string `json:"provider"`
}

// ExampleModelProviders is the model table of llm-bulkhead's example policy
// (examples/policy.yaml's models list): deepseek-* on deepseek, qwen-* on
// qwen, gemini-* on gemini, Anthropic's and Amazon's Nova models (and their
// inference profiles) on bedrock, everything else on local. The mockllm
// command's -check-model-provider flag uses it.
var ExampleModelProviders = []ModelProvider{
	{Match: "deepseek-*", Provider: "deepseek"},
	{Match: "qwen-*", Provider: "qwen"},
	{Match: "gemini-*", Provider: "gemini"},
	{Match: "*anthropic.claude-*", Provider: "bedrock"},
	{Match: "*amazon.nova-*", Provider: "bedrock"},
	{Match: "*", Provider: "local"},
}

// maxModelProviders bounds Options.ModelProviders: every request scans it.
const maxModelProviders = 1024

// validateModelProviders reports every unusable entry of a model table.
func validateModelProviders(table []ModelProvider) error {
	var errs []error
	if len(table) > maxModelProviders {
		errs = append(errs, fmt.Errorf("at most %d model providers, got %d", maxModelProviders, len(table)))
	}
	for i, m := range table {
		if m.Match == "" || m.Provider == "" {
			errs = append(errs, fmt.Errorf("model provider %d: needs both a model glob and a provider", i))
		}
		if !utf8.ValidString(m.Match) || !utf8.ValidString(m.Provider) {
			errs = append(errs, fmt.Errorf("model provider %d: glob and provider must be valid UTF-8", i))
		}
		if _, err := path.Match(m.Match, ""); err != nil {
			errs = append(errs, fmt.Errorf("model provider %d: model glob %q: %w", i, m.Match, err))
		}
	}
	return errors.Join(errs...)
}

// ownerOf returns the provider the first entry matching model names, or "".
func ownerOf(table []ModelProvider, model string) string {
	for _, m := range table {
		if ok, err := path.Match(m.Match, model); err == nil && ok {
			return m.Provider
		}
	}
	return ""
}

// wrongProvider reports whether the table forbids sending model to provider:
// the table names provider, and its first entry matching model names another
// provider or none. Requests without a provider, or for a provider the table
// does not name, are not checked.
func wrongProvider(table []ModelProvider, provider, model string) bool {
	if provider == "" || len(table) == 0 {
		return false
	}
	listed := false
	for _, m := range table {
		if m.Provider == provider {
			listed = true
			break
		}
	}
	return listed && ownerOf(table, model) != provider
}

// modelNotFoundBody renders the 404 a provider answers for a model it does
// not serve, in the called API's format: OpenAI's code model_not_found,
// Anthropic's not_found_error, Azure's DeploymentNotFound, Google's NOT_FOUND
// or AWS's ResourceNotFoundException.
func (e *exchange) modelNotFoundBody(model string) ([]byte, error) {
	switch e.rt.dialect {
	case dialectAnthropic:
		return anthropicErrorBody(http.StatusNotFound, "model: "+model, "req_"+e.id)
	case dialectAzure:
		return json.Marshal(struct {
			Error azureErrorDetail `json:"error"`
		}{azureErrorDetail{Code: "DeploymentNotFound", Message: fmt.Sprintf("The API deployment %s for this resource does not exist.", model)}})
	case dialectGemini:
		return googleErrorBody(http.StatusNotFound, fmt.Sprintf("models/%s is not found for API version v1beta, or is not supported for this method.", model))
	case dialectBedrock:
		e.w.Header().Set("x-amzn-errortype", bedrockException(http.StatusNotFound))
		return bedrockErrorBody("Model not found: " + model)
	}
	code, param := "model_not_found", "model"
	return json.Marshal(openAIError{Error: openAIErrorDetail{
		Message: fmt.Sprintf("The model `%s` does not exist or you do not have access to it.", model),
		Type:    "invalid_request_error", Param: &param, Code: &code,
	}})
}

// rejectModel answers a request for a model its provider does not serve.
func (e *exchange) rejectModel(model string) {
	body, err := e.modelNotFoundBody(model)
	if err != nil {
		e.reject(http.StatusNotFound, "model "+model+" not found")
		return
	}
	outcome := OutcomeRejected
	if err := newOutput(e.w, false, 0).json(http.StatusNotFound, body); err != nil {
		outcome = OutcomeClientGone
	}
	e.finish(http.StatusNotFound, outcome)
}
