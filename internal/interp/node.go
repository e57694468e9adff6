package interp

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/cagehq/cage/internal/interp/jupyter"
)

//go:embed nodekernel.js
var nodeKernelJS string

// NodeStartTimeout bounds a Node.js kernel's start.
var NodeStartTimeout = time.Minute

func nodeLanguage(typescript bool) Language {
	return Language{
		Start: func(ctx context.Context, cwd string) (Kernel, error) {
			k := &nodeKernel{ts: typescript, cwd: cwd}
			if err := k.start(ctx); err != nil {
				return nil, err
			}
			return k, nil
		},
		Missing: func() string { return missingCommand("node", "nodejs") },
	}
}

// nodeKernel is a context on cage's Node.js kernel (nodekernel.js).
type nodeKernel struct {
	ts  bool
	cwd string

	mu    sync.Mutex
	p     *childProc
	seq   int
	count int
}

// nodeMsg is one message of the kernel (see nodekernel.js).
type nodeMsg struct {
	ID         *int                       `json:"id"`
	Type       string                     `json:"type"`
	Text       string                     `json:"text"`
	Data       map[string]json.RawMessage `json:"data"`
	Name       string                     `json:"name"`
	Value      string                     `json:"value"`
	Traceback  string                     `json:"traceback"`
	TypeScript bool                       `json:"typescript"`
	SIGINT     bool                       `json:"sigint"`
}

func (k *nodeKernel) start(ctx context.Context) error {
	p, err := startChild(exec.Command("node", "-e", nodeKernelJS), k.cwd, nil)
	if err != nil {
		return fmt.Errorf("start the Node.js kernel: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, NodeStartTimeout)
	defer cancel()
	select {
	case line, ok := <-p.msgs:
		var m nodeMsg
		if !ok || json.Unmarshal(line, &m) != nil || m.Type != "ready" {
			p.kill()
			return fmt.Errorf("the Node.js kernel did not start: %w", p.exitError())
		}
		if k.ts && !m.TypeScript {
			p.kill()
			return errors.New("TypeScript is not installed in this sandbox (Debian package node-typescript)")
		}
	case <-ctx.Done():
		p.kill()
		return fmt.Errorf("the Node.js kernel did not start: %w", ctx.Err())
	}
	k.mu.Lock()
	k.p, k.count = p, 0
	k.mu.Unlock()
	return nil
}

func (k *nodeKernel) Execute(ctx context.Context, code string, env map[string]string, out Output) error {
	k.mu.Lock()
	p := k.p
	k.seq++
	k.count++
	id, count := k.seq, k.count
	k.mu.Unlock()
	if p == nil {
		return jupyter.ErrRestarted
	}
	if err := p.exited(); err != nil {
		return err
	}
	req, _ := json.Marshal(map[string]any{"id": id, "code": code, "env": env, "ts": k.ts})
	out.Count(count)
	p.setOutput(out)
	defer p.setOutput(nil)
	if _, err := p.req.Write(append(req, '\n')); err != nil {
		return p.exitError()
	}
	interrupt, interrupted := ctx.Done(), false
	var grace, signal <-chan time.Time
	for {
		select {
		case line, ok := <-p.msgs:
			if !ok {
				return p.exitError()
			}
			var m nodeMsg
			if json.Unmarshal(line, &m) != nil || m.ID == nil || *m.ID != id {
				continue
			}
			switch m.Type {
			case "stdout", "stderr":
				out.Stream(m.Type, m.Text, time.Now())
			case "result":
				out.Result(m.Data, true)
			case "error":
				out.Error(m.Name, m.Value, m.Traceback)
			case "done":
				if interrupted && !m.SIGINT {
					p.awaitSIGINT()
				}
				return nil
			}
		case <-p.done:
			return p.exitError()
		case <-interrupt:
			// A run waiting on a promise stops at the message; one that
			// never yields needs the SIGINT, sent only if the message
			// did not do (a SIGINT Node takes after the run ends may
			// break the next one).
			interrupt = nil
			_, _ = p.req.Write([]byte(fmt.Sprintf("{\"interrupt\":%d}\n", id)))
			signal = time.After(signalAfter)
			grace = time.After(jupyter.InterruptGrace)
		case <-signal:
			interrupted = true
			p.signal(syscall.SIGINT)
		case <-grace:
			return jupyter.ErrNotInterrupted
		}
	}
}

// signalAfter is how long an interrupted run may take to stop at the
// interrupt message before the kernel gets a SIGINT.
const signalAfter = 200 * time.Millisecond

// awaitSIGINT waits (briefly) until the kernel reports the SIGINT an
// interrupted run ended without: left pending, it would break the next run.
func (p *childProc) awaitSIGINT() {
	timeout := time.After(time.Second)
	for {
		select {
		case line, ok := <-p.msgs:
			var m nodeMsg
			if !ok || (json.Unmarshal(line, &m) == nil && m.Type == "sigint") {
				return
			}
		case <-timeout:
			return
		case <-p.done:
			return
		}
	}
}

func (k *nodeKernel) Restart(ctx context.Context) error {
	k.mu.Lock()
	p := k.p
	k.p = nil
	k.mu.Unlock()
	if p != nil {
		p.kill()
	}
	return k.start(ctx)
}

func (k *nodeKernel) Close() error {
	k.mu.Lock()
	p := k.p
	k.p = nil
	k.mu.Unlock()
	if p != nil {
		p.kill()
	}
	return nil
}

func (k *nodeKernel) Exited() error {
	k.mu.Lock()
	p := k.p
	k.mu.Unlock()
	if p == nil {
		return jupyter.ErrRestarted
	}
	return p.exited()
}
