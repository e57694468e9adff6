package agent

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func tarOf(t *testing.T, hdrs []*tar.Header, bodies map[string]string) *tar.Reader {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, h := range hdrs {
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(bodies[h.Name]))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			_, _ = tw.Write([]byte(bodies[h.Name]))
		}
	}
	tw.Close()
	return tar.NewReader(&b)
}

// TestRestoreTree: a restore writes files, directories, symlinks and FIFOs
// with their owners, modes, times and user.* attributes.
func TestRestoreTree(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIP: restoring owners needs root")
	}
	root := t.TempDir()
	mt := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	hdrs := []*tar.Header{
		{Name: "home/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: mt},
		{Name: "home/user/", Typeflag: tar.TypeDir, Mode: 0o700, Uid: 1000, Gid: 1000, ModTime: mt},
		{Name: "home/user/notes.txt", Typeflag: tar.TypeReg, Mode: 0o640, Uid: 1000, Gid: 1000, ModTime: mt,
			PAXRecords: map[string]string{"SCHILY.xattr.user.e2b.k": "v", "SCHILY.xattr.security.capability": "x"}},
		{Name: "home/user/link", Typeflag: tar.TypeSymlink, Linkname: "notes.txt", Uid: 1000, Gid: 1000, ModTime: mt},
		{Name: "home/user/fifo", Typeflag: tar.TypeFifo, Mode: 0o600, Uid: 1000, Gid: 1000, ModTime: mt},
		{Name: "proc/evil", Typeflag: tar.TypeReg, Mode: 0o644, ModTime: mt},
	}
	n, err := restoreTree(tarOf(t, hdrs, map[string]string{"home/user/notes.txt": "hello", "proc/evil": "x"}), root)
	if err != nil || n != 5 {
		t.Fatalf("restore: %d entries, %v; want 5 (proc/ skipped)", n, err)
	}
	var st unix.Stat_t
	f := filepath.Join(root, "home/user/notes.txt")
	if err := unix.Lstat(f, &st); err != nil || st.Uid != 1000 || st.Mode&0o7777 != 0o640 || st.Mtim.Sec != mt.Unix() {
		t.Errorf("notes.txt: %+v %v", st, err)
	}
	if b, _ := os.ReadFile(f); string(b) != "hello" {
		t.Errorf("notes.txt holds %q", b)
	}
	v := make([]byte, 16)
	if n, err := unix.Lgetxattr(f, "user.e2b.k", v); err != nil || string(v[:n]) != "v" {
		t.Errorf("user.e2b.k: %q %v", v[:max(n, 0)], err)
	}
	if _, err := unix.Lgetxattr(f, "security.capability", v); err == nil {
		t.Errorf("a security.* attribute was restored")
	}
	if l, err := os.Readlink(filepath.Join(root, "home/user/link")); err != nil || l != "notes.txt" {
		t.Errorf("link: %q %v", l, err)
	}
	if err := unix.Lstat(filepath.Join(root, "home/user/fifo"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFIFO {
		t.Errorf("fifo: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "proc")); err == nil {
		t.Errorf("an entry under /proc was restored")
	}
}

// TestRestoreRefusesPathThroughSymlink: an archive whose later entry goes
// through a symlink an earlier one made (home/user/x -> /etc, then
// home/user/x/passwd) is refused, and nothing outside is written: the agent
// restores as root, and no entry may steer another.
func TestRestoreRefusesPathThroughSymlink(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	hdrs := []*tar.Header{
		{Name: "home/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "home/x", Typeflag: tar.TypeSymlink, Linkname: outside},
		{Name: "home/x/passwd", Typeflag: tar.TypeReg, Mode: 0o644},
	}
	_, err := restoreTree(tarOf(t, hdrs, map[string]string{"home/x/passwd": "root::0:0::/:/bin/sh\n"}), root)
	if err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Errorf("restore through a symlink: %v, want a refusal", err)
	}
	if _, err := os.Stat(filepath.Join(outside, "passwd")); err == nil {
		t.Errorf("the restore wrote through the symlink")
	}
}

func TestParseMountinfo(t *testing.T) {
	m, ok := parseMountinfo(`36 35 0:33 / /home/user\040dir rw,nosuid shared:1 - tmpfs tmpfs rw,size=1024k`)
	if !ok || m.point != "/home/user dir" || m.fstype != "tmpfs" || m.readOnly {
		t.Errorf("got %+v %v", m, ok)
	}
	m, ok = parseMountinfo(`40 35 8:1 /usr /usr ro,nosuid,nodev - ext4 /dev/sda1 rw`)
	if !ok || !m.readOnly {
		t.Errorf("a read-only bind: %+v %v", m, ok)
	}
	if _, ok := parseMountinfo("garbage"); ok {
		t.Errorf("garbage parsed")
	}
}

// TestArchiveUpper: the archive of a root from its overlay's upper layer
// names each file by its path in the root and reads it from the layer;
// it leaves out whiteouts (devices), what keep refuses, the trees that
// are never saved (/proc, /run/cage...) and what a mount covers (the
// layer's files under a mount point are hidden in the root), and marks
// what it wrote as seen.
func TestArchiveUpper(t *testing.T) {
	upper := t.TempDir()
	write := func(p, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(upper, p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(upper, p), []byte(s), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	write("etc/motd", "changed\n")
	write("home/user/notes.txt", "notes\n")
	write("usr/local/old", "not changed since the start\n")
	write("mnt/vol/hidden", "under a mount point\n")
	write("run/cage/token", "secret\n")
	write("proc/x", "kernel's\n")
	if err := os.Symlink("/etc/motd", filepath.Join(upper, "home/user/link")); err != nil {
		t.Fatal(err)
	}
	whiteout := os.Geteuid() == 0
	if whiteout { // overlayfs's whiteout: a character device 0:0
		if err := unix.Mknod(filepath.Join(upper, "etc/deleted"), unix.S_IFCHR, 0); err != nil {
			t.Fatal(err)
		}
	}
	var old unix.Stat_t
	if err := unix.Lstat(filepath.Join(upper, "usr/local/old"), &old); err != nil {
		t.Fatal(err)
	}
	keep := func(st *unix.Stat_t) bool { return st.Ino != old.Ino }
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	seen := map[string]bool{}
	if err := archiveUpper(tw, upper+"/", map[string]bool{"/": true, "/mnt/vol": true}, seen, keep); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	tr := tar.NewReader(&b)
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		body, _ := io.ReadAll(tr)
		got[h.Name] = string(body)
		if h.Typeflag == tar.TypeSymlink {
			got[h.Name] = "-> " + h.Linkname
		}
	}
	want := map[string]string{
		"etc/": "", "etc/motd": "changed\n", "home/": "", "home/user/": "", "home/user/notes.txt": "notes\n",
		"home/user/link": "-> /etc/motd", "mnt/": "", "run/": "", "usr/": "", "usr/local/": "",
	}
	for name, body := range want {
		if g, ok := got[name]; !ok || g != body {
			t.Errorf("%s: got %q (there: %v), want %q", name, g, ok, body)
		}
	}
	for name := range got {
		if _, ok := want[name]; !ok {
			t.Errorf("%s was archived", name)
		}
	}
	if !seen["/etc/motd"] || !seen["/home/user"] || seen["/mnt/vol/hidden"] {
		t.Errorf("seen: %v", seen)
	}
}

// TestArchiveRootFromHoldsItsLayer: the server keeps the layer's directory
// open though its caller holds no reference to it (the microvm guest
// held none): garbage collections between the start and an archive do not
// close the descriptor the layer's path goes through, and the archive has
// every file. Before, the *os.File's finalizer closed it, and an archive
// that a collection interrupted left out every file after that point.
func TestArchiveRootFromHoldsItsLayer(t *testing.T) {
	dir := t.TempDir()
	for _, p := range []string{"upper/home/user/big.txt", "upper/home/user/dir/sub/f"} {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, p), []byte(p), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	s := &Server{}
	func() {
		layer, err := os.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		s.ArchiveRootFrom(layer, "upper")
	}()
	// Collections run the finalizers and cleanups of what they freed, on
	// a goroutine of their own: give it time.
	for range 5 {
		runtime.GC()
		time.Sleep(20 * time.Millisecond)
	}
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	if err := archiveUpper(tw, s.rootUpper, map[string]bool{"/": true}, map[string]bool{}, func(*unix.Stat_t) bool { return true }); err != nil {
		t.Fatalf("archive: %v", err)
	}
	tw.Close()
	var got []string
	for tr := tar.NewReader(&b); ; {
		h, err := tr.Next()
		if err != nil {
			break
		}
		got = append(got, h.Name)
	}
	want := []string{"home/", "home/user/", "home/user/big.txt", "home/user/dir/", "home/user/dir/sub/", "home/user/dir/sub/f"}
	if !slices.Equal(got, want) {
		t.Errorf("archived %q, want %q", got, want)
	}
	runtime.KeepAlive(s)
}

// TestArchiveUpperLayerGone: an upper layer that cannot be read is an
// error, not an archive without the root's files.
func TestArchiveUpperLayerGone(t *testing.T) {
	tw := tar.NewWriter(io.Discard)
	err := archiveUpper(tw, filepath.Join(t.TempDir(), "gone"), map[string]bool{}, map[string]bool{}, func(*unix.Stat_t) bool { return true })
	if err == nil {
		t.Fatal("an archive of a missing upper layer succeeded")
	}
}

// deepTree makes under dir a chain of directories whose path is longer than
// PATH_MAX (4,096 bytes, which no path-taking system call accepts), with a
// file at its bottom, by descriptors as a sandbox can, and returns the
// file's path below dir.
func deepTree(t *testing.T, dir string) string {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.Repeat("d", 200)
	rel := ""
	for len(rel) < 5000 {
		if err := unix.Mkdirat(fd, name, 0o755); err != nil {
			t.Fatal(err)
		}
		next, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(fd)
		fd, rel = next, rel+name+"/"
	}
	defer unix.Close(fd)
	f, err := unix.Openat(fd, "bottom.txt", unix.O_WRONLY|unix.O_CREAT|unix.O_CLOEXEC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	unix.Write(f, []byte("deep\n"))
	unix.Close(f)
	return rel + "bottom.txt"
}

// readAt reads the file at rel below dir through descriptors, one
// component at a time.
func readAt(dir, rel string) (string, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	parts := strings.Split(rel, "/")
	for _, c := range parts[:len(parts)-1] {
		next, err := unix.Openat(fd, c, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return "", err
		}
		fd = next
	}
	defer unix.Close(fd)
	f, err := unix.Openat(fd, parts[len(parts)-1], unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	file := os.NewFile(uintptr(f), "bottom")
	defer file.Close()
	b, err := io.ReadAll(file)
	return string(b), err
}

// TestArchiveDeepTree: a file whose path is longer than PATH_MAX is
// archived and restored like any other (before, the archive's walk by
// paths met ENAMETOOLONG there and left the tree's bottom out without a
// word: a pause lost it).
func TestArchiveDeepTree(t *testing.T) {
	dir := t.TempDir()
	rel := deepTree(t, dir)
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	all := func(string, *unix.Stat_t) bool { return true }
	for _, walk := range []struct {
		name, prefix string
		archive      func(tw *tar.Writer) error
	}{
		{"the root's upper layer", "", func(tw *tar.Writer) error {
			return archiveUpper(tw, dir, map[string]bool{"/": true}, map[string]bool{}, func(st *unix.Stat_t) bool { return all("/", st) })
		}},
		{"a mount point", strings.TrimPrefix(dir, "/") + "/", func(tw *tar.Writer) error {
			return archiveTree(tw, []string{dir}, map[uint64]bool{st.Dev: true}, map[string]bool{}, all)
		}},
	} {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		if err := walk.archive(tw); err != nil {
			t.Fatalf("archive of %s: %v", walk.name, err)
		}
		if err := tw.Close(); err != nil {
			t.Fatal(err)
		}
		found := false
		for tr := tar.NewReader(bytes.NewReader(b.Bytes())); ; {
			h, err := tr.Next()
			if err != nil {
				break
			}
			found = found || h.Name == walk.prefix+rel
		}
		if !found {
			t.Errorf("the archive of %s has no %d-byte path to the tree's bottom", walk.name, len(rel))
			continue
		}
		root := t.TempDir()
		if _, err := restoreTree(tar.NewReader(bytes.NewReader(b.Bytes())), root); err != nil {
			t.Fatalf("restore: %v", err)
		}
		if got, err := readAt(root, walk.prefix+rel); err != nil || got != "deep\n" {
			t.Errorf("the restored bottom (%s): %q, %v", walk.name, got, err)
		}
	}
}

// TestRestoreReplacedDirectory: an entry that replaces a directory the
// restore went through (a file where the archive had one) is written, and
// a later entry below its name is refused, not written into the removed
// directory.
func TestRestoreReplacedDirectory(t *testing.T) {
	root := t.TempDir()
	hdrs := []*tar.Header{
		{Name: "a/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "a/b/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "a/b/c", Typeflag: tar.TypeReg, Mode: 0o644},
		{Name: "a/b", Typeflag: tar.TypeReg, Mode: 0o644},
		{Name: "a/b/d", Typeflag: tar.TypeReg, Mode: 0o644},
	}
	_, err := restoreTree(tarOf(t, hdrs, map[string]string{"a/b/c": "c", "a/b": "file", "a/b/d": "d"}), root)
	if err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Errorf("an entry below a replaced directory: %v, want a refusal", err)
	}
	if b, err := os.ReadFile(filepath.Join(root, "a/b")); err != nil || string(b) != "file" {
		t.Errorf("a/b: %q, %v; want the file that replaced the directory", b, err)
	}
}
