package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/sandbox"
)

// WallPooler is a host that keeps pools of prepared sandboxes on any wall
// (issue 20's item 2: pools are a driver capability). Measurements of
// pooled creates on the OCI walls and the microvm use it when the host
// has it, and say "not measured" when it does not.
type WallPooler interface {
	AddWallPool(wallName, template string, n int) error
}

// poolFillWait bounds the wait for a pool to be full again between two
// samples (a microvm restore under TCG takes about a second).
const poolFillWait = 60 * time.Second

// PooledToFirstOutput times create -> first output of `echo ready` on a
// wall whose pool on h is full before each sample, so that every sample
// is a create served by the pool, not one racing the pool's refill. A
// create that finds the pool empty all the same (its members were made
// for other creates: with a network, say, which the pool then stops
// making) is left out and tried again; the count of those is returned.
func PooledToFirstOutput(ctx context.Context, h *sandbox.Host, wallName string, runs, warm int) (stats.Stats, int64, error) {
	var samples []time.Duration
	var missed int64
	for i := -warm; i < runs; i++ {
		d, m, err := pooledSample(ctx, h, wallName)
		missed += m
		if err != nil {
			return stats.Stats{}, missed, err
		}
		if i >= 0 {
			samples = append(samples, d)
		}
	}
	return stats.Summarize(samples), missed, nil
}

// PooledToFirstOutputVs is PooledToFirstOutput with a peer sample after
// each of cage's (see Alternate).
func PooledToFirstOutputVs(ctx context.Context, h *sandbox.Host, wallName string, runs, warm int, peer func() (time.Duration, error)) (cage, peers stats.Stats, missed int64, err error) {
	cage, peers, err = Alternate(runs, warm, func() (time.Duration, error) {
		d, m, err := pooledSample(ctx, h, wallName)
		missed += m
		return d, err
	}, peer)
	return cage, peers, missed, err
}

// maxPoolMisses bounds the tries of one pooled sample.
const maxPoolMisses = 5

// pooledSample is one create -> first output served by the wall's full
// pool, with the creates that missed it before.
func pooledSample(ctx context.Context, h *sandbox.Host, wallName string) (time.Duration, int64, error) {
	var missed int64
	for missed < maxPoolMisses {
		before, err := WaitPoolFull(ctx, h, wallName)
		if err != nil {
			return 0, missed, err
		}
		s, err := WallToFirstOutput(ctx, h, wallName, 1, 0)
		if err != nil {
			return 0, missed, err
		}
		if after := poolOf(h, wallName); after.Misses == before.Misses {
			return s.P50, missed, nil
		}
		missed++
	}
	return 0, missed, fmt.Errorf("%s: %d creates in a row found the full pool empty", wallName, missed)
}

func poolOf(h *sandbox.Host, wallName string) sandbox.PoolStat {
	for _, p := range h.PoolStats() {
		if p.Wall == wallName {
			return p
		}
	}
	return sandbox.PoolStat{}
}

// WaitPoolFull waits until the wall's pool holds as many sandboxes as it
// keeps, and returns its counters then.
func WaitPoolFull(ctx context.Context, h *sandbox.Host, wallName string) (sandbox.PoolStat, error) {
	deadline := time.Now().Add(poolFillWait)
	for {
		p := poolOf(h, wallName)
		if p.Size > 0 && p.Ready == p.Size {
			return p, nil
		}
		if time.Now().After(deadline) {
			return p, fmt.Errorf("the %s pool holds %d of %d sandboxes after %v", wallName, p.Ready, p.Size, poolFillWait)
		}
		select {
		case <-ctx.Done():
			return p, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
