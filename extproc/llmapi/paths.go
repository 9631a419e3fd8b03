package llmapi

import (
	"fmt"
	"strings"
)

// A response scan only cares about a handful of paths in each JSON document
// (the usage numbers, the generated text, the event type). They are compiled
// into a small tree of pathNodes so the streaming parser can tell, one key at
// a time and without building anything, whether the value it is entering
// matters.

type nodeKind uint8

const (
	nodeNone   nodeKind = iota
	nodeObject          // an object with interesting members
	nodeArray           // an array whose elements are all the node elem
	nodeNumber          // a usage count stored in a slot
	nodeText            // a string whose unescaped length is generated content
	nodeType            // the document's "type" string
	nodeErr             // an error's type or code string, classified into error bits
	nodeMillis          // a number of seconds, stored in a slot as milliseconds rounded up
)

// Usage slots. Group 0 is the top-level "usage" object; group 1 is the one
// nested in an envelope: Anthropic's message_start "message.usage" or the
// Responses API's "response.usage". Anthropic's cache_read_input_tokens shares
// the cached slot; cache_creation_input_tokens has its own. slotMillis holds
// the seconds of audio an audio transcription's usage reports, in milliseconds.
const (
	slotPrompt = iota
	slotCompletion
	slotTotal
	slotCached
	slotReasoning
	slotCacheCreation
	slotMillis
	groupSize
	numUsageSlots = 2 * groupSize
)

// Error bits of a document's has mask, above the usage slots. An error
// object (a path leaf "=%") sets its presence bit when its value is an
// object; an error code string (leaf "=!") sets one bit by the class of its
// value. Each marked object and each code leaf of a tree has its own bits, so
// that a repeated key forgets only what its earlier value set, as in a map.
const (
	maxErrMarks  = 4
	maxErrLeaves = 4

	errPresentShift = 16
	errRateShift    = 20
	errServerShift  = 24
	errClientShift  = 28

	errPresentBits uint32 = 0xF << errPresentShift
	errRateBits    uint32 = 0xF << errRateShift
	errServerBits  uint32 = 0xF << errServerShift
	errClientBits  uint32 = 0xF << errClientShift
)

// maxKids bounds the interesting members of one object, and maxTrack the
// nesting depth at which anything is still interesting; both are checked when
// the trees are built.
const (
	maxKids  = 6
	maxTrack = 8
)

type pathNode struct {
	lens  uint64 // bit n set: some key is n bytes long (n < 64), a cheap filter
	kind  nodeKind
	slot  uint8 // a number's usage slot; an error leaf's or marked object's index
	mark  bool  // an error object: its presence is recorded
	elem  uint8
	keys  []string
	kids  []uint8
	clear uint32 // slots at or below this node, forgotten when its key repeats
}

// pathTree is a compiled set of paths. Node 0 means "not interesting" and node
// 1 is the document's top-level value.
type pathTree []pathNode

// lookup returns the index among n's keys of key, or -1.
func (n *pathNode) lookup(key []byte) int {
	if len(key) >= 64 || n.lens&(1<<len(key)) == 0 {
		return -1
	}
	for k, name := range n.keys {
		if len(name) == len(key) && len(key) > 0 && name[0] == key[0] && name == string(key) {
			return k
		}
	}
	return -1
}

// compileTree builds a tree from paths written as dotted member names, "[]"
// marking an array whose elements continue the path, and a suffix naming the
// leaf: "=#N" a usage slot, "=~N" a usage slot holding seconds (a decimal
// number, kept as milliseconds), "=$" generated text, "=@" the document type,
// "=!" an error code string, "=%" an object whose presence marks an error.
func compileTree(paths ...string) (pathTree, error) {
	t := pathTree{{}, {kind: nodeObject}}
	marks, errLeaves := 0, 0
	for _, p := range paths {
		path, leaf, ok := strings.Cut(p, "=")
		if !ok {
			return nil, fmt.Errorf("llmapi: path %q has no leaf", p)
		}
		cur := uint8(1)
		segs := strings.Split(path, ".")
		for si, seg := range segs {
			name, isArray := strings.CutSuffix(seg, "[]")
			last := si == len(segs)-1
			var kind nodeKind
			switch {
			case isArray:
				kind = nodeArray
			case !last:
				kind = nodeObject
			case leaf == "$":
				kind = nodeText
			case leaf == "@":
				kind = nodeType
			case leaf == "!":
				kind = nodeErr
			case leaf == "%":
				kind = nodeObject
			case strings.HasPrefix(leaf, "~"):
				kind = nodeMillis
			default:
				kind = nodeNumber
			}
			k := t[cur].lookup([]byte(name))
			if k < 0 {
				if len(t[cur].keys) == maxKids {
					return nil, fmt.Errorf("llmapi: path %q: more than %d members under one object", p, maxKids)
				}
				if len(name) == 0 || len(name) >= 64 {
					return nil, fmt.Errorf("llmapi: path %q: member names must be 1 to 63 bytes", p)
				}
				t = append(t, pathNode{kind: kind})
				t[cur].lens |= 1 << len(name)
				t[cur].keys = append(t[cur].keys, name)
				t[cur].kids = append(t[cur].kids, uint8(len(t)-1))
				k = len(t[cur].keys) - 1
			}
			cur = t[cur].kids[k]
			if t[cur].kind != kind {
				return nil, fmt.Errorf("llmapi: path %q conflicts with an earlier one", p)
			}
			if last && kind == nodeErr {
				if errLeaves == maxErrLeaves {
					return nil, fmt.Errorf("llmapi: path %q: more than %d error codes", p, maxErrLeaves)
				}
				t[cur].slot = uint8(errLeaves)
				errLeaves++
			}
			if last && leaf == "%" && !t[cur].mark {
				if marks == maxErrMarks {
					return nil, fmt.Errorf("llmapi: path %q: more than %d error objects", p, maxErrMarks)
				}
				t[cur].mark, t[cur].slot = true, uint8(marks)
				marks++
			}
			if kind == nodeNumber || kind == nodeMillis {
				var slot int
				if _, err := fmt.Sscanf(leaf[1:], "%d", &slot); err != nil || slot < 0 || slot >= numUsageSlots {
					return nil, fmt.Errorf("llmapi: path %q: bad slot", p)
				}
				t[cur].slot = uint8(slot)
			}
			if isArray {
				elemKind := nodeObject
				if last {
					elemKind = nodeText
				}
				if t[cur].elem == 0 {
					t = append(t, pathNode{kind: elemKind})
					t[cur].elem = uint8(len(t) - 1)
				}
				cur = t[cur].elem
			}
		}
	}
	if len(t) > 255 {
		return nil, fmt.Errorf("llmapi: too many path nodes")
	}
	if _, err := t.fillClear(1, 1); err != nil {
		return nil, err
	}
	return t, nil
}

// fillClear computes each node's clear mask and checks the depth bound.
func (t pathTree) fillClear(n uint8, depth int) (uint32, error) {
	node := &t[n]
	var m uint32
	switch node.kind {
	case nodeNumber, nodeMillis:
		m = 1 << node.slot
	case nodeErr:
		m = errClassBit(errRate, node.slot) | errClassBit(errServer, node.slot) | errClassBit(errClient, node.slot)
	case nodeObject, nodeArray:
		if node.mark {
			m = 1 << (errPresentShift + node.slot)
		}
		if depth > maxTrack {
			return 0, fmt.Errorf("llmapi: path nested deeper than %d levels", maxTrack)
		}
		kids := node.kids
		if node.elem != 0 {
			kids = append(kids[:len(kids):len(kids)], node.elem)
		}
		for _, k := range kids {
			km, err := t.fillClear(k, depth+1)
			if err != nil {
				return 0, err
			}
			m |= km
		}
	}
	node.clear = m
	return m, nil
}

func usagePaths(prefix string, group int, prompt, completion, cached, reasoning string) []string {
	o := group * groupSize
	p := []string{
		fmt.Sprintf("%s.%s=#%d", prefix, prompt, o+slotPrompt),
		fmt.Sprintf("%s.%s=#%d", prefix, completion, o+slotCompletion),
		fmt.Sprintf("%s.total_tokens=#%d", prefix, o+slotTotal),
	}
	if cached != "" {
		p = append(p, fmt.Sprintf("%s.%s=#%d", prefix, cached, o+slotCached))
	}
	if reasoning != "" {
		p = append(p, fmt.Sprintf("%s.%s=#%d", prefix, reasoning, o+slotReasoning))
	}
	return p
}

func anthropicUsagePaths(prefix string, group int) []string {
	o := group * groupSize
	return []string{
		fmt.Sprintf("%s.input_tokens=#%d", prefix, o+slotPrompt),
		fmt.Sprintf("%s.output_tokens=#%d", prefix, o+slotCompletion),
		fmt.Sprintf("%s.cache_read_input_tokens=#%d", prefix, o+slotCached),
		fmt.Sprintf("%s.cache_creation_input_tokens=#%d", prefix, o+slotCacheCreation),
	}
}

func joinPaths(groups ...[]string) []string {
	var out []string
	for _, g := range groups {
		out = append(out, g...)
	}
	return out
}

// The trees per API and framing. Generated text counts the unescaped bytes
// of what the model wrote: message text, refusals, reasoning text and tool
// call arguments; base64 payloads (audio, images) are not text and are left
// out.
var chatMessage = []string{"content=$", "refusal=$", "reasoning_content=$", "tool_calls[].function.arguments=$"}

// errorPaths find an error object at the top of a document, as OpenAI
// (and OpenAI-compatible servers) send inside a 200 stream or body.
var errorPaths = []string{"error=%", "error.type=!", "error.code=!"}

// Tree indexes.
const (
	treeOpenAIChat = iota
	treeOpenAIEmbeddings
	treeResponsesJSON
	treeResponsesSSE
	treeAnthropicJSON
	treeAnthropicSSE
	treeGemini
	treeBedrock
	treeAudioJSON
	treeAudioSSE
	numTrees
)

var treeSpecs = [numTrees][]string{
	treeOpenAIChat: joinPaths(
		usagePaths("usage", 0, "prompt_tokens", "completion_tokens",
			"prompt_tokens_details.cached_tokens", "completion_tokens_details.reasoning_tokens"),
		[]string{"choices[].text=$"},
		prefixed("choices[].message.", chatMessage),
		prefixed("choices[].delta.", chatMessage),
		errorPaths,
	),
	treeOpenAIEmbeddings: joinPaths(usagePaths("usage", 0, "prompt_tokens", "completion_tokens", "", ""), errorPaths),
	treeResponsesJSON: joinPaths(
		usagePaths("usage", 0, "input_tokens", "output_tokens",
			"input_tokens_details.cached_tokens", "output_tokens_details.reasoning_tokens"),
		[]string{"output[].content[].text=$", "output[].content[].refusal=$", "output[].arguments=$"},
		errorPaths,
	),
	treeResponsesSSE: joinPaths(
		[]string{"type=@", "delta=$"},
		usagePaths("response.usage", 1, "input_tokens", "output_tokens",
			"input_tokens_details.cached_tokens", "output_tokens_details.reasoning_tokens"),
		// The error event carries its code at the top; response.failed in its response.
		[]string{"code=!", "response.error=%", "response.error.code=!"},
		errorPaths,
	),
	treeAnthropicJSON: joinPaths(
		anthropicUsagePaths("usage", 0),
		[]string{"content[].text=$", "content[].thinking=$"},
		errorPaths[:2],
	),
	treeAnthropicSSE: joinPaths(
		[]string{"type=@", "delta.text=$", "delta.thinking=$", "delta.partial_json=$"},
		anthropicUsagePaths("message.usage", 1),
		anthropicUsagePaths("usage", 0),
		errorPaths[:2],
	),
	// Gemini's GenerateContentResponse, whole or as each chunk of a stream (SSE or a JSON
	// array): usageMetadata is in every chunk, the last one final. thoughtsTokenCount is
	// output that candidatesTokenCount leaves out (Usage adds it); an error object's status
	// (RESOURCE_EXHAUSTED, UNAVAILABLE, ...) classifies it.
	treeGemini: {
		"usageMetadata.promptTokenCount=#0", "usageMetadata.candidatesTokenCount=#1", "usageMetadata.totalTokenCount=#2",
		"usageMetadata.cachedContentTokenCount=#3", "usageMetadata.thoughtsTokenCount=#4",
		"candidates[].content.parts[].text=$",
		"error=%", "error.status=!",
	},
	// Bedrock Converse's response, and the events of ConverseStream (usage in its metadata
	// event, text in contentBlockDelta): input, cache reads and cache writes are all input.
	treeBedrock: {
		"usage.inputTokens=#0", "usage.outputTokens=#1", "usage.totalTokens=#2",
		"usage.cacheReadInputTokens=#3", "usage.cacheWriteInputTokens=#5",
		"output.message.content[].text=$", "output.message.content[].reasoningContent.reasoningText.text=$",
		"delta.text=$", "delta.reasoningContent.text=$", "delta.toolUse.input=$",
	},
	// An audio transcription or translation (json and verbose_json formats): its text and the
	// usage newer models report, in tokens ({"type":"tokens","input_tokens",...}) or in
	// seconds of audio ({"type":"duration","seconds":9.2}).
	treeAudioJSON: joinPaths(audioUsagePaths, []string{"text=$"}, errorPaths),
	// A streamed transcription: transcript.text.delta events carry the text,
	// transcript.text.done the whole text again (not counted) and the usage.
	treeAudioSSE: joinPaths([]string{"type=@", "delta=$"}, audioUsagePaths, errorPaths),
}

var audioUsagePaths = []string{
	fmt.Sprintf("usage.input_tokens=#%d", slotPrompt), fmt.Sprintf("usage.output_tokens=#%d", slotCompletion),
	fmt.Sprintf("usage.total_tokens=#%d", slotTotal), fmt.Sprintf("usage.seconds=~%d", slotMillis),
}

// trees are compiled once. The specs are fixed, so treesErr can only be set
// by a broken edit of this file, which every test run reports; a scanner
// built on a failed tree reports the error through Err instead of crashing
// the process.
var trees, treesErr = compileTrees()

func compileTrees() ([numTrees]pathTree, error) {
	var out [numTrees]pathTree
	for i, spec := range treeSpecs {
		t, err := compileTree(spec...)
		if err != nil {
			return out, err
		}
		out[i] = t
	}
	return out, nil
}

// emptyTree matches nothing; it stands in for a tree that failed to compile.
var emptyTree = pathTree{{}, {}}

func prefixed(prefix string, paths []string) []string {
	out := make([]string, len(paths))
	for i, p := range paths {
		out[i] = prefix + p
	}
	return out
}

// treeFor returns the paths a response of api in the given framing carries.
// Unknown APIs are read as OpenAI chat, the format most gateways speak.
func treeFor(api API, sse bool) pathTree {
	i := treeOpenAIChat
	switch api {
	case APIOpenAIEmbeddings:
		i = treeOpenAIEmbeddings
	case APIOpenAIResponses:
		i = treeResponsesJSON
		if sse {
			i = treeResponsesSSE
		}
	case APIAnthropicMessages, APIBedrockInvoke, APIBedrockInvokeStream:
		i = treeAnthropicJSON
		if sse {
			i = treeAnthropicSSE
		}
	case APIGeminiGenerate, APIGeminiStream, APIGeminiCountTokens, APIGeminiEmbed:
		i = treeGemini
	case APIBedrockConverse, APIBedrockConverseStream:
		i = treeBedrock
	case APIOpenAITranscriptions, APIOpenAITranslations:
		i = treeAudioJSON
		if sse {
			i = treeAudioSSE
		}
	}
	if trees[i] == nil {
		return emptyTree
	}
	return trees[i]
}
