package agent

import (
	"archive/tar"
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path"
	"path/filepath"
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
		err := filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil // gone meanwhile, or unreadable: skip
			}
			if under(p, skipUnder) {
				return fs.SkipDir
			}
			if seen[p] {
				if d.IsDir() {
					return fs.SkipDir
				}
				return nil
			}
			seen[p] = true
			var st unix.Stat_t
			if err := unix.Lstat(p, &st); err != nil {
				return nil
			}
			// A directory's device says which file system it is on; a
			// file's may not (overlayfs answers with its layer's), and it
			// is on its directory's.
			if d.IsDir() && !devs[st.Dev] {
				if p != "/" {
					return fs.SkipDir // another file system, not saved
				}
				return nil
			}
			if !keep(top, &st) {
				return nil // an image's file the sandbox did not change (its directory may hold some it did)
			}
			return addEntry(tw, p, p, &st)
		})
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
	upper = filepath.Clean(upper)
	return filepath.WalkDir(upper, func(src string, d fs.DirEntry, err error) error {
		if err != nil && src == upper {
			// The layer itself: an archive without the root's files
			// would pass for a whole one.
			return fmt.Errorf("the root's upper layer: %w", err)
		}
		if err != nil {
			return nil // gone meanwhile, or unreadable: skip
		}
		p := "/" + strings.TrimPrefix(strings.TrimPrefix(src, upper), "/")
		if p != "/" && (mounted[p] || under(p, skipUnder)) {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(src, &st); err != nil || !keep(&st) {
			return nil
		}
		seen[p] = true
		return addEntry(tw, p, src, &st)
	})
}

// addEntry writes the header (and contents) of the file at p in the root,
// read at src (p itself, or its place in the root's upper layer).
func addEntry(tw *tar.Writer, p, src string, st *unix.Stat_t) error {
	hdr := &tar.Header{Name: strings.TrimPrefix(p, "/"), Mode: int64(st.Mode & 0o7777), Uid: int(st.Uid), Gid: int(st.Gid),
		ModTime: time.Unix(st.Mtim.Sec, st.Mtim.Nsec), Format: tar.FormatPAX}
	if hdr.Name == "" {
		return nil // the root itself
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		hdr.Typeflag, hdr.Name = tar.TypeDir, hdr.Name+"/"
	case unix.S_IFLNK:
		target, err := os.Readlink(src)
		if err != nil {
			return nil
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
	case unix.S_IFIFO:
		hdr.Typeflag = tar.TypeFifo
	case unix.S_IFREG:
		hdr.Typeflag, hdr.Size = tar.TypeReg, st.Size
	default:
		return nil // sockets and devices are not files to keep
	}
	hdr.PAXRecords = userXattrs(src)
	if hdr.Typeflag != tar.TypeReg {
		return tw.WriteHeader(hdr)
	}
	// A FIFO or a file swapped in since the lstat must not hang or mislead.
	fd, err := unix.Open(src, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	f := os.NewFile(uintptr(fd), src)
	defer f.Close()
	// (A regular file still: overlayfs answers fstat of an open file with
	// the layer's device and inode, not the merged view's, so only the
	// type can be compared.)
	var now unix.Stat_t
	if unix.Fstat(fd, &now) != nil || now.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil
	}
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

// userXattrs returns p's user.* extended attributes as PAX records.
func userXattrs(p string) map[string]string {
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	if err != nil || n <= 0 {
		return nil
	}
	out := map[string]string{}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		if !strings.HasPrefix(name, "user.") {
			continue
		}
		v := make([]byte, 64<<10)
		if m, err := unix.Lgetxattr(p, name, v); err == nil {
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
func restoreTree(tr *tar.Reader, root string) (int, error) {
	type dirTime struct {
		path string
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
		p := filepath.Join(root, name)
		if err := restoreEntry(tr, hdr, p); err != nil {
			return n, err
		}
		if hdr.Typeflag == tar.TypeDir {
			dirs = append(dirs, dirTime{p, hdr.ModTime})
		}
		n++
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		ts := []unix.Timespec{unix.NsecToTimespec(dirs[i].t.UnixNano()), unix.NsecToTimespec(dirs[i].t.UnixNano())}
		_ = unix.UtimesNanoAt(unix.AT_FDCWD, dirs[i].path, ts, unix.AT_SYMLINK_NOFOLLOW)
	}
	return n, nil
}

// mkdirNoFollow makes dir and its missing parents, refusing a path through
// a symlink: entries are written as root, and no earlier entry may lead a
// later one elsewhere.
func mkdirNoFollow(dir string) error {
	p := "/"
	for _, c := range strings.Split(strings.Trim(filepath.Clean(dir), "/"), "/") {
		if c == "" {
			continue
		}
		p = filepath.Join(p, c)
		var st unix.Stat_t
		switch err := unix.Lstat(p, &st); {
		case err == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR:
		case err == nil:
			return fmt.Errorf("archive: %s is not a directory", p)
		case errors.Is(err, unix.ENOENT):
			if err := unix.Mkdir(p, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
				return err
			}
		default:
			return err
		}
	}
	return nil
}

// restoreEntry writes one entry at p with its owner, mode, time and
// attributes.
func restoreEntry(tr *tar.Reader, hdr *tar.Header, p string) error {
	if err := mkdirNoFollow(filepath.Dir(p)); err != nil {
		return err
	}
	mode := uint32(hdr.Mode & 0o7777)
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := os.Mkdir(p, os.FileMode(mode)); err != nil && !os.IsExist(err) {
			return err
		}
	case tar.TypeSymlink:
		_ = os.RemoveAll(p)
		if err := os.Symlink(hdr.Linkname, p); err != nil {
			return err
		}
	case tar.TypeFifo:
		_ = os.RemoveAll(p)
		if err := unix.Mkfifo(p, mode); err != nil {
			return err
		}
	case tar.TypeReg:
		_ = os.RemoveAll(p)
		fd, err := unix.Open(p, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), p)
		_, err = io.Copy(f, tr)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	default:
		return nil
	}
	if err := unix.Lchown(p, hdr.Uid, hdr.Gid); err != nil {
		return err
	}
	if hdr.Typeflag != tar.TypeSymlink {
		if err := unix.Fchmodat(unix.AT_FDCWD, p, mode, 0); err != nil {
			return err
		}
	}
	for k, v := range hdr.PAXRecords {
		if name, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok && strings.HasPrefix(name, "user.") {
			_ = unix.Lsetxattr(p, name, []byte(v), 0)
		}
	}
	if hdr.Typeflag != tar.TypeDir {
		ts := []unix.Timespec{unix.NsecToTimespec(hdr.ModTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
		_ = unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW)
	}
	return nil
}
