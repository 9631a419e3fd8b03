package extproc_test

import (
	"context"
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// TestAudioUploadIsNotJSON: an audio transcription's multipart/form-data body is neither
// refused on a path that requires a JSON body nor counted as invalid JSON; feature rules
// match its path.
func TestAudioUploadIsNotJSON(t *testing.T) {
	s := serve(t, `
envoy: {max_message_timeout: 10s}
body: {require_valid_json: ["/v1/"]}
classification:
  feature: {rules: [{path_prefix: /v1/audio/, value: audio}]}
features:
  default: {max_concurrent: 5}
  audio: {max_concurrent: 1, tokens_per_minute: 1000000}
`, bufferedWithMetadata())
	body := "--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--b\r\n" +
		"Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF....\r\n--b--\r\n"
	req := &envoysim.Request{Method: "POST", Path: "/v1/audio/transcriptions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "multipart/form-data; boundary=b"}}, Body: []byte(body)}
	r, err := s.sim.RoundTrip(context.Background(), req, envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}}, `{"text":"hello"}`))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	if f := r.DynamicMetadata["llm_bulkhead"].GetFields()["feature"].GetStringValue(); f != "audio" {
		t.Errorf("feature %q", f)
	}
	if got := string(r.Upstream.Body); got != body {
		t.Errorf("the upload was changed on its way: %q", got)
	}
	mfs, err := s.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if mf.GetName() == "llm_bulkhead_classify_errors_total" && m.GetCounter().GetValue() != 0 {
				t.Errorf("classification errors counted for an upload: %v", m)
			}
		}
	}
}

// audioSpendPolicy prices whisper-1 by the second and gpt-4o-transcribe by the token, with a
// spend budget so that both reserve and settle; the model of an upload (a form field the
// server does not read) comes from a header.
const audioSpendPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  model: {rules: [{header: x-model}]}
prices:
  - {match: whisper-1, per_second: 0.0001}
  - {match: gpt-4o-transcribe, input_per_mtok: 2.50, output_per_mtok: 10.00}
  - {match: tts-1, per_request: 0.002}
  - {match: dall-e-3, per_image: 0.04}
  - {match: default, input_per_mtok: 1, output_per_mtok: 1}
features:
  default: {max_concurrent: 5, tokens_per_minute: 100000000, spend_per_day: 1000}
`

func upload(model string, size int) *envoysim.Request {
	body := "--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n" + model + "\r\n--b\r\n" +
		"Content-Disposition: form-data; name=\"file\"; filename=\"a.mp3\"\r\nContent-Type: audio/mpeg\r\n\r\n" +
		strings.Repeat("\xff", size) + "\r\n--b--\r\n"
	return &envoysim.Request{Method: "POST", Path: "/v1/audio/transcriptions", Body: []byte(body),
		Headers: envoysim.Headers{{Key: "content-type", Value: "multipart/form-data; boundary=b"}, {Key: "x-model", Value: model},
			{Key: "content-length", Value: strconv.Itoa(len(body))}}}
}

func mdNumber(t *testing.T, r *envoysim.Result, key string) float64 {
	t.Helper()
	v := r.DynamicMetadata["llm_bulkhead"].GetFields()[key]
	if v == nil {
		t.Fatalf("no %s in %v", key, r.DynamicMetadata["llm_bulkhead"])
	}
	return v.GetNumberValue()
}

// TestAudioSettlesFromUsage: a transcription is decided at its headers, its upload never
// buffered, and reserved for the longest audio its size can hold at 2000 bytes a second; it
// settles at the seconds or the tokens its response reports, and at the reserved seconds when
// it reports none. A transcription's tokens reach the token budget.
func TestAudioSettlesFromUsage(t *testing.T) {
	cfg := bufferedWithMetadata()
	cfg.AllowModeOverride = true
	s := serve(t, audioSpendPolicy, cfg)
	json := envoysim.Headers{{Key: "content-type", Value: "application/json"}}
	tests := []struct {
		name, model, body string
		size              int
		spend, tokens     float64
	}{
		// 9.215 s at $0.0001 a second: 921.5 millionths, rounded up.
		{"whisper seconds", "whisper-1", `{"text":"Hello there.","usage":{"type":"duration","seconds":9.215}}`, 40_000, 0.000922, 0},
		// 14 × 2.50 + 6 × 10 per million.
		{"transcribe tokens", "gpt-4o-transcribe", `{"text":"Hello there.","usage":{"type":"tokens","input_tokens":14,"output_tokens":6,"total_tokens":20}}`, 40_000, 0.000095, 20},
		// No usage: the worst case of the upload, (40 000 + form) bytes at 2000 a second.
		{"whisper without usage", "whisper-1", `{"text":"Hello there."}`, 40_000, 0, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := upload(tt.model, tt.size)
			r, err := s.sim.RoundTrip(context.Background(), req, envoysim.Respond(200, json, tt.body))
			if err != nil || r.Status != 200 {
				t.Fatalf("%v %v", r, err)
			}
			for _, k := range r.SentKinds() {
				if k == envoysim.KindRequestBody {
					t.Fatal("the upload was sent to the server")
				}
			}
			if string(r.Upstream.Body) != string(req.Body) {
				t.Error("the upload was changed on its way")
			}
			// The longest audio the upload holds, at $0.0001 (100 millionths) a second, rounded
			// up to a millionth.
			millis := (int64(len(req.Body))*1000 + 1999) / 2000
			reserved := float64((millis*100+999)/1000) / 1e6
			want := tt.spend
			if want == 0 {
				want = reserved
			}
			if got := mdNumber(t, r, "spend"); math.Abs(got-want) > 1e-9 || (tt.model == "whisper-1" && mdNumber(t, r, "spend_reserved") < reserved-1e-9) {
				t.Errorf("spend %v (reserved %v), want %v", got, mdNumber(t, r, "spend_reserved"), want)
			}
			if tt.tokens >= 0 {
				if got := mdNumber(t, r, "total_tokens"); got != tt.tokens {
					t.Errorf("settled %v tokens, want %v", got, tt.tokens)
				}
			}
		})
	}
}

// TestSpeechAndImagesPricedPerUnit: speech is charged per request and image generation per
// image asked for, when the provider served them; a failed one is refunded.
func TestSpeechAndImagesPricedPerUnit(t *testing.T) {
	s := serve(t, audioSpendPolicy, bufferedWithMetadata())
	jsonCT := envoysim.Headers{{Key: "content-type", Value: "application/json"}}
	call := func(path, model, body string, status int, resp string) *envoysim.Result {
		t.Helper()
		req := &envoysim.Request{Method: "POST", Path: path, Body: []byte(body),
			Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-model", Value: model}}}
		r, err := s.sim.RoundTrip(context.Background(), req, envoysim.Respond(status, jsonCT, resp))
		if err != nil || r.Status != status {
			t.Fatalf("%v %v", r, err)
		}
		return r
	}
	r := call("/v1/audio/speech", "tts-1", `{"model":"tts-1","input":"Hello there.","voice":"alloy"}`, 200, "ID3....")
	if got := mdNumber(t, r, "spend"); got != 0.002 {
		t.Errorf("speech: spend %v, want 0.002", got)
	}
	r = call("/v1/images/generations", "dall-e-3", `{"model":"dall-e-3","prompt":"a bulkhead","n":3}`, 200, `{"created":1,"data":[{"url":"a"},{"url":"b"},{"url":"c"}]}`)
	if got := mdNumber(t, r, "spend"); math.Abs(got-0.12) > 1e-9 || math.Abs(mdNumber(t, r, "spend_reserved")-0.12) > 1e-9 {
		t.Errorf("3 images: spend %v reserved %v, want 0.12", got, mdNumber(t, r, "spend_reserved"))
	}
	r = call("/v1/images/generations", "dall-e-3", `{"model":"dall-e-3","prompt":"a bulkhead"}`, 503, `{"error":{"message":"down"}}`)
	if got := mdNumber(t, r, "spend"); got != 0 {
		t.Errorf("a failed image generation was charged %v", got)
	}
}
