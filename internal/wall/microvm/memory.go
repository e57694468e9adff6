package microvm

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/template"
)

// Snapshot memories. Every VM this process restores from a snapshot maps
// the snapshot's RAM private from one sealed memfd, loaded from its
// memory file once, so that they share its pages. QEMU 7.2 opens a memory
// file for writing even to map it private; a memfd sealed against writes,
// growing and shrinking is one it may open so but can never change, so no
// VM can plant anything in the RAM the next ones start from.
//
// The host holds a memfd only to hand it to QEMUs: a restore holds it
// (memory) until its QEMU has its own descriptor (vm.Restore returned),
// and each QEMU keeps the pages it maps for its own life. A snapshot no VM
// will be restored from again is dropped: the host lets go of its memfd
// once the last restore that holds it has (never while one does), and its
// pages go with the last QEMU that maps them. A snapshot is dropped when
//
//   - a newer one of its shape replaces it (removeSuperseded);
//   - its memory file is gone or another (another process superseded or
//     rebuilt it, or its cache was removed): restoring the old RAM with a
//     new state file would start a guest from two different boots;
//   - none of the templates restored from it is its image any more (each
//     was removed or imported again);
//   - no restore has taken it for memIdle, or maxMemories others were
//     taken since (evict): each shape of VM (its RAM class, vCPUs, NIC,
//     template) has a snapshot of its own, and a tenant choosing limits
//     may make many; one not kept in memory is loaded from its file
//     again at its next restore.
//
// sweepMemories checks the last three at every restore and, while any
// memfd is held, every sweepEvery.

// memEntry is one snapshot's RAM in memory.
type memEntry struct {
	f       *os.File
	file    [2]uint64 // the memory file it was loaded from: device, inode
	refs    int       // restores holding f
	used    time.Time // when a restore last took it
	dropped bool      // superseded: f is closed when refs is 0
	image   string    // the template image of its disk (imgstore's ID)
	// names are the templates restored from it, each with how to read it
	// again from its store.
	names map[string]func() (string, error)
}

// memories holds, per snapshot directory, its RAM.
var memories = struct {
	sync.Mutex
	m        map[string]*memEntry
	sweeping bool
}{m: map[string]*memEntry{}}

// sweepEvery is how often, at most, a dropped template's snapshot memory
// lingers when no VM is restored.
const sweepEvery = time.Minute

// memIdle and maxMemories bound the snapshot memories kept: one no
// restore has taken for memIdle is let go, and past maxMemories the
// least recently taken (a pool's refills take theirs).
var (
	memIdle     = 10 * time.Minute
	maxMemories = 8
)

// memory returns the snapshot's RAM as a sealed memfd, loaded once per
// process, for a restore of template t, and the release of the restore's
// hold on it, to call once its QEMU has started (or failed to).
func (s snapshot) memory(t *template.Template) (*os.File, func(), error) {
	sweepMemories()
	if f, rel := holdMemory(s.dir, t); f != nil {
		return f, rel, nil
	}
	mu, _ := snapshotLocks.LoadOrStore("memory "+s.dir, new(sync.Mutex))
	mu.(*sync.Mutex).Lock()
	defer mu.(*sync.Mutex).Unlock()
	if f, rel := holdMemory(s.dir, t); f != nil {
		return f, rel, nil
	}
	f, id, err := loadSealed(filepath.Join(s.dir, snapMemory))
	if err != nil {
		return nil, nil, fmt.Errorf("load the snapshot's memory: %w", err)
	}
	e := &memEntry{f: f, file: id, names: map[string]func() (string, error){}}
	if t != nil && t.Image != nil {
		e.image = t.Image.Info.ID
	}
	memories.Lock()
	defer memories.Unlock()
	if had := memories.m[s.dir]; had != nil {
		// Loaded meanwhile by a restore that went through the lock
		// before it was let go (forgetSnapshot).
		f.Close()
		hf, rel := had.hold(t)
		return hf, rel, nil
	}
	memories.m[s.dir] = e
	if !memories.sweeping {
		memories.sweeping = true
		go sweepLoop()
	}
	f, rel := e.hold(t)
	return f, rel, nil
}

// holdMemory takes a hold on dir's memory for a restore of t, if it is
// loaded.
func holdMemory(dir string, t *template.Template) (*os.File, func()) {
	memories.Lock()
	defer memories.Unlock()
	if e := memories.m[dir]; e != nil {
		return e.hold(t)
	}
	return nil, nil
}

// hold takes a hold on e for a restore of t and names t among its
// templates; the release is safe to call more than once. memories is
// locked.
func (e *memEntry) hold(t *template.Template) (*os.File, func()) {
	e.refs++
	e.used = time.Now()
	if t != nil && t.Image != nil && t.Image.Store != nil && t.Image.Info.ID == e.image {
		name, store := t.Image.Info.Name, t.Image.Store
		e.names[name] = func() (string, error) {
			it, err := store.Get(name)
			if err != nil {
				return "", err
			}
			return it.ID, nil
		}
	}
	var once sync.Once
	return e.f, func() {
		once.Do(func() {
			memories.Lock()
			defer memories.Unlock()
			e.refs--
			e.closeIfDone()
		})
	}
}

// closeIfDone closes a dropped snapshot's memfd once no restore holds it;
// memories is locked.
func (e *memEntry) closeIfDone() {
	if e.dropped && e.refs == 0 && e.f != nil {
		e.f.Close()
		e.f = nil
	}
}

// dropMemory drops dir's memory (see above); memories is locked.
func dropMemory(dir string) {
	if e := memories.m[dir]; e != nil {
		delete(memories.m, dir)
		e.dropped = true
		e.closeIfDone()
	}
}

// forgetSnapshot drops the memory of a snapshot removed from disk.
func forgetSnapshot(dir string) {
	memories.Lock()
	dropMemory(dir)
	memories.Unlock()
}

// sweepMemories drops the memories of snapshots whose memory file is gone
// or another, or whose templates have all moved on, and reports whether
// any is left.
func sweepMemories() bool {
	type check struct {
		dir   string
		e     *memEntry
		file  [2]uint64
		image string
		names map[string]func() (string, error)
	}
	memories.Lock()
	checks := make([]check, 0, len(memories.m))
	for dir, e := range memories.m {
		c := check{dir: dir, e: e, file: e.file, image: e.image, names: make(map[string]func() (string, error), len(e.names))}
		for n, f := range e.names {
			c.names[n] = f
		}
		checks = append(checks, c)
	}
	memories.Unlock()
	// Outside the lock: a stat, and a template's record read per name.
	gone := map[*memEntry]bool{}
	moved := map[*memEntry][]string{}
	for _, c := range checks {
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(c.dir, snapMemory), &st); err != nil || [2]uint64{uint64(st.Dev), st.Ino} != c.file {
			gone[c.e] = true
			continue
		}
		for n, current := range c.names {
			if id, err := current(); err != nil || id != c.image {
				moved[c.e] = append(moved[c.e], n)
			}
		}
	}
	memories.Lock()
	defer memories.Unlock()
	for _, c := range checks {
		if memories.m[c.dir] != c.e {
			continue // dropped, or loaded again, meanwhile
		}
		if gone[c.e] {
			dropMemory(c.dir)
			continue
		}
		if len(moved[c.e]) == 0 {
			continue
		}
		for _, n := range moved[c.e] {
			delete(c.e.names, n)
		}
		// A restore of a template that is still its image meanwhile
		// named it again, or none is left.
		if len(c.e.names) == 0 {
			dropMemory(c.dir)
		}
	}
	evict(time.Now())
	return len(memories.m) > 0
}

// evict drops the memories no restore has taken for memIdle and, past
// maxMemories, the least recently taken. A restore holding one keeps its
// memfd until it lets go, and a running VM the pages it maps. memories
// is locked.
func evict(now time.Time) {
	type taken struct {
		dir  string
		used time.Time
	}
	var kept []taken
	for dir, e := range memories.m {
		if now.Sub(e.used) >= memIdle {
			dropMemory(dir)
			continue
		}
		kept = append(kept, taken{dir, e.used})
	}
	if len(kept) <= maxMemories {
		return
	}
	sort.Slice(kept, func(i, j int) bool { return kept[i].used.Before(kept[j].used) })
	for _, k := range kept[:len(kept)-maxMemories] {
		dropMemory(k.dir)
	}
}

// sweepLoop sweeps every sweepEvery while any memory is held.
func sweepLoop() {
	for {
		time.Sleep(sweepEvery)
		memories.Lock()
		if len(memories.m) == 0 {
			memories.sweeping = false
			memories.Unlock()
			return
		}
		memories.Unlock()
		sweepMemories()
	}
}

// loadSealed copies file p into a memfd, holes left as holes, and seals
// it; it returns p's device and inode too.
func loadSealed(p string) (*os.File, [2]uint64, error) {
	var id [2]uint64
	src, err := os.Open(p)
	if err != nil {
		return nil, id, err
	}
	defer src.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(src.Fd()), &st); err != nil {
		return nil, id, err
	}
	id = [2]uint64{uint64(st.Dev), st.Ino}
	fd, err := unix.MemfdCreate("cage-snapshot", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, id, err
	}
	dst := os.NewFile(uintptr(fd), "cage-snapshot")
	if err := copySparse(dst, src, st.Size); err != nil {
		dst.Close()
		return nil, id, err
	}
	seals := unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE | unix.F_SEAL_SEAL
	if _, err := unix.FcntlInt(dst.Fd(), unix.F_ADD_SEALS, seals); err != nil {
		dst.Close()
		return nil, id, fmt.Errorf("seal: %w", err)
	}
	return dst, id, nil
}

// copySparse copies size bytes of src into dst, skipping src's holes.
func copySparse(dst, src *os.File, size int64) error {
	if err := dst.Truncate(size); err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(src.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole is left
		}
		if err != nil {
			return err
		}
		hole, err := unix.Seek(int(src.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		for off = data; off < hole; {
			n, err := src.ReadAt(buf[:min(int64(len(buf)), hole-off)], off)
			if n > 0 {
				if _, werr := dst.WriteAt(buf[:n], off); werr != nil {
					return werr
				}
				off += int64(n)
			}
			if err != nil && !(errors.Is(err, io.EOF) && off >= hole) {
				return err
			}
		}
	}
	return nil
}
