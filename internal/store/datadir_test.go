package store

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// TestDataDirOnlyItsOwners: the databases are opened only in a data
// directory of this user's that nobody else may write, and only when the
// file is this user's. Found by review, 2026-12-03: in a DATA left 0777,
// a host user swapped cage.db for one of her own holding an admin key she
// knew, and root's daemon took it after a restart.
func TestDataDirOnlyItsOwners(t *testing.T) {
	testutil.RequireRoot(t)
	open := func(dir string) error {
		st, err := Open(dir)
		if err == nil {
			st.Close()
		}
		return err
	}
	// Writable by others: refused, nothing made in it.
	loose := t.TempDir()
	if err := os.Chmod(loose, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := open(loose); err == nil || !strings.Contains(err.Error(), "writable by others") {
		t.Errorf("a data directory of mode 0777: %v, want refused", err)
	}
	if _, err := OpenRecords(loose); err == nil {
		t.Error("OpenRecords: a data directory of mode 0777 taken")
	}
	if ents, _ := os.ReadDir(loose); len(ents) != 0 {
		t.Errorf("made %v in it", ents)
	}
	// Another user's: refused.
	theirs := t.TempDir()
	if err := os.Chown(theirs, 1234, 1234); err != nil {
		t.Fatal(err)
	}
	if err := open(theirs); err == nil {
		t.Error("a data directory of uid 1234's taken")
	}
	// Root's, 0700, but the database was put there by another user (before
	// the directory was closed): refused.
	planted := t.TempDir()
	db := filepath.Join(planted, FileName)
	if err := os.WriteFile(db, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(db, 1234, 1234); err != nil {
		t.Fatal(err)
	}
	if err := open(planted); err == nil {
		t.Error("a cage.db of uid 1234's taken")
	}
	// A link in its place is not followed.
	linked := t.TempDir()
	target := filepath.Join(t.TempDir(), "elsewhere")
	if err := os.Symlink(target, filepath.Join(linked, FileName)); err != nil {
		t.Fatal(err)
	}
	if err := open(linked); err == nil {
		t.Error("a cage.db that is a link taken")
	}
	if _, err := os.Lstat(target); err == nil {
		t.Error("the link was followed: its target was made")
	}
	// Root's, 0700, but in a directory another user owns, or others may
	// write without the sticky bit: refused (they could rename it away).
	for _, mode := range []os.FileMode{0o755, 0o777} {
		parent := t.TempDir()
		if mode == 0o755 {
			if err := os.Chown(parent, 1234, 1234); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chmod(parent, mode); err != nil {
			t.Fatal(err)
		}
		inside := filepath.Join(parent, "data")
		if err := os.Mkdir(inside, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := open(inside); err == nil {
			t.Errorf("a data directory in a directory of mode %04o (owner uid 1234: %v) taken", mode, mode == 0o755)
		}
	}
	// In a sticky directory others may write (/tmp): taken.
	sticky := t.TempDir()
	if err := os.Chmod(sticky, os.ModeSticky|0o777); err != nil {
		t.Fatal(err)
	}
	if err := open(filepath.Join(sticky, "data")); err != nil {
		t.Errorf("a data directory in a sticky directory: %v", err)
	}
	// As it should be: taken.
	if err := open(t.TempDir()); err != nil {
		t.Errorf("a data directory of root's, 0700: %v", err)
	}
	// Group- or other-readable only is no danger: taken.
	readable := t.TempDir()
	if err := os.Chmod(readable, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := open(readable); err != nil {
		t.Errorf("a data directory of mode 0755: %v", err)
	}
}
