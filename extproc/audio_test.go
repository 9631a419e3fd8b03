package extproc_test

import (
	"context"
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
