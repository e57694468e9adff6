package testutil

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Busybox is the static busybox of Debian's busybox-static (scripts/test.sh
// installs it): the one binary of the test image.
const Busybox = "/bin/busybox"

// TarEntry is one entry of a test layer.
type TarEntry struct {
	Name     string
	Type     byte // tar.TypeReg (default), TypeDir, TypeSymlink, TypeLink, ...
	Mode     int64
	UID, GID int
	Body     []byte
	Link     string
}

// LayerTar writes entries as an uncompressed tar.
func LayerTar(t testing.TB, entries []TarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mtime := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, e := range entries {
		h := &tar.Header{Name: e.Name, Typeflag: e.Type, Mode: e.Mode, Uid: e.UID, Gid: e.GID, Linkname: e.Link,
			ModTime: mtime, Format: tar.FormatPAX}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.Body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write(e.Body); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// Layer makes an image layer of a tar.
func Layer(t testing.TB, tarBytes []byte) v1.Layer {
	t.Helper()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(tarBytes)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestImage is a small image in two layers, built around the host's static
// busybox: the first has busybox with its applets, a /bin/bash that runs
// busybox's sh (the agent runs E2B's `bash -l -c`), accounts, a file of uid
// 1000 and a file the second layer whites out; the second a setuid-root copy
// of busybox (as /usr/local/bin/suid/id) and a file of its own.
func TestImage(t testing.TB) v1.Image {
	t.Helper()
	bb, err := os.ReadFile(Busybox)
	if err != nil {
		t.Skipf("SKIP: the test image needs %s (apt-get install busybox-static): %v", Busybox, err)
	}
	base := []TarEntry{
		{Name: "bin/", Type: tar.TypeDir}, {Name: "etc/", Type: tar.TypeDir}, {Name: "usr/", Type: tar.TypeDir},
		{Name: "tmp/", Type: tar.TypeDir, Mode: 0o1777}, {Name: "root/", Type: tar.TypeDir, Mode: 0o700},
		{Name: "opt/", Type: tar.TypeDir}, {Name: "opt/data/", Type: tar.TypeDir},
		{Name: "bin/busybox", Mode: 0o755, Body: bb},
		{Name: "bin/bash", Mode: 0o755, Body: []byte("#!/bin/busybox sh\n[ \"$1\" = -l ] && shift\nexec /bin/busybox sh \"$@\"\n")},
		{Name: "etc/passwd", Body: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")},
		{Name: "etc/group", Body: []byte("root:x:0:\nnogroup:x:65534:\n")},
		{Name: "etc/os-release", Body: []byte("ID=cage-test\nNAME=\"cage test image\"\n")},
		{Name: "etc/doomed", Body: []byte("whited out by the second layer\n")},
		{Name: "opt/data/owned1000", Body: []byte("user's\n"), UID: 1000, GID: 1000},
	}
	for _, applet := range []string{"sh", "ls", "cat", "id", "stat", "echo", "touch", "mkdir", "rm", "dd", "sleep", "env",
		"head", "wc", "true", "false", "whoami", "hostname", "chmod", "chown", "cp", "mv", "df", "sync", "test", "grep", "tr", "sed", "ln", "nc", "readlink", "printf", "ps"} {
		base = append(base, TarEntry{Name: "bin/" + applet, Type: tar.TypeSymlink, Link: "busybox"})
	}
	second := []TarEntry{
		{Name: "etc/.wh.doomed"},
		{Name: "usr/local/", Type: tar.TypeDir}, {Name: "usr/local/bin/", Type: tar.TypeDir},
		{Name: "usr/local/bin/suid/", Type: tar.TypeDir},
		{Name: "usr/local/bin/suid/id", Mode: 0o4755, Body: bb},
		{Name: "usr/local/share/", Type: tar.TypeDir},
		{Name: "usr/local/share/layer2", Body: []byte("second layer\n")},
	}
	img, err := mutate.AppendLayers(empty.Image, Layer(t, LayerTar(t, base)), Layer(t, LayerTar(t, second)))
	if err != nil {
		t.Fatal(err)
	}
	img, err = mutate.Config(img, v1.Config{
		Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin", "CAGE_TEST_IMAGE=1"},
		WorkingDir: "/",
		Cmd:        []string{"sh"},
		Labels:     map[string]string{"org.cage.test": "yes"},
	})
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// WriteDockerArchive writes img as a `docker save` tarball tagged tag.
func WriteDockerArchive(t testing.TB, img v1.Image, tag string) string {
	t.Helper()
	ref, err := name.NewTag(tag)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "image.tar")
	if err := tarball.WriteToFile(path, ref, img); err != nil {
		t.Fatal(err)
	}
	return path
}
