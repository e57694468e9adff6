package inside

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
	"syscall"
)

// An image template's root is its overlay, writable; what cage needs in it
// is put there before anything of the image runs (by the process wall's
// child, or by the host for the OCI walls). The image is not trusted: every
// path is resolved inside the root (os.Root refuses symlinks and ".." that
// lead out of it), so a symlink such as /etc/hosts -> /tmp/x cannot make a
// write land on the host's /tmp.

// PrepareImageRoot makes the directories the sandbox mounts on real
// directories, the storage directories and the user's home, and the
// accounts and identity files. hostID maps an id inside the sandbox to the
// owner a file must have on the host (identity when the caller is the
// sandbox's own root).
//
// For a build's sandbox (build), only the mount points and /run/cage are
// made, and the identity links: what a build step's layer must not carry is
// listed in BuildArtifacts.
func PrepareImageRoot(root, hostname string, hostID func(int) int, build bool) error {
	spec := struct {
		UserName         string
		UserUID, UserGID int
		Hostname         string
	}{UserName, UserUID, UserUID, hostname}
	r, err := os.OpenRoot(root)
	if err != nil {
		return err
	}
	defer r.Close()
	dirs := []struct {
		path     string
		mode     fs.FileMode
		uid, gid int
	}{
		{"dev", 0o755, 0, 0}, {"proc", 0o555, 0, 0}, {"tmp", fs.ModeSticky | 0o777, 0, 0},
		{"run", 0o755, 0, 0}, {"run/cage", 0o755, 0, 0}, {"etc", 0o755, 0, 0},
		{"var", 0o755, 0, 0}, {"var/tmp", fs.ModeSticky | 0o777, 0, 0},
		{"home", 0o755, 0, 0}, {"home/" + spec.UserName, 0o750, spec.UserUID, spec.UserGID}, {"root", 0o700, 0, 0},
	}
	if build {
		dirs = dirs[:6] // dev, proc, tmp, run, run/cage, etc
	}
	for _, d := range dirs {
		if err := realDir(r, d.path, d.mode, hostID(d.uid), hostID(d.gid)); err != nil {
			return fmt.Errorf("image root: /%s: %w", d.path, err)
		}
	}
	if !build {
		if err := ensureAccounts(r, spec.UserName, spec.UserUID, spec.UserGID, hostID(0)); err != nil {
			return fmt.Errorf("image root: accounts: %w", err)
		}
	}
	// hosts, hostname and resolv.conf are the sandbox's own, in /run/cage.
	for name, content := range map[string]string{"hosts": HostsFile(spec.Hostname), "hostname": spec.Hostname + "\n", "resolv.conf": NoNetworkResolvConf} {
		if err := replaceFile(r, "run/cage/"+name, content, hostID(0)); err != nil {
			return fmt.Errorf("image root: /run/cage/%s: %w", name, err)
		}
		if err := replaceLink(r, "etc/"+name, "/run/cage/"+name, hostID(0)); err != nil {
			return fmt.Errorf("image root: /etc/%s: %w", name, err)
		}
	}
	return nil
}

// BuildArtifacts are the paths (relative to the root) that PrepareImageRoot
// writes into a build's sandbox and that a build step's layer leaves out:
// the sandbox's identity, not the image's. As with Docker, a RUN step's own
// changes to these files are not kept either.
var BuildArtifacts = []string{"run/cage", "etc/hosts", "etc/hostname", "etc/resolv.conf"}

// realDir makes path a directory with the mode given when it is missing or
// not a directory (a symlink, a file: removed first).
func realDir(r *os.Root, path string, mode fs.FileMode, uid, gid int) error {
	fi, err := r.Lstat(path)
	if err == nil && fi.IsDir() {
		return nil
	}
	if err == nil {
		if err := r.RemoveAll(path); err != nil {
			return err
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := r.Mkdir(path, mode&fs.ModePerm); err != nil {
		return err
	}
	if err := r.Chmod(path, mode); err != nil { // umask, sticky
		return err
	}
	return r.Lchown(path, uid, gid)
}

// replaceFile writes a fresh regular file at path (whatever was there).
func replaceFile(r *os.Root, path, content string, owner int) error {
	if err := r.RemoveAll(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := r.WriteFile(path, []byte(content), 0o644); err != nil {
		return err
	}
	return r.Lchown(path, owner, owner)
}

// replaceLink makes path a symlink to target (whatever was there).
func replaceLink(r *os.Root, path, target string, owner int) error {
	if err := r.RemoveAll(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := r.Symlink(target, path); err != nil {
		return err
	}
	return r.Lchown(path, owner, owner)
}

// ensureAccounts adds the sandbox's user and the agent's account to the
// image's passwd and group unless it has them by name.
func ensureAccounts(r *os.Root, userName string, uid, gid, owner int) error {
	shell := "/bin/sh"
	if fi, err := r.Stat("bin/bash"); err == nil && !fi.IsDir() {
		shell = "/bin/bash"
	}
	users := []string{
		fmt.Sprintf("root:x:0:0:root:/root:%s", shell),
		fmt.Sprintf("%s:x:%d:%d:%s:/home/%s:%s", userName, uid, gid, userName, userName, shell),
		fmt.Sprintf("%s:x:%d:%d::/nonexistent:/usr/sbin/nologin", AgentName, AgentUID, AgentUID),
	}
	groups := []string{"root:x:0:", fmt.Sprintf("%s:x:%d:", userName, gid),
		fmt.Sprintf("%s:x:%d:", AgentName, AgentUID)}
	for file, want := range map[string][]string{"etc/passwd": users, "etc/group": groups} {
		if err := addEntries(r, file, want, owner); err != nil {
			return err
		}
	}
	return nil
}

// maxAccountsFile bounds an image's passwd and group, which the OCI walls
// read in the daemon: a sparse file of gigabytes costs an image nothing
// to carry.
const maxAccountsFile = 1 << 20

// addEntries appends the lines of want whose name (first field) file does
// not have yet. A file that is not a regular file is replaced; one larger
// than maxAccountsFile is refused.
func addEntries(r *os.Root, file string, want []string, owner int) error {
	var have string
	if fi, err := r.Lstat(file); err == nil && fi.Mode().IsRegular() {
		b, err := readSmall(r, file, maxAccountsFile)
		if err != nil {
			return err
		}
		have = string(b)
	} else if err == nil {
		if err := r.RemoveAll(file); err != nil {
			return err
		}
	}
	names := map[string]bool{}
	for _, line := range strings.Split(have, "\n") {
		if name, _, ok := strings.Cut(line, ":"); ok {
			names[name] = true
		}
	}
	out := have
	if out != "" && !strings.HasSuffix(out, "\n") {
		out += "\n"
	}
	for _, line := range want {
		if name, _, _ := strings.Cut(line, ":"); !names[name] {
			out += line + "\n"
		}
	}
	if out == have {
		return nil
	}
	if have == "" {
		if err := r.WriteFile(file, []byte(out), 0o644); err != nil {
			return err
		}
		return r.Lchown(file, owner, owner)
	}
	// Append: the file keeps its owner and mode.
	f, err := r.OpenFile(file, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(out[len(have):])
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// readSmall reads the regular file name under r, refusing one larger than
// limit (by its size, and by what is read: it may grow meanwhile).
func readSmall(r *os.Root, name string, limit int64) ([]byte, error) {
	f, err := r.OpenFile(name, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("the image's /%s is not a regular file", name)
	}
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if fi.Size() > limit || int64(len(b)) > limit {
		return nil, fmt.Errorf("the image's /%s is larger than %d KiB", name, limit>>10)
	}
	return b, nil
}
