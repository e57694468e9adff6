package imgstore

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"
)

// platform is the one platform templates are taken for.
var platform = v1.Platform{OS: "linux", Architecture: "amd64"}

// Bounds on the JSON documents of an archive, read whole into memory.
const (
	maxJSON       = 16 << 20
	maxTarEntries = 100_000 // entries of a docker-save or OCI tar (not of its layers)
)

// image is an image ready to unpack, whatever it came from.
type image struct {
	source string
	config []byte                          // the raw config, whose sha256 is the image ID
	layers []func() (io.ReadCloser, error) // uncompressed layer streams, bottom first
	close  func()
}

// blobs is where an archive's files are: a directory or a tar file.
type blobs interface {
	open(name string) (io.ReadCloser, error)
	has(name string) bool
	close()
}

// openArchive opens a docker-save tarball, an OCI image layout directory or
// an OCI image layout tar, and picks the image to import as name.
func openArchive(p, name string) (*image, error) {
	abs, err := filepath.Abs(p)
	if err != nil {
		return nil, err
	}
	// Whoever may write where the archive is may swap it between a look
	// and an open: it is opened without blocking (a FIFO would hold the
	// import for good) and what was opened is looked at.
	f, err := os.OpenFile(abs, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	var b blobs
	switch {
	case fi.IsDir():
		f.Close()
		b, err = openDirBlobs(abs)
	case fi.Mode().IsRegular():
		b, err = openTarBlobs(f, abs)
	default:
		f.Close()
		return nil, invalidf("%s is neither a file nor a directory", abs)
	}
	if err != nil {
		return nil, err
	}
	var img *image
	switch {
	case b.has("index.json") || b.has("oci-layout"):
		img, err = ociImage(b, name)
		if img != nil {
			img.source = "oci-layout:" + abs
		}
	case b.has("manifest.json"):
		img, err = dockerImage(b, name)
		if img != nil {
			img.source = "docker-archive:" + abs
		}
	default:
		err = invalidf("%s is neither a docker-save archive nor an OCI image layout (no index.json, oci-layout or manifest.json)", abs)
	}
	if err != nil {
		b.close()
		return nil, err
	}
	img.close = b.close
	return img, nil
}

// cleanArchivePath makes a path named inside an archive relative and clean,
// refusing one that climbs out of it.
func cleanArchivePath(p string) (string, error) {
	c := path.Clean(strings.TrimLeft(p, "/"))
	if c == ".." || strings.HasPrefix(c, "../") {
		return "", invalidf("path %q escapes the archive", p)
	}
	return c, nil
}

func readSmall(b blobs, name string) ([]byte, error) {
	rc, err := b.open(name)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, maxJSON+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if len(data) > maxJSON {
		return nil, invalidf("%s is larger than %d bytes", name, maxJSON)
	}
	return data, nil
}

// dirBlobs reads an archive unpacked in a directory, through an os.Root so
// that its symlinks cannot lead outside it.
type dirBlobs struct{ root *os.Root }

func openDirBlobs(dir string) (*dirBlobs, error) {
	r, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	return &dirBlobs{root: r}, nil
}

func (d *dirBlobs) open(name string) (io.ReadCloser, error) {
	// Look before opening: opening a FIFO would block.
	fi, err := d.root.Stat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, invalidf("%s is missing from the archive", name)
	}
	if err != nil {
		return nil, invalidf("%s: %v", name, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, invalidf("%s in the archive is not a regular file", name)
	}
	if testHookBeforeOpen != nil {
		testHookBeforeOpen(name)
	}
	// It may have been swapped since (a FIFO would block the open).
	f, err := d.root.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, invalidf("%s: %v", name, err)
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, invalidf("%s in the archive is not a regular file", name)
	}
	return f, nil
}

// testHookBeforeOpen, when set (by tests), runs between a blob's look and
// its open: where whoever may write the archive could swap it.
var testHookBeforeOpen func(name string)

func (d *dirBlobs) has(name string) bool {
	_, err := d.root.Stat(name)
	return err == nil
}

func (d *dirBlobs) close() { d.root.Close() }

// tarBlobs reads an archive that is a tar file. The tar is indexed once;
// each file is then a section of it.
type tarBlobs struct {
	f       *os.File
	entries map[string]tarEntry
}

type tarEntry struct {
	offset, size int64
	link         string // for a symlink or hard link: the cleaned path it names
}

// openTarBlobs indexes f, the archive p, a regular file; it takes f.
func openTarBlobs(f *os.File, p string) (*tarBlobs, error) {
	if err := refuseCompressed(f, p); err != nil {
		f.Close()
		return nil, err
	}
	entries, err := indexTar(f)
	if err != nil {
		f.Close()
		return nil, invalidf("%s is not a readable tar archive: %v", p, err)
	}
	return &tarBlobs{f: f, entries: entries}, nil
}

// refuseCompressed gives a clear error for a compressed archive, which
// cannot be read by sections.
func refuseCompressed(f *os.File, p string) error {
	var magic [4]byte
	n, _ := f.ReadAt(magic[:], 0)
	switch {
	case n >= 2 && magic[0] == 0x1f && magic[1] == 0x8b:
		return invalidf("%s is gzip-compressed; decompress it first", p)
	case n == 4 && bytes.Equal(magic[:], []byte{0x28, 0xb5, 0x2f, 0xfd}):
		return invalidf("%s is zstd-compressed; decompress it first", p)
	}
	return nil
}

// indexTar records where each file's data starts. tar.Reader reads exactly
// the header blocks from an *os.File, so after Next the file offset is the
// start of the entry's data. Sparse entries have no such single section and
// are left out.
func indexTar(f *os.File) (map[string]tarEntry, error) {
	entries := map[string]tarEntry{}
	tr := tar.NewReader(f)
	for n := 0; ; n++ {
		hdr, err := tr.Next()
		if err == io.EOF {
			return entries, nil
		}
		if err != nil {
			return nil, err
		}
		if n >= maxTarEntries {
			return nil, fmt.Errorf("more than %d entries", maxTarEntries)
		}
		name, err := cleanArchivePath(hdr.Name)
		if err != nil {
			return nil, err
		}
		if _, dup := entries[name]; dup {
			continue // the first one wins, as in go-containerregistry's tarball
		}
		switch hdr.Typeflag {
		case tar.TypeReg:
			if isSparse(hdr) {
				continue
			}
			off, err := f.Seek(0, io.SeekCurrent)
			if err != nil {
				return nil, err
			}
			entries[name] = tarEntry{offset: off, size: hdr.Size}
		case tar.TypeSymlink:
			target, err := cleanArchivePath(path.Join(path.Dir(name), hdr.Linkname))
			if err == nil {
				entries[name] = tarEntry{link: target}
			}
		case tar.TypeLink:
			target, err := cleanArchivePath(hdr.Linkname)
			if err == nil {
				entries[name] = tarEntry{link: target}
			}
		}
	}
}

func (t *tarBlobs) lookup(name string) (tarEntry, bool) {
	name, err := cleanArchivePath(name)
	if err != nil {
		return tarEntry{}, false
	}
	for range 8 {
		e, ok := t.entries[name]
		if !ok || e.link == "" {
			return e, ok
		}
		name = e.link
	}
	return tarEntry{}, false // a link loop
}

func (t *tarBlobs) open(name string) (io.ReadCloser, error) {
	e, ok := t.lookup(name)
	if !ok {
		return nil, invalidf("%s is missing from the archive", name)
	}
	return io.NopCloser(io.NewSectionReader(t.f, e.offset, e.size)), nil
}

func (t *tarBlobs) has(name string) bool {
	_, ok := t.lookup(name)
	return ok
}

func (t *tarBlobs) close() { t.f.Close() }

// dockerImage reads the image of a docker-save archive.
func dockerImage(b blobs, want string) (*image, error) {
	raw, err := readSmall(b, "manifest.json")
	if err != nil {
		return nil, err
	}
	var m tarball.Manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, invalidf("manifest.json: %v", err)
	}
	refs := make([][]string, len(m))
	for i, d := range m {
		refs[i] = d.RepoTags
	}
	i, err := pick(refs, want)
	if err != nil {
		return nil, err
	}
	d := m[i]
	cfgPath, err := cleanArchivePath(d.Config)
	if err != nil {
		return nil, err
	}
	config, err := readSmall(b, cfgPath)
	if err != nil {
		return nil, err
	}
	img := &image{config: config}
	for _, l := range d.Layers {
		lp, err := cleanArchivePath(l)
		if err != nil {
			return nil, err
		}
		img.layers = append(img.layers, uncompressedOpener(b, lp, v1.Hash{}))
	}
	return img, nil
}

// ociImage reads the image of an OCI image layout.
func ociImage(b blobs, want string) (*image, error) {
	raw, err := readSmall(b, "index.json")
	if err != nil {
		return nil, err
	}
	idx, err := v1.ParseIndexManifest(bytes.NewReader(raw))
	if err != nil {
		return nil, invalidf("index.json: %v", err)
	}
	var cands []v1.Descriptor
	for _, d := range idx.Manifests {
		if (d.MediaType.IsImage() || d.MediaType.IsIndex()) && platformOK(d.Platform) {
			cands = append(cands, d)
		}
	}
	if len(cands) == 0 {
		return nil, invalidf("index.json lists no %s image", platform)
	}
	refs := make([][]string, len(cands))
	for i, d := range cands {
		for _, k := range []string{"io.containerd.image.name", "org.opencontainers.image.ref.name"} {
			if r := d.Annotations[k]; r != "" {
				refs[i] = append(refs[i], r)
			}
		}
	}
	i, err := pick(refs, want)
	if err != nil {
		return nil, err
	}
	m, err := resolveManifest(b, cands[i], 0)
	if err != nil {
		return nil, err
	}
	config, err := readBlob(b, m.Config)
	if err != nil {
		return nil, err
	}
	img := &image{config: config}
	for _, l := range m.Layers {
		if err := checkLayerDescriptor(l); err != nil {
			return nil, err
		}
		p, err := blobPath(l.Digest)
		if err != nil {
			return nil, err
		}
		img.layers = append(img.layers, uncompressedOpener(b, p, l.Digest))
	}
	return img, nil
}

func platformOK(p *v1.Platform) bool {
	return p == nil || (p.OS == platform.OS && p.Architecture == platform.Architecture)
}

// resolveManifest follows indexes down to the image manifest for platform.
func resolveManifest(b blobs, d v1.Descriptor, depth int) (*v1.Manifest, error) {
	if depth > 4 {
		return nil, invalidf("image indexes nest too deep")
	}
	raw, err := readBlob(b, d)
	if err != nil {
		return nil, err
	}
	if d.MediaType.IsImage() {
		m, err := v1.ParseManifest(bytes.NewReader(raw))
		if err != nil {
			return nil, invalidf("manifest %s: %v", shortDigest(d.Digest.String()), err)
		}
		return m, nil
	}
	idx, err := v1.ParseIndexManifest(bytes.NewReader(raw))
	if err != nil {
		return nil, invalidf("index %s: %v", shortDigest(d.Digest.String()), err)
	}
	for _, c := range idx.Manifests {
		if (c.MediaType.IsImage() || c.MediaType.IsIndex()) && c.Platform != nil && platformOK(c.Platform) {
			return resolveManifest(b, c, depth+1)
		}
	}
	// An index of one image that does not say its platform.
	if len(idx.Manifests) == 1 && idx.Manifests[0].Platform == nil {
		return resolveManifest(b, idx.Manifests[0], depth+1)
	}
	return nil, invalidf("the image has no %s variant", platform)
}

func blobPath(h v1.Hash) (string, error) {
	hx, err := digestHex(h.String())
	if err != nil {
		return "", err
	}
	return "blobs/sha256/" + hx, nil
}

// readBlob reads a small blob (a manifest, an index, a config) and checks
// its digest.
func readBlob(b blobs, d v1.Descriptor) ([]byte, error) {
	p, err := blobPath(d.Digest)
	if err != nil {
		return nil, err
	}
	data, err := readSmall(b, p)
	if err != nil {
		return nil, err
	}
	if sum := sha256.Sum256(data); hex.EncodeToString(sum[:]) != d.Digest.Hex {
		return nil, invalidf("blob %s does not match its digest", shortDigest(d.Digest.String()))
	}
	return data, nil
}

// checkLayerDescriptor refuses foreign layers: their URLs would make the
// import fetch from wherever the image says.
func checkLayerDescriptor(d v1.Descriptor) error {
	if len(d.URLs) > 0 || !d.MediaType.IsDistributable() {
		return invalidf("layer %s is a foreign layer, which cage does not fetch", shortDigest(d.Digest.String()))
	}
	return nil
}

// uncompressedOpener opens a layer blob and undoes its compression (gzip,
// zstd or none, found by looking). A known compressed digest is checked as
// the blob is read.
func uncompressedOpener(b blobs, p string, digest v1.Hash) func() (io.ReadCloser, error) {
	return func() (io.ReadCloser, error) {
		rc, err := (&blobLayer{b: b, path: p, digest: digest}).Compressed()
		if err != nil {
			return nil, err
		}
		return uncompress(rc)
	}
}

// maxZstdWindow is the largest zstd window a layer may ask for: the
// reference decoder's own default limit (zstd refuses more unless given
// --long or --memory). The decoder keeps a window's worth of history, and
// go-containerregistry's allowed 512 MiB: a 67 KB layer declaring it took
// the importer 513 MiB.
const maxZstdWindow = 128 << 20

// uncompress undoes a layer stream's compression (gzip, zstd or none,
// found by looking) and closes rc with the result.
func uncompress(rc io.ReadCloser) (io.ReadCloser, error) {
	br := bufio.NewReader(rc)
	magic, _ := br.Peek(4)
	switch {
	case len(magic) >= 2 && magic[0] == 0x1f && magic[1] == 0x8b:
		zr, err := gzip.NewReader(br)
		if err != nil {
			rc.Close()
			return nil, err
		}
		return &readCloser{Reader: zr, close: func() error { zr.Close(); return rc.Close() }}, nil
	case len(magic) == 4 && bytes.Equal(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br, zstd.WithDecoderMaxWindow(maxZstdWindow), zstd.WithDecoderConcurrency(1))
		if err != nil {
			rc.Close()
			return nil, err
		}
		return &readCloser{Reader: zr, close: func() error { zr.Close(); return rc.Close() }}, nil
	}
	return &readCloser{Reader: br, close: rc.Close}, nil
}

type readCloser struct {
	io.Reader
	close func() error
}

func (r *readCloser) Close() error { return r.close() }

// blobLayer is a layer blob of an archive, as partial.CompressedLayer.
type blobLayer struct {
	b      blobs
	path   string
	digest v1.Hash // zero when the archive does not say (docker-save)
}

func (l *blobLayer) Digest() (v1.Hash, error)            { return l.digest, nil }
func (l *blobLayer) Size() (int64, error)                { return -1, nil }
func (l *blobLayer) MediaType() (types.MediaType, error) { return types.DockerLayer, nil }
func (l *blobLayer) Compressed() (io.ReadCloser, error) {
	rc, err := l.b.open(l.path)
	if err != nil || l.digest.Hex == "" {
		return rc, err
	}
	return &verifyReader{rc: rc, h: sha256.New(), want: l.digest}, nil
}

// verifyReader fails the read that reaches the end of a blob whose bytes
// do not match its digest.
type verifyReader struct {
	rc   io.ReadCloser
	h    hash.Hash
	want v1.Hash
}

func (v *verifyReader) Read(p []byte) (int, error) {
	n, err := v.rc.Read(p)
	v.h.Write(p[:n])
	if err == io.EOF && hex.EncodeToString(v.h.Sum(nil)) != v.want.Hex {
		return n, invalidf("blob %s does not match its digest", shortDigest(v.want.String()))
	}
	return n, err
}

func (v *verifyReader) Close() error { return v.rc.Close() }

// pick chooses, among an archive's images (each with its refs), the one to
// import as want: the one whose ref is want or want:latest, else the one
// whose repository's last element is want, else the only image.
func pick(refs [][]string, want string) (int, error) {
	for _, score := range []func(string) bool{
		func(r string) bool { return r == want || r == want+":latest" },
		func(r string) bool { return repoBase(r) == want },
	} {
		var hits []int
		for i, rs := range refs {
			for _, r := range rs {
				if score(r) {
					hits = append(hits, i)
					break
				}
			}
		}
		if len(hits) == 1 {
			return hits[0], nil
		}
		if len(hits) > 1 {
			return 0, invalidf("the archive holds %d images matching %q: %s", len(hits), want, listRefs(refs, hits))
		}
	}
	if len(refs) == 1 {
		return 0, nil
	}
	all := make([]int, len(refs))
	for i := range all {
		all[i] = i
	}
	return 0, invalidf("the archive holds %d images and none is %q: %s", len(refs), want, listRefs(refs, all))
}

// repoBase is the last element of a reference's repository:
// "docker.io/library/python:3.12" -> "python".
func repoBase(ref string) string {
	ref, _, _ = strings.Cut(ref, "@")
	if i := strings.LastIndex(ref, ":"); i > strings.LastIndex(ref, "/") {
		ref = ref[:i]
	}
	return ref[strings.LastIndex(ref, "/")+1:]
}

func listRefs(refs [][]string, which []int) string {
	var names []string
	for _, i := range which {
		if len(refs[i]) == 0 {
			names = append(names, fmt.Sprintf("#%d (untagged)", i+1))
		} else {
			names = append(names, strings.Join(refs[i], " "))
		}
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// remoteImage reads an image from a registry, for platform.
func remoteImage(ctx context.Context, ref string, o Options) (*image, error) {
	opts := []name.Option{name.WeakValidation}
	if o.Insecure {
		opts = append(opts, name.Insecure)
	}
	r, err := name.ParseReference(ref, opts...)
	if err != nil {
		return nil, invalidf("image reference %q: %v", ref, err)
	}
	// go-containerregistry speaks plain http to loopback and private
	// addresses on its own; cage does so only when asked.
	if reg := r.Context().Registry; !o.Insecure && reg.Scheme() == "http" {
		return nil, fmt.Errorf("registry %s would be reached over plain http; allow it with the insecure option", reg.Name())
	}
	img, err := remote.Image(r,
		remote.WithContext(ctx),
		remote.WithPlatform(platform),
		remote.WithAuthFromKeychain(authn.DefaultKeychain))
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	if m.Config.Size > maxJSON {
		return nil, invalidf("the config of %s is larger than %d bytes", ref, maxJSON)
	}
	for _, l := range m.Layers {
		if err := checkLayerDescriptor(l); err != nil {
			return nil, err
		}
	}
	config, err := img.RawConfigFile()
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	out := &image{source: "registry:" + r.Name(), config: config, close: func() {}}
	for _, l := range layers {
		out.layers = append(out.layers, func() (io.ReadCloser, error) {
			rc, err := l.Compressed() // its digest checked as it is read
			if err != nil {
				return nil, err
			}
			return uncompress(rc)
		})
	}
	return out, nil
}
