// Package template describes what a sandbox's root filesystem is made from:
// the built-in template "host" (the host's own /usr, /bin, /sbin and /lib*,
// and a minimal /etc, all read-only), or an image from the template store,
// whose layers every sandbox of it shares under a writable layer of its own.
package template

import (
	"errors"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/inside"
)

// ErrNotFound is returned for a template name that does not exist.
var ErrNotFound = errors.New("template not found")

// Template is a resolved template: what to mount, in order (the host
// template), or an image from the store.
type Template struct {
	Name     string
	Mounts   []inside.Mount
	EtcCache string // the prepared /etc directory in use
	Image    *Image // an image template (Mounts and EtcCache are empty)
	// Build marks a template build's sandbox (process wall): root keeps the
	// agent's capabilities inside the user namespace, as package managers
	// need, and cage adds no accounts or directories to the image beyond
	// the mount points it needs; its identity files are kept out of the
	// layer the step makes (see BuildArtifacts).
	Build bool
}

// hostRoots are the host directories the "host" template shares.
var hostRoots = []string{"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"}

// hostEtc are the host /etc entries the "host" template shares read-only.
// Accounts, hosts and resolver files are generated per sandbox instead.
var hostEtc = []string{
	"alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf",
	"debian_version", "environment", "gai.conf", "host.conf", "inputrc",
	"ld.so.cache", "ld.so.conf", "ld.so.conf.d", "locale.alias", "localtime",
	"login.defs", "mime.types", "nsswitch.conf", "os-release", "profile",
	"profile.d", "protocols", "python3", "python3.11", "rpc", "services",
	"skel", "ssl", "terminfo", "timezone", "vim", "xattr.conf",
}

// Names lists the built-in templates.
func Names() []string { return []string{"host"} }

// Lookup resolves a template by name: "host" (also ""), or an image in
// store (which may be nil: no store). cacheDir holds what templates prepare
// once for every sandbox (the host template's /etc).
//
// Resolving the host template checks the host's /etc for changes (a walk of
// its directories, a few milliseconds), so a result is reused for a second:
// creates in a burst resolve it once.
func Lookup(name, cacheDir string, store *imgstore.Store) (*Template, error) {
	switch name {
	case "host", "":
	default:
		return lookupImage(name, store)
	}
	dir := filepath.Join(cacheDir, "host")
	recent.Lock()
	defer recent.Unlock()
	if r, ok := recent.m[dir]; ok && time.Since(r.at) < reuseFor {
		return r.t, nil
	}
	t, err := hostTemplate(dir)
	if err != nil {
		return nil, err
	}
	recent.m[dir] = resolved{t: t, at: time.Now()}
	return t, nil
}

// reuseFor is how long a resolved template is reused.
const reuseFor = time.Second

var recent = struct {
	sync.Mutex
	m map[string]resolved
}{m: map[string]resolved{}}

type resolved struct {
	t  *Template
	at time.Time
}

func hostTemplate(cacheDir string) (*Template, error) {
	t := &Template{Name: "host"}
	for _, p := range hostRoots {
		m, ok, err := hostMount(p, p)
		if err != nil {
			return nil, err
		}
		if ok {
			t.Mounts = append(t.Mounts, m)
		}
	}
	etc := append([]string(nil), hostEtc...)
	sort.Strings(etc)
	dir, err := etcCache(cacheDir, "/etc", etc)
	if err != nil {
		return nil, err
	}
	t.EtcCache = dir
	t.Mounts = append(t.Mounts, inside.Mount{Kind: inside.Dir, Source: dir, Dest: "/etc"})
	return t, nil
}

// hostMount describes how to bring host path src to dest; ok is false when
// src does not exist on this host.
func hostMount(src, dest string) (inside.Mount, bool, error) {
	fi, err := os.Lstat(src)
	if errors.Is(err, os.ErrNotExist) {
		return inside.Mount{}, false, nil
	}
	if err != nil {
		return inside.Mount{}, false, err
	}
	switch {
	case fi.Mode()&os.ModeSymlink != 0:
		target, err := os.Readlink(src)
		if err != nil {
			return inside.Mount{}, false, err
		}
		return inside.Mount{Kind: inside.Symlink, Dest: dest, Target: target}, true, nil
	case fi.IsDir():
		return inside.Mount{Kind: inside.Dir, Source: src, Dest: dest}, true, nil
	case fi.Mode().IsRegular():
		return inside.Mount{Kind: inside.File, Source: src, Dest: dest}, true, nil
	}
	return inside.Mount{}, false, nil
}
