package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/units"
)

// cage cp copies files and directories between the host and a daemon's
// sandbox. What comes out of a sandbox is untrusted (cp_out.go): it is
// bounded in bytes and entries, written with its holes as holes, staged
// under a hidden directory beside or in the destination and moved into
// place only once complete (nothing half-written is left, even on an
// interrupt), and a directory's tar stream is unpacked with os.Root, so no
// entry (a "..", an absolute name, a symlink planted to be written through,
// a hard link) lands outside the destination.

func newCpCmd(d *daemonFlags) *cobra.Command {
	var user, maxBytes string
	var maxEntries int
	cmd := &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy files or directories between the host and a sandbox (ID:PATH on one side)",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 2 {
				return exitf(ExitUsage, "usage: cage cp HOSTPATH ID:PATH | cage cp ID:PATH HOSTPATH")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			lim := cpLimits{MaxEntries: maxEntries}
			var err error
			if lim.MaxBytes, err = units.ParseSize(maxBytes); err != nil || lim.MaxBytes < 1 {
				return exitf(ExitUsage, "--max-bytes %q: want a size of at least 1 byte (e.g. 4G)", maxBytes)
			}
			if lim.MaxEntries < 1 {
				return exitf(ExitUsage, "--max-entries %d: want at least 1", maxEntries)
			}
			c, err := d.client()
			if err != nil {
				return err
			}
			srcID, srcPath, srcRemote := splitRemote(args[0])
			dstID, dstPath, dstRemote := splitRemote(args[1])
			if srcRemote == dstRemote {
				return exitf(ExitUsage, "exactly one of SRC and DST must be ID:PATH")
			}
			id := srcID
			if dstRemote {
				id = dstID
			}
			// An interrupt stops the copy, which then removes what it staged.
			ctx, stop := signal.NotifyContext(ctx(cmd), syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
			defer stop()
			sb, err := c.Get(ctx, id)
			if err != nil {
				return apiFailure(err)
			}
			ac, err := c.Agent(sb.SandboxID, sb.EnvdAccessToken)
			if err != nil {
				return exitf(ExitUsage, "%v", err)
			}
			defer ac.Close()
			if dstRemote {
				err = copyToSandbox(ctx, ac, user, srcPath, dstPath)
			} else {
				err = copyFromSandbox(ctx, ac, user, srcPath, dstPath, lim)
			}
			return cpFailure(err, args[0])
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&user, "user", "u", "user", "user that owns (or reads) the files in the sandbox")
	fl.StringVar(&maxBytes, "max-bytes", units.FormatSize(defaultCpMaxBytes),
		"out of a sandbox: copy at most this much (files at their full size, holes included; and the archive sent)")
	fl.IntVar(&maxEntries, "max-entries", defaultCpMaxEntries, "out of a sandbox: copy at most this many files, directories and links")
	return cmd
}

// cpFailure gives a copy's error its exit code: a bound passed is a limit
// too small for this copy (64), a missing file 66, the rest 125.
func cpFailure(err error, src string) error {
	var le *limitError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &le):
		return exitf(ExitUsage, "cp: %s holds %s; nothing was copied", src, le.msg)
	case errors.Is(err, os.ErrNotExist):
		return exitf(ExitNotFoundObj, "cp: %v", err)
	}
	return exitf(ExitInternal, "cp: %v", err)
}

// splitRemote reads "ID:PATH" (ID lowercase letters and digits).
func splitRemote(s string) (id, p string, remote bool) {
	id, p, ok := strings.Cut(s, ":")
	if !ok || id == "" || strings.Trim(id, "abcdefghijklmnopqrstuvwxyz0123456789") != "" {
		return "", s, false
	}
	return id, p, true
}

// copyToSandbox copies a host file or directory into the sandbox. The
// file is opened once, without blocking, and sent only if what was opened
// is a regular file: a FIFO (or one swapped in after a look at the path)
// blocked root's copy for good, and a device (/dev/zero) was sent without
// end (found by review, 2026-12-04).
func copyToSandbox(ctx context.Context, ac *agentclient.Client, user, src, dst string) error {
	f, err := os.OpenFile(src, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.IsDir() {
		f.Close()
		return copyIn(ctx, ac, user, src, dst)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file or a directory (%s)", src, fi.Mode().Type())
	}
	if strings.HasSuffix(dst, "/") {
		dst += filepath.Base(src)
	}
	q := url.Values{"path": {dst}, "username": {user}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, agentclient.BaseURL+"/files?"+q.Encode(), f)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := ac.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("upload %s: %s", dst, oneLineOf(b))
	}
	// Keep the executable bits, as cp does.
	if fi.Mode()&0o111 != 0 {
		_, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "chmod", Args: []string{fmt.Sprintf("%o", fi.Mode().Perm()), dst},
			User: user, Stdout: io.Discard, Stderr: io.Discard})
		return err
	}
	return nil
}

func copyFromSandbox(ctx context.Context, ac *agentclient.Client, user, src, dst string, lim cpLimits) error {
	req := connect.NewRequest(&fspb.StatRequest{Path: src})
	req.Header().Set("Authorization", agentclient.UserHeader(user))
	st, err := ac.FS.Stat(ctx, req)
	if err != nil {
		return fmt.Errorf("%s: %v", src, connectMessage(err))
	}
	e := st.Msg.GetEntry()
	if e.GetType() == fspb.FileType_FILE_TYPE_DIRECTORY {
		return dirFromSandbox(ctx, ac, user, src, dst, lim)
	}
	// What the sandbox says of the file only lets a copy too big fail
	// early; the bytes are counted as they come.
	if e.GetSize() > lim.MaxBytes {
		return lim.tooBig()
	}
	if fi, err := os.Stat(dst); err == nil && fi.IsDir() {
		dst = filepath.Join(dst, filepath.Base(filepath.Clean(src)))
	}
	return fileFromSandbox(ctx, ac, user, src, dst, os.FileMode(e.GetMode()&0o777), lim)
}

// oneLineOf is an untrusted answer as one short line.
func oneLineOf(b []byte) string {
	s := strings.Join(strings.Fields(string(bytes.ToValidUTF8(b, []byte("?")))), " ")
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return s
}
