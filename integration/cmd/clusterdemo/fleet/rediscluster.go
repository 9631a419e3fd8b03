package fleet

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Backend is the Redis a fleet shares: one server (*Redis) or a Redis Cluster (*RedisCluster).
type Backend interface {
	// Addrs are the addresses a replica's cluster section names, Mode its cluster.mode.
	Addrs() []string
	Mode() string
	// ReadCommands reads the command counters, added up over the servers.
	ReadCommands(ctx context.Context) (Commands, error)
	// CPU returns the CPU time the servers have used so far, added up.
	CPU() (time.Duration, error)
	// Stop shuts every server down.
	Stop()
}

var (
	_ Backend = (*Redis)(nil)
	_ Backend = (*RedisCluster)(nil)
)

// Addrs returns the server's address.
func (r *Redis) Addrs() []string { return []string{r.Addr} }

// Mode returns "standalone".
func (r *Redis) Mode() string { return "standalone" }

// RedisCluster is a Redis Cluster of master nodes without replicas, each a redis-server child
// process as StartRedis starts one. Its methods are safe for concurrent use.
type RedisCluster struct {
	Nodes []*Redis
}

// StartCluster starts n ≥ 3 cluster-enabled servers on free ports of 127.0.0.1, joins them into
// a cluster of n masters sharing the hash slots (redis-cli --cluster create; redis-cli must be on
// PATH) and waits until every node reports cluster_state:ok.
func StartCluster(ctx context.Context, n int) (*RedisCluster, error) {
	if n < 3 {
		return nil, fmt.Errorf("a Redis Cluster needs at least 3 masters, not %d", n)
	}
	path, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, ErrNoRedis
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		return nil, errors.New("redis-cli is not installed (it must be on PATH to create a Redis Cluster)")
	}
	c := &RedisCluster{}
	ok := false
	defer func() {
		if !ok {
			c.Stop()
		}
	}()
	for range n {
		dir, err := os.MkdirTemp("", "llm-bulkhead-redis-")
		if err != nil {
			return nil, err
		}
		node, err := startRetrying(ctx, path, dir, func(port int) ([]string, error) {
			// The cluster bus gets a free port of its own: the default, port+10000, may be taken
			// or beyond 65535.
			bus, err := freePort()
			if err != nil {
				return nil, err
			}
			return []string{"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(dir, "nodes-"+strconv.Itoa(port)+".conf"),
				"--cluster-node-timeout", "2000", "--cluster-port", strconv.Itoa(bus)}, nil
		})
		if err != nil {
			return nil, err
		}
		c.Nodes = append(c.Nodes, node)
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	args := append(append([]string{"--cluster", "create"}, c.Addrs()...), "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.CommandContext(cctx, cli, args...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("redis-cli %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	for _, node := range c.Nodes {
		var info string
		for {
			info, err = node.client.ClusterInfo(cctx).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if cctx.Err() != nil {
				return nil, fmt.Errorf("cluster node %s not ready: %v\n%s", node.Addr, err, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	ok = true
	return c, nil
}

// Addrs returns the nodes' addresses.
func (c *RedisCluster) Addrs() []string {
	out := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		out[i] = n.Addr
	}
	return out
}

// Mode returns "cluster".
func (c *RedisCluster) Mode() string { return "cluster" }

// ReadCommands adds up the nodes' command counters.
func (c *RedisCluster) ReadCommands(ctx context.Context) (Commands, error) {
	sum := Commands{Calls: map[string]int64{}, Usec: map[string]int64{}}
	for _, n := range c.Nodes {
		one, err := n.ReadCommands(ctx)
		if err != nil {
			return sum, fmt.Errorf("cluster node %s: %w", n.Addr, err)
		}
		sum = sum.Add(one)
	}
	return sum, nil
}

// CPU adds up the nodes' CPU time.
func (c *RedisCluster) CPU() (time.Duration, error) {
	var sum time.Duration
	for _, n := range c.Nodes {
		d, err := n.CPU()
		if err != nil {
			return 0, fmt.Errorf("cluster node %s: %w", n.Addr, err)
		}
		sum += d
	}
	return sum, nil
}

// Stop shuts every node down.
func (c *RedisCluster) Stop() {
	for _, n := range c.Nodes {
		n.Stop()
	}
}
