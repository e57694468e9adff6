package imgstore

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/units"
)

// Import imports the image at path as the template name, replacing any
// template of that name. path is a docker-save tarball, an OCI image layout
// directory or an OCI image layout as a tar; an archive of several images
// gives the one tagged name (or name:latest, or whose repository is name).
func (s *Store) Import(ctx context.Context, path, name string, o Options) (*Template, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	img, err := openArchive(path, name)
	if err != nil {
		return nil, fmt.Errorf("import %s: %w", path, err)
	}
	defer img.close()
	t, err := s.install(ctx, img, name, o)
	if err != nil {
		return nil, fmt.Errorf("import %s: %w", path, err)
	}
	return t, nil
}

// Pull imports the image ref (linux/amd64) from its registry as the
// template name, replacing any template of that name.
func (s *Store) Pull(ctx context.Context, ref, name string, o Options) (*Template, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	img, err := remoteImage(ctx, ref, o)
	if err != nil {
		return nil, err
	}
	defer img.close()
	t, err := s.install(ctx, img, name, o)
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	return t, nil
}

// install unpacks the layers the store lacks and writes the template. The
// layers are unpacked without the store's lock; each is pinned (its
// directory flock'ed shared) from the moment it is found or made until the
// template that names it is written, so a GC in between leaves it alone.
func (s *Store) install(ctx context.Context, img *image, name string, o Options) (_ *Template, err error) {
	cfg, err := v1.ParseConfigFile(bytes.NewReader(img.config))
	if err != nil {
		return nil, invalidf("image config: %v", err)
	}
	if (cfg.OS != "" && cfg.OS != platform.OS) || (cfg.Architecture != "" && cfg.Architecture != platform.Architecture) {
		return nil, invalidf("the image is for %s/%s, not %s", cfg.OS, cfg.Architecture, platform)
	}
	hexes, err := layerHexes(cfg, len(img.layers))
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(img.config)

	b := newBudget(o)
	var pins []*os.File
	var added []string // layers this import put in the store
	defer func() {
		for _, p := range pins {
			p.Close()
		}
		if err != nil && len(added) > 0 {
			s.dropLayers(added)
		}
	}()
	var size int64
	counted := map[string]bool{}
	for i, hx := range hexes {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		label := fmt.Sprintf("layer %d/%d %s", i+1, len(hexes), shortDigest("sha256:"+hx))
		pin, info, ours, err := s.ensureLayer(ctx, hx, img.layers[i], b, label, o)
		if err != nil {
			return nil, err
		}
		pins = append(pins, pin)
		if ours {
			added = append(added, hx)
		}
		if !counted[hx] {
			counted[hx] = true
			size += info.Size
		}
	}
	t := &Template{
		Name: name,
		ID:   "sha256:" + hex.EncodeToString(sum[:]),
		Config: Config{
			Env:        cfg.Config.Env,
			WorkingDir: cfg.Config.WorkingDir,
			User:       cfg.Config.User,
			Entrypoint: cfg.Config.Entrypoint,
			Cmd:        cfg.Config.Cmd,
			Labels:     cfg.Config.Labels,
		},
		Size:    size,
		Created: time.Now().UTC().Truncate(time.Second),
		Source:  img.source,
	}
	for _, hx := range hexes {
		t.Layers = append(t.Layers, "sha256:"+hx)
	}
	if err := s.commitTemplate(t, img.config, o); err != nil {
		return nil, err
	}
	return t, nil
}

// maxLayers is overlayfs's limit on lower layers (OVL_MAX_STACK). It also
// bounds the descriptors an import holds (one pin per layer).
const maxLayers = 500

// layerHexes checks the config's diff IDs, which name directories.
func layerHexes(cfg *v1.ConfigFile, layers int) ([]string, error) {
	ids := cfg.RootFS.DiffIDs
	if len(ids) == 0 {
		return nil, invalidf("the image has no layers")
	}
	if len(ids) != layers {
		return nil, invalidf("the image config lists %d layers but its manifest %d", len(ids), layers)
	}
	if len(ids) > maxLayers {
		return nil, invalidf("the image has %d layers; overlayfs stacks at most %d", len(ids), maxLayers)
	}
	hexes := make([]string, len(ids))
	for i, d := range ids {
		h, err := digestHex(d.String())
		if err != nil {
			return nil, fmt.Errorf("image config: %w", err)
		}
		hexes[i] = h
	}
	return hexes, nil
}

// layerInfo is layers/<hex>.json.
type layerInfo struct {
	DiffID  string `json:"diffID"`
	Size    int64  `json:"size"`    // bytes of regular files
	Files   int    `json:"files"`   // entries made
	TarSize int64  `json:"tarSize"` // bytes of the uncompressed layer tar (for Export)
}

// ensureLayer pins the layer hx, unpacking it first if the store lacks it.
// ours says this import put it in the store.
func (s *Store) ensureLayer(ctx context.Context, hx string, open func() (io.ReadCloser, error), b *budget, label string, o Options) (pin *os.File, info layerInfo, ours bool, err error) {
	// Within the process, one unpack of a layer at a time: a second import
	// of the same layer waits and then finds it. (Across processes both may
	// unpack it; the first to commit wins and the other's copy is dropped.)
	unlock := lockKey(s.dir + "\x00" + hx)
	defer unlock()
	if pin, info, ok, err := s.pinLayer(hx); err != nil || ok {
		if ok {
			o.progress("%s reused", label)
		}
		return pin, info, false, err
	}
	st, err := s.newStage()
	if err != nil {
		return nil, layerInfo{}, false, err
	}
	defer st.discard()
	info, stats, err := s.unpackLayer(ctx, st, hx, open, b, label)
	if err != nil {
		return nil, layerInfo{}, false, err
	}
	o.progress("%s %s", label, units.HumanSize(info.TarSize))
	if stats.dropped > 0 {
		o.progress("%s: dropped %d xattr(s) outside user.* (trusted.*, security.*, system.*, user.overlay.*)", label, stats.dropped)
	}
	if stats.skipped > 0 {
		o.progress("%s: skipped %d device, FIFO or other special entr(ies)", label, stats.skipped)
	}
	return s.commitLayer(st, hx, info)
}

// unpackLayer unpacks the layer stream into the stage and checks it
// against its diff ID.
func (s *Store) unpackLayer(ctx context.Context, st *stage, hx string, open func() (io.ReadCloser, error), b *budget, label string) (layerInfo, layerStats, error) {
	rc, err := open()
	if err != nil {
		return layerInfo{}, layerStats{}, fmt.Errorf("%s: %w", label, streamError(err))
	}
	defer rc.Close()
	meta, err := os.OpenFile(filepath.Join(st.dir, "tarmeta"), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return layerInfo{}, layerStats{}, err
	}
	defer meta.Close()
	root, err := os.OpenRoot(filepath.Join(st.dir, "root"))
	if err != nil {
		return layerInfo{}, layerStats{}, err
	}
	defer root.Close()

	start := b.read
	cr := &countingReader{ctx: ctx, r: rc, b: b}
	h := sha256.New()
	rw := newRecipeWriter(meta)
	rec := &recorder{r: io.TeeReader(cr, h), rw: rw}
	u := newUnpacker(root, label, b, rec)
	err = u.run(tar.NewReader(rec))
	if err == nil {
		// The diff ID covers the whole stream, also what follows the end
		// of the tar (zero blocks, padding to a record).
		if _, rerr := io.Copy(io.Discard, rec); rerr != nil {
			err = &tarError{rerr}
		}
	}
	var te *tarError
	switch {
	case errors.As(err, &te) && cr.err != nil:
		return layerInfo{}, layerStats{}, fmt.Errorf("%s: %w", label, cr.err)
	case errors.As(err, &te):
		return layerInfo{}, layerStats{}, invalidf("%s: bad tar: %v", label, te.err)
	case err != nil:
		return layerInfo{}, layerStats{}, err
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != hx {
		return layerInfo{}, layerStats{}, invalidf("%s: the layer does not match its diff ID (its sha256 is %s)", label, got)
	}
	if err := rw.finish(); err != nil {
		return layerInfo{}, layerStats{}, err
	}
	if err := meta.Close(); err != nil {
		return layerInfo{}, layerStats{}, err
	}
	// The layer is about to get its real name, which says it is complete:
	// make it durable first.
	if err := unix.Syncfs(int(st.lock.Fd())); err != nil {
		return layerInfo{}, layerStats{}, fmt.Errorf("%s: sync: %w", label, err)
	}
	info := layerInfo{DiffID: "sha256:" + hx, Size: u.stats.size, Files: u.stats.files, TarSize: b.read - start}
	return info, u.stats, nil
}

// commitLayer gives the unpacked layer its real name, under the store's
// lock, and pins it. If the layer appeared meanwhile (another process), that
// one is pinned and the stage is dropped.
func (s *Store) commitLayer(st *stage, hx string, info layerInfo) (*os.File, layerInfo, bool, error) {
	unlock, err := s.lock(unix.LOCK_EX)
	if err != nil {
		return nil, layerInfo{}, false, err
	}
	defer unlock()
	if pin, have, ok, err := s.pinLayer(hx); err != nil || ok {
		return pin, have, false, err
	}
	dir := s.path(layersDir, hx)
	// A directory without a valid record is a leftover (or tampering):
	// no template can use it, so it makes way.
	if _, err := os.Lstat(dir); err == nil {
		aside := s.path(layersDir, tmpPrefix+randomName())
		if err := os.Rename(dir, aside); err != nil {
			return nil, layerInfo{}, false, err
		}
		os.RemoveAll(aside)
	}
	rec, err := json.Marshal(info)
	if err != nil {
		return nil, layerInfo{}, false, err
	}
	if err := os.Rename(filepath.Join(st.dir, "tarmeta"), dir+".tarmeta"); err != nil {
		return nil, layerInfo{}, false, err
	}
	// The record goes first and the directory last: a layer directory
	// under its real name always has its record.
	if err := writeFileAtomic(dir+".json", rec); err != nil {
		return nil, layerInfo{}, false, err
	}
	if err := os.Rename(filepath.Join(st.dir, "root"), dir); err != nil {
		return nil, layerInfo{}, false, err
	}
	if err := syncDir(s.path(layersDir)); err != nil {
		return nil, layerInfo{}, false, err
	}
	pin, have, ok, err := s.pinLayer(hx)
	if err == nil && !ok {
		err = fmt.Errorf("layer %s vanished while it was committed", shortDigest(info.DiffID))
	}
	return pin, have, err == nil, err
}

// pinLayer finds the layer hx and flocks its directory shared, which GC
// respects. ok is false when the store has no complete layer hx.
func (s *Store) pinLayer(hx string) (pin *os.File, info layerInfo, ok bool, err error) {
	dir := s.path(layersDir, hx)
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
		return nil, layerInfo{}, false, nil
	}
	if err != nil {
		return nil, layerInfo{}, false, fmt.Errorf("layer %s: %w", hx, err)
	}
	f := os.NewFile(uintptr(fd), dir)
	if err := flock(fd, unix.LOCK_SH); err != nil {
		f.Close()
		return nil, layerInfo{}, false, fmt.Errorf("layer %s: %w", hx, err)
	}
	// GC may have moved it aside between the open and the lock.
	if !stillAt(f, dir) {
		f.Close()
		return nil, layerInfo{}, false, nil
	}
	info, err = s.readLayerInfo(hx)
	if err != nil {
		f.Close()
		return nil, layerInfo{}, false, nil // no valid record: not a complete layer
	}
	return f, info, true, nil
}

func (s *Store) readLayerInfo(hx string) (layerInfo, error) {
	var info layerInfo
	b, err := os.ReadFile(s.path(layersDir, hx+".json"))
	if err != nil {
		return info, err
	}
	if err := json.Unmarshal(b, &info); err != nil {
		return info, fmt.Errorf("layer record %s: %w", hx, err)
	}
	if info.DiffID != "sha256:"+hx {
		return info, fmt.Errorf("layer record %s names %s", hx, info.DiffID)
	}
	return info, nil
}

// stillAt tells whether the open file f is still what path names.
func stillAt(f *os.File, path string) bool {
	var a, b unix.Stat_t
	if unix.Fstat(int(f.Fd()), &a) != nil || unix.Lstat(path, &b) != nil {
		return false
	}
	return a.Dev == b.Dev && a.Ino == b.Ino
}

// commitTemplate writes the image config and the template, replacing any
// template of that name; the replaced template's layers are then collected.
func (s *Store) commitTemplate(t *Template, config []byte, o Options) error {
	data, err := json.MarshalIndent(t, "", "  ")
	if err != nil {
		return err
	}
	unlock, err := s.lock(unix.LOCK_EX)
	if err != nil {
		return err
	}
	defer unlock()
	cfgPath := s.path(configsDir, t.ID[len("sha256:"):]+".json")
	if _, err := os.Stat(cfgPath); err != nil {
		if err := writeFileAtomic(cfgPath, config); err != nil {
			return fmt.Errorf("write image config: %w", err)
		}
	}
	_, err = s.readTemplate(t.Name)
	replaced := err == nil
	if err := writeFileAtomic(s.path(templatesDir, t.Name+".json"), data); err != nil {
		return fmt.Errorf("write template %q: %w", t.Name, err)
	}
	if replaced {
		// The import succeeded; a failed collection only leaves garbage
		// for the next GC.
		if _, err := s.gcLocked(nil); err != nil {
			o.progress("gc after replacing %q: %v", t.Name, err)
		}
	}
	return nil
}

// dropLayers removes, after a failed import, the layers it added that
// nothing uses.
func (s *Store) dropLayers(hexes []string) {
	unlock, err := s.lock(unix.LOCK_EX)
	if err != nil {
		return
	}
	defer unlock()
	only := map[string]bool{}
	for _, h := range hexes {
		only[h] = true
	}
	s.gcLocked(only)
}

// stage is a layer being unpacked: layers/.tmp-<random>/ holding root/
// (the layer) and tarmeta (its recipe), flock'ed so that GC leaves it alone.
type stage struct {
	dir  string
	lock *os.File
}

func (s *Store) newStage() (*stage, error) {
	for range 3 {
		dir := s.path(layersDir, tmpPrefix+randomName())
		if err := os.Mkdir(dir, 0o700); err != nil {
			return nil, err
		}
		f, err := os.Open(dir)
		if err != nil {
			return nil, err
		}
		if err := flock(int(f.Fd()), unix.LOCK_EX); err != nil {
			f.Close()
			return nil, err
		}
		// A GC may have found it before it was locked, and removed it.
		if !stillAt(f, dir) {
			f.Close()
			continue
		}
		st := &stage{dir: dir, lock: f}
		root := filepath.Join(dir, "root")
		if err := os.Mkdir(root, 0o755); err != nil {
			st.discard()
			return nil, err
		}
		// The layer root's mode, unless the archive sets it ("./").
		if err := os.Chmod(root, 0o755); err != nil {
			st.discard()
			return nil, err
		}
		return st, nil
	}
	return nil, errors.New("cannot make a staging directory in " + s.path(layersDir))
}

// discard removes what is left of the stage (nothing once committed).
func (st *stage) discard() {
	os.RemoveAll(st.dir)
	st.lock.Close()
}

// layerLocks serialise the unpacking of one layer within the process.
var layerLocks = struct {
	sync.Mutex
	m map[string]*keyMutex
}{m: map[string]*keyMutex{}}

type keyMutex struct {
	sync.Mutex
	refs int
}

func lockKey(key string) (unlock func()) {
	layerLocks.Lock()
	km := layerLocks.m[key]
	if km == nil {
		km = &keyMutex{}
		layerLocks.m[key] = km
	}
	km.refs++
	layerLocks.Unlock()
	km.Lock()
	return func() {
		km.Unlock()
		layerLocks.Lock()
		km.refs--
		if km.refs == 0 {
			delete(layerLocks.m, key)
		}
		layerLocks.Unlock()
	}
}
