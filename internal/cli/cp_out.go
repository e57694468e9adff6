package cli

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/imgstore"
)

// Copies out of a sandbox. The sandbox (and its agent) may lie about sizes
// and types, send more than it announced, or a tar stream built to escape:
// every byte is counted as it arrives, and nothing reaches its final name
// before the whole copy is in.

const (
	stagePrefix = ".cage-cp-"
	maxTrailer  = 1 << 20 // bytes a tar stream may carry after its end
)

// fileFromSandbox downloads one file into a temporary file beside dst and
// renames it over dst once complete.
func fileFromSandbox(ctx context.Context, ac *agentclient.Client, user, src, dst string, perm os.FileMode, lim cpLimits) (err error) {
	q := url.Values{"path": {src}, "username": {user}}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodGet, agentclient.BaseURL+"/files?"+q.Encode(), nil)
	if err != nil {
		return err
	}
	resp, err := ac.HTTP.Do(hreq)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("download %s: %s", src, oneLineOf(b))
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), stagePrefix+"*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	hw := &imgstore.HoleWriter{F: tmp}
	if _, err := io.CopyBuffer(hw, &cappedReader{r: resp.Body, left: lim.MaxBytes, err: lim.tooBig()}, make([]byte, 256<<10)); err != nil {
		return err
	}
	if err := hw.Finish(); err != nil {
		return err
	}
	if err := tmp.Chmod(perm &^ umask()); err != nil {
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}

// umask is the process's file mode creation mask (022 if unknown).
func umask() os.FileMode {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0o022
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "Umask:"); ok {
			if m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32); err == nil {
				return os.FileMode(m) & 0o777
			}
		}
	}
	return 0o022
}

// dirFromSandbox copies the directory src into dst (made if missing, merged
// into if it is a directory): tar runs in the sandbox, its stream is
// unpacked into a stage inside dst, and the stage's entries are moved into
// dst once all of it is in.
func dirFromSandbox(ctx context.Context, ac *agentclient.Client, user, src, dst string, lim cpLimits) (err error) {
	made := false
	if fi, serr := os.Stat(dst); errors.Is(serr, fs.ErrNotExist) {
		if err := os.Mkdir(dst, 0o755); err != nil {
			return err
		}
		made = true
	} else if serr != nil {
		return serr
	} else if !fi.IsDir() {
		return fmt.Errorf("%s is not a directory", dst)
	}
	stage, err := os.MkdirTemp(dst, stagePrefix+"*")
	if err != nil {
		return err
	}
	defer func() {
		os.RemoveAll(stage)
		if err != nil && made {
			os.Remove(dst)
		}
	}()
	if err := unpackFromSandbox(ctx, ac, user, src, stage, lim); err != nil {
		return err
	}
	root, err := os.OpenRoot(dst)
	if err != nil {
		return err
	}
	defer root.Close()
	return settle(root, filepath.Base(stage))
}

// unpackFromSandbox runs tar in the sandbox and unpacks its output under
// stage. GNU tar is asked for sparse entries (-S), so that holes cross as a
// map rather than as zeros; a tar that does not know -S (busybox) fails
// before it sends anything, and is asked again without it.
func unpackFromSandbox(ctx context.Context, ac *agentclient.Client, user, src, stage string, lim cpLimits) error {
	root, err := os.OpenRoot(stage)
	if err != nil {
		return err
	}
	defer root.Close()
	sent, err := tarFromSandbox(ctx, ac, user, []string{"-c", "-S", "-C", src, "."}, root, lim)
	var te *tarExit
	if !sent && errors.As(err, &te) {
		_, err = tarFromSandbox(ctx, ac, user, []string{"-c", "-C", src, "."}, root, lim)
	}
	if errors.As(err, &te) {
		return fmt.Errorf("tar in the sandbox: %s", te.stderr)
	}
	return err
}

// tarExit is tar in the sandbox failing.
type tarExit struct{ stderr string }

func (e *tarExit) Error() string { return "tar in the sandbox: " + e.stderr }

// tarFromSandbox runs tar with args in the sandbox, unpacking what it
// writes under root; sent says whether any byte came. Should the unpacking
// stop (a bound, a hostile entry), tar is killed rather than left to write
// into a closed pipe.
func tarFromSandbox(ctx context.Context, ac *agentclient.Client, user string, args []string, root *os.Root, lim cpLimits) (sent bool, _ error) {
	pr, pw := io.Pipe()
	cr := &cappedReader{r: pr, left: lim.MaxBytes, err: lim.tooBig()}
	done := make(chan error, 1)
	go func() {
		_, err := untar(root, cr, lim)
		if err == nil {
			// The archive's trailing padding (tar pads to its record size),
			// and no more.
			if n, _ := io.Copy(io.Discard, io.LimitReader(pr, maxTrailer+1)); n > maxTrailer {
				err = fmt.Errorf("the sandbox sent more than %d bytes after the archive's end", maxTrailer)
			}
		}
		if err != nil {
			pr.CloseWithError(fmt.Errorf("unpacking: %w", err)) // tar's output goes nowhere now
		}
		done <- err
	}()
	stderr := &headBuffer{max: 1024}
	var pid uint32
	end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "tar", Args: args,
		User: user, Stdout: pw, Stderr: stderr, OnStart: func(p uint32) { pid = p }})
	pw.CloseWithError(io.EOF)
	uerr := <-done
	sent = cr.left < lim.MaxBytes
	if end == nil && pid != 0 {
		killProcess(ac, user, pid)
	}
	switch {
	case uerr != nil && end.GetTruncated():
		return sent, fmt.Errorf("the archive of %s is larger than the sandbox's output limit; copy its large files one by one", args[len(args)-2])
	case uerr != nil:
		return sent, uerr
	case err != nil:
		return sent, err
	case end.GetExitCode() != 0:
		return sent, &tarExit{oneLineOf(stderr.Bytes())}
	}
	return sent, nil
}

// killProcess sends SIGKILL to a process of the sandbox, at most once and
// without waiting long.
func killProcess(ac *agentclient.Client, user string, pid uint32) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req := connect.NewRequest(&pb.SendSignalRequest{
		Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}, Signal: pb.Signal_SIGNAL_SIGKILL})
	req.Header().Set("Authorization", agentclient.UserHeader(user))
	_, _ = ac.Process.SendSignal(ctx, req)
}

// headBuffer keeps the first max bytes written to it.
type headBuffer struct {
	max int
	bytes.Buffer
}

func (h *headBuffer) Write(p []byte) (int, error) {
	if room := h.max - h.Len(); room > 0 {
		h.Buffer.Write(p[:min(room, len(p))])
	}
	return len(p), nil
}

// settle moves the entries of root/stage into root: a name root lacks is
// renamed into place, a directory on both sides is merged, a file or
// symlink replaces a file or symlink (rename never follows the name it
// replaces). A directory facing a non-directory, either way, is refused
// before anything moves.
func settle(root *os.Root, stage string) error {
	if err := settleDir(root, stage, ".", false); err != nil {
		return err
	}
	return settleDir(root, stage, ".", true)
}

func settleDir(root *os.Root, stage, rel string, apply bool) error {
	d, err := root.Open(path.Join(stage, rel))
	if err != nil {
		return err
	}
	ents, err := d.ReadDir(-1)
	d.Close()
	if err != nil {
		return err
	}
	for _, e := range ents {
		src, dst := path.Join(stage, rel, e.Name()), path.Join(rel, e.Name())
		if dst == stage {
			return fmt.Errorf("refusing entry %q from the sandbox: it names the copy's stage", dst)
		}
		fi, err := root.Lstat(dst)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return err
		case e.IsDir() && fi.IsDir():
			if err := settleDir(root, stage, dst, apply); err != nil {
				return err
			}
			continue
		case e.IsDir() || fi.IsDir():
			return fmt.Errorf("%s: the copy has a directory where the destination has a file, or the other way round; nothing was copied", dst)
		}
		if apply {
			if err := root.Rename(src, dst); err != nil {
				return err
			}
		}
	}
	return nil
}
