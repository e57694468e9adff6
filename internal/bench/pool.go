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
// is a create served by the pool, not one racing the pool's refill. It
// also returns how many of the creates found the pool empty all the same
// (they are left out of the figures).
func PooledToFirstOutput(ctx context.Context, h *sandbox.Host, wallName string, runs, warm int) (stats.Stats, int64, error) {
	var samples []time.Duration
	var missed int64
	for i := -warm; i < runs; i++ {
		before, err := waitPoolFull(ctx, h, wallName)
		if err != nil {
			return stats.Stats{}, missed, err
		}
		s, err := WallToFirstOutput(ctx, h, wallName, 1, 0)
		if err != nil {
			return stats.Stats{}, missed, err
		}
		after := poolOf(h, wallName)
		if after.Misses > before.Misses {
			missed++
			continue
		}
		if i >= 0 {
			samples = append(samples, s.P50)
		}
	}
	if len(samples) == 0 {
		return stats.Stats{}, missed, fmt.Errorf("%s: every create found the pool empty", wallName)
	}
	return stats.Summarize(samples), missed, nil
}

func poolOf(h *sandbox.Host, wallName string) sandbox.PoolStat {
	for _, p := range h.PoolStats() {
		if p.Wall == wallName {
			return p
		}
	}
	return sandbox.PoolStat{}
}

// waitPoolFull waits until the wall's pool holds as many sandboxes as it
// keeps, and returns its counters then.
func waitPoolFull(ctx context.Context, h *sandbox.Host, wallName string) (sandbox.PoolStat, error) {
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
