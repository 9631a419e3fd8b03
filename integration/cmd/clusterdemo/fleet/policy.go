package fleet

import (
	"bytes"
	"errors"
	"fmt"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// Cluster is the cluster section WithCluster writes: backend redis at Addrs.
type Cluster struct {
	// Addrs are the Redis server's host:port (standalone) or some of a Redis Cluster's nodes.
	Addrs []string
	// Mode is cluster.mode (empty: the default, standalone).
	Mode string
	// KeyPrefix separates runs sharing one Redis (empty: the default).
	KeyPrefix string
	// Timeout is cluster.timeout (0: the default, 20ms).
	Timeout time.Duration
	// Admission is cluster.admission, exact or leased (empty: the default); LeaseInterval and
	// LeaseTTL are cluster.lease_interval and cluster.lease_ttl (0: the defaults).
	Admission               string
	LeaseInterval, LeaseTTL time.Duration
}

// WithCluster returns the policy src with its cluster section replaced by c's (comments and
// every other section kept), checked to load. name is used in messages.
func WithCluster(name string, src []byte, c Cluster) ([]byte, error) {
	if len(c.Addrs) == 0 {
		return nil, errors.New("a Redis address is required")
	}
	sec := &yaml.Node{Kind: yaml.MappingNode}
	add := func(k string, v *yaml.Node) {
		sec.Content = append(sec.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: k}, v)
	}
	str := func(s string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: s} }
	add("backend", str("redis"))
	addrs := &yaml.Node{Kind: yaml.SequenceNode, Style: yaml.FlowStyle}
	for _, a := range c.Addrs {
		addrs.Content = append(addrs.Content, str(a))
	}
	add("addresses", addrs)
	for _, kv := range []struct{ k, v string }{{"mode", c.Mode}, {"key_prefix", c.KeyPrefix}, {"admission", c.Admission}} {
		if kv.v != "" {
			add(kv.k, str(kv.v))
		}
	}
	for _, kv := range []struct {
		k string
		d time.Duration
	}{{"timeout", c.Timeout}, {"lease_interval", c.LeaseInterval}, {"lease_ttl", c.LeaseTTL}} {
		if kv.d > 0 {
			add(kv.k, str(kv.d.String()))
		}
	}
	return rewrite(name, src, sec)
}

// WithoutCluster returns the policy src without its cluster section: every replica enforces
// every limit on its own.
func WithoutCluster(name string, src []byte) ([]byte, error) { return rewrite(name, src, nil) }

// rewrite replaces (or, with sec nil, removes) the top-level cluster section of src.
func rewrite(name string, src []byte, sec *yaml.Node) ([]byte, error) {
	var root yaml.Node
	if err := yaml.Unmarshal(src, &root); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if root.Kind != yaml.DocumentNode || len(root.Content) != 1 || root.Content[0].Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%s: a policy file must be a YAML mapping of sections", name)
	}
	doc := root.Content[0]
	for i := 0; i+1 < len(doc.Content); i += 2 {
		if doc.Content[i].Value == "cluster" {
			doc.Content = append(doc.Content[:i], doc.Content[i+2:]...)
			break
		}
	}
	if sec != nil {
		doc.Content = append(doc.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: "cluster"}, sec)
	}
	var out bytes.Buffer
	enc := yaml.NewEncoder(&out)
	enc.SetIndent(2)
	if err := enc.Encode(&root); err != nil {
		return nil, err
	}
	if err := enc.Close(); err != nil {
		return nil, err
	}
	if _, err := config.Load(name, out.Bytes(), []string{}); err != nil {
		return nil, fmt.Errorf("%s with the cluster section changed does not load: %w", name, err)
	}
	return out.Bytes(), nil
}
