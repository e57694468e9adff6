package build

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/cagehq/cage/internal/imgstore"
)

// DefaultMirror is where mmdebstrap fetches Debian from.
const DefaultMirror = "http://deb.debian.org/debian"

// ErrNoMmdebstrap: FROM debian:... needs mmdebstrap on the host.
var ErrNoMmdebstrap = errors.New("mmdebstrap is not installed (apt-get install mmdebstrap)")

// debian returns the template debian-bookworm (or -slim), making it from
// Debian's mirror with mmdebstrap the first time: minbase, and for -slim
// without documentation, manual pages and translations, as Docker's slim
// images are.
func (b *Builder) debian(ctx context.Context, slim bool) (*imgstore.Template, error) {
	name := "debian-bookworm"
	if slim {
		name += "-slim"
	}
	store := b.Host.Templates
	if t, err := store.Get(name); err == nil {
		return t, nil
	}
	if b.NoDebootstrap {
		return nil, failf("template %s is not in the store, and this build may not make it (it downloads Debian on the host): run cage template build on the host once with FROM debian:bookworm", name)
	}
	bin, err := exec.LookPath("mmdebstrap")
	if err != nil {
		return nil, ErrNoMmdebstrap
	}
	mirror := b.Mirror
	if mirror == "" {
		mirror = DefaultMirror
	}
	out, err := os.CreateTemp("", "cage-debian-*.tar")
	if err != nil {
		return nil, err
	}
	out.Close()
	defer os.Remove(out.Name())
	args := []string{"--variant=minbase", "--mode=root", "--format=tar", "--quiet", "--include=ca-certificates",
		"--aptopt=Acquire::Retries \"3\""}
	if slim {
		for _, p := range []string{"/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*"} {
			args = append(args, "--dpkgopt=path-exclude="+p)
		}
		args = append(args, "--dpkgopt=path-include=/usr/share/doc/*/copyright")
	}
	args = append(args, "bookworm", out.Name(), mirror)
	fmt.Fprintf(b.Out, "  making %s from %s with mmdebstrap (once; kept as template %s)\n", strings.TrimPrefix(name, "debian-"), mirror, name)
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = b.Out, b.Out
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("mmdebstrap bookworm: %v", err)
	}
	var held imgstore.Held
	defer held.Release()
	d, err := store.AddLayer(ctx, &held, out.Name(), "debian bookworm", imgstore.Options{})
	if err != nil {
		return nil, err
	}
	cfg := imgstore.Config{Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, Cmd: []string{"bash"}}
	return store.Compose(name, []string{d}, cfg, "mmdebstrap:bookworm "+mirror, imgstore.Options{})
}
