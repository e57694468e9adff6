package build

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/sandbox"
)

// Attack: a Dockerfile (a repository someone else wrote, built with cage
// template build; or an admin key's build through the API) names a
// variable in its own value, ENV A=$A$A, line after line: each line
// doubles it, and some forty lines ask the host for a terabyte, in the
// daemon's memory, before any step runs in a sandbox. Or it repeats a
// variable of 1 MiB under many names. Expected: the build fails with one
// line (ErrFailed) naming the bound once an instruction's expanded
// arguments pass 1 MiB, or the image's configuration and arguments grow
// past 1 MiB, and the host never holds much more.
func TestExpansionBounded(t *testing.T) {
	store, err := imgstore.Open(filepath.Join(t.TempDir(), "templates"))
	if err != nil {
		t.Fatal(err)
	}
	host := &sandbox.Host{Templates: store}
	doubling := "FROM scratch\nENV A=0123456789abcdef\n" + strings.Repeat("ENV A=$A$A\n", 18) // 4 MiB
	many := "FROM scratch\nARG A=0123456789abcdef\n" + strings.Repeat("ARG A=$A$A\n", 15) +   // 512 KiB
		"ENV B=$A\nENV C=$A\nLABEL d=$A\nENV E=$A\n"
	for _, c := range []struct{ name, dockerfile, want string }{
		{"doubling", doubling, "past 1024 KiB once their variables are expanded"},
		{"many", many, "configuration and build arguments past 1024 KiB more than its base's"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var out bytes.Buffer
			b := &Builder{Host: host, Out: &out}
			_, err := b.Build(context.Background(), strings.NewReader(c.dockerfile), "bomb", "test")
			if !errors.Is(err, ErrFailed) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("build: %v; want a failed step saying %q", err, c.want)
			}
			t.Logf("refused: %v", err)
		})
	}
	// A base image whose configuration is larger is still built from, and
	// its steps may add to it.
	stage := filepath.Join(t.TempDir(), "layer.tar")
	f, err := os.Create(stage)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	if err := tw.WriteHeader(&tar.Header{Name: "f", Typeflag: tar.TypeReg, Mode: 0o644}); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(tw.Close(), f.Close()); err != nil {
		t.Fatal(err)
	}
	var held imgstore.Held
	defer held.Release()
	d, err := store.AddLayer(context.Background(), &held, stage, "test", imgstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := imgstore.Config{Env: []string{"BIG=" + strings.Repeat("x", 2<<20)}}
	if _, err := store.Compose("big", []string{d}, cfg, "test", imgstore.Options{}); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if _, err := (&Builder{Host: host, Out: &out}).Build(context.Background(), strings.NewReader("FROM big\nENV X=1 Y=$X\n"), "on-big", "test"); err != nil {
		t.Errorf("a build from a base of 2 MiB of environment: %v; want it built", err)
	}
}
