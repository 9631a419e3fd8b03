// Package llmapi reads the parts of LLM API traffic that admission control
// needs: a few fields of a request body (model, output limit, streaming,
// user, size of the prompt) and what a response reports (its token usage, an
// error reported inside a successful response, when its first generated
// content arrived, the wait its retry-after header asks for), for
// OpenAI-compatible chat, completions, embeddings and Responses endpoints and
// for Anthropic messages.
//
// Everything here runs on the per-request hot path, so the request side scans
// the body in place without building a document tree, and the response side
// is a push parser that consumes body chunks as Envoy streams them, split at
// any byte, with memory bounded by a few kilobytes (plus the standard
// library's decoder and at most 80 KiB of compressed input when the response
// is compressed).
package llmapi
