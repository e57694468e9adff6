package microvm

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/vm"
	"github.com/cagehq/cage/internal/wall/channel"
	"github.com/cagehq/cage/internal/wall/microvm/guest"
)

// Snapshots: a guest booted once per VM shape (kernel, initramfs with the
// agent, template image, memory, CPUs), its root mounted and the agent
// waiting for a host, saved under <cache>/snapshots/<key>/:
//
//	memory    the guest's RAM, which restored VMs map private
//	state     QEMU's device and CPU state (vm.Snapshot)
//	vm.json   the shape, to check against what is asked
//
// A snapshot is built in a directory of its own and renamed into place
// whole, so a directory under its key is complete.
const (
	snapMemory = "memory"
	snapState  = "state"
	snapShape  = "vm.json"
)

// prepareDiskBytes sizes the upper layer while the snapshot is made; the
// spec resizes it.
const prepareDiskBytes = 64 << 20

// snapshotBuild bounds the making of one snapshot: a cold boot and a save.
const snapshotBuild = 60 * time.Second

// shape is what a snapshot's VM was; a restore must be the same.
type shape struct {
	Kernel    string   `json:"kernel"`
	Version   string   `json:"version"`
	Initramfs string   `json:"initramfs"`
	Disks     []string `json:"disks"`
	// DiskFiles are the disks' identities (size, time, inode): an image
	// made again at the same path (its cache removed, say) is another
	// disk, and a VM restored from memory that knew the old one reads
	// garbage from the new one (ext4: "Bad message").
	DiskFiles []string `json:"disk_files"`
	MemoryMB  int      `json:"memory_mb"`
	CPUs      int      `json:"cpus"`
	Accel     string   `json:"accel"`
	NIC       bool     `json:"nic,omitempty"`    // a virtio-net device (networked sandboxes)
	Append    string   `json:"append,omitempty"` // the kernel's command line, beyond vm's own
	QEMU      string   `json:"qemu"`             // its path, size and time: a new QEMU may not read an old one's state
}

func shapeOf(c vm.Config) (shape, error) {
	qemu, err := exec.LookPath(vm.QEMU)
	if err != nil {
		return shape{}, err
	}
	st, err := os.Stat(qemu)
	if err != nil {
		return shape{}, err
	}
	s := shape{Kernel: c.Kernel.Image(), Version: c.Kernel.Version, Initramfs: c.Initramfs, Disks: c.Disks,
		MemoryMB: max(c.MemoryMB, 256), CPUs: max(c.CPUs, 1), Accel: c.Accel, NIC: c.Tap != nil, Append: c.Append,
		QEMU: qemu + " " + strconv.FormatInt(st.Size(), 10) + " " + strconv.FormatInt(st.ModTime().UnixNano(), 10)}
	if c.MemoryMB != 0 {
		s.MemoryMB = c.MemoryMB
	}
	if s.Accel == "" {
		s.Accel = "tcg"
	}
	if s.DiskFiles, err = diskFiles(c.Disks); err != nil {
		return shape{}, err
	}
	// The kernel may be unpacked again in place.
	if st, err := os.Stat(s.Kernel); err == nil {
		s.Version += " " + strconv.FormatInt(st.Size(), 10) + " " + strconv.FormatInt(st.ModTime().UnixNano(), 10)
	}
	return s, nil
}

// diskFiles returns each disk's identity: size, modification time, inode.
func diskFiles(disks []string) ([]string, error) {
	var ids []string
	for _, d := range disks {
		var st unix.Stat_t
		if err := unix.Stat(d, &st); err != nil {
			return nil, fmt.Errorf("the VM's disk: %w", err)
		}
		ids = append(ids, fmt.Sprintf("%d %d %d", st.Size, st.Mtim.Nano(), st.Ino))
	}
	return ids, nil
}

func (s shape) key() string {
	b, _ := json.Marshal(s)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])[:24]
}

// snapshot is a built snapshot's directory.
type snapshot struct{ dir string }

func (s snapshot) state() string { return filepath.Join(s.dir, snapState) }

// snapshotLocks keeps one process from building a snapshot twice at once.
var snapshotLocks sync.Map // key -> *sync.Mutex

// cachedSnapshot returns the snapshot for VMs like c, built once into
// cache.
func cachedSnapshot(ctx context.Context, cache string, c vm.Config) (snapshot, error) {
	sh, err := shapeOf(c)
	if err != nil {
		return snapshot{}, err
	}
	key := sh.key()
	dir := filepath.Join(cache, "snapshots", key)
	mu, _ := snapshotLocks.LoadOrStore(dir, new(sync.Mutex))
	mu.(*sync.Mutex).Lock()
	defer mu.(*sync.Mutex).Unlock()
	if ok, err := haveSnapshot(dir, sh); err != nil || ok {
		return snapshot{dir}, err
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return snapshot{}, err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), ".build-")
	if err != nil {
		return snapshot{}, err
	}
	defer os.RemoveAll(tmp)
	bctx, cancel := context.WithTimeout(ctx, snapshotBuild)
	defer cancel()
	if err := buildSnapshot(bctx, tmp, c); err != nil {
		return snapshot{}, fmt.Errorf("build a snapshot: %w", err)
	}
	b, err := json.Marshal(sh)
	if err != nil {
		return snapshot{}, err
	}
	if err := os.WriteFile(filepath.Join(tmp, snapShape), b, 0o600); err != nil {
		return snapshot{}, err
	}
	if err := os.Rename(tmp, dir); err != nil {
		// Another process got there first: its snapshot is as good.
		if ok, _ := haveSnapshot(dir, sh); ok {
			return snapshot{dir}, nil
		}
		return snapshot{}, err
	}
	removeSuperseded(filepath.Dir(dir), key, sh)
	return snapshot{dir}, nil
}

// removeSuperseded removes the snapshots in dir of VMs like sh's (same
// image, size, NIC and accelerator) made with another kernel, initramfs
// (agent) or QEMU: no VM will be restored from them again, and their
// memory is let go (memory.go). A process restoring from one as it goes
// falls back to a cold boot.
func removeSuperseded(dir, key string, sh shape) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.Name() == key || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name(), snapShape))
		if err != nil {
			continue
		}
		var old shape
		if json.Unmarshal(b, &old) != nil {
			continue
		}
		if slices.Equal(old.Disks, sh.Disks) && old.MemoryMB == sh.MemoryMB && old.CPUs == sh.CPUs &&
			old.NIC == sh.NIC && old.Accel == sh.Accel {
			_ = os.RemoveAll(filepath.Join(dir, e.Name()))
			forgetSnapshot(filepath.Join(dir, e.Name()))
		}
	}
}

// haveSnapshot reports whether dir holds a snapshot of shape sh.
func haveSnapshot(dir string, sh shape) (bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, snapShape))
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	var got shape
	if err := json.Unmarshal(b, &got); err != nil {
		return false, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	gb, _ := json.Marshal(got)
	wb, _ := json.Marshal(sh)
	if string(gb) != string(wb) {
		return false, fmt.Errorf("snapshot %s is of another vm", dir)
	}
	return true, nil
}

// buildSnapshot boots a VM like c with its RAM in dir, has the guest mount
// its root and wait for the next host, and saves it.
//
// The VM's sockets are in c.Dir with "-snapshot" appended: beside the
// sandbox's own VM directory.
func buildSnapshot(ctx context.Context, dir string, c vm.Config) error {
	c.Dir += "-snapshot"
	// QEMU, an unprivileged uid, opens the RAM file through a descriptor
	// (vm.Config.Credential): writable by anyone who holds one while the
	// guest runs, in a directory only root can enter, root's alone after.
	c.MemoryFile = filepath.Join(dir, snapMemory)
	c.ShareMemory = true
	f, err := os.OpenFile(c.MemoryFile, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = f.Chmod(0o666)
	f.Close()
	if err != nil {
		return err
	}
	c.MemoryFD = nil
	if c.Tap != nil {
		// A NIC like the sandboxes', backed by a tap in a namespace of
		// its own that reaches nowhere: the guest never uses it before
		// the snapshot, but the device must be there to be restored.
		ns := c.Dir + "-netns"
		if err := network.NewNamespace(ns); err != nil {
			return err
		}
		defer network.RemoveNamespace(ns)
		nsf, err := os.Open(ns)
		if err != nil {
			return err
		}
		c.Tap, err = network.OpenTap(int(nsf.Fd()))
		nsf.Close()
		if err != nil {
			return err
		}
		defer c.Tap.Close()
	}
	v, err := vm.Start(ctx, c)
	if err != nil {
		return err
	}
	defer func() {
		v.Stop()
		_ = os.RemoveAll(c.Dir)
	}()
	sess, err := greet(ctx, v)
	if err != nil {
		return err
	}
	first, err := sess.Open()
	if err != nil {
		sess.Close()
		return err
	}
	err = json.NewEncoder(first).Encode(guest.Spec{Prepare: true, DiskBytes: prepareDiskBytes, ShmBytes: shmBytes(0), Threads: inside.AgentThreads})
	if err == nil {
		err = readLine(ctx, first, bufio.NewReader(first), guest.Prepared)
	}
	first.Close()
	// Leaving is the guest's cue to wait for the next host: it saw the
	// port's EOF, closed it and blocks writing its hello (a write that
	// waits for a host). Saved a moment before it gets there, it gets
	// there after the restore, which is the same.
	sess.Close()
	if err != nil {
		return fmt.Errorf("prepare the guest: %w (%s)", err, consoleTail(v))
	}
	if err := waitHelloBlocked(ctx, v); err != nil {
		return fmt.Errorf("%w (%s)", err, consoleTail(v))
	}
	if err := v.Snapshot(ctx, filepath.Join(dir, snapState)); err != nil {
		return err
	}
	v.Stop()
	return os.Chmod(c.MemoryFile, 0o600)
}

// waitHelloBlocked gives the guest a moment to reach its hello after the
// host left. Not needed for correctness (see buildSnapshot), but a guest
// saved idle wakes to less work after each restore.
func waitHelloBlocked(ctx context.Context, v *vm.VM) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-v.Exited():
		return errors.New("the guest ended while preparing")
	case <-time.After(100 * time.Millisecond):
		return nil
	}
}

// greet connects to the guest's agent port, reads its hello and starts the
// host's end of the session.
func greet(ctx context.Context, v *vm.VM) (*yamux.Session, error) {
	conn, err := v.DialAgent(ctx)
	if err != nil {
		return nil, err
	}
	// The guest's hello: it is up and holds its end of the port.
	br := bufio.NewReader(conn)
	if err := readLine(ctx, conn, br, guest.Hello); err != nil {
		conn.Close()
		return nil, fmt.Errorf("the guest did not come up: %w (%s)", err, consoleTail(v))
	}
	sess, err := channel.Client(struct {
		io.Reader
		io.WriteCloser
	}{br, conn})
	if err != nil {
		conn.Close()
		return nil, err
	}
	return sess, nil
}
