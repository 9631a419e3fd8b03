package cluster

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// A replica's first burst of requests must cost Redis what any later burst does. Two things make
// a cold client slower: each script is run by its SHA, and a Redis that does not have it yet (a
// fresh start, a restart, a failover, SCRIPT FLUSH) answers NOSCRIPT, so every call in flight
// sends the whole script again (tens of kilobytes each, compiled once); and the connection pool
// opens a connection, with its handshake, for each call that finds none idle. On a burst of
// concurrent admissions both land on the request's path at once and push admissions past
// cluster.timeout. So before every registration (the first, and each after Redis was
// unreachable or lost its state) the store loads its scripts and opens its pool, and a NOSCRIPT
// met while it runs has the scripts loaded again at once.

// scriptSources returns the scripts a store runs in its admission mode: those its own loops and
// the usage and spend tables use, and exact admission's per request or leased admission's per
// round.
func scriptSources(leased bool) []string {
	src := []string{luaHeartbeat, luaResync, luaLeave, luaRepair, luaSettle, luaUsageFlush, luaUsageRead,
		luaSpendAdd, luaSpendCarry, luaQuota}
	if leased {
		return append(src, luaLease, luaEpoch, luaSpendLease)
	}
	return append(src, luaAdmit, luaPeek, luaSpendReserve, luaSpendSettle)
}

// prepare loads the store's scripts into Redis (every master, in a Redis Cluster) and, with
// warm, opens its connection pool, within the write timeout. It returns an error only when Redis
// could not be reached: then nothing is warmed, and the registration fails as it would have. A
// Redis that refuses SCRIPT LOAD (an ACL may) still runs scripts sent whole: that is logged once.
func (s *Store) prepare(warm bool) error {
	ctx, cancel := context.WithTimeout(s.ctx, s.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	var refused error
	err := s.eachNode(ctx, func(ctx context.Context, c *redis.Client) error {
		// A ping first: a Redis that refuses this client (a password missing or wrong) says
		// so to it, where it may close the connection on the scripts' tens of kilobytes
		// before reading a command.
		if err := c.Ping(ctx).Err(); err != nil {
			if strings.Contains(err.Error(), "NOPERM") {
				// An ACL that allows the scripts only: they are sent whole on first use.
				refused = err
				return nil
			}
			return err
		}
		pipe := c.Pipeline()
		for _, sc := range s.scripts {
			pipe.ScriptLoad(ctx, sc)
		}
		_, err := pipe.Exec(ctx)
		var re redis.Error
		if errors.As(err, &re) {
			refused, err = err, nil
		}
		if err == nil && warm {
			s.warm(ctx, c)
		}
		return err
	})
	if s.ctx.Err() != nil {
		return err
	}
	s.met.observe("prepare", start, errors.Join(err, refused))
	if refused != nil && !s.refusedLoad.Swap(true) {
		s.log.Warn("Redis refused to load the scripts ahead: each is sent whole on its first call after Redis starts",
			"replica", s.o.ReplicaID, "error", refused)
	}
	return err
}

// eachNode calls f for every node scripts run on: the server, the sentinels' master, or every
// master of a Redis Cluster.
func (s *Store) eachNode(ctx context.Context, f func(context.Context, *redis.Client) error) error {
	switch c := s.client.(type) {
	case *redis.ClusterClient:
		return c.ForEachMaster(ctx, f)
	case *redis.Client:
		return f(ctx, c)
	}
	return nil
}

// warm opens c's pool to its size: one ping per connection the pool may hold, all at once, so
// that each finds no idle connection and opens one (completing its handshake), which then stays
// idle in the pool. A ping that failed on a connection Redis closed (a restart) drops it and
// pings again; one that finished before the last started lets another reuse its connection: up
// to five rounds make up for those.
func (s *Store) warm(ctx context.Context, c *redis.Client) {
	size := c.Options().PoolSize
	for range 5 {
		if ctx.Err() != nil || int(c.PoolStats().TotalConns) >= size {
			return
		}
		var wg sync.WaitGroup
		for range size {
			wg.Go(func() {
				if c.Ping(ctx).Err() != nil && ctx.Err() == nil {
					_ = c.Ping(ctx).Err()
				}
			})
		}
		wg.Wait()
	}
}

// run runs sc as redis.Script.Run does (by its SHA, sent whole when Redis does not have it), and
// has every script loaded again when Redis did not have this one.
func (s *Store) run(ctx context.Context, sc *redis.Script, keys []string, args ...any) *redis.Cmd {
	r := sc.EvalSha(ctx, s.client, keys, args...)
	if isNoScript(r.Err()) {
		s.scriptsLost()
		return sc.Eval(ctx, s.client, keys, args...)
	}
	return r
}

// scriptsLost asks the heartbeat loop to load the scripts again: Redis answered NOSCRIPT.
func (s *Store) scriptsLost() {
	select {
	case s.reload <- struct{}{}:
	default:
	}
}
