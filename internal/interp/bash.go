package interp

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cagehq/cage/internal/interp/jupyter"
)

func bashLanguage() Language {
	return Language{
		Start: func(ctx context.Context, cwd string) (Kernel, error) {
			k := &bashKernel{cwd: cwd}
			if err := k.start(); err != nil {
				return nil, err
			}
			return k, nil
		},
		Missing: func() string { return missingCommand("bash", "bash") },
	}
}

// bashKernel is a context on one bash process, which keeps variables,
// functions and the working directory between runs. Each run's code is
// sourced from a file (its stdin is /dev/null); an interrupt returns from
// it. Bash reads the commands that source the runs from its fd 3, and
// reports each run's exit status on fd 4 after marking the end of the
// run's output on stdout and stderr.
type bashKernel struct {
	cwd string
	dir string // private: the cell files

	mu    sync.Mutex
	p     *childProc
	seq   int
	count int
}

func (k *bashKernel) start() error {
	if k.dir == "" {
		dir, err := os.MkdirTemp("", "cage-bash-")
		if err != nil {
			return err
		}
		k.dir = dir
	}
	var nonce [8]byte
	_, _ = rand.Read(nonce[:])
	mark := []byte("\x1e" + hex.EncodeToString(nonce[:]) + ":")
	p, err := startChild(exec.Command("bash", "--norc", "--noprofile", "/dev/fd/3"), k.cwd, mark)
	if err != nil {
		return fmt.Errorf("start bash: %w", err)
	}
	// An interrupt (SIGINT to the group) returns from the run's source.
	if _, err := p.req.Write([]byte("trap 'return 130 2>/dev/null' INT\n")); err != nil {
		p.kill()
		return fmt.Errorf("start bash: %w", p.exitError())
	}
	k.mu.Lock()
	k.p, k.count = p, 0
	k.mu.Unlock()
	return nil
}

// quote is s as one bash word.
func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// bashEnv exports env for one run and puts back what was there after it.
func bashEnv(env map[string]string) (set, restore string) {
	names := make([]string, 0, len(env))
	for k := range env {
		names = append(names, k)
	}
	sort.Strings(names)
	var s, r strings.Builder
	for _, k := range names {
		fmt.Fprintf(&s, "if [ -n \"${%[1]s+x}\" ]; then __cage_had_%[1]s=1; __cage_old_%[1]s=$%[1]s; else __cage_had_%[1]s=; fi; export %[1]s=%[2]s\n", k, quote(env[k]))
		fmt.Fprintf(&r, "if [ -n \"$__cage_had_%[1]s\" ]; then export %[1]s=\"$__cage_old_%[1]s\"; else unset %[1]s; fi; unset __cage_had_%[1]s __cage_old_%[1]s\n", k)
	}
	return s.String(), r.String()
}

func (k *bashKernel) Execute(ctx context.Context, code string, env map[string]string, out Output) error {
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
	cell := filepath.Join(k.dir, "cell-"+strconv.Itoa(id)+".sh")
	if err := os.WriteFile(cell, []byte(code), 0o600); err != nil {
		return err
	}
	defer os.Remove(cell)
	set, restore := bashEnv(env)
	mk := fmt.Sprintf(`printf '%%s%d\036' %s`, id, quote(string(p.mark)))
	cmd := fmt.Sprintf("%s{ source %s; } 3<&- 4>&- </dev/null\n__cage_rc=$?\n%s%s; %s >&2; printf '%d %%d\\n' \"$__cage_rc\" >&4\n",
		set, quote(cell), restore, mk, mk, id)
	out.Count(count)
	p.setOutput(out)
	defer p.setOutput(nil)
	if _, err := p.req.Write([]byte(cmd)); err != nil {
		return p.exitError()
	}
	rc, marks := -1, 0
	interrupt := ctx.Done()
	var grace, repeat <-chan time.Time
	for rc < 0 || marks < 2 {
		select {
		case line, ok := <-p.msgs:
			if !ok {
				return p.exitError()
			}
			var seq, status int
			if n, _ := fmt.Sscanf(string(line), "%d %d", &seq, &status); n == 2 && seq == id {
				rc = status
			}
		case m := <-p.marks:
			if m.seq == id {
				marks++
			}
		case <-p.done:
			return p.exitError()
		case <-interrupt:
			// Again every so often: a SIGINT that reaches bash while it
			// forks a command is kept for when that command ends.
			interrupt = nil
			p.signal(syscall.SIGINT)
			again := time.NewTicker(250 * time.Millisecond)
			defer again.Stop()
			repeat = again.C
			grace = time.After(jupyter.InterruptGrace)
		case <-repeat:
			p.signal(syscall.SIGINT)
		case <-grace:
			return jupyter.ErrNotInterrupted
		}
	}
	if rc != 0 {
		out.Error("CommandExitError", "exit status "+strconv.Itoa(rc), "")
	}
	return nil
}

func (k *bashKernel) Restart(ctx context.Context) error {
	_ = k.stop()
	return k.start()
}

func (k *bashKernel) stop() error {
	k.mu.Lock()
	p := k.p
	k.p = nil
	k.mu.Unlock()
	if p != nil {
		p.kill()
	}
	return nil
}

func (k *bashKernel) Close() error {
	_ = k.stop()
	return os.RemoveAll(k.dir)
}

func (k *bashKernel) Exited() error {
	k.mu.Lock()
	p := k.p
	k.mu.Unlock()
	if p == nil {
		return jupyter.ErrRestarted
	}
	return p.exited()
}
