package extproc

import (
	"context"
	"reflect"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// TestRecycledProcessorStartsClean drives a processor through a whole admitted request, then
// clears it for the next stream: nothing of the request may be left for the next one to see,
// only the bound onQueue and the metadata buffer's array.
func TestRecycledProcessorStartsClean(t *testing.T) {
	eng, srv := internalServer(t, "features: {default: {max_concurrent: 1, tokens_per_minute: 100000}}\nresponses: {compartment_header: true, ratelimit_headers: true}\n", nil)
	pr := newProcessor(srv, quietStream{ctx: context.Background()})
	pr.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: headersMsg(true, ":method", "GET", ":path", "/v1/models")}})
	resp := pr.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: headersMsg(false, ":status", "200", "content-type", "text/event-stream")}})
	if n := len(resp.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders()); n != 3 {
		t.Fatalf("response headers reply sets %d headers, want the compartment and two rate-limit headers", n)
	}
	resp = pr.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{EndOfStream: true,
			Body: []byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4,\"total_tokens\":7}}\n\n")}}})
	if len(resp.ProtoReflect().GetUnknown()) == 0 {
		t.Fatal("the last reply carries no dynamic metadata")
	}
	pr.finish()
	if eng.InFlight() != 0 {
		t.Fatalf("%d request(s) still in flight", eng.InFlight())
	}
	meta := cap(pr.out.meta)

	pr.clear()
	if pr.onQueueFn == nil {
		t.Error("onQueue is no longer bound")
	}
	if cap(pr.out.meta) != meta || len(pr.out.meta) != 0 {
		t.Errorf("metadata buffer: len %d cap %d, want 0 and %d", len(pr.out.meta), cap(pr.out.meta), meta)
	}
	v := reflect.ValueOf(pr).Elem()
	for i := 0; i < v.NumField(); i++ {
		name := v.Type().Field(i).Name
		if name == "onQueueFn" {
			continue
		}
		f := v.Field(i)
		if name == "out" {
			f = f.FieldByName("body") // every reply part but the kept buffer
			for _, part := range []string{"headers", "mut", "set", "nset", "vals", "nvals"} {
				if !v.Field(i).FieldByName(part).IsZero() {
					t.Errorf("out.%s is left from the last stream", part)
				}
			}
		}
		if !f.IsZero() {
			t.Errorf("%s is left from the last stream", name)
		}
	}
}
