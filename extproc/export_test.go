package extproc

import (
	"context"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// SetBeforeHandle installs a function run before each message is handled (tests only).
func (s *Server) SetBeforeHandle(f func(*extprocv3.ProcessingRequest)) { s.beforeHandle = f }

// DecodesWithoutProtobuf reports whether the server's codec decodes the request b itself, not
// with protobuf's decoder (tests only).
func DecodesWithoutProtobuf(b []byte) bool {
	return decodeRequest(b, &extprocv3.ProcessingRequest{})
}

// Endable returns ctx as a stream opened through EndableStreams carries it (tests only).
func Endable(ctx context.Context) context.Context {
	ctx, _ = endableStream(ctx, nil)
	return ctx
}
