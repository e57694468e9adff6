package oci

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/testutil"
)

// TestLayersInRuntimeNamespace: the runtime, started by runAt with
// mountLayers as its setup, finds each template directory's overlay on its
// mount point (the same files, inodes of its own, no host path in its
// mountinfo), and the host's mount namespace never holds them.
func TestLayersInRuntimeNamespace(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.MountAPI)
	tmp := t.TempDir()
	usr, etc := filepath.Join(tmp, "usr"), filepath.Join(tmp, "etc")
	for _, d := range []string{usr, etc} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "f"), []byte(filepath.Base(d)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	mounts := []inside.Mount{{Kind: inside.Dir, Source: usr, Dest: "/usr"},
		{Kind: inside.Symlink, Target: "usr/bin", Dest: "/bin"}, {Kind: inside.Dir, Source: etc, Dest: "/etc"}}
	dir := filepath.Join(tmp, layersDir)
	if err := makeLayerPoints(dir, mounts); err != nil {
		t.Fatal(err)
	}
	// What the runtime sees: the files, their devices, and its mountinfo.
	script := `cat "$1/0/f" "$1/2/f"; echo; stat -c %d "$1/0/f" "$1/2/f"; cat /proc/self/mountinfo`
	cmd := exec.Command("/bin/sh", "-c", script, "sh", dir)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := runAt(cmd, 0, func() error { return mountLayers(dir, mounts) }); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	lines := strings.Split(out.String(), "\n")
	if len(lines) < 3 || lines[0] != "usretc" {
		t.Fatalf("the runtime does not find the template's files on the mount points: %q", out.String())
	}
	var host syscall.Stat_t
	if err := syscall.Stat(filepath.Join(usr, "f"), &host); err != nil {
		t.Fatal(err)
	}
	hostDev := strconv.FormatUint(host.Dev, 10)
	view := lines[3:]
	for i, p := range []string{layerPath(dir, 0), layerPath(dir, 2)} {
		var fields []string
		for _, l := range view {
			if f := strings.Fields(l); len(f) > 4 && f[4] == p {
				fields = f
			}
		}
		if len(fields) < 3 {
			t.Fatalf("nothing mounted on %s in the runtime's namespace: %q", p, view)
		}
		if fields[len(fields)-3] != "overlay" {
			t.Skipf("SKIP: the kernel cannot take an overlay's layers by descriptor (Linux 6.13): %s is a bind: %q", p, fields)
		}
		// Layers by detached mount: no path of the host's in its options.
		if opts := fields[len(fields)-1]; strings.Contains(opts, tmp) {
			t.Errorf("the overlay on %s names its layers by host path: %s", p, opts)
		}
		if lines[1+i] == hostDev {
			t.Errorf("%s's files are on the host's device (%s): not an overlay of its own", p, hostDev)
		}
	}
	if strings.Contains(strings.Join(view, "\n"), filepath.Join(dir, "lower")) {
		t.Errorf("the empty layer's tmpfs is still mounted: %q", view)
	}
	// The host's namespace never held them.
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mi), dir) {
		t.Errorf("the host's mount namespace holds the layers: %s", mi)
	}
	if _, err := os.Stat(filepath.Join(dir, "lower")); !os.IsNotExist(err) {
		t.Errorf("the empty layer's mount point is left: %v", err)
	}
}
