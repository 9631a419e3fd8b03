package fleet

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
)

// Replica is one llm-bulkhead process of a fleet.
type Replica struct {
	// ID is the replica's cluster.replica_id (and its name in messages).
	ID string
	*bench.Process
}

// startTimeout bounds a replica's start (it waits for its first registration in Redis).
const startTimeout = time.Minute

// StartReplicas starts n replicas at once, replica i as spec(i) says (Spec.Name is its id), and
// waits until every one listens. When one fails, the others are stopped.
func StartReplicas(n int, spec func(i int) bench.Spec) ([]*Replica, error) {
	rs := make([]*Replica, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			s := spec(i)
			p, err := bench.StartProcess(s, startTimeout)
			if err != nil {
				errs[i] = fmt.Errorf("replica %s: %w", s.Name, err)
				return
			}
			rs[i] = &Replica{ID: s.Name, Process: p}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		_ = StopReplicas(rs)
		return nil, err
	}
	return rs, nil
}

// StopReplicas stops every replica at once with SIGTERM (each drains, then gives its shared
// slots back) and returns their exit errors. Nil entries are skipped.
func StopReplicas(rs []*Replica) error {
	errs := make([]error, len(rs))
	var wg sync.WaitGroup
	for i, r := range rs {
		if r == nil {
			continue
		}
		wg.Go(func() { errs[i] = r.Stop() })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// metricsClient keeps no connection open: a replica may stop right after it is read.
var metricsClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

// Metrics fetches the replica's /metrics.
func (r *Replica) Metrics(ctx context.Context) (Metrics, error) {
	b, err := r.get(ctx, "/metrics")
	if err != nil {
		return nil, err
	}
	return ParseMetrics(b), nil
}

// ClusterView is what GET /admin/cluster says of leased admission.
type ClusterView struct {
	Admission string              `json:"admission"`
	Available bool                `json:"available"`
	Leases    []cluster.LeaseInfo `json:"leases"`
}

// Lease returns the lease of compartment name (the zero LeaseInfo when the replica holds none).
func (v ClusterView) Lease(name string) cluster.LeaseInfo {
	for _, l := range v.Leases {
		if l.Compartment == name {
			return l
		}
	}
	return cluster.LeaseInfo{Compartment: name}
}

// Cluster fetches the replica's GET /admin/cluster. It costs the replica a call to Redis.
func (r *Replica) Cluster(ctx context.Context) (ClusterView, error) {
	var v ClusterView
	return v, r.getJSON(ctx, "/admin/cluster", &v)
}

// Compartment is one compartment of GET /admin/compartments.
type Compartment struct {
	Name          string `json:"name"`
	InFlight      int64  `json:"in_flight"`
	MaxConcurrent int64  `json:"max_concurrent"`
	Queued        int    `json:"queued"`
}

// Compartments fetches the replica's GET /admin/compartments.
func (r *Replica) Compartments(ctx context.Context) ([]Compartment, error) {
	var v struct {
		Compartments []Compartment `json:"compartments"`
	}
	err := r.getJSON(ctx, "/admin/compartments", &v)
	return v.Compartments, err
}

func (r *Replica) getJSON(ctx context.Context, path string, v any) error {
	b, err := r.get(ctx, path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("replica %s: GET %s: %w", r.ID, path, err)
	}
	return nil
}

// get fetches path from the replica's admin server.
func (r *Replica) get(ctx context.Context, path string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+r.AdminAddr+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := metricsClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("replica %s: GET %s: %s", r.ID, path, resp.Status)
	}
	return io.ReadAll(io.LimitReader(resp.Body, 32<<20))
}

// Metrics are the samples of a Prometheus text exposition.
type Metrics []Sample

// Sample is one line of an exposition: a name, its labels and a value.
type Sample struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// ParseMetrics reads the Prometheus text format; comments and lines it cannot read are skipped.
func ParseMetrics(text []byte) Metrics {
	var out Metrics
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		s := Sample{Labels: map[string]string{}}
		rest := line
		if i := strings.IndexAny(line, "{ "); i >= 0 && line[i] == '{' {
			s.Name = line[:i]
			j := strings.LastIndexByte(line, '}')
			if j < i {
				continue
			}
			if !parseLabels(line[i+1:j], s.Labels) {
				continue
			}
			rest = line[j+1:]
		} else if i >= 0 {
			s.Name, rest = line[:i], line[i:]
		} else {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		s.Value = v
		out = append(out, s)
	}
	return out
}

// parseLabels reads `a="x",b="y"` (values may hold escaped quotes) into m.
func parseLabels(s string, m map[string]string) bool {
	for s != "" {
		k, rest, ok := strings.Cut(s, "=")
		if !ok || !strings.HasPrefix(rest, `"`) {
			return false
		}
		rest = rest[1:]
		var v strings.Builder
		i := 0
		for ; i < len(rest); i++ {
			c := rest[i]
			if c == '\\' && i+1 < len(rest) {
				i++
				switch rest[i] {
				case 'n':
					v.WriteByte('\n')
				default:
					v.WriteByte(rest[i])
				}
				continue
			}
			if c == '"' {
				break
			}
			v.WriteByte(c)
		}
		if i >= len(rest) {
			return false
		}
		m[strings.TrimSpace(k)] = v.String()
		s = strings.TrimPrefix(strings.TrimSpace(rest[i+1:]), ",")
	}
	return true
}

// matches reports whether s has every label of match (pairs of name, value).
func (s Sample) matches(name string, match []string) bool {
	if s.Name != name {
		return false
	}
	for i := 0; i+1 < len(match); i += 2 {
		if s.Labels[match[i]] != match[i+1] {
			return false
		}
	}
	return true
}

// Sum adds the values of the samples named name with the labels match gives (pairs of name,
// value).
func (m Metrics) Sum(name string, match ...string) float64 {
	var v float64
	for _, s := range m {
		if s.matches(name, match) {
			v += s.Value
		}
	}
	return v
}

// Histogram returns the cumulative buckets of histogram name (without _bucket) for the samples
// with the labels match gives.
func (m Metrics) Histogram(name string, match ...string) Buckets {
	var out Buckets
	for _, s := range m {
		if !s.matches(name+"_bucket", match) {
			continue
		}
		le, err := strconv.ParseFloat(s.Labels["le"], 64)
		if err != nil {
			continue
		}
		if i := slices.IndexFunc(out, func(b Bucket) bool { return b.LE == le }); i >= 0 {
			out[i].Count += s.Value
		} else {
			out = append(out, Bucket{LE: le, Count: s.Value})
		}
	}
	slices.SortFunc(out, func(a, b Bucket) int {
		switch {
		case a.LE < b.LE:
			return -1
		case a.LE > b.LE:
			return 1
		}
		return 0
	})
	return out
}

// Bucket is a cumulative histogram bucket: Count observations at or below LE.
type Bucket struct {
	LE    float64
	Count float64
}

// Buckets are a histogram's buckets in ascending order of LE, the last one +Inf.
type Buckets []Bucket

// Sub returns b minus before, bucket by bucket (the buckets of one histogram at two times).
func (b Buckets) Sub(before Buckets) Buckets {
	out := slices.Clone(b)
	for i := range out {
		for _, o := range before {
			if o.LE == out[i].LE {
				out[i].Count -= o.Count
			}
		}
	}
	return out
}

// Count is the number of observations.
func (b Buckets) Count() float64 {
	if len(b) == 0 {
		return 0
	}
	return b[len(b)-1].Count
}

// Quantile estimates the q-quantile as Prometheus's histogram_quantile does: linear
// interpolation inside the bucket holding it (from 0 for the first bucket). A quantile in the
// +Inf bucket returns the highest finite bound. NaN without observations.
func (b Buckets) Quantile(q float64) float64 {
	n := b.Count()
	if n <= 0 {
		return math.NaN()
	}
	rank := q * n
	lower, prev := 0.0, 0.0
	for _, bk := range b {
		if bk.Count >= rank {
			if math.IsInf(bk.LE, 1) {
				return lower
			}
			if bk.Count == prev {
				return bk.LE
			}
			return lower + (bk.LE-lower)*(rank-prev)/(bk.Count-prev)
		}
		lower, prev = bk.LE, bk.Count
	}
	return lower
}
