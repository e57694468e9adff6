package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/client"
)

// What the audit trail costs the API, measured against a daemon that
// keeps none (config audit.disabled), in the same run: create -> first
// output through the API and the proxy, interleaved sample by sample, and
// another tenant's API calls while a sandbox runs commands in a loop.

// ttiOnce is one sample of time to interactive: create through the API,
// `echo ready` through the proxy, the first byte of its output; then kill.
func ttiOnce(ctx context.Context, c *client.Client) (time.Duration, error) {
	start := time.Now()
	sb, err := c.Create(ctx, hostSandbox(120))
	if err != nil {
		return 0, err
	}
	defer c.Kill(ctx, sb.SandboxID)
	ac, err := c.Agent(sb.SandboxID, sb.EnvdAccessToken)
	if err != nil {
		return 0, err
	}
	defer ac.Close()
	fw := &firstWrite{start: start}
	end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"ready"}, Stdout: fw, Stderr: io.Discard})
	if err == nil {
		err = fw.check(end.GetExitCode())
	}
	return fw.at, err
}

// InterleavedTTI takes runs samples of time to interactive from each
// daemon, one after the other in turn (the order swapped each round, so
// that neither always follows the other), after three of each to warm up.
func InterleavedTTI(ctx context.Context, a, b *client.Client, runs int) (stats.Stats, stats.Stats, error) {
	var sa, sb []time.Duration
	for i := -3; i < runs; i++ {
		first, second := a, b
		if i%2 != 0 {
			first, second = b, a
		}
		d1, err := ttiOnce(ctx, first)
		if err != nil {
			return stats.Stats{}, stats.Stats{}, err
		}
		d2, err := ttiOnce(ctx, second)
		if err != nil {
			return stats.Stats{}, stats.Stats{}, err
		}
		if i < 0 {
			continue
		}
		if first == a {
			sa, sb = append(sa, d1), append(sb, d2)
		} else {
			sa, sb = append(sa, d2), append(sb, d1)
		}
	}
	return stats.Summarize(sa), stats.Summarize(sb), nil
}

// Tenant is one daemon's pair of clients for LoopLoad: the one whose
// sandbox runs the loop, and another tenant's whose API calls are timed.
type Tenant struct{ Loop, Other *client.Client }

// loopSide is one daemon's sandboxes and samples in LoopLoad.
type loopSide struct {
	t         Tenant
	ac        *agentclient.Client
	bystander string
	samples   []time.Duration
	took      time.Duration
}

// LoopLoad runs n commands (`true`) in a sandbox of each tenant's daemon,
// workers at a time through the proxy, in chunks taken in turn (so that
// what else the host does weighs on both alike); while a chunk runs, the
// other tenant's GET /sandboxes/{id} on that daemon is timed every 10 ms.
// It returns each daemon's latencies and commands a second.
func LoopLoad(ctx context.Context, a, b Tenant, n, workers, chunk int) ([2]stats.Stats, [2]float64, error) {
	var st [2]stats.Stats
	var rate [2]float64
	sides := [2]*loopSide{{t: a}, {t: b}}
	for _, s := range sides {
		sb, err := s.t.Loop.Create(ctx, hostSandbox(900))
		if err != nil {
			return st, rate, err
		}
		defer s.t.Loop.Kill(ctx, sb.SandboxID)
		by, err := s.t.Other.Create(ctx, hostSandbox(900))
		if err != nil {
			return st, rate, err
		}
		defer s.t.Other.Kill(ctx, by.SandboxID)
		if s.ac, err = s.t.Loop.Agent(sb.SandboxID, sb.EnvdAccessToken); err != nil {
			return st, rate, err
		}
		defer s.ac.Close()
		s.bystander = by.SandboxID
	}
	for done := 0; done < n; done += chunk {
		for _, s := range sides {
			if err := s.chunk(ctx, min(chunk, n-done), workers); err != nil {
				return st, rate, err
			}
		}
	}
	for i, s := range sides {
		st[i], rate[i] = stats.Summarize(s.samples), float64(n)/s.took.Seconds()
	}
	return st, rate, nil
}

// chunk runs n commands, workers at a time, timing the bystander's calls.
func (s *loopSide) chunk(ctx context.Context, n, workers int) error {
	var firstErr error
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < workers; w++ {
		wg.Go(func() {
			for i := w; i < n; i += workers {
				end, err := s.ac.Run(ctx, agentclient.RunOptions{Cmd: "true", Stdout: io.Discard, Stderr: io.Discard})
				if err == nil && end.GetExitCode() != 0 {
					err = errors.New("true failed")
				}
				if err != nil {
					mu.Lock()
					firstErr = err
					mu.Unlock()
					return
				}
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-done:
			s.took += time.Since(start)
			return firstErr
		case <-tick.C:
			t0 := time.Now()
			if _, err := s.t.Other.Get(ctx, s.bystander); err != nil {
				<-done
				return err
			}
			s.samples = append(s.samples, time.Since(t0))
		}
	}
}

// NewKey makes another API key in the daemon's data directory with exe
// (`cage keys create`), for a second tenant.
func (d *Daemon) NewKey(exe string) (string, error) {
	out, err := exec.Command(exe, "keys", "create", "--data", d.data).Output()
	if err != nil {
		return "", fmt.Errorf("keys create: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1], nil
}
