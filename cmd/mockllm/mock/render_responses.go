package mock

import (
	"encoding/json"
	"time"
)

type responsesInputDetails struct {
	CachedTokens int64 `json:"cached_tokens"`
}

type responsesOutputDetails struct {
	ReasoningTokens int64 `json:"reasoning_tokens"`
}

type responsesUsage struct {
	InputTokens         int64                  `json:"input_tokens"`
	InputTokensDetails  responsesInputDetails  `json:"input_tokens_details"`
	OutputTokens        int64                  `json:"output_tokens"`
	OutputTokensDetails responsesOutputDetails `json:"output_tokens_details"`
	TotalTokens         int64                  `json:"total_tokens"`
}

type responsesPart struct {
	Type        string     `json:"type"`
	Text        string     `json:"text"`
	Annotations []struct{} `json:"annotations"`
	Logprobs    []struct{} `json:"logprobs"`
}

type responsesItem struct {
	ID      string          `json:"id"`
	Type    string          `json:"type"`
	Status  string          `json:"status"`
	Role    string          `json:"role"`
	Content []responsesPart `json:"content"`
}

type responsesTextFormat struct {
	Format struct {
		Type string `json:"type"`
	} `json:"format"`
}

type responsesReasoning struct {
	Effort  json.RawMessage `json:"effort"`
	Summary json.RawMessage `json:"summary"`
}

type responsesObject struct {
	ID                 string              `json:"id"`
	Object             string              `json:"object"`
	CreatedAt          int64               `json:"created_at"`
	Status             string              `json:"status"`
	CompletedAt        *int64              `json:"completed_at"`
	Error              json.RawMessage     `json:"error"`
	IncompleteDetails  json.RawMessage     `json:"incomplete_details"`
	Instructions       json.RawMessage     `json:"instructions"`
	MaxOutputTokens    *int64              `json:"max_output_tokens"`
	Model              string              `json:"model"`
	Output             []responsesItem     `json:"output"`
	ParallelToolCalls  bool                `json:"parallel_tool_calls"`
	PreviousResponseID json.RawMessage     `json:"previous_response_id"`
	Reasoning          responsesReasoning  `json:"reasoning"`
	ServiceTier        string              `json:"service_tier"`
	Store              bool                `json:"store"`
	Temperature        float64             `json:"temperature"`
	Text               responsesTextFormat `json:"text"`
	ToolChoice         string              `json:"tool_choice"`
	Tools              []struct{}          `json:"tools"`
	TopP               float64             `json:"top_p"`
	Truncation         string              `json:"truncation"`
	Usage              *responsesUsage     `json:"usage"`
	User               json.RawMessage     `json:"user"`
	Metadata           map[string]string   `json:"metadata"`
}

// responsesEvent carries every field any Responses stream event uses; each
// event fills in its own and the rest are left out.
type responsesEvent struct {
	Type           string           `json:"type"`
	SequenceNumber int64            `json:"sequence_number"`
	Response       *responsesObject `json:"response,omitempty"`
	OutputIndex    *int             `json:"output_index,omitempty"`
	ContentIndex   *int             `json:"content_index,omitempty"`
	ItemID         string           `json:"item_id,omitempty"`
	Item           *responsesItem   `json:"item,omitempty"`
	Part           *responsesPart   `json:"part,omitempty"`
	Delta          *string          `json:"delta,omitempty"`
	Text           *string          `json:"text,omitempty"`
	Logprobs       *[]struct{}      `json:"logprobs,omitempty"`
}

// responsesRenderer renders /v1/responses. It numbers its stream events and
// so belongs to one request.
type responsesRenderer struct {
	r   *response
	seq int64
}

// itemID is the id of the one output message.
func (c *responsesRenderer) itemID() string { return "msg_" + c.r.objectID }

// object builds the response object in status with the given output; usage
// is reported only once completed.
func (c *responsesRenderer) object(status string, output []responsesItem) *responsesObject {
	o := &responsesObject{
		ID: "resp_" + c.r.objectID, Object: "response", CreatedAt: c.r.created, Status: status,
		Error: rawNull, IncompleteDetails: rawNull, Instructions: rawNull, Model: c.r.model,
		Output: output, ParallelToolCalls: true, PreviousResponseID: rawNull,
		Reasoning:   responsesReasoning{Effort: rawNull, Summary: rawNull},
		ServiceTier: "default", Store: true, Temperature: 1, ToolChoice: "auto", Tools: []struct{}{},
		TopP: 1, Truncation: "disabled", User: rawNull, Metadata: map[string]string{},
	}
	o.Text.Format.Type = "text"
	if c.r.parsed.MaxTokens > 0 {
		m := c.r.parsed.MaxTokens
		o.MaxOutputTokens = &m
	}
	if status == "completed" {
		done := time.Now().Unix()
		o.CompletedAt = &done
		if c.r.withUsage {
			u := c.r.reported
			o.Usage = &responsesUsage{
				InputTokens:         u.Prompt,
				InputTokensDetails:  responsesInputDetails{CachedTokens: u.Cached},
				OutputTokens:        u.Completion,
				OutputTokensDetails: responsesOutputDetails{ReasoningTokens: u.Reasoning},
				TotalTokens:         u.Total,
			}
		}
	}
	return o
}

// part is the output_text part holding text.
func (c *responsesRenderer) part(text string) *responsesPart {
	return &responsesPart{Type: "output_text", Text: text, Annotations: []struct{}{}, Logprobs: []struct{}{}}
}

// item is the output message in status with content.
func (c *responsesRenderer) item(status string, content []responsesPart) *responsesItem {
	return &responsesItem{ID: c.itemID(), Type: "message", Status: status, Role: "assistant", Content: content}
}

func (c *responsesRenderer) body() ([]byte, error) {
	return json.Marshal(c.object("completed", []responsesItem{*c.item("completed", []responsesPart{*c.part(c.r.fullText())})}))
}

// event numbers and encodes one stream event.
func (c *responsesRenderer) event(e responsesEvent) (sseEvent, error) {
	e.SequenceNumber = c.seq
	c.seq++
	b, err := json.Marshal(e)
	return sseEvent{name: e.Type, data: b}, err
}

// events encodes several stream events in order.
func (c *responsesRenderer) events(es ...responsesEvent) ([]sseEvent, error) {
	out := make([]sseEvent, 0, len(es))
	for _, e := range es {
		ev, err := c.event(e)
		if err != nil {
			return nil, err
		}
		out = append(out, ev)
	}
	return out, nil
}

func (c *responsesRenderer) preamble() ([]sseEvent, error) {
	zero := 0
	return c.events(
		responsesEvent{Type: "response.created", Response: c.object("in_progress", []responsesItem{})},
		responsesEvent{Type: "response.in_progress", Response: c.object("in_progress", []responsesItem{})},
		responsesEvent{Type: "response.output_item.added", OutputIndex: &zero, Item: c.item("in_progress", []responsesPart{})},
		responsesEvent{Type: "response.content_part.added", ItemID: c.itemID(), OutputIndex: &zero, ContentIndex: &zero, Part: c.part("")},
	)
}

func (c *responsesRenderer) delta(text string) (sseEvent, error) {
	zero := 0
	logprobs := []struct{}{}
	return c.event(responsesEvent{Type: "response.output_text.delta", ItemID: c.itemID(), OutputIndex: &zero, ContentIndex: &zero, Delta: &text, Logprobs: &logprobs})
}

func (c *responsesRenderer) trailer() ([]sseEvent, error) {
	zero := 0
	text := c.r.fullText()
	logprobs := []struct{}{}
	done := c.item("completed", []responsesPart{*c.part(text)})
	return c.events(
		responsesEvent{Type: "response.output_text.done", ItemID: c.itemID(), OutputIndex: &zero, ContentIndex: &zero, Text: &text, Logprobs: &logprobs},
		responsesEvent{Type: "response.content_part.done", ItemID: c.itemID(), OutputIndex: &zero, ContentIndex: &zero, Part: c.part(text)},
		responsesEvent{Type: "response.output_item.done", OutputIndex: &zero, Item: done},
		responsesEvent{Type: "response.completed", Response: c.object("completed", []responsesItem{*done})},
	)
}
