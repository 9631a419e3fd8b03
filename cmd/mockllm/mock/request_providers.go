package mock

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// geminiPartIn is a part of a Gemini content; only text counts.
type geminiPartIn struct {
	Text *string `json:"text"`
}

// geminiContentIn is a Gemini content: a role and its parts.
type geminiContentIn struct {
	Role  string         `json:"role"`
	Parts []geminiPartIn `json:"parts"`
}

// geminiConfigIn is the part of generationConfig the fake provider obeys.
type geminiConfigIn struct {
	MaxOutputTokens *int64 `json:"maxOutputTokens"`
	// The Gemini API takes the proto's field names too.
	MaxOutputTokensSnake *int64 `json:"max_output_tokens"`
	CandidateCount       *int   `json:"candidateCount"`
	CandidateCountSnake  *int   `json:"candidate_count"`
}

// geminiRequestIn is the union of the bodies of Gemini's model methods, in the JSON names
// the SDKs send (camelCase) and the proto's (snake_case), which the API also takes.
type geminiRequestIn struct {
	Contents               []geminiContentIn `json:"contents"`
	SystemInstruction      *geminiContentIn  `json:"systemInstruction"`
	SystemInstructionSnake *geminiContentIn  `json:"system_instruction"`
	GenerationConfig       *geminiConfigIn   `json:"generationConfig"`
	GenerationConfigSnake  *geminiConfigIn   `json:"generation_config"`
	// countTokens may wrap a whole generateContent request.
	GenerateContentRequest      *geminiRequestIn `json:"generateContentRequest"`
	GenerateContentRequestSnake *geminiRequestIn `json:"generate_content_request"`
	// embedContent's single content and the length of its vector.
	Content                   *geminiContentIn `json:"content"`
	OutputDimensionality      *int             `json:"outputDimensionality"`
	OutputDimensionalitySnake *int             `json:"output_dimensionality"`
}

// first returns the first of its arguments that is not nil.
func first[T any](vs ...*T) *T {
	for _, v := range vs {
		if v != nil {
			return v
		}
	}
	return nil
}

// countGeminiContent adds the text parts of c.
func countGeminiContent(c *textCount, content *geminiContentIn) {
	if content == nil {
		return
	}
	for _, part := range content.Parts {
		if part.Text != nil {
			c.bytes += int64(len(*part.Text))
		}
	}
}

// parseGemini reads the body of a Gemini model method; the model is the path's.
func parseGemini(rt route, body []byte) (parsedRequest, error) {
	p := parsedRequest{Model: rt.model, Stream: rt.api.pathStreams()}
	var w geminiRequestIn
	if err := json.Unmarshal(body, &w); err != nil {
		return p, fmt.Errorf("invalid JSON payload received: %w", err)
	}
	var c textCount
	switch rt.api {
	case apiGeminiEmbed:
		if w.Content == nil || len(w.Content.Parts) == 0 {
			return p, errors.New("* EmbedContentRequest.content: contents is not specified")
		}
		countGeminiContent(&c, w.Content)
		var text strings.Builder
		for _, part := range w.Content.Parts {
			if part.Text != nil {
				text.WriteString(*part.Text)
			}
		}
		p.Inputs = []string{text.String()}
		if d := first(w.OutputDimensionality, w.OutputDimensionalitySnake); d != nil {
			if *d < 1 || *d > maxEmbeddingDimensions {
				return p, fmt.Errorf("outputDimensionality %d must lie in [1, %d]", *d, maxEmbeddingDimensions)
			}
			p.Dimensions = *d
		}
	default:
		if rt.api == apiGeminiCountTokens {
			if inner := first(w.GenerateContentRequest, w.GenerateContentRequestSnake); inner != nil {
				w = *inner
			}
		}
		if len(w.Contents) == 0 {
			return p, errors.New("* GenerateContentRequest.contents: contents is not specified")
		}
		for i := range w.Contents {
			countGeminiContent(&c, &w.Contents[i])
		}
		countGeminiContent(&c, first(w.SystemInstruction, w.SystemInstructionSnake))
		if cfg := first(w.GenerationConfig, w.GenerationConfigSnake); cfg != nil {
			if m := first(cfg.MaxOutputTokens, cfg.MaxOutputTokensSnake); m != nil {
				if *m < 1 || *m > maxCompletionTokens {
					return p, fmt.Errorf("maxOutputTokens %d must lie in [1, %d]", *m, maxCompletionTokens)
				}
				p.MaxTokens = *m
			}
			if n := first(cfg.CandidateCount, cfg.CandidateCountSnake); n != nil && *n < 1 {
				return p, fmt.Errorf("candidateCount %d must be at least 1", *n)
			}
		}
	}
	p.PromptTokens = c.tokens()
	return p, nil
}

// converseBlockIn is a Converse content block; only text counts.
type converseBlockIn struct {
	Text *string `json:"text"`
}

// converseRequestIn is the part of a Converse body the fake provider reads.
type converseRequestIn struct {
	Messages []struct {
		Role    string            `json:"role"`
		Content []converseBlockIn `json:"content"`
	} `json:"messages"`
	System          []converseBlockIn `json:"system"`
	InferenceConfig *struct {
		MaxTokens *int64 `json:"maxTokens"`
	} `json:"inferenceConfig"`
}

// parseConverse reads the body of a Bedrock Converse call; the model is the path's.
func parseConverse(rt route, body []byte) (parsedRequest, error) {
	p := parsedRequest{Model: rt.model, Stream: rt.api.pathStreams()}
	var w converseRequestIn
	if err := json.Unmarshal(body, &w); err != nil {
		return p, fmt.Errorf("request body is not valid JSON for Converse: %w", err)
	}
	if len(w.Messages) == 0 {
		return p, errors.New("the messages field is required and must not be empty")
	}
	var c textCount
	add := func(blocks []converseBlockIn) {
		for _, b := range blocks {
			if b.Text != nil {
				c.bytes += int64(len(*b.Text))
			}
		}
	}
	for _, m := range w.Messages {
		add(m.Content)
	}
	add(w.System)
	if w.InferenceConfig != nil && w.InferenceConfig.MaxTokens != nil {
		if m := *w.InferenceConfig.MaxTokens; m < 1 || m > maxCompletionTokens {
			return p, fmt.Errorf("inferenceConfig.maxTokens %d must lie in [1, %d]", m, maxCompletionTokens)
		}
		p.MaxTokens = *w.InferenceConfig.MaxTokens
	}
	p.PromptTokens = c.tokens()
	return p, nil
}
