package cli

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/cagehq/cage/internal/agentclient"
)

// copyIn copies a host directory into the sandbox: the host writes a tar
// stream, tar inside the sandbox unpacks it as the run's user. Regular
// files, directories and symlinks are copied; other file types are skipped.
func copyIn(ctx context.Context, c *agentclient.Client, user, hostDir, dst string) error {
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeTar(pw, hostDir)) }()
	stderr := &headBuffer{max: 1024} // what it says first; a flood is not kept
	end, err := c.Run(ctx, agentclient.RunOptions{
		Cmd:    "/bin/sh",
		Args:   []string{"-c", `mkdir -p "$1" && exec tar -x --no-same-owner -m -C "$1" -f -`, "sh", dst},
		User:   user,
		Stdin:  pr,
		Stdout: io.Discard,
		Stderr: stderr,
	})
	pr.Close()
	if err != nil {
		return err
	}
	if end.GetExitCode() != 0 {
		return fmt.Errorf("unpacking in the sandbox failed: %s", bytes.TrimSpace(stderr.Bytes()))
	}
	return nil
}

func writeTar(w io.Writer, dir string) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil || rel == "." {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			if link, err = os.Readlink(path); err != nil {
				return err
			}
		case fi.IsDir(), fi.Mode().IsRegular():
		default:
			return nil // devices, sockets, fifos
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(path)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}
