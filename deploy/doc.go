// Package deploy holds what runs llm-bulkhead where Envoy runs: the Helm chart
// (helm/llm-bulkhead) and complete examples for Envoy Gateway (envoy-gateway), Envoy AI Gateway
// (ai-gateway) and Istio (istio).
//
// It is a Go module of its own so that the server's module does not depend on Helm, the
// Kubernetes API and the gateways' API types. Its tests render the chart with the Helm library
// for several sets of values and decode every manifest, rendered or written by hand, strictly
// into the official Go types of its API (Kubernetes, Prometheus Operator, cert-manager, Gateway
// API, Envoy Gateway, Istio; Envoy's own protos for the filter configurations patched into
// Envoy), refusing unknown fields. They also check that the chart's policy, alerts and dashboard
// are the ones in examples/, and that every value of the chart is documented.
package deploy
