package imgstore

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// TestStoreOnlyItsOwners: a template store another host user owns, or
// sits in a directory of theirs, is refused: its owner could change the
// layers every sandbox of its templates runs, and put links where root
// unpacks and removes. (Open always made it 0700, but left its owner.)
func TestStoreOnlyItsOwners(t *testing.T) {
	testutil.RequireRoot(t)
	theirs := t.TempDir()
	if err := os.Chown(theirs, 1234, 1234); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(theirs); err == nil {
		t.Error("a template store of uid 1234's opened")
	}
	if _, err := Open(filepath.Join(theirs, "templates")); err == nil {
		t.Error("a template store in a directory of uid 1234's opened")
	}
	if _, err := Open(t.TempDir()); err != nil {
		t.Errorf("a template store of root's: %v", err)
	}
}
