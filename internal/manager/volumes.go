package manager

import (
	"crypto/subtle"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/volume"
	"github.com/cagehq/cage/internal/wall"
)

// Volumes (E2B's Volume API): a key's named file systems (internal/volume
// keeps their bytes), each with a bearer token of its own for the content
// API, mounted into that key's sandboxes at create. A volume mounted by a
// sandbox that exists (running, paused, or being created) cannot be
// deleted: its record names the volume, and a resume mounts it again.

// volumeName is E2B's rule for a volume's name, with a length bound.
// Compiled at first use: a counted repetition compiles into a program of
// its size, work every cage process (cage run included) paid at its start.
var volumeName = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-zA-Z0-9_-]{1,128}$`) })

// DefaultMaxVolumes is how many volumes a key may have unless configured.
const DefaultMaxVolumes = 100

// MaxVolumeMounts is how many volumes one sandbox may mount.
const MaxVolumeMounts = 32

// ErrUnauthorized: a volume's token does not open it.
var ErrUnauthorized = errors.New("unauthorized")

// VolumeMount asks for a volume (by name) mounted at a path.
type VolumeMount struct {
	Name, Path string
}

// volumeLock is one owner's lock of its volumes: a create or resume that
// mounts them (read) against their creation and deletion (write). It is
// the owner's alone, since only the owner's calls name its volumes:
// before (found by review, 2026-12-03), one lock for the whole daemon,
// held by a create for its whole start (a restore of hundreds of MiB, a
// VM's boot), made every tenant's volume create and delete wait for
// another tenant's creates, and every create with a volume behind those.
type volumeLock struct {
	sync.RWMutex
	refs int // holders and waiters (guarded by Manager.volMu)
}

// lockVolumes takes owner's volume lock (write: to create or delete one
// of its volumes; read: to mount them) and returns its unlock. A lock
// lives as long as someone holds or waits for it.
func (m *Manager) lockVolumes(owner string, write bool) (unlock func()) {
	m.volMu.Lock()
	if m.volLocks == nil {
		m.volLocks = map[string]*volumeLock{}
	}
	l := m.volLocks[owner]
	if l == nil {
		l = &volumeLock{}
		m.volLocks[owner] = l
	}
	l.refs++
	m.volMu.Unlock()
	if write {
		l.Lock()
	} else {
		l.RLock()
	}
	return func() {
		if write {
			l.Unlock()
		} else {
			l.RUnlock()
		}
		m.volMu.Lock()
		if l.refs--; l.refs == 0 {
			delete(m.volLocks, owner)
		}
		m.volMu.Unlock()
	}
}

func (m *Manager) volumes() (*volume.Manager, error) {
	if m.cfg.Volumes == nil {
		return nil, fmt.Errorf("%w: this server keeps no volumes", sandbox.ErrUnavailable)
	}
	return m.cfg.Volumes, nil
}

// CreateVolume makes a volume named name for keyID. A name the key has
// already, or one outside E2B's rule, is ErrInvalid (E2B answers 400).
func (m *Manager) CreateVolume(keyID, name string) (*store.Volume, error) {
	vm, err := m.volumes()
	if err != nil {
		return nil, err
	}
	if !volumeName().MatchString(name) {
		return nil, fmt.Errorf("%w: volume name %.140q: want letters, digits, - and _ (1 to 128)", ErrInvalid, name)
	}
	defer m.lockVolumes(keyID, true)()
	if _, err := m.cfg.Store.VolumeByName(keyID, name); err == nil {
		return nil, fmt.Errorf("%w: a volume is named %q already", ErrInvalid, name)
	}
	max := m.cfg.MaxVolumes
	if max == 0 {
		max = DefaultMaxVolumes
	}
	if n, err := m.cfg.Store.CountVolumes(keyID); err != nil {
		return nil, err
	} else if n >= max {
		return nil, fmt.Errorf("%w: this key has %d volumes, the server's maximum; delete one first", ErrInvalid, n)
	}
	v := &store.Volume{ID: ids.NewID(), KeyID: keyID, Name: name, Token: ids.NewToken(), Size: vm.Size(), CreatedAt: time.Now()}
	if err := vm.Create(v.ID); err != nil {
		return nil, fmt.Errorf("create volume %q: %w", name, err)
	}
	if err := m.cfg.Store.InsertVolume(v); err != nil {
		_ = vm.Remove(v.ID)
		if errors.Is(err, store.ErrConflict) {
			return nil, fmt.Errorf("%w: a volume is named %q already", ErrInvalid, name)
		}
		return nil, err
	}
	m.cfg.Audit.Record(audit.Event{Kind: audit.KindVolumeCreate, KeyID: keyID, Detail: map[string]any{"volume": v.ID, "name": name}})
	m.log.Info("volume created", "volume", v.ID, "name", name)
	return v, nil
}

// Volumes lists keyID's volumes.
func (m *Manager) Volumes(keyID string) ([]*store.Volume, error) {
	return m.cfg.Store.ListVolumes(keyID)
}

// Volume returns keyID's volume id.
func (m *Manager) Volume(keyID, id string) (*store.Volume, error) {
	v, err := m.cfg.Store.GetVolume(keyID, id)
	if errors.Is(err, store.ErrNotFound) {
		return nil, fmt.Errorf("%w: volume %q", ErrNotFound, id)
	}
	return v, err
}

// DeleteVolume removes keyID's volume id and its files; a volume a
// sandbox mounts is ErrConflict.
func (m *Manager) DeleteVolume(keyID, id string) error {
	vm, err := m.volumes()
	if err != nil {
		return err
	}
	defer m.lockVolumes(keyID, true)()
	if _, err := m.Volume(keyID, id); err != nil {
		return err
	}
	users, err := m.cfg.Store.SandboxesMounting(id)
	if err != nil {
		return err
	}
	if len(users) > 0 {
		return fmt.Errorf("%w: volume %s is mounted by sandbox %s; kill it first", ErrConflict, id, strings.Join(users, ", "))
	}
	// The files first: a content request in progress (an upload may last
	// an hour) holds the volume, and removed under it, its file system and
	// the image's blocks stayed on the host's disk as long as it lasted,
	// outside the key's volumes (found by review, 2026-12-04). Then a
	// content request that comes meanwhile finds no volume.
	if err := vm.Remove(id); errors.Is(err, volume.ErrBusy) {
		return fmt.Errorf("%w: %v", ErrConflict, err)
	} else if err != nil {
		return err
	}
	if err := m.cfg.Store.DeleteVolume(id); err != nil {
		return err
	}
	m.cfg.Audit.Record(audit.Event{Kind: audit.KindVolumeDelete, KeyID: keyID, Detail: map[string]any{"volume": id}})
	return nil
}

// VolumeGrant is a content request's right to a volume, given by
// CheckVolumeToken: the volume's record (its owner, for the owner's rate)
// and Open. Nothing of the host's is done until Open: a request the
// caller refuses after the check (over its owner's rate) mounts nothing.
type VolumeGrant struct {
	Volume store.Volume
	vm     *volume.Manager
}

// Open opens the volume (mounting it on the host if it is not), held
// against its removal while the request lasts. The caller closes the
// root.
func (g *VolumeGrant) Open() (*volume.Root, error) { return g.vm.OpenHeld(g.Volume.ID) }

// CheckVolumeToken grants volume id's content API to token if it is the
// volume's token (compared in constant time); any other token, and an
// unknown volume, is ErrUnauthorized.
func (m *Manager) CheckVolumeToken(id, token string) (*VolumeGrant, error) {
	vm, err := m.volumes()
	if err != nil {
		return nil, err
	}
	v, err := m.cfg.Store.GetVolume("", id)
	want := ids.NewToken() // compared all the same: an unknown id costs what a known one does
	if err == nil {
		want = v.Token
	} else if !errors.Is(err, store.ErrNotFound) {
		return nil, err
	}
	if subtle.ConstantTimeCompare([]byte(token), []byte(want)) != 1 || err != nil {
		return nil, fmt.Errorf("%w: the token does not open volume %q", ErrUnauthorized, id)
	}
	return &VolumeGrant{Volume: *v, vm: vm}, nil
}

// openMounts resolves a create's volume mounts (names of keyID's volumes)
// and opens them; the caller closes the roots. The caller holds keyID's
// volume lock (lockVolumes).
func (m *Manager) openMounts(keyID string, req []VolumeMount) ([]store.VolumeMount, []wall.Volume, error) {
	if len(req) == 0 {
		return nil, nil, nil
	}
	if len(req) > MaxVolumeMounts {
		return nil, nil, fmt.Errorf("%w: %d volume mounts; at most %d", ErrInvalid, len(req), MaxVolumeMounts)
	}
	vm, err := m.volumes()
	if err != nil {
		return nil, nil, err
	}
	var recs []store.VolumeMount
	var vols []wall.Volume
	fail := func(err error) ([]store.VolumeMount, []wall.Volume, error) {
		closeVolumes(vols)
		return nil, nil, err
	}
	for _, r := range req {
		p, err := sandbox.CheckVolumePath(r.Path)
		if err != nil {
			return fail(err)
		}
		v, err := m.cfg.Store.VolumeByName(keyID, r.Name)
		if errors.Is(err, store.ErrNotFound) {
			return fail(fmt.Errorf("%w: volume %q does not exist (create it first: POST /volumes)", ErrInvalid, r.Name))
		}
		if err != nil {
			return fail(err)
		}
		root, err := vm.Open(v.ID)
		if err != nil {
			return fail(err)
		}
		vols = append(vols, wall.Volume{Path: p, Root: root.File()})
		recs = append(recs, store.VolumeMount{ID: v.ID, Name: v.Name, Path: p})
	}
	return recs, vols, nil
}

// reopenMounts opens the volumes a sandbox's record mounts (a resume).
func (m *Manager) reopenMounts(rec *store.Sandbox) ([]wall.Volume, error) {
	if len(rec.VolumeMounts) == 0 {
		return nil, nil
	}
	vm, err := m.volumes()
	if err != nil {
		return nil, err
	}
	var vols []wall.Volume
	for _, mt := range rec.VolumeMounts {
		root, err := vm.Open(mt.ID)
		if err != nil {
			closeVolumes(vols)
			return nil, fmt.Errorf("sandbox %s: volume %s: %w", rec.ID, mt.Name, err)
		}
		vols = append(vols, wall.Volume{Path: mt.Path, Root: root.File()})
	}
	return vols, nil
}

func closeVolumes(vols []wall.Volume) {
	for _, v := range vols {
		v.Root.Close()
	}
}
