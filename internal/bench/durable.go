package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/client"
)

// PauseFigures are pause and resume on one wall with a given amount of
// touched memory.
type PauseFigures struct {
	Wall    string
	Touched int64
	// With memory (frozen): pause and resume through the API.
	Pause, Resume stats.Stats
	// Host memory the paused sandbox holds (its cgroup's charge: a frozen
	// one's memory stays; a checkpointed one has no process, and a
	// microvm none of its cgroup either), mean over runs.
	PausedBytes int64
	// PausedWith is how it was paused with memory (memory: frozen;
	// checkpoint: saved to disk), and CheckpointBytes the size on disk of
	// a checkpoint, mean over runs.
	PausedWith      string
	CheckpointBytes int64
	// Without memory (files): pause (files saved, sandbox destroyed) and
	// resume (started again, files restored); the saved files' size.
	PauseFiles, ResumeFiles stats.Stats
	FilesBytes              int64
}

// Pause measures pause and resume on wall (template "" is host) with touched
// bytes of memory held by a process, runs times each way.
func Pause(ctx context.Context, d *Daemon, wall, template string, touched int64, runs int) (PauseFigures, error) {
	f := PauseFigures{Wall: wall, Touched: touched}
	if template == "" {
		template = "host"
	}
	c := d.Client()
	cg, err := cgroups.Detect("cage")
	if err != nil {
		return f, err
	}
	memMB := touched>>20 + 256
	var pause, resume, pauseF, resumeF []time.Duration
	var held, saved, ckpt int64
	for i := 0; i < runs; i++ {
		sb, err := touchedSandbox(ctx, c, wall, template, memMB, touched)
		if err != nil {
			return f, err
		}
		t0 := time.Now()
		err = c.Pause(ctx, sb.SandboxID, true)
		pause = append(pause, time.Since(t0))
		if err == nil {
			if u, uerr := cg.Open(sb.SandboxID).Usage(); uerr == nil {
				held += u.MemoryBytes
			}
			if info, gerr := c.Get(ctx, sb.SandboxID); gerr == nil {
				f.PausedWith = string(info.PausedWith)
			}
			ckpt += dirBytes(filepath.Join(d.data, "checkpoints", sb.SandboxID))
			t0 = time.Now()
			_, err = c.Resume(ctx, sb.SandboxID, 300)
			resume = append(resume, time.Since(t0))
		}
		if err == nil {
			t0 = time.Now()
			err = c.Pause(ctx, sb.SandboxID, false)
			pauseF = append(pauseF, time.Since(t0))
		}
		if err == nil {
			if fi, serr := os.Stat(filepath.Join(d.data, "paused", sb.SandboxID+".tar")); serr == nil {
				saved += fi.Size()
			}
			t0 = time.Now()
			_, err = c.Resume(ctx, sb.SandboxID, 300)
			resumeF = append(resumeF, time.Since(t0))
		}
		_ = c.Kill(ctx, sb.SandboxID)
		if err != nil {
			return f, fmt.Errorf("%s, %d MiB touched: %w", wall, touched>>20, err)
		}
	}
	f.Pause, f.Resume = stats.Summarize(pause), stats.Summarize(resume)
	f.PauseFiles, f.ResumeFiles = stats.Summarize(pauseF), stats.Summarize(resumeF)
	f.PausedBytes, f.FilesBytes, f.CheckpointBytes = held/int64(runs), saved/int64(runs), ckpt/int64(runs)
	return f, nil
}

// dirBytes is the disk space the files of dir take (0 when there is none).
func dirBytes(dir string) int64 {
	var n int64
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
	}
	return n
}

// touchedSandbox creates a sandbox whose process holds touched bytes of
// written memory, and returns once it does.
func touchedSandbox(ctx context.Context, c *client.Client, wall, template string, memMB, touched int64) (*types.Sandbox, error) {
	timeout := int64(600)
	sb, err := c.Create(ctx, types.NewSandboxV2{TemplateID: template, Timeout: &timeout, Wall: types.Wall(wall), MemoryMB: memMB})
	if err != nil {
		return nil, err
	}
	ac, err := c.Agent(sb.SandboxID, sb.EnvdAccessToken)
	if err != nil {
		_ = c.Kill(ctx, sb.SandboxID)
		return nil, err
	}
	defer ac.Close()
	script := `nohup python3 -c "import time; b = b'\x01' * ` + strconv.FormatInt(touched, 10) +
		`; open('/tmp/touched', 'w').close(); time.sleep(3600)" >/dev/null 2>&1 &
for i in $(seq 600); do [ -e /tmp/touched ] && exit 0; sleep 0.1; done; exit 1`
	end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", script}, Stdout: io.Discard, Stderr: io.Discard})
	if err == nil && end.GetExitCode() != 0 {
		err = fmt.Errorf("the memory toucher did not start (exit %d)", end.GetExitCode())
	}
	if err != nil {
		_ = c.Kill(ctx, sb.SandboxID)
		return nil, err
	}
	return sb, nil
}

// Fork measures E2B's fork of n sandboxes from a running sandbox (one
// snapshot, n sandboxes from it): from the fork's request to the first
// output of all n.
func Fork(ctx context.Context, c *client.Client, wall, template string, n, runs int) (stats.Stats, error) {
	if template == "" {
		template = "host"
	}
	timeout := int64(300)
	var samples []time.Duration
	for r := 0; r < runs; r++ {
		src, err := c.Create(ctx, types.NewSandboxV2{TemplateID: template, Timeout: &timeout, Wall: types.Wall(wall)})
		if err != nil {
			return stats.Stats{}, err
		}
		start := time.Now()
		forks, err := c.Fork(ctx, src.SandboxID, int32(n), int32(timeout))
		ids := []string{src.SandboxID}
		errs := make([]error, len(forks))
		var wg sync.WaitGroup
		for i, f := range forks {
			if f.Error.Code != 0 {
				errs[i] = fmt.Errorf("fork %d: %s", i+1, f.Error.Message)
				continue
			}
			ids = append(ids, f.Sandbox.SandboxID)
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = firstOutput(ctx, c, f.Sandbox, start)
			}()
		}
		wg.Wait()
		samples = append(samples, time.Since(start))
		for _, id := range ids {
			_ = c.Kill(ctx, id)
		}
		if err != nil {
			return stats.Stats{}, err
		}
		for _, err := range errs {
			if err != nil {
				return stats.Stats{}, err
			}
		}
	}
	return stats.Summarize(samples), nil
}

// firstOutput runs echo in sb and waits for its output.
func firstOutput(ctx context.Context, c *client.Client, sb types.Sandbox, start time.Time) error {
	ac, err := c.Agent(sb.SandboxID, sb.EnvdAccessToken)
	if err != nil {
		return err
	}
	defer ac.Close()
	fw := &firstWrite{start: start}
	end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"ready"}, Stdout: fw, Stderr: io.Discard})
	if err != nil {
		return err
	}
	return fw.check(end.GetExitCode())
}
