package bench

import (
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Noop is the baseline ext_proc server: it answers every message with CONTINUE in a reply of
// the matching type and does nothing else, so the difference between it and llm-bulkhead under
// the same load is what classifying, admitting and settling cost. Safe for concurrent use.
type Noop struct {
	extprocv3.UnimplementedExternalProcessorServer
}

var _ extprocv3.ExternalProcessorServer = Noop{}

// Process serves one stream until Envoy ends it.
func (Noop) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		req, err := stream.Recv()
		if err != nil {
			// Envoy reset or half-closed the stream: nobody reads the status.
			return nil
		}
		resp := Continue(req)
		if resp == nil {
			return status.Error(codes.InvalidArgument, "ProcessingRequest carries no message")
		}
		if err := stream.Send(resp); err != nil {
			return nil
		}
	}
}

// Continue returns the CONTINUE reply of the type matching req, or nil when req carries no
// message.
func Continue(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	switch req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
	case *extprocv3.ProcessingRequest_RequestBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
	case *extprocv3.ProcessingRequest_ResponseBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
	}
	return nil
}
