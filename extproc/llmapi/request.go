package llmapi

// The request scanner reads a body in one pass with per-API field tables; its helpers share the
// scan state and are kept together with it, on the hot path.

import (
	"errors"
	"fmt"
)

// Errors returned by ScanRequest, checked with errors.Is. They are sentinel
// values and safe for concurrent use.
var (
	// ErrInvalidJSON means the body is not a JSON object: invalid, truncated,
	// empty, or a top-level value of another kind.
	ErrInvalidJSON = errors.New("llmapi: request body is not a JSON object")
	// ErrFieldType means a field admission reads has the wrong JSON type, such
	// as "max_tokens": "9".
	ErrFieldType = errors.New("llmapi: request field has the wrong type")
	// ErrFieldValue means a field has the right type but an impossible value,
	// such as a negative max_tokens.
	ErrFieldValue = errors.New("llmapi: request field has an invalid value")
)

// RequestFields are the fields admission needs from a request body. The zero
// value is ready to be filled by ScanRequest. A RequestFields is plain data:
// safe for concurrent reads, not for concurrent writes.
//
// Model and User are copies, never views of the body, so they stay valid and
// unchanged after the body is released or reused. Short values come from a
// small process-wide intern table, which makes the common case (a handful of
// model names, recurring users) free of allocations.
type RequestFields struct {
	Model string
	// MaxTokens is the output limit: the largest of max_tokens,
	// max_completion_tokens and max_output_tokens that are present, so that a
	// request naming two of them is budgeted for the larger; 0 when absent.
	MaxTokens    int64
	HasMaxTokens bool
	// N is the number of choices requested; 1 when absent.
	N int64
	// BestOf is the completions API's best_of, the candidates generated per prompt of which n
	// are returned (all of them are billed); 1 when absent.
	BestOf int64
	// Prompts is the number of prompts in a batched completions request: the elements of a
	// prompt array of strings or of token-id arrays; 1 for a single prompt (a string or one
	// array of token ids) or none.
	Prompts int64
	// Choices is the number of answers the API generates and bills for this request: prompts ×
	// max(n, best_of) for completions (and for a body of an unknown API), n for chat, 1 for the
	// APIs that have no such field. Each is bounded by the output limit on its own.
	Choices int64
	Stream  bool
	// HasStreamOptions reports a stream_options object.
	HasStreamOptions bool
	// IncludeUsage is stream_options.include_usage == true.
	IncludeUsage bool
	// User is OpenAI's "user", or Anthropic's metadata.user_id.
	User string
	// PromptBytes is the unescaped size in bytes of the text the model will
	// read: messages[].content (a string, or the text of its parts, including
	// text nested in tool results), tool call arguments, refusal and thinking
	// text of earlier turns, system (string or blocks), prompt (string or array
	// of strings), input (string, array of strings, or items with text content)
	// and instructions; for Gemini, the parts of contents, systemInstruction
	// and content; for Bedrock Converse, the text blocks of messages (tool
	// results included) and system. Base64 media, URLs and token-id arrays are
	// not text and are not counted.
	PromptBytes int64
	// Images counts image parts (image_url, input_image, Anthropic image,
	// Gemini inlineData of an image/* type, Bedrock image blocks).
	Images int
	// Audio counts audio parts (input_audio, audio, Gemini inlineData of an
	// audio/* type, Bedrock audio blocks).
	Audio int
	// Files counts file and document parts (file, input_file, document,
	// Gemini fileData and other inlineData, Bedrock document and video blocks).
	Files int

	// at is where the scan found what InjectIncludeUsageAt changes.
	at injectPoints
}

// injectPoints are positions in a request body, found by ScanRequest for InjectIncludeUsageAt.
type injectPoints struct {
	// whole: the body, of size bytes, is one valid JSON object, read to its end.
	whole bool
	size  int
	// close is the index of the object's closing brace.
	close int
	// stream and opts are 1 + the index of the last "stream" and "stream_options" values (0:
	// none); optsEnd is the end of that stream_options value.
	stream, opts, optsEnd int
}

// content accumulates what the text-bearing parts of a request hold.
type content struct {
	bytes                int64
	images, audio, files int
}

func (c *content) add(o content) {
	c.bytes += o.bytes
	c.images += o.images
	c.audio += o.audio
	c.files += o.files
}

// rawString remembers where a string value sits in the body so that it is
// decoded and copied once, after duplicates have been resolved.
type rawString struct {
	raw []byte
	esc bool
	set bool
}

func (r rawString) String() string {
	if !r.set {
		return ""
	}
	return internRaw(r.raw, r.esc)
}

// maxContentLevel bounds how far the content walker descends (message, part,
// tool result, nested part, ...). Anything deeper is validated and skipped
// without recursion, so hostile nesting costs neither stack nor time.
const maxContentLevel = 6

// fieldID names the fields ScanRequest checks, in the order their problems
// are reported.
type fieldID uint8

const (
	fModel fieldID = iota
	fMaxTokens
	fMaxCompletionTokens
	fMaxOutputTokens
	fN
	fBestOf
	fStream
	fStreamOptions
	fIncludeUsage
	fUser
	fMetadataUserID
	fMessages
	fSystem
	fPrompt
	fInput
	fInstructions
	fContents
	fSystemInstruction
	fContent
	fGenerationConfig
	fGeminiMaxOutput
	fCandidateCount
	fInferenceConfig
	fInferenceMaxTokens
	numFields
)

var fieldInfo = [numFields]struct{ name, want string }{
	fModel:               {"model", "a string"},
	fMaxTokens:           {"max_tokens", "a non-negative integer"},
	fMaxCompletionTokens: {"max_completion_tokens", "a non-negative integer"},
	fMaxOutputTokens:     {"max_output_tokens", "a non-negative integer"},
	fN:                   {"n", "a positive integer"},
	fBestOf:              {"best_of", "a positive integer"},
	fStream:              {"stream", "a boolean"},
	fStreamOptions:       {"stream_options", "an object"},
	fIncludeUsage:        {"stream_options.include_usage", "a boolean"},
	fUser:                {"user", "a string"},
	fMetadataUserID:      {"metadata.user_id", "a string"},
	fMessages:            {"messages", "an array"},
	fSystem:              {"system", "a string or an array"},
	fPrompt:              {"prompt", "a string or an array"},
	fInput:               {"input", "a string or an array"},
	fInstructions:        {"instructions", "a string or an array"},
	fContents:            {"contents", "an array"},
	fSystemInstruction:   {"systemInstruction", "an object"},
	fContent:             {"content", "an object"},
	fGenerationConfig:    {"generationConfig", "an object"},
	fGeminiMaxOutput:     {"generationConfig.maxOutputTokens", "a non-negative integer"},
	fCandidateCount:      {"generationConfig.candidateCount", "a positive integer"},
	fInferenceConfig:     {"inferenceConfig", "an object"},
	fInferenceMaxTokens:  {"inferenceConfig.maxTokens", "a non-negative integer"},
}

// Problems a field can have.
const (
	problemNone uint8 = iota
	problemType
	problemValue
)

// requestScan is the state of one ScanRequest call.
type requestScan struct {
	b    []byte
	skip skipper
	// items counts the elements of the prompt array being measured, when counting; numbers
	// says its first element is a number (one prompt of token ids).
	counting, numbers bool
	items             int64
	// problems holds, per field, what is wrong with its last occurrence: a
	// repeated key replaces the earlier value, and so its problem.
	problems [numFields]uint8
}

func (s *requestScan) problem(id fieldID, p uint8) { s.problems[id] = p }

// err reports the problem of the first field, in fieldID order, that has one.
func (s *requestScan) err() error {
	for id, p := range s.problems {
		switch p {
		case problemType:
			return fmt.Errorf("%w: %s must be %s", ErrFieldType, fieldInfo[id].name, fieldInfo[id].want)
		case problemValue:
			return fmt.Errorf("%w: %s must be %s", ErrFieldValue, fieldInfo[id].name, fieldInfo[id].want)
		}
	}
	return nil
}

// ScanRequest fills f from a complete request body of the given API.
//
// It returns an error wrapping ErrInvalidJSON when the body is not a JSON
// object (exactly when encoding/json would reject it, or it is not an object),
// in which case f holds whatever was read before the problem. It returns an
// error wrapping ErrFieldType or ErrFieldValue for the first field of the
// wrong type or value; the other fields are still filled. null counts as
// absent. Duplicate keys resolve as in encoding/json: the last one wins.
//
// The body is scanned once, in place, without recursion proportional to its
// nesting, and without allocating except for the copies of Model and User
// when they are not in the intern table yet. ScanRequest is safe for
// concurrent use; f must not be shared with another writer.
func ScanRequest(api API, body []byte, f *RequestFields) error {
	*f = RequestFields{N: 1, BestOf: 1, Prompts: 1, Choices: 1}
	s := requestScan{b: body}
	i := skipWS(body, 0)
	if i >= len(body) || body[i] != '{' {
		return ErrInvalidJSON
	}
	var (
		model, user, metaUser                rawString
		maxTokens, maxCompletion, maxOutput  int64
		hasMax, hasMaxCompletion, hasMaxOut  bool
		messages, system, prompt, input, ins content
		contents, sysIns, embed              content
		keyBuf                               keyBuf
		gemini                               = api.gemini()
		converse                             = api == APIBedrockConverse || api == APIBedrockConverseStream
		// generationConfig's maxOutputTokens and candidateCount (Gemini), inferenceConfig's
		// maxTokens (Bedrock Converse).
		gMax, gCount, iMax     int64
		hasGMax, hasG, hasIMax bool
	)
	it := openObject(body, i)
	ok := true
	for {
		key, esc, v, more := it.next()
		if !more {
			break
		}
		k, _ := decodeKey(&keyBuf, key, esc)
		switch string(k) {
		case "model":
			v, ok = s.stringField(v, &model, fModel)
		case "max_tokens":
			v, ok = s.intField(v, &maxTokens, &hasMax, fMaxTokens, 0)
		case "max_completion_tokens":
			v, ok = s.intField(v, &maxCompletion, &hasMaxCompletion, fMaxCompletionTokens, 0)
		case "max_output_tokens":
			v, ok = s.intField(v, &maxOutput, &hasMaxOut, fMaxOutputTokens, 0)
		case "n":
			var has bool
			v, ok = s.intField(v, &f.N, &has, fN, 1)
			if !has {
				f.N = 1
			}
		case "best_of":
			var has bool
			v, ok = s.intField(v, &f.BestOf, &has, fBestOf, 1)
			if !has {
				f.BestOf = 1
			}
		case "stream":
			f.at.stream = v + 1
			v, ok = s.boolField(v, &f.Stream, fStream)
		case "stream_options":
			f.at.opts = v + 1
			v, ok = s.streamOptions(v, f)
			f.at.optsEnd = v
		case "user":
			v, ok = s.stringField(v, &user, fUser)
		case "metadata":
			v, ok = s.metadata(v, &metaUser)
		case "messages":
			v, ok = s.textSource(v, &messages, fMessages, false)
		case "system":
			v, ok = s.textSource(v, &system, fSystem, true)
		case "prompt":
			s.counting, s.numbers, s.items = true, false, 0
			v, ok = s.textSource(v, &prompt, fPrompt, true)
			s.counting = false
			f.Prompts = 1
			if s.items > 1 && !s.numbers {
				f.Prompts = s.items
			}
		case "input":
			v, ok = s.textSource(v, &input, fInput, true)
		case "instructions":
			v, ok = s.textSource(v, &ins, fInstructions, true)
		case "contents":
			if !gemini {
				v, ok = s.skip.skip(body, v, 1)
				break
			}
			v, ok = s.textSource(v, &contents, fContents, false)
		case "systemInstruction", "system_instruction":
			if !gemini {
				v, ok = s.skip.skip(body, v, 1)
				break
			}
			v, ok = s.objectText(v, &sysIns, fSystemInstruction)
		case "content":
			if !gemini {
				v, ok = s.skip.skip(body, v, 1)
				break
			}
			v, ok = s.objectText(v, &embed, fContent)
		case "generationConfig", "generation_config":
			if !gemini {
				v, ok = s.skip.skip(body, v, 1)
				break
			}
			v, ok = s.intMembers(v, fGenerationConfig, generationConfigNames[:], []intMember{
				{fGeminiMaxOutput, 0, &gMax, &hasGMax}, {fCandidateCount, 1, &gCount, &hasG}})
		case "inferenceConfig":
			if !converse {
				v, ok = s.skip.skip(body, v, 1)
				break
			}
			v, ok = s.intMembers(v, fInferenceConfig, inferenceConfigNames[:], []intMember{{fInferenceMaxTokens, 0, &iMax, &hasIMax}})
		default:
			v, ok = s.skip.skip(body, v, 1)
		}
		if !ok {
			break
		}
		it.i = v
	}
	f.Model = model.String()
	switch {
	case api.Anthropic():
		f.User = metaUser.String()
	case api != APIUnknown:
		f.User = user.String()
	case user.set:
		f.User = user.String()
	default:
		f.User = metaUser.String()
	}
	f.HasMaxTokens = hasMax || hasMaxCompletion || hasMaxOut
	f.MaxTokens = max(maxTokens, maxCompletion, maxOutput)
	switch {
	case gemini:
		// Gemini's output limit and choices are in generationConfig only.
		f.MaxTokens, f.HasMaxTokens, f.N = gMax, hasGMax, 1
		if hasG {
			f.N = gCount
		}
	case converse:
		f.MaxTokens, f.HasMaxTokens = iMax, hasIMax
	}
	if api.Streams() {
		f.Stream = true
	}
	f.Choices = choices(api, f.N, f.BestOf, f.Prompts)
	var c content
	c.add(messages)
	c.add(system)
	c.add(prompt)
	c.add(input)
	c.add(ins)
	c.add(contents)
	c.add(sysIns)
	c.add(embed)
	f.PromptBytes, f.Images, f.Audio, f.Files = c.bytes, c.images, c.audio, c.files
	if !ok || it.bad || skipWS(body, it.i) != len(body) {
		return ErrInvalidJSON
	}
	f.at.whole, f.at.size, f.at.close = true, len(body), it.i-1
	return s.err()
}

// maxChoices bounds each factor of a request's choice count, so that their product cannot
// overflow; no API accepts anywhere near as many.
const maxChoices = 1 << 20

// choices is the number of answers a request of api with n, best_of and prompts generates.
func choices(api API, n, bestOf, prompts int64) int64 {
	n, bestOf, prompts = min(max(n, 1), maxChoices), min(max(bestOf, 1), maxChoices), min(max(prompts, 1), maxChoices)
	switch api {
	case APIOpenAICompletions, APIUnknown:
		return prompts * max(n, bestOf)
	case APIOpenAIChat, APIOpenAIImages, APIGeminiGenerate, APIGeminiStream:
		return n
	}
	return 1
}

// gemini reports whether a's bodies are Gemini's GenerateContentRequest (or its embedding and
// token-count relatives).
func (a API) gemini() bool { return a >= APIGeminiGenerate && a <= APIGeminiEmbed }

// objectText measures an object that holds text (Gemini's systemInstruction or content: a
// Content with parts) into dst, replacing an earlier duplicate's.
func (s *requestScan) objectText(i int, dst *content, id fieldID) (int, bool) {
	*dst = content{}
	s.problem(id, problemNone)
	switch s.b[i] {
	case '{':
		return s.texts(i, 1, 1, dst)
	case 'n':
		return scanLiteral(s.b, i)
	}
	s.problem(id, problemType)
	return s.skip.skip(s.b, i, 1)
}

// intMember is an integer member of a nested object that ScanRequest reads: its field,
// smallest valid value and where it goes.
type intMember struct {
	id      fieldID
	minimum int64
	dst     *int64
	has     *bool
}

// intMembers reads the integer members of the object at i (null: none), members[k] from the
// member named names[2k] or names[2k+1] (its alias; "" for none), whichever comes last. Other
// members are skipped; a value of another type than an object is a problem of field id.
func (s *requestScan) intMembers(i int, id fieldID, names []string, members []intMember) (int, bool) {
	b := s.b
	s.problem(id, problemNone)
	for _, m := range members {
		s.problem(m.id, problemNone)
		*m.dst, *m.has = 0, false
	}
	switch b[i] {
	case '{':
	case 'n':
		return scanLiteral(b, i)
	default:
		s.problem(id, problemType)
		return s.skip.skip(b, i, 1)
	}
	var at [4]int
	end, ok := s.lastMembers(i, names, at[:len(names)])
	for k, m := range members {
		if v := max(at[2*k], at[min(2*k+1, len(names)-1)]); ok && v >= 0 {
			_, ok = s.intField(v, m.dst, m.has, m.id, m.minimum)
		}
	}
	return end, ok
}

// lastMembers walks the object at i (a member of the body's top-level object) and sets at[k]
// to the index of the value of its last member named names[k], -1 when there is none. It
// returns where the object ends and whether it is valid JSON.
func (s *requestScan) lastMembers(i int, names []string, at []int) (int, bool) {
	b := s.b
	for k := range at {
		at[k] = -1
	}
	var kb keyBuf
	it := openObject(b, i)
	for {
		key, esc, v, more := it.next()
		if !more {
			return it.i, !it.bad
		}
		k, _ := decodeKey(&kb, key, esc)
		for n, name := range names {
			if string(k) == name {
				at[n] = v
			}
		}
		end, ok := s.skip.skip(b, v, 2)
		if !ok {
			return end, false
		}
		it.i = end
	}
}

// stringField reads a string value into dst (null clears it).
func (s *requestScan) stringField(i int, dst *rawString, id fieldID) (int, bool) {
	b := s.b
	s.problem(id, problemNone)
	switch b[i] {
	case '"':
		end, _, esc, ok := scanString(b, i+1)
		if !ok {
			return end, false
		}
		*dst = rawString{raw: b[i+1 : end-1], esc: esc, set: true}
		return end, true
	case 'n':
		*dst = rawString{}
		return scanLiteral(b, i)
	}
	*dst = rawString{}
	s.problem(id, problemType)
	return s.skip.skip(b, i, 1)
}

// intField reads a non-negative integer no smaller than minimum (null clears
// it).
func (s *requestScan) intField(i int, dst *int64, has *bool, id fieldID, minimum int64) (int, bool) {
	b := s.b
	s.problem(id, problemNone)
	*has = false
	*dst = 0
	switch c := b[i]; {
	case c == '-' || (c >= '0' && c <= '9'):
		n, ok := scanNumber(b, i)
		if !ok {
			return i, false
		}
		switch {
		case !n.integer:
			s.problem(id, problemType)
		case n.negative && n.val != 0, n.overflow, int64(n.val) < minimum:
			s.problem(id, problemValue)
		default:
			*dst, *has = int64(n.val), true
		}
		return n.end, true
	case c == 'n':
		return scanLiteral(b, i)
	}
	s.problem(id, problemType)
	return s.skip.skip(b, i, 1)
}

// boolField reads true or false (null clears it).
func (s *requestScan) boolField(i int, dst *bool, id fieldID) (int, bool) {
	b := s.b
	s.problem(id, problemNone)
	*dst = false
	switch b[i] {
	case 't':
		*dst = true
		return scanLiteral(b, i)
	case 'f', 'n':
		return scanLiteral(b, i)
	}
	s.problem(id, problemType)
	return s.skip.skip(b, i, 1)
}

func (s *requestScan) streamOptions(i int, f *RequestFields) (int, bool) {
	b := s.b
	f.HasStreamOptions, f.IncludeUsage = false, false
	s.problem(fStreamOptions, problemNone)
	s.problem(fIncludeUsage, problemNone)
	switch b[i] {
	case '{':
	case 'n':
		return scanLiteral(b, i)
	default:
		s.problem(fStreamOptions, problemType)
		return s.skip.skip(b, i, 1)
	}
	f.HasStreamOptions = true
	var at [1]int
	end, ok := s.lastMembers(i, streamOptionsNames[:], at[:])
	if ok && at[0] >= 0 {
		_, ok = s.boolField(at[0], &f.IncludeUsage, fIncludeUsage)
	}
	return end, ok
}

var (
	streamOptionsNames    = [...]string{"include_usage"}
	metadataNames         = [...]string{"user_id"}
	generationConfigNames = [...]string{"maxOutputTokens", "max_output_tokens", "candidateCount", "candidate_count"}
	inferenceConfigNames  = [...]string{"maxTokens"}
)

// metadata reads Anthropic's metadata.user_id. Other shapes of metadata
// (OpenAI uses it for arbitrary tags) are not an error.
func (s *requestScan) metadata(i int, user *rawString) (int, bool) {
	b := s.b
	*user = rawString{}
	s.problem(fMetadataUserID, problemNone)
	if b[i] != '{' {
		return s.skip.skip(b, i, 1)
	}
	var at [1]int
	end, ok := s.lastMembers(i, metadataNames[:], at[:])
	if ok && at[0] >= 0 {
		_, ok = s.stringField(at[0], user, fMetadataUserID)
	}
	return end, ok
}

// textSource measures a top-level source of prompt text into dst, replacing
// what an earlier duplicate of the same key contributed. Every source may be
// an array; strings are allowed where the API allows them.
func (s *requestScan) textSource(i int, dst *content, id fieldID, strings bool) (int, bool) {
	*dst = content{}
	s.problem(id, problemNone)
	switch c := s.b[i]; {
	case c == '[' || (c == '"' && strings):
		return s.texts(i, 1, 1, dst)
	case c == 'n':
		return scanLiteral(s.b, i)
	}
	s.problem(id, problemType)
	return s.skip.skip(s.b, i, 1)
}

// texts measures a value that holds text: a string, an object (a message,
// part, block or item) or an array of those. Other values (numbers of
// token-id prompts, nulls) are validated and ignored. depth counts the
// containers around the value, level the content levels walked so far.
func (s *requestScan) texts(i, depth, level int, dst *content) (int, bool) {
	b := s.b
	switch b[i] {
	case '"':
		end, n, _, ok := scanString(b, i+1)
		dst.bytes += n
		return end, ok
	case '{':
		if level > maxContentLevel {
			break
		}
		return s.part(i, depth, level, dst)
	case '[':
		if level > maxContentLevel {
			break
		}
		if depth+1 > maxDepth {
			return i, false
		}
		i = skipWS(b, i+1)
		if i < len(b) && b[i] == ']' {
			return i + 1, true
		}
		for {
			var ok bool
			if i >= len(b) {
				return i, false
			}
			if s.counting && depth == 1 {
				if s.items == 0 {
					s.numbers = b[i] == '-' || (b[i] >= '0' && b[i] <= '9')
				}
				s.items++
			}
			if i, ok = s.texts(i, depth+1, level, dst); !ok {
				return i, false
			}
			i = skipWS(b, i)
			if i >= len(b) {
				return i, false
			}
			switch b[i] {
			case ',':
				i = skipWS(b, i+1)
				continue
			case ']':
				return i + 1, true
			}
			return i, false
		}
	}
	return s.skip.skip(b, i, depth)
}

// Keys of a message, part, block or item that carry text, and the slots their
// contributions are kept in so that a duplicate key replaces, not adds.
const (
	slotText = iota
	slotRefusal
	slotThinking
	slotArguments
	slotContent
	slotOutput
	slotToolCalls
	slotFunction
	slotParts
	slotToolResult
	numSlots
)

// mediaKind classifies a part by its "type".
type mediaKind uint8

const (
	mediaNone mediaKind = iota
	mediaImage
	mediaAudio
	mediaFile
)

func mediaOf(t []byte) mediaKind {
	switch string(t) {
	case "image_url", "input_image", "image":
		return mediaImage
	case "input_audio", "audio":
		return mediaAudio
	case "file", "input_file", "document":
		return mediaFile
	}
	return mediaNone
}

// mediaKey classifies a part by a member whose name says it holds media, for the APIs whose
// parts have no "type": Gemini's inlineData (an image or audio by its MIME type, anything else
// a file) and fileData, and Bedrock Converse's image, document, video and audio blocks. It
// reads the member's value at v (returning where it ends) only for inlineData.
func (s *requestScan) mediaKey(k []byte, v, depth int) (mediaKind, int, bool) {
	switch string(k) {
	case "image":
		return mediaImage, v, false
	case "audio":
		return mediaAudio, v, false
	case "document", "video", "fileData", "file_data":
		return mediaFile, v, false
	case "inlineData", "inline_data":
	default:
		return mediaNone, v, false
	}
	b := s.b
	kind := mediaFile
	if b[v] != '{' {
		return kind, v, false
	}
	var kb keyBuf
	it := openObject(b, v)
	for {
		key, esc, val, more := it.next()
		if !more {
			return kind, it.i, !it.bad
		}
		mk, _ := decodeKey(&kb, key, esc)
		if (string(mk) == "mimeType" || string(mk) == "mime_type") && b[val] == '"' {
			end, _, esc, ok := scanString(b, val+1)
			if !ok {
				return kind, end, false
			}
			kind = mimeMedia(b[val+1:end-1], esc)
			it.i = end
			continue
		}
		end, ok := s.skip.skip(b, val, depth+2)
		if !ok {
			return kind, end, false
		}
		it.i = end
	}
}

// mediaKeys are the member names mediaKey knows, each with its place in a part's record.
var mediaKeys = [...]string{"image", "audio", "document", "video", "fileData", "file_data", "inlineData", "inline_data"}

const numMediaKeys = len(mediaKeys)

// mediaKeyIndex returns k's index in mediaKeys (k is one of them).
func mediaKeyIndex(k []byte) int {
	for i, name := range mediaKeys {
		if name == string(k) {
			return i
		}
	}
	return 0
}

// mimeMedia classifies a MIME type: image/*, audio/*, anything else a file. An escaped type
// is read as a file.
func mimeMedia(t []byte, esc bool) mediaKind {
	switch {
	case esc:
	case len(t) >= 6 && string(t[:6]) == "image/":
		return mediaImage
	case len(t) >= 6 && string(t[:6]) == "audio/":
		return mediaAudio
	}
	return mediaFile
}

// part measures one object of a content tree. Text keys are counted whatever
// the object's type says, since the type may come after them and a part
// without a known type still costs its text; media are counted by type.
func (s *requestScan) part(i, depth, level int, dst *content) (int, bool) {
	if depth+1 > maxDepth {
		return i, false
	}
	b := s.b
	var (
		slots [numSlots]content
		media mediaKind
		// keyed is the media a member's name says the part holds (mediaKey), for parts without
		// a type that says it.
		keyed [numMediaKeys]mediaKind
		kb    keyBuf
	)
	it := openObject(b, i)
	for {
		key, esc, v, more := it.next()
		if !more {
			break
		}
		k, _ := decodeKey(&kb, key, esc)
		slot := -1
		switch string(k) {
		case "text":
			slot = slotText
		case "refusal":
			slot = slotRefusal
		case "thinking":
			slot = slotThinking
		case "arguments":
			slot = slotArguments
		case "content":
			slot = slotContent
		case "output":
			slot = slotOutput
		case "tool_calls":
			slot = slotToolCalls
		case "function":
			slot = slotFunction
		case "parts":
			slot = slotParts
		case "toolResult":
			slot = slotToolResult
		case "type":
			media = mediaNone
			if b[v] == '"' {
				end, _, esc, ok := scanString(b, v+1)
				if !ok {
					return end, false
				}
				t, _ := decodeKey(&kb, b[v+1:end-1], esc)
				media = mediaOf(t)
				it.i = end
				continue
			}
		}
		var ok bool
		if slot < 0 {
			var mk mediaKind
			end := v
			if mk, end, ok = s.mediaKey(k, v, depth); mk != mediaNone {
				keyed[mediaKeyIndex(k)] = mk
			}
			if end == v {
				v, ok = s.skip.skip(b, v, depth+1)
			} else {
				v = end
			}
		} else {
			slots[slot] = content{}
			if slot <= slotArguments {
				// Plain text keys: a string counts, anything else is ignored.
				if b[v] == '"' {
					var n int64
					v, n, _, ok = scanString(b, v+1)
					slots[slot].bytes = n
				} else {
					v, ok = s.skip.skip(b, v, depth+1)
				}
			} else {
				v, ok = s.texts(v, depth+1, level+1, &slots[slot])
			}
		}
		if !ok {
			return v, false
		}
		it.i = v
	}
	if it.bad {
		return it.i, false
	}
	for _, c := range slots {
		dst.add(c)
	}
	if media == mediaNone {
		for _, mk := range keyed {
			media = max(media, mk)
		}
	}
	switch media {
	case mediaImage:
		dst.images++
	case mediaAudio:
		dst.audio++
	case mediaFile:
		dst.files++
	}
	return it.i, true
}
