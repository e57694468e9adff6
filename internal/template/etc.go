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
	sum, err := fingerprint(cacheDir, srcRoot, entries)
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

// copyRules names what copyTree copies, in the copy's fingerprint: a copy
// an older cage made under other rules (one holding the host's private
// keys) is never used again.
const copyRules = "readable by others"

// copyTree copies files, directories and symlinks (nothing else) with their
// permission bits; owners become root. Only what every host user may read
// is copied: a file others may not read, a directory others may not
// enter (and all below it) is left out. The copy's owners are no
// sandbox's on the process wall and runc, but gVisor's root inside holds
// every file's rights (its kernel maps no ids), and read the host's
// /etc/ssl/private/*.key (0640 root:ssl-cert on the host, then root's)
// until a review, 2026-12-03.
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
		case fi.IsDir() && fi.Mode().Perm()&0o001 == 0:
			return filepath.SkipDir
		case fi.Mode().IsRegular() && fi.Mode().Perm()&0o004 == 0:
			return nil
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

// fingerprint hashes what identifies the sources' current state: each
// listed entry's and each directory's (below them) mode, size and mtime.
// Walking the directories reads every entry of the largest (/etc/ssl/certs,
// /etc/alternatives: ~1.3 ms, once per create), so the states it found are
// kept in cacheDir as a manifest (the host's cache directory, which no
// sandbox can write). While every directory in it is as it was, and no
// listed entry that was absent has appeared, no directory gained, lost or
// renamed an entry, and a walk would find the same states: the manifest's
// sum stands, for a stat of each instead of a walk.
func fingerprint(cacheDir, srcRoot string, entries []string) (string, error) {
	manifest := filepath.Join(cacheDir, ".etc-manifest")
	key := manifestKey(srcRoot, entries)
	if sum, ok := manifestSum(manifest, key, srcRoot, entries); ok {
		return sum, nil
	}
	lines, err := walkStates(srcRoot, entries)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	io.WriteString(h, strings.Join(lines, "\n"))
	io.WriteString(h, fmt.Sprint(generatedEtc, etcLinks, copyRules))
	sum := hex.EncodeToString(h.Sum(nil))[:16]
	saveManifest(manifest, key, sum, lines)
	return sum, nil
}

// state is how fingerprint describes one path.
func state(p string, fi fs.FileInfo) string {
	return fmt.Sprintf("%s %o %d %d", p, fi.Mode(), fi.Size(), fi.ModTime().UnixNano())
}

// walkStates lists the state of each entry and of every directory below
// the directories among them, sorted.
func walkStates(srcRoot string, entries []string) ([]string, error) {
	var lines []string
	for _, name := range entries {
		src := filepath.Join(srcRoot, name)
		fi, err := os.Lstat(src)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		lines = append(lines, state(src, fi))
		if fi.IsDir() {
			err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
				if err != nil || !d.IsDir() || p == src {
					return err
				}
				dfi, err := d.Info()
				if err == nil {
					lines = append(lines, state(p, dfi))
				}
				return err
			})
			if err != nil {
				return nil, err
			}
		}
	}
	sort.Strings(lines)
	return lines, nil
}

// manifestKey names what a manifest was made for: the sources and what
// fingerprint adds to their states.
func manifestKey(srcRoot string, entries []string) string {
	h := sha256.New()
	fmt.Fprintf(h, "%q %q %v %v %s", srcRoot, entries, generatedEtc, etcLinks, copyRules)
	return hex.EncodeToString(h.Sum(nil))
}

// manifestSum returns the manifest's sum if it was made for key and every
// state in it is still true.
func manifestSum(manifest, key, srcRoot string, entries []string) (string, bool) {
	b, err := os.ReadFile(manifest)
	if err != nil {
		return "", false
	}
	lines := strings.Split(string(b), "\n")
	if len(lines) < 3 || lines[0] != key || len(lines[1]) != 16 {
		return "", false
	}
	seen := map[string]bool{}
	for _, line := range lines[2:] {
		// "PATH MODE SIZE MTIME": the path may hold spaces, the rest not.
		f := strings.Fields(line)
		if len(f) < 4 {
			return "", false
		}
		p := strings.TrimSuffix(line, " "+strings.Join(f[len(f)-3:], " "))
		fi, err := os.Lstat(p)
		if err != nil || state(p, fi) != line {
			return "", false
		}
		seen[p] = true
	}
	for _, name := range entries {
		if src := filepath.Join(srcRoot, name); !seen[src] {
			if _, err := os.Lstat(src); !errors.Is(err, os.ErrNotExist) {
				return "", false
			}
		}
	}
	return lines[1], true
}

// saveManifest replaces the manifest at once (a rename), or leaves it: it
// only saves time.
func saveManifest(manifest, key, sum string, lines []string) {
	if err := os.MkdirAll(filepath.Dir(manifest), 0o755); err != nil {
		return
	}
	tmp, err := os.CreateTemp(filepath.Dir(manifest), ".etc-manifest-*")
	if err != nil {
		return
	}
	_, err = io.WriteString(tmp, key+"\n"+sum+"\n"+strings.Join(lines, "\n"))
	if cerr := tmp.Close(); err == nil && cerr == nil {
		err = os.Rename(tmp.Name(), manifest)
	}
	if err != nil {
		os.Remove(tmp.Name())
	}
}

// PruneCaches removes the host template's cached /etc copies except the
// newest (see rocache.Prune).
func PruneCaches(cacheDir string) { rocache.Prune(filepath.Join(cacheDir, "host"), "etc-") }

// RemoveCache unmounts and removes one cached copy.
func RemoveCache(path string) { rocache.Remove(path) }
