package imgstore

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (ownership, devices, xattrs, mounts)")
	}
}

// testTime is the mtime of the entries the tests make.
var testTime = time.Date(2021, 1, 2, 3, 4, 5, 0, time.UTC)

// layer builds a layer tar, entry by entry.
type layer struct {
	buf bytes.Buffer
	tw  *tar.Writer
	t   *testing.T
}

func newLayer(t *testing.T) *layer {
	l := &layer{t: t}
	l.tw = tar.NewWriter(&l.buf)
	return l
}

func (l *layer) add(h tar.Header, body string) *layer {
	l.t.Helper()
	if h.ModTime.IsZero() {
		h.ModTime = testTime
	}
	if h.Typeflag == tar.TypeReg {
		h.Size = int64(len(body))
	}
	if len(h.PAXRecords) > 0 {
		h.Format = tar.FormatPAX
	}
	if err := l.tw.WriteHeader(&h); err != nil {
		l.t.Fatal(err)
	}
	if body != "" {
		if _, err := l.tw.Write([]byte(body)); err != nil {
			l.t.Fatal(err)
		}
	}
	return l
}

func (l *layer) dir(name string, mode int64) *layer {
	return l.add(tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: mode}, "")
}

func (l *layer) file(name, body string, mode int64) *layer {
	return l.add(tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: mode}, body)
}

func (l *layer) symlink(name, target string) *layer {
	return l.add(tar.Header{Name: name, Typeflag: tar.TypeSymlink, Linkname: target, Mode: 0o777}, "")
}

func (l *layer) hardlink(name, target string) *layer {
	return l.add(tar.Header{Name: name, Typeflag: tar.TypeLink, Linkname: target, Mode: 0o644}, "")
}

func (l *layer) bytes() []byte {
	l.t.Helper()
	if err := l.tw.Close(); err != nil {
		l.t.Fatal(err)
	}
	return l.buf.Bytes()
}

func diffID(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// buildImage makes a linux/amd64 image of uncompressed layer tars (which
// go-containerregistry compresses as it writes them out, with gzip unless
// told otherwise).
func buildImage(t *testing.T, cfg v1.Config, layers [][]byte, opts ...tarball.LayerOption) v1.Image {
	t.Helper()
	var ls []v1.Layer
	for _, b := range layers {
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
			return io.NopCloser(bytes.NewReader(b)), nil
		}, opts...)
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
	}
	img, err := mutate.AppendLayers(empty.Image, ls...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", "amd64", cfg
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func writeDockerSave(t *testing.T, img v1.Image, tag string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "image.tar")
	ref, err := name.ParseReference(tag)
	if err != nil {
		t.Fatal(err)
	}
	if err := tarball.WriteToFile(p, ref, img); err != nil {
		t.Fatal(err)
	}
	return p
}

func writeOCIDir(t *testing.T, img v1.Image, ref string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "oci")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": ref})); err != nil {
		t.Fatal(err)
	}
	return dir
}

// tarDir tars a directory (an OCI layout) into a file.
func tarDir(t *testing.T, dir string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "oci.tar")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || path == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		h, err := tar.FileInfoHeader(fi, "")
		if err != nil {
			return err
		}
		h.Name = rel
		if d.IsDir() {
			h.Name += "/"
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if d.Type().IsRegular() {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			_, err = tw.Write(b)
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return p
}

// startRegistry runs an in-process registry on loopback.
func startRegistry(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

func push(t *testing.T, img v1.Image, ref string) {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
}

// rawArchive writes a docker-save archive by hand, with the config and
// layer files given as they are: what a hostile archive can do.
func rawArchive(t *testing.T, cfg *v1.ConfigFile, layers ...[]byte) string {
	t.Helper()
	cfgJSON, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	d := tarball.Descriptor{Config: "config.json", RepoTags: []string{"evil:latest"}}
	files := map[string][]byte{"config.json": cfgJSON}
	for i, l := range layers {
		p := filepath.Join("l"+string(rune('a'+i)), "layer.tar")
		d.Layers = append(d.Layers, p)
		files[p] = l
	}
	m, _ := json.Marshal(tarball.Manifest{d})
	files["manifest.json"] = m
	p := filepath.Join(t.TempDir(), "raw.tar")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	for _, n := range []string{"manifest.json", "config.json"} {
		tw.WriteHeader(&tar.Header{Name: n, Mode: 0o644, Size: int64(len(files[n])), Typeflag: tar.TypeReg})
		tw.Write(files[n])
	}
	for _, n := range d.Layers {
		tw.WriteHeader(&tar.Header{Name: n, Mode: 0o644, Size: int64(len(files[n])), Typeflag: tar.TypeReg})
		tw.Write(files[n])
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return p
}

// configFor is a linux/amd64 config with the given diff IDs.
func configFor(t *testing.T, diffIDs ...string) *v1.ConfigFile {
	t.Helper()
	cf := &v1.ConfigFile{OS: "linux", Architecture: "amd64"}
	cf.RootFS.Type = "layers"
	for _, d := range diffIDs {
		h, err := v1.NewHash(d)
		if err != nil {
			t.Fatal(err)
		}
		cf.RootFS.DiffIDs = append(cf.RootFS.DiffIDs, h)
	}
	return cf
}

// importRaw imports uncompressed layers as they are, with correct diff IDs.
func importRaw(t *testing.T, s *Store, o Options, layers ...[]byte) (*Template, error) {
	t.Helper()
	var ids []string
	for _, l := range layers {
		ids = append(ids, diffID(l))
	}
	return s.Import(context.Background(), rawArchive(t, configFor(t, ids...), layers...), "evil", o)
}

func openStore(t *testing.T) *Store {
	t.Helper()
	s, err := Open(filepath.Join(t.TempDir(), "templates"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// progressLog collects Progress lines.
type progressLog struct {
	mu    sync.Mutex
	lines []string
}

func (p *progressLog) f(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lines = append(p.lines, fmt.Sprintf(format, args...))
}

func (p *progressLog) count(substr string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, l := range p.lines {
		if strings.Contains(l, substr) {
			n++
		}
	}
	return n
}

// layerEntries lists what is under the store's layers directory.
func layerEntries(t *testing.T, s *Store) []string {
	t.Helper()
	es, err := os.ReadDir(filepath.Join(s.Dir(), "layers"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return names
}

func lstat(t *testing.T, p string) *unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return &st
}

func getxattr(p, attr string) (string, error) {
	buf := make([]byte, 256)
	n, err := unix.Lgetxattr(p, attr, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
