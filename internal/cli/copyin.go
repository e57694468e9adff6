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
	"syscall"

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

// writeTar writes dir's tree as a tar stream. dir may be another host
// user's to change while cage, as root, reads it: everything is reached
// through os.Root (no symlink, raced in or not, leads out of dir), a file
// is opened O_NOFOLLOW|O_NONBLOCK and sent only if it is still a regular
// file (a FIFO swapped in neither blocks nor is read), and its header is
// what the open file says. Found by review, 2026-12-03: a directory
// swapped for a link to another directory between the walk's lstat and
// its read had root copy that directory's files into the sandbox.
func writeTar(w io.Writer, dir string) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tw := tar.NewWriter(w)
	err = fs.WalkDir(root.FS(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || path == "." {
			return err
		}
		fi, err := root.Lstat(path)
		if err != nil {
			return err
		}
		link := ""
		var f *os.File
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			if link, err = root.Readlink(path); err != nil {
				return err
			}
		case fi.IsDir():
		case fi.Mode().IsRegular():
			if f, err = root.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0); err != nil {
				return err
			}
			defer f.Close()
			if fi, err = f.Stat(); err != nil {
				return err
			}
			if !fi.Mode().IsRegular() {
				return nil // swapped for something else since the walk saw it
			}
		default:
			return nil // devices, sockets, fifos
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(path)
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if f != nil {
			_, err = io.CopyN(tw, f, hdr.Size)
		}
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}
