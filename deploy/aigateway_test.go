package deploy

import (
	"encoding/json"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	gwapiv1 "sigs.k8s.io/gateway-api/apis/v1"
	gwapiv1a2 "sigs.k8s.io/gateway-api/apis/v1alpha2"
	"sigs.k8s.io/yaml"
)

// Envoy AI Gateway's resources (group aigateway.envoyproxy.io, version v1alpha1). Its Go module
// (github.com/envoyproxy/ai-gateway) is not available from the module proxy this project
// builds with, so these are the fields of its api/v1alpha1 types at the levels the example
// uses, transcribed field for field; every value below them is the Gateway API's own type
// (ParentReference, HTTPHeaderMatch, HTTPRouteTimeouts, BackendObjectReference,
// LocalPolicyTargetReference, SecretObjectReference), which the AI Gateway types embed; the
// parts of a BackendSecurityPolicy the example does not use stay raw JSON. Decoding stays
// strict: a field neither type knows fails.

type aiGatewayRoute struct {
	metav1.TypeMeta `json:",inline"`
	Metadata        metav1.ObjectMeta `json:"metadata"`
	Spec            struct {
		ParentRefs      []gwapiv1.ParentReference `json:"parentRefs,omitempty"`
		Rules           []aiGatewayRouteRule      `json:"rules"`
		FilterConfig    json.RawMessage           `json:"filterConfig,omitempty"`
		LLMRequestCosts json.RawMessage           `json:"llmRequestCosts,omitempty"`
	} `json:"spec"`
}

type aiGatewayRouteRule struct {
	BackendRefs []struct {
		Name              string             `json:"name"`
		Namespace         *gwapiv1.Namespace `json:"namespace,omitempty"`
		Group             *string            `json:"group,omitempty"`
		Kind              *string            `json:"kind,omitempty"`
		ModelNameOverride string             `json:"modelNameOverride,omitempty"`
		HeaderMutation    json.RawMessage    `json:"headerMutation,omitempty"`
		BodyMutation      json.RawMessage    `json:"bodyMutation,omitempty"`
		Weight            *int32             `json:"weight,omitempty"`
		Priority          *uint32            `json:"priority,omitempty"`
	} `json:"backendRefs,omitempty"`
	Matches []struct {
		Headers []gwapiv1.HTTPHeaderMatch `json:"headers,omitempty"`
	} `json:"matches,omitempty"`
	Timeouts        *gwapiv1.HTTPRouteTimeouts `json:"timeouts,omitempty"`
	ModelsOwnedBy   *string                    `json:"modelsOwnedBy,omitempty"`
	ModelsCreatedAt *metav1.Time               `json:"modelsCreatedAt,omitempty"`
}

type aiServiceBackend struct {
	metav1.TypeMeta `json:",inline"`
	Metadata        metav1.ObjectMeta `json:"metadata"`
	Spec            struct {
		APISchema struct {
			Name    string  `json:"name"`
			Version *string `json:"version,omitempty"`
			Prefix  *string `json:"prefix,omitempty"`
		} `json:"schema"`
		BackendRef               gwapiv1.BackendObjectReference `json:"backendRef"`
		BackendSecurityPolicyRef *gwapiv1.LocalObjectReference  `json:"backendSecurityPolicyRef,omitempty"`
	} `json:"spec"`
}

type backendSecurityPolicy struct {
	metav1.TypeMeta `json:",inline"`
	Metadata        metav1.ObjectMeta `json:"metadata"`
	Spec            struct {
		TargetRefs []gwapiv1a2.LocalPolicyTargetReference `json:"targetRefs,omitempty"`
		Type       string                                 `json:"type"`
		APIKey     *struct {
			SecretRef *gwapiv1.SecretObjectReference `json:"secretRef"`
		} `json:"apiKey,omitempty"`
		AWSCredentials *struct {
			Region          string `json:"region"`
			CredentialsFile *struct {
				SecretRef *gwapiv1.SecretObjectReference `json:"secretRef"`
				Profile   string                         `json:"profile,omitempty"`
			} `json:"credentialsFile,omitempty"`
			OIDCExchangeToken json.RawMessage `json:"oidcExchangeToken,omitempty"`
		} `json:"awsCredentials,omitempty"`
		AzureCredentials json.RawMessage `json:"azureCredentials,omitempty"`
		GCPCredentials   json.RawMessage `json:"gcpCredentials,omitempty"`
	} `json:"spec"`
}

func decodeBackendSecurityPolicy(m manifest) (any, error) {
	v := new(backendSecurityPolicy)
	if err := yaml.UnmarshalStrict(m.doc, v); err != nil {
		return nil, fmt.Errorf("does not decode strictly into BackendSecurityPolicy: %w", err)
	}
	set := map[string]bool{"APIKey": v.Spec.APIKey != nil, "AWSCredentials": v.Spec.AWSCredentials != nil,
		"AzureCredentials": v.Spec.AzureCredentials != nil, "GCPCredentials": v.Spec.GCPCredentials != nil}
	if _, known := set[v.Spec.Type]; !known {
		return nil, fmt.Errorf("BackendSecurityPolicy %s: unknown type %q", v.Metadata.Name, v.Spec.Type)
	}
	for typ, has := range set {
		if has != (typ == v.Spec.Type) {
			return nil, fmt.Errorf("BackendSecurityPolicy %s of type %s: only %s's field may be set", v.Metadata.Name, v.Spec.Type, v.Spec.Type)
		}
	}
	return v, nil
}

func decodeAIGatewayRoute(m manifest) (any, error) {
	v := new(aiGatewayRoute)
	if err := yaml.UnmarshalStrict(m.doc, v); err != nil {
		return nil, fmt.Errorf("does not decode strictly into AIGatewayRoute: %w", err)
	}
	if len(v.Spec.Rules) == 0 {
		return nil, fmt.Errorf("AIGatewayRoute %s has no rules (required)", v.Metadata.Name)
	}
	for _, p := range v.Spec.ParentRefs {
		if p.Kind == nil || *p.Kind != "Gateway" {
			return nil, fmt.Errorf("AIGatewayRoute %s: only Gateway parents are supported", v.Metadata.Name)
		}
	}
	return v, nil
}

func decodeAIServiceBackend(m manifest) (any, error) {
	v := new(aiServiceBackend)
	if err := yaml.UnmarshalStrict(m.doc, v); err != nil {
		return nil, fmt.Errorf("does not decode strictly into AIServiceBackend: %w", err)
	}
	switch v.Spec.APISchema.Name {
	case "OpenAI", "AWSBedrock", "AzureOpenAI", "GCPVertexAI", "GCPAnthropic", "Anthropic", "AWSAnthropic", "Cohere":
	default:
		return nil, fmt.Errorf("AIServiceBackend %s: unknown schema %q", v.Metadata.Name, v.Spec.APISchema.Name)
	}
	return v, nil
}
