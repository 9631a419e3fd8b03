package policy

import "github.com/llm-bulkhead/llm-bulkhead/policy/config"

// ClusterShare returns what every limit is divided by in this process: the live replicas last
// seen while the shared state is unavailable and cluster.on_unavailable is local, 1 otherwise
// (and without a cluster).
func (e *Engine) ClusterShare() int { return int(max(e.share.Load(), 1)) }

// ClusterOnUnavailable returns what admission does while the shared state is unavailable
// (cluster.on_unavailable: "local" or "closed"), or "" without a cluster.
func (e *Engine) ClusterOnUnavailable() string {
	switch {
	case e.cluster == nil:
		return ""
	case e.cluster.closed:
		return config.OnUnavailableClosed
	default:
		return config.OnUnavailableLocal
	}
}
