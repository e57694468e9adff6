package agent

import (
	"archive/tar"
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Saving and restoring a sandbox's files (cage's own routes, not E2B's).
// The host pauses a sandbox without its memory, or snapshots it, by asking
// its agent for an archive of everything the sandbox can write; it resumes
// one, or starts one from a snapshot, by handing a new sandbox's agent that
// archive. The host stores the bytes and never reads them: the archive is
// the sandbox's own data, made and unmade inside its wall.
//
//	GET  /cage/archive?processes=stop|kill   a tar of the writable files
//	POST /cage/restore                       unpack such a tar over the root
//
// What is saved: the files of every writable mount but the kernel's and
// cage's own (/proc, /sys, /dev with /dev/shm, /run/cage): the host
// template's /tmp, /var/tmp and /home whole, and of an image template's
// writable root the files changed since the sandbox started (an inode's
// change time is set by every write, chmod, chown, rename and copy-up;
// the image's own files keep the time they were unpacked: found in the
// root's overlay upper layer where the agent can read it, the microvm
// guest's, else by a walk of the whole root); with their owners, modes,
// times and user.* extended attributes.
// Not saved: running processes, memory, sockets and devices, and the
// volumes mounted in the sandbox (the host keeps them; a walk never
// crosses into a file system it does not save). Files a
// sandbox deleted from its image's own layers are not recorded as deleted
// (the overlay's whiteouts are the host's), so they are there again after
// a restore.

// skipFS are file systems whose contents are the kernel's, not files.
var skipFS = map[string]bool{"proc": true, "sysfs": true, "devtmpfs": true, "devpts": true, "mqueue": true,
	"cgroup": true, "cgroup2": true, "securityfs": true, "debugfs": true, "tracefs": true, "bpf": true,
	"binfmt_misc": true, "fusectl": true, "configfs": true, "hugetlbfs": true, "pstore": true}

// skipUnder are trees never saved: the kernel's, the devices (shared
// memory included: it is memory) and the sandbox's identity files, which a
// new sandbox gets its own of.
var skipUnder = []string{"/proc", "/sys", "/dev", "/run/cage"}

// mount is one line of mountinfo that matters here.
type mount struct {
	point    string
	fstype   string
	readOnly bool
}

// writableMounts reads the mount table and returns the mount points whose
// files are saved, the devices they are on (one tmpfs is bound at
// several points: /tmp, /var/tmp, /home), and every mount point there is.
func writableMounts(volumes []string) (points []string, devs map[uint64]bool, all map[string]bool, err error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, nil, nil, err
	}
	defer f.Close()
	devs, all = map[uint64]bool{}, map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		m, ok := parseMountinfo(sc.Text())
		if !ok {
			continue
		}
		all[m.point] = true
		if m.readOnly || skipFS[m.fstype] || under(m.point, skipUnder) || under(m.point, volumes) {
			continue
		}
		var st unix.Stat_t
		if err := unix.Lstat(m.point, &st); err != nil {
			continue
		}
		points, devs[st.Dev] = append(points, m.point), true
	}
	return points, devs, all, sc.Err()
}

// parseMountinfo reads "ID PARENT MAJ:MIN ROOT POINT OPTS ... - FSTYPE SRC SUPEROPTS".
func parseMountinfo(line string) (mount, bool) {
	pre, post, ok := strings.Cut(line, " - ")
	f, g := strings.Fields(pre), strings.Fields(post)
	if !ok || len(f) < 6 || len(g) < 1 {
		return mount{}, false
	}
	m := mount{point: unescapeMount(f[4]), fstype: g[0]}
	for _, o := range strings.Split(f[5], ",") {
		m.readOnly = m.readOnly || o == "ro"
	}
	return m, true
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func under(p string, dirs []string) bool {
	for _, d := range dirs {
		if p == d || strings.HasPrefix(p, d+"/") {
			return true
		}
	}
	return false
}

// serveArchive writes the tar of the sandbox's writable files. processes=
// stop halts every other process of the sandbox while it reads (and lets
// them go on after: a snapshot); kill ends them first (a pause without
// memory, after which the sandbox is destroyed).
func (s *Server) serveArchive(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Query().Get("processes") {
	case "stop":
		s.signalAll(syscall.SIGSTOP)
		defer s.signalAll(syscall.SIGCONT)
	case "kill":
		s.signalAll(syscall.SIGKILL)
	case "":
	default:
		writeHTTPError(w, httpErr(http.StatusBadRequest, "processes: want stop or kill"))
		return
	}
	points, devs, mounted, err := writableMounts(s.cfg.Volumes)
	if err != nil {
		writeHTTPError(w, httpErr(http.StatusInternalServerError, "mount table: %v", err))
		return
	}
	// The root, when it is writable (an image's overlay), holds the image:
	// only what changed since the start is the sandbox's. Two seconds of
	// slack for clocks that step.
	since := s.configured.Add(-2 * time.Second)
	w.Header().Set("Content-Type", "application/x-tar")
	tw := tar.NewWriter(w)
	keep := func(dir string, st *unix.Stat_t) bool {
		return dir != "/" || s.configured.IsZero() || !time.Unix(st.Ctim.Sec, st.Ctim.Nsec).Before(since)
	}
	seen := map[string]bool{}
	if s.rootUpper != "" && slices.Contains(points, "/") {
		// The root's changes are all in its overlay's upper layer: walk
		// that, not the whole image (under TCG, reading a cold image's
		// inodes took most of a pause).
		if err := archiveUpper(tw, s.rootUpper, mounted, seen, func(st *unix.Stat_t) bool { return keep("/", st) }); err != nil {
			s.log.Warn("archive cut short", "err", err)
			panic(http.ErrAbortHandler)
		}
		points = slices.DeleteFunc(points, func(p string) bool { return p == "/" })
	}
	if err := archiveTree(tw, points, devs, seen, keep); err != nil {
		s.log.Warn("archive cut short", "err", err)
		panic(http.ErrAbortHandler) // the client must see a broken stream, not a short tar
	}
	if err := tw.Close(); err != nil {
		panic(http.ErrAbortHandler)
	}
}

// signalAll signals every process of the sandbox but the agent: as the
// sandbox's PID 1, kill(-1) reaches them all, daemons included; elsewhere
// (tests) the process groups the agent started.
func (s *Server) signalAll(sig syscall.Signal) {
	if os.Getpid() == 1 {
		_ = unix.Kill(-1, sig)
		if sig == syscall.SIGKILL {
			time.Sleep(10 * time.Millisecond) // let them die before their files are read
		}
		return
	}
	s.procs.signalAll(sig)
}

// archiveTree writes every file under the saved mount points that keep
// accepts (given the mount point it is walked from), each path once,
// crossing into no file system that is not saved.
func archiveTree(tw *tar.Writer, points []string, devs map[uint64]bool, seen map[string]bool, keep func(mount string, st *unix.Stat_t) bool) error {
	sort.Strings(points)
	for _, top := range points {
		if seen[top] {
			continue
		}
		// From its directory: a mount point may be a file (a bind).
		fd, err := unix.Open(path.Dir(top), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.ENOENT) {
			continue // unmounted meanwhile
		}
		if err != nil {
			return fmt.Errorf("%s: %w", top, err)
		}
		visit := func(parent int, name, p string, st *unix.Stat_t, dir int) (bool, error) {
			if under(p, skipUnder) || seen[p] {
				return false, nil
			}
			seen[p] = true
			// A directory's device says which file system it is on; a
			// file's may not (overlayfs answers with its layer's), and it
			// is on its directory's.
			if dir >= 0 && !devs[st.Dev] {
				return p == "/", nil // another file system, not saved (the root's own files may be)
			}
			if !keep(top, st) {
				return true, nil // an image's file the sandbox did not change (its directory may hold some it did)
			}
			return true, addEntry(tw, p, parent, name, st, dir)
		}
		if top == "/" {
			err = walkFrom(fd, top, visit)
		} else {
			err = walkEntry(fd, path.Base(top), top, visit)
		}
		unix.Close(fd)
		if err != nil {
			return err
		}
	}
	return nil
}

// archiveUpper writes the files of the root's overlay upper layer, the
// directory upper, that keep accepts, under their paths in the root. The
// upper layer holds every file the sandbox made or changed (an image's file
// is copied up whole at its first change, its metadata's included) and
// whiteouts for what it deleted, which are devices and so not kept, as a
// walk of the root would not see them either. Where something is mounted
// over the root (mounted: every mount point), the upper layer's files
// there are hidden, not the root's: they are skipped, as are skipUnder's
// trees. Each path it writes is marked in seen.
func archiveUpper(tw *tar.Writer, upper string, mounted, seen map[string]bool, keep func(st *unix.Stat_t) bool) error {
	fd, err := unix.Open(upper, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		// An archive without the root's files would pass for a whole one.
		return fmt.Errorf("the root's upper layer: %w", err)
	}
	defer unix.Close(fd)
	return walkFrom(fd, "/", func(parent int, name, p string, st *unix.Stat_t, dir int) (bool, error) {
		if p != "/" && (mounted[p] || under(p, skipUnder)) {
			return false, nil
		}
		if !keep(st) {
			return true, nil
		}
		seen[p] = true
		return true, addEntry(tw, p, parent, name, st, dir)
	})
}

// walkFrom visits the directory top (a descriptor; p its path in the root)
// and everything below it, each directory before what it holds and the
// entries of a directory by name, by descriptors only: no system call is
// given more than one name, so a tree deeper than PATH_MAX is walked like
// any other (a walk by paths met ENAMETOOLONG below 4,096 bytes and left
// the rest out). visit gets each entry's directory's descriptor, its
// name in it ("" for top itself, whose descriptor parent then is), its
// path in the root, its lstat and, for a directory, a descriptor of it
// (-1 otherwise), and says whether to go below it. An entry removed
// meanwhile is passed over; any other failure ends the walk with an
// error: a file left out without a word is a file lost.
func walkFrom(top int, p string, visit func(parent int, name, p string, st *unix.Stat_t, dir int) (bool, error)) error {
	var st unix.Stat_t
	if err := unix.Fstat(top, &st); err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	down, err := visit(top, "", p, &st, top)
	if err != nil || !down {
		return err
	}
	return walkBelow(top, p, visit)
}

func walkBelow(dirfd int, p string, visit func(parent int, name, p string, st *unix.Stat_t, dir int) (bool, error)) error {
	names, err := readDirNames(dirfd, math.MaxInt)
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	sort.Strings(names)
	for _, name := range names {
		if err := walkEntry(dirfd, name, path.Join(p, name), visit); err != nil {
			return err
		}
	}
	return nil
}

// walkEntry visits name in dirfd, whose path in the root is p, and what is
// below it (see walkFrom).
func walkEntry(dirfd int, name, p string, visit func(parent int, name, p string, st *unix.Stat_t, dir int) (bool, error)) error {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("%s: %w", p, err)
	}
	sub := -1
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		var err error
		if sub, err = openDirAt(dirfd, name); errors.Is(err, unix.ENOENT) {
			return nil
		} else if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		defer unix.Close(sub)
	}
	down, err := visit(dirfd, name, p, &st, sub)
	if err == nil && down && sub >= 0 {
		err = walkBelow(sub, p, visit)
	}
	return err
}

// openDirAt opens the directory name in dirfd, following no symlink.
func openDirAt(dirfd int, name string) (int, error) {
	return openBeneath(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY)
}

// addEntry writes the header (and contents) of the file at p in the root:
// name in the directory parent, or, name "", the directory parent itself;
// dir is a directory's own descriptor.
func addEntry(tw *tar.Writer, p string, parent int, name string, st *unix.Stat_t, dir int) error {
	hdr := &tar.Header{Name: strings.TrimPrefix(p, "/"), Mode: int64(st.Mode & 0o7777), Uid: int(st.Uid), Gid: int(st.Gid),
		ModTime: time.Unix(st.Mtim.Sec, st.Mtim.Nsec), Format: tar.FormatPAX}
	if hdr.Name == "" {
		return nil // the root itself
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		hdr.Typeflag, hdr.Name = tar.TypeDir, hdr.Name+"/"
		hdr.PAXRecords = userXattrs(dir)
		return tw.WriteHeader(hdr)
	case unix.S_IFLNK:
		target, err := readlinkAt(parent, name)
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
		return tw.WriteHeader(hdr)
	case unix.S_IFIFO:
		hdr.Typeflag = tar.TypeFifo
		return tw.WriteHeader(hdr)
	case unix.S_IFREG:
		hdr.Typeflag, hdr.Size = tar.TypeReg, st.Size
	default:
		return nil // sockets and devices are not files to keep
	}
	// A FIFO or a file swapped in since the lstat must not hang or mislead.
	fd, err := unix.Openat(parent, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	// (A regular file still: overlayfs answers fstat of an open file with
	// the layer's device and inode, not the merged view's, so only the
	// type can be compared.)
	var now unix.Stat_t
	if unix.Fstat(fd, &now) != nil || now.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil
	}
	hdr.PAXRecords = userXattrs(fd)
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	// A file that grew is cut at the size written in the header; one that
	// shrank is padded with zeros: the tar stays well formed.
	n, err := io.Copy(tw, io.LimitReader(f, hdr.Size))
	if err != nil {
		return err
	}
	if n < hdr.Size {
		_, err = io.CopyN(tw, zeroReader{}, hdr.Size-n)
	}
	return err
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// userXattrs returns the user.* extended attributes of the file or
// directory open as fd, as PAX records (symlinks and FIFOs have none:
// Linux allows user.* attributes only on regular files and directories).
func userXattrs(fd int) map[string]string {
	buf := make([]byte, 64<<10)
	n, err := unix.Flistxattr(fd, buf)
	if err != nil || n <= 0 {
		return nil
	}
	out := map[string]string{}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		if !strings.HasPrefix(name, "user.") {
			continue
		}
		v := make([]byte, 64<<10)
		if m, err := unix.Fgetxattr(fd, name, v); err == nil {
			out["SCHILY.xattr."+name] = string(v[:m])
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// serveRestore unpacks a tar made by serveArchive over the root: files are
// replaced, directories merged, owners, modes, times and user.* attributes
// set as recorded.
func (s *Server) serveRestore(w http.ResponseWriter, r *http.Request) {
	defer r.Body.Close()
	n, err := restoreTree(tar.NewReader(r.Body), s.cfg.Root)
	if err != nil {
		writeHTTPError(w, fileHTTPError("restore", "/", err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, "{\"entries\":%d}\n", n)
}

// restoreTree unpacks tr under root and returns how many entries it wrote.
// Every entry is reached from root by descriptors, one name at a time (see
// walkFrom): any depth, and no entry through a symlink an earlier one made.
func restoreTree(tr *tar.Reader, root string) (int, error) {
	rfd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	at := &dirChain{root: rfd}
	defer at.close()
	type dirTime struct {
		name string
		t    time.Time
	}
	var dirs []dirTime
	n := 0
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return n, fmt.Errorf("archive: %w", err)
		}
		name := path.Clean("/" + hdr.Name)
		if name == "/" || under(name, skipUnder) {
			continue
		}
		parent, err := at.dir(path.Dir(name))
		if err != nil {
			return n, err
		}
		if hdr.Typeflag != tar.TypeDir {
			at.drop(name) // a directory of the chain replaced: not to be written into
		}
		if err := restoreEntry(tr, hdr, parent, path.Base(name)); err != nil {
			return n, fmt.Errorf("%s: %w", name, err)
		}
		if hdr.Typeflag == tar.TypeDir {
			dirs = append(dirs, dirTime{name, hdr.ModTime})
		}
		n++
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		parent, err := at.dir(path.Dir(dirs[i].name))
		if err != nil {
			continue
		}
		ts := []unix.Timespec{unix.NsecToTimespec(dirs[i].t.UnixNano()), unix.NsecToTimespec(dirs[i].t.UnixNano())}
		_ = unix.UtimesNanoAt(parent, path.Base(dirs[i].name), ts, unix.AT_SYMLINK_NOFOLLOW)
	}
	return n, nil
}

// dirChain opens directories below root one name at a time, making those
// missing and refusing a symlink on the way: entries are written as root,
// and no earlier entry may lead a later one elsewhere. It keeps the
// descriptors of the last directory's chain, which the next entry, in an
// archive's order, mostly shares.
type dirChain struct {
	root  int
	names []string // the chain's names below root
	fds   []int    // their descriptors
}

// dir returns a descriptor of the directory dir (a clean absolute path),
// valid until the next call.
func (c *dirChain) dir(dir string) (int, error) {
	var want []string
	if dir != "/" {
		want = strings.Split(strings.TrimPrefix(dir, "/"), "/")
	}
	keep := 0
	for keep < len(c.names) && keep < len(want) && c.names[keep] == want[keep] {
		keep++
	}
	c.cut(keep)
	for _, name := range want[keep:] {
		parent := c.root
		if len(c.fds) > 0 {
			parent = c.fds[len(c.fds)-1]
		}
		fd, err := openDirAt(parent, name)
		if errors.Is(err, unix.ENOENT) {
			if err = unix.Mkdirat(parent, name, 0o755); err == nil || errors.Is(err, unix.EEXIST) {
				fd, err = openDirAt(parent, name)
			}
		}
		if errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
			return -1, fmt.Errorf("archive: /%s is not a directory", path.Join(append(c.names, name)...))
		}
		if err != nil {
			return -1, fmt.Errorf("archive: /%s: %w", path.Join(append(c.names, name)...), err)
		}
		c.fds, c.names = append(c.fds, fd), append(c.names, name)
	}
	if len(c.fds) == 0 {
		return c.root, nil
	}
	return c.fds[len(c.fds)-1], nil
}

// drop forgets the chain from the directory p (a clean absolute path) on,
// if it holds it.
func (c *dirChain) drop(p string) {
	names := strings.Split(strings.TrimPrefix(p, "/"), "/")
	if len(names) > len(c.names) || !slices.Equal(c.names[:len(names)], names) {
		return
	}
	c.cut(len(names) - 1)
}

// cut closes the chain's directories past its first n.
func (c *dirChain) cut(n int) {
	for _, fd := range c.fds[n:] {
		unix.Close(fd)
	}
	c.fds, c.names = c.fds[:n], c.names[:n]
}

func (c *dirChain) close() {
	for _, fd := range c.fds {
		unix.Close(fd)
	}
	unix.Close(c.root)
}

// restoreEntry writes one entry, name in the directory parent, with its
// owner, mode, time and attributes.
func restoreEntry(tr *tar.Reader, hdr *tar.Header, parent int, name string) error {
	mode := uint32(hdr.Mode & 0o7777)
	attrs := -1 // a descriptor to set its attributes through
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(parent, name, mode); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
		if fd, err := openDirAt(parent, name); err == nil {
			attrs = fd
		}
	case tar.TypeSymlink:
		_ = removeAt(parent, name, 0) // whatever is there: the entry replaces it
		if err := unix.Symlinkat(hdr.Linkname, parent, name); err != nil {
			return err
		}
	case tar.TypeFifo:
		_ = removeAt(parent, name, 0)
		if err := unix.Mknodat(parent, name, unix.S_IFIFO|mode, 0); err != nil {
			return err
		}
	case tar.TypeReg:
		_ = removeAt(parent, name, 0)
		fd, err := unix.Openat(parent, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), name)
		_, err = io.Copy(f, tr)
		if err != nil {
			f.Close()
			return err
		}
		if attrs, err = unix.Dup(fd); err != nil {
			attrs = -1
		}
		if err := f.Close(); err != nil {
			return err
		}
	default:
		return nil
	}
	if attrs >= 0 {
		defer unix.Close(attrs)
	}
	if err := unix.Fchownat(parent, name, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if hdr.Typeflag != tar.TypeSymlink {
		if err := unix.Fchmodat(parent, name, mode, 0); err != nil {
			return err
		}
	}
	if attrs >= 0 {
		for k, v := range hdr.PAXRecords {
			if name, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok && strings.HasPrefix(name, "user.") {
				_ = unix.Fsetxattr(attrs, name, []byte(v), 0)
			}
		}
	}
	if hdr.Typeflag != tar.TypeDir {
		ts := []unix.Timespec{unix.NsecToTimespec(hdr.ModTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
		_ = unix.UtimesNanoAt(parent, name, ts, unix.AT_SYMLINK_NOFOLLOW)
	}
	return nil
}
