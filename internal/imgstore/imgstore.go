// Package imgstore is cage's on-disk store of templates: container images
// unpacked into layers that sandboxes mount read-only through overlayfs.
//
// Layout under the store's directory (0700: unpacked layers may hold
// setuid-root files, so no host user but root may traverse to them):
//
//	lock                      flock: exclusive while the store changes, shared by RLock
//	layers/<hex>/             one unpacked layer (an overlayfs lower dir), named by its diff ID
//	layers/<hex>.json         {"diffID","size","files","tarSize"}
//	layers/<hex>.tarmeta      what Export needs to rebuild the layer's tar byte for byte
//	layers/.tmp-<random>/     a layer being unpacked (root/ and tarmeta), renamed when complete
//	layers/.tmp-<random>.tar  a build's layer tar before it is added (Staging), locked while in use
//	configs/<hex>.json        an image's config, byte for byte, named by the image ID
//	templates/<name>.json     a Template
//
// Layers are shared: a layer already present (same diff ID) is not unpacked
// again. Each layer dir is flock'ed (shared) by every import that relies on it
// until that import's template is written, and GC skips locked layers, so a
// GC running beside an import never deletes what the import is about to use.
// GC also keeps the layers that mounts still use (found in mountinfo), such
// as those of a template an Import replaced while sandboxes ran on it.
//
// Archives are hostile. Every write into a layer goes through an os.Root of
// that layer and *at system calls on single path components whose parent is
// known to be a real directory, so no entry can make a write land outside
// the layer; see unpack.go.
package imgstore

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/store"
)

// Errors a caller can tell apart with errors.Is.
var (
	ErrNotFound = errors.New("template not found")
	ErrInUse    = errors.New("template in use")
	ErrInvalid  = errors.New("invalid image") // hostile or malformed archives, bad names, too big
)

// Config is what a sandbox takes from the image config.
type Config struct {
	Env        []string          `json:"env,omitempty"`
	WorkingDir string            `json:"workingDir,omitempty"`
	User       string            `json:"user,omitempty"`
	Entrypoint []string          `json:"entrypoint,omitempty"`
	Cmd        []string          `json:"cmd,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
}

// Template is an imported image.
type Template struct {
	Name    string    `json:"name"`
	ID      string    `json:"id"`      // "sha256:<hex>" of the image config (image ID)
	Layers  []string  `json:"layers"`  // diff IDs, bottom first
	Config  Config    `json:"config"`  // from the image config
	Size    int64     `json:"size"`    // bytes of unpacked files (sum over its layers)
	Created time.Time `json:"created"` // when imported
	Source  string    `json:"source"`  // "docker-archive:/path", "oci-layout:/path", "registry:host/repo:tag"
}

// Options bound and report an import.
type Options struct {
	MaxBytes int64                            // total uncompressed bytes read per import; 0 = 16 GiB
	MaxFiles int                              // entries per import; 0 = 2,000,000
	Insecure bool                             // Pull: allow plain http registries
	Progress func(format string, args ...any) // optional: one line per layer
}

const (
	defaultMaxBytes = 16 << 30
	defaultMaxFiles = 2_000_000
)

func (o Options) maxBytes() int64 {
	if o.MaxBytes > 0 {
		return o.MaxBytes
	}
	return defaultMaxBytes
}

func (o Options) maxFiles() int {
	if o.MaxFiles > 0 {
		return o.MaxFiles
	}
	return defaultMaxFiles
}

func (o Options) progress(format string, args ...any) {
	if o.Progress != nil {
		o.Progress(format, args...)
	}
}

// invalidError is an ErrInvalid with a message of its own, so that errors
// read as one clear line ("image exceeds 8388608 bytes uncompressed").
type invalidError struct{ msg string }

func (e *invalidError) Error() string        { return e.msg }
func (e *invalidError) Is(target error) bool { return target == ErrInvalid }

func invalidf(format string, args ...any) error {
	return &invalidError{msg: fmt.Sprintf(format, args...)}
}

// Store is a template store in one directory.
type Store struct {
	dir string
}

const (
	layersDir    = "layers"
	configsDir   = "configs"
	templatesDir = "templates"
	lockFile     = "lock"
	tmpPrefix    = ".tmp-"
)

// Open opens the store in dir, creating it (mode 0700) if needed.
func Open(dir string) (*Store, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("template store %s: %w", dir, err)
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("template store: %w", err)
	}
	// The layers may hold setuid-root files: keep everyone but root out,
	// also when the directory existed before.
	if err := os.Chmod(abs, 0o700); err != nil {
		return nil, fmt.Errorf("template store: %w", err)
	}
	// And no other user may own it, or a directory above it they could
	// rename it out of: they could change the layers every sandbox of a
	// template runs, and hold links where root unpacks and removes.
	if err := store.CheckDataDir(abs); err != nil {
		return nil, fmt.Errorf("template store: %w", err)
	}
	for _, sub := range []string{layersDir, configsDir, templatesDir} {
		if err := os.Mkdir(filepath.Join(abs, sub), 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("template store: %w", err)
		}
	}
	f, err := os.OpenFile(filepath.Join(abs, lockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("template store: %w", err)
	}
	f.Close()
	return &Store{dir: abs}, nil
}

// Dir is the store's directory.
func (s *Store) Dir() string { return s.dir }

func (s *Store) path(elem ...string) string {
	return filepath.Join(append([]string{s.dir}, elem...)...)
}

// RLock takes the store's lock shared. A caller holds it while it reads
// LayerDirs and mounts them, so that Remove and GC (exclusive) cannot delete
// layers under it. The lock is a flock of its own open file, so a goroutine
// holding it must not call Import, Pull, Remove or GC: they would wait for
// it forever.
func (s *Store) RLock() (unlock func(), err error) {
	return s.lock(unix.LOCK_SH)
}

// lock opens the lock file anew each time: flock locks belong to the open
// file, so goroutines of one process exclude each other like processes do.
func (s *Store) lock(how int) (func(), error) {
	f, err := os.OpenFile(s.path(lockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("template store lock: %w", err)
	}
	if err := flock(int(f.Fd()), how); err != nil {
		f.Close()
		return nil, fmt.Errorf("template store lock: %w", err)
	}
	return func() { f.Close() }, nil // closing the file releases the lock
}

func flock(fd, how int) error {
	for {
		err := unix.Flock(fd, how)
		if err != unix.EINTR {
			return err
		}
	}
}

// Compiled at first use: a counted repetition compiles into a program of
// its size, work every cage process (cage run included) paid at its start.
var nameRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`) })

// CheckName reports whether name may be a stored template's name (an
// error wrapping ErrInvalid says why): for callers that refuse a bad name
// before any work.
func CheckName(name string) error { return checkName(name) }

// checkName accepts the names a template may be stored under. "host" is the
// built-in template and cannot be stored.
func checkName(name string) error {
	if !nameRE().MatchString(name) || strings.Contains(name, "..") {
		return invalidf("template name %.64q is not allowed (want [a-z0-9][a-z0-9._-]{0,62}, no \"..\")", name)
	}
	if name == "host" {
		return invalidf("template name \"host\" is reserved for the built-in template")
	}
	return nil
}

// Compiled at first use: a counted repetition compiles into a program of
// its size, work every cage process (cage run included) paid at its start.
var hexRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[0-9a-f]{64}$`) })

// digestHex returns the hex of a "sha256:<hex>" digest, which names files in
// the store, so nothing but exactly 64 lowercase hex digits is accepted.
func digestHex(d string) (string, error) {
	h, ok := strings.CutPrefix(d, "sha256:")
	if !ok || !hexRE().MatchString(h) {
		return "", invalidf("digest %q is not sha256:<64 hex digits>", d)
	}
	return h, nil
}

// shortDigest is a digest for people: "sha256:0123456789ab…".
func shortDigest(d string) string {
	if len(d) > 19 {
		return d[:19] + "…"
	}
	return d
}

// List returns every template, sorted by name.
func (s *Store) List() ([]Template, error) {
	entries, err := os.ReadDir(s.path(templatesDir))
	if err != nil {
		return nil, fmt.Errorf("list templates: %w", err)
	}
	var out []Template
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || strings.HasPrefix(name, tmpPrefix) {
			continue
		}
		t, err := s.readTemplate(name)
		if err != nil {
			return nil, err
		}
		out = append(out, *t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Get returns the template called name.
func (s *Store) Get(name string) (*Template, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	return s.readTemplate(name)
}

func (s *Store) readTemplate(name string) (*Template, error) {
	b, err := os.ReadFile(s.path(templatesDir, name+".json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %q", ErrNotFound, name)
	}
	if err != nil {
		return nil, fmt.Errorf("template %q: %w", name, err)
	}
	var t Template
	if err := json.Unmarshal(b, &t); err != nil {
		return nil, fmt.Errorf("template %q: corrupt record %s: %v", name, s.path(templatesDir, name+".json"), err)
	}
	if t.Name != name {
		return nil, fmt.Errorf("template %q: record %s names %q", name, s.path(templatesDir, name+".json"), t.Name)
	}
	return &t, nil
}

// LayerDirs returns the template's unpacked layer directories, bottom first,
// ready to be an overlay's lower dirs (reversed). A layer the image lists
// twice is given once, where it is uppermost: overlayfs refuses a directory
// twice, and a lower copy of a layer already above adds nothing to the view.
func (s *Store) LayerDirs(t *Template) ([]string, error) {
	dirs := make([]string, 0, len(t.Layers))
	for i, d := range t.Layers {
		if slices.Contains(t.Layers[i+1:], d) {
			continue
		}
		h, err := digestHex(d)
		if err != nil {
			return nil, fmt.Errorf("template %q: %w", t.Name, err)
		}
		dir := s.path(layersDir, h)
		fi, err := os.Lstat(dir)
		if err != nil || !fi.IsDir() {
			return nil, fmt.Errorf("template %q: layer %s is missing from %s", t.Name, shortDigest(d), s.path(layersDir))
		}
		dirs = append(dirs, dir)
	}
	return dirs, nil
}

// writeFileAtomic writes a small file durably: temp file, fsync, rename,
// fsync of the directory. A crash leaves the old file or the new one.
func writeFileAtomic(path string, data []byte) error {
	dir := filepath.Dir(path)
	tmp := filepath.Join(dir, tmpPrefix+randomName()+".json")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

func randomName() string {
	var b [8]byte
	rand.Read(b[:]) // never fails (crypto/rand panics rather than return short)
	return hex.EncodeToString(b[:])
}
