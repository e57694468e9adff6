package volume

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// newVolume makes a manager in temporary directories and one volume of
// size bytes, opened; everything is removed at the end.
func newVolume(t *testing.T, size int64) (*Manager, *Root, string) {
	t.Helper()
	testutil.RequireRoot(t)
	m := New(Config{Data: t.TempDir(), RunDir: t.TempDir(), Size: size})
	const id = "v0test"
	if err := m.Create(id); err != nil {
		t.Fatal(err)
	}
	r, err := m.Open(id)
	if err != nil {
		_ = m.Remove(id)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.Close()
		if err := m.Remove(id); err != nil {
			t.Errorf("remove: %v", err)
		}
		if isMountRoot(m.mountDir(id)) {
			t.Errorf("%s is still mounted after Remove", m.mountDir(id))
		}
	})
	return m, r, m.mountDir(id)
}

func u32(v uint32) *uint32 { return &v }

func TestVolumeFiles(t *testing.T) {
	_, r, _ := newVolume(t, 16<<20)
	root, err := r.Stat("/")
	if err != nil || root.Type != "directory" || root.UID != UserID || root.GID != UserID || root.Mode != 0o755 {
		t.Fatalf("the root: %+v, %v; want a directory of %d:%d, 0755", root, err, UserID, UserID)
	}
	e, err := r.Write("/a/b/c.txt", strings.NewReader("hello"), Meta{}, true)
	if err != nil {
		t.Fatal(err)
	}
	if e.Type != "file" || e.Size != 5 || e.Mode != 0o644 || e.UID != UserID || e.Path != "/a/b/c.txt" || e.Name != "c.txt" {
		t.Errorf("written: %+v", e)
	}
	if _, err := r.Write("/x/y.txt", strings.NewReader("x"), Meta{}, false); !errors.Is(err, ErrNotFound) {
		t.Errorf("a write without force under a missing directory: %v, want ErrNotFound", err)
	}
	f, _, err := r.Open("a/b/c.txt") // relative: from the root
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(f)
	f.Close()
	if string(b) != "hello" {
		t.Errorf("read %q", b)
	}
	if _, err := r.Write("/a/b/c.txt", strings.NewReader("replaced"), Meta{UID: u32(0), Mode: u32(0o600)}, false); err != nil {
		t.Fatal(err)
	}
	if e, _ := r.Stat("/a/b/c.txt"); e.Size != 8 || e.UID != 0 || e.Mode != 0o600 {
		t.Errorf("replaced: %+v", e)
	}
	if _, err := r.MakeDir("/a", Meta{}, false); !errors.Is(err, ErrExists) {
		t.Errorf("mkdir of an existing directory: %v, want ErrExists", err)
	}
	if _, err := r.MakeDir("/a", Meta{}, true); err != nil {
		t.Errorf("mkdir -p of an existing directory: %v", err)
	}
	if e, err := r.MakeDir("/d", Meta{Mode: u32(0o700), GID: u32(5)}, false); err != nil || e.Mode != 0o700 || e.GID != 5 || e.UID != UserID {
		t.Errorf("mkdir /d: %+v, %v", e, err)
	}
	if e, err := r.SetMeta("/d", Meta{Mode: u32(0o750), UID: u32(7)}); err != nil || e.Mode != 0o750 || e.UID != 7 {
		t.Errorf("update /d: %+v, %v", e, err)
	}
	for _, bad := range []Meta{{UID: u32(65536)}, {Mode: u32(0o10000)}} {
		if _, err := r.SetMeta("/d", bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("update with %+v: %v, want ErrInvalid", bad, err)
		}
	}
	list, err := r.List("/", 1)
	if err != nil || len(list) != 2 || list[0].Path != "/a" || list[1].Path != "/d" {
		t.Errorf("list / depth 1: %+v, %v", list, err)
	}
	list, err = r.List("/", 3)
	if err != nil || len(list) != 4 || list[2].Path != "/a/b/c.txt" {
		t.Errorf("list / depth 3: %+v, %v", list, err)
	}
	if err := r.Remove("/a"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Stat("/a/b"); !errors.Is(err, ErrNotFound) {
		t.Errorf("after removing /a: %v", err)
	}
	if err := r.Remove("/"); !errors.Is(err, ErrInvalid) {
		t.Errorf("remove /: %v, want ErrInvalid", err)
	}
	if err := r.Remove("/nothing"); !errors.Is(err, ErrNotFound) {
		t.Errorf("remove of a missing path: %v, want ErrNotFound", err)
	}
}

// TestVolumeQuota: the volume's size is its quota; a write past it fails
// with ErrNoSpace and leaves nothing behind.
func TestVolumeQuota(t *testing.T) {
	_, r, _ := newVolume(t, 16<<20)
	_, err := r.Write("/big", io.LimitReader(zeros{}, 64<<20), Meta{}, false)
	if !errors.Is(err, ErrNoSpace) {
		t.Fatalf("64 MiB into a 16 MiB volume: %v, want ErrNoSpace", err)
	}
	if list, _ := r.List("/", 1); len(list) != 0 {
		t.Errorf("after the failed write the volume holds %+v, want nothing", list)
	}
	if _, err := r.Write("/small", strings.NewReader("fits"), Meta{}, false); err != nil {
		t.Errorf("a small write after the failed one: %v", err)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// TestVolumeHostileEntries: what a sandbox may leave in a volume (planted
// here through the host's mount, as a sandbox's root would make them)
// never leads an operation out of it, blocks it, or is written through.
func TestVolumeHostileEntries(t *testing.T) {
	_, r, dir := newVolume(t, 32<<20)
	outside := t.TempDir()
	secret := filepath.Join(outside, "secret")
	if err := os.WriteFile(secret, []byte("host secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Symlink(secret, filepath.Join(dir, "link")))
	must(os.Symlink(outside, filepath.Join(dir, "dirlink")))
	must(os.Symlink("..", filepath.Join(dir, "up")))
	must(unix.Mkfifo(filepath.Join(dir, "fifo"), 0o666))
	must(unix.Mknod(filepath.Join(dir, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	sock, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	must(err)
	must(unix.Bind(sock, &unix.SockaddrUnix{Name: filepath.Join(dir, "sock")}))
	unix.Close(sock)
	must(os.WriteFile(filepath.Join(dir, "orig"), []byte("original"), 0o644))
	must(os.Link(filepath.Join(dir, "orig"), filepath.Join(dir, "hardlink")))

	if _, _, err := r.Open("/link"); !errors.Is(err, ErrInvalid) {
		t.Errorf("read through a symlink to a host file: %v, want ErrInvalid", err)
	}
	if _, _, err := r.Open("/dirlink/secret"); !errors.Is(err, ErrInvalid) {
		t.Errorf("read through a symlinked directory: %v, want ErrInvalid", err)
	}
	if _, _, err := r.Open("/up/" + filepath.Base(dir)); err == nil {
		t.Errorf("read through a symlink to ..: allowed")
	}
	done := make(chan error, 1)
	go func() { _, _, err := r.Open("/fifo"); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("read of a FIFO: %v, want ErrInvalid", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("read of a FIFO blocked")
	}
	for _, p := range []string{"/null", "/sock"} {
		if _, _, err := r.Open(p); !errors.Is(err, ErrInvalid) {
			t.Errorf("read of %s (a device node, a socket): %v, want ErrInvalid", p, err)
		}
	}
	if _, err := r.Write("/link", strings.NewReader("overwritten"), Meta{}, false); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(secret); string(b) != "host secret" {
		t.Errorf("a write at a symlink changed its target to %q", b)
	}
	if e, _ := r.Stat("/link"); e.Type != "file" {
		t.Errorf("a write at a symlink left %+v; want the link replaced by a file", e)
	}
	if _, err := r.Write("/dirlink/new", strings.NewReader("x"), Meta{}, false); !errors.Is(err, ErrInvalid) {
		t.Errorf("a write under a symlinked directory: %v, want ErrInvalid", err)
	}
	if _, err := os.Stat(filepath.Join(outside, "new")); err == nil {
		t.Errorf("a write under a symlinked directory landed on the host")
	}
	if _, err := r.Write("/hardlink", strings.NewReader("replaced"), Meta{}, false); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "orig")); string(b) != "original" {
		t.Errorf("a write at a hard link wrote through it: the other name reads %q", b)
	}
	if _, err := r.SetMeta("/dirlink", Meta{Mode: u32(0o777)}); !errors.Is(err, ErrInvalid) {
		t.Errorf("chmod of a symlink: %v, want ErrInvalid", err)
	}
	if _, err := r.SetMeta("/dirlink", Meta{UID: u32(0)}); err != nil {
		t.Errorf("chown of a symlink itself: %v", err)
	}
	var st unix.Stat_t
	if unix.Stat(outside, &st) == nil && st.Mode&0o777 == 0o777 {
		t.Errorf("chmod through a symlink reached the host directory")
	}
	if e, err := r.Stat("/dirlink"); err != nil || e.Type != "symlink" || e.Target != outside {
		t.Errorf("stat of a symlink: %+v, %v; want the link, its target named, not followed", e, err)
	}
	if list, err := r.List("/dirlink", 1); !errors.Is(err, ErrInvalid) {
		t.Errorf("list of a symlinked directory: %+v, %v; want ErrInvalid", list, err)
	}
	if list, err := r.List("/", 5); err != nil || containsPath(list, "/dirlink/secret") {
		t.Errorf("a deep listing followed a symlink: %+v, %v", list, err)
	}
	if err := r.Remove("/dirlink"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(secret); err != nil {
		t.Errorf("removing a symlink to a host directory removed what it names: %v", err)
	}
	if err := r.Remove("/up"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); err != nil {
		t.Errorf("removing a symlink to .. touched the volume: %v", err)
	}
}

func containsPath(list []Entry, p string) bool {
	for _, e := range list {
		if e.Path == p {
			return true
		}
	}
	return false
}

// TestVolumeDeepTree: a tree deeper than the bounds is refused with a
// clear error, listed only to the depth asked, and wider than the bound
// not listed whole.
func TestVolumeDeepTree(t *testing.T) {
	_, r, dir := newVolume(t, 64<<20)
	p := dir
	for i := 0; i < maxRemoveDepth+10; i++ {
		p = filepath.Join(p, "d")
		if err := unix.Mkdir(p, 0o755); err != nil {
			t.Fatalf("depth %d: %v", i, err)
		}
	}
	if err := r.Remove("/d"); !errors.Is(err, ErrTooLarge) {
		t.Errorf("remove of a tree %d deep: %v, want ErrTooLarge", maxRemoveDepth+10, err)
	}
	if list, err := r.List("/", MaxListDepth); err != nil || len(list) != MaxListDepth {
		t.Errorf("list at depth %d: %d entries, %v", MaxListDepth, len(list), err)
	}
	if _, err := r.List("/", MaxListDepth+1); !errors.Is(err, ErrInvalid) {
		t.Errorf("list deeper than %d: %v, want ErrInvalid", MaxListDepth, err)
	}
	wide := filepath.Join(dir, "wide")
	if err := os.Mkdir(wide, 0o755); err != nil {
		t.Fatal(err)
	}
	for i := 0; i <= MaxListEntries; i++ {
		f, err := os.Create(filepath.Join(wide, "f"+strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	if _, err := r.List("/wide", 1); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a listing of %d entries: %v, want ErrTooLarge", MaxListEntries+1, err)
	}
	if err := r.Remove("/wide"); err != nil {
		t.Errorf("remove a wide directory: %v", err)
	}
}

// TestVolumeHugeDirectory: a sandbox may fill a directory with hundreds of
// thousands of hard links (no inode each). A listing of it is refused
// after the host has read little more than MaxListEntries names, and a
// removal takes it away a batch at a time. (Before, each listing read
// every name first: 81 MiB for 200,000, and 1.2 GB of daemon memory for
// eight listings at once of 480,000.)
func TestVolumeHugeDirectory(t *testing.T) {
	_, r, dir := newVolume(t, 512<<20)
	big := filepath.Join(dir, "big")
	if err := os.Mkdir(big, 0o755); err != nil {
		t.Fatal(err)
	}
	pad := strings.Repeat("x", 200)
	const n = 150_000
	var target string
	for i := range n {
		if i%60_000 == 0 { // ext4 allows 65,000 links a file
			target = filepath.Join(dir, "target"+strconv.Itoa(i))
			if err := os.WriteFile(target, nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Link(target, filepath.Join(big, pad+strconv.Itoa(i))); err != nil {
			t.Fatalf("link %d: %v", i, err)
		}
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err := r.List("/big", 1)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrTooLarge) {
		t.Errorf("a listing of %d names: %v, want ErrTooLarge", n, err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 16<<20 {
		t.Errorf("a refused listing of %d names allocated %d MiB", n, got>>20)
	}
	if err := r.Remove("/big"); err != nil {
		t.Fatalf("remove the directory of %d names: %v", n, err)
	}
	if _, err := os.Stat(big); !os.IsNotExist(err) {
		t.Errorf("after its removal: %v", err)
	}
}

// TestVolumeListBytesBounded: a sandbox can make a listing's entries long
// without using the volume's space: a chain of directories with 255-byte
// names, 10,000 hard links at its end to one symlink of a 4095-byte
// target, all of bytes JSON writes six times over (\u0001). A listing of
// it whole is refused before it holds more than MaxListBytes of names
// (paths, names and targets as JSON writes them); one deep enough to see
// only part of it is served. (Before, the listing was served: some 200
// MiB of strings in the daemon and 1.2 GB of JSON, per request.)
func TestVolumeListBytesBounded(t *testing.T) {
	_, r, dir := newVolume(t, 1<<30) // 4 KiB blocks: symlinks of 4095 bytes
	long := strings.Repeat("\x01", 255)
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < MaxListDepth-1; i++ {
		if err := unix.Mkdirat(fd, long, 0o755); err != nil {
			t.Fatalf("depth %d: %v", i, err)
		}
		next, err := unix.Openat(fd, long, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		fd = next
	}
	defer unix.Close(fd)
	if err := unix.Symlinkat(strings.Repeat("\x01", 4095), fd, "l"); err != nil {
		t.Fatal(err)
	}
	const n = MaxListEntries - MaxListDepth
	for i := range n {
		name := strconv.Itoa(i) + long[:250]
		if err := unix.Linkat(fd, "l", fd, name, 0); err != nil {
			t.Fatalf("link %d: %v", i, err)
		}
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	list, err := r.List("/", MaxListDepth)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrTooLarge) {
		var sum int
		for _, e := range list {
			sum += len(e.Path) + len(e.Name) + len(e.Target)
		}
		t.Errorf("a listing of %d entries, %d MiB of names: %v, want ErrTooLarge", len(list), sum>>20, err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 4*MaxListBytes {
		t.Errorf("a refused listing allocated %d MiB", got>>20)
	}
	// The chain alone (no links) is a listing like any other.
	if list, err := r.List("/", MaxListDepth-1); err != nil || len(list) != MaxListDepth-1 {
		t.Errorf("the chain to depth %d: %d entries, %v", MaxListDepth-1, len(list), err)
	}
}

// TestJSONLen: a listing's bound counts names as encoding/json writes them.
func TestJSONLen(t *testing.T) {
	for _, s := range []string{"", "plain.txt", "\x01\n\t", `a"b\c`, "<&>", "é日本", "\xff\xfe", "a\u2028b\u2029", "\xe6\x97"} {
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := jsonLen(s), len(b)-2; got < want {
			t.Errorf("jsonLen(%q) = %d, JSON writes %d", s, got, want)
		}
	}
}

// TestVolumeRemoveWhileHeld: a volume open for a content request (an
// upload may last an hour) is not removed under it: the removal is
// refused (ErrBusy) and nothing of the volume goes, and it succeeds once
// the request lets go. Before (found by review, 2026-12-04), the removal
// unlinked the image and detached the mount under the request, whose
// descriptor kept the file system, and the image's blocks on the host's
// disk, for as long as it lasted, outside every quota: a key could fill a
// volume through an upload it kept alive, delete the volume, make another
// and do it again, up to its connections' worth of volumes.
func TestVolumeRemoveWhileHeld(t *testing.T) {
	testutil.RequireRoot(t)
	m := New(Config{Data: t.TempDir(), RunDir: t.TempDir(), Size: 16 << 20})
	const id = "v0held"
	if err := m.Create(id); err != nil {
		t.Fatal(err)
	}
	defer m.Remove(id)
	r, err := m.OpenHeld(id)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Remove(id); !errors.Is(err, ErrBusy) {
		t.Errorf("remove while a content request holds it: %v, want ErrBusy", err)
	}
	if _, err := os.Stat(m.image(id)); err != nil {
		t.Errorf("the refused removal took the image: %v", err)
	}
	if _, err := r.Write("/f", strings.NewReader("still here"), Meta{}, false); err != nil {
		t.Errorf("the request's write after the refused removal: %v", err)
	}
	r.Close()
	r.Close() // twice: let go once
	if err := m.Remove(id); err != nil {
		t.Fatalf("remove once the request let go: %v", err)
	}
	if _, err := os.Stat(m.image(id)); !os.IsNotExist(err) {
		t.Errorf("after the removal the image is still there: %v", err)
	}
	// A volume opened for a sandbox's start (Open) is the caller's to
	// account for (its record names the volume).
	if err := m.Create(id); err != nil {
		t.Fatal(err)
	}
	r2, err := m.Open(id)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if err := m.Remove(id); err != nil {
		t.Errorf("remove beside a start's open: %v", err)
	}
}

// TestOpenMissingImageNamesNoHostPath: a volume whose image is gone (its
// deletion removes the files before the record, so a content request
// racing its owner's delete meets one) is the content API's 404, whose
// message reaches whoever holds the volume's token: it names the volume,
// never the host's data directory. Found by review, 2026-12-04: the
// message quoted the stat error, "stat /var/lib/cage/volumes/ID/
// volume.img: no such file or directory".
func TestOpenMissingImageNamesNoHostPath(t *testing.T) {
	data, run := t.TempDir(), t.TempDir()
	m := New(Config{Data: data, RunDir: run})
	for _, open := range []func(string) (*Root, error){m.Open, m.OpenHeld} {
		r, err := open("v0gone")
		if err == nil {
			r.Close()
			t.Fatal("a volume without an image opened")
		}
		if !errors.Is(err, ErrNotFound) {
			t.Errorf("%v: want ErrNotFound", err)
		}
		if msg := err.Error(); strings.Contains(msg, data) || strings.Contains(msg, run) || strings.Contains(msg, "/") {
			t.Errorf("the message names a host path: %q", msg)
		}
	}
}
