package imgstore

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"
)

// Export writes the template as a docker-save tarball tagged name:latest,
// which Import reads back as the same image: the same config, byte for
// byte, and layers whose tars are rebuilt exactly from the unpacked files
// and the recipe recorded at import (see recipe.go), each checked against
// its diff ID. The store's shared lock is held meanwhile.
//
// On error the output is incomplete: manifest.json, written last, is
// missing, so nothing will load it.
func (s *Store) Export(ctx context.Context, name string, w io.Writer) error {
	if err := checkName(name); err != nil {
		return err
	}
	unlock, err := s.RLock()
	if err != nil {
		return err
	}
	defer unlock()
	t, err := s.readTemplate(name)
	if err != nil {
		return err
	}
	if err := s.export(ctx, t, w); err != nil {
		return fmt.Errorf("export %q: %w", name, err)
	}
	return nil
}

func (s *Store) export(ctx context.Context, t *Template, w io.Writer) error {
	idHex, err := digestHex(t.ID)
	if err != nil {
		return err
	}
	config, err := os.ReadFile(s.path(configsDir, idHex+".json"))
	if err != nil {
		return fmt.Errorf("image config: %w", err)
	}
	if sum := sha256.Sum256(config); hex.EncodeToString(sum[:]) != idHex {
		return fmt.Errorf("image config %s does not match the template's ID", s.path(configsDir, idHex+".json"))
	}
	tw := tar.NewWriter(w)
	if err := writeTarFile(tw, idHex+".json", config); err != nil {
		return err
	}
	m := tarball.Descriptor{Config: idHex + ".json", RepoTags: []string{t.Name + ":latest"}}
	written := map[string]bool{}
	for _, d := range t.Layers {
		hx, err := digestHex(d)
		if err != nil {
			return err
		}
		p := hx + "/layer.tar"
		m.Layers = append(m.Layers, p)
		if written[hx] {
			continue // an image may list a layer twice; the file is there once
		}
		written[hx] = true
		if err := s.exportLayer(ctx, tw, hx, p); err != nil {
			return fmt.Errorf("layer %s: %w", shortDigest(d), err)
		}
	}
	manifest, err := json.Marshal(tarball.Manifest{m})
	if err != nil {
		return err
	}
	if err := writeTarFile(tw, "manifest.json", manifest); err != nil {
		return err
	}
	return tw.Close()
}

// epoch is the time of the files Export makes itself, so that its output
// depends only on the template.
var epoch = time.Unix(0, 0)

func writeTarFile(tw *tar.Writer, name string, data []byte) error {
	hdr := &tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: epoch, Typeflag: tar.TypeReg}
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	_, err := tw.Write(data)
	return err
}

// exportLayer writes the layer's tar, rebuilt from its recipe, as the file
// p of tw, and checks it against the diff ID hx.
func (s *Store) exportLayer(ctx context.Context, tw *tar.Writer, hx, p string) error {
	info, err := s.readLayerInfo(hx)
	if err != nil {
		return err
	}
	recipe, err := os.Open(s.path(layersDir, hx+".tarmeta"))
	if err != nil {
		return fmt.Errorf("recipe: %w", err)
	}
	defer recipe.Close()
	root, err := os.OpenRoot(s.path(layersDir, hx))
	if err != nil {
		return err
	}
	defer root.Close()
	hdr := &tar.Header{Name: p, Mode: 0o644, Size: info.TarSize, ModTime: epoch, Typeflag: tar.TypeReg}
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	h := sha256.New()
	cw := &countWriter{w: io.MultiWriter(tw, h)}
	err = replayRecipe(recipe, cw, func(name string, size int64) (io.ReadCloser, error) {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		return openLayerFile(root, name, size)
	})
	if err != nil {
		return err
	}
	if cw.n != info.TarSize {
		return fmt.Errorf("rebuilt %d bytes, not %d: the layer changed since import", cw.n, info.TarSize)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != hx {
		return fmt.Errorf("the rebuilt layer does not match its diff ID (its sha256 is %s): the layer changed since import", got)
	}
	return nil
}

// openLayerFile opens a regular file of a layer for reading, never
// following a symlink, and checks it has the size the recipe says.
func openLayerFile(root *os.Root, name string, size int64) (io.ReadCloser, error) {
	if !fs.ValidPath(name) || name == "." {
		return nil, fmt.Errorf("recipe names %q", name)
	}
	dir, err := root.OpenFile(path.Dir(name), os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	fd, err := unix.Openat(int(dir.Fd()), path.Base(name), unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != size {
		unix.Close(fd)
		return nil, errors.New(name + " changed since import (a later entry of the layer replaced it, or it was modified)")
	}
	// O_NONBLOCK only kept a FIFO from blocking the open.
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return os.NewFile(uintptr(fd), name), nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
