package conformance

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
)

// testTemplate is the name the test image is imported as, once per run.
const testTemplate = "cage-test"

var importOnce sync.Once

// importTestImage puts the test image (testutil.TestImage) in the store of
// the suite's host.
func importTestImage(t testing.TB) *imgstore.Template {
	h := processHost(t)
	img := testutil.TestImage(t)
	var err error
	importOnce.Do(func() {
		path := testutil.WriteDockerArchive(t, img, "cage-test:latest")
		_, err = h.Templates.Import(context.Background(), path, testTemplate, imgstore.Options{})
	})
	if err != nil {
		t.Fatalf("import the test image: %v", err)
	}
	tm, err := h.Templates.Get(testTemplate)
	if err != nil {
		t.Fatal(err)
	}
	return tm
}

// TestImageTemplate: a sandbox of an image template sees the image's files
// with their owners (through the idmapping), the layers merged (whiteouts
// applied), a writable root whose writes stay its own, the disk limit, and
// setuid bits without effect.
func TestImageTemplate(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		importTestImage(t)
		b := w.newBox(t, sandbox.Options{Template: testTemplate, Disk: 16 << 20})
		checks := []struct {
			name, script, user, want string
		}{
			{"image's file", "cat /etc/os-release | head -1", "", "ID=cage-test"},
			{"second layer", "cat /usr/local/share/layer2", "", "second layer"},
			{"whiteout", "test -e /etc/doomed && echo present || echo gone", "", "gone"},
			{"root's files are root's", "stat -c '%u %g' /bin/busybox", "", "0 0"},
			{"user's files are user's", "stat -c '%u %g' /opt/data/owned1000", "", "1000 1000"},
			{"default user", "id -u; whoami", "", "1000\nuser"},
			{"home", "cd && pwd && touch x && ls", "", "/home/user\nx"},
			{"image env", "echo $CAGE_TEST_IMAGE", "", "1"},
			{"identity files", "cat /etc/hostname", "", "cage-"},
			{"user cannot write the image", "touch /usr/local/share/mine 2>&1; echo rc=$?", "", "rc=1"},
			{"root writes the image", "echo mine > /usr/local/share/mine && cat /usr/local/share/mine", "root", "mine"},
			{"setuid kept as a bit", "stat -c %a /usr/local/bin/suid/id", "", "4755"},
			// busybox drops a setuid gain itself, so running the copy proves
			// nothing; what makes setuid bits inert is no_new_privs.
			{"setuid gives nothing", "grep NoNewPrivs /proc/self/status", "", "NoNewPrivs:\t1"},
			{"disk limit", "dd if=/dev/zero of=/home/user/big bs=1M count=64 2>&1; echo rc=$?", "", "No space left"},
		}
		for _, c := range checks {
			var r result
			if c.user != "" {
				r = b.sh(c.script, asUser(c.user))
			} else {
				r = b.sh(c.script)
			}
			if r.err != nil || !strings.Contains(r.stdout, c.want) {
				t.Errorf("%s: %q: got stdout %q stderr %q err %v; want %q", c.name, c.script, r.stdout, r.stderr, r.err, c.want)
			}
		}
		// A second sandbox of the template does not see the first's writes.
		b2 := w.newBox(t, sandbox.Options{Template: testTemplate})
		if out := b2.sh("cat /usr/local/share/mine 2>&1; ls /home/user"); strings.Contains(out.stdout, "mine\n") || strings.Contains(out.stdout, "big") {
			t.Errorf("a second sandbox of the template sees the first's writes: %q", out.stdout)
		}
	})
}

// TestTemplateInUse: a template cannot be removed while a sandbox runs from
// it; once the sandbox is gone, it can, and its layers go with it.
func TestTemplateInUse(t *testing.T) {
	h := processHost(t)
	importTestImage(t)
	// A template of its own (the same image under another name shares its
	// layers), so that removing it leaves the suite's template alone.
	path := testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:inuse")
	tm, err := h.Templates.Import(context.Background(), path, "inuse", imgstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	sb, err := h.Create(context.Background(), sandbox.Options{Template: "inuse"})
	if err != nil {
		t.Fatal(err)
	}
	users := imgstore.InUse(tm)
	if len(users) != 1 {
		t.Errorf("InUse with one sandbox: %v", users)
	}
	err = h.Templates.Remove("inuse")
	if !errors.Is(err, imgstore.ErrInUse) || !strings.Contains(err.Error(), "inuse") {
		t.Errorf("Remove of a template in use: %v; want ErrInUse naming it", err)
	}
	if err := sb.Destroy(); err != nil {
		t.Fatal(err)
	}
	if users := imgstore.InUse(tm); len(users) != 0 {
		t.Errorf("after destroy, the template is still in use by %v", users)
	}
	if err := h.Templates.Remove("inuse"); err != nil {
		t.Fatalf("Remove after the sandbox is gone: %v", err)
	}
	// The suite's template shares every layer: none may be gone.
	shared, err := h.Templates.Get(testTemplate)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Templates.LayerDirs(shared); err != nil {
		t.Errorf("removing a template took a layer another uses: %v", err)
	}
	if _, err := os.Stat(filepath.Join(h.RunDir, "sandboxes", sb.ID())); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the sandbox's state directory is left: %v", err)
	}
}
