package store

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// OpenDBFile makes sure dataDir/name exists, 0600, and returns its
// absolute path, for a database kept in the data directory (the store, the
// records, the audit trail). The data directory must be this process's
// user's and writable by nobody else, and the file must be this user's: a
// host user who may write the directory could otherwise put a database of
// their own in place (an admin key they know, a journal replayed into
// root's database), or keep one of theirs that root then writes tokens
// and sandboxes' environments into. Found by review, 2026-12-03: with
// DATA left 0777 (made by hand or an installer under umask 000), a user
// swapped cage.db for one made with `cage keys create --admin`, and after
// a restart her admin key was root's daemon's.
func OpenDBFile(dataDir, name string) (string, error) {
	dir, err := filepath.Abs(dataDir)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	if err := CheckDataDir(dir); err != nil {
		return "", err
	}
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return "", err
	}
	if int(st.Uid) != os.Geteuid() || st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return "", fmt.Errorf("%s is not a file of uid %d's (owner uid %d): another user made it", path, os.Geteuid(), st.Uid)
	}
	if err := f.Chmod(0o600); err != nil {
		return "", err
	}
	return path, nil
}

// CheckDataDir says what is wrong with dir as a data directory: not this
// process's user's, or writable by its group or others; or a directory
// above it that another user could rename it out of (one not root's or
// this user's, or writable by others without the sticky bit, as /tmp has).
func CheckDataDir(dir string) error {
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return err
	}
	real, err = filepath.Abs(real)
	if err != nil {
		return err
	}
	fi, err := os.Stat(real)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return fmt.Errorf("data directory %s is not a directory", dir)
	case !ok || int(st.Uid) != os.Geteuid():
		return fmt.Errorf("data directory %s belongs to uid %d, not %d: its owner could replace the keys in it", dir, st.Uid, os.Geteuid())
	case fi.Mode().Perm()&0o022 != 0:
		return fmt.Errorf("data directory %s is writable by others (mode %04o): any of them could replace the keys in it; chmod 700 it", dir, fi.Mode().Perm())
	}
	for p := filepath.Dir(real); ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok || (st.Uid != 0 && int(st.Uid) != os.Geteuid()) {
			return fmt.Errorf("data directory %s is in %s, of uid %d's: its owner could put another in its place", dir, p, st.Uid)
		}
		if fi.Mode().Perm()&0o022 != 0 && fi.Mode()&os.ModeSticky == 0 {
			return fmt.Errorf("data directory %s is in %s, which others may write (mode %04o): any of them could put another in its place", dir, p, fi.Mode().Perm())
		}
		if p == "/" {
			return nil
		}
	}
}
