package imgstore

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// inUseError is ErrInUse naming who uses the template.
type inUseError struct {
	name  string
	users []string
}

func (e *inUseError) Error() string {
	users := e.users
	const show = 10
	more := ""
	if len(users) > show {
		users, more = users[:show], ", ..."
	}
	return fmt.Sprintf("template %q is in use by %d sandbox(es): %s%s", e.name, len(e.users), strings.Join(users, ", "), more)
}

func (e *inUseError) Is(target error) bool { return target == ErrInUse }

// Remove deletes the template name, then collects the layers no template
// uses any more. A template some mount still uses is not removed.
func (s *Store) Remove(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	unlock, err := s.lock(unix.LOCK_EX)
	if err != nil {
		return err
	}
	defer unlock()
	t, err := s.readTemplate(name)
	if err != nil {
		return err
	}
	users, err := inUse(t)
	if err != nil {
		return fmt.Errorf("template %q: cannot tell whether it is in use: %w", name, err)
	}
	if len(users) > 0 {
		return &inUseError{name: name, users: users}
	}
	if err := os.Remove(s.path(templatesDir, name+".json")); err != nil {
		return fmt.Errorf("remove template %q: %w", name, err)
	}
	if err := syncDir(s.path(templatesDir)); err != nil {
		return fmt.Errorf("remove template %q: %w", name, err)
	}
	if _, err := s.gcLocked(nil); err != nil {
		return fmt.Errorf("template %q removed, but collecting its layers failed: %w", name, err)
	}
	return nil
}

// GC removes the unpacked layers no template uses, the configs no template
// uses, and what crashed imports left behind. Layers an import in progress
// relies on, and layers a mount still uses (an overlay's lowerdir, a bind),
// are kept. It returns the diff IDs of the layers removed.
func (s *Store) GC() ([]string, error) {
	unlock, err := s.lock(unix.LOCK_EX)
	if err != nil {
		return nil, err
	}
	defer unlock()
	return s.gcLocked(nil)
}

// gcLocked collects garbage under the store's exclusive lock. With only
// set, it considers only those layers, and nothing else.
func (s *Store) gcLocked(only map[string]bool) ([]string, error) {
	ts, err := s.List()
	if err != nil {
		// Never delete what an unreadable template may use.
		return nil, fmt.Errorf("gc: %w", err)
	}
	usedLayers, usedConfigs := map[string]bool{}, map[string]bool{}
	for _, t := range ts {
		for _, l := range t.Layers {
			if h, err := digestHex(l); err == nil {
				usedLayers[h] = true
			}
		}
		if h, err := digestHex(t.ID); err == nil {
			usedConfigs[h] = true
		}
	}
	// Mounts keep layers too: an Import that replaced a template leaves the
	// old layers unreferenced while sandboxes still run on them. A sandbox's
	// root names no layer path (its layers are given by descriptor, or as
	// idmapped copies), but its source names the template's image ID.
	mounted, sources, err := mountedLayers()
	if err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	if err := s.keepMounted(sources, mounted, usedConfigs); err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	consider := func(h string) bool { return !usedLayers[h] && !mounted[h] && (only == nil || only[h]) }

	entries, err := os.ReadDir(s.path(layersDir))
	if err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		n := e.Name()
		h, ext, _ := strings.Cut(n, ".")
		switch {
		case strings.HasPrefix(n, tmpPrefix):
			if only == nil {
				errs = append(errs, removeUnlocked(s.path(layersDir, n)))
			}
		case hexRE().MatchString(n) && e.IsDir():
			if !consider(n) {
				continue
			}
			ok, err := s.removeLayer(n)
			errs = append(errs, err)
			if ok {
				removed = append(removed, "sha256:"+n)
			}
		case hexRE().MatchString(h) && (ext == "json" || ext == "tarmeta") && consider(h):
			// The record of a layer whose directory is gone.
			if _, err := os.Lstat(s.path(layersDir, h)); errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, removeFile(s.path(layersDir, n)))
			}
		}
	}
	if only == nil {
		errs = append(errs, s.gcFiles(configsDir, usedConfigs), s.gcFiles(templatesDir, nil))
	}
	sort.Strings(removed)
	if err := errors.Join(errs...); err != nil {
		return removed, fmt.Errorf("gc: %w", err)
	}
	return removed, nil
}

// removeLayer removes the layer hx unless an import holds it; it is first
// renamed aside, so that it vanishes from its name at once.
func (s *Store) removeLayer(hx string) (bool, error) {
	dir := s.path(layersDir, hx)
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("layer %s: %w", hx, err)
	}
	defer unix.Close(fd)
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return false, nil // an import in progress relies on it
		}
		return false, fmt.Errorf("layer %s: %w", hx, err)
	}
	aside := s.path(layersDir, tmpPrefix+randomName())
	if err := os.Rename(dir, aside); err != nil {
		return false, fmt.Errorf("layer %s: %w", hx, err)
	}
	err = errors.Join(removeFile(dir+".json"), removeFile(dir+".tarmeta"), os.RemoveAll(aside))
	return true, err
}

// Staging makes a file in the store's layers directory for a build to
// write a layer's tar into before AddLayer reads it: on the store's disk,
// not in the host's $TMPDIR (often a tmpfs, where a RUN step's changes,
// as large as its disk, would be held in memory). The file is locked
// while it is open, so GC leaves it alone, and removes it once its
// owner has died without removing it. Close removes it.
func (s *Store) Staging() (*StagingFile, error) {
	p := s.path(layersDir, tmpPrefix+randomName()+".tar")
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("template store: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		os.Remove(p)
		return nil, fmt.Errorf("template store: %w", err)
	}
	return &StagingFile{File: f}, nil
}

// StagingFile is a locked file in the store (Staging).
type StagingFile struct {
	*os.File
}

// Close removes the file, then closes it (its lock goes with it).
func (f *StagingFile) Close() error {
	err := removeFile(f.Name())
	return errors.Join(err, f.File.Close())
}

// removeUnlocked removes a leftover .tmp-* entry unless its owner (an
// import in progress) still holds its lock.
func removeUnlocked(p string) error {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ELOOP) {
		return removeFile(p) // a symlink: nobody's lock
	}
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	defer unix.Close(fd)
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil
		}
		return fmt.Errorf("%s: %w", p, err)
	}
	return os.RemoveAll(p)
}

// gcFiles removes, in a directory of records written only under the
// store's lock, leftover temp files and (with used set) the configs no
// template names.
func (s *Store) gcFiles(sub string, used map[string]bool) error {
	entries, err := os.ReadDir(s.path(sub))
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		n := e.Name()
		h, isJSON := strings.CutSuffix(n, ".json")
		if strings.HasPrefix(n, tmpPrefix) || (used != nil && isJSON && hexRE().MatchString(h) && !used[h]) {
			errs = append(errs, removeFile(s.path(sub, n)))
		}
	}
	return errors.Join(errs...)
}

func removeFile(p string) error {
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// MountSource is the source a caller gives each overlay mount of the
// template, so that InUse can find them in /proc/self/mountinfo.
func MountSource(t *Template) string {
	id := strings.TrimPrefix(t.ID, "sha256:")
	if len(id) > 12 {
		id = id[:12]
	}
	return mountSourcePrefix + t.Name + "@" + id
}

const mountSourcePrefix = "cage-template:"

// InUse returns the mount points of the mounts whose source is
// MountSource(t). It returns nil if /proc/self/mountinfo cannot be read
// (Remove refuses to go on then).
func InUse(t *Template) []string {
	users, _ := inUse(t)
	return users
}

func inUse(t *Template) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	src := MountSource(t)
	var users []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		point, source, ok := parseMountinfo(sc.Text())
		if ok && source == src {
			users = append(users, point)
		}
	}
	return users, sc.Err()
}

// layerRefRE finds a layer directory in a line of mountinfo: an overlay's
// lowerdir option, or the root of a bind mount of a layer (or of a path in
// it).
var layerRefRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`layers/([0-9a-f]{64})(?:[/:, ]|$)`) })

// mountedLayers returns the layers (by hex) that some mount of this mount
// namespace names by path, and the image IDs (their first 12 hex digits,
// as MountSource has them) of the templates mounts were made from. It may
// name layers and templates of another store: keeping those here costs
// nothing.
func mountedLayers() (layers, templates map[string]bool, err error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	layers, templates = map[string]bool{}, map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		for _, m := range layerRefRE().FindAllStringSubmatch(unescapeMountinfo(line), -1) {
			layers[m[1]] = true
		}
		if _, source, ok := parseMountinfo(line); ok && strings.HasPrefix(source, mountSourcePrefix) {
			if i := strings.LastIndexByte(source, '@'); i >= 0 && idPrefixRE().MatchString(source[i+1:]) {
				templates[source[i+1:]] = true
			}
		}
	}
	return layers, templates, sc.Err()
}

// idPrefixRE is the image ID's part of a MountSource.
var idPrefixRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[0-9a-f]{12}$`) })

// keepMounted adds to layers the layers of every image config whose ID
// begins with one of ids (templates some mount was made from, replaced or
// not), read from the config's rootfs, and keeps those configs (used): a
// mounted template's layers stay while it is mounted. A config that
// cannot be read keeps GC from going on.
func (s *Store) keepMounted(ids, layers, used map[string]bool) error {
	if len(ids) == 0 {
		return nil
	}
	entries, err := os.ReadDir(s.path(configsDir))
	if err != nil {
		return err
	}
	for _, e := range entries {
		h, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || !hexRE().MatchString(h) || !ids[h[:12]] {
			continue
		}
		b, err := os.ReadFile(s.path(configsDir, e.Name()))
		if err != nil {
			return fmt.Errorf("the config of mounted template %s: %w", h[:12], err)
		}
		var c struct {
			RootFS struct {
				DiffIDs []string `json:"diff_ids"`
			} `json:"rootfs"`
		}
		if err := json.Unmarshal(b, &c); err != nil {
			return fmt.Errorf("the config of mounted template %s: %w", h[:12], err)
		}
		for _, d := range c.RootFS.DiffIDs {
			if lh, err := digestHex(d); err == nil {
				layers[lh] = true
			}
		}
		used[h] = true
	}
	return nil
}

// parseMountinfo returns the mount point and the source of a line of
// /proc/self/mountinfo:
//
//	36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
func parseMountinfo(line string) (point, source string, ok bool) {
	fields := strings.Split(line, " ")
	if len(fields) < 10 {
		return "", "", false
	}
	for i := 6; i+2 < len(fields); i++ {
		if fields[i] == "-" {
			return unescapeMountinfo(fields[4]), unescapeMountinfo(fields[i+2]), true
		}
	}
	return "", "", false
}

// unescapeMountinfo undoes the kernel's octal escapes (\040 for a space).
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
