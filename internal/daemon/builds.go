package daemon

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"

	"github.com/cagehq/cage/internal/api"
	"github.com/cagehq/cage/internal/build"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
)

// builds runs the control API's template builds (api.BuildFunc) with
// internal/build on the daemon's host: no build context, nothing
// downloaded on the host (FROM debian:... only once made), RUN steps in
// sandboxes with the network the build asks for. stop cancels a running
// build and waits for it to clean up, before the host closes.
type builds struct {
	ctx    context.Context
	cancel context.CancelFunc
	host   *sandbox.Host
	mu     sync.Mutex
	done   bool
	wg     sync.WaitGroup
}

func newBuilds(ctx context.Context, host *sandbox.Host) *builds {
	b := &builds{host: host}
	b.ctx, b.cancel = context.WithCancel(ctx)
	return b
}

func (b *builds) build(jobCtx context.Context, job api.BuildJob, out io.Writer) (string, error) {
	b.mu.Lock()
	if b.done {
		b.mu.Unlock()
		return "", context.Canceled
	}
	b.wg.Add(1)
	b.mu.Unlock()
	defer b.wg.Done()
	// The build ends with the daemon (b.ctx) or when it is cancelled
	// (jobCtx: DELETE of the build).
	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	defer context.AfterFunc(jobCtx, cancel)()
	bd := &build.Builder{Host: b.host, Args: job.Args, Out: out, NoDebootstrap: true, StepTimeout: job.StepTimeout}
	if bd.Args == nil {
		bd.Args = map[string]string{}
	}
	if job.Internet {
		bd.Net = network.Policy{Mode: network.Internet}
	}
	t, err := bd.Build(ctx, strings.NewReader(job.Dockerfile), job.Template, "api build "+job.ID+" by key "+job.KeyID)
	if err != nil {
		if ctx.Err() != nil && !errors.Is(err, context.Canceled) {
			err = errors.Join(err, context.Canceled)
		}
		return "", err
	}
	return t.ID, nil
}

func (b *builds) stop() {
	b.cancel()
	b.mu.Lock()
	b.done = true
	b.mu.Unlock()
	b.wg.Wait()
}
