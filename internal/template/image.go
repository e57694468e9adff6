package template

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/imgstore"
)

// Image templates come from the template store (internal/imgstore): an
// image's layers, unpacked once and shared read-only by every sandbox of
// the template. Each sandbox gets an overlay of them with an upper layer of
// its own on a size-limited tmpfs (its disk), mounted on the host before the
// wall starts, so that every wall takes the same root directory. Under a
// user namespace the layers are idmapped mounts onto the sandbox's uid
// range: the image's root files belong to the sandbox's root, its user's to
// its user, and nothing is copied.

// Image is the store part of an image template.
type Image struct {
	Store *imgstore.Store
	Info  *imgstore.Template
}

// lookupImage resolves name in the store.
func lookupImage(name string, store *imgstore.Store) (*Template, error) {
	if store == nil {
		return nil, fmt.Errorf("%w: %q (available: host)", ErrNotFound, name)
	}
	info, err := store.Get(name)
	if errors.Is(err, imgstore.ErrNotFound) {
		names := []string{"host"}
		if list, err := store.List(); err == nil {
			for _, t := range list {
				names = append(names, t.Name)
			}
		}
		return nil, fmt.Errorf("%w: %q (available: %s)", ErrNotFound, name, strings.Join(names, ", "))
	}
	if err != nil {
		return nil, err
	}
	return &Template{Name: name, Image: &Image{Store: store, Info: info}}, nil
}

// EnvWith is the environment of a sandbox of t: an image's own variables
// (its config's Env, as `docker run` gives them), overridden by env.
func (t *Template) EnvWith(env map[string]string) map[string]string {
	if t == nil || t.Image == nil || len(t.Image.Info.Config.Env) == 0 {
		return env
	}
	out := map[string]string{}
	for _, kv := range t.Image.Info.Config.Env {
		if k, v, ok := strings.Cut(kv, "="); ok && k != "" {
			out[k] = v
		}
	}
	for k, v := range env {
		out[k] = v
	}
	return out
}

// Image roots live in these entries of a sandbox's state directory.
const (
	imageRoot = "rootfs" // the overlay: the sandbox's root
	imageDisk = "disk"   // tmpfs holding the overlay's upper and work dirs
	imageLow  = "lower"  // idmapped layers, mounted only while the overlay is
)

// MountImage mounts the root of one sandbox of image template t under its
// state directory dir and returns it. idBase is the host uid and gid of the
// sandbox's root (0: no user namespace, the layers are used as they are);
// userns gives a user namespace whose map is the sandbox's (the sandbox's
// own, or HeldUserNS's), for the idmapping. The root is writable up to
// diskBytes and inodes; it is nosuid and nodev on the host. The mounts go
// with the state directory (state.RemoveState unmounts them).
func (t *Template) MountImage(dir string, idBase uint32, userns func() (int, error), diskBytes, inodes int64) (string, error) {
	if t.Image == nil {
		return "", fmt.Errorf("template %q is not an image", t.Name)
	}
	unlock, err := t.Image.Store.RLock()
	if err != nil {
		return "", err
	}
	defer unlock()
	layers, err := t.Image.Store.LayerDirs(t.Image.Info)
	if err != nil {
		return "", fmt.Errorf("template %q: %w", t.Name, err)
	}
	disk := filepath.Join(dir, imageDisk)
	if err := os.Mkdir(disk, 0o700); err != nil {
		return "", err
	}
	opts := fmt.Sprintf("mode=755,size=%d,nr_inodes=%d", diskBytes, inodes)
	if err := unix.Mount("tmpfs", disk, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return "", fmt.Errorf("mount the sandbox disk: %w", err)
	}
	upper, work := filepath.Join(disk, "upper"), filepath.Join(disk, "work")
	for _, d := range []string{upper, work} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return "", err
		}
	}
	// The upper root takes the lowest layer's owner and mode (an image's /
	// is usually root's, 0755).
	if err := os.Chown(upper, int(idBase), int(idBase)); err != nil {
		return "", err
	}
	root := filepath.Join(dir, imageRoot)
	if err := os.Mkdir(root, 0o755); err != nil {
		return "", err
	}
	source := imgstore.MountSource(t.Image.Info)
	if idBase == 0 {
		// No user namespace (gVisor): the layers as they are.
		if err := mountOverlayPaths(root, source, layers, upper, work); err != nil {
			return "", fmt.Errorf("template %q: %w", t.Name, err)
		}
		return root, nil
	}
	ns, err := userns()
	if err != nil {
		return "", fmt.Errorf("user namespace for the template's layers: %w", err)
	}
	fds, err := idmappedLayers(layers, ns)
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	if err != nil {
		return "", err
	}
	// Linux 6.13 and later take the layers as descriptors: the idmapped
	// mounts never need a place in the tree. Older kernels take paths.
	err = mountOverlayFDs(root, source, fds, upper, work)
	if errors.Is(err, unix.EINVAL) {
		err = mountOverlayAttached(root, source, filepath.Join(dir, imageLow), fds, upper, work)
	}
	if err != nil {
		return "", fmt.Errorf("template %q: %w", t.Name, err)
	}
	return root, nil
}

// DetachedRoot is a detached copy of a sandbox's root mount (MountImage's),
// for a process in another mount namespace to attach (move_mount) as its
// own: the process wall's child gets its root this way.
func DetachedRoot(root string) (*os.File, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, root, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("detached copy of the root: %w", err)
	}
	return os.NewFile(uintptr(fd), "root"), nil
}

// ResizeImageDisk changes the size of a prepared sandbox's disk.
func ResizeImageDisk(dir string, diskBytes, inodes int64) error {
	opts := fmt.Sprintf("size=%d,nr_inodes=%d", diskBytes, inodes)
	if err := unix.Mount("", filepath.Join(dir, imageDisk), "", unix.MS_REMOUNT|unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("resize the disk: %w", err)
	}
	return nil
}

// idmappedLayers makes a detached idmapped mount of each layer: the
// image's uid and gid 0..65535 become the map of the user namespace ns (the
// sandbox's range). The caller closes the descriptors.
func idmappedLayers(layers []string, ns int) ([]int, error) {
	var fds []int
	for _, l := range layers {
		fd, err := unix.OpenTree(unix.AT_FDCWD, l, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return fds, fmt.Errorf("layer %s: open_tree: %w", l, err)
		}
		fds = append(fds, fd)
		attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP | unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV,
			Userns_fd: uint64(ns)}
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, attr); err != nil {
			return fds, fmt.Errorf("layer %s: idmapped mount: %w", l, err)
		}
	}
	return fds, nil
}

// mountOverlayFDs mounts the overlay with its lower layers given as mount
// descriptors (bottom first), through the new mount API.
func mountOverlayFDs(root, source string, lowers []int, upper, work string) error {
	fsfd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("fsopen overlay: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", source); err != nil {
		return err
	}
	// "lowerdir+" appends below the layers given so far: top first.
	for i := len(lowers) - 1; i >= 0; i-- {
		if err := unix.FsconfigSetFd(fsfd, "lowerdir+", lowers[i]); err != nil {
			return err // EINVAL: a kernel without layers by descriptor
		}
	}
	for k, v := range map[string]string{"upperdir": upper, "workdir": work} {
		if err := unix.FsconfigSetString(fsfd, k, v); err != nil {
			return fmt.Errorf("overlay %s: %w", k, err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return fmt.Errorf("mount the template's overlay: %w", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return fmt.Errorf("mount the template's overlay: %w", err)
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, root, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the template's overlay: %w", err)
	}
	return nil
}

// mountOverlayAttached is mountOverlayFDs for kernels before 6.13: the
// idmapped layers are attached at base/N for the time of the mount.
func mountOverlayAttached(root, source, base string, lowers []int, upper, work string) error {
	if err := os.Mkdir(base, 0o700); err != nil {
		return err
	}
	defer os.RemoveAll(base)
	var paths []string
	defer func() {
		for _, p := range paths {
			_ = unix.Unmount(p, unix.MNT_DETACH) // the overlay holds its own references
		}
	}()
	for i, fd := range lowers {
		p := filepath.Join(base, strconv.Itoa(i))
		if err := os.Mkdir(p, 0o700); err != nil {
			return err
		}
		if err := unix.MoveMount(fd, "", unix.AT_FDCWD, p, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("attach layer %d: %w", i, err)
		}
		paths = append(paths, p)
	}
	return mountOverlayPaths(root, source, paths, upper, work)
}

// mountOverlayPaths mounts the overlay of the layer directories (bottom
// first) with mount(2).
func mountOverlayPaths(root, source string, layers []string, upper, work string) error {
	var top []string
	for i := len(layers) - 1; i >= 0; i-- {
		top = append(top, layers[i])
	}
	data := "lowerdir=" + strings.Join(top, ":") + ",upperdir=" + upper + ",workdir=" + work
	if len(data) > 4000 {
		return fmt.Errorf("%d layers are too many for one overlay mount on this kernel", len(layers))
	}
	if err := unix.Mount(source, root, "overlay", unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		return fmt.Errorf("mount the template's overlay: %w", err)
	}
	return nil
}

// HeldUserNS gives, for walls whose runtime makes the sandbox's user
// namespace itself (runc), a user namespace with the same map, 0..65535 ->
// idBase..: holder (cage-agent hold) is run in a new one to get hold of it.
// An open namespace file keeps it alive, so one per range serves every
// sandbox that ever uses the range in this process.
func HeldUserNS(idBase uint32, holder string) func() (int, error) {
	return func() (int, error) { return usernsFor(idBase, holder) }
}

func usernsFor(idBase uint32, holder string) (int, error) {
	userns.Lock()
	defer userns.Unlock()
	if fd, ok := userns.fds[idBase]; ok {
		return fd, nil
	}
	cmd := exec.Command(holder, "hold")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(idBase), Size: 65536}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(idBase), Size: 65536}},
		Pdeathsig:   syscall.SIGKILL,
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		return -1, err
	}
	if err := cmd.Start(); err != nil {
		return -1, err
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	in.Close()
	_ = cmd.Wait()
	if err != nil {
		return -1, err
	}
	userns.fds[idBase] = fd
	return fd, nil
}

var userns = struct {
	sync.Mutex
	fds map[uint32]int
}{fds: map[uint32]int{}}
