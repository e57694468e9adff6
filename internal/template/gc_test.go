package template

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/imgstore"
)

// oneFileImage writes a docker-archive of one layer holding the files
// (name to content) and returns its path.
func oneFileImage(t *testing.T, files map[string]string) string {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for n, c := range files {
		if err := tw.WriteHeader(&tar.Header{Name: n, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(c))}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(c)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, l)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "image.tar")
	if err := tarball.WriteToFile(p, name.MustParseReference("r:latest"), img); err != nil {
		t.Fatal(err)
	}
	return p
}

// Attack (on what a tenant has: a running sandbox): its template is
// replaced (an import, a pull or a build under the same name, or `cage
// template gc`) while the sandbox runs on the old one. A sandbox's root
// names no layer path in mountinfo (its layers are idmapped copies, given
// to overlayfs by descriptor since Linux 6.13), and GC deleted the old
// layers under it: its files vanished. Expected: while the root is
// mounted, the old layers stay and the sandbox reads its files, even
// those it never read before; once it is unmounted, GC removes them.
func TestReplacedTemplateKeepsMountedLayers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIP: needs root")
	}
	s, err := imgstore.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	old, err := s.Import(ctx, oneFileImage(t, map[string]string{"version": "1", "unread": "old"}), "r", imgstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// A user namespace as a sandbox's: 0..65535 inside, 300000.. outside.
	holder := exec.Command("sleep", "60")
	holder.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 300000, Size: 65536}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 300000, Size: 65536}}}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Process.Kill(); _ = holder.Wait() }()
	ns, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", holder.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ns)
	dir := t.TempDir()
	tm := &Template{Name: "r", Image: &Image{Store: s, Info: old}}
	root, err := tm.MountImage(dir, 300000, func() (int, error) { return ns, nil }, 16<<20, 1000)
	if err != nil {
		t.Fatal(err)
	}
	unmount := func() {
		_ = unix.Unmount(root, unix.MNT_DETACH)
		_ = unix.Unmount(filepath.Join(dir, imageDisk), unix.MNT_DETACH)
	}
	defer unmount()
	if _, err := s.Import(ctx, oneFileImage(t, map[string]string{"version": "2"}), "r", imgstore.Options{}); err != nil {
		t.Fatal(err)
	}
	if removed, err := s.GC(); err != nil || len(removed) != 0 {
		t.Errorf("GC while the old template is mounted: removed %q, %v; want nothing", removed, err)
	}
	for file, want := range map[string]string{"unread": "old", "version": "1"} {
		if b, err := os.ReadFile(filepath.Join(root, file)); err != nil || string(b) != want {
			t.Errorf("the running sandbox's /%s after its template was replaced: %q, %v; want %q", file, b, err, want)
		}
	}
	if _, err := s.LayerDirs(old); err != nil {
		t.Errorf("the old template's layers: %v", err)
	}
	unmount()
	if removed, err := s.GC(); err != nil || len(removed) != 1 || removed[0] != old.Layers[0] {
		t.Errorf("GC once unmounted: removed %q, %v; want the old layer", removed, err)
	}
}
