package extproc

import (
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// policyParts are the settings and reply pieces that depend only on the policy, built once per
// snapshot and shared by every stream. Protobuf messages may be marshalled concurrently as long as
// nobody changes them, and nobody does: they are never modified after build.
type policyParts struct {
	snap          *policy.Snapshot
	settings      Settings
	featureHeader []*corev3.HeaderValueOption
	provHeader    []*corev3.HeaderValueOption
}

// parts returns the settings and reply pieces of snapshot s, building them on its first use.
func (srv *Server) parts(s *policy.Snapshot) *policyParts {
	if c := srv.policyParts.Load(); c != nil && c.snap == s {
		return c
	}
	c := &policyParts{snap: s, settings: compileSettings(s.Policy(), srv.memLimit)}
	for i := 0; i < s.Features(); i++ {
		c.featureHeader = append(c.featureHeader, setHeader(HeaderFeature, s.FeatureName(i)))
	}
	for i := 0; i < s.Providers(); i++ {
		c.provHeader = append(c.provHeader, setHeader(HeaderProvider, s.ProviderName(i)))
	}
	srv.policyParts.Store(c)
	return c
}
