package imgstore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// Builds add layers one at a time and write the template at the end. A
// layer a build has added or relies on is held (its directory flock'ed
// shared, as an import's) until the build releases it, so that a GC in
// between leaves it alone.

// Held is a set of layers a caller relies on.
type Held struct{ pins []*os.File }

// Release lets GC collect the layers again (those no template names).
func (h *Held) Release() {
	for _, p := range h.pins {
		p.Close()
	}
	h.pins = nil
}

// Hold holds the layers given by diff ID; each must be in the store.
func (s *Store) Hold(h *Held, diffIDs []string) error {
	for _, d := range diffIDs {
		hx, err := digestHex(d)
		if err != nil {
			return err
		}
		pin, _, ok, err := s.pinLayer(hx)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("layer %s is not in the store (removed meanwhile?)", shortDigest(d))
		}
		h.pins = append(h.pins, pin)
	}
	return nil
}

// AddLayer adds the layer in the uncompressed tar file at path (unpacked
// like an imported one, with the same checks) unless the store has it, and
// holds it in h. It returns the layer's diff ID.
func (s *Store) AddLayer(ctx context.Context, h *Held, path, label string, o Options) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	sum := sha256.New()
	_, err = io.Copy(sum, f)
	f.Close()
	if err != nil {
		return "", err
	}
	hx := hex.EncodeToString(sum.Sum(nil))
	open := func() (io.ReadCloser, error) { return os.Open(path) }
	pin, _, _, err := s.ensureLayer(ctx, hx, open, newBudget(o), label, o)
	if err != nil {
		return "", err
	}
	h.pins = append(h.pins, pin)
	return "sha256:" + hx, nil
}

// Compose writes the template name of layers (diff IDs, bottom first, all
// in the store) and cfg, with an image config of its own (so that Export
// works), replacing any template of that name.
func (s *Store) Compose(name string, layers []string, cfg Config, source string, o Options) (*Template, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	var h Held
	defer h.Release()
	if err := s.Hold(&h, layers); err != nil {
		return nil, err
	}
	var size int64
	counted := map[string]bool{}
	// No creation time in the config: the same layers and settings give
	// the same image ID, so a build served from its cache is the same
	// template.
	file := v1.ConfigFile{
		Architecture: platform.Architecture,
		OS:           platform.OS,
		Config: v1.Config{Env: cfg.Env, WorkingDir: cfg.WorkingDir, User: cfg.User, Entrypoint: cfg.Entrypoint,
			Cmd: cfg.Cmd, Labels: cfg.Labels},
		RootFS: v1.RootFS{Type: "layers"},
	}
	for _, d := range layers {
		hx, _ := digestHex(d)
		info, err := s.readLayerInfo(hx)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", shortDigest(d), err)
		}
		if !counted[hx] {
			counted[hx] = true
			size += info.Size
		}
		hash, err := v1.NewHash(d)
		if err != nil {
			return nil, err
		}
		file.RootFS.DiffIDs = append(file.RootFS.DiffIDs, hash)
	}
	config, err := json.Marshal(file)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(config)
	t := &Template{Name: name, ID: "sha256:" + hex.EncodeToString(sum[:]), Layers: append([]string(nil), layers...),
		Config: cfg, Size: size, Created: time.Now().UTC().Truncate(time.Second), Source: source}
	if err := s.commitTemplate(t, config, o); err != nil {
		return nil, err
	}
	return t, nil
}

// Ephemeral is a template of layers that is not written to the store (a
// build's state between steps): sandboxes can run from it while its
// layers are held.
func Ephemeral(name string, layers []string, cfg Config) *Template {
	sum := sha256.Sum256([]byte(name + "\x00" + strings.Join(layers, ",")))
	return &Template{Name: name, ID: "sha256:" + hex.EncodeToString(sum[:]), Layers: layers, Config: cfg}
}
