package template

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/rocache"
)

// The host template's /etc is a copy of the listed host entries plus the
// sandbox's own accounts, kept in a cache directory that every sandbox binds
// read-only: one mount per sandbox instead of one per entry. The copy is
// named after a fingerprint of the sources (every directory's and top-level
// file's size and mtime, which change when a package manager adds, removes
// or renames a file), so a changed host gets a fresh copy while sandboxes
// still running keep the one they started with.

var generatedEtc = map[string]string{
	"passwd": fmt.Sprintf("root:x:0:0:root:/root:/bin/bash\n%s:x:%d:%d:%s:/home/%s:/bin/bash\n%s:x:%d:%d::/nonexistent:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
		inside.UserName, inside.UserUID, inside.UserUID, inside.UserName, inside.UserName, inside.AgentName, inside.AgentUID, inside.AgentUID),
	"group":  fmt.Sprintf("root:x:0:\ntty:x:5:\n%s:x:%d:\n%s:x:%d:\nnogroup:x:65534:\n", inside.UserName, inside.UserUID, inside.AgentName, inside.AgentUID),
	"shadow": "",
}

// Per-sandbox files live in the sandbox's /run/cage; /etc links to them.
var etcLinks = map[string]string{
	"hosts":       "/run/cage/hosts",
	"hostname":    "/run/cage/hostname",
	"resolv.conf": "/run/cage/resolv.conf",
	"mtab":        "/proc/self/mounts",
}

// etcCache returns the cache directory for the current state of the host's
// /etc entries, building it if needed. Each copy is a read-only tmpfs of its
// own, so that a sandbox's mountinfo shows "/" as the root of its /etc, not
// a path of the host.
func etcCache(cacheDir, srcRoot string, entries []string) (string, error) {
	sum, err := fingerprint(srcRoot, entries)
	if err != nil {
		return "", err
	}
	return rocache.Get(cacheDir, "etc-"+sum, "64m", func(dst string) error { return fillEtc(dst, srcRoot, entries) })
}

func fillEtc(dir, srcRoot string, entries []string) error {
	for _, name := range entries {
		src := filepath.Join(srcRoot, name)
		if _, err := os.Lstat(src); errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err := copyTree(src, filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	for name, content := range generatedEtc {
		mode := os.FileMode(0o644)
		if name == "shadow" {
			mode = 0o600
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), mode); err != nil {
			return err
		}
	}
	for name, target := range etcLinks {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	return nil
}

// copyTree copies files, directories and symlinks (nothing else) with their
// permission bits; owners become root.
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			link, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(link, target)
		case fi.IsDir():
			if err := os.Mkdir(target, fi.Mode().Perm()); err != nil {
				return err
			}
			return os.Chmod(target, fi.Mode().Perm())
		case fi.Mode().IsRegular():
			return copyFile(p, target, fi.Mode().Perm())
		}
		return nil
	})
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Chmod(dst, mode)
}

// fingerprint hashes what identifies the sources' current state.
func fingerprint(srcRoot string, entries []string) (string, error) {
	h := sha256.New()
	var lines []string
	add := func(p string, fi fs.FileInfo) {
		lines = append(lines, fmt.Sprintf("%s %o %d %d", p, fi.Mode(), fi.Size(), fi.ModTime().UnixNano()))
	}
	for _, name := range entries {
		src := filepath.Join(srcRoot, name)
		fi, err := os.Lstat(src)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return "", err
		}
		add(src, fi)
		if fi.IsDir() {
			err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
				if err != nil || !d.IsDir() || p == src {
					return err
				}
				dfi, err := d.Info()
				if err == nil {
					add(p, dfi)
				}
				return err
			})
			if err != nil {
				return "", err
			}
		}
	}
	sort.Strings(lines)
	io.WriteString(h, strings.Join(lines, "\n"))
	io.WriteString(h, fmt.Sprint(generatedEtc, etcLinks))
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

// PruneCaches removes the host template's cached /etc copies except the
// newest (see rocache.Prune).
func PruneCaches(cacheDir string) { rocache.Prune(filepath.Join(cacheDir, "host"), "etc-") }

// RemoveCache unmounts and removes one cached copy.
func RemoveCache(path string) { rocache.Remove(path) }
