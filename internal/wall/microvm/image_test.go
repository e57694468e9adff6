package microvm

import (
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// TestTemplateImageConcurrent: creates that find no image of their
// template build it at once (a daemon's first creates after an import, or
// two processes sharing the cache). Each gets the same, whole image; no
// build reads or removes another's file, and no temporary file is left.
// Before, they shared one temporary name: mke2fs failed with bad inode
// checksums, or a build's chmod found its file removed by the next.
func TestTemplateImageConcurrent(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := exec.LookPath("mke2fs"); err != nil {
		t.Skip("no mke2fs")
	}
	tmpl := testTemplate(t)
	dir := t.TempDir()
	const n = 4
	paths := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			paths[i], errs[i] = TemplateImage(dir, tmpl)
		}()
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("build %d: %v", i, errs[i])
		}
		if paths[i] != paths[0] {
			t.Fatalf("build %d made %s, build 0 %s", i, paths[i], paths[0])
		}
	}
	if out, err := exec.Command("e2fsck", "-fn", paths[0]).CombinedOutput(); err != nil {
		t.Fatalf("the image is not whole: %v\n%s", err, out)
	}
	left, err := filepath.Glob(filepath.Join(filepath.Dir(paths[0]), ".image-*"))
	if err != nil || len(left) != 0 {
		t.Fatalf("temporary files left: %v %v", left, err)
	}
	if fi, err := os.Stat(paths[0]); err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("image %v %v, want mode 0644", fi, err)
	}
}
