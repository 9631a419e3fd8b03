package extproc

import (
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// replyParts are reply pieces that depend only on the policy, built once per snapshot and
// shared by every stream's replies. Protobuf messages may be marshalled concurrently as long as
// nobody changes them, and nobody does: they are never modified after build.
type replyParts struct {
	snap          *policy.Snapshot
	featureHeader []*corev3.HeaderValueOption
	provHeader    []*corev3.HeaderValueOption
}

// parts returns the reply pieces of snapshot s, building them on its first use.
func (srv *Server) parts(s *policy.Snapshot) *replyParts {
	if c := srv.replyParts.Load(); c != nil && c.snap == s {
		return c
	}
	c := &replyParts{snap: s}
	for i := 0; i < s.Features(); i++ {
		c.featureHeader = append(c.featureHeader, setHeader(HeaderFeature, s.FeatureName(i)))
	}
	for i := 0; i < s.Providers(); i++ {
		c.provHeader = append(c.provHeader, setHeader(HeaderProvider, s.ProviderName(i)))
	}
	srv.replyParts.Store(c)
	return c
}
