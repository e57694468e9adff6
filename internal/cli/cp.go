package cli

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/internal/agentclient"
)

// cage cp copies files and directories between the host and a daemon's
// sandbox. What comes out of a sandbox is untrusted: a directory arrives as a
// tar stream unpacked under the destination with os.Root, so no entry (a
// "..", an absolute name, a symlink planted to be written through) lands
// outside it.

func newCpCmd(d *daemonFlags) *cobra.Command {
	var user string
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
			sb, err := c.Get(ctx(cmd), id)
			if err != nil {
				return apiFailure(err)
			}
			ac, err := c.Agent(sb.SandboxID, sb.EnvdAccessToken)
			if err != nil {
				return exitf(ExitUsage, "%v", err)
			}
			defer ac.Close()
			if dstRemote {
				err = copyToSandbox(ctx(cmd), ac, user, srcPath, dstPath)
			} else {
				err = copyFromSandbox(ctx(cmd), ac, user, srcPath, dstPath)
			}
			if errors.Is(err, os.ErrNotExist) {
				return exitf(ExitNotFoundObj, "cp: %v", err)
			}
			if err != nil {
				return exitf(ExitInternal, "cp: %v", err)
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&user, "user", "u", "user", "user that owns (or reads) the files in the sandbox")
	return cmd
}

// splitRemote reads "ID:PATH" (ID lowercase letters and digits).
func splitRemote(s string) (id, p string, remote bool) {
	id, p, ok := strings.Cut(s, ":")
	if !ok || id == "" || strings.Trim(id, "abcdefghijklmnopqrstuvwxyz0123456789") != "" {
		return "", s, false
	}
	return id, p, true
}

func copyToSandbox(ctx context.Context, ac *agentclient.Client, user, src, dst string) error {
	fi, err := os.Stat(src)
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return copyIn(ctx, ac, user, src, dst)
	}
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
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
		return fmt.Errorf("upload %s: %s", dst, bytes.TrimSpace(b))
	}
	// Keep the executable bits, as cp does.
	if fi.Mode()&0o111 != 0 {
		_, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "chmod", Args: []string{fmt.Sprintf("%o", fi.Mode().Perm()), dst},
			User: user, Stdout: io.Discard, Stderr: io.Discard})
		return err
	}
	return nil
}

func copyFromSandbox(ctx context.Context, ac *agentclient.Client, user, src, dst string) error {
	req := connect.NewRequest(&fspb.StatRequest{Path: src})
	req.Header().Set("Authorization", agentclient.UserHeader(user))
	st, err := ac.FS.Stat(ctx, req)
	if err != nil {
		return fmt.Errorf("%s: %v", src, connectMessage(err))
	}
	if st.Msg.GetEntry().GetType() == fspb.FileType_FILE_TYPE_DIRECTORY {
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return err
		}
		return unpackFromSandbox(ctx, ac, user, src, dst)
	}
	if fi, err := os.Stat(dst); err == nil && fi.IsDir() {
		dst = filepath.Join(dst, path.Base(src))
	}
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
		return fmt.Errorf("download %s: %s", src, bytes.TrimSpace(b))
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, os.FileMode(st.Msg.GetEntry().GetMode()&0o777))
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, resp.Body); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// unpackFromSandbox runs tar in the sandbox and unpacks its output under dst.
func unpackFromSandbox(ctx context.Context, ac *agentclient.Client, user, src, dst string) error {
	root, err := os.OpenRoot(dst)
	if err != nil {
		return err
	}
	defer root.Close()
	pr, pw := io.Pipe()
	var stderr bytes.Buffer
	done := make(chan error, 1)
	go func() {
		err := untar(root, pr)
		if err != nil {
			// Stop the stream, so tar's output does not block.
			pr.CloseWithError(fmt.Errorf("unpacking: %v", err))
		} else {
			_, _ = io.Copy(io.Discard, pr) // the archive's trailing padding
		}
		done <- err
	}()
	end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "tar", Args: []string{"-c", "-C", src, "."},
		User: user, Stdout: pw, Stderr: &stderr})
	pw.CloseWithError(io.EOF)
	uerr := <-done
	if uerr != nil {
		return uerr
	}
	if err != nil {
		return err
	}
	if end.GetExitCode() != 0 {
		return fmt.Errorf("tar in the sandbox: %s", bytes.TrimSpace(stderr.Bytes()))
	}
	return uerr
}

func untar(root *os.Root, r io.Reader) error {
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name := path.Clean(strings.TrimPrefix(hdr.Name, "./"))
		if name == "." {
			continue
		}
		if path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") {
			return fmt.Errorf("refusing tar entry %q from the sandbox", hdr.Name)
		}
		mode := os.FileMode(hdr.Mode).Perm()
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(name, mode|0o700); err != nil {
				return err
			}
		case tar.TypeReg:
			if dir := path.Dir(name); dir != "." {
				if err := root.MkdirAll(dir, 0o755); err != nil {
					return err
				}
			}
			_ = root.Remove(name) // never write through something already there
			f, err := root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, mode)
			if err != nil {
				return err
			}
			_, err = io.Copy(f, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
		case tar.TypeSymlink:
			_ = root.Remove(name)
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return err
			}
		default:
			// devices, fifos, hard links: skipped
		}
	}
}
