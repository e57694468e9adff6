// Package volume is cage's volumes (E2B's Volume API): file systems a
// tenant creates by name, reads and writes through the content API, and
// mounts into sandboxes when it creates them; a volume outlives every
// sandbox that mounts it.
//
// A volume is an ext4 file system in a sparse image file of the volume's
// size (its quota; see loop.go), mounted once on the host under the run
// directory, where only root can reach it. The walls take that mount as a
// descriptor (Root.File) and give each sandbox a copy of it (idmapped onto
// the sandbox's uid range where the wall has one), so that owners are the
// same in every sandbox on every wall: a file user (uid 1000) wrote in one
// sandbox is user's in the next.
//
// Sandboxes write into a volume, so the host treats its contents as
// hostile: every operation of the content API (fs.go) resolves paths from
// a descriptor of the volume's root with openat2 RESOLVE_BENEATH,
// RESOLVE_NO_SYMLINKS and RESOLVE_NO_XDEV, acts on the last component with
// *at calls that do not follow it, opens files O_NOFOLLOW|O_NONBLOCK and
// checks their type, and bounds walks in depth and entries.
package volume

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/inside"
)

// Error kinds; the API maps them to statuses.
var (
	ErrUnavailable = errors.New("unavailable on this host")
	ErrNotFound    = errors.New("not found")
	ErrInvalid     = errors.New("invalid")
	ErrExists      = errors.New("already exists")
	ErrNoSpace     = errors.New("the volume is full")
	ErrTooLarge    = errors.New("too large")
	ErrBusy        = errors.New("in use")
)

// UserID is the uid and gid that owns a new volume's root and, unless a
// request says otherwise, what the content API writes: the sandboxes'
// user.
const UserID = inside.UserUID

// DefaultSize is a volume's size when the daemon's config sets none.
const DefaultSize int64 = 1 << 30

// MinSize is the smallest volume ext4 makes comfortably.
const MinSize int64 = 8 << 20

// Config says where volumes live.
type Config struct {
	Data   string // DATA: images under DATA/volumes/ID
	RunDir string // RUN: host mounts under RUN/volumes/ID
	Size   int64  // bytes of a new volume (0: DefaultSize)
	Log    *slog.Logger
}

// Manager makes, mounts and removes volumes on this host.
type Manager struct {
	cfg  Config
	mu   sync.Mutex     // mounts and removals
	held map[string]int // volume id -> roots open for content requests (OpenHeld), under mu
}

// New returns a manager of the volumes under cfg's directories.
func New(cfg Config) *Manager {
	if cfg.Size <= 0 {
		cfg.Size = DefaultSize
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Manager{cfg: cfg}
}

// Size is the size of a volume created now.
func (m *Manager) Size() int64 { return m.cfg.Size }

func (m *Manager) dir(id string) string      { return filepath.Join(m.cfg.Data, "volumes", id) }
func (m *Manager) image(id string) string    { return filepath.Join(m.dir(id), "volume.img") }
func (m *Manager) mountDir(id string) string { return filepath.Join(m.cfg.RunDir, "volumes", id) }

// validID: volume ids are cage's own ([a-z0-9]+), never a client's name.
func validID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}

// Create makes the volume id's image and file system.
func (m *Manager) Create(id string) error {
	if !validID(id) {
		return fmt.Errorf("%w: volume id %q", ErrInvalid, id)
	}
	if err := os.MkdirAll(filepath.Join(m.cfg.Data, "volumes"), 0o700); err != nil {
		return err
	}
	if err := os.Mkdir(m.dir(id), 0o700); err != nil {
		return err
	}
	if err := makeImage(m.image(id), m.cfg.Size); err != nil {
		_ = os.RemoveAll(m.dir(id))
		return err
	}
	// A new volume is empty: mke2fs's lost+found goes (e2fsck makes it
	// again when it needs it).
	r, err := m.Open(id)
	if err == nil {
		err = unix.Unlinkat(r.fd(), "lost+found", unix.AT_REMOVEDIR)
		r.Close()
	}
	if err != nil {
		_ = m.Remove(id)
		return fmt.Errorf("volume %s: %w", id, err)
	}
	return nil
}

// Open returns the root of volume id, mounting it on the host first if it
// is not. The caller closes it.
func (m *Manager) Open(id string) (*Root, error) { return m.open(id, false) }

// open is Open; hold counts the root for OpenHeld in the same hold of mu
// (no Remove between the open and the count).
func (m *Manager) open(id string, hold bool) (*Root, error) {
	if !validID(id) {
		return nil, fmt.Errorf("%w: volume %q", ErrNotFound, id)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	dir := m.mountDir(id)
	if !isMountRoot(dir) {
		// The not-found is the content API's 404, read by the token's
		// holder: it names the volume, not the host's data directory
		// (any other failure is the daemon's log's).
		if _, err := os.Stat(m.image(id)); errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w: volume %q has no image", ErrNotFound, id)
		} else if err != nil {
			return nil, fmt.Errorf("volume %q: %w", id, err)
		}
		if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
			return nil, err
		}
		if err := os.Chmod(filepath.Dir(dir), 0o700); err != nil {
			return nil, err
		}
		if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, err
		}
		if err := mountImage(m.image(id), dir); err != nil {
			return nil, err
		}
		m.cfg.Log.Debug("volume mounted", "volume", id, "at", dir)
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open volume %s: %w", id, err)
	}
	var stx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_BASIC_STATS, &stx); err != nil || stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		unix.Close(fd)
		return nil, fmt.Errorf("volume %s: %s is not its mount", id, dir)
	}
	r := &Root{f: os.NewFile(uintptr(fd), "volume "+id), dev: uint64(stx.Dev_major)<<32 | uint64(stx.Dev_minor)}
	if hold {
		if m.held == nil {
			m.held = map[string]int{}
		}
		m.held[id]++
		var once sync.Once
		r.release = func() {
			once.Do(func() {
				m.mu.Lock()
				defer m.mu.Unlock()
				if m.held[id]--; m.held[id] <= 0 {
					delete(m.held, id)
				}
			})
		}
	}
	return r, nil
}

// OpenHeld is Open for a content request: until the root is closed, the
// volume is not removed (Remove is ErrBusy). A request may last an hour
// (an upload), and its descriptor keeps the file system, and the image's
// blocks on the host's disk, whatever is removed under it.
func (m *Manager) OpenHeld(id string) (*Root, error) { return m.open(id, true) }

// Remove unmounts volume id from the host and deletes its image. The
// caller makes sure no sandbox mounts it; a content request's root
// (OpenHeld) still open is ErrBusy, and nothing is removed.
func (m *Manager) Remove(id string) error {
	if !validID(id) {
		return fmt.Errorf("%w: volume %q", ErrNotFound, id)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if n := m.held[id]; n > 0 {
		return fmt.Errorf("%w: volume %s is open for %d content request(s) in progress; delete it once they end", ErrBusy, id, n)
	}
	dir := m.mountDir(id)
	if err := unmount(dir); err != nil {
		return err
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	// DATA/volumes/ID holds only the host's image file.
	return os.RemoveAll(m.dir(id))
}

// Close detaches every volume's host mount. Sandboxes that mount a volume
// keep their own copies; the next daemon mounts the same loop device again.
func (m *Manager) Close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	ents, _ := os.ReadDir(filepath.Join(m.cfg.RunDir, "volumes"))
	for _, e := range ents {
		dir := m.mountDir(e.Name())
		if err := unmount(dir); err != nil {
			m.cfg.Log.Warn("unmount volume", "volume", e.Name(), "err", err)
			continue
		}
		_ = os.Remove(dir)
	}
}
