// Package examples holds the example policy files. examples/policy.yaml is also embedded in the
// server binary as its default policy.
package examples

import _ "embed"

// DefaultPolicy is examples/policy.yaml, the policy the server runs when no --config is given.
//
//go:embed policy.yaml
var DefaultPolicy []byte

// DefaultPolicyName names the embedded policy in log lines and error messages.
const DefaultPolicyName = "<embedded examples/policy.yaml>"
