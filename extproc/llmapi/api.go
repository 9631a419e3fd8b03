package llmapi

// API identifies the wire protocol of an endpoint: the shape of its request and response
// bodies. It is a small value type and safe for concurrent use.
type API uint8

// The APIs this package understands. APIUnknown is the zero value. The values are stable;
// new APIs are added at the end.
const (
	APIUnknown           API = iota
	APIOpenAIChat            // /v1/chat/completions
	APIOpenAICompletions     // /v1/completions
	APIOpenAIEmbeddings      // /v1/embeddings
	APIOpenAIResponses       // /v1/responses
	APIAnthropicMessages     // /v1/messages
	// APIOpenAITranscriptions and APIOpenAITranslations take audio as multipart/form-data and
	// answer with its text (JSON, SSE or plain text).
	APIOpenAITranscriptions // /v1/audio/transcriptions
	APIOpenAITranslations   // /v1/audio/translations
	// APIOpenAISpeech answers text with audio bytes.
	APIOpenAISpeech // /v1/audio/speech
	// APIOpenAIImages answers a prompt with n images.
	APIOpenAIImages // /v1/images/generations
	// The Gemini API's model methods, the model named in the path.
	APIGeminiGenerate    // /v1beta/models/{model}:generateContent
	APIGeminiStream      // /v1beta/models/{model}:streamGenerateContent (SSE with alt=sse, else a JSON array)
	APIGeminiCountTokens // /v1beta/models/{model}:countTokens
	APIGeminiEmbed       // /v1beta/models/{model}:embedContent
	// Amazon Bedrock's runtime, the model named in the path. Invoke and InvokeStream are
	// InvokeModel and InvokeModelWithResponseStream with an Anthropic model, whose bodies are
	// Anthropic messages; ConverseStream and InvokeStream answer in AWS's binary event stream.
	APIBedrockConverse       // /model/{modelId}/converse
	APIBedrockConverseStream // /model/{modelId}/converse-stream
	APIBedrockInvoke         // /model/{modelId}/invoke
	APIBedrockInvokeStream   // /model/{modelId}/invoke-with-response-stream
	numAPIs
)

var apiNames = [numAPIs]string{
	APIUnknown:               "unknown",
	APIOpenAIChat:            "openai.chat",
	APIOpenAICompletions:     "openai.completions",
	APIOpenAIEmbeddings:      "openai.embeddings",
	APIOpenAIResponses:       "openai.responses",
	APIAnthropicMessages:     "anthropic.messages",
	APIOpenAITranscriptions:  "openai.audio.transcriptions",
	APIOpenAITranslations:    "openai.audio.translations",
	APIOpenAISpeech:          "openai.audio.speech",
	APIOpenAIImages:          "openai.images.generations",
	APIGeminiGenerate:        "gemini.generate_content",
	APIGeminiStream:          "gemini.stream_generate_content",
	APIGeminiCountTokens:     "gemini.count_tokens",
	APIGeminiEmbed:           "gemini.embed_content",
	APIBedrockConverse:       "bedrock.converse",
	APIBedrockConverseStream: "bedrock.converse_stream",
	APIBedrockInvoke:         "bedrock.invoke",
	APIBedrockInvokeStream:   "bedrock.invoke_stream",
}

// String returns the stable name of a, used in metrics labels and logs. It is
// safe for concurrent use.
func (a API) String() string {
	if a >= numAPIs {
		return "unknown"
	}
	return apiNames[a]
}

// Anthropic reports whether a's bodies are Anthropic messages: /v1/messages, and Bedrock's
// InvokeModel of an Anthropic model. It is safe for concurrent use.
func (a API) Anthropic() bool {
	return a == APIAnthropicMessages || a == APIBedrockInvoke || a == APIBedrockInvokeStream
}

// Streams reports whether a answers in a stream whatever the body says: the streaming methods
// of Gemini and Bedrock, which the path names.
func (a API) Streams() bool {
	return a == APIGeminiStream || a == APIBedrockConverseStream || a == APIBedrockInvokeStream
}

// NoOutput reports whether a generates no tokens (embeddings, token counts): nothing is
// reserved for output, and a completion count a response claims is not believed.
func (a API) NoOutput() bool {
	return a == APIOpenAIEmbeddings || a == APIGeminiEmbed || a == APIGeminiCountTokens
}

// Multipart reports whether a's request body is multipart/form-data (an audio file and its
// form fields), not JSON.
func (a API) Multipart() bool {
	return a == APIOpenAITranscriptions || a == APIOpenAITranslations
}

// MinAudioBytesPerSecond is the lowest bitrate an uploaded audio file is taken to have, 2000
// bytes (16 kbit/s) a second: speech codecs go about that low. UploadAudioMillis reads an
// upload's size at this rate, which gives the longest audio it can hold.
const MinAudioBytesPerSecond = 2000

// UploadAudioMillis is the most audio, in milliseconds, that an upload of size bytes (a
// transcription's whole multipart body) holds at MinAudioBytesPerSecond: the worst case a
// request billed by the second is reserved for. A size of 0 or less (unknown) gives 0.
func UploadAudioMillis(size int64) int64 {
	if size <= 0 {
		return 0
	}
	const limit = 1 << 40 // far beyond any upload; keeps the product from overflowing
	return (min(size, limit)*1000 + MinAudioBytesPerSecond - 1) / MinAudioBytesPerSecond
}

// IncludeUsage reports whether a streamed request of a can ask for a final usage chunk with
// stream_options.include_usage (OpenAI chat and completions, on OpenAI and on Azure).
func (a API) IncludeUsage() bool { return a == APIOpenAIChat || a == APIOpenAICompletions }
