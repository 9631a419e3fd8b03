package envoysim

import (
	"context"
	"net"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	ratelimitfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/llm-bulkhead/llm-bulkhead/envoy"
)

// fakeRLS is a rate limit service answering every call with code and recording the requests.
type fakeRLS struct {
	rlsv3.UnimplementedRateLimitServiceServer
	addr string
	code rlsv3.RateLimitResponse_Code
	mu   sync.Mutex
	reqs []*rlsv3.RateLimitRequest
}

func (f *fakeRLS) ShouldRateLimit(_ context.Context, r *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reqs = append(f.reqs, r)
	return &rlsv3.RateLimitResponse{OverallCode: f.code}, nil
}

func (f *fakeRLS) requests() []*rlsv3.RateLimitRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*rlsv3.RateLimitRequest(nil), f.reqs...)
}

func startRLS(t *testing.T, code rlsv3.RateLimitResponse_Code) *fakeRLS {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeRLS{addr: lis.Addr().String(), code: code}
	gs := grpc.NewServer()
	rlsv3.RegisterRateLimitServiceServer(gs, f)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	t.Cleanup(func() {
		gs.Stop()
		<-done
	})
	return f
}

// shippedRateLimit is the rate limit filter as envoy/ratelimit.yaml configures it.
func shippedRateLimit(t *testing.T, addr string) *RateLimit {
	t.Helper()
	domain, rules, err := RateLimitFromVirtualHostYAML(envoy.RateLimit)
	if err != nil {
		t.Fatal(err)
	}
	return &RateLimit{Addr: addr, Domain: domain, Rules: rules, Timeout: 5 * time.Second}
}

// settles answers every message with CONTINUE and leaves total_tokens in the llm_bulkhead
// namespace with its reply to the response headers, as the last reply of a request.
func settles(total float64) script {
	return func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		resp := cont(req)
		if _, ok := req.GetRequest().(*extprocv3.ProcessingRequest_ResponseHeaders); ok {
			resp.DynamicMetadata = &structpb.Struct{Fields: map[string]*structpb.Value{
				"llm_bulkhead": structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
					"total_tokens": structpb.NewNumberValue(total)}})}}
		}
		return resp
	}
}

func descriptorString(r *rlsv3.RateLimitRequest) []string {
	var out []string
	for _, d := range r.GetDescriptors() {
		s := ""
		for _, e := range d.GetEntries() {
			s += e.GetKey() + "=" + e.GetValue() + ";"
		}
		if d.GetHitsAddend() != nil {
			s += "hits=" + strconv.FormatUint(d.GetHitsAddend().GetValue(), 10)
		}
		out = append(out, s)
	}
	return out
}

// TestRateLimitFromShippedYAML: envoy/ratelimit.yaml reads into the check (tenant and
// tenant_tokens on the request path) and the charge (tenant_tokens with llm_bulkhead's
// total_tokens when the stream is done).
func TestRateLimitFromShippedYAML(t *testing.T) {
	domain, rules, err := RateLimitFromVirtualHostYAML(envoy.RateLimit)
	if err != nil {
		t.Fatal(err)
	}
	if domain != "llm" || len(rules) != 3 {
		t.Fatalf("domain %q, %d rules", domain, len(rules))
	}
	charge := rules[2]
	if !charge.OnStreamDone || charge.HitsAddendMetadata == nil || charge.HitsAddendMetadata.Namespace != "llm_bulkhead" ||
		len(charge.HitsAddendMetadata.Path) != 1 || charge.HitsAddendMetadata.Path[0] != "total_tokens" {
		t.Errorf("charge rule %+v", charge)
	}
	if check := rules[1]; check.OnStreamDone || check.HitsAddend == nil || *check.HitsAddend != 1 ||
		check.Headers[0] != (RateLimitHeader{HeaderName: "x-tenant-id", DescriptorKey: "tenant_tokens"}) {
		t.Errorf("check rule %+v", check)
	}
}

// TestRateLimitFromProtoRefusesWhatIsNotSimulated: other actions and formats fail loudly.
func TestRateLimitFromProtoRefusesWhatIsNotSimulated(t *testing.T) {
	for name, rl := range map[string]*routev3.RateLimit{
		"remote_address": {Actions: []*routev3.RateLimit_Action{{ActionSpecifier: &routev3.RateLimit_Action_RemoteAddress_{}}}},
		"format": {Actions: []*routev3.RateLimit_Action{{ActionSpecifier: &routev3.RateLimit_Action_RequestHeaders_{
			RequestHeaders: &routev3.RateLimit_Action_RequestHeaders{HeaderName: "x", DescriptorKey: "x"}}}},
			HitsAddend: &routev3.RateLimit_HitsAddend{Format: "%REQ(x-hits)%"}},
	} {
		if _, _, err := RateLimitFromProto(&ratelimitfilterv3.RateLimitPerRoute{RateLimits: []*routev3.RateLimit{rl}}); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestRateLimitChecksThenChargesSettledTokens: the check goes out before ext_proc with one
// hit, the charge after the stream with the total_tokens ext_proc left in dynamic metadata.
func TestRateLimitChecksThenChargesSettledTokens(t *testing.T) {
	rls := startRLS(t, rlsv3.RateLimitResponse_OK)
	ts := startServer(t, scripted(settles(1234)))
	s := newSim(t, ts.addr, FilterConfig{ReceivingNamespaces: []string{"llm_bulkhead"}, RateLimit: shippedRateLimit(t, rls.addr)})
	res := roundTrip(t, s, &Request{Method: "POST", Path: "/v1/chat/completions", Headers: H("x-tenant-id", "acme")}, Respond(200, nil, ""))
	if res.Status != 200 || res.Local != NotLocal {
		t.Fatalf("status %d local %v", res.Status, res.Local)
	}
	reqs := rls.requests()
	if len(reqs) != 2 || len(res.RateLimitCalls) != 2 {
		t.Fatalf("%d calls reached the service, %d recorded", len(reqs), len(res.RateLimitCalls))
	}
	if reqs[0].GetDomain() != "llm" || !slices.Equal(descriptorString(reqs[0]), []string{"tenant=acme;", "tenant_tokens=acme;hits=1"}) {
		t.Errorf("check %v %v", reqs[0].GetDomain(), descriptorString(reqs[0]))
	}
	if res.RateLimitCalls[0].OnStreamDone || !res.RateLimitCalls[1].OnStreamDone {
		t.Error("calls out of order")
	}
	if !slices.Equal(descriptorString(reqs[1]), []string{"tenant_tokens=acme;hits=1234"}) {
		t.Errorf("charge %v", descriptorString(reqs[1]))
	}
	if ts.streamCount() != 1 || res.Upstream == nil {
		t.Error("the request did not reach ext_proc and the upstream")
	}
}

// TestRateLimitOverLimitAnswers429BeforeExtProc: OVER_LIMIT is Envoy's 429 with
// x-envoy-ratelimited; neither ext_proc nor the upstream sees the request, and the stream-done
// rule, whose metadata never came, charges nothing.
func TestRateLimitOverLimitAnswers429BeforeExtProc(t *testing.T) {
	rls := startRLS(t, rlsv3.RateLimitResponse_OVER_LIMIT)
	ts := startServer(t, scripted(settles(10)))
	s := newSim(t, ts.addr, FilterConfig{ReceivingNamespaces: []string{"llm_bulkhead"}, RateLimit: shippedRateLimit(t, rls.addr)})
	res := roundTrip(t, s, &Request{Method: "POST", Path: "/v1/chat/completions", Headers: H("x-tenant-id", "acme"), Body: []byte("{}")}, Respond(200, nil, ""))
	if res.Status != 429 || res.Local != LocalRateLimited || res.Headers.Get("x-envoy-ratelimited") != "true" || res.LocalDetails != "request_rate_limited" {
		t.Fatalf("status %d local %v details %q headers %v", res.Status, res.Local, res.LocalDetails, res.Headers)
	}
	if ts.streamCount() != 0 || res.Upstream != nil || res.Stream != StreamNotOpened {
		t.Error("a refused request reached ext_proc or the upstream")
	}
	if n := len(rls.requests()); n != 1 {
		t.Errorf("%d calls, want the check only", n)
	}
}

// TestRateLimitNoDescriptorNoCall: without the tenant header no descriptor is built and the
// service is never called.
func TestRateLimitNoDescriptorNoCall(t *testing.T) {
	rls := startRLS(t, rlsv3.RateLimitResponse_OVER_LIMIT)
	ts := startServer(t, scripted(continueAll))
	s := newSim(t, ts.addr, FilterConfig{RateLimit: shippedRateLimit(t, rls.addr)})
	res := roundTrip(t, s, &Request{Path: "/v1/models"}, Respond(200, nil, ""))
	if res.Status != 200 || len(rls.requests()) != 0 {
		t.Fatalf("status %d, %d calls", res.Status, len(rls.requests()))
	}
}

// TestRateLimitServiceDown: an unreachable service lets the request through, unless
// failure_mode_deny, which answers status_on_error.
func TestRateLimitServiceDown(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := lis.Addr().String()
	_ = lis.Close()
	ts := startServer(t, scripted(continueAll))
	for _, deny := range []bool{false, true} {
		rl := shippedRateLimit(t, dead)
		rl.FailureModeDeny = deny
		s := newSim(t, ts.addr, FilterConfig{RateLimit: rl})
		res := roundTrip(t, s, &Request{Path: "/v1/models", Headers: H("x-tenant-id", "acme")}, Respond(200, nil, ""))
		want, local := 200, NotLocal
		if deny {
			want, local = 500, LocalRateLimitError
		}
		if res.Status != want || res.Local != local || len(res.RateLimitCalls) != 1 || res.RateLimitCalls[0].Err == nil {
			t.Errorf("failure_mode_deny %v: status %d local %v calls %+v", deny, res.Status, res.Local, res.RateLimitCalls)
		}
	}
}

// TestRateLimitHitsAddendFromMetadata: numbers and numeric strings in range count; anything
// else drops the descriptor, as Envoy does.
func TestRateLimitHitsAddendFromMetadata(t *testing.T) {
	k := &MetadataKey{Namespace: "ns", Path: []string{"n"}}
	for _, c := range []struct {
		v    *structpb.Value
		want uint64
		ok   bool
	}{
		{structpb.NewNumberValue(42.9), 42, true},
		{structpb.NewStringValue("7"), 7, true},
		{structpb.NewNumberValue(-1), 0, false},
		{structpb.NewNumberValue(2e9), 0, false},
		{structpb.NewStringValue("-"), 0, false},
		{structpb.NewBoolValue(true), 0, false},
	} {
		md := map[string]*structpb.Struct{"ns": {Fields: map[string]*structpb.Value{"n": c.v}}}
		if got, ok := metadataHits(md, k); got != c.want || ok != c.ok {
			t.Errorf("%v: %d %v, want %d %v", c.v, got, ok, c.want, c.ok)
		}
	}
	if _, ok := metadataHits(nil, k); ok {
		t.Error("absent metadata resolved")
	}
}

// TestRateLimitRefusedByExtProcIsNotCharged: a request the processor refuses leaves no
// total_tokens, so the stream-done descriptor does not resolve and only the check is sent.
func TestRateLimitRefusedByExtProcIsNotCharged(t *testing.T) {
	rls := startRLS(t, rlsv3.RateLimitResponse_OK)
	ts := startServer(t, scripted(func(_ int, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{Status: &typev3.HttpStatus{Code: typev3.StatusCode_TooManyRequests}}}}
	}))
	s := newSim(t, ts.addr, FilterConfig{ReceivingNamespaces: []string{"llm_bulkhead"}, RateLimit: shippedRateLimit(t, rls.addr)})
	res := roundTrip(t, s, &Request{Path: "/v1/models", Headers: H("x-tenant-id", "acme")}, Respond(200, nil, ""))
	if res.Status != 429 || res.Local != LocalImmediate || res.Headers.Get("x-envoy-ratelimited") != "" {
		t.Fatalf("status %d local %v headers %v", res.Status, res.Local, res.Headers)
	}
	if n := len(rls.requests()); n != 1 {
		t.Errorf("%d calls, want the check only", n)
	}
}
